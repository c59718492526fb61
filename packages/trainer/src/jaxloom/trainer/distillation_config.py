"""`DistillationConfig`: the arguments of on-policy distillation (`DistillationTrainer`), TRL 1.16's names and
defaults: every `TrainingArguments` argument and the `distillation` group (`DistillationArgs`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from .arguments import GROUPS, TrainingArguments, SettingsGroup, check_positive, config_signature
from .grpo.config import completion_rows

__all__ = ["DistillationArgs", "DistillationConfig"]


class DistillationArgs(SettingsGroup):
    """The settings of on-policy distillation (`DistillationConfig`), TRL 1.16's names, meanings and defaults. The
    student samples its completions as GRPO's rollouts do (one per prompt), so the group also answers what those
    ask of GRPO's settings: one completion a prompt, one optimizer step a rollout, no rewards."""

    teacher_model_name_or_path: str | None = Field(
        None,
        description="distillation: the teacher, a Hugging Face model directory or a jaxloom run directory (it must "
        "share the student's vocabulary; its size may differ)",
    )
    teacher_model_init_kwargs: dict[str, Any] | None = Field(
        None,
        description="distillation: how the teacher is loaded, TRL's name; {load_in_4bit: true} stores its linear "
        "layers in NF4 (QLoRA's code), {load_in_8bit: true} in int8",
    )
    beta: float = Field(
        1.0,
        description="distillation: which divergence, the generalized JSD's interpolation (0: forward KL, 0.5: JSD, "
        "1: reverse KL)",
    )
    temperature: float = Field(
        1.0, description="distillation: sampling temperature, also dividing both models' logits in the loss"
    )
    max_completion_length: int = Field(512, description="distillation: tokens the student generates per completion")
    max_prompt_length: int | None = Field(
        None, description="distillation: prompt tokens kept (longer prompts lose their start, counted; None: all)"
    )
    top_p: float = Field(1.0, description="distillation: nucleus sampling (1: off)")
    top_k: int = Field(0, description="distillation: keep the k most likely tokens (0: off)")

    @property
    def teacher_quantization(self) -> str | None:
        """How the teacher's linear layers are stored (`teacher_model_init_kwargs`): "nf4", "int8" or None."""
        kw = self.teacher_model_init_kwargs or {}
        return "nf4" if kw.get("load_in_4bit") else "int8" if kw.get("load_in_8bit") else None

    # what GRPO's rollouts read: one completion per prompt, one step per rollout, every completion trained on
    @property
    def num_generations(self) -> int:
        return 1

    @property
    def num_iterations(self) -> int:
        return 1

    @property
    def mask_truncated_completions(self) -> bool:
        return False

    @model_validator(mode="after")
    def _check(self):
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta = {self.beta}; expected a value in [0, 1] (0: forward KL, 0.5: JSD, 1: reverse KL)")
        check_positive(self, "temperature", "max_completion_length")
        check_positive(self, "max_prompt_length", allow_none=True)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}; expected a value in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}; expected >= 0 (0: off)")
        kw = self.teacher_model_init_kwargs or {}
        unknown = sorted(set(kw) - {"load_in_4bit", "load_in_8bit"})
        if unknown:
            raise ValueError(
                f"teacher_model_init_kwargs has {unknown}; expected load_in_4bit or load_in_8bit (the teacher's "
                "storage; its compute settings are the run's)"
            )
        if kw.get("load_in_4bit") and kw.get("load_in_8bit"):
            raise ValueError("teacher_model_init_kwargs sets load_in_4bit and load_in_8bit; expected one")
        return self


class DistillationConfig(TrainingArguments):
    """The arguments of `DistillationTrainer`: every `TrainingArguments` argument and the `distillation` group (TRL
    1.16's `DistillationConfig` names): `teacher_model_name_or_path`, `teacher_model_init_kwargs` (`load_in_4bit` or
    `load_in_8bit`: the teacher's linear layers stored quantized), `beta`, `temperature`, `max_completion_length`,
    `top_p`, `top_k`, and `max_prompt_length` (jaxloom's, as GRPO's: cut prompts lose
    their start). A step trains on `total_batch_size` completions, one per prompt, sampled from the student; rows
    are as wide as the step's data (GRPO's buckets), `max_sequence_length` being the widest the caps allow.
    `packing` is off.

        DistillationConfig(teacher_model_name_or_path="teacher/", beta=0.5, max_completion_length=128)
    """

    GROUPS = {**GROUPS, "distillation": DistillationArgs}

    def __init__(self, **kwargs: Any):
        super().__init__(**completion_rows(kwargs, DistillationArgs, "distillation"))
        if self.gradient_accumulation_steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps = {self.gradient_accumulation_steps}: distillation rolls out one batch "
                "a step; expected 1 (raise total_batch_size instead)"
            )


DistillationConfig.__signature__ = config_signature(DistillationConfig.GROUPS)  # type: ignore[attr-defined]
