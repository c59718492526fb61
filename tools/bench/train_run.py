"""One benchmark process: `python train_run.py {trainer|bare} STEPS JSON_CONFIG` → one JSON line.

`trainer`: jaxloom's Trainer and Llama with the user-facing defaults on (a metrics row every 10 steps,
TensorBoard file, progress bar), fed text through its data pipeline. `bare`: the hand-written Llama and
loop of bare_llama.py (nothing from jaxloom), over pre-tokenized arrays, printing the mean loss every
10 steps. Same architecture, sizes, batch, dtype, optimizer (clip + AdamW) and masked loss.

Throughput is steady state: from the end of step `warmup` to the end of the last step, both measured
after blocking on the device, so steps kept in flight count as they should.
"""

import time

T0 = time.perf_counter()  # as close to process start as Python allows

import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def main():
    kind, steps, cfg = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    import jax
    import numpy as np

    b, length, m, warmup = cfg["batch"], cfg["seq"], cfg["model"], cfg["warmup"]
    marks = {}

    def clock(step, tree):
        if step in (1, warmup, steps):
            jax.block_until_ready(tree)
            marks[step] = time.perf_counter()

    if kind == "bare":
        sys.path.insert(0, str(Path(__file__).parent))
        import bare_llama
        from jax.sharding import NamedSharding, PartitionSpec

        rng = np.random.default_rng(0)
        ids = rng.integers(0, m["vocab_size"], (steps, b, length)).astype(np.int32)
        fixed = {
            "segment_ids": np.ones((b, length), np.int32),
            "loss_mask": np.ones((b, length), np.int32),
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy(),
        }
        params = bare_llama.init(
            jax.random.PRNGKey(0),
            m["vocab_size"],
            m["hidden_size"],
            m["num_hidden_layers"],
            m["num_attention_heads"],
            m["num_key_value_heads"],
            m["intermediate_size"],
        )
        if cfg.get("mesh"):  # every weight split over its first axis, the batch split by rows
            n = jax.device_count()
            mesh = jax.make_mesh((n,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
            rows, repl = NamedSharding(mesh, PartitionSpec("fsdp")), NamedSharding(mesh, PartitionSpec())
            params = jax.tree_util.tree_map(lambda x: jax.device_put(x, rows if x.shape[0] % n == 0 else repl), params)
            fixed = jax.device_put(fixed, rows)
            batches = ({"input_ids": jax.device_put(ids[i], rows), **fixed} for i in range(steps))
        else:
            batches = ({"input_ids": ids[i], **fixed} for i in range(steps))
        bare_llama.train(
            params,
            batches,
            cfg["lr"],
            m["num_attention_heads"],
            m["num_key_value_heads"],
            donate=jax.devices()[0].platform != "cpu",
            on_step=clock,
            dtype=cfg["dtype"],
        )
    else:
        import jaxloom.data as jd
        import jaxloom.models as jm
        from jaxloom.mesh import MeshConfig
        from jaxloom.trainer import Trainer, TrainingArguments

        class Clock:
            def on_step_end(self, trainer, step, metrics):
                clock(step, trainer.state)

        rng = np.random.default_rng(0)
        records = [{"text": " ".join(map(str, rng.integers(0, 1000, 400)))} for _ in range(400)]
        # user-facing defaults: logging_steps=10, use_tensorboard=True, progress_bar=True
        args = TrainingArguments(
            learning_rate=cfg["lr"],
            warmup_steps=0,
            scheduler="constant",
            total_batch_size=b,
            max_sequence_length=length,
            max_training_steps=steps,
            save_directory=cfg["out"],
            resume_if_possible=False,
            overwrite_output_dir=True,  # every repeat starts over in the same directory
            dtype=cfg["dtype"],
            adam_beta2=0.95,
            **({"loss_block_size": cfg["loss_block_size"]} if "loss_block_size" in cfg else {}),
            **cfg.get("arguments", {}),  # e.g. LoRA: use_peft, lora_r, lora_target_modules
            **({"profile_steps": cfg["profile"]} if cfg.get("profile") else {}),
        )
        layout = {k: v for k, v in cfg.get("arguments", {}).items() if k in ("scan_layers", "scan_unroll")}
        runtime = jm.RuntimeConfig(dtype=cfg["dtype"], param_dtype="float32", **layout)
        model = jm.create_model(jm.LlamaConfig(**m), runtime, lazy=True)
        mesh = MeshConfig.from_axes(**cfg["mesh"]).build() if cfg.get("mesh") else MeshConfig().build()
        trainer = Trainer(
            args, model, dataset_train=records, processing_class=jd.load_processor(), mesh=mesh, hooks=[Clock()]
        )
        trainer.train()
        marks["attention"] = trainer.plan.attention
        if cfg.get("profile"):  # where the profiled steps' device time went (profile_summary.py)
            sys.path.insert(0, str(Path(__file__).parent))
            from profile_summary import summarize

            first, last = cfg["profile"]
            marks["profile"] = summarize(str(trainer.run_directory.local / "profile"), last - first + 1)
    print(
        json.dumps(
            {
                "kind": kind,
                "tokens_per_second": (steps - warmup) * b * length / (marks[steps] - marks[warmup]),
                "first_step_s": marks[1] - T0,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                "devices": jax.device_count(),
                "platform": jax.devices()[0].platform,
                **({"attention": marks["attention"]} if "attention" in marks else {}),
                **({"profile": marks["profile"]} if "profile" in marks else {}),
            }
        )
    )


if __name__ == "__main__":
    main()
