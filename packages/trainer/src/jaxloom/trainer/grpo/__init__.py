"""`GRPOTrainer`: online RL with verifiable rewards (GRPO, DAPO, Dr. GRPO) on the core of `BaseTrainer`.

What it adds to the core is a rollout stage and an objective:

- `Rollouts` (the trainer's `batches` component): for each step, the step's prompts (a seeded permutation of
  the prompt records, read by a cursor saved with the state), each completed `num_generations` times by the
  policy's current weights through `jaxloom.generation` (one prefill per prompt shared by its group, finished
  rows compacted away, on the training mesh, no copy of the weights), scored by the reward functions, turned
  into group-relative advantages, and laid out as one batch of rows `[prompt | completion]` as wide as the
  step's longest prompt and completion (bucketed: `drawing.row_buckets`), with the old, reference and
  sampler per-token log-probs. The sampling key is `fold_in(state.rng, rollout)`: a resumed run samples what
  the uninterrupted one did.
- `grpo_loss` (the objective): the clipped policy-gradient loss per completion token, plus `beta` times the
  k3 estimate of the KL to the reference, averaged as `loss_type` says (TRL's `grpo`, `bnpo`, `dr_grpo`,
  `dapo`).

An external rollout engine (vLLM on GPU, say) plugs in as another `generate(prompt_ids, prompt_mask, key)`
callable: `Rollouts.engine`.

Modules: `config` (`GRPOConfig`, TRL's names), `loss` (the objective), `rewards` (reward functions and
advantages), `rollouts` (the rollout stage), `tools` (tool calls in the rollouts, TRL's `tools=`), `environments`
(TRL's `environment_factory`), `trainer` (`GRPOTrainer`), `rloo` (`RLOOTrainer`, `RLOOConfig`: TRL's RLOO on these
rollouts). Names are loaded on first use, so that
reading the config (`jaxloom config keys`, a run directory's settings) imports no trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "config": ("GRPOConfig", "RLArgs"),
    "environments": ("EnvironmentCallError", "Environments"),
    "loss": ("ADV", "OLD", "REF", "SAMPLED", "aggregate", "grpo_loss", "grpo_metrics", "per_token_loss", "token_logps"),
    "rewards": (
        "RewardError",
        "RewardTimeoutError",
        "advantages",
        "call_reward",
        "load_reward_function",
        "reward_name",
    ),
    "rloo": ("RLOOConfig", "RLOOTrainer", "rloo_advantages", "rloo_loss"),
    "drawing": ("COMPLETION_BUCKET", "PROMPT_BUCKET", "Drawer", "Drawn", "row_buckets"),
    "rollouts": ("PromptOrder", "Rollouts", "read_records"),
    "trainer": ("GRPOTrainer",),
}
_WHERE = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
