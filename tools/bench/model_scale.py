"""Scaling rows of `nox -s bench`: does cost follow the work? `python model_scale.py` → one JSON line.

- attention: `jaxloom plan` temporaries per device of a 2-layer 64-wide model, batch 1, for T = 1k..8k,
  with `chunked` (blockwise) attention and with the `xla` reference (materialised T×S mask).
- experts: XLA cost analysis of a Mixtral train step (forward + backward) at k=2, E=2 vs E=8, token
  dispatch (`tiled`, the CPU default) and the dense reference.
- depth: start of a fresh process to the end of the first training step, 4 vs 48 layers of the same
  width (scanned stack), through the real `Trainer`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
NARROW = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.tie_word_embeddings=true",
]

MIXTRAL = dict(  # the MoE rows' model (here and in moe_parallel.py), k=2
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_experts_per_tok=2,
    max_position_embeddings=512,
)


def plan_temporaries(seq: int, attn: str) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run(
            [
                "jaxloom",
                "plan",
                *NARROW,
                f"model.max_position_embeddings={seq}",
                f"max_sequence_length={seq}",
                "total_batch_size=1",
                f"attn_mechanism={attn}",
                f"save_directory={d}",
                "resume_if_possible=false",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            timeout=900,
        )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    text = out.stdout[out.stdout.index("{") :]
    return json.loads(text)["memory_per_device"]["temporaries_gb"]


def moe_flops(experts: int, impl: str) -> float:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jaxloom.models as jm

    config = jm.MixtralConfig(**MIXTRAL, num_local_experts=experts)
    model = jm.create_model(config, jm.RuntimeConfig(moe_implementation=impl), lazy=True)
    graphdef, state = nnx.split(model)
    ids = jax.ShapeDtypeStruct((8, 256), jnp.int32)

    def loss(s, x):
        out = nnx.merge(graphdef, s)(x)
        return jnp.mean(out.logits.astype(jnp.float32)) + out.aux_loss

    return jax.jit(jax.grad(loss)).lower(state, ids).compile().cost_analysis()["flops"]


def first_step(layers: int) -> float:
    model = dict(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    cfg = {"model": model, "batch": 8, "seq": 128, "lr": 1e-3, "dtype": "float32", "warmup": 1}
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, str(HERE / "train_run.py"), "trainer", "3", json.dumps({**cfg, "out": d})]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])["first_step_s"]


def main() -> None:
    seqs = (1024, 2048, 4096, 8192)
    attention = {
        "chunked": {s: plan_temporaries(s, "chunked") for s in seqs},
        "xla": {s: plan_temporaries(s, "xla") for s in seqs[:3]},
    }
    experts = {impl: {e: moe_flops(e, impl) for e in (2, 8)} for impl in ("tiled", "dense")}
    depth = {n: first_step(n) for n in (4, 48)}
    print(json.dumps({"attention_temporaries_gb": attention, "moe_step_flops": experts, "first_step_s": depth}))


if __name__ == "__main__":
    main()
