"""Dropout in the train step only: a key set around the step's forward (traced), read by the layers that drop.

    with dropout_key(key):              # the train step's forward: LoRA adapters with dropout > 0 drop their input
        loss = objective(model, batch)
    with dropout_layer(i): ...          # a scanned stack's layer i: its own masks

Outside `dropout_key` nothing drops (evaluation, generation, the rollouts' log-probs).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

_DROPOUT_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("jaxloom_lora_dropout", default=None)


@contextlib.contextmanager
def dropout_key(key: jax.Array | None) -> Iterator[None]:
    """Within it (the train step's forward, traced), adapters with `dropout > 0` drop their input with that
    probability (PEFT's `lora_dropout`, inverted scaling), each layer's mask drawn from `key` folded with the
    layer's path (and, in a scanned stack, its index: `dropout_layer`); outside it they never drop (evaluation,
    generation, the rollouts' log-probs: PEFT's evaluation mode). None: no dropout."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


def dropout_active() -> bool:
    """Whether a forward traced now may drop adapter inputs (inside `dropout_key`)."""
    return _DROPOUT_KEY.get() is not None


@contextlib.contextmanager
def dropout_layer(index: jax.Array | int) -> Iterator[None]:
    """Within it, the active dropout key is folded with `index` (a scanned layer stack's layer: the stack's layers
    share one module, so its path alone would give every layer the same mask)."""
    key = _DROPOUT_KEY.get()
    if key is None:
        yield
        return
    with dropout_key(jax.random.fold_in(key, index)):
        yield


def dropped(x: jax.Array, rate: float, salt: int) -> jax.Array:
    """`x` with each element zeroed with probability `rate` and the rest scaled by `1 / (1 - rate)` (torch's
    `nn.Dropout`), the mask drawn from the active dropout key folded with `salt`; `x` itself when none is active."""
    key = _DROPOUT_KEY.get()
    if key is None or not rate:
        return x
    keep = jax.random.bernoulli(jax.random.fold_in(key, salt), 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))
