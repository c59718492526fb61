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
    """A tiny actor the workers beat on (`beat(rank, step, phase)`); the driver reads `snapshot()` to see
    who is alive and making progress, and sets `request_stop()` when it is asked to stop, which every
    beat answers (True: stop). Ages use this actor's clock only."""

    def __init__(self):
        self._beats: dict[int, tuple[float, int, str]] = {}
        self._stop = False

    def beat(self, rank: int, step: int, phase: str) -> bool:
        self._beats[rank] = (time.time(), step, phase)
        return self._stop

    def request_stop(self) -> None:
        """The driver's stop (its SIGINT/SIGTERM): the workers learn it from their next beats."""
        self._stop = True

    def snapshot(self) -> dict[int, tuple[float, int, str]]:
        now = time.time()
        return {r: (now - t, step, phase) for r, (t, step, phase) in self._beats.items()}


@dataclasses.dataclass
class WorkerContext:
    """Given to the job function in each worker: who it is (`rank` of `world_size`), which `attempt`
    this is, the progress `board` it reports to, and the JAX `coordinator` address (rank 0's host:port)."""

    rank: int
    world_size: int
    attempt: int
    board: Any = dataclasses.field(repr=False, default=None)
    coordinator: str | None = None  # host:port of the JAX coordination service (rank 0)

    def beat(self, step: int = 0, phase: str = "step") -> Any:
        """Tell the supervisor this worker is alive and at `step` (phase: 'joined', 'ready', 'step').
        Returns the reply (a Ray reference to a bool: whether the driver asks the job to stop), or None."""
        if self.board is not None:
            return self.board.beat.remote(self.rank, int(step), phase)
        return None

    def hooks(self) -> list:
        """Trainer hooks that beat after every step (give them to `BaseTrainer(hooks=...)`)."""
        return [_BeatHook(self)]


class _BeatHook:
    """Beats after every step; when a beat's reply says the driver was asked to stop, asks the trainer to
    stop (every rank stops after the same step: the trainer agrees on it). Replies are read without
    waiting: the step loop never blocks on the board."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self._reply = None

    def on_step_end(self, trainer, step, metrics) -> None:
        previous, self._reply = self._reply, self.ctx.beat(step, "step")
        if previous is None or not hasattr(trainer, "request_stop"):
            return
        import ray

        ready, _ = ray.wait([previous], timeout=0)  # an unanswered one is skipped: later replies say the same
        if ready and ray.get(ready[0]):
            trainer.request_stop("stop requested by the Ray driver")


class GangWorker:
    """One JAX process. `settings`: platform ('cpu' or None for the default), devices (simulated CPU
    devices per worker), heartbeat_timeout_s and init_timeout_s for `jax.distributed`, env (extra)."""

    def __init__(self, rank: int, world_size: int, attempt: int, board: Any, settings: dict[str, Any]):
        self.rank, self.world_size, self.attempt, self.board = rank, world_size, attempt, board
        self.settings = settings
        for key, value in (settings.get("env") or {}).items():
            os.environ[key] = str(value)
        if settings.get("platform"):
            os.environ["JAX_PLATFORMS"] = settings["platform"]
        if settings.get("platform") == "cpu":  # the device count is the launcher's, not the inherited flags'
            flags = os.environ.get("XLA_FLAGS", "").split()
            os.environ["XLA_FLAGS"] = " ".join(f for f in flags if "xla_force_host_platform_device_count" not in f)

    def coordinator_address(self) -> str:
        """host:port for `jax.distributed` (called on rank 0 only): this node's address as the Ray cluster
        knows it (127.0.0.1 for a local loopback cluster) and a free port."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        host = next(
            (n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node), ray.util.get_node_ip_address()
        )
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"{host}:{port}"

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
        ctx = WorkerContext(self.rank, self.world_size, self.attempt, self.board, coordinator)
        ctx.beat(0, "joined")
        return fn(ctx, *args, **kwargs)
