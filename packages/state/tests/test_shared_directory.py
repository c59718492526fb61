"""Two real JAX processes: `check_shared_directory`: a directory both see passes (and is left as it
was); a relative path under each process's own working directory (a node-local run directory) is one
error on every process, naming the process that cannot see it."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("shared_worker.py")


def _two(root: Path, mode: str, *more: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(rank), str(root), mode, *more],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a process hung")
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_a_directory_every_process_sees_passes(tmp_path):
    outs = _two(tmp_path, "shared")
    assert [o["error"] for o in outs] == [None, None]
    assert list((tmp_path / "run").iterdir()) == []  # the marker is removed


def test_a_node_local_directory_is_one_clear_error_on_every_process(tmp_path):
    outs = _two(tmp_path, "local")
    for o in outs:
        assert o["error"] and "save_directory run is not shared by the processes of this run" in o["error"]
        assert f"process 1 on {socket.gethostname()} cannot see" in o["error"]
        assert f"process 0 on {socket.gethostname()}" not in o["error"] and str(tmp_path / "0" / "run") in o["error"]


def test_save_minutes_shares_the_clock_every_few_steps_not_every_step(tmp_path):
    """Two processes agree on time-based saves, decided by process 0 at every 4th step only: no collective
    on the steps between."""
    outs = _two(tmp_path, "timed")
    assert [o["due"] for o in outs] == [[4, 8, 12], [4, 8, 12]]


@pytest.mark.parametrize("array_format", ["orbax", "raw"])
def test_each_process_reads_about_its_share_of_a_sharded_restore(tmp_path, array_format):
    """Two processes of four devices restore a 32 MB state sharded over the eight: integrity is checked in
    the same read (raw: each piece's digest as it is read; orbax: the arrays' digests over what was read), so
    each reads (rchar, plus the file pages it mapped) little more than its half, never every file of the
    checkpoint. Each process wrote the shards it owns."""
    outs = _two(tmp_path, "restore", array_format)
    for rank, o in enumerate(outs):
        assert o["equal"], rank
        if array_format == "raw":
            assert o["parts"] == ["process_0.bin", "process_0.json", "process_1.bin", "process_1.json"]
        else:
            assert o["parts"] == ["ocdbt.process_0", "ocdbt.process_1"]
        assert 0.9 * o["share"] <= o["read"] <= 1.2 * o["share"], (rank, o)
