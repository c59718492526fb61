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


class SparseMoE(nnx.Module):
    """Top-k routing (softmax, top-k, renormalised weights) over `E` experts stored stacked
    `[E, ...]` and sharded on the `expert` logical axis (→ `ep`).

    Compute is dropless and dense over experts: every expert sees every token and the router weights
    (zero outside the top-k) combine them. Exact, shards over `ep` with one reduction, and costs
    `E/k` times the FLOPs of a token-dispatching kernel: right for small expert counts and tests.
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
        probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)        # [B, T, E]
        top_w, top_i = jax.lax.top_k(probs, self.k)                                 # [B, T, k]
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
        chosen = jax.nn.one_hot(top_i, self.e, dtype=jnp.float32)                  # [B, T, k, E]
        weights = jnp.einsum("btk,btke->bte", top_w, chosen)                        # [B, T, E]
        h = self.act(jnp.einsum("btd,edf->btef", x.astype(dtype), self.w_gate[...].astype(dtype)))
        h = h * jnp.einsum("btd,edf->btef", x.astype(dtype), self.w_up[...].astype(dtype))
        h = constrain(h, ("batch", "length", "expert", "mlp"), self.runtime)
        out = jnp.einsum("btef,efd,bte->btd", h, self.w_down[...].astype(dtype), weights.astype(dtype))
        # Switch-style load balancing: E · Σ_e (share of routed slots to e) · (mean router prob of e).
        mask = jnp.ones(x.shape[:2], jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
        n = jnp.maximum(mask.sum(), 1.0)
        routed = jnp.einsum("btke,bt->e", chosen, mask) / (n * self.k)
        mean_prob = jnp.einsum("bte,bt->e", probs, mask) / n
        aux = self.e * jnp.sum(routed * mean_prob)
        return out, aux


@register("mixtral", TaskType.CAUSAL_LM)
class MixtralForCausalLM(CausalLM):
    """Mixtral (sparse mixture of experts) for causal language modelling; built like `LlamaForCausalLM`;
    its output carries the router's `aux_loss`."""

    config_class = MixtralConfig
    mlp_factory = SparseMoE
