"""One benchmark process: `python dpo_run.py {sft|dpo|dpo_precomputed} STEPS JSON_CONFIG` → one JSON line.

The same model and sequence length trained with the user-facing defaults on (a metrics row every 10 steps,
TensorBoard, progress bar): `sft` on `2 × pairs` text rows, `dpo` on `pairs` preference pairs (each pair is
two sequences: the same tokens per step) with a live reference model, `dpo_precomputed` with the
reference's log-probs computed before training. Throughput is steady state (blocking on the device at
the marks); peak memory is the process's peak RSS (and the device's peak where it reports one).
"""

import time

T0 = time.perf_counter()

import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402


def main():
    kind, steps, cfg = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    import jax
    import numpy as np

    import jaxloom.data as jd
    import jaxloom.models as jm
    from jaxloom.mesh import MeshConfig
    from jaxloom.trainer import DPOConfig, DPOTrainer, Trainer, TrainingArguments

    pairs, length, warmup = cfg["pairs"], cfg["seq"], cfg["warmup"]
    marks = {}

    class Clock:
        def on_step_end(self, trainer, step, metrics):
            if step in (1, warmup, steps):
                jax.block_until_ready(trainer.state)
                marks[step] = time.perf_counter()

    rng = np.random.default_rng(0)

    def words(n):
        return " ".join(map(str, rng.integers(0, 1000, n)))

    common = dict(
        learning_rate=1e-4,
        warmup_steps=0,
        scheduler="constant",
        max_training_steps=steps,
        save_directory=cfg["out"],
        resume_if_possible=False,
        overwrite_output_dir=True,
        dtype=cfg["dtype"],
        max_sequence_length=length,
    )
    model = jm.create_model(jm.LlamaConfig(**cfg["model"]), jm.RuntimeConfig(dtype=cfg["dtype"]), lazy=True)
    tok, mesh = jd.load_processor(), MeshConfig().build()
    if kind == "sft":
        records = [{"text": words(length)} for _ in range(64)]
        args = TrainingArguments(**common, total_batch_size=2 * pairs, packing=True)
        trainer = Trainer(args, model, dataset_train=records, processing_class=tok, mesh=mesh, hooks=[Clock()])
    else:
        records = [
            {"prompt": words(length // 16), "chosen": words(length), "rejected": words(length)} for _ in range(64)
        ]
        args = DPOConfig(**common, total_batch_size=pairs, precompute_ref_log_probs=kind == "dpo_precomputed")
        trainer = DPOTrainer(args, model, dataset_train=records, processing_class=tok, mesh=mesh, hooks=[Clock()])
    trainer.train()
    stats = jax.devices()[0].memory_stats() or {}
    print(
        json.dumps(
            {
                "kind": kind,
                "tokens_per_second": (steps - warmup) * 2 * pairs * length / (marks[steps] - marks[warmup]),
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                "device_peak_gb": stats.get("peak_bytes_in_use", 0) / 2**30,
                "platform": jax.devices()[0].platform,
            }
        )
    )


if __name__ == "__main__":
    main()
