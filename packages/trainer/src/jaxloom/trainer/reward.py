"""`RewardTrainer`: reward modelling (a Bradley-Terry model of preference pairs) on the core of `BaseTrainer`, as
TRL's `RewardTrainer` computes it.

The model is the given one as a sequence classifier of one score (`jaxloom.models.as_sequence_classifier`: a
causal LM's decoder and a new `score` layer, read at each sequence's last token that is not the pad token, as
transformers' `*ForSequenceClassification` reads it); its rows are preference pairs (chosen and rejected side by
side, as DPO's: `jaxloom.data.DataConfig(pairs=True)`), each sequence prompt + completion whole — a longer pair
than `max_length` is a bad record, as TRL drops it. The loss is `−log σ(r_chosen − r_rejected)` per pair, plus
`center_rewards_coefficient · (r_chosen + r_rejected)²`; TRL's metrics (`accuracy`, `margin`, `min_reward`,
`mean_reward`, `max_reward`). The loop, checkpoints and exact resume, evaluation, export (a model
`AutoModelForSequenceClassification` loads) and `plan` are the core's.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import jaxloom.models as jmod
import jaxloom.state as js

from .batches import DataSpec
from .pairs import pairs_as_rows
from .reward_config import RewardConfig
from .step import Objective, StepConfig
from .trainer import BaseTrainer

EXTREMES = (("min_reward", "min"), ("max_reward", "max"))
MARGIN = "margin"
"""The batch key of each pair's margin (TRL's optional `margin` column, read by the loaders: 0 where absent)."""


# ---- the objective: pure functions, jitted inside the core's step ----------------------------------------
def pair_rewards(model, batch) -> tuple[jax.Array, Any]:
    """`(rewards [B, 2], out)`: the classifier `model`'s score of each pair row's chosen and rejected sequence (a
    batch of pair rows `[B, 2L]`), and its output (for the MoE auxiliary loss)."""
    out = model(
        pairs_as_rows(batch["input_ids"]),
        positions=pairs_as_rows(batch["positions"]),
        segment_ids=pairs_as_rows(batch["segment_ids"]),
    )
    return out.logits[:, 0].reshape(-1, 2), out


def reward_loss(state: js.TrainState, params, batch, cfg: StepConfig, *, center: float | None):
    """The pairs' Bradley-Terry loss summed over the micro-batch (`−log σ(r_chosen − r_rejected − margin)`, the
    margin TRL's optional column (0 without it), plus `center ·
    (r_chosen + r_rejected)²` when `center` is set: TRL's `center_rewards_coefficient`), and TRL's statistics
    (`pairs` counts the pairs with tokens: padding rows at the end of the data count for nothing)."""
    rewards, out = pair_rewards(state.replace(params=params).model, batch)
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    width = batch["segment_ids"].shape[-1] // 2
    valid = (batch["segment_ids"][:, :width] > 0).any(-1).astype(jnp.float32)
    n = valid.sum()
    margin = batch[MARGIN][:, 0] if MARGIN in batch else 0.0  # TRL's optional column: 0 where a record has none
    loss_sum = jnp.sum(-jax.nn.log_sigmoid(chosen - rejected - margin) * valid)
    if center is not None:
        loss_sum = loss_sum + center * jnp.sum(jnp.square(chosen + rejected) * valid)
    if out.aux_loss is not None and cfg.aux_loss_coef:
        loss_sum = loss_sum + cfg.aux_loss_coef * out.aux_loss * n
    r = jax.lax.stop_gradient(rewards)
    real = valid[:, None] > 0
    sums = {
        "pairs": n,
        "correct": jnp.sum((r[:, 0] > r[:, 1]) * valid),
        "margin_sum": jnp.sum((r[:, 0] - r[:, 1]) * valid),
        "reward_sum": jnp.sum(r * valid[:, None]),
        "min_reward": jnp.min(jnp.where(real, r, jnp.inf)),
        "max_reward": jnp.max(jnp.where(real, r, -jnp.inf)),
        "tokens": jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32),
    }
    return loss_sum, sums


def reward_metrics(sums):
    """TRL's metric names from the statistics of a step (or an evaluation): `accuracy` (chosen scored above
    rejected), `margin` (their mean difference), `mean_reward` over both, `min_reward`, `max_reward`."""
    pairs = jnp.maximum(sums["pairs"], 1.0)
    return {
        "accuracy": sums["correct"] / pairs,
        "margin": sums["margin_sum"] / pairs,
        "mean_reward": sums["reward_sum"] / (2 * pairs),
        "min_reward": sums["min_reward"],
        "max_reward": sums["max_reward"],
        "tokens": sums["tokens"],
    }


def reward_model(*, given_model: Any, tokenizer: Any, arguments: RewardConfig) -> Any:
    """The given model as a one-score sequence classifier (a causal LM's decoder with a new `score` drawn from the
    seed; a classifier as it is) reading its score at the last token that is not the tokenizer's pad token, as TRL
    sets the model's `pad_token_id`: the model the reward kind trains (its plan's and its exports')."""
    return jmod.as_sequence_classifier(
        given_model, num_labels=1, pad_token_id=tokenizer.pad_token_id, seed=arguments.seed
    )


# ---- the trainer -------------------------------------------------------------------------------------------
class RewardTrainer(BaseTrainer):
    """A reward model trained on preference pairs, as TRL's `RewardTrainer` trains it, on jaxloom's core (one
    jitted step, exact resume, the same outputs and commands).

    - `arguments`: a `RewardConfig` (`max_length`, `center_rewards_coefficient`, ...).
    - `model`: a causal LM (its decoder is kept, a `score` layer is added and its output layer left out) or a
      sequence classifier of one label (`jaxloom.models.from_pretrained(..., task=SEQUENCE_CLASSIFICATION)`).
    - `dataset_train`, `dataset_eval`: preference records — `prompt` (optional), `chosen`, `rejected`, as
      text or chat messages — from anything `jaxloom.data.as_source` reads; each sequence is prompt +
      completion (text completions end with the EOS token, as TRL appends it).
    - the rest as `BaseTrainer`.

    `total_batch_size` counts pairs. The exported model (`save_pretrained`, `jaxloom convert --to-hf`) is a
    transformers `*ForSequenceClassification` with `num_labels = 1` and the tokenizer's pad token.
    """

    MATCH_BOS = False  # pairs are tokenized with the tokenizer's own special-token policy, as TRL does
    arguments_class = RewardConfig
    BUILDERS: ClassVar[dict[str, Any]] = {"source_model": reward_model}

    def objective(self) -> Objective:
        """The pairs' Bradley-Terry loss (with `center_rewards_coefficient`); TRL's metrics."""
        loss = functools.partial(reward_loss, center=self.arguments.center_rewards_coefficient)
        return Objective(loss=loss, metrics=reward_metrics, weight="pairs", perplexity=False, extremes=EXTREMES)

    def data_spec(self) -> DataSpec:
        """Pairs, one per row (chosen and rejected side by side: `2 × max_length` tokens), unpacked, with each
        record's `margin` (0 without one); a pair longer than `max_length` is a bad record (skipped and counted with
        `skip_bad_records`)."""
        a = self.arguments
        return DataSpec.tokens(
            a,
            row_width=2 * a.max_sequence_length,
            settings={"packing": False, "pairs": True, "long_records": "raise", "margin_column": MARGIN},
            extra={MARGIN: ((1,), np.float32)},
        )
