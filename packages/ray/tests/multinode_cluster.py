"""Hosts a two-node Ray cluster on 127.0.0.1 until its stdin closes: a head (2 CPUs, resource `node_a`)
and a second node (2 CPUs, `node_b`), each with its own raylet, object store and ports, started through
`ray.cluster_utils.Cluster` as Ray's own multi-node tests do. (`ray start --address=127.0.0.1:P` cannot
be used on loopback: Ray rewrites a loopback address to the machine's routable IP before joining.)
Prints the cluster's address first."""

import os
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every port on 127.0.0.1

from ray.cluster_utils import Cluster  # noqa: E402

common = {"num_cpus": 2, "node_ip_address": "127.0.0.1"}
cluster = Cluster(
    initialize_head=True, head_node_args={**common, "resources": {"node_a": 1}, "include_dashboard": False}
)
cluster.add_node(**common, resources={"node_b": 1})
cluster.wait_for_nodes()
print(cluster.address, flush=True)
sys.stdin.read()  # until the test closes it
cluster.shutdown()
