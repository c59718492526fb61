"""Ray across nodes (issue 22): a real cluster of two raylets on 127.0.0.1, each with its own
resources. The gang is one placement group: spread one worker per node, it trains as one process does;
a gang the cluster can never hold fails at once, with the numbers."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxloom.ray.testing import listening_addresses

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def two_nodes():
    """Two raylets on 127.0.0.1 (head: 2 CPUs and resource node_a; second node: 2 CPUs and node_b),
    hosted by `multinode_cluster.py` until its stdin closes (`ray stop` would stop every Ray on the
    machine, the other tests' cluster too)."""
    # RAY_AUTH_MODE explicit: Ray turns token auth on by itself when ~/.ray/auth_token exists
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
    }
    env.pop("RAY_ADDRESS", None)
    before = listening_addresses()
    host = subprocess.Popen(
        [sys.executable, str(HERE / "multinode_cluster.py")],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        address = host.stdout.readline().strip()
        assert address.startswith("127.0.0.1:"), address
        yield {"address": address, "env": env, "before": before}
    finally:
        host.stdin.close()
        try:
            host.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(host.pid, signal.SIGKILL)


def _driver(cluster, mode, root):
    out = subprocess.run(
        [sys.executable, str(HERE / "multinode_driver.py"), mode, str(root)],
        env={**cluster["env"], "RAY_ADDRESS": cluster["address"], "XLA_FLAGS": ""},
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_a_gang_spread_over_two_nodes_trains_as_one_process(two_nodes, tmp_path):
    result, log = _driver(two_nodes, "train", tmp_path)
    assert "placed (STRICT_SPREAD) on 2 node(s)" in log, log[-3000:]  # one worker per raylet
    assert len(result["two"]) == len(result["one"]) == 4
    np.testing.assert_allclose(result["two"], result["one"], rtol=2e-5)
    assert len(set(result["hashes"])) == 1  # one global state across the nodes
    new = listening_addresses() - two_nodes["before"]
    assert new and {ip for ip, _ in new} <= {"127.0.0.1"}, sorted(new)  # both raylets, the gang: loopback only


def test_a_gang_the_cluster_can_never_hold_fails_at_once_with_the_numbers(two_nodes, tmp_path):
    result, _ = _driver(two_nodes, "place", tmp_path)
    spread, custom, cpus = result["spread"], result["custom"], result["cpus"]
    for r in (spread, custom, cpus):
        assert r["error"] and r["seconds"] < 10, r
    assert "num_workers=3 with placement_strategy=STRICT_SPREAD needs 3 nodes each with CPU 1" in spread["error"]
    assert "the cluster has 2 node(s)" in spread["error"]
    assert "needs 2 × CPU 1, node_a 1 over its nodes" in custom["error"]
    assert "node_a 1" in custom["error"] and "node_a 0" in custom["error"]  # what each node has
    assert "STRICT_PACK needs one node with CPU 6" in cpus["error"] and "CPU 2" in cpus["error"]
