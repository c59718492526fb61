"""Pretrain a small Llama on the bundled corpus with the bundled tokenizer, on CPU or GPU.

    python examples/pretrain.py --out runs/pretrain                    # 300 steps: a few minutes on CPU
    python examples/pretrain.py --out /tmp/pretrain --steps 4 --tiny   # seconds (what the test runs)

Run it again with the same --out and it resumes from the newest checkpoint.
"""

from __future__ import annotations

import argparse
import json

import jaxloom.data as jd
import jaxloom.models as jm
from jaxloom.trainer import Trainer, TrainingArguments


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Pretrain a small Llama on the bundled corpus.")
    p.add_argument("--out", default="runs/pretrain", help="save_directory: checkpoints, metrics, report")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 32-wide model and short sequences")
    a = p.parse_args(argv)

    tokenizer = jd.load_processor()  # the bundled tokenizer
    path = jd.bundled_corpus_path()
    documents = jd.JsonlSource(path).read_shard(str(path))  # [{"text": ...}, ...]
    train, held_out = documents[:-20], documents[-20:]

    width = 32 if a.tiny else 128
    config = jm.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=3 * width,
        num_hidden_layers=2 if a.tiny else 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    model = jm.create_model(config, lazy=True)  # abstract: built on its shards by the trainer

    args = TrainingArguments(
        learning_rate=3e-3,
        scheduler="cosine",
        warmup_steps=max(1, a.steps // 10),
        weight_decay=0.01,
        total_batch_size=4 if a.tiny else 16,
        max_sequence_length=32 if a.tiny else 128,
        max_training_steps=a.steps,
        logging_steps=max(1, a.steps // 10),
        evaluation_steps=max(1, a.steps // 3),
        eval_batches=2 if a.tiny else 8,
        save_directory=a.out,
        save_steps=max(1, a.steps // 3),
        save_total_limit=2,
        resume_if_possible=True,
        progress_bar=not a.tiny,
        seed=0,
        generation_interval=None,
        generation_prompts=["The interpreter"],
        generation_max_new_tokens=16,
    )
    out = Trainer(args, model, dataset_train=train, dataset_eval=held_out, processing_class=tokenizer).train()

    print(f"stopped: {out.stop_reason}; resumed from: {out.resumed_from}")
    print(f"final metrics: {json.dumps(out.metrics)}")
    print(f"report: {out.report_path}; plot: {out.plot_path}; checkpoints: {out.checkpoint_dir}")
    for sample in out.samples:
        print(f"sample: {sample!r}")
    return {"stop_reason": out.stop_reason, "metrics": out.metrics, "report": out.report_path}


if __name__ == "__main__":
    main()
