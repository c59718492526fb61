"""GSPO: GRPO with one probability ratio per sequence (`importance_sampling_level="sequence"`, TRL's name).

The reward is the share of the letter e in a completion of a few tokens; nothing else tells the model. Each rollout
is trained on twice (`num_iterations=2`), so the second step is off-policy and the ratio matters: GSPO's is the exp
of the completion's mean per-token log-ratio, clipped per sequence (TRL's formula, `loss_type="grpo"` as GSPO's
setup). The same run from the command line:
`jaxloom train trainer=grpo importance_sampling_level=sequence loss_type=grpo num_iterations=2
reward_funcs=my_rewards.letter_e data.train=prompts.jsonl`.

    python examples/gspo.py --out runs/gspo                   # a minute or two on CPU
    python examples/gspo.py --out /tmp/gspo --tiny            # seconds (what the test runs)
"""

from __future__ import annotations

import argparse

import jaxloom.data as jd
import jaxloom.models as jm
from jaxloom.trainer import GRPOConfig, GRPOTrainer

WORDS = ["red", "blue", "green", "cat", "dog", "tree", "sun", "moon"]


def letter_e(prompts, completions, **kwargs):
    """The share of the letter e in each completion (TRL's reward-function form)."""
    return [c.count("e") / max(len(c), 1) for c in completions]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="GSPO on a toy reward.")
    p.add_argument("--out", default="runs/gspo")
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args(argv)
    steps = 30 if a.tiny else 120

    tok = jd.load_processor()
    config = jm.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32 if a.tiny else 64,
        intermediate_size=64 if a.tiny else 128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    run = GRPOTrainer(
        GRPOConfig(
            importance_sampling_level="sequence",
            loss_type="grpo",
            num_iterations=2,
            num_generations=4,
            total_batch_size=16,
            max_prompt_length=8,
            max_completion_length=8,
            top_k=16,  # sample among the 16 likeliest tokens: over all 4,096 a few steps see too little to move
            learning_rate=1e-2,
            warmup_steps=0,
            max_training_steps=steps,
            logging_steps=1,
            save_directory=a.out,
            save_steps=steps,
            progress_bar=False,
            generation_prompts=[],
            seed=0,
        ),
        model=jm.create_model(config, lazy=True),
        dataset_train=[{"prompt": f"say {w}:"} for w in WORDS * 8],
        processing_class=tok,
        reward_funcs=[letter_e],
    )
    run.train()
    rewards = [r["train/reward"] for r in run.step_log.history if "train/reward" in r]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"reward (share of e): {first:.3f} over the first 5 steps, {last:.3f} over the last 5")
    return {"first": first, "last": last}


if __name__ == "__main__":
    main()
