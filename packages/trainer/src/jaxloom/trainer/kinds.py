"""The trainer kinds of a config (`trainer: sft | dpo | kto | grpo | rloo | reward | distillation`): one registry,
the kind's name to its trainer class; each class names the arguments it takes (`arguments_class`) and its own inputs
(`take_inputs`)."""

from __future__ import annotations

from typing import Any

from .arguments import TrainingArguments
from .distillation import DistillationTrainer
from .dpo import DPOTrainer
from .grpo.rloo import RLOOTrainer
from .grpo.trainer import GRPOTrainer
from .kto import KTOTrainer
from .reward import RewardTrainer
from .trainer import BaseTrainer, Trainer

KINDS: dict[str, type[BaseTrainer]] = {
    "sft": Trainer,
    "dpo": DPOTrainer,
    "kto": KTOTrainer,
    "grpo": GRPOTrainer,
    "rloo": RLOOTrainer,
    "reward": RewardTrainer,
    "distillation": DistillationTrainer,
}
"""The trainer class of each `trainer=` kind: `sft` (next-token training, the default), `dpo` (preference
training), `kto` (unpaired preference data, TRL's KTO), `grpo` (online RL with reward functions), `rloo` (REINFORCE
leave-one-out, TRL's RLOO), `reward` (a reward model of preference pairs) or `distillation` (on-policy distillation
of a teacher). A new kind is one entry here."""

TRAINERS = tuple(KINDS)
"""The `trainer=` key's values."""


def arguments_of(data: dict[str, Any]) -> tuple[str, TrainingArguments]:
    """`(kind, arguments)` of a config's top-level keys (the `model` and `data` sections already removed):
    `trainer` picks the trainer kind and with it the arguments class (its `arguments_class`)."""
    data = dict(data)
    kind = data.pop("trainer", "sft") or "sft"
    if kind not in KINDS:
        raise ValueError(f"trainer = {kind!r}; expected one of {', '.join(KINDS)}")
    if kind in ("sft", "dpo", "kto", "reward") and "max_length" in data:  # TRL's SFT/DPO/KTO/RewardConfig name
        data["max_sequence_length"] = data.pop("max_length")
    return kind, KINDS[kind].arguments_class(**data)
