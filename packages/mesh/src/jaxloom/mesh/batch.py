"""Batch-size arithmetic for a mesh shared by many processes (RedCo's batch helpers)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from jax.sharding import NamedSharding, PartitionSpec

from .axes import PartitionAxis

DATA_AXES: tuple[str, ...] = tuple(PartitionAxis().batch_axis or ())
"""The mesh axes a batch is split over, in order: `PartitionAxis().batch_axis` (fsdp, then dp), the one
source of truth, so the loader lays rows out exactly as the model's activations expect them (no
resharding of the batch inside the step)."""


def data_parallel_size(mesh, data_axes: Sequence[str] = DATA_AXES) -> int:
    """How many distinct slices the batch is split into: the product of the sizes of the `data_axes`
    present in `mesh`."""
    return math.prod(mesh.shape[a] for a in data_axes if a in mesh.shape)


def batch_spec(mesh, data_axes: Sequence[str] = DATA_AXES) -> PartitionSpec:
    """The spec that splits a batch's leading dim over the `data_axes` present in `mesh`."""
    axes = tuple(a for a in data_axes if a in mesh.shape)
    return PartitionSpec(axes if axes else None)


def local_batch_slice(mesh, global_batch_size: int, data_axes: Sequence[str] = DATA_AXES) -> slice:
    """The rows of a global batch of `global_batch_size` that this process's devices hold under `mesh`
    (split over `data_axes`): what it must load itself.

    Raises if the batch does not divide over the data axes, or this process's rows are not contiguous.
    """
    dp = data_parallel_size(mesh, data_axes)
    if global_batch_size % dp:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by the data-parallel size "
            f"{dp} (mesh axes {tuple(a for a in data_axes if a in mesh.shape)} of {dict(mesh.shape)})"
        )
    sharding = NamedSharding(mesh, batch_spec(mesh, data_axes))
    rows = sorted(
        {
            (idx[0].start or 0, idx[0].stop if idx[0].stop is not None else global_batch_size)
            for idx in sharding.addressable_devices_indices_map((global_batch_size,)).values()
        }
    )
    start, stop = rows[0][0], rows[-1][1]
    covered = sum(b - a for a, b in rows)
    if covered != stop - start:
        raise ValueError(
            f"this process's batch rows {rows} are not contiguous; order the mesh so each "
            "process's devices are adjacent along the data axes"
        )
    return slice(start, stop)


def get_local_global_micro_batch_size(
    per_device_batch_size: int, mesh, data_axes: Sequence[str] = DATA_AXES
) -> tuple[int, int]:
    """`(local, global)` micro-batch sizes: `global = per_device_batch_size × data-parallel size` (the
    `data_axes` of `mesh`); `local` is the part this process loads (fewer than `per_device × local
    devices` when model axes span devices)."""
    if per_device_batch_size <= 0:
        raise ValueError(f"per_device_batch_size must be positive, got {per_device_batch_size}")
    global_size = per_device_batch_size * data_parallel_size(mesh, data_axes)
    s = local_batch_slice(mesh, global_size, data_axes)
    return s.stop - s.start, global_size


def get_accumulate_grad_batches(
    global_batch_size: int, per_device_batch_size: int, mesh, data_axes: Sequence[str] = DATA_AXES
) -> int:
    """How many micro-batches of `per_device_batch_size` per data-parallel slice of `mesh` (over
    `data_axes`) make one optimizer step of `global_batch_size` examples."""
    _, micro = get_local_global_micro_batch_size(per_device_batch_size, mesh, data_axes)
    if global_batch_size <= 0 or global_batch_size % micro:
        raise ValueError(
            f"global_batch_size {global_batch_size} must be a positive multiple of the global "
            f"micro-batch {micro} (= per_device_batch_size {per_device_batch_size} × "
            f"data-parallel size {micro // per_device_batch_size})"
        )
    return global_batch_size // micro
