"""Attention: masks from padding / packing / causality / windows, and two implementations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .configs import LlamaConfig
from .layers import Linear, apply_rope, constrain, rope_frequencies
from .runtime import RuntimeConfig


def make_attention_mask(segment_ids: jax.Array, q_positions: jax.Array, k_positions: jax.Array,
                   sliding_window: int | None = None, kv_segment_ids: jax.Array | None = None) -> jax.Array:
    """Boolean `[B, T, S]`: query t may see key s iff same segment (segment 0 = padding, sees nothing),
    s is not after t, and (with a window) t - s < window. Positions order tokens inside a segment.

    Arguments, grouped:

    - `segment_ids`: `[B, T]` document ids of the queries (and of the keys, unless `kv_segment_ids`).
    - `q_positions`, `k_positions`: `[B, T]` and `[B, S]` positions of queries and keys.
    - `sliding_window`: the window in tokens, or None.
    - `kv_segment_ids`: `[B, S]` document ids of the keys when they differ from the queries' (KV cache).
    """
    kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
    same = (segment_ids[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
    causal = k_positions[:, None, :] <= q_positions[:, :, None]
    mask = same & causal
    if sliding_window is not None:
        mask &= (q_positions[:, :, None] - k_positions[:, None, :]) < sliding_window
    return mask


def vanilla_attention(q, k, v, mask, dtype):
    """Reference: `q [B,T,N,H]`, `k, v [B,S,K,H]` (GQA: N = K·G), `mask [B,T,S]`; softmax in float32."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    q = q.reshape(b, t, kh, n // kh, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(h).astype(jnp.float32)
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, n, h)


def fast_attention(q, k, v, mask, dtype):
    """`jax.nn.dot_product_attention` (XLA on CPU, cuDNN flash attention where it applies on GPU)."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None]).astype(dtype)


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        d, n, kv, h = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        std = config.initializer_range
        self.q_proj = Linear(d, n * h, ("embed", "heads"), runtime, use_bias=config.qkv_bias, std=std, rngs=rngs)
        self.k_proj = Linear(d, kv * h, ("embed", "kv_heads"), runtime, use_bias=config.qkv_bias, std=std, rngs=rngs)
        self.v_proj = Linear(d, kv * h, ("embed", "kv_heads"), runtime, use_bias=config.qkv_bias, std=std, rngs=rngs)
        self.o_proj = Linear(n * h, d, ("heads", "embed"), runtime, use_bias=config.o_bias, std=std, rngs=rngs)
        self.n, self.kv, self.h = n, kv, h
        self.config, self.runtime = config, runtime
        self.impl = vanilla_attention if runtime.attn_mechanism == "vanilla" else fast_attention

    def __call__(self, x, positions, mask, cache=None, cache_index=None):
        """With `cache=(k, v)` (`[B, S, KV, H]` each), this call's keys and values are written at
        `cache_index` and attention runs over the whole cache; returns `(out, new_cache)`."""
        b, t, _ = x.shape
        rt = self.runtime
        q = self.q_proj(x).reshape(b, t, self.n, self.h)
        k = self.k_proj(x).reshape(b, t, self.kv, self.h)
        v = self.v_proj(x).reshape(b, t, self.kv, self.h)
        inv_freq, scale = rope_frequencies(self.h, self.config.rope_theta, self.config.rope_scaling,
                                           self.config.max_position_embeddings, seq_len=t)
        q, k = apply_rope(q, positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale)
        if cache is not None:
            at = (0, cache_index, 0, 0)
            cache = (jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), at),
                     jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), at))
            k, v = cache[0].astype(q.dtype), cache[1].astype(q.dtype)
        q = constrain(q, ("batch", "query_length", "heads", "head_dim"), rt)
        k = constrain(k, ("batch", "key_length", "kv_heads", "kv_head_dim"), rt)
        v = constrain(v, ("batch", "key_length", "kv_heads", "kv_head_dim"), rt)
        out = self.impl(q, k, v, mask, rt.dtype)
        return self.o_proj(out.reshape(b, t, self.n * self.h)), cache
