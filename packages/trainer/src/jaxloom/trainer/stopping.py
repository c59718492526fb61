"""When training stops early, agreed by every process: a signal, the wall-clock limit, a request from
code, or a non-finite loss. Built from the arguments' `nan_policy` and `training_time_limit`.

    stop = StopControl(nan_policy="stop", time_limit=3600.0)
    restore = stop.install_signal_handlers()
    stop.apply_training_hooks({"step": 3, "finite": True, "loss": 2.1, "grad_norm": 0.4})
    stop.reason      # None while training goes on
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from .step import STOP_KEY

log = logging.getLogger("jaxloom.trainer")

# Why a process asks to stop; with several processes the largest code of any process wins (see request).
STOP_SIGNAL, STOP_TIME_LIMIT, STOP_REQUESTED = 1, 2, 3


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN or infinite loss or gradient (with `nan_policy="stop"`)."""


class StopControl:
    """This process's stop request (`code`, sent with each batch so that all processes stop after the same
    step), the agreed `reason` once a step's metrics carry one, the `signal` received, and the count of
    `skipped` non-finite updates (`nan_policy="skip"`)."""

    def __init__(self, nan_policy: str = "stop", time_limit: float | None = None, where: str = ""):
        self.nan_policy, self.time_limit, self.where = nan_policy, time_limit, where
        self.start()

    def start(self) -> None:
        """A new training segment: no request, the clock of `time_limit` from now."""
        self.t0 = time.monotonic()
        self.code, self.note, self.reason = 0, "", None
        self.agreed = 0  # the stop code every process agreed on (the same on all), once training stops
        self.signal: int | None = None
        self.skipped = 0

    @property
    def by_signal(self) -> bool:
        """Whether training stopped on a signal (Ctrl-C, SIGTERM, SIGHUP) on any process: then the way out is
        short — save, plot, report; no final evaluation or preview."""
        return self.agreed == STOP_SIGNAL

    def request_stop(self, reason: str = "stop requested") -> None:
        """Ask training to stop: the step in flight finishes, a checkpoint is saved and `train()` returns
        with `reason` as its `stop_reason`. With several processes, a request made by any one of them
        (here, in a hook or from another thread) stops all of them after the same step: the request
        travels inside the next step's batch and comes back in its metrics. Later requests change nothing."""
        if not self.code:
            self.code, self.note = STOP_REQUESTED, reason

    def apply_training_hooks(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The built-in checks on a finished step's host `metrics` (with its `step`): a non-finite loss
        raises `NonFiniteLossError` naming the step (`nan_policy="stop"`) or counts a skipped update; the
        wall-clock limit and a stop signal or request end training after this step. Returns the metrics."""
        step = metrics["step"]
        if not bool(metrics["finite"]):
            if self.nan_policy == "stop":
                raise NonFiniteLossError(
                    f"loss is {float(metrics['loss'])} (grad norm {float(metrics['grad_norm'])}) at step {step}; "
                    f"stopping. The last checkpoint{self.where} is untouched."
                )
            self.skipped += 1
            log.warning("non-finite loss at step %d: update skipped (%d so far)", step, self.skipped)
        limit = self.time_limit
        if limit and not self.code and time.monotonic() - self.t0 >= limit:
            self.code = STOP_TIME_LIMIT  # each process's own clock: agreed through the batch
        agreed = int(metrics[STOP_KEY]) if STOP_KEY in metrics else self.code
        if agreed and not self.reason:
            self.agreed = agreed
            self.reason = {
                STOP_SIGNAL: "stop signal received",
                STOP_TIME_LIMIT: f"training_time_limit of {limit} s reached",
                STOP_REQUESTED: self.note or "stop requested by another process",
            }[agreed]
        return metrics

    def install_signal_handlers(self) -> Callable[[], Any]:
        """SIGINT, SIGTERM, SIGHUP (the terminal closed, an ssh session dropped) and SIGQUIT (Ctrl-\\, which
        would otherwise dump core and lose the steps since the last checkpoint) finish the step, save and stop
        (another one while saving is absorbed); returns the function that puts the previous handlers back. Only
        in the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum, _frame):
            if self.code:
                log.warning("signal %d again: still saving the final checkpoint; it is not interrupted", signum)
                return
            log.warning("signal %d: finishing this step, saving a checkpoint and stopping", signum)
            self.code, self.signal = STOP_SIGNAL, signum

        stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
        old = {s: signal.signal(s, handler) for s in stops}
        return lambda: [signal.signal(s, h) for s, h in old.items()]
