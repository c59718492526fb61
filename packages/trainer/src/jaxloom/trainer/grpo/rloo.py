"""`RLOOTrainer`: REINFORCE leave-one-out (TRL 1.16's `RLOOTrainer`, Ahmadian et al. 2024) on GRPO's rollouts.

What differs from GRPO, as TRL 1.16 has it:

- **the advantage**: each completion's reward (the weighted sum of the reward functions, `None` from all of them:
  unscorable, left out) clipped to `reward_clip_range`, minus `beta` times its sequence KL to the reference — the
  first-order estimate `sum over its tokens of (logp_old - logp_ref)`, a reward penalty, not a loss term — minus
  the mean reward of the *other* scorable completions of its prompt; optionally normalised over the batch
  (`normalize_advantages`); unscorable completions get 0.
- **the loss**: one ratio per completion, `exp` of the *sum* of its token log-ratios, clipped as PPO's
  (`epsilon`, `epsilon_high`), averaged over completions.

The advantage is made inside the train step from the rows' rewards (the step holds every group whole): the KL
needs the old and reference log-probs, which the step has. Rollouts, tools, environments, the paged engine,
`rollout_func`, resume and the commands are GRPO's.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import Field, model_validator

from ..arguments import config_signature
from ..batches import DataSpec
from ..components import part
from ..step import Objective, StepConfig
from .config import GRPOConfig, RLArgs
from .loss import OLD, REF, policy_logps, routing_metrics, routing_sums, sampler_metrics, sampler_sums
from .rewards import call_reward, concurrently, is_async, reward_name
from .rollouts import Rollouts
from ..trainer import BaseTrainer
from .kind import RewardedRollouts
from .trainer import rollouts_of

REWARDS = "rewards"
"""Batch key of RLOO's rows: each completion's reward (NaN: unscorable), the advantage made in the step."""

GRPO_ONLY = {
    "loss_type": "dapo",
    "importance_sampling_level": "token",
    "scale_rewards": "group",
    "delta": None,
    "vllm_importance_sampling_correction": False,
    "off_policy_mask_threshold": None,
    "use_bias_correction_kl": True,  # RLOO's KL is a reward penalty, not a loss term
}
"""GRPO's settings that RLOO does not have (TRL's `RLOOConfig` lacks them): refused when set to another value."""


class RLOOArgs(RLArgs):
    """RLOO's settings (TRL 1.16's `RLOOConfig`): GRPO's rollout settings with RLOO's defaults (`beta` 0.05: the KL
    is a reward penalty), `normalize_advantages` and `reward_clip_range`; GRPO's loss settings are refused."""

    beta: float = Field(0.05, description="RLOO: weight of the sequence KL to the reference, taken off the reward")
    normalize_advantages: bool = Field(False, description="RLOO: advantages normalised over the batch (mean 0, std 1)")
    reward_clip_range: tuple[float, float] | None = Field(
        None, description="RLOO: each completion's reward clipped to [low, high] before the KL and the baseline"
    )

    @model_validator(mode="after")
    def _rloo(self):
        for key, default in GRPO_ONLY.items():
            if getattr(self, key) != default:
                raise ValueError(
                    f"{key} = {getattr(self, key)!r} is GRPO's; RLOO's loss is its own (one clipped ratio per "
                    "completion, TRL's RLOOConfig has no such key): drop it, or use trainer=grpo"
                )
        clip = self.reward_clip_range
        if clip is not None and not clip[0] < clip[1]:
            raise ValueError(f"reward_clip_range = {clip}; expected [low, high] with low < high")
        return self


class RLOOConfig(GRPOConfig):
    """The arguments of `RLOOTrainer`: every `TrainingArguments` argument and the `rl` group with TRL 1.16's
    `RLOOConfig` names and defaults: `reward_funcs`, `reward_weights`, `num_generations`, `max_prompt_length`,
    `max_completion_length`, `temperature`, `top_p`, `top_k`, `beta` (0.05), `epsilon`, `epsilon_high`,
    `num_iterations`, `normalize_advantages`, `reward_clip_range`, `mask_truncated_completions`, `ref_model`, tools,
    environments, `rollout_func` and the sampler's settings as `GRPOConfig` has them (GRPO's loss settings, and its
    sampler corrections `vllm_importance_sampling_correction`, `vllm_importance_sampling_mode`,
    `vllm_importance_sampling_clip_max`, `vllm_importance_sampling_clip_min` and `off_policy_mask_threshold`, are
    refused when set).

        RLOOConfig(num_generations=4, max_completion_length=128, learning_rate=1e-6, reward_funcs=["m.acc"])
    """

    GROUPS = {**GRPOConfig.GROUPS, "rl": RLOOArgs}


RLOOConfig.__signature__ = config_signature(RLOOConfig.GROUPS)  # type: ignore[attr-defined]


# ---- the objective: pure functions, jitted inside the core's step ----------------------------------------
def rloo_advantages(rewards, kl, group: int, *, beta: float, normalize: bool):
    """TRL 1.16's RLOO advantages of rows `i * group + j`: `rewards [B]` (NaN: unscorable) minus `beta` times each
    row's sequence KL `kl [B]`, minus the mean of the other scorable rewards of its group; normalised over the
    scorable rows (unbiased std, + 1e-4) with `normalize`; NaN (an unscorable row, or one alone in its group) → 0."""
    r = rewards - beta * kl if beta else rewards
    grouped = r.reshape(-1, group)
    scorable = jnp.sum(~jnp.isnan(grouped), axis=1, keepdims=True)
    total = jnp.nansum(grouped, axis=1, keepdims=True)
    adv = (r - ((total - grouped) / (scorable - 1)).reshape(-1)) if group > 1 else jnp.zeros_like(r)
    if normalize:
        mean = jnp.nanmean(adv)
        n = jnp.sum(~jnp.isnan(adv))
        std = jnp.sqrt(jnp.nansum((adv - mean) ** 2) / jnp.maximum(n - 1, 1))
        adv = (adv - mean) / (std + 1e-4)
    return jnp.nan_to_num(adv, nan=0.0)


def rloo_loss(state, params, batch, cfg: StepConfig, *, rl, iterations: int):
    """RLOO's objective of one step's rollout rows (every group whole): `(summed loss, sums)`, the loss summed over
    completions and `sums["rows"]` their count (the loss is their mean); TRL's metrics' sums."""
    logp, entropy, used = policy_logps(state.replace(params=params).model, batch, cfg, rl)
    mask = batch["loss_mask"][:, 1:].astype(jnp.float32)
    old = batch[OLD][:, 1:] if iterations > 1 else jax.lax.stop_gradient(logp)
    token_kl = old - batch[REF][:, 1:] if rl.beta else jnp.zeros_like(logp)
    kl = jnp.sum(token_kl * mask, axis=-1)
    adv = jax.lax.stop_gradient(
        rloo_advantages(batch[REWARDS], kl, rl.num_generations, beta=rl.beta, normalize=rl.normalize_advantages)
    )
    ratio = jnp.exp(jnp.sum(logp * mask, -1) - jnp.sum(old * mask, -1))
    high = rl.epsilon if rl.epsilon_high is None else rl.epsilon_high
    clipped = jnp.clip(ratio, 1 - rl.epsilon, 1 + high)
    loss = -jnp.minimum(ratio * adv, clipped * adv)
    bound = ((ratio < 1 - rl.epsilon) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    sums = {
        "rows": jnp.float32(logp.shape[0]),
        "completion_tokens": jnp.sum(mask),
        "kl_sum": jnp.sum(jax.lax.stop_gradient(token_kl) * mask),
        "clipped": jnp.sum(bound.astype(jnp.float32)),
        "entropy_sum": jnp.sum(jax.lax.stop_gradient(entropy) * mask),
    }
    return jnp.sum(loss), {**sums, **sampler_sums(logp, batch, mask), **routing_sums(used, batch)}


def rloo_metrics(sums):
    """TRL's RLOO step metrics: `kl` (per completion token, first-order), `entropy`, `clip_ratio/region_mean`
    (completions whose ratio the clip bound), and the sampler/trainer log-prob difference."""
    n = jnp.maximum(sums["completion_tokens"], 1.0)
    out = {
        "kl": sums["kl_sum"] / n,
        "entropy": sums["entropy_sum"] / n,
        "clip_ratio/region_mean": sums["clipped"] / jnp.maximum(sums["rows"], 1.0),
    }
    return {**out, **sampler_metrics(sums, n), **routing_metrics(sums)}


# ---- the components it changes ------------------------------------------------------------------------------
class RLOORollouts(Rollouts):
    """GRPO's rollout stage scored as RLOO scores: each completion's weighted reward (NaN when every function gave
    None), clipped to `reward_clip_range`, laid out under `REWARDS` (the advantage is made in the step)."""

    def score(self, prompts, completions, columns, completion, completion_mask, where=None):
        rl, started = self.rl, time.perf_counter()
        funcs, weights = self.policy.rewards()
        ids = [list(c[m > 0]) for c, m in zip(completion, completion_mask, strict=True)]

        def call(f):
            return call_reward(
                f, prompts, completions, columns, timeout=rl.reward_timeout, where=where, completion_ids=ids
            )

        per_func = np.stack(concurrently(call, funcs, [is_async(f) for f in funcs]), axis=1)
        unscorable = np.isnan(per_func).all(axis=1)
        rewards = np.nansum(per_func * np.asarray(weights)[None], axis=1)
        rewards[unscorable] = np.nan
        trained = rewards if rl.reward_clip_range is None else np.clip(rewards, *rl.reward_clip_range)
        std = np.nanstd(trained.reshape(-1, rl.num_generations), axis=1, ddof=1)
        metrics = {  # TRL logs the rewards as the functions gave them, before the clip
            "reward": float(np.nanmean(rewards)),
            "reward_std": float(np.nanstd(rewards, ddof=1)),
            "frac_reward_zero_std": float(np.mean(np.isclose(std, 0.0))),
            **{f"rewards/{reward_name(f)}/mean": float(np.nanmean(per_func[:, j])) for j, f in enumerate(funcs)},
            **{f"rewards/{reward_name(f)}/std": float(np.nanstd(per_func[:, j], ddof=1)) for j, f in enumerate(funcs)},
            "time/reward_s": time.perf_counter() - started,
        }
        return {REWARDS: trained.astype(np.float32)}, metrics


rloo_rollouts = rollouts_of(RLOORollouts)
"""RLOO's batches component: GRPO's rollouts, scored by reward (the advantage is the step's)."""


class RLOOTrainer(RewardedRollouts, BaseTrainer):
    """REINFORCE leave-one-out as TRL 1.16's `RLOOTrainer` (see the module docstring): GRPO's inputs and rollouts
    (`reward_funcs`, `tools`, `environment_factory`, `rollout_func`, `rollout_engine`), RLOO's advantage and loss;
    `arguments` is an `RLOOConfig`."""

    arguments_class = RLOOConfig
    batches = part(rloo_rollouts)  # type: ignore[assignment]

    def objective(self) -> Objective:
        """RLOO's loss (one clipped ratio per completion, averaged over completions) and TRL's metrics."""
        rl = self.arguments.rl
        loss = functools.partial(rloo_loss, rl=rl, iterations=rl.num_iterations)
        return Objective(loss=loss, metrics=rloo_metrics, weight="rows", perplexity=False)

    def data_spec(self) -> DataSpec:
        """GRPO's rows with each completion's reward (`REWARDS`) in place of its advantage."""
        spec = super().data_spec()
        extra = {k: v for k, v in spec.extra.items() if k != "advantages"}
        return DataSpec(row_width=spec.row_width, settings=spec.settings, extra={REWARDS: ((), np.float32), **extra})
