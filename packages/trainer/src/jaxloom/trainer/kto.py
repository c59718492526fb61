"""`KTOTrainer`: Kahneman-Tversky optimisation (TRL 1.16's `KTOTrainer`) on the core of `BaseTrainer`.

Unpaired preference data — each record a `prompt`, one `completion` and a boolean `label` (thumbs up or down) — is
read one record per row (`jaxloom.data.DataConfig(label_column="label")`). The objective compares each completion's
log-ratio to the frozen reference with the batch's KL estimate: the policy's and the reference's log-probs of
mismatched pairs, each prompt with the completion of the row before it in the micro-batch (the last row's for the
first), as TRL builds them. Those rows are made inside the step from the batch itself (`mismatched_rows`), so the
data stays one record per row and the pairs follow whatever batches the loader draws. The reference is `dpo.py`'s
`Reference` with this kind's two log-probs per row (the completion's and the mismatched one's).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxloom.models as jmod
import jaxloom.state as js

from . import reference
from .batches import DataSpec
from .dpo import REF_KEY, Reference
from .kto_config import KTOConfig
from .step import Objective, StepConfig, forward_for_loss
from .trainer import BaseTrainer

LABEL = "label"
"""Batch key of each row's label `[rows, 1]`: 1.0 for a desirable completion, 0.0 for an undesirable one."""
ROW_KEYS = ("input_ids", "positions", "segment_ids", "loss_mask")


# ---- the objective: pure functions, jitted inside the core's step ----------------------------------------
def mismatched_rows(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """TRL's KL rows of a micro-batch of one record per row (prompt, then completion, then padding): row i is row
    i's prompt followed by row i−1's completion (row 0 takes the last row's), cut at the row's width."""
    ids, mask, seg = batch["input_ids"], batch["loss_mask"] > 0, batch["segment_ids"] > 0
    width = ids.shape[-1]
    prompt = jnp.sum(seg & ~mask, -1)  # tokens of each row's prompt, and of its completion
    completion = jnp.sum(mask, -1)
    src_ids, src_prompt, src_completion = (jnp.roll(x, 1, axis=0) for x in (ids, prompt, completion))
    t = jnp.arange(width)[None, :]
    p, c = prompt[:, None], src_completion[:, None]
    source = jnp.clip(t - p + src_prompt[:, None], 0, width - 1)
    taken = jnp.take_along_axis(src_ids, source, axis=-1)
    in_completion = (t >= p) & (t < p + c)
    kept = t < p + c
    return {
        "input_ids": jnp.where(t < p, ids, jnp.where(in_completion, taken, 0)).astype(ids.dtype),
        "loss_mask": in_completion.astype(batch["loss_mask"].dtype),
        "segment_ids": kept.astype(batch["segment_ids"].dtype),
        "positions": jnp.where(kept, t, 0).astype(batch["positions"].dtype),
    }


def sequence_stats(model, rows, fuse: tuple[int, int] = (0, 1)):
    """`(logps, logit sums, entropy sums, target counts)`, each `[B]`, of `model` on rows of one sequence each
    (over the completion tokens: `loss_mask`), the model's output, and the `FusedHead` when `fuse =
    (loss_block_size, data_shards)` fuses the output layer (then the log-probs carry no gradient: `kto_loss` gives
    it through `cross_entropy_gradient`, as DPO's does), else None."""
    ids, mask = rows["input_ids"], rows["loss_mask"]
    weight = (mask[:, 1:] > 0).astype(jnp.float32)
    block_size, data_shards = fuse
    out, head = forward_for_loss(
        model,
        ids,
        weight,
        positions=rows["positions"],
        segment_ids=rows["segment_ids"],
        block_size=block_size,
        data_shards=data_shards,
    )
    if head is None:
        logits = out.logits[:, :-1].astype(jnp.float32)
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        target = jnp.take_along_axis(logp_all, ids[:, 1:, None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)
        sums = (jnp.sum(target * weight, -1), jnp.sum(jnp.mean(logits, -1) * weight, -1), jnp.sum(entropy * weight, -1))
    else:
        sums = jmod.linear_log_probs(
            head.hidden, head.kernel, head.targets, head.weight, entropy=True, **head.settings()
        )
    return (*sums, weight.sum(-1)), out, head


def kto_losses(ratio, kl, label, *, beta, loss_type, desirable_weight, undesirable_weight):
    """Per row, TRL 1.16's KTO loss of a completion's log-ratio to the reference: `kto` (eq. 7 of the KTO paper)
    1 − σ(β(ratio − KL)) for a desirable completion, 1 − σ(β(KL − ratio)) for an undesirable one;
    `apo_zero_unpaired` 1 − σ(β·ratio) and σ(β·ratio); each side weighted by its weight."""
    if loss_type == "kto":
        chosen, rejected = 1 - jax.nn.sigmoid(beta * (ratio - kl)), 1 - jax.nn.sigmoid(beta * (kl - ratio))
    elif loss_type == "apo_zero_unpaired":
        chosen, rejected = 1 - jax.nn.sigmoid(beta * ratio), jax.nn.sigmoid(beta * ratio)
    else:
        raise ValueError(f"loss_type {loss_type!r}; expected kto or apo_zero_unpaired")
    return jnp.where(label, desirable_weight * chosen, undesirable_weight * rejected)


def kto_loss(state: js.TrainState, params, batch, cfg: StepConfig, *, beta, loss_type, weights):
    """The KTO loss summed over the micro-batch's records and TRL's statistics summed. The KL estimate (TRL's `kl`:
    the mean over the micro-batch of the policy's minus the reference's log-prob of each mismatched row, at least 0)
    carries no gradient; `loss_type='apo_zero_unpaired'` has none and skips that forward pass."""
    model = state.replace(params=params).model
    fuse = (cfg.loss_block_size, cfg.data_shards)
    (logps, logit_sums, entropy, counts), out, head = sequence_stats(model, batch, fuse)
    ref = jax.lax.stop_gradient(batch[REF_KEY].astype(jnp.float32))
    label = batch[LABEL][:, 0] > 0.5
    valid = (counts > 0).astype(jnp.float32)
    if loss_type == "kto":
        kl_logps = jax.lax.stop_gradient(sequence_stats(model, mismatched_rows(batch), fuse)[0][0])
        kl_valid = valid * jnp.roll(valid, 1)  # a row whose neighbour is padding has no mismatched completion
        kl = jnp.sum((kl_logps - ref[:, 1]) * kl_valid) / jnp.maximum(kl_valid.sum(), 1.0)
        kl = jnp.maximum(kl, 0.0)
    else:
        kl = jnp.zeros((), jnp.float32)
    desirable_weight, undesirable_weight = weights
    kwargs = dict(beta=beta, loss_type=loss_type, desirable_weight=desirable_weight)
    kwargs["undesirable_weight"] = undesirable_weight

    def row_loss(logps):
        return jnp.sum(kto_losses(logps - ref[:, 0], kl, label, **kwargs) * valid)

    if head is None:
        loss_sum = row_loss(logps)
    else:
        loss_sum, d_logps = jax.value_and_grad(row_loss)(logps)
        d_rows = jax.lax.stop_gradient(d_logps)[:, None]
        loss_sum = loss_sum - jmod.cross_entropy_gradient(
            head.hidden, head.kernel, head.targets, head.weight * d_rows, **head.settings()
        )
    n = valid.sum()
    if out.aux_loss is not None and cfg.aux_loss_coef:
        loss_sum = loss_sum + cfg.aux_loss_coef * out.aux_loss * n
    logps = jax.lax.stop_gradient(logps)
    rewards = beta * (logps - ref[:, 0])
    chosen, rejected = valid * label, valid * ~label
    sums = {
        "rows": n,
        "chosen": chosen.sum(),
        "rejected": rejected.sum(),
        "kl_sum": kl,
        "microbatches": jnp.ones((), jnp.float32),
        "rewards_sum/chosen": jnp.sum(rewards * chosen),
        "rewards_sum/rejected": jnp.sum(rewards * rejected),
        "logps_sum/chosen": jnp.sum(logps * chosen),
        "logps_sum/rejected": jnp.sum(logps * rejected),
        "logits_sum/chosen": jnp.sum(jax.lax.stop_gradient(logit_sums) * chosen),
        "logits_sum/rejected": jnp.sum(jax.lax.stop_gradient(logit_sums) * rejected),
        "targets/chosen": jnp.sum(counts * chosen),
        "targets/rejected": jnp.sum(counts * rejected),
        "entropy_sum": jnp.sum(jax.lax.stop_gradient(entropy) * valid),
        "tokens": jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32),
    }
    return loss_sum, sums


def kto_metrics(sums):
    """TRL's KTO metric names from the summed statistics: `kl` (the mean of the micro-batches' estimates),
    `rewards/*` and `logps/*` (per desirable or undesirable record), `rewards/margins` (their difference),
    `logits/*` and `entropy` (per completion token)."""
    out = {"kl": sums["kl_sum"] / jnp.maximum(sums["microbatches"], 1.0)}
    for side in ("chosen", "rejected"):
        n = jnp.maximum(sums[side], 1.0)
        out[f"rewards/{side}"] = sums[f"rewards_sum/{side}"] / n
        out[f"logps/{side}"] = sums[f"logps_sum/{side}"] / n
        out[f"logits/{side}"] = sums[f"logits_sum/{side}"] / jnp.maximum(sums[f"targets/{side}"], 1.0)
    out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    out["entropy"] = sums["entropy_sum"] / jnp.maximum(sums["targets/chosen"] + sums["targets/rejected"], 1.0)
    out["tokens"] = sums["tokens"]
    return out


def kto_reference_logps(
    ref: js.TrainState, batch, after=None, fuse: tuple[int, int] = (0, 1), adapters_off: bool = False, kl: bool = True
):
    """The frozen reference's `[..., B, 2]` log-probs of each row's completion and of its mismatched row's
    (`mismatched_rows`; 0 without the KL term, `kl=False`); a leading accumulation axis is mapped over. `after`
    and `adapters_off` as `dpo.reference_logps`."""
    if adapters_off:
        ref = reference.adapters_off(ref)

    def one(mb):
        own = sequence_stats(ref.model, mb, fuse)[0][0]
        other = sequence_stats(ref.model, mismatched_rows(mb), fuse)[0][0] if kl else jnp.zeros_like(own)
        return jnp.stack([own, other], -1)

    rows = {k: batch[k] for k in ROW_KEYS}
    if rows["input_ids"].ndim == 3:
        return jax.lax.map(one, rows)
    return one(rows)


# ---- the trainer -------------------------------------------------------------------------------------------
class KTOTrainer(BaseTrainer):
    """KTO of `model` against a frozen reference, as TRL 1.16's `KTOTrainer` computes it, on jaxloom's core (one
    jitted step, exact resume, the same outputs and commands).

    - `arguments`: a `KTOConfig` (`beta`, `loss_type`, `desirable_weight`, `undesirable_weight`, `max_length`, ...).
    - `dataset_train`, `dataset_eval`: unpaired preference records — `prompt`, `completion` (text, or chat
      messages) and `label` (true: desirable) — from anything `jaxloom.data.as_source` reads.
    - `ref_model`: the reference: an `nnx` model, an HF directory or a jaxloom run directory (default:
      `arguments.ref_model`, else the starting policy, frozen; with LoRA, the base with the adapters off).
    - the rest as `BaseTrainer`.

    `total_batch_size` counts records; the KL estimate of `loss_type='kto'` pairs records within each micro-batch
    (`total_batch_size / gradient_accumulation_steps` rows, TRL's `per_device_train_batch_size` on one device), so
    a micro-batch needs two records or more.
    """

    MATCH_BOS = False  # records are tokenized with the tokenizer's own special-token policy, as TRL does
    arguments_class = KTOConfig

    def take_inputs(self, *, ref_model: Any = None) -> None:
        """`ref_model` (default: `arguments.ref_model`): see the class."""
        a = self.arguments
        rows = a.total_batch_size // a.gradient_accumulation_steps
        if a.loss_type == "kto" and rows < 2:
            raise ValueError(
                f"total_batch_size / gradient_accumulation_steps = {rows} record per micro-batch: KTO's KL term pairs "
                "each prompt with another record's completion in its micro-batch (TRL: 'batch size must be > 1'); "
                "expected at least 2, or loss_type='apo_zero_unpaired'"
            )
        logps = functools.partial(kto_reference_logps, kl=a.loss_type == "kto")
        source = ref_model if ref_model is not None else a.ref_model
        self.reference = Reference(source, logps=logps, collaborators=self.reference_collaborators)

    def reference_collaborators(self) -> dict[str, Any]:
        """What the reference reads once the policy exists (see `dpo.Reference`)."""
        return {
            "policy": lambda: self.state,
            "plan": self.plan,
            "batches": self.batches,
            "folder": lambda: self.run_directory.local,
        }

    @property
    def ref_state(self) -> js.TrainState | None:
        """The reference's state (None before `configure_model()`, once log-probs are precomputed, and with LoRA)."""
        return self.reference.state

    def objective(self) -> Objective:
        """The KTO loss of `loss_type` with `beta` and the two weights; TRL's metrics."""
        a = self.arguments
        loss = functools.partial(
            kto_loss, beta=a.beta, loss_type=a.loss_type, weights=(a.desirable_weight, a.undesirable_weight)
        )
        return Objective(loss=loss, metrics=kto_metrics, weight="rows", perplexity=False)

    def data_spec(self) -> DataSpec:
        """One record per row (`max_length` tokens, unpacked), its `label`, and the reference's two log-probs."""
        a = self.arguments
        return DataSpec.tokens(
            a,
            settings={"packing": False, "label_column": LABEL},
            extra={LABEL: ((1,), np.float32), REF_KEY: ((2,), np.float32)},
            extend=self.reference.extend,
        )

    def prepare(self) -> None:
        """Once the policy exists (built or restored by the core): the frozen reference, before step 1."""
        self.reference.ready()
