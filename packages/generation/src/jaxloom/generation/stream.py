"""Token-by-token generation for interactive use: a jitted prefill and a jitted one-token step, driven
from Python so each token can be shown as soon as it exists."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import GenerationConfig
from .decode import bucket
from .sampling import next_token


@functools.lru_cache(maxsize=16)
def _steps(graphdef, config: GenerationConfig, p: int):
    total = p + config.max_new_tokens

    @jax.jit
    def prefill(state, ids, mask, rng):
        m = nnx.merge(graphdef, state)
        pos = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
        kv_seg = jnp.zeros((1, total), jnp.int32).at[:, :p].set(mask)
        kv_pos = jnp.zeros((1, total), jnp.int32).at[:, :p].set(pos)
        out = m(ids, positions=pos, segment_ids=mask, cache=m.init_cache(1, total), cache_index=0,
                kv_positions=kv_pos, kv_segment_ids=kv_seg)
        return next_token(out.logits[:, -1], rng, config), out.cache, pos[:, -1], kv_seg, kv_pos

    @jax.jit
    def step(state, token, cache, pos, kv_seg, kv_pos, at, rng):
        m = nnx.merge(graphdef, state)
        pos = pos + 1
        kv_seg = jax.lax.dynamic_update_slice(kv_seg, jnp.ones((1, 1), jnp.int32), (0, at))
        kv_pos = jax.lax.dynamic_update_slice(kv_pos, pos[:, None], (0, at))
        out = m(token[:, None], positions=pos[:, None], segment_ids=jnp.ones((1, 1), jnp.int32), cache=cache,
                cache_index=at, kv_positions=kv_pos, kv_segment_ids=kv_seg)
        return next_token(out.logits[:, -1], rng, config), out.cache, pos, kv_seg, kv_pos

    return prefill, step


def stream(model: nnx.Module, prompt_ids, config: GenerationConfig | None = None) -> Iterator[int]:
    """Yield the token ids generated after one prompt, one at a time, stopping after EOS. Gives the
    same tokens as `generate` with the same config and seed."""
    config = config or GenerationConfig()
    ids = np.asarray(prompt_ids, np.int32).reshape(1, -1)
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    p = bucket(ids.shape[1])
    mask = np.pad(np.ones_like(ids), ((0, 0), (p - ids.shape[1], 0)))
    ids = np.pad(ids, ((0, 0), (p - ids.shape[1], 0)), constant_values=config.pad_token_id)
    graphdef, state = nnx.split(model)
    prefill, step = _steps(graphdef, config, p)
    rng, sub = jax.random.split(jax.random.PRNGKey(config.seed))
    token, cache, pos, kv_seg, kv_pos = prefill(state, ids, mask, sub)
    for i in range(config.max_new_tokens):
        value = int(token[0])
        yield value
        if value in config.eos_ids or i + 1 == config.max_new_tokens:
            return
        rng, sub = jax.random.split(rng)
        token, cache, pos, kv_seg, kv_pos = step(state, token, cache, pos, kv_seg, kv_pos, p + i, sub)
