"""What a user sees of a run while it trains: the progress bar, a metrics row every `logging_steps`
(metrics.jsonl, TensorBoard, W&B, the console), parameter histograms. Built from the arguments' logging
settings; `open()` starts the writers (on every process: only process 0 writes), `close()` ends them.

    log = StepLog(arguments, config=model_config, row_width=512, devices=8, is_process_zero=True)
    log.open(step=0, total_steps=100, run_config={...})
    log.step(1, on_device_metrics, extra=dict)   # a row when one is due, the bar always
    log.log_metrics({"loss": 2.3}, None, 1, mode="eval")
    log.close()
"""

from __future__ import annotations

import math
from collections.abc import Callable
import time
from typing import Any

import jax
import numpy as np

import jaxloom.models as jmod
from jaxloom.mesh import named_leaves

from .metrics import MetricsWriter, create_progress_bar, memory_in_use, peak_flops
from .step import STOP_KEY

# Step metrics that are not averaged into a log row (bookkeeping; tokens and the learning rate are logged apart).
_NOT_AVERAGED = {"finite", "learning_rate", "tokens", "row_width", STOP_KEY}


class StepLog:
    """Rows of step metrics averaged over each logging window, with throughput (tokens/s, TFLOP/s, MFU),
    memory and wall time over every segment of the run. `perplexity` adds exp(loss) to each row."""

    def __init__(
        self,
        arguments: Any,
        *,
        config: Any,
        row_width: int,
        devices: int,
        is_process_zero: bool,
        perplexity: bool = True,
        directory: Any,
    ):
        self.arguments, self.config, self.row_width, self.devices = arguments, config, row_width, devices
        self.is_process_zero, self.perplexity = is_process_zero, perplexity
        self.directory = directory  # where the metrics and TensorBoard files go (the run directory's local folder)
        self.writer: MetricsWriter | None = None
        self.pbar: Any = None
        self._window: list[dict] = []
        self._t_log = time.perf_counter()
        self._t0 = time.monotonic()
        self._elapsed_base = 0.0
        self._tokens_seen = 0

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every row written by this run (and the earlier segments it resumed), oldest first."""
        return self.writer.history if self.writer is not None else []

    def create_progress_bar(self, total: int, desc: str = "", disabled: bool = False, initial: int = 0):
        """A progress bar over `total` steps labelled `desc`, starting at `initial` (a no-op object when
        `disabled`, or on any process but 0): `update(n)`, `set_postfix(...)`, `write(line)`, `close()`."""
        return create_progress_bar(total, desc, disabled=disabled or not self.is_process_zero, initial=initial)

    def open(self, step: int, total_steps: int, run_config: dict[str, Any]) -> None:
        """Start the bar at `step` and the writers (their history reads the rows of earlier segments up to
        `step`); `run_config` is recorded with the run (TensorBoard hparams, W&B config)."""
        a = self.arguments
        self.pbar = self.create_progress_bar(total_steps, desc="train", disabled=not a.progress_bar, initial=step)
        self._window, self._t_log, self._t0 = [], time.perf_counter(), time.monotonic()
        self._flops_token = jmod.flops_per_token(self.config, a.max_sequence_length)  # constants of the run,
        self._peak = peak_flops(override=a.peak_flops_per_device)  # not of each log row
        self.total_steps = total_steps
        self.writer = MetricsWriter(
            self.directory,
            tensorboard=a.use_tensorboard,
            use_wandb=a.use_wandb,
            wandb_project=a.wandb_project,
            bar=self.pbar,
            start_step=step,
            config=run_config,
            total_steps=total_steps,
        )
        # training time of the segments before this one (their rows up to the checkpoint resumed from)
        self._elapsed_base = next(
            (r["train/elapsed_time"] for r in reversed(self.writer.history) if "train/elapsed_time" in r), 0.0
        )
        # the earlier segments' tokens: their last row's count (a kind's rows may vary in width), and the steps
        # after that row at this run's width
        last = next((r for r in reversed(self.writer.history) if "train/tokens_seen" in r), {"step": 0})
        counted = last.get("train/tokens_seen", 0)
        self._tokens_seen = int(counted + (step - last["step"]) * a.training_batch_size * self.row_width)

    def step(self, step: int, metrics: dict[str, Any], *, extra: Callable[[], dict], state: Any = None) -> None:
        """`step`'s on-device `metrics` into the window; every `logging_steps` (and at the last step) the
        window's row, with `extra()` (the data's metrics, asked for only when a row is written) and, with
        `log_weight_distribution`, histograms of `state`. The bar advances by one."""
        a = self.arguments
        self._window.append(metrics)
        if step % a.logging_steps == 0 or step == self.total_steps:
            host, now = jax.device_get(self._window), time.perf_counter()
            dt = now - self._t_log
            widths = [float(m.get("row_width", self.row_width)) for m in host]  # as wide as each step's rows
            tokens = int(a.training_batch_size * sum(widths))
            self._tokens_seen += tokens
            tps = tokens / dt
            flops_token = (
                self._flops_token
                if all(w == self.row_width for w in widths)
                else jmod.flops_per_token(self.config, round(float(np.mean(widths))))
            )
            keys = ["loss", *sorted(k for k in host[-1] if k not in _NOT_AVERAGED and k != "loss")]
            row = {k: float(np.mean([m[k] for m in host])) for k in keys}
            if self.perplexity:
                row["perplexity"] = math.exp(min(row["loss"], 50))
            row.update(
                learning_rate=float(host[-1]["learning_rate"]),
                tokens_seen=self._tokens_seen,
                elapsed_time=self._elapsed_base + time.monotonic() - self._t0,  # over every segment of the run
                tokens_per_second=tps,
                step_time=dt / len(host),
                tflops_per_device=flops_token * tps / self.devices / 1e12,
                **memory_in_use(),
            )
            if self._peak:
                row["mfu"] = flops_token * tps / self.devices / self._peak
            row.update(extra())
            self.log_metrics(row, None, step)
            if a.log_weight_distribution and state is not None:
                self.log_weight_distribution(state, step)
            self._window, self._t_log = [], now
        self.pbar.update(1)

    def log_metrics(self, metrics: dict[str, Any], pbar: Any, step: int, mode: str = "train") -> None:
        """Write `metrics` of `step` as `mode/name` to metrics.jsonl, TensorBoard, wandb and the console
        (through `pbar`, default this log's bar, whose postfix shows the loss)."""
        assert self.writer is not None, "StepLog.open() first"
        self.writer.write(step, metrics, prefix=mode)
        pbar = pbar if pbar is not None else self.pbar
        if pbar is not None and "loss" in metrics:
            pbar.set_postfix({f"{mode}_loss": f"{metrics['loss']:.4g}"})

    def log_weight_distribution(self, state: Any, step: int) -> None:
        """A TensorBoard histogram of every parameter of `state`, labelled `step`."""
        assert self.writer is not None, "StepLog.open() first"
        for name, leaf in named_leaves(state.params):
            self.writer.histogram(step, f"weights/{name}", np.asarray(jax.device_get(leaf)))

    def samples(self, step: int, prompts: list[str], completions: list[str]) -> None:
        if self.writer is not None:
            self.writer.samples(step, prompts, completions)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
