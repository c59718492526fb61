"""Partition rules: ordered `(regex, PartitionSpec)` pairs matched against parameter paths."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

Rules = Sequence[tuple[str, PartitionSpec]]


def path_str(path: Sequence[Any]) -> str:
    """`('model', 'layers', 0, 'kernel')`-like key path → `"model/layers/0/kernel"`."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def named_leaves(tree: Any, is_leaf=None) -> list[tuple[str, Any]]:
    """`[(path, leaf), ...]` of `tree` in tree-flatten order; `is_leaf` as in `jax.tree_util`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(path_str(p), leaf) for p, leaf in flat]


def match_partition_rules(rules: Rules, tree: Any, *, mesh=None) -> Any:
    """A tree of `PartitionSpec` shaped like `tree`: each leaf gets the spec of the first rule whose
    regex `re.search`-es its path. Scalars are replicated. A leaf no rule matches is an error; end
    the rules with `(".*", PartitionSpec())` to replicate the rest. With `mesh`, the result is also
    checked to divide every shape (see `validate_specs`)."""
    compiled = [(re.compile(r), s) for r, s in rules]

    def pick(path, leaf):
        name = path_str(path)
        if len(getattr(leaf, "shape", ())) == 0:
            return PartitionSpec()
        for regex, spec in compiled:
            if regex.search(name):
                return spec
        raise ValueError(
            f"no partition rule matches parameter {name!r} (shape {tuple(leaf.shape)}); "
            f"rules tried: {[r for r, _ in rules]}. Add a catch-all ('.*', PartitionSpec())."
        )

    specs = jax.tree_util.tree_map_with_path(pick, tree)
    if mesh is not None:
        validate_specs(specs, tree, mesh)
    return specs


def _axis_size(mesh_shape: Mapping[str, int], axes: Any, where: str) -> int:
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    missing = [a for a in axes if a not in mesh_shape]
    if missing:
        raise ValueError(f"{where}: mesh axis {missing} not in the mesh {dict(mesh_shape)}")
    return math.prod(mesh_shape[a] for a in axes)


def validate_specs(specs: Any, tree: Any, mesh) -> None:
    """Check that every spec in `specs` fits its leaf's shape in `tree` on `mesh`; the error names the
    parameter, its shape, the spec and the mesh."""
    shape_of = dict(named_leaves(tree))
    for name, spec in named_leaves(specs, is_leaf=is_spec):
        shape = tuple(getattr(shape_of.get(name), "shape", ()))
        where = f"parameter {name!r} with shape {shape} and spec {spec} on mesh {dict(mesh.shape)}"
        if len(spec) > len(shape):
            raise ValueError(f"{where}: the spec has {len(spec)} entries but the array has {len(shape)} dims")
        for dim, axes in enumerate(spec):
            size = _axis_size(mesh.shape, axes, where)
            if shape[dim] % size:
                raise ValueError(
                    f"{where}: dim {dim} of size {shape[dim]} is not divisible by {size}, "
                    f"the size of mesh axes {axes!r}"
                )


def auto_partition_rules(tree: Any, mesh, axes: Iterable[str | tuple[str, ...]] = ("tp",)) -> list:
    """Rules from shapes alone (RedCo's `get_sharding_rules`): for each axis group in `axes`, shard the
    largest dimension (not already sharded) that its size divides; replicate where none divides.
    Returns exact-path rules ending with a catch-all, so they can be stored, printed and edited.
    `tree`: parameters or their shapes; `mesh`: gives each axis group's size."""
    groups = [(g, _axis_size(mesh.shape, g, "auto_partition_rules")) for g in axes]
    rules = []
    for name, leaf in named_leaves(tree):
        shape = tuple(getattr(leaf, "shape", ()))
        spec: list[Any] = [None] * len(shape)
        order = sorted(range(len(shape)), key=lambda d: (-shape[d], -d))
        for group, size in groups:
            if size == 1:
                continue
            for d in order:
                if spec[d] is None and shape[d] % size == 0:
                    spec[d] = group
                    break
        rules.append(("^" + re.escape(name) + "$", PartitionSpec(*spec)))
    rules.append((".*", PartitionSpec()))
    return rules
