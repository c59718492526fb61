"""A driver joined to the test's multi-node cluster (RAY_ADDRESS): `train` runs the same tiny run as a
2-worker gang spread over both nodes and as 1 process with 2 devices; `place` asks for gangs the cluster
can never hold. Prints one JSON line."""

import json
import logging
import sys
import time

import ray
from util import TINY_OVERRIDES

from jaxloom.ray import PlacementError, ScalingConfig, init_ray, launch, train_from_config

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
init_ray()
deadline = time.time() + 90
while sum(bool(n["Alive"]) for n in ray.nodes()) < 2:
    assert time.time() < deadline, "the second node did not join"
    time.sleep(0.5)
mode, root = sys.argv[1], sys.argv[2]


def losses(res):
    return [r["train/loss"] for r in res.result["history"] if "train/loss" in r]


if mode == "train":
    overrides = [*TINY_OVERRIDES, "max_training_steps=4", "save_steps=2", "eval_batches=1"]
    two = launch(
        train_from_config,
        None,
        [*overrides, f"save_directory={root}/two"],
        scaling=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD"),
    )
    one = launch(
        train_from_config,
        None,
        [*overrides, f"save_directory={root}/one"],
        scaling=ScalingConfig(num_workers=1, devices_per_worker=2),
    )
    out = {
        "two": losses(two),
        "one": losses(one),
        "hashes": [r["params_sha256"] for r in two.results],
        "one_hash": one.result["params_sha256"],
    }
else:
    out = {}
    for name, scaling in {
        "spread": ScalingConfig(num_workers=3, placement_strategy="STRICT_SPREAD"),
        "custom": ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1, "node_a": 1}),
        "cpus": ScalingConfig(num_workers=2, resources_per_worker={"CPU": 3}, placement_strategy="STRICT_PACK"),
    }.items():
        t0 = time.monotonic()
        try:
            launch(train_from_config, None, [], scaling=scaling)
            out[name] = {"error": None}
        except PlacementError as e:
            out[name] = {"error": str(e), "seconds": time.monotonic() - t0}
print(json.dumps(out))
