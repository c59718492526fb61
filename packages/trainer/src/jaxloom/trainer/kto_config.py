"""`KTOConfig`: the arguments of `KTOTrainer` (`kto.py`), TRL 1.16's names and defaults: every `TrainingArguments`
argument and the `kto` group."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .arguments import GROUPS, SettingsGroup, check_positive
from .pair_config import PairArguments

__all__ = ["KTOArgs", "KTOConfig"]

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
"""TRL 1.16's KTO `loss_type`s: `kto` (the KTO paper's eq. 7, against the batch's KL estimate) and
`apo_zero_unpaired` (APO-zero's unpaired form: no KL term)."""


class KTOArgs(SettingsGroup):
    """The settings of KTO (`KTOConfig`), TRL's names and defaults."""

    beta: float = Field(0.1, description="KTO: how far the policy may move from the reference (higher: less)")
    loss_type: Literal["kto", "apo_zero_unpaired"] = Field(
        "kto",
        description="KTO: the loss, as TRL defines it: kto (against the batch's KL estimate), apo_zero_unpaired "
        "(no KL term)",
    )
    desirable_weight: float = Field(
        1.0, description="KTO: weight of the desirable records' losses (counter unequal desirable/undesirable counts)"
    )
    undesirable_weight: float = Field(
        1.0, description="KTO: weight of the undesirable records' losses (counter unequal counts)"
    )
    ref_model: str | None = Field(
        None, description="KTO: the reference, an HF directory or a jaxloom run directory (None: the starting policy)"
    )
    precompute_ref_log_probs: bool = Field(
        False,
        description="KTO: compute the reference log-probs in one pass before training; no reference held "
        "(loss_type=apo_zero_unpaired: the KL term pairs records within each batch)",
    )

    @model_validator(mode="after")
    def _check(self):
        check_positive(self, "beta", "desirable_weight", "undesirable_weight")
        if self.precompute_ref_log_probs and self.loss_type == "kto":
            raise ValueError(
                "precompute_ref_log_probs = true with loss_type='kto': the KL estimate pairs each prompt with another "
                "record's completion within its batch, and batches are drawn anew each epoch, so the reference's "
                "log-probs of those pairs cannot be computed ahead; expected precompute_ref_log_probs=false, or "
                "loss_type='apo_zero_unpaired' (no KL term)"
            )
        return self


class KTOConfig(PairArguments):
    """The arguments of `KTOTrainer`: every `TrainingArguments` argument, and the `kto` group — `beta`,
    `loss_type` (`kto`, `apo_zero_unpaired`), `desirable_weight`, `undesirable_weight`, `ref_model`,
    `precompute_ref_log_probs` — plus TRL's `max_length` (default 1024), the tokens of prompt + completion, the
    same as `max_sequence_length`. `truncation_mode` defaults to TRL's `keep_start`; `packing` is off (each row
    holds one record).

        KTOConfig(beta=0.1, desirable_weight=1.0, undesirable_weight=1.33, max_length=1024, learning_rate=1e-6)
    """

    GROUPS = {**GROUPS, "kto": KTOArgs}
    MAX_LENGTH = 1024  # TRL's KTOConfig
    PAIR_DEFAULTS = {"truncation_mode": "keep_start"}  # TRL's


KTOConfig.__signature__ = KTOConfig.pair_signature()  # type: ignore[attr-defined]
