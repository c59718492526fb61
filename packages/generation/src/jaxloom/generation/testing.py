"""A reference for testing decoders, kept out of the main API: greedy decoding by full recomputation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx


def naive_greedy(model: nnx.Module, input_ids, attention_mask, max_new_tokens: int) -> np.ndarray:
    """Reference: `model` recomputes the full forward over `input_ids` (+ `attention_mask`) for each of
    `max_new_tokens` new tokens and takes the argmax. Slow; for tests."""
    ids = np.asarray(input_ids, np.int32)
    mask = np.asarray(attention_mask, np.int32)
    new = []
    for _ in range(max_new_tokens):
        logits = model(ids, attention_mask=mask).logits
        token = np.asarray(jnp.argmax(logits[:, -1], axis=-1), np.int32)
        new.append(token)
        ids = np.concatenate([ids, token[:, None]], axis=1)
        mask = np.concatenate([mask, np.ones_like(token)[:, None]], axis=1)
    return np.stack(new, axis=1)
