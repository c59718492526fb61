"""The train and eval steps: pure functions of (state, batch), jitted once by the trainer.

Batches carry a leading accumulation axis: `input_ids [A, B, L]` etc. Losses are summed over all
target tokens of all micro-batches and divided once, so A micro-batches of B rows give the same
update as one batch of A·B rows.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxloom.models import dropout_key
from jaxloom.models.losses import block_count, linear_cross_entropy
from jaxloom.state import TrainState

EXPERT_LOAD = "expert_load"
"""Key of an objective's sums holding, per decoder layer whose router balances through a bias (DeepSeek-V3), the
tokens each routed expert took: the train step moves those biases by `StepConfig.router_bias_update_rate`."""

DROPOUT_STREAM = 0x4C6F5241
"""Folded into the state's key for the train step's dropout (LoRA's `lora_dropout`), then the step and the
micro-batch: a resumed run drops what the uninterrupted one did."""

STOP_KEY = "stop_request"
"""Batch key of the per-row stop requests of a multi-process run; the step returns their maximum under
the same key, so every process learns of any process's request after the same step."""


def token_loss(state: TrainState, params, batch, cfg: StepConfig):
    """Sum of masked next-token cross entropy of `state`'s model with `params` over one micro-batch
    (`batch`, the steps' `cfg`), and its sums: `tokens` (the targets,
    the loss's normaliser) and `correct` (targets with the highest logit).

    A model with an `output_projection()` (jaxloom's causal LMs) is run up to its final hidden states and
    the projection and loss are fused in blocks of at most `cfg.loss_block_size` positions per data shard
    (`jaxloom.models.linear_cross_entropy`: the `[B, T, V]` logits are never held whole); other models,
    or `loss_block_size=0`, compute the logits and then the loss."""
    ids, seg = batch["input_ids"], batch["segment_ids"]
    valid = (batch["loss_mask"][:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    weight = valid.astype(jnp.float32)
    n = weight.sum()
    out, head = forward_for_loss(
        state.replace(params=params).model,
        ids,
        weight,
        positions=batch["positions"],
        segment_ids=seg,
        block_size=cfg.loss_block_size,
        data_shards=cfg.data_shards,
        inputs={k: batch[k] for k in MODEL_INPUTS if k in batch},
    )
    if head is not None:
        loss_sum, correct = linear_cross_entropy(
            head.hidden, head.kernel, head.targets, head.weight, z_loss=cfg.z_loss, **head.settings()
        )
    else:
        logits = out.logits[:, :-1].astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        target_logit = jnp.take_along_axis(logits, ids[:, 1:, None], axis=-1)[..., 0]
        ce = lse - target_logit  # softmax cross entropy, sharing log-sum-exp with the z-loss
        if cfg.z_loss:
            ce = ce + cfg.z_loss * jnp.square(lse)
        loss_sum = jnp.sum(ce * weight)
        # the target has the highest logit: a max, where argmax is a (value, index) reduction XLA's CPU
        # backend runs ~25x slower (10% of a small model's step)
        correct = jnp.sum((target_logit >= jnp.max(logits, axis=-1)) * weight)
    if out.aux_loss is not None and cfg.aux_loss_coef:
        loss_sum = loss_sum + cfg.aux_loss_coef * out.aux_loss * n
    sums = {"tokens": n, "correct": correct}
    if out.expert_load is not None:  # routers balanced by a bias: what their experts took, for the step's update
        sums[EXPERT_LOAD] = {str(i): jax.lax.stop_gradient(load) for i, load in out.expert_load.items()}
    return loss_sum, sums


MODEL_INPUTS = ("pixel_values", "token_type_ids")
"""Batch keys the model reads beside the tokens, under transformers' names: a vision-language model's rows' images
(`pixel_values [B, K, C, S, S]`, each row's image slots) and the processor's `token_type_ids`."""


class FusedHead(NamedTuple):
    """What a fused output layer and loss read: the final `hidden [B, T, D]`, the output `kernel [D, V]`,
    `targets` and `weight [B, T]` (position t predicts `targets[:, t]`; the last position has weight 0),
    and the `blocks`, `dtype`, `precision` and `softcap` to compute the logits with."""

    hidden: jax.Array
    kernel: jax.Array
    targets: jax.Array
    weight: jax.Array
    blocks: int
    dtype: Any
    precision: Any
    softcap: float | None = None

    def settings(self) -> dict[str, Any]:
        """`blocks`, `dtype`, `precision` and the logits' `softcap` (Gemma 2) as keywords of
        `jaxloom.models.linear_cross_entropy` & co."""
        return {"blocks": self.blocks, "dtype": self.dtype, "precision": self.precision, "softcap": self.softcap}


def forward_for_loss(
    model, ids, weight, *, positions, segment_ids, block_size: int, data_shards: int, routing=None, inputs=None
):
    """Run `model` on `ids [B, T]` for a loss over next-token targets with `weight [B, T-1]`: `(out, head)`.
    When `block_size > 0` and the model can stop before its output layer (jaxloom's causal LMs, and
    subclasses that keep the call signature), `out` has no logits and `head` is the `FusedHead` for a fused
    loss in blocks of at most `block_size` positions per data shard (`data_shards`: how many ways the rows
    are split); otherwise `out` has the logits and `head` is None. `positions` and `segment_ids` go to the
    model, and `routing` (MoE routing replay, `[L, B, T, k]`) and `inputs` (more of the model's arguments by name:
    `MODEL_INPUTS`) when given."""
    fusable = hasattr(model, "output_projection") and "return_hidden" in inspect.signature(model.__call__).parameters
    replay = {**(inputs or {}), **({} if routing is None else {"routing": routing})}
    if block_size <= 0 or not fusable:
        return model(ids, positions=positions, segment_ids=segment_ids, **replay), None
    out = model(ids, positions=positions, segment_ids=segment_ids, return_hidden=True, **replay)
    kernel, dtype, precision = model.output_projection()
    b, t = ids.shape
    last = ((0, 0), (0, 1))  # the last position predicts nothing
    blocks = block_count(max(1, b // data_shards), t, block_size)
    return out, FusedHead(
        out.hidden,
        kernel,
        jnp.pad(ids[:, 1:], last),
        jnp.pad(weight, last),
        blocks,
        dtype,
        precision,
        getattr(model, "logit_softcap", None),
    )


def token_metrics(sums):
    """The next-token objective's metrics from its summed statistics: `accuracy` and `tokens`."""
    return {"accuracy": sums["correct"] / jnp.maximum(sums["tokens"], 1.0), "tokens": sums["tokens"]}


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a trainer minimises, as the core's steps use it:

    - `loss(state, params, micro_batch, cfg) -> (loss_sum, sums)`: the loss summed over the micro-batch's
      units (target tokens, preference pairs) and additive statistics, `sums[weight]` counting the units;
      the step divides the summed loss (and gradients) by the summed `weight` once, over all micro-batches.
    - `metrics(sums) -> dict`: the logged metrics from the statistics summed over a step (or an evaluation).
    - `perplexity`: whether exp(loss) means something (next-token losses) and is logged.
    - `extremes`: statistics combined over micro-batches (and evaluation batches) by their smallest (`"min"`) or
      largest (`"max"`) value rather than added (`{"min_reward": "min"}`).
    """

    loss: Callable = token_loss
    metrics: Callable = token_metrics
    weight: str = "tokens"
    perplexity: bool = True
    extremes: tuple[tuple[str, str], ...] = ()

    def combine(self, key: str) -> Callable:
        """How statistic `key` of two micro-batches combines: added, or by `extremes` its min or max."""
        kind = dict(self.extremes).get(key)
        return {"min": jnp.minimum, "max": jnp.maximum}[kind] if kind else jnp.add

    def start(self, key: str, value: jax.Array) -> jax.Array:
        """What statistic `key` (shaped as `value`) is before the first micro-batch: 0, or ±inf for an extreme."""
        kind = dict(self.extremes).get(key)
        fill = {"min": jnp.inf, "max": -jnp.inf}.get(kind or "", 0.0)
        return jnp.full(value.shape, fill, value.dtype)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The train step's static settings: `z_loss` weight, MoE `aux_loss_coef` and `router_bias_update_rate` (how
    far a bias-balanced router's `e_score_correction_bias` moves after each step, toward equal loads),
    `skip_nonfinite` (keep the old parameters when loss or gradients are not finite), `dropout` (the model drops in
    training — LoRA's `lora_dropout`: the step keys it; off, the step's program has no dropout at all), the
    learning-rate `schedule` (for the logged learning rate), the `objective` (default: next-token cross entropy),
    and for that objective's fused output projection `loss_block_size` (positions per data shard in a block; 0: whole
    logits) and `data_shards` (how many ways the batch rows are split). `frozen` is None when the steps are built:
    a kind whose objective reads a model it does not train (distillation's teacher) has its steps take it as their
    first argument (`StepFunctions.build(frozen=...)`), and the step sets it here for the objective."""

    z_loss: float = 0.0
    loss_block_size: int = 0
    data_shards: int = 1
    aux_loss_coef: float = 0.0  # MoE load balancing (router_aux_loss_coef)
    router_bias_update_rate: float = 0.0  # DeepSeek-V3's aux-loss-free balancing: bias step per train step
    skip_nonfinite: bool = False  # nan_policy="skip": keep the old params when loss/grads are not finite
    dropout: bool = False  # the model drops in training (lora_dropout > 0): the step sets its key
    schedule: Callable | None = None
    objective: Objective = Objective()
    frozen: Any = None  # what the objective reads and never trains (distillation's teacher), set inside the step


def train_step(state: TrainState, batch, cfg: StepConfig):
    """One optimizer step: forward and backward over the micro-batches of `batch` (scanned, gradients
    averaged), masked next-token loss with optional z-loss and MoE aux loss, clipping and the update;
    a non-finite step is skipped when `cfg.skip_nonfinite`. Returns `(state, metrics)`; a `STOP_KEY`
    entry of `batch` (not model input) comes back as its maximum in the metrics."""
    batch = dict(batch)
    stop = batch.pop(STOP_KEY, None)
    objective = cfg.objective
    dropout = jax.random.fold_in(jax.random.fold_in(state.rng, DROPOUT_STREAM), state.step) if cfg.dropout else None

    def loss_fn(p, mb, index=0):  # LoRA's dropout (training only) keyed by the step and the micro-batch
        with dropout_key(None if dropout is None else jax.random.fold_in(dropout, index)):
            return objective.loss(state, p, mb, cfg)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def micro(carry, xs):
        grads, loss, sums = carry
        mb, index = xs
        (part, s), g = grad_fn(state.params, mb, index)
        merged = {k: jax.tree_util.tree_map(objective.combine(k), sums[k], s[k]) for k in sums}
        return (jax.tree_util.tree_map(jnp.add, grads, g), loss + part, merged), None

    zero = jnp.zeros((), jnp.float32)
    if jax.tree_util.tree_leaves(batch)[0].shape[0] == 1:  # one micro-batch: no loop for XLA to see through
        (loss_sum, sums), grads = grad_fn(state.params, jax.tree_util.tree_map(lambda x: x[0], batch))
    else:
        first = jax.tree_util.tree_map(lambda x: x[0], batch)
        shapes = jax.eval_shape(lambda mb: objective.loss(state, state.params, mb, cfg)[1], first)
        sums0 = {k: jax.tree_util.tree_map(lambda x, k=k: objective.start(k, x), v) for k, v in shapes.items()}
        init = (jax.tree_util.tree_map(jnp.zeros_like, state.params), zero, sums0)
        micro_batches = jax.tree_util.tree_leaves(batch)[0].shape[0]
        (grads, loss_sum, sums), _ = jax.lax.scan(micro, init, (batch, jnp.arange(micro_batches)))
    denom = jnp.maximum(sums[objective.weight], 1.0)
    grads = jax.tree_util.tree_map(lambda g: g / denom, grads)
    loss = loss_sum / denom
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new = state.apply_gradients(grads)
    loads = sums.pop(EXPERT_LOAD, None)
    if loads is not None and cfg.router_bias_update_rate:
        new = new.replace(params=balance_routers(new.params, loads, cfg.router_bias_update_rate))
    if cfg.skip_nonfinite:
        kept = jax.tree_util.tree_map(
            lambda a, b: jnp.where(finite, a, b), (new.params, new.opt_state), (state.params, state.opt_state)
        )
        new = new.replace(params=kept[0], opt_state=kept[1])
    metrics = {
        "loss": loss,
        **objective.metrics(sums),
        "grad_norm": grad_norm,
        "finite": finite,
        "learning_rate": cfg.schedule(state.step) if cfg.schedule else zero,
        "row_width": jnp.float32(batch["input_ids"].shape[-1]),  # tokens per row (a kind's rows may vary by step)
    }
    if loads:  # how far the busiest expert is from an even share, averaged over the bias-balanced layers
        metrics["router_imbalance"] = jnp.mean(
            jnp.stack([jnp.max(x) / jnp.maximum(jnp.mean(x), 1.0) for x in loads.values()])
        )
    if stop is not None:
        metrics[STOP_KEY] = jnp.max(stop)
    return new, metrics


def balance_routers(params, loads: dict[str, jax.Array], rate: float):
    """`params` with each decoder layer's `e_score_correction_bias` moved by `rate` toward balance
    (`jaxloom.models.update_router_bias`), from `loads` (layer index as a string → tokens per expert `[E]`). A
    scanned stack's bias `[L, E]` takes every layer's load in order."""
    from jaxloom.models import update_router_bias

    def visit(path, leaf):
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        if keys[-1] != "e_score_correction_bias" or "layers" not in keys:
            return leaf
        if leaf.ndim == 2:  # stacked layers: one row each
            return update_router_bias(leaf, jnp.stack([loads[str(i)] for i in range(leaf.shape[0])]), rate)
        layer = keys[keys.index("layers") + 1]
        if layer not in loads:
            return leaf
        return update_router_bias(leaf, loads[layer], rate)

    return jax.tree_util.tree_map_with_path(visit, params)


def eval_step(state: TrainState, batch, cfg: StepConfig):
    """The summed loss (`loss_sum`) and the objective's summed statistics (for next-token losses: `tokens`,
    `correct`) of `state`'s model on one eval `batch` `[B, L]` (no accumulation axis), with `cfg`'s losses."""
    loss_sum, sums = cfg.objective.loss(state, state.params, batch, dataclasses.replace(cfg, aux_loss_coef=0.0))
    sums.pop(EXPERT_LOAD, None)
    return {"loss_sum": loss_sum, **sums}
