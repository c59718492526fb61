"""`RuntimeConfig`: how a model runs (dtypes, attention kernel, remat, sharding names), apart from what it is."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

from jaxloom.mesh import PartitionAxis

AttnMechanism = Literal["auto", "vanilla", "dot_product"]
RematPolicy = Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"]
ATTN_MECHANISMS = ("auto", "vanilla", "dot_product")
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")


def to_dtype(value: Any) -> Any:
    """`"bfloat16"`, `jnp.bfloat16` or `np.dtype` → a numpy dtype; a clear error otherwise."""
    try:
        return jnp.dtype(value)
    except TypeError as e:
        raise ValueError(f"{value!r} is not a dtype; expected e.g. 'float32' or 'bfloat16'") from e


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Args:
      dtype: computation dtype. param_dtype: storage dtype of the parameters.
      precision: `jax.lax.Precision` name for matmuls (None = default).
      attn_mechanism: 'vanilla' (reference einsum), 'dot_product' (`jax.nn.dot_product_attention`,
        cuDNN flash attention on GPU) or 'auto' (dot_product).
      remat: rematerialisation of each decoder layer: none, full, or a policy saving matmul outputs.
      partition_axis: the logical → mesh axis mapping used for parameters and activations.
    """

    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    precision: str | None = None
    attn_mechanism: AttnMechanism = "auto"
    remat: RematPolicy = "none"
    partition_axis: PartitionAxis = dataclasses.field(default_factory=PartitionAxis)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", to_dtype(self.dtype))
        object.__setattr__(self, "param_dtype", to_dtype(self.param_dtype))
        if self.attn_mechanism not in ATTN_MECHANISMS:
            raise ValueError(f"attn_mechanism {self.attn_mechanism!r}; expected one of {ATTN_MECHANISMS}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat {self.remat!r}; expected one of {REMAT_POLICIES}")
        if self.precision not in (None, "default", "high", "highest", "DEFAULT", "HIGH", "HIGHEST"):
            raise ValueError(f"precision {self.precision!r}; expected None, 'default', 'high' or 'highest'")
        if isinstance(self.partition_axis, dict):
            object.__setattr__(self, "partition_axis", PartitionAxis.from_dict(self.partition_axis))

    def replace(self, **changes: Any) -> RuntimeConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)
