"""KTO on thumbs up/down feedback: one completion per record, labelled good or bad, no pairs.

The feedback here is made up on the spot (a good answer repeats the word asked for, a bad one names another), so the
example runs anywhere; point `dataset_train` at your own `.jsonl` of `prompt` / `completion` / `label` records
instead (TRL's KTO format; chat messages work too).

    python examples/kto_feedback.py --out runs/kto                      # 200 steps: a minute or two on CPU
    python examples/kto_feedback.py --out /tmp/kto --steps 60 --tiny    # seconds (what the test runs)
"""

from __future__ import annotations

import argparse
import random

import jaxloom.data as jd
import jaxloom.models as jm
from jaxloom.trainer import KTOConfig, KTOTrainer

WORDS = ["red", "blue", "green", "cat", "dog", "tree", "sun", "moon", "fish", "bird", "rock", "leaf"]


def feedback(n: int, seed: int, good_share: float = 0.6) -> list[dict]:
    """`n` records: "say W:" answered with W (label true) or with another word (label false)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word, other = rng.sample(WORDS, 2)
        good = rng.random() < good_share
        out.append({"prompt": f"say {word}:", "completion": f" {word if good else other}", "label": good})
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="KTO on unpaired thumbs up/down records.")
    p.add_argument("--out", default="runs/kto")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args(argv)

    tokenizer = jd.load_processor()
    width = 32 if a.tiny else 128
    config = jm.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    # 60 % good answers: TRL's advice for unequal counts is desirable x count ≈ undesirable x count (up to 4:3)
    args = KTOConfig(
        max_length=16,
        total_batch_size=8,
        max_training_steps=a.steps,
        learning_rate=1e-2,
        warmup_steps=5,
        beta=0.1,
        desirable_weight=1.0,
        undesirable_weight=1.33,
        evaluation_steps=a.steps,
        eval_batches=8,
        save_directory=a.out,
        progress_bar=False,
    )
    trainer = KTOTrainer(
        args, model=jm.create_model(config, seed=0), dataset_train=feedback(512, 0), dataset_eval=feedback(64, 1)
    )
    out = trainer.train()
    m = out.metrics
    print(
        f"KTO: {int(out.state.step)} steps; held-out rewards/chosen {m['eval_rewards/chosen']:.3f}, "
        f"rewards/rejected {m['eval_rewards/rejected']:.3f}, margin {m['eval_rewards/margins']:.3f}"
    )
    return m


if __name__ == "__main__":
    main()
