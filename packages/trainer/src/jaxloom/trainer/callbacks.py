"""The one mechanism for work around the steps: a `Callback` has events and, optionally, a cadence.

- `fn(run, step)` runs after `step` when it is due: every `every` steps and/or whenever `when(step)` is
  true. Checkpoints, evaluation and previews are such callbacks; so is a user's `add_callback(fn, every=N)`.
- `on_step_start(run, step)`, `on_step_end(run, step, metrics)`, `on_save(run, step)` are events
  that every callback may handle. `hooks=[obj]` objects (with any of these methods) are adapted
  onto it with `Callback.of(obj)`, and so are the trainer's overridable `on_step_start(state, step)` /
  `on_step_end(state, metrics, step)` (`trainer_hooks`), which the reference documents.

`run` is a `RunView`: what a callback may see and change of the run (its state, arguments, checkpoints, the rows
logged so far, a stop request), never the trainer. `Callbacks` holds them in order and fires the events; the loop
only asks it what is due.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any


class RunView:
    """What a callback sees of the run, and all it may change: the state being trained (`state`, which it may
    replace, as a fault injector or a hook that edits parameters does), the `arguments`, the checkpoint manager
    (`checkpoints`, None without a save directory), the metric rows logged so far (`history`), whether the run
    evaluates (`evaluates`), whether this is process 0 (`is_process_zero`) and `request_stop(reason)` (the run
    stops after the current step, saving it). Built once per trainer by the composition root from the
    components; the names are the trainer's own, so a hook written as `on_step_start(trainer, step)` that reads
    `trainer.state` keeps working."""

    def __init__(
        self,
        *,
        arguments: Callable[[], Any],
        state: tuple[Callable[[], Any], Callable[[Any], None]],
        checkpoints: Callable[[], Any],
        history: Callable[[], list[dict[str, Any]]],
        evaluates: bool,
        is_process_zero: bool,
        request_stop: Callable[[str], None],
    ):
        self._arguments, (self._get_state, self._set_state) = arguments, state
        self._checkpoints, self._history, self._request_stop = checkpoints, history, request_stop
        self.evaluates, self.is_process_zero = evaluates, is_process_zero

    @property
    def state(self) -> Any:
        """The `TrainState` being trained, as of the step the callback runs for."""
        return self._get_state()

    @state.setter
    def state(self, value: Any) -> None:
        self._set_state(value)

    @property
    def arguments(self) -> Any:
        """The run's `TrainingArguments` (with `save_directory` filled in once the run has chosen one)."""
        return self._arguments()

    @property
    def checkpoints(self) -> Any:
        """The run's `CheckpointManager` (None when the run saves nothing)."""
        return self._checkpoints()

    @property
    def history(self) -> list[dict[str, Any]]:
        """The metric rows logged so far (`metrics.jsonl`'s rows on process 0; empty elsewhere)."""
        return self._history()

    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop the run after the current step (it is saved, as on a stop signal)."""
        self._request_stop(reason)


@dataclasses.dataclass
class Callback:
    """`fn(run, step)` run after `step` when it is due: every `every` steps, and/or whenever
    `when(step)` is true (asked exactly once per step, so `when` may be a collective such as a
    time-based checkpoint decision). Callbacks see the state of their own step: the loop settles it
    before the first due callback runs. They run in the order they were added; the trainer adds the
    checkpoint first, so a step is saved before anything that can fail runs on it. `name` labels it
    in errors and listings. `run` is the run's `RunView`.

    Events, each optional: `on_step_start(run, step)` before a step is dispatched;
    `on_step_end(run, step, metrics)` after it is dispatched (its on-device `metrics`; a returned
    dict replaces them); `on_save(run, step)` after checkpoint `step` is written (or handed to the
    async writer). A callback with events only needs no cadence."""

    fn: Callable[[RunView, int], Any] | None = None
    every: int | None = None
    when: Callable[[int], bool] | None = None
    name: str = ""
    on_step_start: Callable[[RunView, int], Any] | None = None
    on_step_end: Callable[[RunView, int, dict], Any] | None = None
    on_save: Callable[[RunView, int], Any] | None = None

    def __post_init__(self) -> None:
        label = self.name or self.fn
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every <= 0
        ):
            raise ValueError(f"callback {label!r}: every={self.every!r}; expected a positive integer")
        events = (self.on_step_start, self.on_step_end, self.on_save)
        if self.fn is not None and self.every is None and self.when is None:
            raise ValueError(f"callback {label!r}: give every=N steps and/or when=fn(step)")
        if self.fn is None and (self.every is not None or self.when is not None):
            raise ValueError(f"callback {label!r}: a cadence (every/when) needs fn(run, step) to run")
        if self.fn is None and not any(e is not None for e in events):
            raise ValueError(f"callback {label!r}: give fn with every=N or when=fn(step), or an event handler")

    def due(self, step: int) -> bool:
        """Whether `fn` runs after `step` (`when` is asked even if `every` already says yes)."""
        if self.fn is None:
            return False
        by_time = bool(self.when(step)) if self.when is not None else False
        return bool(self.every and step % self.every == 0) or by_time

    @classmethod
    def of(cls, hook: Any) -> Callback:
        """A `Callback` from a hook object: its `on_step_start(run, step)`, `on_step_end(run, step, metrics)`
        and `on_save(run, step)`, whichever it has (a `Callback` is returned as it is)."""
        if isinstance(hook, Callback):
            return hook
        events = {e: getattr(hook, e, None) for e in ("on_step_start", "on_step_end", "on_save")}
        events = {e: f for e, f in events.items() if callable(f)}
        if not events:
            raise TypeError(
                f"hook {hook!r} has none of on_step_start(run, step), on_step_end(run, step, metrics), "
                "on_save(run, step); expected at least one"
            )
        return cls(name=type(hook).__name__, **events)


def trainer_hooks(on_step_start: Callable[[Any, int], Any], on_step_end: Callable[[Any, dict, int], Any]) -> Callback:
    """A trainer's own overridable `on_step_start(state, step) -> state` and
    `on_step_end(state, metrics, step) -> (state, metrics)` (EasyDeL's names and signatures) as a callback."""

    def start(run: RunView, step: int) -> None:
        run.state = on_step_start(run.state, step)

    def end(run: RunView, step: int, metrics: dict) -> dict:
        run.state, metrics = on_step_end(run.state, metrics, step)
        return metrics

    return Callback(name="trainer", on_step_start=start, on_step_end=end)


class Callbacks:
    """`callbacks` in the order they run, and their events fired on each."""

    def __init__(self, callbacks: Iterable[Callback] = ()):
        self.items: list[Callback] = list(callbacks)

    def step_start(self, run: RunView, step: int) -> None:
        """`on_step_start(run, step)` of each callback that has one."""
        for cb in self.items:
            if cb.on_step_start is not None:
                cb.on_step_start(run, step)

    def step_end(self, run: RunView, step: int, metrics: dict) -> dict:
        """`on_step_end(run, step, metrics)` of each callback; a returned dict replaces `metrics`."""
        for cb in self.items:
            if cb.on_step_end is not None:
                out = cb.on_step_end(run, step, metrics)
                metrics = out if isinstance(out, dict) else metrics
        return metrics

    def saved(self, run: RunView, step: int) -> None:
        """`on_save(run, step)` of each callback: checkpoint `step` was written (or handed over)."""
        for cb in self.items:
            if cb.on_save is not None:
                cb.on_save(run, step)

    def due(self, step: int) -> list[Callback]:
        """The callbacks whose `fn` runs after `step`, in order."""
        return [cb for cb in self.items if cb.due(step)]
