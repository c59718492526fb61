"""Explicit multi-process setup. Nothing here runs at import; launchers call these functions."""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)


def init_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    *,
    cpu_collectives: str | None = "gloo",
    initialization_timeout: int = 300,
    heartbeat_timeout_seconds: int = 100,
    coordinator_bind_address: str | None = None,
) -> bool:
    """Join this process to a JAX process group. A no-op (returns False) for one process.

    On CPU, cross-process computations need CPU collectives: `cpu_collectives="gloo"` (the default)
    selects them before the backend starts; without them JAX fails with "Multiprocess computations
    aren't implemented on the CPU backend". Keep `heartbeat_timeout_seconds` short under a supervisor
    (Ray): a hung peer is only noticed by the heartbeat. Must be called before any device query.
    `coordinator_bind_address` ('host:port'): where process 0's coordination service listens; JAX's
    default is every interface.

    Arguments, grouped:

    - `coordinator_address`: 'host:port' of process 0's coordination service (None: from the environment
      or the cluster, as `jax.distributed.initialize` finds it).
    - `num_processes`, `process_id`: the group's size and this process's rank.
    - `local_device_ids`: the devices this process uses (None: all it sees).
    - `initialization_timeout`: seconds to wait for every process to join.
    """
    import jax

    if num_processes is None or num_processes == 1:
        return False
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if process_id is None or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id!r} must be in [0, {num_processes}) for {num_processes} processes")
    if not coordinator_address or ":" not in coordinator_address:
        raise ValueError(f"coordinator_address {coordinator_address!r}; expected 'host:port' of process 0")
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    log.info("joining process group at %s as process %d of %d", coordinator_address, process_id, num_processes)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        coordinator_bind_address=coordinator_bind_address,
    )
    return True


def simulate_cpu_devices(n: int) -> None:
    """Give this process `n` CPU devices (for tests and laptops). Call before JAX starts its backend;
    the same as `XLA_FLAGS=--xla_force_host_platform_device_count=n`."""
    import jax

    if n < 1:
        raise ValueError(f"simulate_cpu_devices: n must be >= 1, got {n}")
    try:
        jax.config.update("jax_num_cpu_devices", n)
        late = jax.device_count("cpu") != n
    except RuntimeError:  # JAX refuses once its backends exist
        late = True
    if late:
        raise RuntimeError(
            f"simulate_cpu_devices({n}) came too late: JAX already started with "
            f"{jax.device_count('cpu')} CPU devices. Call it before any device query."
        )
