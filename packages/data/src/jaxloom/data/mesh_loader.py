"""`MeshLoader`: this process's rows of global batches, one stream per data-parallel shard.

The global batch is split over the mesh's data-parallel shards (`dp × fsdp`); shard `d` of `D` is
filled by its own `DataLoader` stream (`data_rank=d, data_ranks=D`). A process runs the streams of the
shards its devices hold. So the data of a step depends on the mesh's data-parallel size only — one
process with 2 devices and 2 processes with 1 device each see the same global batches — and the
position of every stream is saved (gathered from all processes), so a resume is exact whatever
process holds which shard.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from .pipeline import START, DataConfig, DataLoader

log = logging.getLogger(__name__)
_KEYS = tuple(START)


def _flat(state: dict) -> list[int]:
    """A stream's position as ints (gathered across processes as one array)."""
    if "components" in state:
        return [v for c in state["components"] for v in _flat(c)] + list(state["tokens"])
    return [state[k] for k in _KEYS]


def _unflat(values: list[int], parts: int) -> dict:
    n = len(_KEYS)
    if parts == 1 and len(values) == n:
        return dict(zip(_KEYS, values, strict=True))
    return {
        "components": [dict(zip(_KEYS, values[i * n : (i + 1) * n], strict=True)) for i in range(parts)],
        "tokens": values[parts * n :],
    }


class MeshLoader:
    """Args:
    data, tokenizer: as for `DataLoader`. config: its `batch_size` is ignored (set from the mesh).
    mesh: the device mesh; global_batch_size: rows of one micro-batch over all processes.
    accumulation: micro-batches per `next()`: rows come out as `[accumulation × local rows]`, micro-batch
      major, so `batch.reshape(accumulation, -1, length)` gives each micro-batch's local rows.
    state: from `global_state_dict()` (any process count with the same data-parallel size), or a
      single stream's 4-integer state when the data-parallel size is 1.
    data_axes: the mesh axes the batch rows are split over, in order (default `DATA_AXES`, fsdp then dp);
      the model's `partition_axis.batch_axis`, e.g. with `ep` for expert parallelism that moves tokens.
    """

    def __init__(
        self,
        data: Any,
        tokenizer,
        config: DataConfig,
        mesh,
        global_batch_size: int,
        *,
        accumulation: int = 1,
        state: dict | None = None,
        data_axes: Sequence[str] | None = None,
    ):
        from jaxloom.mesh import DATA_AXES, data_parallel_size, local_batch_slice

        axes = DATA_AXES if data_axes is None else tuple(data_axes)
        self.dp = data_parallel_size(mesh, axes)
        rows = local_batch_slice(mesh, global_batch_size, axes)
        self.per_shard = global_batch_size // self.dp
        self.first = rows.start // self.per_shard
        self.accumulation = accumulation
        streams = self._streams_from(state)
        cfg = dataclasses.replace(config, batch_size=self.per_shard * accumulation)
        self.loaders = [
            DataLoader(data, tokenizer, cfg, data_rank=d, data_ranks=self.dp, state=streams[d])
            for d in range(self.first, rows.stop // self.per_shard)
        ]

    def _streams_from(self, state: dict | None) -> list[dict | None]:
        if state is None:
            return [None] * self.dp
        if (set(state) == set(_KEYS) or set(state) == {"components", "tokens"}) and self.dp == 1:  # one stream's
            return [state]
        if set(state) != {"data_parallel", "streams"} or len(state["streams"]) != state["data_parallel"]:
            raise ValueError(f"data iterator state {state!r}; expected {{'data_parallel': D, 'streams': [D states]}}")
        if state["data_parallel"] != self.dp:
            log.warning(
                "the data position was saved for %d data-parallel shards and the mesh now has %d: it "
                "cannot carry over exactly, so every stream starts again from the beginning",
                state["data_parallel"],
                self.dp,
            )
            return [None] * self.dp
        return list(state["streams"])

    def start(self) -> MeshLoader:
        """Start every stream's prefetching now."""
        for loader in self.loaders:
            loader.start()
        return self

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(loader) for loader in self.loaders]  # StopIteration ends the whole loader
        if len(parts) == 1:  # one stream (one process, one data shard): its batch as it is, no copy
            return parts[0]
        a = self.accumulation
        return {
            k: np.concatenate([p[k].reshape(a, -1, *p[k].shape[1:]) for p in parts], axis=1).reshape(
                -1, *parts[0][k].shape[1:]
            )
            for k in parts[0]
        }

    def close(self) -> None:
        """Stop every stream's prefetch thread."""
        for loader in self.loaders:
            loader.close()

    def state_dict(self) -> dict[str, Any]:
        """The positions of this process's streams only (see `global_state_dict`)."""
        return {"first": self.first, "streams": [loader.state_dict() for loader in self.loaders]}

    def global_state_dict(self) -> dict[str, Any]:
        """Every stream's position, gathered from all processes (a collective: call it on all)."""
        import jax

        local = np.asarray([[self.first + i, *_flat(s)] for i, s in enumerate(self.state_dict()["streams"])], np.int64)
        width = local.shape[1]
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            local = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, width)
        parts = len(self.loaders[0].streams)
        streams: list[dict | None] = [None] * self.dp
        for row in local.tolist():
            streams[row[0]] = _unflat(row[1:], parts)
        if any(s is None for s in streams):
            raise RuntimeError(f"data streams {[d for d, s in enumerate(streams) if s is None]} have no process")
        return {"data_parallel": self.dp, "streams": streams}
