"""The real multi-host path: 2 processes × 2 CPU devices joined by jax.distributed over gloo."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("mp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two(tmp_path, mesh: dict):
    port, outs, procs = free_port(), [tmp_path / f"out{i}.json" for i in range(2)], []
    for i in range(2):
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(port), str(i), str(outs[i]), json.dumps(mesh)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for p in procs:
        try:
            log, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a worker process hung")
        assert p.returncode == 0, log[-3000:]
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.parametrize(
    "mesh, expected_shape",
    [
        ({"axis_dims": [1, -1, 1, 1, 1]}, {"dp": 1, "fsdp": 4, "ep": 1, "tp": 1, "sp": 1}),
        (
            {"axis_dims": [1, 1, 1, 2, 1], "dcn_axis_dims": [1, 2, 1, 1, 1]},
            {"dp": 1, "fsdp": 2, "ep": 1, "tp": 2, "sp": 1},
        ),
    ],
)
def test_two_processes_one_global_mesh(tmp_path, mesh, expected_shape):
    a, b = run_two(tmp_path, mesh)
    assert a["shape"] == b["shape"] == expected_shape
    # each process loads a disjoint half of the batch, together all of it
    assert sorted([tuple(a["rows"]), tuple(b["rows"])]) == [(0, 4), (4, 8)]
    dp = expected_shape["fsdp"]
    assert a["local_global"] == [2 * dp // 2, 2 * dp]
    w = np.arange(32 * 16, dtype=np.float32).reshape(32, 16) / 100.0
    x = np.arange(8 * 32, dtype=np.float32).reshape(8, 32) / 50.0
    expected = np.tanh(x @ w + 1.0)
    for r in (a, b):
        np.testing.assert_allclose(np.array(r["y"]), expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.array(r["w_back"], dtype=np.float32), w)
