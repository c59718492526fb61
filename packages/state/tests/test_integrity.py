"""The arrays' digests: the same for any sharding, and changed by any one flipped bit."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from state_util import mesh_of

from jaxloom.state import integrity


def test_a_digest_does_not_depend_on_the_sharding():
    x = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)
    seen = set()
    for axes, spec in ((dict(fsdp=4), P("fsdp")), (dict(fsdp=2, tp=2), P("fsdp", "tp")), (dict(fsdp=1), P())):
        mesh = mesh_of(**axes)
        placed = jax.device_put(x, NamedSharding(mesh, spec))
        seen.add(tuple(integrity.digests({"w": placed})["w"]))
    assert len(seen) == 1, seen


def test_any_flipped_bit_changes_the_digest_and_names_matter():
    rng = np.random.default_rng(1)
    for dtype in (np.float32, jnp.bfloat16, np.int8, np.bool_, np.uint32):
        x = rng.integers(0, 2, (6, 5)).astype(dtype) if dtype == np.bool_ else rng.standard_normal((6, 5)).astype(dtype)
        base = integrity.digests({"w": jnp.asarray(x)})["w"]
        assert base[2] == str(jnp.dtype(dtype))
        bits = x.view(np.uint8).reshape(-1).copy()
        for byte, bit in ((0, 0), (7, 7), (bits.size - 1, 3), (bits.size // 2, 5)):
            flipped = bits.copy()
            flipped[byte] ^= np.uint8(1 << bit)
            if dtype == np.bool_ and flipped[byte] > 1:
                continue  # not a valid bool
            y = jnp.asarray(flipped.view(x.dtype).reshape(x.shape))
            assert integrity.digests({"w": y})["w"][:2] != base[:2], (dtype, byte, bit)
        assert integrity.digests({"v": jnp.asarray(x)})["v"][:2] != base[:2]  # another name, other weights


def test_mismatches_compare_in_the_saved_dtype():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 4)), jnp.bfloat16)
    saved = integrity.digests({"w": x})
    assert integrity.mismatches({"w": x.astype(jnp.float32)}, saved) == []  # restored as float32
    assert integrity.mismatches({"w": x.astype(jnp.float32) + 1}, saved) == ["w"]


def test_small_shards_summed_on_the_host_give_the_device_digest(monkeypatch):
    """Shards up to HOST_ELEMENTS are summed in numpy: every dtype, rank and offset as on the device."""
    rng = np.random.default_rng(3)
    arrays = {
        "f32": rng.standard_normal((8, 12)).astype(np.float32),
        "bf16": rng.standard_normal((4, 6, 8)).astype(jnp.bfloat16),
        "f16": rng.standard_normal(16).astype(np.float16),
        "i8": rng.integers(-100, 100, (8, 4)).astype(np.int8),
        "u32": rng.integers(0, 2**32, (4, 8), dtype=np.uint32),
        "b": rng.integers(0, 2, (8,)).astype(np.bool_),
        "i4": rng.integers(-8, 8, (8, 2)).astype(jnp.int4),
        "step": np.asarray(7, np.int32),
    }
    mesh = mesh_of(fsdp=2, tp=2)
    placed = {}
    for name, x in arrays.items():
        spec = P(*(["fsdp", "tp", None][: x.ndim])) if x.ndim and x.shape[0] % 2 == 0 else P()
        placed[name] = jax.device_put(x, NamedSharding(mesh, spec))
    device_calls = []
    device_partial = integrity._partial
    monkeypatch.setattr(integrity, "_partial", lambda *a: device_calls.append(1) or device_partial(*a))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # wrapping uint32 arithmetic is the digest: no overflow warning
        on_host = integrity.digests(placed)
    assert not device_calls  # every shard here is small: no device program
    monkeypatch.setattr(integrity, "HOST_ELEMENTS", -1)  # every shard on its device
    assert integrity.digests(placed) == on_host and device_calls
    assert "i4" not in on_host and set(on_host) == set(arrays) - {"i4"}  # sub-byte dtypes have no digest
