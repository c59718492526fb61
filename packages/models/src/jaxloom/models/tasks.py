"""`TaskType`: what a model class is for."""

from __future__ import annotations

import enum


class TaskType(str, enum.Enum):
    """What a model class is for (EasyDeL's names); the registry maps (model_type, task) to a class."""

    CAUSAL_LM = "causal-language-model"
    SEQUENCE_CLASSIFICATION = "sequence-classification"
    BASE_MODULE = "base-module"
    CUSTOM = "custom"  # a model class of the user's own (e.g. given to `RayDistributedTrainer(model_class=...)`)
