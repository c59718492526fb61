"""Atomic outputs: a Hugging Face export is written beside its directory and renamed into place, so a kill
or a full disk mid-export leaves the previous export loadable, and no stale shard or index survives."""

import contextlib
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import jaxloom.models as jm

TINY = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=32,
    eos_token_id=2,
)

# Exports a seeded tiny model into argv[1] in many small shards; "pause" stops after the first shard file,
# "full" writes with a 2 KB file-size limit.
CHILD = f"""
import sys, time
import jaxloom.models as jm
from jaxloom.models import safetensors_io
out, seed, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = jm.create_model(jm.LlamaConfig(**{TINY!r}), seed=seed)
if mode == "pause":  # stop once the first shard file of the new export is complete
    close = safetensors_io.StreamWriter.__exit__
    def slow(self, *a):
        close(self, *a)
        print("WROTE", flush=True)
        time.sleep(120)
    safetensors_io.StreamWriter.__exit__ = slow
if mode == "full":  # no file may grow past 2 KB, as on a full disk
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
jm.save_hf_model(model, out, max_shard_bytes=4000)
print("DONE", flush=True)
"""


def export(out, seed, **kw):
    jm.save_hf_model(jm.create_model(jm.LlamaConfig(**TINY), seed=seed), out, **kw)


def weights(path):
    return {k: np.asarray(v) for k, v in jm.to_hf_state_dict(jm.from_pretrained(path)).items()}


def child(out, seed, mode):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("JAXLOOM_TEST_XLA_FLAGS", "")}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(out), str(seed), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.fixture
def good_export(tmp_path):
    out = tmp_path / "export"
    export(out, seed=0)  # one file, no index
    (out / "README.md").write_text("my notes")
    return out, weights(out)


def test_sigkill_mid_export_leaves_the_previous_export_intact(good_export):
    out, before = good_export
    proc = child(out, seed=1, mode="pause")
    assert proc.stdout.readline().strip() == "WROTE"  # one shard of the new export is on disk
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    after = weights(out)
    assert all(np.array_equal(after[k], before[k]) for k in before)


def test_full_disk_mid_export_is_an_error_and_keeps_the_previous_export(good_export):
    out, before = good_export
    proc = child(out, seed=1, mode="full")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "File too large" in err, err[-2000:]
    after = weights(out)
    assert all(np.array_equal(after[k], before[k]) for k in before)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".export.tmp")]  # the partial write is gone


def test_reexporting_unsharded_over_sharded_leaves_no_stale_index(tmp_path):
    out = tmp_path / "export"
    export(out, seed=0, max_shard_bytes=4000)
    assert (out / "model.safetensors.index.json").is_file()
    export(out, seed=1)  # one file now
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"], names
    fresh = {k: np.asarray(v) for k, v in jm.to_hf_state_dict(jm.create_model(jm.LlamaConfig(**TINY), seed=1)).items()}
    loaded = weights(out)
    assert all(np.array_equal(loaded[k], fresh[k]) for k in fresh)  # the new weights, not the old shards
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_a_full_disk_during_jaxloom_convert_is_one_line_and_keeps_the_previous_export(tmp_path):
    """`jaxloom convert --to-hf` on a full disk ended in a traceback (issue 43): one line naming what could not
    be written and what to do, exit 3, and the previous export intact."""
    from jaxloom.trainer.cli import main

    tiny = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
            "max_sequence_length=32", "total_batch_size=8", "progress_bar=false", "max_training_steps=1",
            "generation_prompts=[]", f"save_directory={tmp_path / 'run'}"]  # fmt: skip
    assert main(["train", *tiny]) == 0
    out = tmp_path / "hf"
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(out)]) == 0
    before = weights(out)
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))  # no file may grow past 20 KB, as on a full disk\n"
        "from jaxloom.trainer.cli import main\n"
        f"sys.exit(main(['convert', '--to-hf', {str(tmp_path / 'run')!r}, {str(out)!r}]))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("JAXLOOM_TEST_XLA_FLAGS", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "jaxloom: error: the disk is full writing" in proc.stderr and "Traceback" not in proc.stderr
    after = weights(out)
    assert all(np.array_equal(after[k], before[k]) for k in before)


@contextlib.contextmanager
def tmpfs(path, options):
    """A real tmpfs mounted at `path` with `options` for the block (skips the test where mounting needs root)."""
    path.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.decode()[:200]}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def train_into(directory, *extra):
    """`jaxloom train` of a tiny model into `directory` in a new process: the finished process."""
    tiny = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1"]
    tiny += ["max_sequence_length=16", "total_batch_size=4", "progress_bar=false", "generation_prompts=[]"]
    return subprocess.run(
        [sys.executable, "-m", "jaxloom.trainer.cli", "train", f"save_directory={directory}", *tiny, *extra],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("JAXLOOM_TEST_XLA_FLAGS", "")},
        timeout=300,
    )


def test_a_read_only_save_directory_is_one_line(tmp_path):
    """A save_directory on a read-only filesystem (a real read-only tmpfs mount) ended in a traceback
    (issue 43): one line naming the directory and what to do, exit 3."""
    with tmpfs(tmp_path / "ro", "ro,size=1m") as mount:
        proc = train_into(mount / "run", "max_training_steps=1")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert f"jaxloom: error: cannot write {mount / 'run'} (Read-only file system)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_full_filesystem_during_training_is_one_error_and_keeps_earlier_checkpoints(tmp_path):
    """A real full filesystem (a 3 MB tmpfs) under a run saving every step: one `CheckpointSaveError` line, exit
    3, the checkpoints written before intact — not five orbax tracebacks before it (issue 43)."""
    from jaxloom.state import CheckpointManager

    with tmpfs(tmp_path / "small", "size=3m") as mount:
        proc = train_into(mount / "run", "max_training_steps=6", "save_steps=1", "save_total_limit=10")
        kept = sorted(int(p.name) for p in (mount / "run" / "checkpoints").iterdir() if p.name.isdigit())
        assert kept and CheckpointManager(str(mount / "run" / "checkpoints")).all_steps() == kept
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "jaxloom: error: CheckpointSaveError: the disk is full: saving checkpoint" in proc.stderr
    assert "No space left on device" in proc.stderr and "Traceback" not in proc.stderr
    # said as a full disk with how much to free, whatever wrapped the writer's error (issue 52)
    assert " is free there" in proc.stderr and "then rerun: the run resumes" in proc.stderr, proc.stderr
