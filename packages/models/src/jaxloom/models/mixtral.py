"""Mixtral: the Llama decoder with a top-k routed mixture of experts as feed-forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .configs import MixtralConfig
from .layers import ACTIVATIONS, Linear, constrain
from .llama import CausalLM
from .registry import TaskType, register
from .runtime import RuntimeConfig


def resolve_moe_implementation(requested: str, platform: str | None = None) -> str:
    """`auto` → `ragged` on GPU/TPU (grouped GEMM kernels), `tiled` elsewhere: XLA's CPU backend lowers
    `ragged_dot` to a dense product over every expert (measured: 4× the FLOPs from E=2 to E=8)."""
    if requested != "auto":
        return requested
    return "ragged" if (platform or jax.default_backend()) in ("gpu", "cuda", "rocm", "tpu") else "tiled"


def tile_rows(rows: int, groups: int, largest: int = 128) -> int:
    """Rows per tile of the `tiled` grouped matmul: a power of two, at most `largest`, and small enough
    that the padding of one partial tile per group (`groups · tile`) stays under a quarter of `rows`."""
    tile = 8
    while tile < largest and groups * tile * 2 * 4 <= rows:
        tile *= 2
    return tile


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, implementation: str, tile: int | None = None
) -> jax.Array:
    """`x [M, D]` whose rows are sorted by group, `w [E, D, F]`, `group_sizes [E]` (summing to M) →
    `[M, F]`, row i multiplied by the weights of its group.

    `implementation` `ragged`: `lax.ragged_dot`. `tiled`: each group's rows are placed into `tile`-row tiles (a group
    starts a new tile), every tile gathers its one expert's weights and the tiles run as one batched
    matmul: `(M + E·tile)·D·F` multiply-adds instead of `E·M·D·F`, static shapes, any platform.
    `tile` defaults to `tile_rows(M, E)`.
    """
    if implementation == "ragged":
        return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype)
    m, d = x.shape
    e = w.shape[0]
    tile = tile or tile_rows(m, e)
    tiles = -(-m // tile) + e  # enough: sum over groups of ceil(size / tile) < m / tile + e
    padded = -(-group_sizes // tile) * tile  # each group's rows rounded up to tiles
    padded_end = jnp.cumsum(padded)
    start = jnp.cumsum(group_sizes) - group_sizes  # first sorted row of each group
    group_of_row = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")
    dest = (padded_end - padded)[group_of_row] + jnp.arange(m) - start[group_of_row]
    x_tiles = jnp.zeros((tiles * tile, d), x.dtype).at[dest].set(x).reshape(tiles, tile, d)
    tile_group = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(tiles) * tile, side="right"), e - 1)
    y = jnp.einsum("tmd,tdf->tmf", x_tiles, w[tile_group])
    return y.reshape(tiles * tile, -1)[dest]


class SparseMoE(nnx.Module):
    """Top-k routing (softmax, top-k, renormalised weights) over `E` experts stored stacked
    `[E, ...]` and sharded on the `expert` logical axis (→ `ep`).

    Dropless token dispatch: the `N·k` (token, expert) pairs are sorted by expert, each expert's rows
    go through its weights in one grouped matmul (`grouped_matmul`), and the results are scattered
    back and combined with the router weights, so FLOPs follow `k`, not `E`. `moe_implementation=
    "dense"` runs every expert on every token instead (exact, `E/k` times the FLOPs): the reference
    the tests compare against.
    """

    def __init__(self, config: MixtralConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        e, d, f, std = config.num_local_experts, config.hidden_size, config.intermediate_size, config.initializer_range
        init = jax.nn.initializers.normal(std)
        self.gate = Linear(d, e, ("embed", None), runtime, std=std, rngs=rngs)

        def param(shape, axes):
            return nnx.Param(init(rngs.params(), shape, runtime.param_dtype), logical_axes=axes)

        self.w_gate = param((e, d, f), ("expert", "embed", "mlp"))
        self.w_up = param((e, d, f), ("expert", "embed", "mlp"))
        self.w_down = param((e, f, d), ("expert", "mlp", "embed"))
        self.k, self.e = config.num_experts_per_tok, e
        self.act, self.runtime = ACTIVATIONS[config.hidden_act], runtime

    def __call__(self, x, token_mask=None):
        dtype = self.runtime.dtype
        probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)  # [B, T, E]
        top_w, top_i = jax.lax.top_k(probs, self.k)  # [B, T, k]
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
        chosen = jax.nn.one_hot(top_i, self.e, dtype=jnp.float32)  # [B, T, k, E]
        impl = resolve_moe_implementation(self.runtime.moe_implementation)
        w_gate, w_up, w_down = (w[...].astype(dtype) for w in (self.w_gate, self.w_up, self.w_down))
        if impl == "dense":
            weights = jnp.einsum("btk,btke->bte", top_w, chosen)  # [B, T, E]
            h = self.act(jnp.einsum("btd,edf->btef", x.astype(dtype), w_gate))
            h = h * jnp.einsum("btd,edf->btef", x.astype(dtype), w_up)
            h = constrain(h, ("batch", "length", "expert", "mlp"), self.runtime)
            out = jnp.einsum("btef,efd,bte->btd", h, w_down, weights.astype(dtype))
        else:
            out = self._dispatch(x.astype(dtype), top_i, top_w, w_gate, w_up, w_down, impl)
        # Switch-style load balancing: E · Σ_e (share of routed slots to e) · (mean router prob of e).
        mask = jnp.ones(x.shape[:2], jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
        n = jnp.maximum(mask.sum(), 1.0)
        routed = jnp.einsum("btke,bt->e", chosen, mask) / (n * self.k)
        mean_prob = jnp.einsum("bte,bt->e", probs, mask) / n
        aux = self.e * jnp.sum(routed * mean_prob)
        return out, aux

    def _dispatch(self, x, top_i, top_w, w_gate, w_up, w_down, impl):
        """Sort the (token, expert) pairs by expert, run each expert on its rows, scatter back, combine."""
        b, t, d = x.shape
        flat_expert = top_i.reshape(-1)  # [N·k]
        order = jnp.argsort(flat_expert, stable=True)
        rows = x.reshape(b * t, d)[order // self.k]  # [N·k, D] sorted by expert
        sizes = jnp.bincount(flat_expert, length=self.e).astype(jnp.int32)
        h = self.act(grouped_matmul(rows, w_gate, sizes, implementation=impl))
        h = h * grouped_matmul(rows, w_up, sizes, implementation=impl)
        y = grouped_matmul(h, w_down, sizes, implementation=impl)  # [N·k, D]
        y = jnp.zeros_like(y).at[order].set(y).reshape(b, t, self.k, d)
        return jnp.einsum("btkd,btk->btd", y, top_w.astype(y.dtype))


@register("mixtral", TaskType.CAUSAL_LM)
class MixtralForCausalLM(CausalLM):
    """Mixtral (sparse mixture of experts) for causal language modelling; built like `LlamaForCausalLM`;
    its output carries the router's `aux_loss`."""

    config_class = MixtralConfig
    mlp_factory = SparseMoE
