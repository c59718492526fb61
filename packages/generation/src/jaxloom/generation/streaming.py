"""Token-by-token generation for interactive use: a jitted prefill and a jitted one-token step, driven
from Python so each token can be shown as soon as it exists."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx

from .config import GenerationConfig
from .decode import bucket, decode_one, prefill


@functools.lru_cache(maxsize=16)
def _steps(graphdef, config: GenerationConfig, p: int):
    total = p + config.max_new_tokens
    first = jax.jit(lambda state, ids, mask, rng: prefill(nnx.merge(graphdef, state), ids, mask, total, rng, config))
    step = jax.jit(
        lambda state, token, decoding, at, rng: decode_one(nnx.merge(graphdef, state), token, decoding, at, rng, config)
    )
    return first, step


def stream(model: nnx.Module, prompt_ids, config: GenerationConfig | None = None) -> Iterator[int]:
    """Yield the token ids `model` generates after one prompt (`prompt_ids`), one at a time, stopping
    after EOS. Gives the same tokens as `generate` with the same config and seed."""
    config = config or GenerationConfig()
    ids = np.asarray(prompt_ids, np.int32).reshape(1, -1)
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    p = bucket(ids.shape[1])
    mask = np.pad(np.ones_like(ids), ((0, 0), (p - ids.shape[1], 0)))
    ids = np.pad(ids, ((0, 0), (p - ids.shape[1], 0)), constant_values=config.pad_token_id)
    graphdef, state = nnx.split(model)
    first, step = _steps(graphdef, config, p)
    rng, sub = jax.random.split(jax.random.PRNGKey(config.seed))
    token, decoding = first(state, ids, mask, sub)
    for i in range(config.max_new_tokens):
        value = int(token[0])
        yield value
        if value in config.eos_ids or i + 1 == config.max_new_tokens:
            return
        rng, sub = jax.random.split(rng)
        token, decoding = step(state, token, decoding, p + i, sub)
