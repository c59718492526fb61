"""FP8 matmuls for training (`RuntimeConfig(fp8="tensor" | "row")`): the linear layers multiply in FP8 as
torchtitan's Float8 and MaxText's `fp8_gpu` do — activations and weights quantized to float8 e4m3 in the forward pass,
the incoming gradient to float8 e5m2 in the backward pass, each with a scale computed from the current tensor (its
absolute maximum over the whole tensor, `tensor`, or over each row of the activations and each output column of the
weight, `row`). Written as quantize-dequantize around an ordinary `dot` (`qdq`): XLA's GPU compiler turns that pattern
into cuBLASLt FP8 GEMMs on Hopper and newer; on a CPU it is emulated (the same numbers, no speed). Master weights,
optimizer state, checkpoints and exports are unchanged: only the products are FP8."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
"""The forward (activations, weights) and backward (gradients) formats."""
FP8_MODES = ("none", "tensor", "row")
"""`RuntimeConfig.fp8`: off, one scale per tensor, or one per row of the activations (and output column of the
weight, and row of the gradient)."""


def fp8_max(dtype) -> float:
    """The largest finite value of an FP8 format (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def scale_of(x: jax.Array, dtype, axis: int | None = None) -> jax.Array:
    """The scale that maps `x`'s absolute maximum (over `axis`, kept; None: the whole tensor) to `dtype`'s largest
    value, in float32 (1 where `x` is all zeros), without gradient."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=axis is not None)
    return jax.lax.stop_gradient(jnp.where(amax > 0, amax / fp8_max(dtype), 1.0))


def qdq(x: jax.Array, dtype, axis: int | None = None) -> jax.Array:
    """`x` rounded through FP8 `dtype` with its current scale and back, in `x`'s dtype: `cast(x / s) · s`."""
    s = scale_of(x, dtype, axis)
    q = jnp.clip(x.astype(jnp.float32) / s, -fp8_max(dtype), fp8_max(dtype)).astype(dtype)
    return (q.astype(jnp.float32) * s).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def fp8_dot(x: jax.Array, kernel: jax.Array, mode: str = "tensor", precision=None) -> jax.Array:
    """`x @ kernel` (x `[..., in]`, kernel `[in, out]`, one dtype) with both operands rounded through e4m3 (`mode`:
    `tensor` or `row` scales); its gradient takes the incoming gradient through e5m2 and multiplies it with the
    rounded operands, as FP8 training's backward GEMMs do."""
    return _forward(x, kernel, mode, precision)[0]


def _operands(x, kernel, mode):
    if mode == "row":
        return qdq(x, E4M3, axis=-1), qdq(kernel, E4M3, axis=0)
    return qdq(x, E4M3), qdq(kernel, E4M3)


def _forward(x, kernel, mode, precision):
    xq, wq = _operands(x, kernel, mode)
    return jnp.dot(xq, wq, precision=precision), (xq, wq)


def _backward(mode, precision, residuals, g):
    xq, wq = residuals
    gq = qdq(g, E5M2, axis=-1 if mode == "row" else None)
    dx = jnp.dot(gq, wq.T, precision=precision)
    rows = xq.reshape(-1, xq.shape[-1])
    dw = jnp.dot(rows.T, gq.reshape(-1, gq.shape[-1]), precision=precision)
    return dx.astype(xq.dtype), dw.astype(wq.dtype)


fp8_dot.defvjp(lambda x, kernel, mode, precision: _forward(x, kernel, mode, precision), _backward)
