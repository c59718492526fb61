"""`MeshConfig`: the device mesh as data, and `build()` to turn it into a `jax.sharding.Mesh`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from jaxloom.core.schema import config

DEFAULT_AXIS_NAMES: tuple[str, ...] = ("dp", "fsdp", "ep", "tp", "sp")
DEFAULT_AXIS_DIMS: tuple[int, ...] = (1, -1, 1, 1, 1)


def _check_dims(dims: tuple[int, ...], what: str) -> None:
    bad = [d for d in dims if d == 0 or d < -1]
    if bad:
        raise ValueError(f"{what} {dims}: every dim must be a positive integer or -1, got {bad}")
    if dims.count(-1) > 1:
        raise ValueError(f"{what} {dims}: at most one dim may be -1 ('the rest'), found {dims.count(-1)}")


def resolve_dims(dims: Sequence[int], total: int, *, what: str = "axis_dims") -> tuple[int, ...]:
    """Replace the one `-1` in `dims` so that their product is `total`; check the rest.

    Raises ValueError naming the dims and the count when that is impossible; `what` names the dims
    in that message.
    """
    dims = tuple(int(d) for d in dims)
    _check_dims(dims, what)
    holes = dims.count(-1)
    known = math.prod(d for d in dims if d != -1)
    if holes == 0:
        if known != total:
            raise ValueError(
                f"{what} {dims}: product is {known}, but there are {total} devices to place; "
                f"expected a product of exactly {total} (or one -1)"
            )
        return dims
    if total % known:
        raise ValueError(
            f"{what} {dims}: the fixed dims multiply to {known}, which does not divide the "
            f"{total} devices, so -1 has no integer value"
        )
    return tuple(total // known if d == -1 else d for d in dims)


@config
class MeshConfig:
    """A named device mesh.

    Attributes:
      axis_dims: size of each axis inside one granule (host or slice); at most one `-1` = the rest.
      axis_names: mesh axis names, default `("dp", "fsdp", "ep", "tp", "sp")`.
      dcn_axis_dims: size of each axis across granules (processes, or TPU slices). `None` means one
        granule per mesh, i.e. the mesh is built as if all devices were local. With several
        processes, the total size of an axis is `axis_dims[i] * dcn_axis_dims[i]`.
    """

    axis_dims: tuple[int, ...] = DEFAULT_AXIS_DIMS
    axis_names: tuple[str, ...] = DEFAULT_AXIS_NAMES
    dcn_axis_dims: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"MeshConfig.axis_names {self.axis_names} has a repeated name")
        for field in ("axis_dims", "dcn_axis_dims"):
            dims = getattr(self, field)
            if dims is not None and len(dims) != len(self.axis_names):
                raise ValueError(
                    f"MeshConfig.{field} {dims} has {len(dims)} entries, expected one per "
                    f"axis name {self.axis_names} ({len(self.axis_names)})"
                )
            if dims is not None:
                _check_dims(dims, f"MeshConfig.{field}")

    @classmethod
    def from_axes(cls, axis_names: Sequence[str] = DEFAULT_AXIS_NAMES, **dims: int) -> MeshConfig:
        """`MeshConfig.from_axes(fsdp=4, tp=2)`: the named axes get those sizes, the others 1.
        `axis_names` lists every axis of the mesh (default `("dp", "fsdp", "ep", "tp", "sp")`)."""
        unknown = sorted(set(dims) - set(axis_names))
        if unknown:
            raise ValueError(f"unknown mesh axis {unknown}; expected some of {tuple(axis_names)}")
        return cls(axis_dims=tuple(dims.get(n, 1) for n in axis_names), axis_names=tuple(axis_names))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeshConfig:
        """Inverse of `to_dict`: `data` holds the fields by name; unknown keys are an error."""
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON data (`from_dict` reads it back)."""
        return {
            "axis_dims": list(self.axis_dims),
            "axis_names": list(self.axis_names),
            "dcn_axis_dims": None if self.dcn_axis_dims is None else list(self.dcn_axis_dims),
        }

    def resolve(self, num_devices: int, num_granules: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The concrete `(ici_dims, dcn_dims)` for `num_devices` devices split over `num_granules`
        granules (processes or slices)."""
        if num_devices % num_granules:
            raise ValueError(f"{num_devices} devices do not split evenly over {num_granules} granules")
        if self.dcn_axis_dims is None or num_granules == 1:
            dcn = tuple(1 for _ in self.axis_names)
            return resolve_dims(self.axis_dims, num_devices), dcn
        dcn = resolve_dims(self.dcn_axis_dims, num_granules, what="MeshConfig.dcn_axis_dims")
        ici = resolve_dims(self.axis_dims, num_devices // num_granules, what="MeshConfig.axis_dims (per granule)")
        return ici, dcn

    def shape(self, num_devices: int, num_granules: int = 1) -> dict[str, int]:
        """Total size of every axis for `num_devices` devices over `num_granules` granules, e.g.
        `{'dp': 1, 'fsdp': 8, ...}`."""
        ici, dcn = self.resolve(num_devices, num_granules)
        return {n: i * d for n, i, d in zip(self.axis_names, ici, dcn, strict=True)}

    def build(self, devices: Sequence[Any] | None = None):
        """A `jax.sharding.Mesh` (Auto axis types) over `devices` (default: all of `jax.devices()`)."""
        import jax
        import numpy as np
        from jax.experimental import mesh_utils

        devices = list(jax.devices() if devices is None else devices)
        granules = _granules(devices) if self.dcn_axis_dims is not None else 1
        ici, dcn = self.resolve(len(devices), granules)
        if granules > 1:
            by_slice = (
                all(getattr(d, "slice_index", None) is not None for d in devices)
                and len({d.slice_index for d in devices}) == granules
            )
            arr = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=not by_slice)
        elif devices[0].platform == "tpu":
            arr = mesh_utils.create_device_mesh(ici, devices)
        else:
            # Sorted by (process, id): each process's devices stay together along the leading axes.
            ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
            arr = np.array(ordered, dtype=object).reshape(ici)
        return jax.sharding.Mesh(arr, self.axis_names)


def _granules(devices: Sequence[Any]) -> int:
    slices = {getattr(d, "slice_index", None) for d in devices}
    if None not in slices and len(slices) > 1:
        return len(slices)
    return len({d.process_index for d in devices})
