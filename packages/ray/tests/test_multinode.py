"""Ray across nodes (issue 22): a real cluster of two raylets on 127.0.0.1, each with its own
resources. The gang is one placement group: spread one worker per node, it trains as one process does;
when a node is lost mid-run, the gang restarts on what is left and resumes from the newest checkpoint,
or, when what is left cannot hold it, fails with one clear error; a gang the cluster can never hold
fails at once, with the numbers."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from jaxloom.ray.testing import listening_addresses

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def two_nodes():
    """Two raylets on 127.0.0.1 (head: 2 CPUs and resource node_a; second node: 2 CPUs and node_b),
    hosted by `multinode_cluster.py` until its stdin closes (`ray stop` would stop every Ray on the
    machine, the other tests' cluster too), and an S3 server on loopback whose endpoint and credentials
    every node's workers see (`TEST_BUCKET`: its bucket)."""
    from jaxloom.state.testing import s3_server

    with s3_server() as bucket:
        yield from _cluster(bucket)


def _cluster(bucket):
    # RAY_AUTH_MODE explicit: Ray turns token auth on by itself when ~/.ray/auth_token exists
    env = {
        "TEST_BUCKET": bucket,
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
        yield {"address": address, "env": env, "before": before, "host": host}
    finally:
        host.stdin.close()
        try:
            host.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(host.pid, signal.SIGKILL)


def _command(cluster, word):
    """`lose` (kill the second node now) or `add` (a new second node) on the cluster host."""
    cluster["host"].stdin.write(word + "\n")
    cluster["host"].stdin.flush()
    assert cluster["host"].stdout.readline().strip() == "ok"


def _driver(cluster, mode, root):
    """Runs `multinode_driver.py MODE ROOT`; while it runs, each `FaultInjector: hang` a worker logs (rank 0
    stalls after a complete checkpoint) is answered by killing the second node, and NEED-NODE by a new one."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "multinode_driver.py"), mode, str(root)],
        env={
            **cluster["env"],
            "RAY_ADDRESS": cluster["address"],
            "XLA_FLAGS": os.environ.get("JAXLOOM_TEST_XLA_FLAGS", ""),
            "RAY_DEDUP_LOGS": "0",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []

    def follow():
        for line in proc.stderr:
            lines.append(line)
            if "FaultInjector: hang" in line:
                _command(cluster, "lose")
            elif line.startswith("NEED-NODE"):
                _command(cluster, "add")

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    try:
        stdout = proc.stdout.read()
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        follower.join(timeout=60)
    log = "".join(lines)
    assert proc.returncode == 0, log[-6000:]
    # Ray may print more (a state dump at exit) after the driver's one JSON line
    return json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1]), log


def test_a_gang_the_cluster_can_never_hold_fails_at_once_with_the_numbers(two_nodes, tmp_path):
    result, _ = _driver(two_nodes, "place", tmp_path)
    spread, custom, cpus, gpus = result["spread"], result["custom"], result["cpus"], result["gpus"]
    for r in (spread, custom, cpus, gpus):
        assert r["error"] and r["seconds"] < 10, r
    assert "num_workers=3 with placement_strategy=STRICT_SPREAD needs 3 nodes each with CPU 1" in spread["error"]
    assert "the cluster has 2 node(s)" in spread["error"]
    assert "needs 2 × CPU 1, node_a 1 over its nodes" in custom["error"]
    assert "node_a 1" in custom["error"] and "node_a 0" in custom["error"]  # what each node has
    assert "STRICT_PACK needs one node with CPU 6" in cpus["error"] and "CPU 2" in cpus["error"]
    assert "needs 2 × CPU 1, GPU 2 over its nodes" in gpus["error"] and "GPU 1" in gpus["error"]

    # use_gpu: each worker is given its own GPU (CUDA_VISIBLE_DEVICES is that one only) and runs JAX on CUDA
    seen, nodes = result["seen"], result["nodes"]
    assert all(w["JAX_PLATFORMS"] == "cuda" and len(w["gpu_ids"]) == 1 for w in seen), seen
    assert all(w["CUDA_VISIBLE_DEVICES"] == w["gpu_ids"][0] for w in seen), seen
    per_node: dict[str, list[str]] = {}
    for w in seen:
        per_node.setdefault(w["node_id"], []).append(w["gpu_ids"][0])
    assert {n: sorted(g) for n, g in per_node.items()} == {
        n: [str(i) for i in range(int(k))] for n, k in nodes.items()
    }, (seen, nodes)  # every GPU of the cluster, each to one worker


def test_a_gang_spread_over_two_nodes_trains_as_one_process_and_survives_losing_a_node(two_nodes, tmp_path):
    try:
        result, log = _driver(two_nodes, "train", tmp_path)
    finally:
        _command(two_nodes, "add")  # the second node is lost at the end: back for any later test
    new = listening_addresses() - two_nodes["before"]
    assert new and {ip for ip, _ in new} <= {"127.0.0.1"}, sorted(new)  # both raylets, the gang: loopback only

    # The second node dies while rank 0 stalls at step 3: the gang is placed again on the head node alone
    # and resumes from checkpoint 2, which both nodes' workers wrote to the bucket: the run directory is
    # s3://... (lease, checkpoints, metrics, report there), with no shared disk.
    lost = result["lost"]
    bucket = two_nodes["env"]["TEST_BUCKET"]
    assert lost["resumed_from"] == f"{bucket}/lost/checkpoints/2", lost
    assert {"metrics.jsonl", "report.md", "run_config.json"} <= set(result["lost_files"]), result["lost_files"]
    assert ".jaxloom.lock" not in result["lost_files"] and not (tmp_path / "lost").exists()
    assert "gang attempt 0 placed (SPREAD) on 2 node(s)" in log and "gang attempt 1 placed (SPREAD) on 1 node(s)" in log
    assert lost["attempts"] == 2 and [k for k, _ in lost["failures"]] in (["died"], ["error"]), lost
    assert lost["resumed_from"].endswith("checkpoints/2"), lost
    # Steps 1-2 ran across the two nodes, 3-4 on the head alone: all four as one process trains them
    assert len(lost["losses"]) == len(result["one"]) == 4
    np.testing.assert_allclose(lost["losses"], result["one"], rtol=2e-5)
    assert len(set(result["hashes"])) == 1  # one global state over the gang's processes
    print(f"\nnode lost → training resumed on the head node {lost['restart_to_first_step_s']:.1f} s after detection")

    # Strictly one worker per node and one node left: one error, saying what failed and why no restart.
    nowhere = result["nowhere"]
    assert nowhere is not None and nowhere["type"] == "PlacementError", (nowhere, log[-5000:])
    assert "gang attempt 0 placed (STRICT_SPREAD) on 2 node(s)" in log, log[-3000:]  # one worker per raylet
    assert "cannot be placed again on what is left of the cluster" in nowhere["error"]
    assert "STRICT_SPREAD needs 2 nodes each with CPU 1" in nowhere["error"] and "1 node(s)" in nowhere["error"]
    assert "newest complete checkpoint is kept" in nowhere["error"]
