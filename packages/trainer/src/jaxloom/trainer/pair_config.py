"""`PairArguments`: the arguments of a trainer whose rows are preference pairs (`DPOConfig`, `RewardConfig`): TRL's
`max_length`, the tokens of one sequence (prompt + chosen, or prompt + rejected), is `max_sequence_length`, and
`packing` is off (each row holds one pair)."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

from .arguments import TrainingArguments, config_signature

__all__ = ["PairArguments"]


class PairArguments(TrainingArguments):
    """`TrainingArguments` with TRL's `max_length` (default `MAX_LENGTH`) for `max_sequence_length`, the kind's
    `PAIR_DEFAULTS` (TRL's defaults where they differ from next-token training's), and no packing."""

    MAX_LENGTH: ClassVar[int] = 512
    PAIR_DEFAULTS: ClassVar[dict[str, Any]] = {}

    def __init__(self, **kwargs: Any):
        if "max_length" in kwargs:
            length = kwargs.pop("max_length")
            if "max_sequence_length" in kwargs and kwargs["max_sequence_length"] != length:
                raise ValueError(
                    f"max_length = {length!r} and max_sequence_length = {kwargs['max_sequence_length']!r}: "
                    "they are one setting (tokens per sequence); give one"
                )
            kwargs["max_sequence_length"] = length
        kwargs.setdefault("max_sequence_length", self.MAX_LENGTH)
        for key, value in self.PAIR_DEFAULTS.items():
            kwargs.setdefault(key, value)
        if kwargs.setdefault("packing", False):
            raise ValueError("packing = true: preference pairs are not packed (one pair per row); set packing=false")
        super().__init__(**kwargs)

    @property
    def max_length(self) -> int:
        """TRL's name of `max_sequence_length`: tokens per sequence."""
        return self.max_sequence_length

    @classmethod
    def pair_signature(cls) -> inspect.Signature:
        """The constructor's signature: every group's argument, with `max_length` for `max_sequence_length`."""
        return inspect.Signature(
            [
                *(p for p in config_signature(cls.GROUPS).parameters.values() if p.name != "max_sequence_length"),
                inspect.Parameter("max_length", inspect.Parameter.KEYWORD_ONLY, default=cls.MAX_LENGTH, annotation=int),
            ]
        )
