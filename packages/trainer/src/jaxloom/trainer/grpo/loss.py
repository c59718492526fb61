"""GRPO's objective: per-token log-probs (fused with the output layer), TRL's clipped token loss with the k3 KL,
the averages of each `loss_type`, and the step's metrics. Pure functions, jitted inside the core's step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..step import StepConfig

ADV, OLD, REF, SAMPLED = "advantages", "old_logps", "ref_logps", "sampling_logps"
"""Batch keys of the rollout rows: the advantage per row; the old, reference and sampler log-probs per token."""
ROUTES = "sampling_routes"
"""Batch key of an MoE policy's rollout rows: the experts the sampler sent each token to, `[B, T, L, k]` (-1: none
recorded); the training forward replays them with `routing_replay` (`token_logps`)."""


def token_logps(model, batch, temperature: float, *, block_size: int = 0, data_shards: int = 1, replay: bool = False):
    """Per-token log-probabilities `[B, L-1]` of each row's next tokens under `model` (logits divided by
    `temperature`, as TRL does), the entropies of those distributions, and an MoE model's experts per token
    (`[L, B, T, k]`, the forward's `routes`; None for a dense one). With `block_size > 0` (the
    trainer's `loss_block_size`) and a jaxloom causal LM, the output layer runs in blocks of positions
    (`jaxloom.models.linear_token_log_probs`): no `[B, L, V]` logits in the step or the rollout. With `replay`
    and the sampler's experts in the batch (`ROUTES`), the forward sends each token where sampling did (MoE routing
    replay)."""
    from ..step import MODEL_INPUTS, forward_for_loss

    ids = batch["input_ids"]
    weight = jnp.ones((ids.shape[0], ids.shape[1] - 1), jnp.float32)
    out, head = forward_for_loss(
        model,
        ids,
        weight,
        positions=batch["positions"],
        segment_ids=batch["segment_ids"],
        block_size=block_size,
        data_shards=data_shards,
        routing=jnp.transpose(batch[ROUTES], (2, 0, 1, 3)).astype(jnp.int32) if replay and ROUTES in batch else None,
        inputs={k: batch[k] for k in MODEL_INPUTS if k in batch},  # a vision-language policy's images
    )
    if head is not None:
        from jaxloom.models import linear_token_log_probs

        logp, entropy = linear_token_log_probs(
            head.hidden, head.kernel, head.targets, temperature=temperature, **head.settings()
        )
        return logp[:, :-1], entropy[:, :-1], out.routes
    logits = out.logits[:, :-1].astype(jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, ids[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy, out.routes


def policy_logps(model, batch, cfg: StepConfig, rl):
    """`token_logps` of the policy a step trains, on a micro-batch of rollout rows: at `rl.temperature`, the output
    layer fused as the step says (`cfg`), the sampler's experts replayed with `rl.routing_replay`."""
    return token_logps(
        model,
        batch,
        rl.temperature,
        block_size=cfg.loss_block_size,
        data_shards=cfg.data_shards,
        replay=rl.routing_replay,
    )


def routing_sums(used, batch) -> dict:
    """With the sampler's experts in the batch (`ROUTES`) and an MoE forward's `used [L, B, T, k]`: how many (token,
    MoE layer) pairs sampling recorded, and on how many the training forward sent the token elsewhere (another set
    of experts) — `routing/disagreement` (`routing_metrics`); else nothing."""
    if ROUTES not in batch or used is None:
        return {}
    recorded = jnp.transpose(batch[ROUTES], (2, 0, 1, 3)).astype(jnp.int32)  # [L, B, T, k]
    seen = jnp.all(recorded >= 0, axis=-1)
    same = jnp.all(jnp.sort(recorded, axis=-1) == jnp.sort(used.astype(jnp.int32), axis=-1), axis=-1)
    return {
        "routes_recorded": jnp.sum(seen.astype(jnp.float32)),
        "routes_differ": jnp.sum((seen & ~same).astype(jnp.float32)),
    }


def routing_metrics(sums) -> dict:
    """`routing/disagreement`: the share of the (token, MoE layer) pairs sampling recorded whose experts the training
    forward did not choose (0 with `routing_replay`), when `routing_sums` made any."""
    if "routes_recorded" not in sums:
        return {}
    return {"routing/disagreement": sums["routes_differ"] / jnp.maximum(sums["routes_recorded"], 1.0)}


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
"""TRL 1.16's `loss_type`s: how each token's loss is made from the ratio and the advantage (clipped: grpo, bnpo,
dr_grpo, dapo, luspo; cispo: clipped importance weights on log-probs; sapo: a soft gate; vespo: a gamma weight per
sequence) and how the token losses are averaged (`aggregate`)."""


def per_token_loss(
    logp,
    old,
    ref,
    advantages,
    *,
    beta,
    epsilon_low,
    epsilon_high,
    mask=None,
    level="token",
    loss_type="grpo",
    delta=None,
    sapo_temperatures=(1.0, 1.05),
    vespo=(2.0, 3.0, 3.0, 2.0),
    bias_correction_kl=True,
):
    """TRL 1.16's token loss of `loss_type`, `+ beta k3(ref, logp)`, with `r = exp(logp - old)` per token
    (`level="token"`), or with `level="sequence"` (GSPO, TRL's `importance_sampling_level`) one ratio per row, `exp`
    of the mean of `logp - old` over its completion tokens (`mask`):

    - grpo, bnpo, dr_grpo, dapo, luspo: `-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)` (`r` first capped at
      `delta` when given: INTELLECT-2's two-sided clip);
    - cispo: `-min(r, eps_high) A logp`, the capped weight held constant (ScaleRL's CISPO);
    - sapo: `-sigmoid(tau (r - 1)) 4 / tau A`, `tau` = `sapo_temperatures[0]` where `A > 0`, else `[1]`;
    - vespo: `-phi A logp`, `phi` the sequence's gamma weight held constant (`vespo_weights`, `vespo` =
      `(k_pos, lambda_pos, k_neg, lambda_neg)`).

    With `bias_correction_kl` (TRL's `use_bias_correction_kl`, on by default) the KL is weighted by `r` (its value
    1 on-policy, its gradient not: the unbiased reverse-KL gradient of DeepSeek-V3.2).
    Also the k3 KL and which tokens the loss's clip acts on (low with A < 0 or high with A > 0; cispo: the cap with
    A > 0; none for sapo and vespo)."""
    log_ratio = logp - old
    token_log_ratio = log_ratio
    if level == "sequence":
        tokens = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
        log_ratio = jnp.sum(log_ratio * mask, axis=-1, keepdims=True) / tokens
    ratio = jnp.exp(log_ratio)
    a = advantages[:, None]
    none = jnp.zeros(logp.shape, bool)
    if loss_type == "cispo":
        weight = jax.lax.stop_gradient(jnp.minimum(ratio, epsilon_high))
        loss = -weight * a * logp
        bound = (ratio > epsilon_high) & (a > 0)
    elif loss_type == "sapo":
        tau = jnp.where(a > 0, sapo_temperatures[0], sapo_temperatures[1])
        loss = -jax.nn.sigmoid(tau * (ratio - 1)) * 4 / tau * a
        bound = none
    elif loss_type == "vespo":
        phi = vespo_weights(token_log_ratio, mask, advantages, *vespo)
        loss = -phi * a * logp
        bound = none
    else:
        clipped = jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)
        capped = ratio if delta is None else jnp.minimum(ratio, delta)
        loss = -jnp.minimum(capped * a, clipped * a)
        bound = ((ratio < 1 - epsilon_low) & (a < 0)) | ((ratio > 1 + epsilon_high) & (a > 0))
    loss = jnp.broadcast_to(loss, logp.shape)
    kl = jnp.exp(ref - logp) - (ref - logp) - 1
    if bias_correction_kl:
        kl = kl * ratio
    if beta:
        loss = loss + beta * kl
    return loss, kl, jnp.broadcast_to(bound, logp.shape)


def vespo_weights(log_ratio, mask, advantages, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's gamma weight per sequence `[B, 1]`, held constant (TRL 1.16's `get_gamma_weights`):
    `phi(w) = exp(lambda + k log w - lambda w)` (so `phi(1) = 1`) of the sequence's ratio `w = exp(sum of the
    token log-ratios)` (each clipped to ±20, the sum to [log 1e-8, 20]), `k, lambda` by the advantage's sign
    (`>= 0`: the `_pos` pair); non-finite weights are 0."""
    low = float(np.log(1e-8))
    seq = jnp.sum(jnp.clip(log_ratio, -20.0, 20.0) * mask, axis=-1, keepdims=True)
    log_w = jnp.clip(seq, low, 20.0)
    nonneg = advantages[:, None] >= 0
    k = jnp.where(nonneg, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(nonneg, lambda_pos, lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    phi = jnp.where(jnp.isfinite(phi), phi, 0.0)
    return jax.lax.stop_gradient(phi)


IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""TRL 1.16's `vllm_importance_sampling_mode`s: a ratio per token or per sequence, truncated or masked."""


def sampler_correction(old, sampled, mask, mode: str, clip_min=None, clip_max=3.0):
    """TRL 1.16's importance-sampling correction of the sampler (`vllm_importance_sampling_*`; here whatever
    sampled the rows: the in-process or paged engine, in bf16, a step or more stale): `exp(old - sampled)` of the
    completion tokens (`mask`), per token or (`sequence_*`) summed per sequence `[B, 1]`; `*_truncate` clamps it to
    `[clip_min, clip_max]`, `*_mask` sets it to 0 outside. A NaN sampler log-prob gives ratio 1. Held constant."""
    diff = jnp.nan_to_num((old - sampled) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = jnp.sum(diff, axis=-1, keepdims=True)
    ratio = jnp.exp(diff)
    if mode.endswith("truncate"):
        ratio = jnp.clip(ratio, clip_min, clip_max)
    else:
        low = -jnp.inf if clip_min is None else clip_min
        high = jnp.inf if clip_max is None else clip_max
        ratio = jnp.where((ratio < low) | (ratio > high), 0.0, ratio)
    return jax.lax.stop_gradient(ratio)


def off_policy_mask(advantages, logp, sampled, mask, threshold: float):
    """TRL 1.16's off-policy sequence mask (`off_policy_mask_threshold`, DeepSeek-V3.2's): `[B, 1]`, 1 where the
    advantage is >= 0 or the sequence's mean `sampled - logp` over its tokens is at most `threshold`, else 0."""
    kl = jnp.nan_to_num(sampled - jax.lax.stop_gradient(logp), nan=0.0)
    mean = jnp.sum(kl * mask, axis=1, keepdims=True) / jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1.0)
    return ((advantages[:, None] >= 0) | (mean <= threshold)).astype(mask.dtype)


def aggregate(loss, mask, loss_type: str, max_completion_length: int):
    """`(summed loss, units)` of token losses `[B, T]` under `mask`: the step divides the sum over its
    micro-batches by the units once. grpo and sapo: each completion's mean, averaged over completions; bnpo, dapo,
    cispo and vespo: the mean over every completion token; dr_grpo: the sum over tokens / (completions × max
    length); luspo: each completion's sum, averaged over completions (TRL 1.16's)."""
    tokens = jnp.sum(mask, axis=-1)
    rows = jnp.float32(loss.shape[0])
    if loss_type in ("grpo", "sapo"):
        return jnp.sum(jnp.sum(loss * mask, -1) / jnp.maximum(tokens, 1.0)), rows
    if loss_type == "dr_grpo":
        return jnp.sum(loss * mask) / max_completion_length, rows
    if loss_type == "luspo":
        return jnp.sum(loss * mask), rows
    return jnp.sum(loss * mask), jnp.sum(tokens)


def grpo_loss(state, params, batch, cfg: StepConfig, *, rl, iterations: int):
    """The GRPO objective of one micro-batch of rollout rows: `(summed loss, sums)`; `sums["units"]`
    normalises it (see `aggregate`), the rest are TRL's metrics' sums, and with the sampler's log-probs in the
    batch (`SAMPLED`) how far the training forward's log-probs of the same tokens are from them."""
    logp, entropy, used = policy_logps(state.replace(params=params).model, batch, cfg, rl)
    mask = batch["loss_mask"][:, 1:].astype(jnp.float32)
    old = batch[OLD][:, 1:] if iterations > 1 else jax.lax.stop_gradient(logp)
    ref = batch[REF][:, 1:] if rl.beta else jax.lax.stop_gradient(logp)
    high = rl.epsilon if rl.epsilon_high is None else rl.epsilon_high
    vespo = (rl.vespo_k_pos, rl.vespo_lambda_pos, rl.vespo_k_neg, rl.vespo_lambda_neg)
    loss, kl, bound = per_token_loss(
        logp,
        old,
        ref,
        batch[ADV],
        beta=rl.beta,
        epsilon_low=rl.epsilon,
        epsilon_high=high,
        mask=mask,
        level=rl.importance_sampling_level,
        loss_type=rl.loss_type,
        delta=rl.delta,
        sapo_temperatures=(rl.sapo_temperature_pos, rl.sapo_temperature_neg),
        vespo=vespo,
        bias_correction_kl=rl.use_bias_correction_kl,
    )
    if rl.off_policy_mask_threshold is not None:  # TRL: with the sampler's log-probs, as with vLLM
        keep = off_policy_mask(batch[ADV], logp, batch[SAMPLED][:, 1:], mask, rl.off_policy_mask_threshold)
        loss = loss * keep
    if rl.vllm_importance_sampling_correction and rl.loss_type != "vespo":
        ratio = sampler_correction(
            old,
            batch[SAMPLED][:, 1:],
            mask,
            rl.vllm_importance_sampling_mode,
            rl.vllm_importance_sampling_clip_min,
            rl.vllm_importance_sampling_clip_max,
        )
        loss = loss * ratio
        extra = importance_sums(ratio, mask)
    else:
        extra = {}
    total, units = aggregate(loss, mask, rl.loss_type, rl.max_completion_length)
    sums = {
        "units": units,
        "completion_tokens": jnp.sum(mask),
        "kl_sum": jnp.sum(jax.lax.stop_gradient(kl) * mask),
        "clipped": jnp.sum(bound * mask),
        "entropy_sum": jnp.sum(jax.lax.stop_gradient(entropy) * mask),
    }
    if rl.loss_type == "cispo":  # TRL's `cispo_clip_ratio`: tokens whose weight the cap holds
        sums["cispo_clipped"] = sums["clipped"]
    if rl.loss_type == "vespo":  # TRL's `vespo/phi_seq_mean`: the weights' mean over completion tokens
        phi = vespo_weights(logp - old, mask, batch[ADV], *vespo)
        sums["phi_sum"] = jnp.sum(phi * mask)
    return total, {**sums, **sampler_sums(logp, batch, mask), **routing_sums(used, batch), **extra}


def importance_sums(ratio, mask) -> dict:
    """The sampler correction's ratios as sums for TRL's `sampling/importance_sampling_ratio/min|mean|max`: over
    the completion tokens (`mask`), or per sequence (a `[B, 1]` ratio: every row, as TRL flattens it). One
    micro-batch a step (GRPO, RLOO): the minimum and maximum are the step's."""
    where = jnp.broadcast_to(mask > 0, ratio.shape) if ratio.shape == mask.shape else jnp.ones(ratio.shape, bool)
    return {
        "is_ratio_sum": jnp.sum(jnp.where(where, ratio, 0.0)),
        "is_ratio_count": jnp.sum(where.astype(jnp.float32)),
        "is_ratio_min": jnp.min(jnp.where(where, ratio, jnp.inf)),
        "is_ratio_max": jnp.max(jnp.where(where, ratio, -jnp.inf)),
    }


def sampler_sums(logp, batch, mask) -> dict:
    """With the sampler's log-probs in the batch (`SAMPLED`): the sums of how far the training forward's log-probs
    of the completion tokens are from them (`sampler_metrics` reads them); else nothing."""
    if SAMPLED not in batch:
        return {}
    diff = jnp.abs(jax.lax.stop_gradient(logp) - batch[SAMPLED][:, 1:]) * mask
    # one micro-batch a step (GRPO, RLOO): the step's maximum
    return {"logprob_diff_sum": jnp.sum(diff), "logprob_diff_max": jnp.max(diff)}


def sampler_metrics(sums, tokens) -> dict:
    """TRL's `sampling/sampling_logp_difference/mean` (over `tokens`) and `/max` of `sampler_sums`' sums, when
    there are any; with the sampler's correction, TRL's `sampling/importance_sampling_ratio/min`, `/mean`, `/max`."""
    if "logprob_diff_sum" not in sums:
        return {}
    out = {
        "sampling/sampling_logp_difference/mean": sums["logprob_diff_sum"] / tokens,
        "sampling/sampling_logp_difference/max": sums["logprob_diff_max"],
    }
    if "is_ratio_sum" in sums:
        out["sampling/importance_sampling_ratio/min"] = sums["is_ratio_min"]
        out["sampling/importance_sampling_ratio/mean"] = sums["is_ratio_sum"] / jnp.maximum(sums["is_ratio_count"], 1.0)
        out["sampling/importance_sampling_ratio/max"] = sums["is_ratio_max"]
    return out


def grpo_metrics(sums):
    """TRL's step metrics: `kl`, `clip_ratio` (tokens whose ratio the clip bound), `entropy`; and, with the
    sampler's log-probs, `sampling/sampling_logp_difference/mean` and `/max`: |trainer − sampler| log-prob of the
    completion tokens (0 up to float32 rounding when both run the same model in float32; in bf16 the difference an
    importance-sampling correction would undo)."""
    n = jnp.maximum(sums["completion_tokens"], 1.0)
    out = {"kl": sums["kl_sum"] / n, "clip_ratio": sums["clipped"] / n, "entropy": sums["entropy_sum"] / n}
    if "cispo_clipped" in sums:
        out["cispo_clip_ratio"] = sums["cispo_clipped"] / n
    if "phi_sum" in sums:
        out["vespo/phi_seq_mean"] = sums["phi_sum"] / n
    return {**out, **sampler_metrics(sums, n), **routing_metrics(sums)}
