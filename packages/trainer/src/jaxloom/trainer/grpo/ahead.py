"""How a GRPO run's rollouts are drawn (`RolloutDraws`): rollout `index` from its prompts, seeded by the training
state's key folded with `index`, by the policy's weights now — and, asynchronous (`max_staleness >= 1`), drawn ahead
through a `Pipeline`: on the sampler's own devices (`sampling_devices`, the weights copied once per version), a part
per version (partial rollouts), each rollout in flight with environment instances of its own, and what a checkpoint
keeps of a drawn rollout and how a resumed run rebuilds it. Built from the collaborators it names."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .drawing import Drawer, Drawn
from .environments import replay_calls
from .pipeline import Pipeline, completions_of, depth_of, pack, unpack
from .sampler import Sampler

log = logging.getLogger("jaxloom.trainer")


class RolloutDraws:
    """The rollouts of a run as drawn: by `drawer` (its `sampler`) from `prompts(index) -> (records, token ids,
    where)`, with the `policy`'s state (weights, key) and version (`policy.step()`), as the sampling settings `rl`
    say, a step being `rows` completions and `last()` the run's last rollout; `made`: the pipeline, once made."""

    def __init__(
        self,
        rl: Any,
        rows: int,
        drawer: Drawer,
        sampler: Sampler,
        policy: Any,
        prompts: Callable[[int], tuple[list[dict], list[np.ndarray], list[str]]],
        *,
        last: Callable[[], int],
    ):
        self.rl, self.rows, self.drawer, self.sampler, self.policy = rl, rows, drawer, sampler, policy
        self.prompts, self.last = prompts, last
        self.made: Pipeline | None = None  # the asynchronous rollouts (max_staleness >= 1), made when first asked
        self._copied: tuple[int, Any] | None = None  # (version, the weights on the sampler's devices)

    def draw(self, index: int, *, later: bool = False) -> Drawn | Callable[[], Drawn]:
        """Rollout `index` drawn by the current weights, seeded by the state's key folded with `index`; `later`: the
        weights copied to the sampler's own devices now (`sampling_devices`), the drawing returned as a function
        to run on another thread while the step trains."""
        records, encoded, where = self.prompts(index)
        key = jax.random.fold_in(self.policy.state().rng, index)
        budget = getattr(self.rl, "partial_rollout_tokens", 0) or None  # partial rollouts: a part per version
        part = dict(budget=budget, version=self.policy.step(), slot=self.slot(index))
        if not later:
            return self.drawer.draw(records, encoded, key, where, **part)
        model = self.weights()
        return lambda: self.drawer.draw(records, encoded, key, where, model=model, **part)

    def slot(self, index: int) -> int | None:
        """The pool of environment instances rollout `index` takes: with `max_staleness >= 1` one of `depth + 1`
        (the rollouts in flight at once: the one trained and those drawn ahead), None when synchronous."""
        depth = depth_of(self.rl, self.rows)
        return index % (depth + 1) if depth else None

    def advance(
        self, index: int, get: Callable[[], Drawn], finish: bool, *, later: bool = False
    ) -> Drawn | Callable[[], Drawn]:
        """Partial rollouts: rollout `index`'s running completions (`get()`: what is drawn of it) continued by the
        current weights (`Drawer.extend`: a part, or with `finish` the rest), seeded by the rollout's key folded with
        the version; `later` as `draw`'s."""
        version = self.policy.step()
        key = jax.random.fold_in(jax.random.fold_in(self.policy.state().rng, index), 1 + version)
        if not later:
            return self.drawer.extend(get(), key, version, finish=finish)
        model = self.weights()
        return lambda: self.drawer.extend(get(), key, version, finish=finish, model=model)

    def weights(self) -> Any:
        """The current weights on the sampler's own devices (`sampling_devices`), copied once per policy version."""
        version = self.policy.step()
        if self._copied is None or self._copied[0] != version:
            self._copied = (version, self.sampler.weights())
        return self._copied[1]

    def save(self, drawn: Drawn) -> dict[str, Any]:
        """What a checkpoint keeps of a drawn rollout (JSON-safe): its completions (`pack`ed arrays: tokens, mask,
        the sampler's log-probs, the model's own tokens, an MoE sampler's experts), with tools its exchange as
        messages, and a `rollout_func`'s prompt tokens and fields (checked JSON-safe when drawn)."""
        saved: dict[str, Any] = {"arrays": pack(completions_of(drawn))}
        if drawn.turns is not None:
            saved["turns"] = drawn.turns.saved()
        if drawn.fields is not None:
            saved["custom"] = {"prompt_ids": [[int(t) for t in ids] for ids in drawn.row_ids], "fields": drawn.fields}
        return saved

    def redraw(self, index: int, saved: dict[str, Any]) -> Drawn:
        """Rollout `index` as a checkpoint saved it drawn (`save`; see `pipeline.Pipeline.state`)."""
        records, encoded, where = self.prompts(index)
        drawn = self.drawer.prompt_rows(records, encoded, where)
        tools, row_tools = self.drawer.environment_rows(drawn, records, self.slot(index))  # instances reset again
        custom = saved.get("custom")
        if custom is not None:  # a rollout_func's rows: its own prompt tokens and fields
            drawn.row_ids = [np.asarray(ids, np.int32) for ids in custom["prompt_ids"]]
            self.drawer.lay_prompts(drawn, drawn.row_ids, 0)
            drawn.columns.update(custom["fields"])
            drawn.fields = custom["fields"]
        else:
            self.drawer.cut_prompts(drawn)
        c = unpack(saved["arrays"])
        drawn.completed(
            c["completion"], c["completion_mask"], c.get("sampled"), c.get("keep"), c.get("routes"), c.get("versions")
        )
        if saved.get("turns") is not None:
            from .tools import Exchange

            drawn.turns = Exchange.restored(saved["turns"])
            if row_tools is not None:  # the environments' state: the calls the rows made, made again in order
                differ = replay_calls(tools, row_tools, drawn.turns.made, drawn.where)
                if differ:
                    log.warning(
                        "resumed: %d tool calls of rollout %d made again on its environments returned other text "
                        "than when it was drawn (an environment that is not deterministic: the resumed rewards may "
                        "differ from an uninterrupted run's); first: %s",
                        len(differ),
                        index,
                        differ[0],
                    )
        return drawn

    def pipeline(self, resume_state: dict[str, Any] | None = None) -> Pipeline | None:
        """The asynchronous rollouts (`max_staleness >= 1`), made when first asked (from the drawn rollouts saved
        in `resume_state`, a resumed run's data position); None when synchronous."""
        if self.made is None:
            depth = depth_of(self.rl, self.rows)
            if not depth:
                return None
            apart = bool(getattr(self.rl, "sampling_devices", 0))  # drawn on the sampler's own devices, on a thread
            partial: dict[str, Any] = {}
            if getattr(self.rl, "partial_rollout_tokens", 0):  # drawn ahead, continued under each new version
                partial = dict(
                    advance=functools.partial(self.advance, later=apart),
                    running=lambda drawn: bool(self.drawer.running(drawn).any()),
                    versions=lambda drawn: drawn.versions,
                )
            self.made = Pipeline(
                functools.partial(self.draw, later=apart),
                self.drawer.finish,
                self.policy.step,
                save=self.save,
                depth=depth,
                max_staleness=self.rl.max_staleness,
                last=self.last(),
                **partial,
            )
            saved = (resume_state or {}).get("pipeline")
            if saved:
                self.made.restore(saved, self.redraw)
        return self.made

    def close(self) -> None:
        """The pipeline stopped (its threads end when their call returns)."""
        if self.made is not None:
            self.made.close()
