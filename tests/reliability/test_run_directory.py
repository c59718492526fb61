"""One owner per save_directory, no earlier run replaced silently, run directories read as data, and an
error mid-training that never leaves a checkpoint half written or the process hanging."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from faultrun import TINY, run_worker


from jaxloom.trainer.arguments import apply_overrides, load_config_file
from jaxloom.trainer.cli import DEMO_CONFIG


def steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in (directory / "checkpoints").iterdir() if p.name.isdigit())


def test_a_second_live_run_is_refused_and_a_dead_owners_lock_is_taken_over(tmp_path):
    hold = "import sys, time\nfrom jaxloom.state import DirectoryLock\nDirectoryLock(sys.argv[1]).acquire()\n"
    hold += "print('HELD', flush=True)\ntime.sleep(300)\n"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "HELD"
        proc, _, err = run_worker(tmp_path, "max_training_steps=4")
        assert proc.returncode == 2, err[-3000:]
        assert f"{tmp_path} is in use by another run (pid {holder.pid} on" in err, err[-3000:]
        assert not (tmp_path / "checkpoints").exists()  # nothing written by the refused run
    finally:
        holder.kill()
        holder.wait()
    proc, _, err = run_worker(tmp_path, "max_training_steps=4")  # the owner is dead: its lock is taken over
    assert proc.returncode == 0, err[-3000:]
    assert steps(tmp_path) == [4] and not (tmp_path / ".jaxloom.lock").exists()  # released at the end


def test_an_earlier_run_is_never_replaced_silently(tmp_path):
    first, _, err = run_worker(tmp_path, "max_training_steps=4")
    assert first.returncode == 0, err[-3000:]
    before = (tmp_path / "metrics.jsonl").read_text()
    proc, _, err = run_worker(tmp_path, "max_training_steps=4", "resume_if_possible=false")
    assert proc.returncode == 2, err[-3000:]
    assert f"save_directory {tmp_path} holds checkpoints [4] of an earlier run and resume_if_possible=false" in err
    assert "overwrite_output_dir=true" in err
    assert steps(tmp_path) == [4] and (tmp_path / "metrics.jsonl").read_text() == before  # untouched
    proc, lines, err = run_worker(tmp_path, "max_training_steps=8", "overwrite_output_dir=true")
    assert proc.returncode == 0, err[-3000:]
    assert "RESUMED_FROM None" in lines  # started over, from scratch
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [4, 8]  # the old run's rows are gone


def test_commands_that_read_a_run_take_no_process_settings_from_it(tmp_path):
    """`jaxloom convert` of a run: no process settings from its run_config.json, no training data needed (an
    epoch-based run whose data file is gone), no lock taken (the run may still be training), and nothing in
    the run changed: the step its owner is writing (`<step>.orbax-checkpoint-tmp`) is left alone (issue 43:
    a reader's checkpoint manager cleaned it up and the training died on its save)."""
    run = tmp_path / "run"
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i}: the quick brown fox"}) + "\n" for i in range(120)))
    train = [f"data.train={data}", "data.eval=null", "max_training_steps=null", "num_train_epochs=1"]
    proc, lines, err = run_worker(run, *train)
    assert proc.returncode == 0 and "STEP 2" in lines, err[-3000:]
    evil = tmp_path / "chosen-by-the-run-directory"
    resolved = apply_overrides(
        load_config_file(DEMO_CONFIG), [*TINY, *train, f"save_directory={run}", f"compilation_cache_dir={evil}"]
    )
    (run / "run_config.json").write_text(json.dumps(resolved))
    data.unlink()
    holder = subprocess.Popen(  # a live run owns the directory
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom jaxloom.state import DirectoryLock\n"
            "DirectoryLock(sys.argv[1]).acquire(); print('HELD', flush=True); time.sleep(300)",
            str(run),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    in_flight = run / "checkpoints" / "99.orbax-checkpoint-tmp-1764100000000000"
    (in_flight / "params").mkdir(parents=True)
    (in_flight / "params" / "process_0.bin").write_bytes(b"\0" * 64)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}",
    }
    try:
        assert holder.stdout.readline().strip() == "HELD"
        out = subprocess.run(
            [sys.executable, "-m", "jaxloom.trainer.cli", "convert", "--to-hf", str(run), str(tmp_path / "hf")],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file() and not evil.exists()
    assert (in_flight / "params" / "process_0.bin").is_file()  # a reader changes nothing of the run


def _bad_record_run(directory: Path):
    """A run whose data has, at line 70, a pre-tokenized record with a token id past the vocabulary (found only
    when the loader reads it with the tokenizer: the up-front check of small files reads structure, issue 57),
    reached at step 5, just after the asynchronous step-4 checkpoint started."""
    directory.mkdir()
    data = directory / "data.jsonl"
    lines = [json.dumps({"text": f"record {i}: the quick brown fox jumps over the lazy dog"}) for i in range(200)]
    lines[69] = json.dumps({"input_ids": [5, 6, 10**7]})
    data.write_text("\n".join(lines) + "\n")
    out = directory / "run"
    return (
        run_worker(
            out,
            f"data.train={data}",
            "data.eval=null",
            "shuffle_train_dataset=false",
            "max_training_steps=12",
            timeout=120,
        ),
        data,
        out,
    )


def test_an_error_mid_training_waits_for_the_checkpoint_in_flight_and_exits_20_times(tmp_path):
    """Repeated: the interpreter never hangs at exit (orbax threads), no `*.orbax-checkpoint-tmp` remains,
    and the error names the file, the line and the step."""
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda i: _bad_record_run(tmp_path / f"r{i}"), range(20)))
    for (proc, _lines, err), data, out in results:
        assert proc.returncode == 2, err[-3000:]  # run_worker's timeout would have raised on a hang
        assert f"{data}:70: input_ids hold 5..10000000; expected ids in [0, " in err, err[-3000:]
        assert "training stopped during step" in err and "the newest complete checkpoint is" in err, err[-3000:]
        assert not list((out / "checkpoints").glob("*.orbax-checkpoint-tmp*"))
        assert steps(out) and max(steps(out)) % 4 == 0
