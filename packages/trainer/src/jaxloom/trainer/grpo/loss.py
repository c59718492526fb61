"""GRPO's objective: per-token log-probs (fused with the output layer), TRL's clipped token loss with the k3 KL,
the averages of each `loss_type`, and the step's metrics. Pure functions, jitted inside the core's step."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..step import StepConfig

ADV, OLD, REF, SAMPLED = "advantages", "old_logps", "ref_logps", "sampling_logps"
"""Batch keys of the rollout rows: the advantage per row; the old, reference and sampler log-probs per token."""


def token_logps(model, batch, temperature: float, *, block_size: int = 0, data_shards: int = 1):
    """Per-token log-probabilities `[B, L-1]` of each row's next tokens under `model` (logits divided by
    `temperature`, as TRL does), and the entropies of those distributions. With `block_size > 0` (the
    trainer's `loss_block_size`) and a jaxloom causal LM, the output layer runs in blocks of positions
    (`jaxloom.models.linear_token_log_probs`): no `[B, L, V]` logits in the step or the rollout."""
    from ..step import forward_for_loss

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
    )
    if head is not None:
        from jaxloom.models import linear_token_log_probs

        logp, entropy = linear_token_log_probs(
            head.hidden, head.kernel, head.targets, temperature=temperature, **head.settings()
        )
        return logp[:, :-1], entropy[:, :-1]
    logits = out.logits[:, :-1].astype(jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, ids[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def per_token_loss(logp, old, ref, advantages, *, beta, epsilon_low, epsilon_high, mask=None, level="token"):
    """TRL's token loss: `-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta k3(ref, logp)`, `r =
    exp(logp - old)` per token (`level="token"`), or with `level="sequence"` (GSPO, TRL's
    `importance_sampling_level`) one ratio per row, `exp` of the mean of `logp - old` over its completion tokens
    (`mask`); also the k3 KL and which tokens the clip bound (low with A < 0, high with A > 0)."""
    log_ratio = logp - old
    if level == "sequence":
        tokens = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
        log_ratio = jnp.sum(log_ratio * mask, axis=-1, keepdims=True) / tokens
    ratio = jnp.exp(log_ratio)
    a = advantages[:, None]
    clipped = jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = jnp.broadcast_to(-jnp.minimum(ratio * a, clipped * a), logp.shape)
    kl = jnp.exp(ref - logp) - (ref - logp) - 1
    if beta:
        loss = loss + beta * kl
    bound = ((ratio < 1 - epsilon_low) & (a < 0)) | ((ratio > 1 + epsilon_high) & (a > 0))
    return loss, kl, jnp.broadcast_to(bound, logp.shape)


def aggregate(loss, mask, loss_type: str, max_completion_length: int):
    """`(summed loss, units)` of token losses `[B, T]` under `mask`: the step divides the sum over its
    micro-batches by the units once. grpo: each completion's mean, averaged over completions; bnpo and dapo:
    the mean over every completion token; dr_grpo: the sum over tokens / (completions × max length)."""
    tokens = jnp.sum(mask, axis=-1)
    if loss_type == "grpo":
        return jnp.sum(jnp.sum(loss * mask, -1) / jnp.maximum(tokens, 1.0)), jnp.float32(loss.shape[0])
    if loss_type == "dr_grpo":
        return jnp.sum(loss * mask) / max_completion_length, jnp.float32(loss.shape[0])
    return jnp.sum(loss * mask), jnp.sum(tokens)


def grpo_loss(state, params, batch, cfg: StepConfig, *, rl, iterations: int):
    """The GRPO objective of one micro-batch of rollout rows: `(summed loss, sums)`; `sums["units"]`
    normalises it (see `aggregate`), the rest are TRL's metrics' sums, and with the sampler's log-probs in the
    batch (`SAMPLED`) how far the training forward's log-probs of the same tokens are from them."""
    model = state.replace(params=params).model
    logp, entropy = token_logps(
        model, batch, rl.temperature, block_size=cfg.loss_block_size, data_shards=cfg.data_shards
    )
    mask = batch["loss_mask"][:, 1:].astype(jnp.float32)
    old = batch[OLD][:, 1:] if iterations > 1 else jax.lax.stop_gradient(logp)
    ref = batch[REF][:, 1:] if rl.beta else jax.lax.stop_gradient(logp)
    high = rl.epsilon if rl.epsilon_high is None else rl.epsilon_high
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
    )
    total, units = aggregate(loss, mask, rl.loss_type, rl.max_completion_length)
    sums = {
        "units": units,
        "completion_tokens": jnp.sum(mask),
        "kl_sum": jnp.sum(jax.lax.stop_gradient(kl) * mask),
        "clipped": jnp.sum(bound * mask),
        "entropy_sum": jnp.sum(jax.lax.stop_gradient(entropy) * mask),
    }
    if SAMPLED in batch:
        diff = jnp.abs(jax.lax.stop_gradient(logp) - batch[SAMPLED][:, 1:]) * mask
        sums["logprob_diff_sum"] = jnp.sum(diff)
        sums["logprob_diff_max"] = jnp.max(diff)  # one micro-batch a step (GRPO): the step's maximum
    return total, sums


def grpo_metrics(sums):
    """TRL's step metrics: `kl`, `clip_ratio` (tokens whose ratio the clip bound), `entropy`; and, with the
    sampler's log-probs, `sampling/logprob_diff/mean` and `/max`: |trainer − sampler| log-prob of the completion
    tokens (0 up to float32 rounding when both run the same model in float32; in bf16 the difference an
    importance-sampling correction would undo)."""
    n = jnp.maximum(sums["completion_tokens"], 1.0)
    out = {"kl": sums["kl_sum"] / n, "clip_ratio": sums["clipped"] / n, "entropy": sums["entropy_sum"] / n}
    if "logprob_diff_sum" in sums:
        out["sampling/logprob_diff/mean"] = sums["logprob_diff_sum"] / n
        out["sampling/logprob_diff/max"] = sums["logprob_diff_max"]
    return out
