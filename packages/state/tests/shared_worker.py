"""One of two JAX processes (gloo over 127.0.0.1) asking `check_shared_directory`. argv: port, rank, root,
mode ('shared': both name ROOT/run; 'local': each names the relative `run` from its own ROOT/<rank>;
'timed': which steps `save_minutes` makes due; 'restore': four devices each, save a state sharded over the
eight in argv[5]'s array format, restore it, and count the bytes this process read doing so).
Prints one JSON line: the error, or null."""

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count=4 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}"
    if sys.argv[4] == "restore"
    else os.environ.get("JAXLOOM_TEST_XLA_FLAGS", "")
)
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
if mode == "restore":
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxloom.state import CheckpointManager, TrainState

    def bytes_read() -> int:
        """Bytes through read/pread (rchar, page cache or not) plus bytes of checkpoint files mapped (a local
        checkpoint file is mapped, not read)."""
        from jaxloom.state import arrays

        rchar = int(dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())["rchar"])
        return rchar + arrays.mapped_bytes()

    mesh = jax.make_mesh((8,), ("fsdp",))
    shard, rep = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    params = jax.jit(
        lambda: {f"w{i}": jax.random.normal(jax.random.key(i), (2048, 1024)) for i in range(4)}, out_shardings=shard
    )()
    step, rng = jax.jit(lambda: (jax.numpy.zeros((), jax.numpy.int32), jax.random.PRNGKey(0)), out_shardings=rep)()
    state = TrainState(step=step, params=params, opt_state={}, rng=rng)
    fmt = sys.argv[5] if len(sys.argv) > 5 else "orbax"
    saver = CheckpointManager(f"{root}/ck", array_format=fmt)  # async: each process writes the shards it owns
    saver.save(1, state)
    saver.wait_until_finished()
    multihost_utils.sync_global_devices("saved")
    target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    jax.block_until_ready(CheckpointManager(f"{root}/ck").restore(target).state.params)  # imports, compiles
    before = bytes_read()
    restored = CheckpointManager(f"{root}/ck").restore(target).state.params
    jax.block_until_ready(restored)
    read = bytes_read() - before
    equal = all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for k in params
        for a, b in zip(params[k].addressable_shards, restored[k].addressable_shards, strict=True)
    )
    share = sum(x.nbytes for x in params.values()) // 2
    parts = sorted(p.name for p in (Path(root) / "ck" / "1" / "params").iterdir() if "process_" in p.name)
    print(json.dumps({"read": read, "share": share, "equal": equal, "parts": parts}))
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
