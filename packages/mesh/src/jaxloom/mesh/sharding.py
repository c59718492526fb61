"""Placing trees on a mesh and bringing them back to the host, for one process or many."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .rules import is_spec, validate_specs


def specs_to_named_sharding(specs: Any, mesh) -> Any:
    """`specs`, a tree of `PartitionSpec` → a tree of `NamedSharding` on `mesh` (EasyDeL's
    `specs_to_name_sharding`)."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)


def shard(tree: Any, specs: Any, mesh) -> Any:
    """Place every leaf of `tree` on `mesh` with its spec from `specs` (a tree of `PartitionSpec`).
    Works with many processes: host values must
    be the same on every process, and each process only copies the shards its devices hold. Specs
    are checked against shapes first, so a bad spec is a clear error instead of an XLA one."""
    validate_specs(specs, tree, mesh)
    shardings = specs_to_named_sharding(specs, mesh)
    return jax.tree_util.tree_map(_place, tree, shardings)


def _place(x: Any, sharding: NamedSharding) -> jax.Array:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)  # already global: reshard
    if isinstance(x, jax.Array) and jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def gather(tree: Any) -> Any:
    """Every leaf of `tree` as a full host `numpy` array, on every process (all-gathers what is not local)."""
    from jax.experimental import multihost_utils

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree_util.tree_map(get, tree)


def replicated(mesh) -> NamedSharding:
    """The sharding that keeps a full copy on every device of `mesh`."""
    return NamedSharding(mesh, PartitionSpec())
