"""Integrity of checkpointed arrays checked in the same read: a digest of each array that does not depend on
how the array is sharded, computed on the devices that hold it.

The digest of an array `x` is two sums, modulo 2**32, of `bits(x[i]) * w(i)` over every element, where
`bits` is the element's bit pattern (as unsigned integers) and `w(i)` an odd weight mixed from the
element's global index and a seed taken from the array's name. Integer sums modulo 2**32 do not depend on
the order of summation, so every device sums the elements it holds and XLA adds the partial sums: the same
two numbers come out for any mesh and any number of processes, and computing them reads each byte once,
from device memory, where the restore has just put it. Because every weight is odd, changing one bit of
one element always changes the digest; swapping two equal-shaped arrays changes it too (other seeds).

A checkpoint stores the digests of what it saved; a restore recomputes them over what it read and calls
any difference corruption. No process reads a file it does not restore.
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_M1, _M2, _GOLDEN = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35), np.uint32(0x9E3779B9)


def _mix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: every input bit affects every output bit."""
    h = h ^ (h >> 16)
    h = h * _M1
    h = h ^ (h >> 13)
    h = h * _M2
    return h ^ (h >> 16)


def _bits(x: jax.Array) -> jax.Array:
    """The elements' bit patterns as uint32 (8-byte elements as two uint32s on a last axis)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        unsigned = jnp.uint8 if size == 1 else jnp.uint16
        return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    raise TypeError(f"no digest for dtype {x.dtype}")


@jax.jit
def _digest(x: jax.Array, seed: jax.Array) -> jax.Array:
    u = _bits(x)
    index = jnp.zeros(u.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(u.ndim)):  # the global flat index, built from per-axis iotas (shards cleanly)
        index = index + jax.lax.broadcasted_iota(jnp.uint32, u.shape, axis) * np.uint32(stride % 2**32)
        stride *= u.shape[axis]
    first = _mix(index ^ seed) | np.uint32(1)
    second = _mix(index * _GOLDEN + (seed ^ _M2)) | np.uint32(1)
    return jnp.stack([jnp.sum(u * first, dtype=jnp.uint32), jnp.sum(u * second, dtype=jnp.uint32)])


def array_digest(name: str, x: jax.Array) -> jax.Array:
    """The (not yet fetched) digest of array `x` named `name`: a uint32[2] array, replicated."""
    seed = np.uint32(zlib.crc32(name.encode()))
    return _digest(x, seed)


def dispatch(named: dict[str, Any]) -> dict[str, tuple[jax.Array, str]]:
    """Start computing the digests of `{name: array}` on the devices, without waiting: `{name: (pending
    digest, dtype)}` for `fetch`. Every process calls this together (the digest of an array sharded over
    processes is one computation across them). Arrays of dtypes without a digest are left out."""
    pending = {}
    for name, x in named.items():
        try:
            pending[name] = (array_digest(name, x), str(x.dtype))
        except TypeError:
            continue
    return pending


def fetch(pending: dict[str, tuple[jax.Array, str]]) -> dict[str, list]:
    """Wait for `dispatch`ed digests: `{name: [a, b, dtype]}`, JSON-ready, on any process."""
    return {name: [*(int(v) for v in _fetch(d)), dtype] for name, (d, dtype) in sorted(pending.items())}


def digests(named: dict[str, Any]) -> dict[str, list]:
    """`fetch(dispatch(named))`: the digests of `{name: array}`, computed now."""
    return fetch(dispatch(named))


def _fetch(d: jax.Array) -> np.ndarray:
    """A replicated result's value on any process (`device_get` refuses arrays spanning processes)."""
    return np.asarray(d.addressable_shards[0].data)


def mismatches(named: dict[str, Any], expected: dict[str, list]) -> list[str]:
    """Names in `named` whose digest differs from `expected` (arrays cast back to the dtype they were
    saved in first, e.g. float32 parameters stored as bfloat16). Names without a stored digest are not
    checked. Every process calls this together."""
    cast = {}
    for name, x in named.items():
        if name in expected:
            dtype = jnp.dtype(expected[name][2])
            cast[name] = x if x.dtype == dtype else x.astype(dtype)
    found = digests(cast)
    return [name for name in sorted(cast) if found.get(name, [None])[:2] != expected[name][:2]]
