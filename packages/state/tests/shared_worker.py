"""One of two JAX processes (gloo over 127.0.0.1) asking `check_shared_directory`. argv: port, rank, root,
mode ('shared': both name ROOT/run; 'local': each names the relative `run` from its own ROOT/<rank>;
'timed': which steps `save_minutes` makes due).
Prints one JSON line: the error, or null."""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = ""
import jax  # noqa: E402

from jaxloom.state import check_shared_directory  # noqa: E402

port, rank, root, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", 2, rank, initialization_timeout=60)
if mode == "timed":  # save_minutes over two processes: which steps are due (always late: 1e-9 minutes)
    from jaxloom.state import CheckpointManager

    manager = CheckpointManager(f"{root}/timed", save_minutes=1e-9, time_check_steps=4)
    print(json.dumps({"due": [step for step in range(1, 14) if manager.should_save(step)]}))
    jax.distributed.shutdown()
    sys.exit(0)
if mode == "local":
    os.makedirs(f"{root}/{rank}", exist_ok=True)
    os.chdir(f"{root}/{rank}")
    directory = "run"
else:
    directory = f"{root}/run"
try:
    check_shared_directory(directory)
    error = None
except ValueError as e:
    error = str(e)
print(json.dumps({"error": error}))
jax.distributed.shutdown()
