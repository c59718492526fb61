"""Building blocks whose parameters carry logical axis names (`logical_axes` metadata)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jaxloom.mesh.axes import Kind

import jax
import jax.numpy as jnp
from flax import nnx

from .runtime import RuntimeConfig


def constrain(x: jax.Array, names: Sequence[str | None], runtime: RuntimeConfig, kind: Kind = "activation"):
    """Shard an activation by logical names when a mesh is set (`with jax.set_mesh(mesh)`); else a no-op."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:  # nothing to place; a constraint would only restrict XLA's fusions
        return x
    return jax.lax.with_sharding_constraint(x, runtime.partition_axis.spec(names, kind, mesh=mesh))


def matmul_precision(runtime: RuntimeConfig):
    """The `jax.lax.Precision` of `runtime.precision` for the matmuls (None: XLA's default)."""
    return None if runtime.precision is None else jax.lax.Precision[runtime.precision.upper()]


class Linear(nnx.Module):
    """`y = x @ kernel (+ bias)`, kernel `[in, out]` named by `axes`."""

    def __init__(
        self,
        din: int,
        dout: int,
        axes: tuple[str | None, str | None],
        runtime: RuntimeConfig,
        *,
        use_bias: bool = False,
        std: float = 0.02,
        rngs: nnx.Rngs,
    ):
        init = jax.nn.initializers.normal(std)
        self.kernel = nnx.Param(init(rngs.params(), (din, dout), runtime.param_dtype), logical_axes=axes)
        self.bias = nnx.Param(jnp.zeros((dout,), runtime.param_dtype), logical_axes=(axes[1],)) if use_bias else None
        self.dtype, self.precision = runtime.dtype, matmul_precision(runtime)
        self.fp8 = getattr(runtime, "fp8", "none")

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fp8 != "none":  # FP8 training (`RuntimeConfig.fp8`): the product's operands rounded through FP8
            from .fp8_training import fp8_dot

            y = fp8_dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), self.fp8, self.precision)
        else:
            y = jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), precision=self.precision)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, runtime: RuntimeConfig, *, std: float = 0.02, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(std)
        self.embedding = nnx.Param(
            init(rngs.params(), (vocab, dim), runtime.param_dtype), logical_axes=("vocab", "embed")
        )
        self.dtype, self.precision = runtime.dtype, matmul_precision(runtime)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied output projection: `x @ embedding.T`."""
        return jnp.dot(x.astype(self.dtype), self.embedding[...].astype(self.dtype).T, precision=self.precision)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis, computed in float32, with a learned scale per feature.

    `style` is how a family applies the scale, which matters in low precision: `llama` casts the normed
    input to the compute dtype, then multiplies by the weight (Llama, Qwen, Mistral, Phi-3); `olmo`
    multiplies in float32, then casts (OLMo 2); `gemma` multiplies by `1 + weight` in float32, then
    casts, with the weight stored as an offset from one (initialised to zeros, as Gemma's checkpoints
    hold it)."""

    def __init__(self, dim: int, eps: float, runtime: RuntimeConfig, style: str = "llama"):
        if style not in ("llama", "olmo", "gemma"):
            raise ValueError(f"RMSNorm style {style!r}; expected llama, olmo or gemma")
        init = jnp.zeros if style == "gemma" else jnp.ones
        self.weight = nnx.Param(init((dim,), runtime.param_dtype), logical_axes=("norm",))
        self.eps, self.dtype, self.style = eps, runtime.dtype, style

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        if self.style == "llama":
            return self.weight[...].astype(self.dtype) * h.astype(self.dtype)
        w = self.weight[...].astype(jnp.float32)
        return (h * (1.0 + w) if self.style == "gemma" else h * w).astype(self.dtype)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


# ---- rotary position embeddings --------------------------------------------------------------------


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_positions: int,
    seq_len: int | None = None,
    positions: jax.Array | None = None,
) -> tuple[jax.Array, Any]:
    """`(inv_freq [head_dim/2], attention_scaling)` for the rope types transformers knows:
    default, linear, dynamic (NTK), llama3, yarn and longrope. `seq_len` is this call's length (dynamic);
    `positions` are its token positions: longrope picks its long factors when the largest one reaches
    past `original_max_position_embeddings`, as transformers does per forward pass."""
    exps = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv = 1.0 / (theta**exps)
    if not scaling:
        return inv, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor = float(scaling.get("factor") or 1.0)
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "dynamic":
        original = scaling.get("original_max_position_embeddings", max_positions)
        if seq_len is not None and seq_len > original:
            base = theta * ((factor * seq_len / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
            inv = 1.0 / (base**exps)
        return inv, 1.0
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        out = jnp.where(wavelen > original / low, inv / factor, inv)
        mid = (wavelen <= original / low) & (wavelen >= original / high)
        return jnp.where(mid, smoothed, out), 1.0
    if kind == "yarn":  # transformers' _compute_yarn_parameters, key for key
        original = scaling.get("original_max_position_embeddings", max_positions)
        factor = float(scaling.get("factor") or max_positions / original)
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def mscale_of(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = scaling.get("attention_factor")
        if attention is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attention = mscale_of(factor, m) / mscale_of(factor, m_all) if m and m_all else mscale_of(factor)

        def dim_for(rot):
            return head_dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = dim_for(beta_fast), dim_for(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - lo) / (hi - lo if hi != lo else 1e-3), 0, 1)
        extrapolation = 1 - ramp
        return (inv / factor) * (1 - extrapolation) + inv * extrapolation, float(attention)
    if kind == "longrope":  # transformers' _compute_longrope_parameters and longrope_frequency_update
        original = int(scaling["original_max_position_embeddings"])
        factor = float(scaling.get("factor") or max_positions / original)
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        base = theta**exps
        short = 1.0 / (jnp.asarray(scaling["short_factor"], jnp.float32) * base)
        if positions is None:
            return short, float(attention)
        long = 1.0 / (jnp.asarray(scaling["long_factor"], jnp.float32) * base)
        return jnp.where(jnp.max(positions) + 1 > original, long, short), float(attention)
    return inv, 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: Any = 1.0) -> jax.Array:
    """Rotate `x [B, T, N, H]` by `positions [B, T]` (the rotate-half convention of HF Llama), or by `positions
    [B, T, H/2]`, a position per rotated pair (multimodal RoPE: Qwen2.5-VL's sections of pairs turn with a token's
    frame, row or column)."""
    positions = positions.astype(jnp.float32)
    angles = (positions if positions.ndim == 3 else positions[..., None]) * inv_freq  # [B, T, H/2]
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
