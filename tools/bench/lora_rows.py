"""LoRA / QLoRA bench rows (`nox -s bench`, or alone): `python tools/bench/lora_rows.py` → one JSON line.

1. Per-device bytes of parameters, optimizer state and frozen base, from the run's plan (shapes and
   shardings only, nothing allocated), for a ~1B and an 8B Llama: full fine-tuning (float32 parameters and
   AdamW state), LoRA r=16 on every linear layer over a bf16 base, QLoRA r=16 over an NF4 base.
2. Whether the 8B QLoRA train step fits one 80 GB GPU at sequence 4096: XLA's memory analysis of the
   compiled step (compiled for this machine's CPU, with the run's shapes; remat on), vs 80 GB.
3. LoRA step tokens/s vs full fine-tuning on the 8.4M model, r=16 on q_proj,v_proj and on every linear layer
   (tools/bench/train_run.py, alternating processes).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
MODES = {
    "full": dict(param_dtype="float32"),
    "lora_r16": dict(param_dtype="bfloat16", use_peft=True, lora_r=16, lora_target_modules="all-linear"),
    "qlora_nf4_r16": dict(
        param_dtype="bfloat16", use_peft=True, lora_r=16, lora_target_modules="all-linear", load_in_4bit=True
    ),
}


def plan_of(model_cfg: dict, mode: dict, seq: int = 4096):
    import jaxloom.models as jm
    from jaxloom.mesh import MeshConfig
    from jaxloom.trainer import Plan, TrainingArguments

    args = TrainingArguments(
        total_batch_size=1, max_sequence_length=seq, max_training_steps=10, dtype="bfloat16", remat="full", **mode
    )
    model = jm.create_model(jm.LlamaConfig(**model_cfg), lazy=True)
    return Plan.build(args, model, mesh=MeshConfig().build(), total_steps=10)


def memory_rows() -> dict:
    from run import GPU_MODEL

    out = {}
    for name, cfg in (("1b", GPU_MODEL), ("8b", LLAMA_8B)):
        for mode, settings in MODES.items():
            gb = plan_of(cfg, settings).state_gb_per_device()  # what `jaxloom plan` prints
            row = {"parameters_gb": gb["parameters"], "optimizer_gb": gb["optimizer"], "frozen_gb": gb["frozen"]}
            row["total_gb"] = sum(row.values())
            out[f"{name}_{mode}"] = row
        full, lora, qlora = (out[f"{name}_{m}"] for m in MODES)
        out[f"{name}_lora_optimizer_vs_full"] = lora["optimizer_gb"] / full["optimizer_gb"]
        out[f"{name}_qlora_base_vs_bf16"] = qlora["frozen_gb"] / lora["frozen_gb"]
    return out


def fits_8b_qlora(seq: int = 4096) -> dict:
    """Compile the 8B QLoRA step (batch 1 × 4096, remat) for its memory analysis."""
    import jax

    from jaxloom.trainer.functions import StepFunctions
    from jaxloom.trainer.batches import DataSpec
    from jaxloom.trainer.step import StepConfig

    plan = plan_of(LLAMA_8B, MODES["qlora_nf4_r16"], seq)
    t0 = time.perf_counter()
    fns = StepFunctions.build(
        plan, DataSpec.tokens(plan.arguments), StepConfig(loss_block_size=1024), accumulation=1, donate=True
    )
    mem = fns.lower(1).compile().memory_analysis()
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes) / 2**30
    total -= getattr(mem, "alias_size_in_bytes", 0) / 2**30
    return {
        "total_gb": total,
        "temporaries_gb": mem.temp_size_in_bytes / 2**30,
        "compile_s": time.perf_counter() - t0,
        "fits_80gb": total <= 80,
        "platform": jax.devices()[0].platform,
    }


def speed_rows(reps: int = 2, steps: int = 30) -> dict:
    from run import CPU_MODEL, run_process

    cfg = {"model": CPU_MODEL, "batch": 8, "seq": 256, "lr": 1e-3, "dtype": "float32", "warmup": 5}
    kinds = {
        "full": {},
        "lora_qv": {"use_peft": True, "lora_r": 16},
        "lora_all": {"use_peft": True, "lora_r": 16, "lora_target_modules": "all-linear"},
    }
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(reps):  # alternating, each in its own process
        for kind, extra in kinds.items():
            with tempfile.TemporaryDirectory() as d:
                args = [
                    str(HERE / "train_run.py"),
                    "trainer",
                    str(steps),
                    json.dumps({**cfg, "arguments": extra, "out": d}),
                ]
                runs[kind].append(run_process(args, {"JAX_PLATFORMS": "cpu"})["tokens_per_second"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "full_tokens_per_s": med["full"],
        "lora_qv_tokens_per_s": med["lora_qv"],
        "lora_tokens_per_s": med["lora_all"],
        "lora_qv_vs_full": med["lora_qv"] / med["full"],
        "lora_vs_full": med["lora_all"] / med["full"],
    }


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    parts = sys.argv[1:] or ["memory", "fits", "speed"]
    out = {}
    if "memory" in parts:
        out["memory"] = memory_rows()
    if "fits" in parts:
        out["fits_8b_qlora_4096"] = fits_8b_qlora()
    if "speed" in parts:
        out["speed"] = speed_rows()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
