"""Faults on an object store (issue 41), with the run directory and its checkpoints in a bucket of a real S3
server on loopback (moto) reached through a relay the test takes down (`jaxloom.state.testing.Outage`):

- out of reach for 20 s while checkpoints are saved: the store clients' retries (tensorstore's, s3fs's) and
  the save's own (backoff, `storage_retry_seconds`) ride it out, the run goes on and ends bitwise where an
  uninterrupted run ends;
- gone for good: the run stops with one clear error once `storage_retry_seconds` is spent; back again, a
  rerun resumes from the newest complete checkpoint and ends bitwise the same;
- a run paused past its lease (SIGSTOP) while another run takes the directory over: resumed (SIGCONT), it
  stops at its next write with one error naming the new owner, and the new owner's checkpoints are intact.

(SIGKILL during an upload, on S3 and GCS: packages/trainer/tests/test_resume_cli.py; a GCS server stopped
and started again with its objects: packages/state/tests/test_object_store.py.)"""

import os
import signal
import threading
import time

import numpy as np
import pytest
from faultrun import run_worker

from jaxloom.state.testing import Outage, s3_server


def _same(reference, folder):
    final = np.load(folder / "final.npz")
    for k in reference:
        np.testing.assert_array_equal(final[k], reference[k], err_msg=k)


def _run_with_outage(uri, relay, folder, *overrides, down_at=5, up_after=None, env=None):
    """The worker on `uri`, its store reached through `relay`, taken down when the worker prints `STEP
    down_at` and brought back `up_after` seconds later (None: left down)."""

    def watch(line_seen, proc):
        relay.down()
        if up_after is not None:
            threading.Timer(up_after, relay.up).start()

    env = {"AWS_ENDPOINT_URL": relay.url, "FINAL_TO": str(folder), **(env or {})}
    return run_worker(uri, *overrides, stop_after=down_at, sig=None, env=env, on_stop=watch, timeout=400)


def test_a_store_out_of_reach_for_20_s_during_a_save_is_retried_and_nothing_is_lost(reference, tmp_path):
    with s3_server() as bucket:
        relay = Outage(os.environ["AWS_ENDPOINT_URL"])
        try:
            proc, lines, err = _run_with_outage(f"{bucket}/runs/outage", relay, tmp_path, up_after=20)
        finally:
            relay.stop()
    assert proc.returncode == 0, err[-3000:]
    assert relay.refused > 0  # the run reached for the store while it was down (the clients' retries and
    # jaxloom's, "the store cannot be reached; trying again in N s", rode it out)
    _same(reference, tmp_path)


def test_a_store_gone_for_good_stops_the_run_with_one_error_and_a_rerun_resumes(reference, tmp_path):
    with s3_server() as bucket:
        uri = f"{bucket}/runs/gone"
        relay = Outage(os.environ["AWS_ENDPOINT_URL"])
        try:
            # synchronous saves: checkpoint 4 is complete when step 5 starts; the S3 client's own retries
            # shortened (AWS_MAX_ATTEMPTS) so that jaxloom's give up within seconds
            proc, lines, err = _run_with_outage(
                uri,
                relay,
                tmp_path,
                "storage_retry_seconds=4",
                "async_checkpointing=false",
                env={"AWS_MAX_ATTEMPTS": "2"},
            )
            assert proc.returncode not in (0, None), err[-3000:]
            errors = [x for x in lines if x.startswith("ERROR ")]
            assert len(errors) == 1 and "the store cannot be reached" in errors[0], (lines, err[-3000:])
            assert "Rerun when the store is back" in errors[0]
            assert "the store cannot be reached; trying again in 1 s" in err  # backoff first, then the error
            relay.up()
            again, lines, err = run_worker(
                uri, "async_checkpointing=false", env={"AWS_ENDPOINT_URL": relay.url, "FINAL_TO": str(tmp_path)}
            )
        finally:
            relay.stop()
    assert again.returncode == 0, err[-3000:]
    assert f"RESUMED_FROM {uri}/checkpoints/4" in lines, (lines, err[-5000:])
    _same(reference, tmp_path)


@pytest.mark.parametrize("checkpoints", ["sync", "async"])
def test_a_run_paused_past_its_lease_stops_before_writing_and_the_run_that_took_over_is_intact(
    reference, tmp_path, checkpoints
):
    """Run A is SIGSTOPped (its lease: 3 s); run B takes the expired lease over (generation 2) and finishes; A,
    continued, renews nothing and writes nothing: its next save is fenced (exit 5, one error naming B). B's
    checkpoints are B's, and a rerun resumes B's last one bitwise. `sync`: A paused after step 5, B resumes from
    checkpoint 4. `async` (the defaults, issue 70): A paused as checkpoint 4 is handed to the background writer;
    that save in flight asks the lease again before orbax commits it and is never committed as A's."""
    from jaxloom.state import CheckpointManager

    common = ("storage_lease_seconds=3", *(["async_checkpointing=false"] if checkpoints == "sync" else []))
    for name in "abc":
        (tmp_path / name).mkdir()
    with s3_server() as bucket:
        uri = f"{bucket}/runs/lease-{checkpoints}"
        taken = {}

        def pause_and_take_over(line, proc):
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                time.sleep(4)  # past A's lease
                taken["b"] = run_worker(uri, *common, env={"FINAL_TO": str(tmp_path / "b")})
            finally:
                os.kill(proc.pid, signal.SIGCONT)

        pause = dict(stop_after=5) if checkpoints == "sync" else dict(stop_after=4, stop_line="SAVING 4")
        a, lines, err = run_worker(
            uri, *common, **pause, sig=None, on_stop=pause_and_take_over, env={"FINAL_TO": str(tmp_path / "a")}
        )
        assert "b" in taken, (lines, err[-3000:])
        b, b_lines, b_err = taken["b"]
        assert b.returncode == 0, b_err[-3000:]
        resumed_from_4 = any(x.startswith("RESUMED_FROM") and x.endswith("checkpoints/4") for x in b_lines)
        assert resumed_from_4 or checkpoints == "async", b_lines
        assert a.returncode == 5, err[-3000:]
        errors = [x for x in err.splitlines() if x.startswith("jaxloom: error")]
        assert len(errors) == 1 and "LeaseLostError" in errors[0] and "taken by another run" in errors[0], err[-3000:]
        assert "nothing more was written" in err, err[-3000:]
        assert not (tmp_path / "a" / "final.npz").exists()
        manager = CheckpointManager(f"{uri}/checkpoints", read_only=True)
        steps = manager.all_steps()
        assert steps[-1] == 16, steps
        generations = {s: manager.read_meta(s).get("lease_generation") for s in steps}
        # every committed checkpoint is B's, but a checkpoint 4 A committed before its pause (B resumed from it)
        assert all(g == 2 for s, g in generations.items() if s > 4 or not resumed_from_4), (generations, b_lines)
        c, c_lines, c_err = run_worker(uri, *common, env={"FINAL_TO": str(tmp_path / "c")})
    assert c.returncode == 0, c_err[-3000:]
    _same(reference, tmp_path / "b")
    _same(reference, tmp_path / "c")  # B's final checkpoint, restored with its digests checked
