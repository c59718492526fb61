"""jaxloom.mesh: device meshes, logical axes, partition rules, sharding, RNG streams, batch sizes."""

from .__about__ import __version__
from .axes import LOGICAL_NAMES, PartitionAxis
from .batch import (
    DATA_AXES,
    batch_spec,
    data_parallel_size,
    get_accumulate_grad_batches,
    get_local_global_micro_batch_size,
    local_batch_slice,
)
from .config import MeshConfig, resolve_dims
from .distributed import init_distributed, simulate_cpu_devices
from .rng import RngStream
from .rules import auto_partition_rules, match_partition_rules, named_leaves, path_str, validate_specs
from .sharding import gather, replicated, shard, specs_to_named_sharding

__all__ = [
    "DATA_AXES",
    "LOGICAL_NAMES",
    "MeshConfig",
    "PartitionAxis",
    "RngStream",
    "__version__",
    "auto_partition_rules",
    "batch_spec",
    "data_parallel_size",
    "gather",
    "get_accumulate_grad_batches",
    "get_local_global_micro_batch_size",
    "init_distributed",
    "local_batch_slice",
    "match_partition_rules",
    "named_leaves",
    "path_str",
    "replicated",
    "resolve_dims",
    "shard",
    "simulate_cpu_devices",
    "specs_to_named_sharding",
    "validate_specs",
]
