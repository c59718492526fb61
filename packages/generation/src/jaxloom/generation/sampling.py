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


def sample_rows(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Each row of `logits [B, V]` with its own key (`keys [B, 2]`) and settings `[B]` (a server's requests
    differ): `temperature` (0: greedy), `top_k` (0: off), then `top_p` over what top-k kept (1: off), as
    `filter_logits` does for one setting. Returns `(token [B], logp [B])`, `logp` the token's log-probability
    under the float32 logits over the temperature (1 when greedy) before top-k/top-p: what a trainer's forward
    pass gives."""
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)[:, None]
    z = logits / t
    ordered = -jnp.sort(-z, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    kept = jnp.where(jnp.arange(v)[None, :] < k[:, None], ordered, -jnp.inf)
    probs = jax.nn.softmax(kept, axis=-1)
    inside = ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]) | (top_p[:, None] >= 1)  # the top one always
    last = jnp.maximum(jnp.sum(inside & (jnp.arange(v)[None, :] < k[:, None]), axis=-1), 1) - 1
    pth = jnp.take_along_axis(ordered, last[:, None], axis=-1)
    filtered = jnp.where(z < jnp.maximum(kth, pth), -jnp.inf, z)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
    token = jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn)
    logp = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), token[:, None], axis=-1)[:, 0]
    return token, logp
