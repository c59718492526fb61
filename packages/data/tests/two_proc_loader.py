"""One of two JAX processes (gloo over 127.0.0.1, 2 CPU devices each) reading DATA through a MeshLoader
on a 4-way data-parallel mesh: 4 streams, 2 per process. argv: port, rank, data, steps, state file or
'-', out file. Takes STEPS batches (after restoring the position in the state file, if given), writes
the local batches' input_ids and the gathered position to OUT (JSON)."""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=2 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}"
import jax  # noqa: E402

port, rank, data, steps, state_file, out = sys.argv[1:7]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", 2, int(rank), initialization_timeout=60)

import jaxloom.data as jd  # noqa: E402
from jaxloom.mesh import MeshConfig  # noqa: E402

mesh = MeshConfig.from_axes(fsdp=4).build()
state = None if state_file == "-" else json.loads(open(state_file).read())
cfg = jd.DataConfig(max_sequence_length=24, shuffle_buffer_size=6, seed=4)
loader = jd.MeshLoader(data, jd.load_processor(), cfg, mesh, 8, state=state)
batches = [next(loader)["input_ids"].tolist() for _ in range(int(steps))]
position = loader.global_state_dict()
with open(out, "w") as fh:
    json.dump({"batches": batches, "position": position, "opened": sorted(set(loader.loaders[0].shards))}, fh)
jax.distributed.shutdown()
