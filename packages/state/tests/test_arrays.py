"""jaxloom's raw array format (`array_format="raw"`): partial reads of pieces when the restoring mesh
differs, only the pieces read are checked, `verify=False` skips the check, typed PRNG keys round-trip; every
format any jaxloom-state wrote restores (orbax's arrays without digests, < 0.8; raw, 0.9-0.11), and a
checkpoint is converted from one format to the other."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from state_util import make_state, mesh_of, target, train_steps

import jaxloom.state as js
from jaxloom.mesh import gather
from jaxloom.state import arrays


def equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(gather(x), gather(y)) for x, y in zip(la, lb, strict=True))


def same(a, b):
    """The arrays a checkpoint keeps: parameters, optimizer state, RNG."""
    return equal((a.params, a.opt_state, a.rng), (b.params, b.opt_state, b.rng))


def test_small_pieces_partial_reads_and_only_what_is_read_is_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(arrays, "PIECE", 256)  # several pieces per shard: a resharded restore reads part of one
    state = train_steps(make_state(mesh_of(fsdp=2)), 1)
    manager = js.CheckpointManager(str(tmp_path), async_save=False, array_format="raw")
    manager.save(1, state)
    index = (tmp_path / "1" / "params" / "process_0.json").read_text()
    assert '"piece_bytes": 256' in index
    for axes in (dict(fsdp=4), dict(fsdp=2, tp=2), dict(fsdp=8), dict(fsdp=1)):
        assert equal(js.CheckpointManager(str(tmp_path)).restore(target(mesh_of(**axes))).state, state), axes
    # flip one byte of the embedding's first rows: a restore that reads them fails, naming the piece
    import json

    chunks = json.loads(index)["chunks"]
    embed = next(c for c in chunks if "embed" in c["name"] and c["start"][0] == 0)
    data = tmp_path / "1" / "params" / "process_0.bin"
    raw = bytearray(data.read_bytes())
    raw[embed["offset"] + 3] ^= 0x40
    data.write_bytes(bytes(raw))
    (tmp_path / "1" / js.checkpoint.CHECKSUMS).unlink()  # sizes unchanged anyway; digests are in the index
    with pytest.raises(
        js.CheckpointCorruptError, match=r"process_0.bin bytes \d+\.\.\d+ \(.*embed.*\): piece 0 differs"
    ):
        js.CheckpointManager(str(tmp_path)).restore(target(mesh_of(fsdp=4)), step=1)
    # verify=False takes effect: the same file restores, with the flipped bit in it
    loose = js.CheckpointManager(str(tmp_path), verify=False).restore(target(mesh_of(fsdp=4)), step=1)
    assert not equal(loose.state.params, state.params)


def test_typed_keys_and_scalars_round_trip(tmp_path):
    mesh = mesh_of(fsdp=2)
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tree = {
        "key": jax.device_put(jax.random.key(7), sharded),
        "scalar": jax.device_put(np.float32(2.5), sharded),
        "empty": jax.device_put(np.zeros((0, 3), np.int32), sharded),
        "rows": jax.device_put(np.arange(12, dtype=np.int8).reshape(6, 2), sharded),
    }
    info, shards = arrays.host_copy(tree)
    (tmp_path / "t").mkdir()
    arrays.write(tmp_path / "t", info, shards)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    back = arrays.restore(tmp_path / "t", abstract)
    assert jax.random.key_data(back["key"]).tolist() == jax.random.key_data(tree["key"]).tolist()
    assert float(back["scalar"]) == 2.5 and back["empty"].shape == (0, 3)
    assert np.array_equal(np.asarray(back["rows"]), np.asarray(tree["rows"]))
    shapes = arrays.shapes(tmp_path / "t")
    assert shapes["rows"].shape == (6, 2) and shapes["rows"].dtype == np.int8


def test_a_checkpoint_of_the_previous_format_still_restores(tmp_path):
    """jaxloom-state < 0.9 wrote orbax's own arrays (StandardCheckpointHandler) and on-device digests."""
    state = make_state(mesh_of(fsdp=2))
    old = ocp.CheckpointManager(
        tmp_path,
        item_handlers={
            "params": ocp.StandardCheckpointHandler(),
            "opt_state": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        },
    )
    meta = {"step": 4, "rng": np.asarray(jax.random.key_data(state.rng)).tolist(), "data": {"i": 1}, "metadata": {}}
    args = {"params": ocp.args.StandardSave(state.params), "opt_state": ocp.args.StandardSave(state.opt_state)}
    old.save(4, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args))
    old.wait_until_finished()
    old.close()
    manager = js.CheckpointManager(str(tmp_path))
    assert manager.restore_shapes()["model"]["embed_tokens"]["embedding"].shape == (64, 32)
    restored = manager.restore(target(mesh_of(fsdp=4)))
    assert restored.step == 4 and restored.data_state == {"i": 1} and equal(restored.state.params, state.params)
    assert equal(restored.state.opt_state, state.opt_state)


def test_a_failed_read_raises_only_once_every_reader_has_stopped():
    """A restore that meets a corrupt piece must not return while other readers still touch the mapped
    files: the caller may cut those files short next (a SIGBUS in a reader thread kills the process)."""
    import threading
    import time

    started, finished = threading.Event(), threading.Event()

    def slow():
        started.set()
        time.sleep(0.3)
        finished.set()

    def bad():
        assert started.wait(10)  # fail while the other reader is running
        raise arrays.CheckpointCorruptError("piece 0 differs")

    with pytest.raises(arrays.CheckpointCorruptError):
        arrays._all_or_raise(arrays._pool(4), [bad, slow])
    assert finished.is_set()
    assert arrays._all_or_raise(arrays._pool(4), [lambda: 1, lambda: 2]) == [1, 2]


def test_orbax_alone_restores_a_checkpoint_in_a_fresh_process(tmp_path):
    """The default format is orbax's own: a process that never imports jaxloom restores `<step>/params` with
    `StandardCheckpointer` (and the whole step with orbax's `CheckpointManager`), equal to jaxloom's restore."""
    import subprocess
    import sys

    state = train_steps(make_state(mesh_of(fsdp=2)), 1)
    saver = js.CheckpointManager(str(tmp_path / "ck"))
    saver.save(4, state)
    saver.wait_until_finished()
    ours = js.CheckpointManager(str(tmp_path / "ck")).restore(target(mesh_of(fsdp=4))).state
    np.savez(tmp_path / "ours.npz", **{str(i): gather(x) for i, x in enumerate(jax.tree_util.tree_leaves(ours.params))})
    script = f"""
import sys, numpy as np, jax, orbax.checkpoint as ocp
params = ocp.StandardCheckpointer().restore("{tmp_path}/ck/4/params")
whole = ocp.CheckpointManager("{tmp_path}/ck").restore(4, args=ocp.args.Composite(
    params=ocp.args.StandardRestore(), opt_state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
ours = np.load("{tmp_path}/ours.npz")
leaves = jax.tree_util.tree_leaves(params)
assert len(leaves) == len(ours.files), (len(leaves), len(ours.files))
for i, x in enumerate(leaves):
    np.testing.assert_array_equal(np.asarray(x), ours[str(i)])
for a, b in zip(jax.tree_util.tree_leaves(whole["params"]), leaves):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
assert whole["meta"]["step"] == 4
assert not [m for m in sys.modules if m.startswith("jaxloom")]
print("ORBAX_ALONE_OK")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "ORBAX_ALONE_OK" in out.stdout, out.stderr[-3000:]


def test_a_raw_checkpoint_still_restores_and_converts_both_ways(tmp_path):
    """Checkpoints of jaxloom-state 0.9-0.11 (the raw format) restore with today's defaults; `convert_checkpoint`
    writes them in orbax's format and back, each step's arrays, step, RNG and data position kept bitwise."""
    s1 = make_state(mesh_of(fsdp=2))
    s2 = train_steps(s1, 1)
    raw = js.CheckpointManager(str(tmp_path / "raw"), array_format="raw", async_save=False)
    raw.save(1, s1, data_state={"i": 1})
    raw.save(2, s2, data_state={"i": 2})
    assert arrays.is_ours(tmp_path / "raw" / "2" / "params")
    back = js.CheckpointManager(str(tmp_path / "raw")).restore(target(mesh_of(fsdp=4)))
    assert back.step == 2 and same(back.state, s2)
    onto = target(mesh_of(fsdp=2))
    assert js.convert_checkpoint(str(tmp_path / "raw"), str(tmp_path / "orbax"), target=onto) == [1, 2]
    assert not arrays.is_ours(tmp_path / "orbax" / "2" / "params")
    assert (tmp_path / "orbax" / "2" / "params" / "_METADATA").exists()
    again = js.convert_checkpoint(
        str(tmp_path / "orbax"), str(tmp_path / "again"), array_format="raw", step=2, target=onto
    )
    assert again == [2]
    for where, step, state in (("orbax", 1, s1), ("orbax", 2, s2), ("again", 2, s2)):
        out = js.CheckpointManager(str(tmp_path / where)).restore(target(mesh_of(fsdp=2, tp=2)), step=step)
        assert out.step == step and out.data_state == {"i": step} and same(out.state, state), (where, step)
    with pytest.raises(FileExistsError, match=r"holds checkpoint\(s\) \[2\] already"):
        js.convert_checkpoint(str(tmp_path / "orbax"), str(tmp_path / "again"), step=2)
    # without a target: the stored tree, read back by orbax alone
    js.convert_checkpoint(str(tmp_path / "again"), str(tmp_path / "plain"), step=2)
    plain = ocp.StandardCheckpointer().restore(tmp_path / "plain" / "2" / "params")
    assert [gather(x).tolist() for x in jax.tree_util.tree_leaves(plain)] == [
        gather(x).tolist() for x in jax.tree_util.tree_leaves(s2.params)
    ]
