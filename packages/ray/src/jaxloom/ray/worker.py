"""What runs inside the Ray actors: one JAX process per actor, and a board the workers report progress to.

Nothing here imports JAX at module level: an actor sets up its devices before JAX starts.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any


class ProgressBoard:
    """A tiny actor the workers beat on (`beat(rank, step, phase, report)`); the driver reads `snapshot()`
    to see who is alive and making progress (and takes rank 0's `report`s: metrics and the newest
    checkpoint), and sets `request_stop()` when it is asked to stop, which every beat answers (True:
    stop). It remembers when the gang first beat from a step, so that a gang that ends before the driver
    looks still says when it started training. Ages use this actor's clock only."""

    def __init__(self):
        self._beats: dict[int, tuple[float, int, str]] = {}
        self._reports: list[dict[str, Any]] = []
        self._stop = False
        self._first_step_at: float | None = None

    def beat(self, rank: int, step: int, phase: str, report: dict[str, Any] | None = None) -> bool:
        now = time.time()
        self._beats[rank] = (now, step, phase)
        if phase == "step" and self._first_step_at is None:
            self._first_step_at = now
        if report:
            self._reports.append(report)
        return self._stop

    def request_stop(self) -> None:
        """The driver's stop (its SIGINT/SIGTERM): the workers learn it from their next beats."""
        self._stop = True

    def snapshot(self) -> tuple[dict[int, tuple[float, int, str]], list[dict[str, Any]], float | None]:
        """(rank → (seconds since its last beat, step, phase)), the reports not taken before, and the
        seconds since the first beat from a step (None before one)."""
        now, reports, self._reports = time.time(), self._reports, []
        first = None if self._first_step_at is None else now - self._first_step_at
        return {r: (now - t, step, phase) for r, (t, step, phase) in self._beats.items()}, reports, first


@dataclasses.dataclass
class WorkerContext:
    """Given to the job function in each worker: who it is (`rank` of `world_size`), which `attempt`
    this is, the progress `board` it reports to, the JAX `coordinator` address (rank 0's host:port), and
    `report_interval_s`: how often its step hooks report at most."""

    rank: int
    world_size: int
    attempt: int
    board: Any = dataclasses.field(repr=False, default=None)
    coordinator: str | None = None  # host:port of the JAX coordination service (rank 0)
    report_interval_s: float = 2.0  # the step hooks beat at most this often (and on every checkpoint)

    def beat(self, step: int = 0, phase: str = "step", report: dict[str, Any] | None = None) -> Any:
        """Tell the supervisor this worker is alive and at `step` (phase: 'joined', 'ready', 'step'), with
        an optional `report` (rank 0: metrics, the newest checkpoint). Returns the reply (a Ray reference
        to a bool: whether the driver asks the job to stop), or None."""
        if self.board is not None:
            return self.board.beat.remote(self.rank, int(step), phase, report)
        return None

    def hooks(self) -> list:
        """Trainer hooks that beat after the first step, then at most every `report_interval_s` and on
        every checkpoint (give them to `BaseTrainer(hooks=...)`)."""
        return [_BeatHook(self)]


class _BeatHook:
    """Beats after the first step, then at most every `report_interval_s` and after every checkpoint: a
    Ray message every few seconds, whatever the step time, and one report per step at most (a step's
    interval beat goes out when the next step starts, so a step that saves reports once). Rank 0's
    beats carry a report: its newest logged metrics (train and, once there is one, eval; only once an
    evaluation ran when the run evaluates, so every report has the same keys) and the newest
    checkpoint. When a reply says the driver was asked to stop, it asks the trainer to stop (every rank
    stops after the same step: the trainer agrees on it). Replies are read without waiting: the step
    loop never blocks on the board."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self._reply = None
        self._last = -float("inf")
        self._records = 0  # history records already looked at
        self._latest: dict[str, Any] = {}
        self._checkpoint: str | None = None
        self._due: int | None = None  # a step whose beat is owed

    def on_step_start(self, run, step) -> None:
        if self._due is not None:  # the finished step's beat, unless its checkpoint sent one
            self._beat(run, self._due)

    def on_step_end(self, run, step, metrics) -> None:
        self._read_reply(run)
        if time.monotonic() - self._last >= self.ctx.report_interval_s:
            # Sent when the next step starts, after this step's evaluation and checkpoint: a step that
            # saves reports once (with its checkpoint), not once before the save and once after.
            self._due = step

    def on_save(self, run, step) -> None:
        if run.checkpoints is not None:
            self._checkpoint = str(run.checkpoints.step_folder(step))
        self._beat(run, step)

    def _beat(self, run, step) -> None:
        self._last, self._due = time.monotonic(), None
        if self._reply is None:
            self._reply = self.ctx.beat(step, "step", self._report(run, step))
        else:  # keep the older unanswered reply: it is read first
            self.ctx.beat(step, "step", self._report(run, step))

    def _report(self, run, step) -> dict[str, Any] | None:
        """`run` is the trainer's `RunView`: the rows logged so far, whether the run evaluates."""
        if self.ctx.rank != 0:
            return None
        history = run.history
        for record in history[self._records :]:
            for key, value in record.items():
                if key != "step" and "/" in key:
                    kind, name = key.split("/", 1)
                    self._latest[name if kind == "train" else f"{kind}_{name}"] = value
        self._records = len(history)
        if "loss" not in self._latest or (run.evaluates and "eval_loss" not in self._latest):
            return None
        return {**self._latest, "step": int(step), "checkpoint_dir": self._checkpoint}

    def _read_reply(self, run) -> None:
        if self._reply is None:
            return
        import ray

        ready, _ = ray.wait([self._reply], timeout=0)  # an unanswered one is kept for the next step
        if not ready:
            return
        self._reply = None
        if ray.get(ready[0]):
            run.request_stop("stop requested by the Ray driver")


class GangWorker:
    """One JAX process. `settings`: platform ('cpu' or None for the default), devices (simulated CPU
    devices per worker), heartbeat_timeout_s and init_timeout_s for `jax.distributed`, report_interval_s
    (how often the step hooks beat), env (extra)."""

    def __init__(self, rank: int, world_size: int, attempt: int, board: Any, settings: dict[str, Any]):
        self.rank, self.world_size, self.attempt, self.board = rank, world_size, attempt, board
        self.settings = settings
        self._port_hold: socket.socket | None = None
        for key, value in (settings.get("env") or {}).items():
            os.environ[key] = str(value)
        if settings.get("platform"):
            os.environ["JAX_PLATFORMS"] = settings["platform"]
        if settings.get("platform") == "cpu":  # the device count is the launcher's, not the inherited flags'
            flags = os.environ.get("XLA_FLAGS", "").split()
            os.environ["XLA_FLAGS"] = " ".join(f for f in flags if "xla_force_host_platform_device_count" not in f)

    def visible(self) -> dict[str, Any]:
        """What this worker was given: its node, Ray's GPU ids, CUDA_VISIBLE_DEVICES and JAX_PLATFORMS."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS"),
        }

    def coordinator_address(self) -> str:
        """host:port for `jax.distributed` (called on rank 0 only): this node's address as the Ray cluster
        knows it (127.0.0.1 for a local loopback cluster) and a free port."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        host = next(
            (n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node), ray.util.get_node_ip_address()
        )
        # Held, bound but not listening, until JAX's coordinator has bound it: nothing else on the node can
        # take the port in between. SO_REUSEPORT lets the coordinator (gRPC sets it too) bind beside it.
        self._port_hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._port_hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self._port_hold.bind((host, 0))
        return f"{host}:{self._port_hold.getsockname()[1]}"

    def run(self, coordinator: str, fn, args: tuple, kwargs: dict) -> Any:
        import jax

        from jaxloom.mesh import init_distributed

        if self.settings.get("platform") == "cpu":
            jax.config.update("jax_num_cpu_devices", int(self.settings.get("devices") or 1))
        init_distributed(
            coordinator,
            self.world_size,
            self.rank,
            initialization_timeout=int(self.settings.get("init_timeout_s", 120)),
            heartbeat_timeout_seconds=int(self.settings.get("heartbeat_timeout_s", 10)),
            coordinator_bind_address=coordinator if self.rank == 0 else None,
        )
        if self._port_hold is not None:
            self._port_hold.close()  # the coordinator listens on it now
            self._port_hold = None
        ctx = WorkerContext(
            self.rank,
            self.world_size,
            self.attempt,
            self.board,
            coordinator,
            float(self.settings.get("report_interval_s", 2.0)),
        )
        ctx.beat(0, "joined")
        return fn(ctx, *args, **kwargs)
