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
    """A tiny actor the workers beat on (`beat(rank, step, phase)`, fire and forget); the driver reads
    `snapshot()` to see who is alive and making progress. Ages use this actor's clock only."""

    def __init__(self):
        self._beats: dict[int, tuple[float, int, str]] = {}

    def beat(self, rank: int, step: int, phase: str) -> None:
        self._beats[rank] = (time.time(), step, phase)

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

    def beat(self, step: int = 0, phase: str = "step") -> None:
        """Tell the supervisor this worker is alive and at `step` (phase: 'joined', 'ready', 'step')."""
        if self.board is not None:
            self.board.beat.remote(self.rank, int(step), phase)

    def hooks(self) -> list:
        """Trainer hooks that beat after every step (give them to `BaseTrainer(hooks=...)`)."""
        return [_BeatHook(self)]


class _BeatHook:
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx

    def on_step_end(self, trainer, step, metrics) -> None:
        self.ctx.beat(step, "step")


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
