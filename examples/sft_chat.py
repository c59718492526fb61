"""Supervised fine-tuning on chat data: the loss counts only the assistant's tokens.

The chat records here are made up on the spot (`{"messages": [user, assistant]}` asking for sums), so
the example runs anywhere; point `dataset_train` at your own `.jsonl` of `messages` records instead.

    python examples/sft_chat.py --out runs/sft                      # 400 steps: a few minutes on CPU
    python examples/sft_chat.py --out /tmp/sft --steps 4 --tiny     # seconds (what the test runs)
"""

from __future__ import annotations

import argparse
import json

import jaxloom.data as jd
import jaxloom.generation as jg
import jaxloom.models as jm
from jaxloom.trainer import Trainer, TrainingArguments


def chat_records(n: int, seed: int) -> list[dict]:
    """`n` two-turn conversations: the user asks for a sum, the assistant answers it."""
    return [
        {
            "messages": [
                {"role": "user", "content": f"What is {r['prompt'][:-1]}?"},
                {"role": "assistant", "content": r["completion"]},
            ]
        }
        for r in jd.addition_records(n, max_digits=2, seed=seed)
    ]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="SFT a small Llama on chat records.")
    p.add_argument("--out", default="runs/sft")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args(argv)

    tokenizer = jd.load_processor()  # bundled; it has a chat template
    train, held_out = chat_records(4000, seed=0), chat_records(64, seed=1)
    ids, mask = jd.tokenize_record(train[0], tokenizer, jd.DataConfig())
    print(f"one record: {len(ids)} tokens, {sum(mask)} of them trained on (the answer and its end marker)")

    width = 32 if a.tiny else 128
    config = jm.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=2 if a.tiny else 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    args = TrainingArguments(
        learning_rate=3e-3,
        scheduler="cosine",
        warmup_steps=max(1, a.steps // 10),
        total_batch_size=8 if a.tiny else 32,
        max_sequence_length=64,
        max_training_steps=a.steps,
        logging_steps=max(1, a.steps // 10),
        evaluation_steps=None,
        save_directory=a.out,
        save_steps=a.steps,
        resume_if_possible=True,
        progress_bar=not a.tiny,
        generation_interval=None,
        generation_prompts=[],
        seed=0,
    )
    out = Trainer(
        args, jm.create_model(config, lazy=True), dataset_train=train, dataset_eval=held_out, processing_class=tokenizer
    ).train()

    questions = [r["messages"][:1] for r in held_out[:16]]
    answers = jg.generate_unified(
        out.state.model, tokenizer, prompts=questions, apply_chat_template=True, max_new_tokens=4
    ).generation_results
    truth = [r["messages"][1]["content"] for r in held_out[:16]]
    exact = sum(x.strip() == y for x, y in zip(answers, truth, strict=True)) / len(truth)
    print(f"final metrics: {json.dumps(out.metrics)}")
    print(f"held-out exact match: {exact:.2f} ({questions[0][0]['content']!r} → {answers[0].strip()!r})")
    return {"metrics": out.metrics, "exact_match": exact, "answers": answers}


if __name__ == "__main__":
    main()
