"""The trainer kinds of a config (`trainer: sft | dpo | grpo`) and the arguments class of each."""

from __future__ import annotations

from typing import Any

from .arguments import TrainingArguments
from .dpo_config import DPOConfig
from .grpo.config import GRPOConfig

TRAINERS = ("sft", "dpo", "grpo")
"""The `trainer=` key: `sft` (next-token training, the default), `dpo` (preference training) or `grpo` (online
RL with reward functions)."""


def arguments_of(data: dict[str, Any]) -> tuple[str, TrainingArguments]:
    """`(kind, arguments)` of a config's top-level keys (the `model` and `data` sections already removed):
    `trainer` picks the trainer (`sft`, `dpo`) and with it the arguments class."""
    data = dict(data)
    kind = data.pop("trainer", "sft") or "sft"
    if kind not in TRAINERS:
        raise ValueError(f"trainer = {kind!r}; expected one of {', '.join(TRAINERS)}")
    if kind in ("sft", "dpo") and "max_length" in data:  # TRL's SFTConfig/DPOConfig name: it is the setting
        data["max_sequence_length"] = data.pop("max_length")
    return kind, {"dpo": DPOConfig, "grpo": GRPOConfig}.get(kind, TrainingArguments)(**data)
