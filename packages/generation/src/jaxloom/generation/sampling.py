"""Choosing the next token from logits: greedy, temperature, top-k, top-p."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import GenerationConfig


def filter_logits(logits: jax.Array, top_k: int | None, top_p: float | None) -> jax.Array:
    """Set `logits` outside the `top_k` most likely and outside the smallest set with probability >=
    `top_p` to -inf (None disables either)."""
    neg = jnp.finfo(logits.dtype).min
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if top_p is not None and top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        keep_sorted = before < top_p  # always keeps the most likely token
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, neg)
    return logits


def next_token(logits: jax.Array, rng: jax.Array, config: GenerationConfig, rows: jax.Array | None = None) -> jax.Array:
    """`logits [B, V]` → token ids `[B]`: greedy, or sampled as `config` says, each row with its own key
    `fold_in(rng, row)` (`rows [B]`: the rows' ids, default 0..B-1), so that a row's sample does not depend on
    which other rows share its batch (a decoder may drop finished rows, or stream one row alone)."""
    rows = jnp.arange(logits.shape[0], dtype=jnp.int32) if rows is None else rows
    return sample_with_keys(logits, jax.vmap(jax.random.fold_in, (None, 0))(rng, rows), config)


def sample_with_keys(logits: jax.Array, keys: jax.Array, config: GenerationConfig) -> jax.Array:
    """`logits [B, V]` → token ids `[B]`: the argmax when `config` is greedy, else each row sampled with its own
    key (`keys [B, 2]`) after temperature and top-k/top-p."""
    logits = logits.astype(jnp.float32)
    if config.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = filter_logits(logits / config.temperature, config.top_k, config.top_p)
    return jax.vmap(lambda z, k: jax.random.categorical(k, z))(logits, keys).astype(jnp.int32)
