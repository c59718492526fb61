"""Train on a gang of two Ray workers: two JAX processes joined by `jax.distributed` into one mesh.

    python examples/ray_two_workers.py --out runs/ray2                     # local cluster on 127.0.0.1
    python examples/ray_two_workers.py --out runs/ray2 --address auto      # an existing cluster
    python examples/ray_two_workers.py --out /tmp/ray2 --tiny --steps 6 --kill-at-step 4   # the test

`--kill-at-step N` SIGKILLs rank 1 at step N of the first attempt: the driver sees the death, tears the
gang down, starts a new one, and it resumes from the newest checkpoint (saved every 2 steps here).
On a real cluster give each worker its accelerator: `ScalingConfig(resources_per_worker={"GPU": 1},
platform="gpu")`; `out` must then be on storage every node sees.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxloom.ray import ScalingConfig, init_ray, launch, params_fingerprint
from jaxloom.ray.testing import FaultInjector


def job(ctx, out: str, steps: int, tiny: bool, faults: list[FaultInjector]) -> dict:
    """Runs in every worker; `jax.distributed` is already up, so `jax.process_index() == ctx.rank`."""
    import jax

    import jaxloom.data as jd
    import jaxloom.models as jm
    from jaxloom.trainer import Trainer, TrainingArguments

    tokenizer = jd.load_processor()
    width = 32 if tiny else 128
    config = jm.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=3 * width,
        num_hidden_layers=2 if tiny else 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    args = TrainingArguments(
        learning_rate=3e-3,
        warmup_steps=1,
        total_batch_size=4 if tiny else 16,
        max_sequence_length=32 if tiny else 128,
        max_training_steps=steps,
        logging_steps=1,
        save_directory=out,
        save_steps=2,
        resume_if_possible=True,
        progress_bar=False,
        use_tensorboard=False,
        generation_interval=None,
        generation_prompts=[],
        seed=0,
        sharding_axis_dims=(1, -1, 1, 1, 1),
    )  # fsdp over both processes' devices
    hooks = ctx.hooks() + [h for f in faults if (h := f.bind(ctx)) is not None]
    trainer = Trainer(
        args,
        jm.create_model(config, lazy=True),
        dataset_train=str(jd.bundled_corpus_path()),
        processing_class=tokenizer,
        hooks=hooks,
    )
    try:
        result = trainer.train()
        return {
            "rank": ctx.rank,
            "processes": jax.process_count(),
            "devices": jax.device_count(),
            "step": int(result.state.step),
            "loss": result.metrics.get("loss"),
            "resumed_from": result.resumed_from,
            "params_sha256": params_fingerprint(result.state.params),
        }
    finally:
        trainer.finish()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Two-worker Ray training with restart on failure.")
    p.add_argument("--out", default="runs/ray2")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--address", help="an existing Ray cluster ('auto', 'ray://head:10001'); default: a local one")
    p.add_argument("--kill-at-step", type=int, help="SIGKILL rank 1 at this step of the first attempt")
    a = p.parse_args(argv)

    init_ray(a.address, num_cpus=None if a.address else 4)
    faults = [FaultInjector(at_step=a.kill_at_step, rank=1, wait_for_checkpoint=True)] if a.kill_at_step else []
    res = launch(
        job,
        str(Path(a.out).resolve()),
        a.steps,
        a.tiny,
        faults,
        scaling=ScalingConfig(num_workers=2, devices_per_worker=1, max_failures=1 if faults else 0),
    )
    summary = {
        "attempts": res.attempts,
        "wall_s": round(res.wall_s, 1),
        "ranks": res.results,
        "failures": [f"{f.kind} on rank {f.rank}: {f.message.splitlines()[0][:100]}" for f in res.failures],
    }
    print(json.dumps(summary, indent=2))
    (Path(a.out) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
