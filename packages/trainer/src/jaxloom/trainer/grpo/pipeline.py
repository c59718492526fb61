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
import threading
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
    """A rollout drawn ahead: its index, the policy version that began it, what is drawn of it (a future: the last
    of its draws) and its scoring (a future, once it is whole)."""

    index: int
    version: int
    drawn: cf.Future
    scored: cf.Future | None = None
    scored_for: Any = None  # the drawn rollout `scored` scores


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
    the scores).

    Partial rollouts (`advance`): a rollout is drawn a part per version. `running(drawn)` says whether any of its
    completions still runs; `advance(index, get, finish)` continues `get()` (what is drawn of rollout `index`) with the
    weights now — a part, or with `finish` to the end — or returns a function that does, run on the drawing thread
    after its earlier parts. At `take(index)` the rollout of the next step finishes what still runs (under the last
    version before its step, so it is scored while this step trains) and every rollout after it draws one more part;
    a rollout begun `depth` steps ahead is drawn under `depth` versions (`depth >= 2` for any to span two). It is
    scored when whole. `versions(drawn)` gives each completion token's version (`[rows, tokens]`, -1 on padding):
    the metrics `sample/token_staleness_mean` and `sample/partial_ratio` (the share of completions drawn under more
    than one version)."""

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
        advance: Callable[[int, Callable[[], Any], bool], Any] | None = None,
        running: Callable[[Any], bool] = lambda drawn: False,
        versions: Callable[[Any], np.ndarray | None] = lambda drawn: None,
    ):
        self.draw, self.finish, self.version, self.save = draw, finish, version, save
        self.depth, self.max_staleness, self.last = depth, max_staleness, last
        self.advance, self.running, self.versions = advance, running, versions
        self.pending: dict[int, Pending] = {}
        self.dropped = 0
        self._lock = threading.Lock()
        self._threads: cf.ThreadPoolExecutor | None = None
        self._drawing: cf.ThreadPoolExecutor | None = None  # draws on the sampler's own devices, one at a time

    def _submit(self, index: int, version: int, drawn: Any) -> None:
        """Rollout `index` (begun by `version`): `drawn`, or a function (`draw` on the sampler's own devices) drawn on
        the one drawing thread (rollouts drawn in order); scored on a thread once whole."""
        if self._threads is None:
            self._threads = cf.ThreadPoolExecutor(max(self.depth, 1), thread_name_prefix="jaxloom-rollout")
        pending = Pending(index, version, done(None))
        self.pending[index] = pending
        self._chain(pending, drawn)

    def _chain(self, pending: Pending, drawn: Any) -> None:
        """`drawn` (a value, or a function for the drawing thread) as `pending`'s latest draw; scored when it is
        done and whole."""
        if callable(drawn):
            if self._drawing is None:
                self._drawing = cf.ThreadPoolExecutor(1, thread_name_prefix="jaxloom-draw")
            got = self._drawing.submit(drawn)
        else:
            got = done(drawn)
        pending.drawn = got
        got.add_done_callback(lambda f: self._drawn(pending, f))

    def _drawn(self, pending: Pending, got: cf.Future) -> None:
        """A draw of `pending` ended: scoring starts if it is its latest and the rollout is whole."""
        if got.cancelled() or got.exception() is not None or pending.drawn is not got:
            return
        if not self.running(got.result()):
            self._scoring(pending, got.result())

    def _scoring(self, pending: Pending, drawn: Any) -> cf.Future:
        """The scoring of `drawn` (rollout `pending` whole), started once."""
        with self._lock:
            if pending.scored is None or pending.scored_for is not drawn:
                if self._threads is None:  # closed: nothing more is scored
                    pending.scored = cf.Future()
                    pending.scored.cancel()
                else:
                    pending.scored = self._threads.submit(self.finish, drawn)
                pending.scored_for = drawn
            return pending.scored

    def _advance(self, pending: Pending, finish: bool, here: bool = False) -> None:
        """Partial rollouts: rollout `pending` draws its next part (`finish`: the rest) with the weights now; `here`:
        on this thread (its step waits for it), not the drawing thread."""
        got = pending.drawn
        if got.done() and (got.exception() is not None or not self.running(got.result())):
            return  # failed (its step says why) or whole
        assert self.advance is not None
        step = self.advance(pending.index, got.result, finish)
        if here and callable(step):
            step = step()
        self._chain(pending, step)

    def take(self, index: int) -> tuple[dict[str, np.ndarray], dict[str, float], np.ndarray | None]:
        """Rollout `index`'s scored rows (see the class), drawing what the steps ahead need first."""
        now = self.version()
        stale = self.pending.get(index)
        if stale is not None and now - stale.version > self.max_staleness:  # never trained on: dropped, counted
            del self.pending[index]
            for future in (stale.scored, stale.drawn):
                if future is not None:
                    future.cancel()
            self.dropped += 1
            log.warning(
                "rollout %d was drawn by policy version %d, %d versions ago (max_staleness = %d): dropped and drawn "
                "again with the current weights",
                index,
                stale.version,
                now - stale.version,
                self.max_staleness,
            )
        if self.advance is not None:  # partial rollouts: the next step's finishes, those after draw a part each
            for ahead in sorted(self.pending.values(), key=lambda p: p.index):
                own = ahead.index == index  # still running (its first step, a restore): its last part, here
                if own:
                    ahead.drawn.exception()  # its earlier parts drawn (a failure is raised below)
                self._advance(ahead, ahead.index <= index + 1, here=own)
        for i in range(index, index + self.depth + 1):
            if i not in self.pending and (i == index or self.last is None or i < self.last):
                self._submit(i, now, self.draw(i))
                if self.advance is not None and i <= index + 1:  # its step, or the next: whole now
                    self._advance(self.pending[i], True, here=i == index)
        taken = self.pending.pop(index)
        waited = time.perf_counter()
        drawn = taken.drawn.result()
        rows, metrics, sampled = self._scoring(taken, drawn).result()
        staleness = float(now - taken.version)
        metrics = {
            **metrics,
            "sample/staleness_mean": staleness,
            "sample/staleness_max": staleness,
            "sample/dropped_stale_total": float(self.dropped),
            "perf/rollout_wait_s": time.perf_counter() - waited,
            **token_staleness(self.versions(drawn), now),
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


def token_staleness(versions: np.ndarray | None, now: int) -> dict[str, float]:
    """Partial rollouts' metrics from each completion token's policy version (`versions`, -1 on padding; None: a
    rollout drawn whole): `sample/token_staleness_mean` (versions behind `now`, over the tokens) and
    `sample/partial_ratio` (the share of completions drawn under more than one version)."""
    if versions is None:
        return {}
    on = versions >= 0
    newest, oldest = np.where(on, versions, -1).max(axis=1), np.where(on, versions, np.iinfo(np.int32).max).min(axis=1)
    return {
        "sample/token_staleness_mean": float(np.mean(now - versions[on])) if on.any() else 0.0,
        "sample/partial_ratio": float(np.mean(on.any(axis=1) & (newest != oldest))),
    }


def completions_of(drawn: Any) -> dict[str, np.ndarray | None]:
    """A drawn rollout's completions (`Drawn`; an MoE sampler's experts per token too): what a checkpoint keeps of
    it."""
    return {
        "completion": drawn.completion,
        "completion_mask": drawn.completion_mask,
        "sampled": drawn.sampled,
        "keep": drawn.keep,
        "routes": getattr(drawn, "routes", None),
        "versions": getattr(drawn, "versions", None),
    }
