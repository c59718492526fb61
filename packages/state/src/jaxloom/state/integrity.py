"""Integrity of checkpointed arrays checked in the same read: a digest of each array that does not depend on
how the array is sharded, computed on the devices that hold it.

The digest of an array `x` is two sums, modulo 2**32, of `bits(x[i]) * w(i)` over every element, where
`bits` is the element's bit pattern (as unsigned integers) and `w(i)` an odd weight mixed from the
element's global index and a seed taken from the array's name. Integer sums modulo 2**32 do not depend on
the order of summation, so each process sums the shards it holds (one small program per shard, on that
shard's device: no collective, nothing waits on another process) and the partial sums add up to the same
two numbers for any mesh and any number of processes. Computing them reads each byte once, from device
memory, where the restore has just put it. Shards of at most `HOST_ELEMENTS` elements (norms, biases, the
step counter: most leaves of a model, few of its bytes) are summed on the host with the same arithmetic
instead: a device program per leaf shape costs a compile on the first save and a dispatch on each.
Because every weight is odd, changing one bit of one element always changes the digest; swapping two
equal-shaped arrays changes it too (other seeds).

A checkpoint stores each process's partial digests of what it saved; a restore recomputes them over what
it read, adds up every process's (one gather) and calls any difference corruption. No process reads a file
it does not restore.
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_M1, _M2, _GOLDEN = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35), np.uint32(0x9E3779B9)


# Shards up to this many elements are summed on the host (numpy), larger ones on their device.
HOST_ELEMENTS = 1 << 16


def _mix(h: Any) -> Any:
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
    if jax.dtypes.itemsize_bits(x.dtype) != 8 * size:  # int4 and the like: no digest
        raise TypeError(f"no digest for dtype {x.dtype}")
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        unsigned = jnp.uint8 if size == 1 else jnp.uint16
        return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    raise TypeError(f"no digest for dtype {x.dtype}")


@jax.jit
def _partial(x: jax.Array, seed: jax.Array, offsets: jax.Array, strides: jax.Array) -> jax.Array:
    """The two sums over one shard `x`'s bit patterns, whose element [i, j, ...] is the global element
    [offsets + (i, j, ...)] of an array (of bit patterns) with row-major `strides` (uint32, wrapping)."""
    u = _bits(x)
    index = jnp.zeros(u.shape, jnp.uint32)
    for axis in range(u.ndim):  # the global flat index
        index = index + (jax.lax.broadcasted_iota(jnp.uint32, u.shape, axis) + offsets[axis]) * strides[axis]
    first = _mix(index ^ seed) | np.uint32(1)
    second = _mix(index * _GOLDEN + (seed ^ _M2)) | np.uint32(1)
    return jnp.stack([jnp.sum(u * first, dtype=jnp.uint32), jnp.sum(u * second, dtype=jnp.uint32)])


def _host_bits(x: np.ndarray) -> np.ndarray | None:
    """`_bits` on the host for whole elements of 1, 2 or 4 bytes (None for others: they go to the device)."""
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    size = x.dtype.itemsize
    if size not in (1, 2, 4) or jax.dtypes.itemsize_bits(x.dtype) != 8 * size:  # int4 and the like
        return None
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size]).astype(np.uint32)


def _host_partial(u: np.ndarray, seed: np.uint32, offsets: np.ndarray, strides: np.ndarray) -> np.ndarray:
    """`_partial` in numpy (the same uint32 arithmetic, wrapping alike) over a shard's bit patterns `u`."""
    with np.errstate(over="ignore"):  # a 0-d shard's products are numpy scalars, which warn as they wrap
        return _host_sums(u, seed, offsets, strides)


def _host_sums(u: np.ndarray, seed: np.uint32, offsets: np.ndarray, strides: np.ndarray) -> np.ndarray:
    index = np.zeros(u.shape, np.uint32)
    for axis in range(u.ndim):
        shape = [1] * u.ndim
        shape[axis] = u.shape[axis]
        coord = (np.arange(u.shape[axis], dtype=np.uint32) + offsets[axis]).reshape(shape)
        index = index + coord * strides[axis]
    first = _mix(index ^ seed) | np.uint32(1)
    second = _mix(index * _GOLDEN + (seed ^ _M2)) | np.uint32(1)
    return np.stack([np.sum(u * first, dtype=np.uint32), np.sum(u * second, dtype=np.uint32)])


def _on_host(shard: Any, x: jax.Array) -> np.ndarray | None:
    """The shard's bit patterns on the host when it is small and of a plain dtype, else None."""
    if shard.data.size > HOST_ELEMENTS or jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return None
    return _host_bits(np.asarray(shard.data))


Pending = dict[str, tuple[list[Any], str]]


def dispatch(named: dict[str, Any]) -> Pending:
    """Start computing this process's partial digests of `{name: array}` (the shards it holds whose
    replica id is 0), without waiting: `{name: (pending sums, dtype)}` for `fetch`. Every program runs on
    one device: no collective, so it may run beside training on any number of processes. Arrays of
    dtypes without a digest are left out."""
    pending: Pending = {}
    for name, x in named.items():
        try:
            bits_shape = jax.eval_shape(_bits, jax.ShapeDtypeStruct(x.shape, x.dtype)).shape
        except TypeError:
            continue
        shape = tuple(bits_shape)
        strides, acc = [], 1
        for size in reversed(shape):
            strides.append(acc % 2**32)
            acc *= size
        strides_arr = np.asarray(strides[::-1], np.uint32)
        seed = np.uint32(zlib.crc32(name.encode()))
        sums = []
        for shard in x.addressable_shards:
            if shard.replica_id != 0:
                continue
            starts = [sl.indices(dim)[0] for sl, dim in zip(shard.index, x.shape, strict=False)]
            starts += [0] * (len(shape) - len(starts))
            offsets = np.asarray([v % 2**32 for v in starts], np.uint32)
            host = _on_host(shard, x)
            if host is not None:
                sums.append(_host_partial(host, seed, offsets, strides_arr))
            else:
                sums.append(_partial(shard.data, seed, offsets, strides_arr))
        pending[name] = (sums, str(x.dtype))
    return pending


def fetch(pending: Pending) -> dict[str, list]:
    """Wait for `dispatch`ed sums: `{name: [a, b, dtype]}`, this process's part, JSON-ready."""
    out = {}
    for name, (sums, dtype) in sorted(pending.items()):
        a = b = 0
        for d in sums:
            va, vb = (int(v) for v in np.asarray(d))
            a, b = (a + va) % 2**32, (b + vb) % 2**32
        out[name] = [a, b, dtype]
    return out


def deferred(named: dict[str, Any]):
    """The digests of `{name: array}` as a function to call later (when a save is recorded): on one process the
    sums are dispatched now and fetched then; on several, every process's part is added up now (a collective: call
    it where every process is, as in a save) and the function returns the total."""
    if jax.process_count() == 1:
        pending = dispatch(named)
        return lambda: fetch(pending)
    total = digests(named)
    return lambda: dict(total)


def combine(parts: list[dict[str, list]]) -> dict[str, list]:
    """Every process's `fetch` added up: the arrays' digests."""
    out: dict[str, list] = {}
    for part in parts:
        for name, (a, b, dtype) in part.items():
            sa, sb, _ = out.get(name, [0, 0, dtype])
            out[name] = [(sa + a) % 2**32, (sb + b) % 2**32, dtype]
    return out


def digests(named: dict[str, Any]) -> dict[str, list]:
    """The digests of `{name: array}`, computed now. Every process calls this together: their parts are
    added with one gather (a collective: call it where every process is, e.g. in a restore)."""
    mine = fetch(dispatch(named))
    if jax.process_count() == 1:
        return mine
    from jax.experimental import multihost_utils

    names = sorted(mine)
    local = np.asarray([mine[n][:2] for n in names], np.uint32).reshape(len(names), 2)
    every = np.asarray(multihost_utils.process_allgather(local))  # [processes, names, 2]
    totals = every.astype(np.uint64).sum(axis=0) % 2**32
    return {n: [int(totals[i, 0]), int(totals[i, 1]), mine[n][2]] for i, n in enumerate(names)}


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
