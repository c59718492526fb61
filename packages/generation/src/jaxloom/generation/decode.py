"""Prefill + KV-cache decoding inside one jitted function, and a naive reference."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import GenerationConfig
from .sampling import next_token


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Generated:
    """What `generate` returns: `sequences [B, P + N]` (the left-padded prompt, then the completion),
    `completion_ids [B, N]` right-padded after EOS, and `completion_mask` (1 for generated tokens)."""

    sequences: jax.Array  # [B, P + N]: the (left-padded) prompt then the completion
    completion_ids: jax.Array  # [B, N], right-padded with pad_token_id after EOS
    completion_mask: jax.Array  # [B, N], 1 for generated tokens (EOS included)


def bucket(n: int, minimum: int = 16) -> int:
    """Prompt lengths are padded up to a power of two so each bucket compiles once."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def prefill(model, input_ids, attention_mask, total: int, rng, config: GenerationConfig):
    """Run the prompts `[B, P]` into a fresh cache of `total` slots; returns the first new token and the
    decoding state `(cache, last_position, kv_segment_ids, kv_positions)`."""
    b, p = input_ids.shape
    mask = attention_mask.astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
    kv_seg = jnp.zeros((b, total), jnp.int32).at[:, :p].set(mask)
    kv_pos = jnp.zeros((b, total), jnp.int32).at[:, :p].set(positions)
    out = model(
        input_ids,
        positions=positions,
        segment_ids=mask,
        cache=model.init_cache(b, total),
        cache_index=0,
        kv_positions=kv_pos,
        kv_segment_ids=kv_seg,
    )
    return next_token(out.logits[:, -1], rng, config), (out.cache, positions[:, -1], kv_seg, kv_pos)


def decode_one(model, token, decoding, at, rng, config: GenerationConfig):
    """Feed `token [B]` at cache slot `at`; returns the next token and the updated decoding state."""
    cache, pos, kv_seg, kv_pos = decoding
    b = token.shape[0]
    pos = pos + 1
    kv_seg = jax.lax.dynamic_update_slice(kv_seg, jnp.ones((b, 1), jnp.int32), (0, at))
    kv_pos = jax.lax.dynamic_update_slice(kv_pos, pos[:, None], (0, at))
    out = model(
        token[:, None],
        positions=pos[:, None],
        segment_ids=jnp.ones((b, 1), jnp.int32),
        cache=cache,
        cache_index=at,
        kv_positions=kv_pos,
        kv_segment_ids=kv_seg,
    )
    return next_token(out.logits[:, -1], rng, config), (out.cache, pos, kv_seg, kv_pos)


def refill(model, tokens, token, decoding, at, rng, config: GenerationConfig):
    """Like `decode_one`, but the whole sequence so far (`tokens [B, S]`, the token fed now at slot `at`) is run
    again into a fresh cache: what transformers does once when a LongRoPE model (Phi-3 128k) passes its original
    length, so that every key is rotated with the long factors from there on."""
    cache, pos, kv_seg, kv_pos = decoding
    b = token.shape[0]
    pos = pos + 1
    kv_seg = jax.lax.dynamic_update_slice(kv_seg, jnp.ones((b, 1), jnp.int32), (0, at))
    kv_pos = jax.lax.dynamic_update_slice(kv_pos, pos[:, None], (0, at))
    out = model(
        tokens,
        positions=kv_pos,
        segment_ids=kv_seg,
        cache=jax.tree_util.tree_map(jnp.zeros_like, cache),
        cache_index=0,
        kv_positions=kv_pos,
        kv_segment_ids=kv_seg,
    )
    logits = jax.lax.dynamic_slice_in_dim(out.logits, at, 1, axis=1)[:, 0]
    return next_token(logits, rng, config), (out.cache, pos, kv_seg, kv_pos)


def _decode(graphdef, state, input_ids, attention_mask, rng, config: GenerationConfig):
    model = nnx.merge(graphdef, state)
    b, p = input_ids.shape
    n = config.max_new_tokens
    rng, sub = jax.random.split(rng)
    token, decoding = prefill(model, input_ids, attention_mask, p + n, sub, config)
    eos = jnp.asarray(config.eos_ids or (-1,), jnp.int32)
    done = jnp.isin(token, eos)
    completion = jnp.full((b, n), config.pad_token_id, jnp.int32).at[:, 0].set(token)
    comp_mask = jnp.zeros((b, n), jnp.int32).at[:, 0].set(1)

    def cond(carry):
        i, *_, done = carry
        return (i < n) & ~jnp.all(done)

    refresh = getattr(model, "cache_refresh_position", None)

    def step(token, decoding, at, sub, completion):
        if refresh is None:
            return decode_one(model, token, decoding, at, sub, config)
        crossing = jnp.max(decoding[1]) + 1 == refresh  # the longest row's next position is the first past it
        return jax.lax.cond(
            crossing,
            lambda: refill(model, jnp.concatenate([input_ids, completion], 1), token, decoding, at, sub, config),
            lambda: decode_one(model, token, decoding, at, sub, config),
        )

    def body(carry):
        i, decoding, token, completion, comp_mask, rng, done = carry
        rng, sub = jax.random.split(rng)
        new, decoding = step(token, decoding, p + i - 1, sub, completion)
        new = jnp.where(done, config.pad_token_id, new)
        completion = jax.lax.dynamic_update_slice(completion, new[:, None], (0, i))
        comp_mask = jax.lax.dynamic_update_slice(comp_mask, (~done).astype(jnp.int32)[:, None], (0, i))
        return i + 1, decoding, new, completion, comp_mask, rng, done | jnp.isin(new, eos)

    carry = (jnp.int32(1), decoding, token, completion, comp_mask, rng, done)
    _, _, _, completion, comp_mask, _, _ = jax.lax.while_loop(cond, body, carry)
    return Generated(jnp.concatenate([input_ids, completion], axis=1), completion, comp_mask)


@functools.lru_cache(maxsize=64)
def _compiled(graphdef, config: GenerationConfig):
    return jax.jit(functools.partial(_decode, graphdef, config=config))


def generate(
    model: nnx.Module, input_ids, attention_mask=None, config: GenerationConfig | None = None, *, mesh=None, rng=None
) -> Generated:
    """Decode `config.max_new_tokens` tokens after left-padded prompts `input_ids [B, P]` (with
    `attention_mask`, 0 on padding; default all ones). With `mesh`, the batch is sharded over its data
    axes. One jitted function per (model structure, config, prompt bucket); prompts are padded to the
    bucket. `rng`: the sampling key (default: `PRNGKey(config.seed)`), e.g. one derived from a training
    state, so that a resumed run samples what the uninterrupted one did."""
    config = config or GenerationConfig()
    ids = np.asarray(input_ids, np.int32)
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, length] array, got shape {ids.shape}")
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, np.int32)
    limit = model.config.max_position_embeddings
    longest = int(mask.sum(-1).max())
    if longest + config.max_new_tokens > limit:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens {config.max_new_tokens} exceeds the model's "
            f"context of {limit} (max_position_embeddings)"
        )
    p = bucket(ids.shape[1])
    pad = p - ids.shape[1]
    ids = np.pad(ids, ((0, 0), (pad, 0)), constant_values=config.pad_token_id)
    mask = np.pad(mask, ((0, 0), (pad, 0)))
    graphdef, state = nnx.split(model)
    fn = _compiled(graphdef, config)
    rng = jax.random.PRNGKey(config.seed) if rng is None else rng
    if mesh is not None:
        with jax.set_mesh(mesh):
            out = fn(state, ids, mask, rng)
    else:
        out = fn(state, ids, mask, rng)
    out = jax.tree_util.tree_map(_on_every_process, out)
    return Generated(out.sequences[:, pad:], out.completion_ids, out.completion_mask)


def _on_every_process(x: jax.Array) -> jax.Array | np.ndarray:
    """`x` readable on this process: an array split between processes (each Ray worker or host holds its
    rows) is gathered whole on every process, so callers can read the tokens on any of them."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return x


def create_generate_function(
    generation_config: GenerationConfig | None = None,
    *,
    shard_inputs: bool = True,
    config_overrides: dict[str, Any] | None = None,
    mesh=None,
):
    """EasyDeL's `create_generate_function`: `fn(state_or_model, input_ids, attention_mask)` →
    `(sequences, completion_ids, completion_mask)`, decoding with `generation_config` (updated by
    `config_overrides`). With `shard_inputs`, inputs are placed on `mesh`'s batch axes."""
    config = (generation_config or GenerationConfig()).replace(**(config_overrides or {}))

    def fn(state_or_model, input_ids, attention_mask):
        model = state_or_model.model if hasattr(state_or_model, "graphdef") else state_or_model
        out = generate(model, input_ids, attention_mask, config, mesh=mesh if shard_inputs else None)
        return out.sequences, out.completion_ids, out.completion_mask

    return fn
