"""Expert-parallel rows of `nox -s bench`: what a Mixtral train step moves between 8 devices, and holds on
each, with the experts split over `ep` (tokens move; the batch split over ep too) vs fully sharded over
`fsdp` (every expert's weights gathered where used), at E=8 and E=32 experts (k=2).
`python moe_parallel.py` (8 CPU devices) → one JSON line.

Bytes moved: the results of the compiled step's collectives (all-gather, all-reduce, reduce-scatter,
all-to-all), summed from its HLO. Memory: XLA's per-device arguments + temporaries. Step time: median
of 5 steps after compiling (CPU devices share 2 cores: indicative only).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time

from model_scale import MIXTRAL  # the same model as the MoE FLOPs rows (this script's folder is on sys.path)

BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "u64": 8}
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all)(-start)?\(")


def collective_bytes(hlo: str) -> int:
    total = 0
    for line in hlo.splitlines():
        if not COLLECTIVE.search(line) or "=" not in line:
            continue
        result = line.split("=", 1)[1]
        result = result[: COLLECTIVE.search(result).start()]
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
            total += BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
    return total


def measure(axes: dict, batch_axis: tuple[str, ...], experts: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jaxloom.models as jm
    from jaxloom.mesh import MeshConfig, PartitionAxis

    config = jm.MixtralConfig(**MIXTRAL, num_local_experts=experts)
    runtime = jm.RuntimeConfig(moe_implementation="tiled", partition_axis=PartitionAxis(batch_axis=batch_axis))
    mesh = MeshConfig.from_axes(**axes).build()
    graphdef, state = nnx.split(jm.create_model(config, runtime, seed=0, mesh=mesh))
    batch_spec = runtime.partition_axis.spec(("batch", None), mesh=mesh)
    ids = jax.device_put(
        np.random.default_rng(0).integers(0, 4096, (16, 256)).astype(np.int32),
        jax.sharding.NamedSharding(mesh, batch_spec),
    )

    def train_step(s, x):
        def loss(s):
            out = nnx.merge(graphdef, s)(x)
            return jnp.mean(out.logits.astype(jnp.float32) ** 2) + out.aux_loss

        grads = jax.grad(loss)(s)
        return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, s, grads)

    with jax.set_mesh(mesh):
        step = jax.jit(train_step, donate_argnums=0)
        compiled = step.lower(state, ids).compile()
        mem = compiled.memory_analysis()
        state = step(state, ids)
        jax.block_until_ready(state)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            state = step(state, ids)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t0)
    return {
        "collective_mb": collective_bytes(compiled.as_text()) / 2**20,
        "arguments_mb": mem.argument_size_in_bytes / 2**20,
        "temporaries_mb": mem.temp_size_in_bytes / 2**20,
        "step_s": statistics.median(times),
    }


def main() -> None:
    out: dict[str, dict] = {"ep8": {}, "fsdp8": {}}
    for experts in (8, 32):
        out["ep8"][str(experts)] = measure({"ep": 8}, ("fsdp", "dp", "ep"), experts)
        out["fsdp8"][str(experts)] = measure({"fsdp": 8}, ("fsdp", "dp"), experts)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
