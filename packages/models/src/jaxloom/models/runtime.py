"""`RuntimeConfig`: how a model runs (dtypes, attention kernel, remat, sharding names), apart from what it is."""

from __future__ import annotations

import dataclasses
import enum
from typing import Annotated, Any, Literal

import jax
import jax.numpy as jnp

from pydantic import AfterValidator, BeforeValidator

from jaxloom.mesh import PartitionAxis
from jaxloom.core.schema import PositiveInt, config

AttnMechanism = Literal["auto", "xla", "chunked", "cudnn", "flash"]
RematPolicy = Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"]
ATTN_MECHANISMS = ("auto", "xla", "chunked", "cudnn", "flash")
MOE_IMPLEMENTATIONS = ("auto", "ragged", "tiled", "dense")
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")


class AttentionMechanisms(str, enum.Enum):
    """EasyDeL's attention names; each runs on one of jaxloom's backends (`ATTN_ALIASES`): its Pallas
    kernels on `flash`, its cuDNN/SDPA paths on `cudnn`, blockwise on `chunked`, vanilla on `xla`."""

    AUTO = "auto"
    VANILLA = "vanilla"
    DOT_PRODUCT = "dot_product"
    XLA = "xla"
    CHUNKED = "chunked"
    BLOCKWISE = "blockwise"
    SDPA = "sdpa"
    CUDNN = "cudnn"
    FLASH = "flash"
    FLASH_ATTN2 = "flash_attn2"
    SPLASH = "splash"


class EasyDeLGradientCheckPointers(str, enum.Enum):
    """EasyDeL's gradient-checkpointing names; each is one of jaxloom's remat policies (`REMAT_ALIASES`)."""

    NONE = "none"
    EVERYTHING_SAVEABLE = "everything_saveable"
    NOTHING_SAVEABLE = "nothing_saveable"
    FULL = "full"
    SELECTIVE = "selective"
    CHECKPOINT_DOTS = "checkpoint_dots"
    CHECKPOINT_DOTS_WITH_NO_BATCH_DMIS = "checkpoint_dots_with_no_batch_dims"
    DOTS_SAVEABLE = "dots_saveable"
    DOTS_WITH_NO_BATCH_DIMS_SAVEABLE = "dots_with_no_batch_dims_saveable"


# EasyDeL's (and earlier) attention names → the backend each runs on.
ATTN_ALIASES = {
    "vanilla": "xla",
    "dot_product": "xla",
    "blockwise": "chunked",
    "sdpa": "cudnn",
    "flash_attn2": "flash",
    "splash": "flash",
}
# EasyDeL's gradient-checkpointing names → remat policies ("everything saveable" saves all: no remat).
REMAT_ALIASES = {
    "everything_saveable": "none",
    "nothing_saveable": "full",
    "selective": "dots_saveable",
    "checkpoint_dots": "dots_saveable",
    "checkpoint_dots_with_no_batch_dims": "dots_with_no_batch_dims_saveable",
}


def _canonical(name: Any, aliases: dict[str, str], known: tuple[str, ...], what: str) -> str:
    key = str(getattr(name, "value", name)).lower()  # enum members by their value
    key = aliases.get(key, key)
    if key not in known:
        raise ValueError(f"{what} {name!r}; expected one of {sorted({*known, *aliases})}")
    return key


def attn_backend(name: Any) -> str:
    """The backend an attention name (ours, EasyDeL's or an `AttentionMechanisms`) runs on."""
    return _canonical(name, ATTN_ALIASES, ATTN_MECHANISMS, "attn_mechanism")


def remat_policy(name: Any) -> str:
    """The remat policy a gradient-checkpointing name (ours, EasyDeL's or an enum member) means."""
    return _canonical(name, REMAT_ALIASES, REMAT_POLICIES, "remat")


# `scan_layers=None` scans stacks deeper than this. Measured (docs/performance.md): scanning 8 layers cost 12%
# of a CPU train step (8.4M Llama) and saved 0.6 s of its compile; at 32 layers unrolling costs 5.8 s more
# compile. Decided by depth alone, so a checkpoint's layout never depends on the platform that wrote it.
SCAN_ABOVE_LAYERS = 16
"""`RuntimeConfig(scan_layers=None)` scans decoder stacks of more layers than this."""


FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""The dtypes a model computes in and stores its parameters in (`dtype`, `param_dtype`)."""


def to_dtype(value: Any) -> Any:
    """`"bfloat16"`, `jnp.bfloat16` or `np.dtype` → a numpy floating dtype; a clear error otherwise (an integer
    dtype would reach JAX's initializers as "dtype argument to 'normal' must be a float")."""
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise ValueError(f"{value!r} is not a dtype; expected one of {', '.join(FLOAT_DTYPES)}") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{dtype.name} is not a floating dtype; expected one of {', '.join(FLOAT_DTYPES)} (quantized weights: "
            "load_in_8bit or load_in_4bit)"
        )
    return dtype


def _precision_name(name: str | None) -> str | None:
    if name is not None and name.lower() not in ("default", "high", "highest"):
        raise ValueError(f"precision {name!r}; expected None, 'default', 'high' or 'highest'")
    return name


DType = Annotated[Any, BeforeValidator(to_dtype)]
"""A dtype field: `"bfloat16"`, `jnp.bfloat16` or a numpy dtype, stored as a numpy dtype."""


@config
class RuntimeConfig:
    """Args:
    dtype: computation dtype. param_dtype: storage dtype of the parameters.
    precision: `jax.lax.Precision` name for matmuls (None = default).
    attn_mechanism: the attention backend (`attention.attend`): 'xla' (reference, materialised mask),
      'chunked' (blockwise, linear memory, any platform), 'cudnn' (NVIDIA), 'flash' (Pallas, GPU/TPU)
      or 'auto' (by platform and length). An explicit backend that cannot run is an error.
      EasyDeL's names and `AttentionMechanisms` members are read as the backend they run on.
    attn_block_size: keys per block of the 'chunked' backend.
    attn_max_documents: documents a row that 'cudnn' keeps apart in its packed layout (MaxText's
      `max_segments_per_seq`); its softmax statistics take `B·M·N·T` floats a layer. A row with more runs the
      'flash' kernel for that step (same result, slower).
    remat: rematerialisation of each decoder layer: none, full, or a policy saving matmul outputs
      (EasyDeL's gradient-checkpointing names and `EasyDeLGradientCheckPointers` members are read too).
    scan_layers: stack the decoder layers' parameters and run them with one `lax.scan` (compile time
      flat in depth); None = scan when the model has more than `SCAN_ABOVE_LAYERS` (16) layers.
    scan_unroll: layers per iteration of a scanned stack (`lax.scan`'s `unroll`). The parameters stay stacked
      whatever it is (a checkpoint's layout never depends on it); unrolled iterations give XLA straight-line
      code across layers: the speed of unrolled layers for their compile time. None: every layer on CPU and
      GPU (measured on CPU: a scanned 18-layer step 19 % slower than unrolled at 1, as fast at 18; on an H100
      the rolled scan cost 25 %), 1 on TPU (compile time flat in depth, as MaxText scans).
    moe_implementation: how routed experts compute: 'ragged' (`lax.ragged_dot`, grouped GEMM kernels on
      GPU/TPU), 'tiled' (tokens sorted by expert in fixed tiles, pure JAX: FLOPs follow k on any
      platform), 'dense' (every expert on every token: the test reference) or 'auto' (ragged on
      GPU/TPU, tiled on CPU, where XLA lowers ragged_dot densely).
    fp8: FP8 training of the decoder's linear layers (`fp8_training`): 'none', 'tensor' (one scale per tensor)
      or 'row' (per row of the activations and gradients, per output column of the weights); e4m3 forward, e5m2
      gradients, scales from the current tensors. The output layer stays in `dtype`.
    partition_axis: the logical → mesh axis mapping used for parameters and activations.
    """

    dtype: DType = jnp.dtype("float32")
    param_dtype: DType = jnp.dtype("float32")
    precision: Annotated[str | None, AfterValidator(_precision_name)] = None
    attn_mechanism: Annotated[str, BeforeValidator(attn_backend)] = "auto"
    attn_block_size: PositiveInt = 512
    attn_max_documents: PositiveInt = 32
    remat: Annotated[str, BeforeValidator(remat_policy)] = "none"
    scan_layers: bool | None = None
    scan_unroll: PositiveInt | None = None
    moe_implementation: Literal["auto", "ragged", "tiled", "dense"] = "auto"
    fp8: Literal["none", "tensor", "row"] = "none"
    partition_axis: PartitionAxis = dataclasses.field(default_factory=PartitionAxis)

    def unroll(self, num_layers: int, platform: str | None = None) -> int:
        """The `lax.scan` unroll of a scanned stack of `num_layers` layers on `platform` (default: JAX's
        backend): `scan_unroll`, or by platform when it is None (see the field)."""
        if self.scan_unroll is not None:
            return max(1, min(self.scan_unroll, num_layers))
        return 1 if (platform or jax.default_backend()) == "tpu" else num_layers

    def scans(self, num_layers: int) -> bool:
        """Whether a model of `num_layers` decoder layers runs them as one scanned stack."""
        return num_layers > SCAN_ABOVE_LAYERS if self.scan_layers is None else bool(self.scan_layers)

    def replace(self, **changes: Any) -> RuntimeConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)
