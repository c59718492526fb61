"""Fine-tune a Hugging Face Llama directory (config.json + safetensors + tokenizer) and export the
result as a Hugging Face directory again, loadable by `transformers` and by jaxloom.

    python examples/finetune_hf_llama.py --model-dir path/to/llama --data my.jsonl --out runs/ft
    python examples/finetune_hf_llama.py --make-tiny-model --out /tmp/ft --steps 4   # what the test runs

Nothing is downloaded: `--model-dir` is a local directory. `--make-tiny-model` first writes a random
2-layer Llama with the bundled tokenizer to `OUT/base`, to show the round trip without a real model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import jaxloom.data as jd
import jaxloom.models as jm
from jaxloom.trainer import Trainer, TrainingArguments


def make_tiny_model(path: Path) -> Path:
    """A random 2-layer Llama saved the way `transformers` saves one, with the bundled tokenizer."""
    tokenizer = jd.load_processor()
    config = jm.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    jm.save_hf_model(jm.create_model(config, seed=1), path)
    tokenizer.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Fine-tune an HF Llama directory; export to HF format.")
    p.add_argument("--model-dir", help="a local Hugging Face model directory")
    p.add_argument("--make-tiny-model", action="store_true", help="write a random tiny Llama first and use it")
    p.add_argument("--data", help=".jsonl/.parquet/.txt path or glob (default: the bundled corpus)")
    p.add_argument("--out", default="runs/finetune")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    a = p.parse_args(argv)
    if bool(a.model_dir) == a.make_tiny_model:
        p.error("give exactly one of --model-dir DIR or --make-tiny-model")
    base = Path(a.model_dir) if a.model_dir else make_tiny_model(Path(a.out) / "base")

    model = jm.from_pretrained(base)  # weights as saved; an error names any mismatch
    tokenizer = jd.load_processor(base)
    data = a.data or str(jd.bundled_corpus_path())
    args = TrainingArguments(
        learning_rate=a.learning_rate,
        scheduler="linear",
        warmup_steps=max(1, a.steps // 10),
        total_batch_size=4,
        max_sequence_length=64,
        max_training_steps=a.steps,
        logging_steps=max(1, a.steps // 10),
        save_directory=str(Path(a.out) / "run"),
        save_steps=a.steps,
        progress_bar=False,
        generation_interval=None,
        generation_prompts=[],
        seed=0,
    )
    trainer = Trainer(args, model, dataset_train=data, processing_class=tokenizer)
    out = trainer.train()
    exported = trainer.save_pretrained(Path(a.out) / "hf", to_torch=True)  # config.json + safetensors + tokenizer
    trainer.finish()

    before = jm.to_hf_state_dict(jm.from_pretrained(base))
    after = jm.to_hf_state_dict(jm.from_pretrained(exported))
    moved = max(
        float(np.abs(np.asarray(after[k], np.float32) - np.asarray(before[k], np.float32)).max()) for k in before
    )
    print(f"final metrics: {json.dumps(out.metrics)}")
    print(f"exported to {exported}; largest weight change from the base model: {moved:.3g}")
    return {"exported": str(exported), "max_change": moved, "metrics": out.metrics}


if __name__ == "__main__":
    main()
