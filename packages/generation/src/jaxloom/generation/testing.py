"""A reference for testing decoders, kept out of the main API: greedy decoding by full recomputation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx


def naive_greedy(model: nnx.Module, input_ids, attention_mask, max_new_tokens: int) -> np.ndarray:
    """Reference: `model` recomputes the full forward over `input_ids` (+ `attention_mask`) and the tokens chosen
    so far for each of `max_new_tokens` new tokens, with no cache, and takes the argmax. The sequence sits in one
    buffer of the final width, the positions not yet generated masked out (a causal model never reads them), so
    the forward is compiled once, not once per length. Slow; for tests."""
    ids = np.asarray(input_ids, np.int32)
    mask = np.asarray(attention_mask, np.int32)
    b, w = ids.shape
    full = np.zeros((b, w + max_new_tokens), np.int32)
    full_mask = np.zeros_like(full)
    full[:, :w], full_mask[:, :w] = ids, mask
    forward = nnx.jit(lambda m, i, a: m(i, attention_mask=a).logits)
    for step in range(max_new_tokens):
        logits = forward(model, full, full_mask)
        full[:, w + step] = np.asarray(jnp.argmax(logits[:, w + step - 1], axis=-1), np.int32)
        full_mask[:, w + step] = 1
    return full[:, w:].copy()
