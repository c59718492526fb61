"""A Ray Tune sweep with EasyDeL's `RayDistributedTrainer`: each trial scales a base Llama config by
`scaling_index` (and may change any training argument), trains on its own gang of workers, and is
judged by its eval loss.

    python examples/tune_sweep.py --model-dir path/to/llama --out runs/sweep
    python examples/tune_sweep.py --out /tmp/sweep --tiny --steps 3          # what the test runs

Without `--model-dir` a base directory (`config.json` of a small Llama plus the bundled tokenizer) is
written to `OUT/base`; no weights are needed, each trial starts from a fresh model of its scale.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jaxloom.data as jd
from jaxloom.ray import RayDistributedTrainer, ScalingConfig, init_ray
from jaxloom.trainer import TrainingArguments


def base_dir(path: Path) -> Path:
    """A Hugging Face-style directory with a Llama `config.json` and the bundled tokenizer."""
    tokenizer = jd.load_processor()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": len(tokenizer),
                "hidden_size": 64,
                "intermediate_size": 192,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "max_position_embeddings": 256,
                "tie_word_embeddings": True,
            }
        )
    )
    tokenizer.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Ray Tune sweep over model scale and learning rate.")
    p.add_argument("--model-dir")
    p.add_argument("--out", default="runs/sweep")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--tiny", action="store_true", help="a 16-wide base and a 2-trial grid")
    p.add_argument("--address", help="an existing Ray cluster; default: a local one on 127.0.0.1")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    init_ray(a.address, num_cpus=None if a.address else 4)

    width = 16 if a.tiny else 64  # scaling_index k multiplies these by k
    trainer = RayDistributedTrainer(
        a.model_dir or str(base_dir(out / "base")),
        config_scaling_variables={
            "hidden_size": width,
            "intermediate_size": 3 * width,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        },
        config_variables={
            "dtype": "float32",
            "param_dtype": "float32",
            "max_position_embeddings": 256,
            "sharding_axis_dims": (1, -1, 1, 1, 1),
        },
    )
    path = jd.bundled_corpus_path()
    documents = jd.JsonlSource(path).read_shard(str(path))
    arguments = TrainingArguments(
        learning_rate=3e-3,
        warmup_steps=1,
        total_batch_size=4 if a.tiny else 16,
        max_sequence_length=32 if a.tiny else 128,
        max_training_steps=a.steps,
        logging_steps=max(1, a.steps // 5),
        eval_batches=2,
        save_directory=str(out),
        progress_bar=False,
        use_tensorboard=False,
        generation_interval=None,
        generation_prompts=[],
        seed=0,
    )
    space = {"scaling_index": [1, 2]} if a.tiny else {"scaling_index": [1, 2], "learning_rate": [1e-3, 3e-3]}
    sweep = trainer.tune(space, arguments, documents[:-20], documents[-20:], scaling=ScalingConfig(num_workers=1))
    for trial in sweep.trials:
        print(f"trial {trial['config']}: eval_loss={trial['metrics']['eval_loss']:.4f}")
    print(
        f"best: {sweep.best_config} (eval_loss {sweep.best_metrics['eval_loss']:.4f}), "
        f"checkpoint in {sweep.best_checkpoint_dir}"
    )
    return {"best_config": sweep.best_config, "trials": sweep.trials, "best_checkpoint_dir": sweep.best_checkpoint_dir}


if __name__ == "__main__":
    main()
