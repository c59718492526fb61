"""The attention layer (`Attention`) and a decoder layer's causal self-attention over its keys or its KV cache
(`self_attention`), on the backends of `attention.backends`."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp

from ..configs import LlamaConfig
from ..layers import Linear, RMSNorm, apply_rope, constrain, rope_frequencies
from ..runtime import RuntimeConfig
from .backends import attend

__all__ = ["Attention", "self_attention"]


def self_attention(
    q,
    k,
    v,
    runtime: RuntimeConfig,
    *,
    positions,
    segment_ids,
    cache=None,
    cache_index=None,
    kv_positions=None,
    kv_segment_ids=None,
    window=None,
    scale=None,
    softcap=None,
    sinks=None,
    q_horizon=None,
):
    """A decoder layer's causal self-attention of `q [B, T, N, H]` over this call's `k, v [B, T, K, H]`, or, with
    `cache=(k, v)` (`[B, S, K, H]` each), over the cache after writing this call's keys and values at
    `cache_index` (its slots described by `kv_positions` / `kv_segment_ids`): `(out [B, T, N, H], new_cache)`.
    The backend, block size and sharding are `runtime`'s; `window`, `scale`, `softcap`, `sinks` and `q_horizon` as
    `attend`."""
    if cache is not None:
        at = (0, cache_index, 0, 0)
        cache = (
            jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), at),
            jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), at),
        )
        k, v = cache[0].astype(q.dtype), cache[1].astype(q.dtype)
    q = constrain(q, ("batch", "query_length", "heads", "head_dim"), runtime)
    k = constrain(k, ("batch", "key_length", "kv_heads", "kv_head_dim"), runtime)
    v = constrain(v, ("batch", "key_length", "kv_heads", "kv_head_dim"), runtime)
    out = attend(
        q,
        k,
        v,
        q_segment_ids=segment_ids,
        q_positions=positions,
        kv_segment_ids=kv_segment_ids if cache is not None else None,
        kv_positions=kv_positions if cache is not None else None,
        causal=True,
        window=window,
        implementation=runtime.attn_mechanism,
        cached=cache is not None,
        block_size=runtime.attn_block_size,
        scale=scale,
        softcap=softcap,
        sinks=sinks,
        max_documents=runtime.attn_max_documents,
        q_horizon=q_horizon,
    )
    return out, cache


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, as the family's config says: biases (`qkv_bias`, `o_bias`),
    q/k RMSNorm (`qk_norm`: per head, Qwen3 / Gemma 3; over the whole projection, OLMo 2), the logit
    scale (`attention_scale`, Gemma's `query_pre_attn_scalar`) and soft-cap (`attention_softcap`), and a learned
    sink logit per head (`attention_sinks`: GPT-OSS's `sinks`)."""

    def __init__(self, config: LlamaConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        d, n, kv, h = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        std = config.initializer_range
        self.q_proj = Linear(d, n * h, ("embed", "heads"), runtime, use_bias=config.qkv_bias, std=std, rngs=rngs)
        self.k_proj = Linear(d, kv * h, ("embed", "kv_heads"), runtime, use_bias=config.qkv_bias, std=std, rngs=rngs)
        self.v_proj = Linear(d, kv * h, ("embed", "kv_heads"), runtime, use_bias=config.qkv_bias, std=std, rngs=rngs)
        self.o_proj = Linear(n * h, d, ("heads", "embed"), runtime, use_bias=config.o_bias, std=std, rngs=rngs)
        self.qk_norm = config.qk_norm
        if self.qk_norm is None:
            self.q_norm = self.k_norm = None
        else:
            q_dim, k_dim = (h, h) if self.qk_norm == "head" else (n * h, kv * h)
            self.q_norm = RMSNorm(q_dim or 0, config.rms_norm_eps, runtime, config.norm_style)
            self.k_norm = RMSNorm(k_dim or 0, config.rms_norm_eps, runtime, config.norm_style)
        self.sinks = (
            nnx.Param(jax.nn.initializers.normal(std)(rngs.params(), (n,), runtime.param_dtype), logical_axes=(None,))
            if config.attention_sinks
            else None
        )
        self.n, self.kv, self.h = n, kv, h
        self.config, self.runtime = config, runtime

    def __call__(
        self,
        x,
        positions,
        segment_ids,
        cache=None,
        cache_index=None,
        kv_positions=None,
        kv_segment_ids=None,
        *,
        window=None,
        rope=None,
        rope_positions=None,
        q_horizon=None,
    ):
        """Self-attention of `x [B, T, D]`. With `cache=(k, v)` (`[B, S, KV, H]` each), this call's keys and
        values are written at `cache_index` and attention runs over the whole cache, whose slots are
        described by `kv_positions` / `kv_segment_ids` `[B, S]`; returns `(out, new_cache)`. `rope`
        (`(inv_freq, scale)`) and `window` are this layer's (a model passes them per layer); without
        `rope`, both are the config's. `rope_positions` (`[B, T]`, or `[B, T, H/2]` a position per rotated pair) turn
        q and k in place of `positions`, which then only order the tokens (multimodal RoPE). `q_horizon [B, T]`: the
        last position each query sees (`attend`'s; Gemma 3's image tokens see their whole image)."""
        b, t, _ = x.shape
        rt, c = self.runtime, self.config
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.reshape(b, t, self.n, self.h), k.reshape(b, t, self.kv, self.h)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).reshape(b, t, self.kv, self.h)
        if rope is None:
            kind = c.attention_types()[0]
            window = c.window_of(kind)
            rope = rope_frequencies(self.h, *c.rope_of(kind), c.max_position_embeddings, seq_len=t, positions=positions)
            rope = rope if c.uses_rope(kind) else (jnp.zeros_like(rope[0]), rope[1])
        inv_freq, scale = rope
        turn = positions if rope_positions is None else rope_positions
        q, k = apply_rope(q, turn, inv_freq, scale), apply_rope(k, turn, inv_freq, scale)
        out, cache = self_attention(
            q,
            k,
            v,
            rt,
            positions=positions,
            segment_ids=segment_ids,
            cache=cache,
            cache_index=cache_index,
            kv_positions=kv_positions,
            kv_segment_ids=kv_segment_ids,
            window=window,
            scale=c.attention_scale,
            softcap=c.attention_softcap,
            sinks=None if self.sinks is None else self.sinks[...],
            q_horizon=q_horizon,
        )
        return self.o_proj(out.reshape(b, t, self.n * self.h)), cache
