"""Metrics out of the loop: console / progress bar, JSONL file, TensorBoard, wandb. Process 0 only."""

from __future__ import annotations

import datetime
import json
import logging
import os
import resource
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax

log = logging.getLogger("jaxloom.trainer")

# Dense bf16 peak FLOP/s per device, for MFU. CPUs have no meaningful entry.
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
}


def peak_flops(device=None, override: float | None = None) -> float | None:
    if override:
        return override
    kind = (device or jax.devices()[0]).device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k.lower() in kind.lower()), None)


def memory_in_use() -> dict[str, float]:
    """Device memory in use (GB) where the backend reports it, and this process's peak host RSS."""
    out = {"host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_in_use" in stats:
        out["device_memory_gb"] = stats["bytes_in_use"] / 2**30
    return out


_CONSOLE = {"closed": False}


def console(line: str, bar: Any = None) -> None:
    """Print `line` (through the progress bar `bar` when there is one). A closed output (`jaxloom train ... |
    head`, a log collector that died) never stops training: console lines stop, everything written to files
    goes on, and stdout is pointed at /dev/null so that nothing later fails on it either."""
    if _CONSOLE["closed"]:
        return
    try:
        if bar is not None:
            bar.write(line)
        else:
            print(line, flush=True)
    except OSError:  # EPIPE, EBADF, EIO: the reader is gone
        _CONSOLE["closed"] = True
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass


class NoBar:
    """A progress bar that shows nothing (disabled, or not process 0); lines still reach the console."""

    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, *args: Any, **kwargs: Any) -> None: ...
    def close(self) -> None: ...

    def write(self, line: str) -> None:
        console(line)


def create_progress_bar(total: int, desc: str = "", *, disabled: bool = False, initial: int = 0):
    """A tqdm bar over `total` steps (shown on a terminal), or a no-op bar when `disabled`."""
    if disabled or not total:
        return NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, disable=not sys.stderr.isatty())


def read_history(path: str | Path, upto: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of an earlier metrics.jsonl that belong to a run resumed at step `upto`: `(metric rows,
    every kept line)`. Rows after `upto` were logged past the checkpoint and will be logged again; a
    line cut short by a kill is dropped."""
    rows: list[dict[str, Any]] = []
    kept: list[str] = []
    path = Path(path)
    if not path.is_file():
        return rows, kept
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int) or row["step"] > upto:
                continue
            kept.append(json.dumps(row))
            if "samples" not in row:
                rows.append(row)
    return rows, kept


class MetricsWriter:
    """Metrics rows to metrics.jsonl, TensorBoard, wandb and the console, on process 0. The console lines
    go through `bar` when given (so they do not break a progress bar), else through its own bar of
    `progress_total` steps when `progress_bar`.

    `start_step`: the step the run starts from. The file keeps the earlier rows up to it (a resumed run's
    history, so plots and reports cover the whole run) and drops the rest, which the run logs again; a
    fresh run (0) starts an empty file; None keeps every row. `history` holds the metric rows, earlier ones included.

    `config` (the run's settings) goes to TensorBoard's HParams tab and to W&B, whose run is named
    `run_name` (default: the directory's name) and continued by every resume of the run."""

    def __init__(
        self,
        directory: str | Path,
        *,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        use_wandb: bool = False,
        progress_total: int | None = None,
        progress_bar: bool = True,
        initial: int = 0,
        bar: Any = None,
        start_step: int | None = None,
        config: dict[str, Any] | None = None,
        run_name: str | None = None,
        total_steps: int | None = None,
    ):
        self.enabled = jax.process_index() == 0
        self.closed = False
        self.directory = Path(directory)
        self.history: list[dict[str, Any]] = []
        self._tb = self._wandb = self._bar = None
        self.total_steps = total_steps
        self._last_row: tuple[int, float] | None = None  # (step, time) of this session's last train row
        self._intervals: list[float] = []  # seconds a step between the session's last rows (the ETA's rate)
        if not self.enabled:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / "metrics.jsonl"
        self.history, kept = read_history(path, start_step if start_step is not None else 2**62)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)  # atomic: a kill now leaves the old file or the new one
        self._jsonl = open(path, "a", buffering=1)
        if tensorboard:
            from jaxloom.trainer.tbevents import EventWriter

            self._tb = EventWriter(self.directory / "tensorboard")
            if config:
                self._tb.add_hparams(config, ["train/loss", "eval/loss"])
        if use_wandb:
            try:
                import wandb
            except ImportError:
                raise ValueError("use_wandb=True, but wandb is not installed (pip install wandb)") from None
            # One W&B run per jaxloom run: its id is kept beside the run, so every resume continues it.
            id_file = self.directory / "wandb_run_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
            id_file.write_text(run_id)
            self._wandb = wandb.init(
                project=wandb_project or "jaxloom",
                dir=str(self.directory),
                id=run_id,
                resume="allow",
                name=run_name or self.directory.resolve().name,
                config=config,
            )
        if bar is not None:
            self._bar = bar
        elif progress_bar and progress_total:
            self._bar = create_progress_bar(progress_total, "train", initial=initial)

    def rewrite_if_gone(self) -> None:
        """`metrics.jsonl` written again, whole, from the history, when it was removed under the run (its open
        handle was writing to a deleted file)."""
        if not self.enabled or self.closed:
            return
        path = self.directory / "metrics.jsonl"
        if path.is_file():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in self.history))
        os.replace(tmp, path)
        self._jsonl.close()
        self._jsonl = open(path, "a", buffering=1)

    def flush(self) -> None:
        """Everything written so far on its way to the files (before they are copied, e.g. uploaded)."""
        if not self.enabled or self.closed:
            return
        self._jsonl.flush()
        if self._tb is not None and hasattr(self._tb, "flush"):
            self._tb.flush()

    def write(self, step: int, metrics: dict[str, Any], prefix: str = "train") -> None:
        if not self.enabled or self.closed:
            return
        row = {"step": step, **{f"{prefix}/{k}": v for k, v in metrics.items()}}
        self.history.append(row)
        self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, int | float):
                    self._tb.add_scalar(f"{prefix}/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        line = f"[{prefix}] step {self._progress(step) if prefix == 'train' else step}: {text}"
        console(line, self._bar)

    def _progress(self, step: int) -> str:
        """`step/total` and, from the second row of a session on, the time left at the median seconds a step of
        the last rows' intervals (up to 16): one interval that compiled a step (GRPO's rows of a new width, an
        evaluation's first batch) does not make the estimate jump."""
        if not self.total_steps:
            return str(step)
        now = time.monotonic()
        if self._last_row is not None and step > self._last_row[0]:
            last_step, last_time = self._last_row
            self._intervals = [*self._intervals[-15:], (now - last_time) / (step - last_step)]
        self._last_row = (step, now)
        out = f"{step}/{self.total_steps}"
        if self._intervals and step < self.total_steps:
            left = (self.total_steps - step) * statistics.median(self._intervals)
            out += f" eta {datetime.timedelta(seconds=round(left))}"
        return out

    def samples(self, step: int, prompts: list[str], completions: list[str]) -> None:
        """Generated previews: console, TensorBoard text and the JSONL file."""
        if not self.enabled or self.closed:  # e.g. a preview asked for after the run ended
            return
        pairs = [{"prompt": p, "completion": c} for p, c in zip(prompts, completions, strict=True)]
        self._jsonl.write(json.dumps({"step": step, "samples": pairs}) + "\n")
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            line = f"[sample] step {step}: {p!r} → {c!r}"
            console(line, self._bar)
            self.text(step, f"samples/{i}", f"**{p}**{c}")

    def text(self, step: int, tag: str, value: str) -> None:
        if self.enabled and self._tb is not None:
            self._tb.add_text(tag, value, step)

    def advance(self, n: int = 1, **postfix: Any) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in postfix.items()})

    def histogram(self, step: int, name: str, values) -> None:
        if self.enabled and self._tb is not None:
            self._tb.add_histogram(name, values, step)

    def close(self) -> None:
        if not self.enabled or self.closed:
            return
        self.closed = True
        if self._bar is not None:
            self._bar.close()  # a bar given by the trainer is closed with the run, too
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl.close()
