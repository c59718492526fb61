"""Faults with their observed outcomes: SIGKILL at random steps, SIGINT/SIGTERM, a full disk. (Kill
during an async write, corrupted checkpoints, NaN, and Ray worker death/hang are held by the tests
named in docs/reliability.md.)"""

import json
import os
import signal
import socket
import subprocess
import sys

import time

import numpy as np
import pytest
from faultrun import WORKER, run_worker


@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_at_a_random_step_resumes_to_the_same_parameters(reference, tmp_path, seed):
    kill_at = int(np.random.default_rng(seed).integers(5, 15))
    killed, _, _ = run_worker(tmp_path, stop_after=kill_at)
    assert killed.returncode == -signal.SIGKILL
    again, lines, err = run_worker(tmp_path)
    assert again.returncode == 0, err[-3000:]
    resumed = next(x for x in lines if x.startswith("RESUMED_FROM"))
    if "checkpoints/" in resumed:
        step = int(resumed.rsplit("/", 1)[-1])
        assert step % 4 == 0 and step <= kill_at, (resumed, kill_at)
    else:  # the kill beat the first async finalisation: the log says it started over
        assert "no complete checkpoint" in err
    final = np.load(tmp_path / "final.npz")
    for k in reference:
        np.testing.assert_array_equal(final[k], reference[k], err_msg=f"{k} after a kill at step {kill_at}")


# SIGHUP: the terminal closed or the ssh session dropped (issue 43: it killed the run with no checkpoint);
# SIGQUIT (Ctrl-\) dumped core
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_stop_signal_saves_a_checkpoint_and_exits_cleanly(tmp_path, sig):
    proc, lines, err = run_worker(tmp_path, "save_steps=100", stop_after=5, sig=sig, timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "STOP_REASON stop signal received" in lines
    stopped_at = max(int(x.split()[1]) for x in lines if x.startswith("STEP "))
    assert 5 <= stopped_at <= 6  # the step in flight finishes, nothing more
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [stopped_at]
    resumed, lines, err = run_worker(tmp_path, "max_training_steps=8")
    assert f"resumed from checkpoint {tmp_path}/checkpoints/{stopped_at}" in err


def test_repeated_stop_signals_while_stopping_still_save_and_exit_cleanly(tmp_path):
    """Ctrl-C pressed four times: the signals after the first are ignored until the final checkpoint is
    complete."""
    proc, lines, err = run_worker(tmp_path, "save_steps=100", stop_after=5, sig=signal.SIGINT, repeat=3, timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "STOP_REASON stop signal received" in lines and "again: still saving the final checkpoint" in err
    stopped_at = max(int(x.split()[1]) for x in lines if x.startswith("STEP "))
    from jaxloom.state import CheckpointManager

    assert CheckpointManager(str(tmp_path / "checkpoints")).all_steps() == [stopped_at]
    assert not list((tmp_path / "checkpoints").glob("*.orbax-checkpoint-tmp*"))


def test_a_stop_signal_to_one_process_stops_every_process_after_the_same_step(tmp_path):
    """Two processes over gloo; SIGTERM reaches only process 1 (a preempted host). Its request rides in the
    next step's batch, so both stop after the same step, save that checkpoint together and exit 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}",
        "JAXLOOM_RUN_OWNER": "mp-test",
    }
    args = [sys.executable, str(WORKER), str(tmp_path), "max_training_steps=5000", "save_steps=5000"]
    # The worker's markers on stdout, gloo's and the logs' lines on stderr: one stream each, never interleaved
    # mid-line (a shared file once read "STEP 1[Gloo] ...").
    logs = [tmp_path / f"p{r}.out" for r in range(2)]
    errs = [tmp_path / f"p{r}.err" for r in range(2)]
    procs = [
        subprocess.Popen(
            args,
            stdout=open(logs[r], "w"),
            stderr=open(errs[r], "w"),
            text=True,
            env={**env, "TEST_PROCESS": f"{r}/2/{port}"},
        )
        for r in range(2)
    ]
    try:
        deadline = time.time() + 240
        while "STEP 4\n" not in logs[1].read_text():
            assert time.time() < deadline and all(p.poll() is None for p in procs), errs[1].read_text()[-3000:]
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    outs = [log.read_text() for log in logs]
    assert codes == [0, 0], "".join(e.read_text()[-2000:] for e in errs)
    last = [max(int(ln.split()[1]) for ln in out.splitlines() if ln.startswith("STEP ")) for out in outs]
    assert last[0] == last[1] and 4 <= last[0] < 100, last
    assert all("STOP_REASON stop signal received" in out for out in outs)
    from jaxloom.state import CheckpointManager

    assert CheckpointManager(str(tmp_path / "checkpoints")).all_steps() == [last[0]]


def test_full_disk_during_a_save_is_a_clear_error_and_keeps_earlier_checkpoints(tmp_path):
    # Files may not grow past 64 KiB from step 6 on: the step-8 checkpoint's arrays cannot be written.
    proc, lines, err = run_worker(
        tmp_path, "async_checkpointing=false", env={"FSIZE_LIMIT_AT": "6:65536", "TEST_XLA_CACHE": ""}
    )
    assert proc.returncode == 3, err[-3000:]
    error = next(x for x in lines if x.startswith("ERROR "))
    assert "saving checkpoint 8 in" in error and "Earlier checkpoints [4] are untouched" in error, error
    assert error.startswith("ERROR the disk is full") and "A checkpoint takes about" in error, error
    assert "STEP 8" in lines and "STEP 9" not in lines  # stopped at the failed save, not later
    from jaxloom.state import CheckpointManager

    manager = CheckpointManager(str(tmp_path / "checkpoints"))
    assert manager.latest_step() == 4  # the partial step-8 write is never chosen
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics and metrics[0]["step"] == 4  # what was written before is still readable
    again, lines, err = run_worker(tmp_path, "async_checkpointing=false")
    assert again.returncode == 0 and f"resumed from checkpoint {tmp_path}/checkpoints/4" in err, err[-3000:]


def test_two_processes_finish_with_previews_evaluation_report_and_plot(tmp_path):
    """The demo's end of run on a gang (issue 42): previews and the final sample decode the model sharded over
    two processes, evaluation runs, and the report and plot are written — every multi-process test used to
    turn previews off, and the final preview could not read an array spread over two processes. One device
    per process, as each Ray worker of `--ray num_workers=2` has: every array is split between the processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=1 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}",
        "JAXLOOM_RUN_OWNER": "mp-test",
    }
    args = [
        sys.executable,
        str(WORKER),
        str(tmp_path),
        "max_training_steps=4",
        "generation_interval=2",
        "plot_loss=true",
    ]
    args += ["generation_prompts=[The interpreter, A list is]", "generation_max_new_tokens=24", "evaluation_steps=2"]
    logs = [tmp_path / f"p{r}.out" for r in range(2)]
    errs = [tmp_path / f"p{r}.err" for r in range(2)]
    procs = [
        subprocess.Popen(
            args,
            stdout=open(logs[r], "w"),
            stderr=open(errs[r], "w"),
            env={**env, "TEST_PROCESS": f"{r}/2/{port}"},
        )
        for r in range(2)
    ]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    outs = [log.read_text() for log in logs]
    assert codes == [0, 0], "".join(e.read_text()[-3000:] for e in errs)
    assert all("STOP_REASON max_training_steps reached" in out for out in outs)
    assert (tmp_path / "report.md").is_file() and (tmp_path / "loss.png").is_file()
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert sum('"samples"' in r for r in rows) >= 2 and any('"eval/loss"' in r for r in rows)


def test_a_closed_output_pipe_never_stops_training(tmp_path):
    """`jaxloom train ... | head -1`: the reader goes away after the first line (issue 43: the run ended at
    the next print and lost every step since its last checkpoint). Training goes on to its last step, saves
    it, and writes its metrics and report; only console lines are lost."""
    from faultrun import TINY

    cmd = [sys.executable, "-m", "jaxloom.trainer.cli", "train", *TINY, "max_training_steps=8", "logging_steps=1"]
    cmd += [f"save_directory={tmp_path / 'run'}", "save_steps=100"]
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(tmp_path / "err", "w"), env=env)
    assert proc.stdout.readline()  # the first console line, then the reader is gone
    proc.stdout.close()
    assert proc.wait(timeout=240) == 0, (tmp_path / "err").read_text()[-3000:]
    from jaxloom.state import CheckpointManager

    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).all_steps() == [8]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"train/loss"' in r for r in rows) == 8 and (tmp_path / "run" / "report.md").is_file()
