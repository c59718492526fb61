import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from state_util import CONFIG, make_state, mesh_of, target, train_steps

import jaxloom.state as js
from jaxloom.mesh import gather


def flip(raw: bytes) -> bytes:
    out = bytearray(raw)
    out[len(out) // 2] ^= 0xFF
    return bytes(out)


def size(path: Path) -> int:
    return path.stat().st_size


def leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(gather(x), gather(y)) for x, y in zip(la, lb, strict=True))


def test_save_restore_bitwise_and_reshard(tmp_path):
    state = train_steps(make_state(mesh_of(fsdp=4)), 3)
    manager = js.CheckpointManager(str(tmp_path), save_steps=1)
    manager.save(3, state, data_state={"epoch": 0, "index": 24}, metadata={"tokens": 192})
    manager.wait_until_finished()
    assert manager.latest_step() == 3 and (tmp_path / "3" / js.checkpoint.CHECKSUMS).is_file()
    for axes in (dict(fsdp=4), dict(fsdp=2, tp=2), dict(fsdp=1)):
        restored = js.CheckpointManager(str(tmp_path)).restore(target(mesh_of(**axes)))
        assert restored.step == 3 and restored.data_state == {"epoch": 0, "index": 24}
        assert restored.metadata == {"tokens": 192}
        assert leaves_equal(restored.state, state), axes
        kernel = restored.state.params["model"]["layers"][0]["mlp"]["up_proj"]["kernel"]
        assert len(kernel.sharding.device_set) == int(np.prod(list(axes.values())))
    # training continues bitwise identically from a state restored onto the same mesh and placement (the trained
    # state's leaves may carry an equivalent spec, P('fsdp',) for P('fsdp', 'tp') at tp=1, which compiles another
    # program: XLA's older CPU emitters then sum in another order)
    same = js.CheckpointManager(str(tmp_path)).restore(target(mesh_of(fsdp=4))).state
    placed = jax.device_put(state, jax.tree_util.tree_map(lambda x: x.sharding, same))
    assert leaves_equal(train_steps(same, 2, seed=5), train_steps(placed, 2, seed=5))


def test_keep_n_params_only_shapes_and_float_dtype(tmp_path):
    mesh = mesh_of(fsdp=2)
    state = make_state(mesh)
    manager = js.CheckpointManager(str(tmp_path), save_total_limit=2, keep_period=None, float_dtype="bfloat16")
    for step in (1, 2, 3):
        manager.save(step, state)
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 3]
    shapes = manager.restore_shapes()
    assert shapes["lm_head"]["kernel"].shape == (32, 64) and shapes["lm_head"]["kernel"].dtype == jax.numpy.bfloat16
    fresh = target(mesh)
    restored = manager.restore(fresh, params_only=True)
    assert restored.step == 0 and restored.state.opt_state is fresh.opt_state  # optimizer left to the caller
    kernel = restored.state.params["lm_head"]["kernel"]
    assert kernel.dtype == np.float32
    np.testing.assert_array_equal(
        gather(kernel), gather(state.params["lm_head"]["kernel"]).astype(jax.numpy.bfloat16).astype(np.float32)
    )


def test_bad_inputs_touch_nothing(tmp_path):
    mesh = mesh_of(fsdp=2)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in .*the directory does not exist"):
        js.CheckpointManager(str(tmp_path / "missing")).restore(target(mesh))
    assert not (tmp_path / "missing").exists()
    manager = js.CheckpointManager(str(tmp_path / "run"), async_save=False)
    manager.save(5, make_state(mesh))
    before = sorted(str(p) for p in (tmp_path / "run").rglob("*"))
    bigger = CONFIG.replace(hidden_size=64, num_attention_heads=8, num_key_value_heads=4)
    with pytest.raises(
        ValueError,
        match=r"written for another configuration, another model shape: .*stored \(64, 32\) vs this run.s \(64, 64\)",
    ):
        manager.restore(target(mesh, bigger))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 7 .*available: \[5\]"):
        manager.restore(target(mesh), step=7)
    odd = CONFIG.replace(vocab_size=66)  # 66 rows cannot split over tp=4
    js.CheckpointManager(str(tmp_path / "odd"), async_save=False).save(1, make_state(mesh, odd))
    from jax.sharding import NamedSharding, PartitionSpec

    t = target(mesh, odd)
    bad = NamedSharding(mesh_of(tp=4), PartitionSpec(None, "tp"))
    t = t.replace(params={**t.params, "lm_head": {"kernel": jax.ShapeDtypeStruct((32, 66), np.float32, sharding=bad)}})
    with pytest.raises(ValueError, match=r"parameter lm_head/kernel with shape \(32, 66\) cannot be placed"):
        js.CheckpointManager(str(tmp_path / "odd")).restore(t)
    assert sorted(str(p) for p in (tmp_path / "run").rglob("*")) == before


@pytest.mark.parametrize("array_format", ["orbax", "raw"])
def test_corruption_is_detected_and_falls_back(tmp_path, array_format):
    mesh = mesh_of(fsdp=2)
    s1 = make_state(mesh)
    s2 = train_steps(s1, 1)
    manager = js.CheckpointManager(str(tmp_path), async_save=True, array_format=array_format)
    manager.save(1, s1)
    manager.save(2, s2)
    manager.wait_until_finished()
    # metadata (and the raw format's pieces' digests): hashed in the manifest
    small = ("params/arrays.json", "params/process_0.json") if array_format == "raw" else ("params/_METADATA",)
    for name in small:
        meta_file = tmp_path / "2" / name
        good_meta = meta_file.read_bytes()
        meta_file.write_bytes(flip(good_meta))
        with pytest.raises(js.CheckpointCorruptError, match=f"file {name} is corrupt"):
            manager.restore(target(mesh), step=2)
        meta_file.write_bytes(good_meta)
    # array data is not hashed: a flipped byte is found by the digests, in the same read
    if array_format == "raw":
        data = sorted((p for p in (tmp_path / "2").rglob("*.bin")), key=size)
        found = r"process_0.bin bytes \d+\.\.\d+ \(.+\): piece \d+ differs from what was written"
    else:
        data = sorted((p for p in (tmp_path / "2" / "params").rglob("*") if p.parent.name == "d"), key=size)
        found = r"array data differs from what was saved in \d+ array\(s\): params/"
    victim = data[-1]
    good = victim.read_bytes()
    victim.write_bytes(flip(good))
    with pytest.raises(js.CheckpointCorruptError, match=found):
        manager.restore(target(mesh), step=2)
    with pytest.raises(js.CheckpointCorruptError):
        manager.restore(target(mesh), fallback=False)
    victim.write_bytes(good[: len(good) // 3])  # truncation: the size, from a stat
    with pytest.raises(js.CheckpointCorruptError, match=r"is corrupt \(size \d+ vs \d+ written\)"):
        manager.restore(target(mesh), step=2)
    victim.unlink()
    with pytest.raises(js.CheckpointCorruptError, match="is missing"):
        manager.restore(target(mesh), step=2)
    restored = manager.restore(target(mesh))  # newest is corrupt: set aside, falls back to step 1
    assert restored.step == 1 and leaves_equal(restored.state.params, s1.params)
    assert (tmp_path / "2.corrupt").is_dir() and not (tmp_path / "2").exists() and manager.all_steps() == [1]
    manager.save(2, s2)  # the run can write that step again
    manager.wait_until_finished()
    assert manager.restore(target(mesh)).step == 2


def test_a_cut_checksum_manifest_is_corruption_with_fallback(tmp_path):
    mesh = mesh_of(fsdp=2)
    manager = js.CheckpointManager(str(tmp_path), async_save=False)
    manager.save(1, make_state(mesh))
    manager.save(2, train_steps(make_state(mesh), 1))
    manifest = tmp_path / "2" / js.checkpoint.CHECKSUMS
    manifest.write_text(manifest.read_text()[:20])
    with pytest.raises(js.CheckpointCorruptError, match=r"checksum manifest .* is unreadable"):
        manager.restore(target(mesh), step=2)
    assert manager.restore(target(mesh)).step == 1 and (tmp_path / "2.corrupt").is_dir()


def test_another_optimizer_is_another_configuration_not_corruption(tmp_path):
    import optax

    mesh = mesh_of(fsdp=2)
    manager = js.CheckpointManager(str(tmp_path), async_save=False)
    manager.save(3, make_state(mesh))  # Adam: two moments per parameter
    sgd = optax.sgd(0.1, momentum=0.9)  # one
    with pytest.raises(ValueError, match=r"written for another configuration, another optimizer") as e:
        manager.restore(target(mesh, tx=sgd))
    assert not isinstance(e.value, js.CheckpointCorruptError) and "overwrite_output_dir=true" in str(e.value)
    assert manager.all_steps() == [3] and not list(tmp_path.glob("*.corrupt"))  # nothing moved aside
    assert manager.restore(target(mesh, tx=sgd), params_only=True).step == 0  # the weights still load


WORKER = Path(__file__).with_name("ckpt_worker.py")


def test_sigkill_during_async_save_keeps_the_previous_checkpoint(tmp_path):
    """A process killed in the middle of writing checkpoint 2 leaves checkpoint 1 as the newest."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}",
        },
    )
    for line in proc.stdout:
        if line.strip() == "SAVING 2":
            time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    manager = js.CheckpointManager(str(tmp_path))
    assert manager.latest_step() == 1
    restored = manager.restore(target(mesh_of(fsdp=2)))
    assert restored.step == 1
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]  # stale partial folders were cleaned
    shutil.rmtree(tmp_path)


def test_json_configs_round_trip(tmp_path):
    from jaxloom.mesh import PartitionAxis

    value = {
        "dtype": jax.numpy.bfloat16,
        "pa": PartitionAxis(head_axis=None),
        "dims": (1, -1, 1),
        "rt": {"param_dtype": np.dtype("float32")},
        "n": np.int32(3),
    }
    js.save_json(value, tmp_path / "c.json")
    back = js.load_json(tmp_path / "c.json")
    assert back["dtype"] == jax.numpy.dtype("bfloat16") and back["pa"] == PartitionAxis(head_axis=None)
    assert back["dims"] == (1, -1, 1) and back["rt"]["param_dtype"] == np.float32 and back["n"] == 3
    json.loads((tmp_path / "c.json").read_text())
    (tmp_path / "bad.json").write_text('{"a": 1,,}')
    with pytest.raises(ValueError, match="bad.json: malformed JSON at line 1, column 9"):
        js.load_json(tmp_path / "bad.json")
    with pytest.raises(TypeError, match="cannot store object"):
        js.to_jsonable(object())


def test_state_without_optimizer_state_round_trips(tmp_path):
    """`convert_model_to_state` uses optax.identity, whose state has no arrays (orbax refuses empty items)."""
    import jaxloom.models as jm
    from state_util import CONFIG

    state = js.convert_model_to_state(jm.create_model(CONFIG, seed=4))
    manager = js.CheckpointManager(str(tmp_path), async_save=True)
    manager.save(7, state)
    manager.wait_until_finished()
    abstract = jax.eval_shape(lambda: state)
    restored = manager.restore(
        jax.tree_util.tree_map(
            lambda a, x: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=x.sharding), abstract, state
        )
    )
    assert restored.step == 7 and leaves_equal(restored.state.params, state.params)


def test_time_based_saving_and_keep_period(tmp_path):
    state = make_state(mesh_of(fsdp=2))
    timed = js.CheckpointManager(str(tmp_path / "t"), save_minutes=0.002, async_save=False)  # 0.12 s
    assert not timed.should_save(1)
    time.sleep(0.2)
    assert timed.should_save(2)
    timed.save(2, state)
    assert not timed.should_save(3)  # the clock restarts at each save
    kept = js.CheckpointManager(str(tmp_path / "k"), save_total_limit=2, keep_period=3, async_save=False)
    for step in range(1, 8):
        kept.save(step, state)
    steps = kept.all_steps()
    assert {3, 6, 7} <= set(steps) and 1 not in steps and 2 not in steps


def test_a_read_only_manager_changes_nothing(tmp_path):
    """A reader (`read_only=True`) leaves a step being written alone, creates no directory and refuses to save."""
    import jax.numpy as jnp
    import pytest

    from jaxloom.state import CheckpointManager

    assert not CheckpointManager(str(tmp_path / "none"), read_only=True).all_steps()
    assert not (tmp_path / "none").exists()
    in_flight = tmp_path / "ckpt" / "7.orbax-checkpoint-tmp-1764100000000000"
    in_flight.mkdir(parents=True)
    reader = CheckpointManager(str(tmp_path / "ckpt"), read_only=True)
    assert reader.latest_step() is None and in_flight.is_dir()
    with pytest.raises(ValueError, match="read-only"):
        reader.save(1, {"x": jnp.ones(2)})
    assert in_flight.is_dir()


def test_a_step_removed_while_it_is_read_is_not_corruption(tmp_path, monkeypatch):
    """Issue 52: a reader beside a run that rotates its checkpoints (save_total_limit) finds the step it reads
    removed mid-read: it reads the newest complete step as it is then, renames nothing, and says why."""
    mesh = mesh_of(fsdp=1)
    state = make_state(mesh)
    writer = js.CheckpointManager(str(tmp_path), save_total_limit=None, async_save=False)
    for step in (1, 2, 3):
        writer.save(step, state, data_state={}, metadata={})
    writer.wait_until_finished()
    reader = js.CheckpointManager(str(tmp_path), read_only=True)
    real = js.CheckpointManager._restore_one
    calls = []

    def rotating(self, target_, step, params_only):  # the writer saves 4 and removes 3 while 3 is being read
        calls.append(step)
        if step == 3 and len(calls) == 1:
            writer.save(4, state, data_state={}, metadata={})
            writer.wait_until_finished()
            shutil.rmtree(tmp_path / "3")
            raise FileNotFoundError(f"{tmp_path / '3'}: No such file or directory")
        return real(self, target_, step, params_only)

    monkeypatch.setattr(js.CheckpointManager, "_restore_one", rotating)
    restored = reader.restore(target(mesh))
    assert restored.step == 4 and calls == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name[0].isdigit()) == ["1", "2", "4"]  # nothing set aside


@pytest.mark.parametrize("array_format", ["orbax", "raw"])
def test_a_checkpoint_commits_with_its_integrity_record(tmp_path, array_format):
    """Issue 70: with asynchronous saves a checkpoint's checksums were written only when the next one was saved, so
    after a kill -9 twenty steps later the checkpoint resumed from was "not verified". The record (the manifest, and
    the arrays' digests in orbax's format) is written into the folder before orbax commits it: the folder is never
    visible without it, and it is verified with no later save or wait."""
    state = train_steps(make_state(mesh_of(fsdp=4)), 2)
    manager = js.CheckpointManager(str(tmp_path), save_steps=1, array_format=array_format)
    assert manager.config.async_save
    manager.save(2, state)
    folder, deadline = tmp_path / "2", time.monotonic() + 60
    while not folder.is_dir() and time.monotonic() < deadline:  # the moment it becomes visible
        time.sleep(0.001)
    seen = sorted(p.name for p in folder.iterdir())
    assert js.checkpoint.CHECKSUMS in seen, seen
    if array_format == "orbax":
        assert f"{js.checkpoint.DIGESTS}0.json" in seen
    assert manager.verify(2) or array_format == "raw"  # the digests, read back before anything else happens
    manager.wait_until_finished()
    assert sorted(p.name for p in folder.iterdir()) == seen  # nothing added after the commit
    restored = js.CheckpointManager(str(tmp_path)).restore(target(mesh_of(fsdp=4)))
    assert leaves_equal(restored.state, state)


def test_a_commit_check_that_raises_keeps_the_checkpoint_from_committing(tmp_path):
    """`commit_check` (the trainer's lease fence) runs before orbax commits an asynchronous save: one that raises
    `LeaseLostError` leaves the step uncommitted (no folder, no step listed), and the error surfaces as itself at
    the next wait, not as a failed save. A passing check commits as before."""
    state = train_steps(make_state(mesh_of(fsdp=4)), 1)
    calls = []

    def lost():
        calls.append(1)
        raise js.LeaseLostError("the run directory's lease was taken by another run (generation 2)")

    manager = js.CheckpointManager(str(tmp_path), save_steps=1, commit_check=lost)
    manager.save(1, state)
    with pytest.raises(js.LeaseLostError, match="taken by another run"):
        manager.wait_until_finished()
    assert calls and not (tmp_path / "1").exists()
    assert js.CheckpointManager(str(tmp_path), read_only=True).all_steps() == []
    fine = js.CheckpointManager(str(tmp_path), save_steps=1, commit_check=lambda: None)
    fine.save(2, state)
    fine.wait_until_finished()
    assert fine.all_steps() == [2] and (tmp_path / "2" / js.checkpoint.CHECKSUMS).is_file()
