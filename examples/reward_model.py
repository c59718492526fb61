"""A reward model from preference pairs, then GRPO driven by it.

The pairs here are made up on the spot (the chosen completion praises, the rejected one complains), so the example
runs anywhere; point `dataset_train` at your own `.jsonl` of `prompt` / `chosen` / `rejected` records instead.

    python examples/reward_model.py --out runs/rm                      # 200 steps: a minute or two on CPU
    python examples/reward_model.py --out /tmp/rm --steps 20 --tiny    # seconds (what the test runs)
"""

from __future__ import annotations

import argparse
import random

import jaxloom.data as jd
import jaxloom.models as jm
from jaxloom.trainer import GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer

WORDS = "the cat sat on a mat and then it ran far away".split()


def pairs(n: int, seed: int) -> list[dict]:
    """`n` preference records: a few random words, then praise (chosen) or complaint (rejected)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, tail = " ".join(rng.choices(WORDS, k=4)), " ".join(rng.choices(WORDS, k=3))
        out.append({"prompt": prompt, "chosen": f" great, wonderful {tail}", "rejected": f" awful, terrible {tail}"})
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Train a reward model, then GRPO with it.")
    p.add_argument("--out", default="runs/rm")
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
    args = RewardConfig(
        max_length=24,
        total_batch_size=16,
        max_training_steps=a.steps,
        learning_rate=3e-3,
        warmup_steps=0,
        evaluation_steps=a.steps,
        save_directory=f"{a.out}/reward",
        progress_bar=False,
    )
    rm = RewardTrainer(
        args, model=jm.create_model(config, seed=0), dataset_train=pairs(800, 0), dataset_eval=pairs(32, 1)
    )
    out = rm.train()
    held_out = out.metrics
    print(f"reward model: held-out accuracy {held_out['eval_accuracy']:.2f}, margin {held_out['eval_margin']:.2f}")
    rm.save_pretrained(f"{a.out}/reward_model", to_torch=True)  # a transformers *ForSequenceClassification
    tokenizer.save_pretrained(f"{a.out}/reward_model")  # beside it: GRPO reads the reward model's own tokenizer

    grpo = GRPOTrainer(
        GRPOConfig(
            num_generations=4,
            max_prompt_length=8,
            max_completion_length=8,
            total_batch_size=8,
            max_training_steps=2 if a.tiny else 20,
            learning_rate=1e-3,
            save_directory=f"{a.out}/grpo",
            progress_bar=False,
        ),
        model=jm.create_model(config, seed=1),
        dataset_train=[{"prompt": r["prompt"]} for r in pairs(64, 2)],
        reward_funcs=[f"{a.out}/reward_model"],
    )
    result = grpo.train()
    name = "rewards/reward_model/mean"
    print(f"GRPO with the reward model: {int(result.state.step)} steps, last {name} {result.metrics[name]:.3f}")
    return {"eval_accuracy": out.metrics["eval_accuracy"], "reward": result.metrics[name]}


if __name__ == "__main__":
    main()
