"""Hosts a two-node Ray cluster on 127.0.0.1 until its stdin closes: a head (2 CPUs, 2 GPUs, resource
`node_a`) and a second node (2 CPUs, 1 GPU, `node_b`) — GPUs Ray only counts (none exist), for the
resource bookkeeping — each with its own raylet, object store and ports, started through
`ray.cluster_utils.Cluster` as Ray's own multi-node tests do. (`ray start --address=127.0.0.1:P` cannot
be used on loopback: Ray rewrites a loopback address to the machine's routable IP before joining.)
Prints the cluster's address first. Commands on stdin, one per line, each answered `ok` on stdout:
`lose` kills the second node's processes at once (a node loss: its raylet, object store and workers
die without a goodbye), `add` starts a new second node (the same as the first)."""

import os
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every port on 127.0.0.1

from ray.cluster_utils import Cluster  # noqa: E402

common = {"num_cpus": 2, "node_ip_address": "127.0.0.1"}
# A lost node is declared dead after ~3 s of missed health checks (Ray's default: ~30 s).
health = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
cluster = Cluster(
    initialize_head=True,
    head_node_args={
        **common,
        "num_gpus": 2,
        "resources": {"node_a": 1},
        "include_dashboard": False,
        "_system_config": health,
    },
)
second = cluster.add_node(**common, num_gpus=1, resources={"node_b": 1})
cluster.wait_for_nodes()
print(cluster.address, flush=True)
for line in sys.stdin:  # until the test closes it
    if line.strip() == "lose" and second is not None:
        cluster.remove_node(second, allow_graceful=False)
        second = None
    elif line.strip() == "add" and second is None:
        second = cluster.add_node(**common, num_gpus=1, resources={"node_b": 1})
        cluster.wait_for_nodes()
    print("ok", flush=True)
cluster.shutdown()
