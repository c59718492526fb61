"""A driver joined to the test's multi-node cluster (RAY_ADDRESS): `train` runs the same tiny run as a
2-worker gang spread over both nodes and as 1 process with 2 devices, then twice more while the second
node is lost mid-run (the test kills it when a worker logs `FaultInjector: hang`; this driver logs
NEED-NODE when it wants it back): once with room to restart on the head node, once without;
`place` asks for gangs the cluster can never hold. Prints one JSON line."""

import json
import logging
import os
import sys
import time

import ray
from util import TINY_OVERRIDES

from jaxloom.ray import (
    GangFailedError,
    PlacementError,
    ScalingConfig,
    init_ray,
    launch,
    probe_gang,
    train_from_config,
)
from jaxloom.ray.testing import FaultInjector

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
init_ray()


def wait_for_two_nodes():
    deadline = time.time() + 90
    while sum(bool(n["Alive"]) for n in ray.nodes()) < 2:
        assert time.time() < deadline, "the second node did not join"
        time.sleep(0.5)


wait_for_two_nodes()
mode, root = sys.argv[1], sys.argv[2]


def _files(uri):
    from jaxloom.core import paths

    return [name for name in paths.files_with_sizes(uri) if not name.startswith("checkpoints/")]


def losses(res):
    return [r["train/loss"] for r in res.result["history"] if "train/loss" in r]


if mode == "train":
    overrides = [*TINY_OVERRIDES, "max_training_steps=4", "save_steps=2", "eval_batches=1"]
    one = launch(
        train_from_config,
        None,
        [*overrides, f"save_directory={root}/one"],
        scaling=ScalingConfig(num_workers=1, devices_per_worker=2),
    )
    # Node loss: rank 0 stalls at step 3 once checkpoint 2 is complete; the test then kills the second node.
    stall = (FaultInjector(at_step=3, rank=0, kind="hang", seconds=150, wait_for_checkpoint=True),)
    lost = launch(
        train_from_config,
        None,
        [*overrides, f"save_directory={os.environ['TEST_BUCKET']}/lost"],  # on S3: no shared disk
        stall,
        scaling=ScalingConfig(num_workers=2, placement_strategy="SPREAD", max_failures=1),
    )
    print("NEED-NODE", file=sys.stderr, flush=True)
    wait_for_two_nodes()
    t0 = time.monotonic()
    try:  # one worker per node, and one node left: no restart can be placed
        launch(
            train_from_config,
            None,
            [*overrides, f"save_directory={root}/nowhere"],
            stall,
            scaling=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD", max_failures=1),
        )
        nowhere = None
    except GangFailedError as e:
        nowhere = {"error": str(e), "failures": [f.kind for f in e.failures], "type": type(e.__cause__).__name__}
    out = {
        "one": losses(one),
        "hashes": [r["params_sha256"] for r in lost.results],
        "one_hash": one.result["params_sha256"],
        "lost": {
            "losses": losses(lost),
            "attempts": lost.attempts,
            "failures": [(f.kind, f.message) for f in lost.failures],
            "resumed_from": lost.result["resumed_from"],
            "restart_to_first_step_s": lost.failures[0].restart_to_first_step_s if lost.failures else None,
        },
        "nowhere": nowhere,
        "lost_files": sorted(_files(f"{os.environ['TEST_BUCKET']}/lost")),
    }
else:
    out = {}
    for name, scaling in {
        "spread": ScalingConfig(num_workers=3, placement_strategy="STRICT_SPREAD"),
        "custom": ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1, "node_a": 1}),
        "cpus": ScalingConfig(num_workers=2, resources_per_worker={"CPU": 3}, placement_strategy="STRICT_PACK"),
        "gpus": ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"GPU": 2}),
    }.items():
        t0 = time.monotonic()
        try:
            launch(train_from_config, None, [], scaling=scaling)
            out[name] = {"error": None}
        except PlacementError as e:
            out[name] = {"error": str(e), "seconds": time.monotonic() - t0}
    # GPU workers: three, one GPU each, over the head's 2 and the second node's 1 (GPUs Ray only counts)
    out["seen"] = probe_gang(ScalingConfig(num_workers=3, use_gpu=True))
    out["nodes"] = {n["NodeID"]: n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]}
print(json.dumps(out))
