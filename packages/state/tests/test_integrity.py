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
