"""The training loop: steps, and the callbacks that are due after them. Everything else is a component.

One step is always in flight: step n+1 is dispatched (its batch staged on the device meanwhile) before
step n's metrics are read, so the host's checks, logging and progress bar run while the device computes.
Callbacks need their own step's state; the loop settles it first.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax

from .callbacks import Callbacks
from .step import STOP_KEY

log = logging.getLogger("jaxloom.trainer")


def run_loop(trainer: Any, step: int, callbacks: Callbacks, train_fn: Any) -> tuple[int, str]:
    """Train `trainer.state` from `step` to the plan's last step (or a stop); returns `(step, stop reason)`."""
    stop, data, total, run = trainer.stop_control, trainer.batches, trainer.plan.total_steps, trainer.run_view
    loader = data.train_loader()
    profiler = Profiler(trainer.arguments.profile_steps, trainer.run_directory.local / "profile")
    pending, reason = None, "max_training_steps reached"
    # the newest step known to have run: steps are dispatched ahead, so an error of step k (an out-of-memory on the
    # device) surfaces while step k + 1 is dispatched; the run's error names the step that failed, not the next
    trainer.completed_step = step

    def settle(step: int, metrics: dict) -> None:
        """The host's share of `step`, once the next step is dispatched: checks, log row, progress."""
        keys = ("finite", "loss", "grad_norm", STOP_KEY)
        done = jax.device_get({k: metrics[k] for k in keys if k in metrics})  # the step has run on the device
        trainer.completed_step = step
        trainer.apply_training_hooks({**done, "step": step})
        trainer.step_log.step(step, metrics, extra=lambda: trainer.data_metrics(step=step), state=trainer.state)

    try:
        while step < total and not stop.reason:
            callbacks.step_start(run, step + 1)  # steps are numbered like checkpoints: updates after the step
            profiler.before(step + 1)
            try:
                local = next(loader)
            except StopIteration:
                reason = "training data exhausted"
                break
            trainer.state, metrics = train_fn(trainer.state, data.global_batch(local, stop_code=stop.code))
            step = trainer.current_step = step + 1
            metrics = callbacks.step_end(run, step, metrics)
            profiler.after(step, metrics)
            if pending:
                settle(*pending)  # the previous step, now done on the device
            pending = (step, metrics)
            due = callbacks.due(step)
            if due:  # they need this step's state: settle it first
                settle(*pending)
                pending = None
                for cb in due:
                    cb.fn(run, step)  # type: ignore[misc]
        if pending:
            settle(*pending)
    except jax.errors.JaxRuntimeError:
        if pending:  # did the step in flight run? its error, if it failed, is the one being raised
            try:
                jax.block_until_ready(pending[1])
                trainer.completed_step = pending[0]
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
