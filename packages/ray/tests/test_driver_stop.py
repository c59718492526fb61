"""`jaxloom train --ray` stopped by the user: SIGINT/SIGTERM to the driver (pressed again while it stops)
reaches every worker, which finish the same step, save that checkpoint and return; the driver prints the
summary and exits 0. A real driver process joined to the session's local Ray cluster through RAY_ADDRESS
(as `RAY_ADDRESS=... jaxloom train --ray` joins a user's), two workers."""

import json
import os
import signal
import subprocess
import sys
import time

from util import TINY_OVERRIDES

from jaxloom.state import CheckpointManager


def test_a_stop_signal_to_the_driver_saves_the_gang_and_exits_cleanly(ray_cluster, tmp_path):
    """SIGTERM, then Ctrl-C twice while the gang saves, each to the driver's whole process group (as a
    terminal's Ctrl-C and most schedulers do)."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-c",
        "import sys; from jaxloom.trainer.cli import main; sys.exit(main())",
        "train",
        *TINY_OVERRIDES,
        "max_training_steps=100000",
        "save_steps=100000",
        f"save_directory={run}",
        "eval_batches=1",
        "--ray",
        "num_workers=2",
        "max_failures=2",
    ]
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ.get("JAXLOOM_TEST_XLA_FLAGS", ""),
        "RAY_ADDRESS": ray_cluster["info"]["address"],
    }
    with open(tmp_path / "driver.err", "w") as err:
        driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
        try:
            deadline = time.time() + 300
            metrics = run / "metrics.jsonl"
            while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
                assert driver.poll() is None and time.time() < deadline, (tmp_path / "driver.err").read_text()[-4000:]
                time.sleep(0.1)
            os.killpg(driver.pid, signal.SIGTERM)
            # Python runs pending handlers in signal-number order, so a Ctrl-C sent before the driver has
            # taken the SIGTERM would be taken first: wait until it has, as a user would see it in the log
            while "signal 15: asking the gang" not in (tmp_path / "driver.err").read_text():
                assert driver.poll() is None and time.time() < deadline, (tmp_path / "driver.err").read_text()[-4000:]
                time.sleep(0.05)
            for _ in range(2):  # an impatient user: Ctrl-C while the gang saves
                time.sleep(0.2)
                os.killpg(driver.pid, signal.SIGINT)
            out, _ = driver.communicate(timeout=240)
        finally:
            driver.kill()
    log = (tmp_path / "driver.err").read_text()
    assert driver.returncode == 128 + signal.SIGTERM, log[-4000:]  # stopped by SIGTERM, after a clean save
    summary, _ = json.JSONDecoder().raw_decode(out[out.index("{\n") :])  # workers' lines may follow it
    # the rank that read the driver's stop first names it; the others stop with it after the same step
    assert summary["stop_reason"] in ("stop requested by the Ray driver", "stop requested by another process")
    assert summary["attempts"] == 1, summary
    assert 3 <= summary["step"] < 100000
    assert "again: the gang is saving its final checkpoint" in log
    assert "Connecting to existing Ray cluster at address: " + ray_cluster["info"]["address"] in log  # RAY_ADDRESS
    assert CheckpointManager(str(run / "checkpoints")).all_steps() == [summary["step"]]
    assert not list((run / "checkpoints").glob("*tmp*"))
