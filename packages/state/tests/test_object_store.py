"""Checkpoints on an object store: a real GCS server (`gcs_emulator`) and a real S3 server (moto, `s3_server`)
on loopback, orbax writing through tensorstore's gcs / s3 drivers, listings and metadata through gcsfs /
s3fs. Save, restore onto another mesh bitwise; a truncated, deleted or flipped data object is corruption (the
flip found in the same read), set aside, the previous step restored, and that step written again. A step
is complete only once its commit marker is written. The HF export into a bucket."""

import time

import fsspec
import jax
import numpy as np
import pytest
from state_util import make_state, mesh_of, target, train_steps

import jaxloom.state as js
from jaxloom.mesh import gather
from jaxloom.state.testing import gcs_emulator, s3_server


def equal(a, b):
    return all(
        np.array_equal(gather(x), gather(y))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


STORES = {"gs": gcs_emulator, "s3": s3_server}


@pytest.mark.parametrize("scheme", sorted(STORES))
def test_checkpoints_on_a_store_save_restore_and_fall_back(caplog, scheme):
    with STORES[scheme]() as bucket:
        s1 = make_state(mesh_of(fsdp=2))
        s2 = train_steps(s1, 1)
        manager = js.CheckpointManager(f"{bucket}/run/checkpoints", async_save=True)
        manager.save(1, s1, data_state={"epoch": 0})
        manager.save(2, s2)
        manager.wait_until_finished()
        assert manager.all_steps() == [1, 2]
        fresh = js.CheckpointManager(f"{bucket}/run/checkpoints")
        restored = fresh.restore(target(mesh_of(fsdp=2, tp=2)))  # another mesh
        assert restored.step == 2 and equal(restored.state.params, s2.params)
        assert fresh.restore(target(mesh_of(fsdp=1)), step=1).data_state == {"epoch": 0}

        fs, root = fsspec.core.url_to_fs(f"{bucket}/run/checkpoints/2")  # a user's own client
        data = {k: v["size"] for k, v in fs.find(root, detail=True).items() if "/params/" in k and "/d/" in k}
        victim = max(data, key=data.get)
        good = fs.cat_file(victim)
        fs.pipe_file(victim, good[: len(good) // 3])  # truncated: its size, from one listing
        with pytest.raises(js.CheckpointCorruptError, match=r"is corrupt \(size \d+ vs \d+ written\)"):
            js.CheckpointManager(f"{bucket}/run/checkpoints").restore(target(mesh_of(fsdp=2)), step=2)
        fs.rm(victim)  # deleted
        with pytest.raises(js.CheckpointCorruptError, match="is missing"):
            js.CheckpointManager(f"{bucket}/run/checkpoints").restore(target(mesh_of(fsdp=2)), step=2)
        raw = bytearray(good)
        raw[len(raw) // 2] ^= 0xFF
        fs.pipe_file(victim, bytes(raw))
        with caplog.at_level("ERROR"):
            back = js.CheckpointManager(f"{bucket}/run/checkpoints").restore(target(mesh_of(fsdp=2)))
        assert back.step == 1 and equal(back.state.params, s1.params)
        assert "array data differs from what was saved" in caplog.text and "2.corrupt" in caplog.text
        names = {p.rsplit("/", 1)[-1] for p in fs.ls(fs._strip_protocol(f"{bucket}/run/checkpoints"), refresh=True)}
        assert "2.corrupt" in names and "2" not in names
        again = js.CheckpointManager(f"{bucket}/run/checkpoints")
        again.save(2, s2)  # the run can write that step again
        again.wait_until_finished()
        assert equal(again.restore(target(mesh_of(fsdp=2))).state.params, s2.params)


def test_a_step_without_its_commit_marker_is_never_listed_nor_restored():
    """On S3 a step is written in place and `commit_success.txt` is added last: a step whose marker is missing
    (an upload cut off by a crash) is not listed, never restored, and the next save of that step replaces it;
    keep-N never deletes the newest complete step."""
    with s3_server() as bucket:
        state = make_state(mesh_of(fsdp=2))
        where = f"{bucket}/run/checkpoints"
        manager = js.CheckpointManager(where, async_save=False, save_total_limit=2)
        for step in (1, 2, 3):
            manager.save(step, train_steps(state, step))
        assert manager.all_steps() == [2, 3]
        fs, root = fsspec.core.url_to_fs(where)
        markers = sorted(
            p for p in fs.find(root) if p.endswith("/commit_success.txt") and p.count("/") == root.count("/") + 2
        )
        assert [m.rsplit("/", 2)[-2] for m in markers] == ["2", "3"]
        fs.rm(f"{root}/3/commit_success.txt")  # step 3's upload never finished
        reader = js.CheckpointManager(where, read_only=True)
        assert reader.all_steps() == [2]
        assert reader.restore(target(mesh_of(fsdp=4))).step == 2
        again = js.CheckpointManager(where, async_save=False, save_total_limit=2)
        again.save(3, train_steps(state, 3))
        assert again.all_steps() == [2, 3]
        assert equal(again.restore(target(mesh_of(fsdp=2))).state.params, train_steps(state, 3).params)


@pytest.mark.parametrize("scheme", sorted(STORES))
def test_conditional_writes_and_the_run_lease(scheme):
    """The store decides a conditional write: of two creators one wins, a replace needs the version read. The
    run directory's lease: a second run (another process) is refused naming the owner; a lease whose owner
    process died is taken over; a released lease is gone."""
    import os
    import subprocess
    import sys

    from jaxloom.core import paths

    with STORES[scheme]() as bucket:
        obj = f"{bucket}/cond/x"
        paths.write_if(obj, b"one", None)
        with pytest.raises(paths.PreconditionFailed):
            paths.write_if(obj, b"two", None)
        data, version = paths.read_versioned(obj)
        assert data == b"one"
        paths.write_if(obj, b"three", version)
        with pytest.raises(paths.PreconditionFailed):
            paths.write_if(obj, b"four", version)  # changed since it was read
        assert paths.read_versioned(obj)[0] == b"three"

        code = (
            "import sys, jaxloom.state as js\n"
            "try:\n"
            f"    js.StoreLease({bucket + '/run'!r}).acquire()\n"
            "    print('TOOK')\n"
            "except js.DirectoryLockedError as e:\n"
            "    print('REFUSED', e)\n"
        )

        def other() -> str:
            return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout

        lease = js.StoreLease(f"{bucket}/run").acquire()
        assert lease.owner()["pid"] == os.getpid()
        refused = other()
        assert refused.startswith("REFUSED") and f"pid {os.getpid()}" in refused, refused
        lease.release()
        assert lease.owner() is None
        assert other().startswith("TOOK")  # that process exits without releasing it: a dead owner's lease
        taken = js.StoreLease(f"{bucket}/run").acquire()
        assert taken.owner()["pid"] == os.getpid()  # taken over
        taken.release()

        # fencing: a holder paused past its lease, taken over meanwhile, learns it before its next write
        first = js.StoreLease(f"{bucket}/fenced", ttl=3).acquire()
        assert first.check() == first.generation == 1  # renewed now; the generation a write records
        first._stop.set()  # paused: no renewal from here on
        time.sleep(3.5)
        second = js.StoreLease(f"{bucket}/fenced", ttl=30).acquire()  # expired: taken over
        assert second.generation == 2
        with pytest.raises(js.LeaseLostError, match=r"taken by another run \(pid \d+ .* generation 2"):
            first.check()
        first.release()  # never removes the new owner's lease
        assert second.owner()["generation"] == 2 and second.check() == 2
        second.release()


def test_a_step_written_after_the_lease_changed_hands_is_never_resumed(tmp_path, caplog):
    """Generations recorded by `save(generation=...)` never decrease with the step: a step of an older
    generation above a newer generation's step was written by a run that had lost the lease; it is skipped by
    `resumable_step` and `restore` (a local-disk checkpoint carries no generation and is never skipped)."""
    state = make_state(mesh_of(fsdp=2))
    manager = js.CheckpointManager(str(tmp_path / "ckpt"), async_save=False, save_total_limit=None)
    manager.save(4, train_steps(state, 4), generation=1)  # the first run
    manager.save(8, train_steps(state, 8), generation=2)  # the run that took over
    manager.save(12, train_steps(state, 9), generation=1)  # the first run, late (no fence)
    assert manager.all_steps() == [4, 8, 12] and manager.latest_step() == 12
    with caplog.at_level("WARNING"):
        assert manager.resumable_step() == 8
    assert "had lost this directory's lease (generation 1, after generation 2 took over)" in caplog.text
    restored = manager.restore(target(mesh_of(fsdp=2)))
    assert restored.step == 8 and equal(restored.state.params, train_steps(state, 8).params)
    manager.save(16, train_steps(state, 10))  # no generation: never fenced out
    assert manager.resumable_step() == 16


def test_a_late_writer_never_touches_the_folder_of_the_run_that_took_its_lease_over(caplog):
    """Issue 70: a run paused past its lease still has a save in flight when it continues; its array writes land
    without asking the lease (tensorstore writes a bucket's step folder in place). Run B, which took the lease over
    (generation 2), names its steps `<step>.g2`: run A's late save of the same step writes `8`, never B's `8.g2`,
    so B's checkpoint 8 restores B's arrays, verified, whatever A wrote after (with one name per step, A's
    writes replaced B's objects and step 8 restored A's arrays). Each step is read from its newest committed
    generation; a lower step of generation 1 (A's `4`, which B resumed from) is still read."""
    state = make_state(mesh_of(fsdp=2))
    with s3_server() as bucket:
        uri = f"{bucket}/run/checkpoints"
        a = js.CheckpointManager(uri, async_save=False, save_total_limit=None)
        a.save(4, train_steps(state, 4), generation=1)
        b = js.CheckpointManager(uri, async_save=False, save_total_limit=None)
        b.save(8, train_steps(state, 8), generation=2)
        a.save(8, train_steps(state, 3), generation=1)  # A's write in flight, landing after B committed step 8
        fs, root = fsspec.core.url_to_fs(uri)
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, refresh=True))
        assert names == ["4", "8", "8.g2"], names
        reader = js.CheckpointManager(uri, read_only=True)
        assert reader.all_steps() == [4, 8] and str(reader.step_folder(8)).endswith("/checkpoints/8.g2")
        assert reader.read_meta(8)["lease_generation"] == 2
        reader.verify(8)  # B's files as B wrote them
        restored = reader.restore(target(mesh_of(fsdp=2)))
        assert restored.step == 8 and equal(restored.state.params, train_steps(state, 8).params)
        four = reader.restore(target(mesh_of(fsdp=2)), step=4)
        assert equal(four.state.params, train_steps(state, 4).params)
        # B ended and released its lease; the next run is generation 3, past every generation that wrote here (a
        # lease taken where none is never starts again at 1: its steps would sit below generation 2's, fenced out)
        from jaxloom.core import paths

        assert js.newest_generation(paths.as_path(uri)) == 2
        lease = js.StoreLease(f"{bucket}/run", ttl=30, after=js.newest_generation(paths.as_path(uri))).acquire()
        assert lease.generation == 3
        c = js.CheckpointManager(uri, async_save=False, save_total_limit=None)
        c.save(12, train_steps(state, 12), generation=lease.generation)
        lease.release()
        assert c.resumable_step() == 12 and str(c.step_folder(12)).endswith("/12.g3")
    assert js.step_name(8, 2) == "8.g2" and js.step_name(8, 1) == js.step_name(8) == "8"
    assert js.parse_step_name("8.g2") == (8, 2) and js.parse_step_name("8") == (8, 1)
    assert js.parse_step_name("8.corrupt") is None and js.parse_step_name("8.orbax-checkpoint-tmp-1") is None


def test_hf_export_to_gcs_streams_and_loads_back(tmp_path):
    """save_pretrained(to_hf=True) into gs://: written beside the destination, then swapped in; a re-export
    leaves no stale shard and keeps the user's own files; the bucket's copy loads as the same model."""
    import jaxloom.models as jm

    state = make_state(mesh_of(fsdp=2))
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")), unk_token="[UNK]"
    )
    with gcs_emulator() as bucket:
        fs, _ = fsspec.core.url_to_fs(bucket)
        js.save_pretrained(state, f"{bucket}/hf", tokenizer=tok, max_shard_bytes=20_000)  # several shards
        root = fs._strip_protocol(f"{bucket}/hf")
        first = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, refresh=True))
        assert "tokenizer.json" in first and "model.safetensors.index.json" in first  # uploaded beside the shards
        fs.pipe_file(f"{root}/README.md", b"my notes")
        js.save_pretrained(train_steps(state, 1), f"{bucket}/hf")  # one file now, over the sharded one
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, refresh=True))
        assert "model.safetensors" in names and "README.md" in names and "tokenizer.json" not in names
        assert not [n for n in names if n.startswith("model-0")] and "model.safetensors.index.json" not in names
        assert not [p for p in fs.ls(fs._strip_protocol(bucket), refresh=True) if ".tmp-" in p or ".old-" in p]
        fs.get(root + "/", str(tmp_path / "local") + "/", recursive=True)
    loaded = jm.to_hf_state_dict(jm.from_pretrained(tmp_path / "local"))
    expected = jm.to_hf_state_dict(__import__("flax").nnx.merge(state.graphdef, train_steps(state, 1).params))
    assert sorted(loaded) == sorted(expected)
    for k in expected:
        np.testing.assert_array_equal(np.asarray(loaded[k]), gather(expected[k]), err_msg=k)


@pytest.fixture
def quick_gcsfs_backoff(monkeypatch):
    """gcsfs's own backoff between its six tries of a request (1 + 2 + 4 + 8 + 16 s, fixed when gcsfs is imported:
    33 s for each call that meets a stopped server) cut to 50 ms a try. The tries, the errors they end in and what
    jaxloom makes of them are unchanged; the test took 72 s with the real sleeps, two thirds of them there."""
    import asyncio
    import types

    import gcsfs.retry

    sleep = asyncio.sleep
    monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=lambda seconds: sleep(0.05)))


def test_a_store_that_goes_away_is_one_clear_error_and_a_rerun_resumes_when_it_is_back(
    caplog, tmp_path, quick_gcsfs_backoff
):
    """The GCS server stops mid-run (issue 43): the next save is one `CheckpointSaveError` saying the store
    cannot be reached and what to do, not four retry tracebacks and a raw client error. Started again (the same
    objects), a new manager finds checkpoint 1 complete and restores it: nothing saved before is lost."""
    import os
    import signal
    import subprocess

    from jaxloom.state.testing import emulator_command, wait_until_up

    with gcs_emulator(data_dir=str(tmp_path / "objects")) as bucket:
        state = make_state(mesh_of(fsdp=1))
        # the save's own backoff shortened (its default rides out 120 s): this test is about the one error it ends in
        manager = js.CheckpointManager(f"{bucket}/gone/checkpoints", async_save=False, retry_seconds=2)
        manager.save(1, state)
        os.kill(int(os.environ["JAXLOOM_GCS_EMULATOR_PID"]), signal.SIGKILL)  # the server goes away
        with caplog.at_level("WARNING"), pytest.raises(js.CheckpointSaveError) as failed:
            manager.save(2, state)
        host = os.environ["STORAGE_EMULATOR_HOST"]
        port = int(host.rsplit(":", 1)[1])
        again = subprocess.Popen(
            emulator_command(port, bucket.removeprefix("gs://"), str(tmp_path / "objects")),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until_up(host, bucket.removeprefix("gs://"), again)
            back = js.CheckpointManager(f"{bucket}/gone/checkpoints")
            assert back.all_steps() == [1]
            assert equal(back.restore(target(mesh_of(fsdp=1))).state.params, state.params)
        finally:
            again.kill()
            again.wait()
    text = str(failed.value)
    assert f"saving checkpoint 2 in {bucket}/gone/checkpoints failed: the store cannot be reached" in text
    assert "Rerun when the store is back" in text
    assert not [r for r in caplog.records if r.exc_info], "a client's retry logged a traceback"
