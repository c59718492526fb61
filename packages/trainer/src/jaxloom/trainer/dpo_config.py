"""`DPOConfig`: the arguments of `DPOTrainer` (`dpo.py`), TRL's names and defaults: every `TrainingArguments`
argument and the `preference` group."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .pair_config import PairArguments
from .arguments import GROUPS, SettingsGroup, check_positive

__all__ = ["DPOConfig", "PreferenceArgs"]


class PreferenceArgs(SettingsGroup):
    """The settings of preference training (`DPOConfig`), TRL's names and defaults."""

    beta: float = Field(
        0.1, description="DPO: how far the policy may move from the reference (higher: less); IPO's tau"
    )
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid",
        description="DPO: the preference loss, as TRL defines it: sigmoid (DPO), ipo, hinge (TRL 1.16's one-element "
        "list too)",
    )
    label_smoothing: float = Field(
        0.0, description="DPO sigmoid: the probability that a preference label is wrong (conservative DPO)"
    )
    # an HF directory or a jaxloom run directory; None: the starting policy, frozen
    ref_model: str | None = Field(
        None, description="DPO: the reference, an HF directory or a jaxloom run directory (None: the starting policy)"
    )
    precompute_ref_log_probs: bool = Field(
        False, description="DPO: compute the reference log-probs in one pass before training; no reference held"
    )

    @field_validator("loss_type", mode="before")
    @classmethod
    def _one_loss(cls, value: Any) -> Any:
        """TRL 1.16 writes `loss_type=["sigmoid"]` (a list: several losses combined by `loss_weights`): one is one
        loss; several are refused by name."""
        if isinstance(value, list | tuple):
            if len(value) != 1:
                raise ValueError(
                    f"loss_type = {list(value)!r}: combining several DPO losses (TRL's loss_weights) is not "
                    "implemented; expected one of sigmoid, ipo, hinge"
                )
            return value[0]
        return value

    @model_validator(mode="after")
    def _check(self):
        check_positive(self, "beta")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing = {self.label_smoothing}; expected a value in [0, 0.5)")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"label_smoothing = {self.label_smoothing} applies to loss_type='sigmoid' only")
        return self


class DPOConfig(PairArguments):
    """The arguments of `DPOTrainer`: every `TrainingArguments` argument, and the `preference` group —
    `beta`, `loss_type` (`sigmoid`, `ipo`, `hinge`), `label_smoothing`, `ref_model`,
    `precompute_ref_log_probs` — plus TRL's `max_length`, the tokens of one sequence
    (prompt + chosen, or prompt + rejected), the same as `max_sequence_length`. `truncation_mode` defaults
    to TRL's `keep_start`; `packing` is off (each row holds one pair).

        DPOConfig(beta=0.1, loss_type="sigmoid", max_length=1024, learning_rate=5e-7)
    """

    GROUPS = {**GROUPS, "preference": PreferenceArgs}
    PAIR_DEFAULTS = {"truncation_mode": "keep_start"}  # TRL's


DPOConfig.__signature__ = DPOConfig.pair_signature()  # type: ignore[attr-defined]
