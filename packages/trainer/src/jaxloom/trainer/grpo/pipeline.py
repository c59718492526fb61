"""Asynchronous rollouts (`max_staleness >= 1`, TRL's `AsyncGRPOConfig` names): the next steps' rollouts are drawn
ahead with the weights of their time, each tagged with that policy version, and scored on threads while the device
trains; a step takes its rollout when the scores are in, dropping (and counting) one older than `max_staleness`
versions. What is drawn and not yet trained is saved with each checkpoint (`state`), so a resumed run trains what
the uninterrupted one did, bit for bit. Built from callables: testable without a trainer."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import dataclasses
import io
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger("jaxloom.trainer")


def depth_of(rl: Any, rows: int) -> int:
    """How many steps ahead rollouts are drawn: `max_staleness`, bounded by the completions `queue_maxsize` may
    hold drawn and untrained and the `max_inflight_tasks` drawn and unscored (`-1`: `max_staleness × rows`), a
    step being `rows` completions. 0: synchronous."""
    k = getattr(rl, "max_staleness", 0)
    if not k:
        return 0
    inflight = rl.max_inflight_tasks if rl.max_inflight_tasks != -1 else k * rows
    return min(k, rl.queue_maxsize // rows, inflight // rows)


def pack(arrays: dict[str, np.ndarray | None]) -> str:
    """Host arrays as one text (an `.npz` in base64): exact, compact, JSON-safe (a checkpoint's data position)."""
    buffer = io.BytesIO()
    kept: dict[str, Any] = {k: v for k, v in arrays.items() if v is not None}
    np.savez(buffer, **kept)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def unpack(text: str) -> dict[str, np.ndarray]:
    """The arrays `pack` wrote."""
    with np.load(io.BytesIO(base64.b64decode(text))) as z:
        return {k: z[k] for k in z.files}


@dataclasses.dataclass
class Pending:
    """A rollout drawn ahead: its index, the policy version that drew it, what was drawn (when it is) and its
    scoring."""

    index: int
    version: int
    drawn: cf.Future
    scored: cf.Future


def done(value: Any) -> cf.Future:
    """A future that holds `value`."""
    future: cf.Future = cf.Future()
    future.set_result(value)
    return future


class Pipeline:
    """The rollouts drawn ahead of the steps that train them. `draw(index)` draws rollout `index` with the current
    weights (on the caller's thread: it holds the device, in step with training) — or returns a function that does,
    run on a drawing thread (the sampler on devices of its own); `finish(drawn)` scores it and
    lays out its host rows (`(rows, metrics, sampler log-probs)`, on one of `depth` threads); `version()` is the
    policy's version now (optimizer steps taken); `save(drawn)` what a checkpoint keeps of a drawn rollout (JSON-safe;
    default its completions, `pack`ed). `take(index)` keeps rollouts `index .. index + depth` drawn
    (none past `last`) and returns rollout `index`'s rows with its staleness metrics (TRL's: `sample/staleness_mean`,
    `sample/staleness_max`, `sample/dropped_stale_total`, `perf/rollout_wait_s`: the seconds the step waited for
    the scores)."""

    def __init__(
        self,
        draw: Callable[[int], Any],
        finish: Callable[[Any], tuple],
        version: Callable[[], int],
        *,
        save: Callable[[Any], dict[str, Any]] = lambda drawn: {"arrays": pack(completions_of(drawn))},
        depth: int,
        max_staleness: int,
        last: int | None = None,
    ):
        self.draw, self.finish, self.version, self.save = draw, finish, version, save
        self.depth, self.max_staleness, self.last = depth, max_staleness, last
        self.pending: dict[int, Pending] = {}
        self.dropped = 0
        self._threads: cf.ThreadPoolExecutor | None = None
        self._drawing: cf.ThreadPoolExecutor | None = None  # draws on the sampler's own devices, one at a time

    def _submit(self, index: int, version: int, drawn: Any) -> None:
        """Score `drawn` on a thread; a function (`draw` on the sampler's own devices) is drawn first, on the one
        drawing thread (rollouts drawn in order), then scored."""
        if self._threads is None:
            self._threads = cf.ThreadPoolExecutor(max(self.depth, 1), thread_name_prefix="jaxloom-rollout")
        if callable(drawn):
            if self._drawing is None:
                self._drawing = cf.ThreadPoolExecutor(1, thread_name_prefix="jaxloom-draw")
            got = self._drawing.submit(drawn)
            scored = self._threads.submit(lambda: self.finish(got.result()))
        else:
            got, scored = done(drawn), self._threads.submit(self.finish, drawn)
        self.pending[index] = Pending(index, version, got, scored)

    def take(self, index: int) -> tuple[dict[str, np.ndarray], dict[str, float], np.ndarray | None]:
        """Rollout `index`'s scored rows (see the class), drawing what the steps ahead need first."""
        now = self.version()
        stale = self.pending.get(index)
        if stale is not None and now - stale.version > self.max_staleness:  # never trained on: dropped, counted
            del self.pending[index]
            stale.scored.cancel()
            stale.drawn.cancel()
            self.dropped += 1
            log.warning(
                "rollout %d was drawn by policy version %d, %d versions ago (max_staleness = %d): dropped and drawn "
                "again with the current weights",
                index,
                stale.version,
                now - stale.version,
                self.max_staleness,
            )
        for i in range(index, index + self.depth + 1):
            if i not in self.pending and (i == index or self.last is None or i < self.last):
                self._submit(i, now, self.draw(i))
        taken = self.pending.pop(index)
        waited = time.perf_counter()
        rows, metrics, sampled = taken.scored.result()
        staleness = float(now - taken.version)
        metrics = {
            **metrics,
            "sample/staleness_mean": staleness,
            "sample/staleness_max": staleness,
            "sample/dropped_stale_total": float(self.dropped),
            "perf/rollout_wait_s": time.perf_counter() - waited,
        }
        return rows, metrics, sampled

    def state(self) -> dict[str, Any]:
        """What is drawn and not yet trained (each rollout's index, version and completions) and the drops so far:
        saved with a checkpoint (JSON-safe). The scores are not: a resumed run scores them again."""
        return {
            "dropped": self.dropped,
            "drawn": [
                {"index": p.index, "version": p.version, **self.save(p.drawn.result())}
                for p in sorted(self.pending.values(), key=lambda p: p.index)
                if p.drawn.exception() is None  # a draw that failed is not saved: the step's checkpoint still is
            ],
        }

    def restore(self, state: dict[str, Any], redraw: Callable[[int, dict[str, Any]], Any]) -> None:
        """Continue from `state` (`state()` of a checkpoint): each saved rollout rebuilt by `redraw(index, saved)`
        (`saved`: what `save` wrote of it) and scored again, under the version that drew it."""
        self.dropped = int(state.get("dropped", 0))
        for saved in state.get("drawn", []):
            index = int(saved["index"])
            self._submit(index, int(saved["version"]), redraw(index, saved))

    def close(self) -> None:
        """Stop: scoring not yet started is cancelled; the threads end when their call returns."""
        for pool in (self._drawing, self._threads):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._threads = self._drawing = None
        self.pending.clear()


def completions_of(drawn: Any) -> dict[str, np.ndarray | None]:
    """A drawn rollout's completions (`Drawn`; an MoE sampler's experts per token too): what a checkpoint keeps of
    it."""
    return {
        "completion": drawn.completion,
        "completion_mask": drawn.completion_mask,
        "sampled": drawn.sampled,
        "keep": drawn.keep,
        "routes": getattr(drawn, "routes", None),
    }
