"""`RewardConfig`: the arguments of `RewardTrainer` (`reward.py`), TRL's names and defaults: every
`TrainingArguments` argument and the `reward` group."""

from __future__ import annotations

from typing import Any


from pydantic import Field, model_validator

from .pair_config import PairArguments
from .arguments import GROUPS, SettingsGroup

__all__ = ["RewardArgs", "RewardConfig"]

MAX_LENGTH = 1024  # TRL's RewardConfig default


class RewardArgs(SettingsGroup):
    """The settings of reward modelling (`RewardConfig`), TRL's names and defaults."""

    center_rewards_coefficient: float | None = Field(
        None,
        description="reward: weight of the mean squared sum of each pair's rewards added to the loss, which keeps "
        "the rewards centred on zero (None: not added)",
    )

    @model_validator(mode="after")
    def _check(self):
        c = self.center_rewards_coefficient
        if c is not None and not c >= 0:
            raise ValueError(f"center_rewards_coefficient = {c!r}; expected None or a number ≥ 0")
        return self


class RewardConfig(PairArguments):
    """The arguments of `RewardTrainer`: every `TrainingArguments` argument, and the `reward` group —
    `center_rewards_coefficient` — plus TRL's `max_length` (default 1024), the tokens of one sequence (prompt +
    chosen, or prompt + rejected), the same as `max_sequence_length`. A longer pair is a bad record (TRL drops
    them: `skip_bad_records=true` skips and counts them); `packing` is off (each row holds one pair).

        RewardConfig(max_length=1024, learning_rate=1e-5, center_rewards_coefficient=0.01)
    """

    GROUPS = {**GROUPS, "reward": RewardArgs}
    MAX_LENGTH = MAX_LENGTH

    def __init__(self, **kwargs: Any):
        if kwargs.get("generation_prompts"):
            raise ValueError(
                f"generation_prompts = {kwargs['generation_prompts']!r}: a reward model scores text and generates "
                "none; expected no generation_prompts with trainer=reward"
            )
        super().__init__(**kwargs)


RewardConfig.__signature__ = RewardConfig.pair_signature()  # type: ignore[attr-defined]
