"""One process of the 2-process test: python mp_worker.py PORT PROCESS_ID OUT_JSON MESH_JSON."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=2 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxloom.mesh as jm  # noqa: E402

port, pid, out_path, mesh_json = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
assert jm.init_distributed(f"127.0.0.1:{port}", 2, pid, heartbeat_timeout_seconds=10, initialization_timeout=60)
mesh = jm.MeshConfig.from_dict(json.loads(mesh_json)).build()

params = {"w": np.arange(32 * 16, dtype=np.float32).reshape(32, 16) / 100.0, "b": np.ones(16, np.float32)}
specs = jm.match_partition_rules([("w", P("fsdp", "tp")), (".*", P())], params, mesh=mesh)
sharded = jm.shard(params, specs, mesh)

global_batch = 8
rows = jm.local_batch_slice(mesh, global_batch)
x_all = np.arange(global_batch * 32, dtype=np.float32).reshape(global_batch, 32) / 50.0
x = jax.make_array_from_process_local_data(NamedSharding(mesh, jm.batch_spec(mesh)), x_all[rows], (global_batch, 32))
y = jax.jit(lambda p, x: jnp.tanh(x @ p["w"] + p["b"]))(sharded, x)
local, glob = jm.get_local_global_micro_batch_size(2, mesh)
with open(out_path, "w") as f:
    json.dump(
        {
            "rows": [rows.start, rows.stop],
            "y": jm.gather(y).tolist(),
            "shape": dict(mesh.shape),
            "local_global": [local, glob],
            "w_back": jm.gather(sharded)["w"].tolist(),
        },
        f,
    )
