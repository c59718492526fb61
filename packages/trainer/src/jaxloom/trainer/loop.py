"""The training loop: steps, and the callbacks that are due after them. Everything else is a component.

One step is always in flight: step n+1 is dispatched (its batch staged on the device meanwhile) before
step n's metrics are read, so the host's checks, logging and progress bar run while the device computes.
Callbacks need their own step's state; the loop settles it first.
"""

from __future__ import annotations

import logging
from pathlib import Path
from collections.abc import Callable
from typing import Any

import jax

from .batches import Batches
from .callbacks import Callbacks, RunView
from .monitor import StepLog
from .run_state import RunState
from .step import STOP_KEY
from .stopping import StopControl

log = logging.getLogger("jaxloom.trainer")


def run_loop(
    *,
    run: RunState,
    step: int,
    total: int,
    train_fn: Any,
    batches: Batches,
    callbacks: Callbacks,
    view: RunView,
    stop: StopControl,
    step_log: StepLog,
    data_metrics: Callable[..., dict[str, float]],
    profiler: Profiler,
) -> tuple[int, str]:
    """Train `run.state` from `step` to `total` (or a stop); returns `(step, stop reason)`. The loop owns `run`: it
    writes the state, the step being run and the newest step known to have run on the device."""
    loader = batches.train_loader()
    pending, reason = None, "max_training_steps reached"
    # the newest step known to have run: steps are dispatched ahead, so an error of step k (an out-of-memory on the
    # device) surfaces while step k + 1 is dispatched; the run's error names the step that failed, not the next
    run.completed = step

    def settle(step: int, metrics: dict) -> None:
        """The host's share of `step`, once the next step is dispatched: checks, log row, progress."""
        keys = ("finite", "loss", "grad_norm", STOP_KEY)
        done = jax.device_get({k: metrics[k] for k in keys if k in metrics})  # the step has run on the device
        run.completed = step
        stop.apply_training_hooks({**done, "step": step})
        step_log.step(step, metrics, extra=lambda: data_metrics(step=step), state=run.state)

    try:
        while step < total and not stop.reason:
            callbacks.step_start(view, step + 1)  # steps are numbered like checkpoints: updates after the step
            profiler.before(step + 1)
            try:
                local = next(loader)
            except StopIteration:
                reason = "training data exhausted"
                break
            run.state, metrics = train_fn(run.state, batches.global_batch(local, stop_code=stop.code))
            step = run.step = step + 1
            metrics = callbacks.step_end(view, step, metrics)
            profiler.after(step, metrics)
            if pending:
                settle(*pending)  # the previous step, now done on the device
            pending = (step, metrics)
            due = callbacks.due(step)
            if due:  # they need this step's state: settle it first
                settle(*pending)
                pending = None
                for cb in due:
                    cb.fn(view, step)  # type: ignore[misc]
        if pending:
            settle(*pending)
    except jax.errors.JaxRuntimeError:
        if pending:  # did the step in flight run? its error, if it failed, is the one being raised
            try:
                jax.block_until_ready(pending[1])
                run.completed = pending[0]
            except Exception:  # noqa: BLE001, S110 - it failed: completed_step stays before it
                pass
        raise
    finally:
        profiler.close()
    return step, stop.reason or reason


class Profiler:
    """A JAX profiler trace of steps `first..last` (`profile_steps`) into `directory`."""

    def __init__(self, steps, directory: Path):
        self.steps, self.directory, self.active = steps, directory, False

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0]:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, metrics) -> None:
        if self.active and step == self.steps[1]:
            jax.block_until_ready(metrics)
            self.close()
            log.warning(
                "profiler trace of steps %d-%d in %s (TensorBoard's profile plugin)", *self.steps, self.directory
            )

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
