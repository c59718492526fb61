"""`TaskType` and the registry `(model_type, task) → model class`."""

from __future__ import annotations

import enum


class TaskType(str, enum.Enum):
    """What a model class is for (EasyDeL's names); the registry maps (model_type, task) to a class."""

    CAUSAL_LM = "causal-language-model"
    SEQUENCE_CLASSIFICATION = "sequence-classification"
    BASE_MODULE = "base-module"
    CUSTOM = "custom"  # a model class of the user's own (e.g. given to `RayDistributedTrainer(model_class=...)`)


_REGISTRY: dict[tuple[str, TaskType], type] = {}


def register(model_type: str, task: TaskType):
    """Class decorator: register a model class and record its `model_type` and `task` on it."""

    def wrap(cls):
        key = (model_type, TaskType(task))
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise ValueError(f"{key} is already registered to {_REGISTRY[key].__name__}")
        _REGISTRY[key] = cls
        cls.model_type, cls.task = model_type, TaskType(task)
        return cls

    return wrap


def get_model_class(model_type: str, task: TaskType | str = TaskType.CAUSAL_LM) -> type:
    """The class registered for `(model_type, task)`; an error listing what is known otherwise."""
    try:
        task = TaskType(task)
    except ValueError:
        raise ValueError(f"unknown task {task!r}; expected one of {[t.value for t in TaskType]}") from None
    if (model_type, task) not in _REGISTRY:
        known = sorted(f"{m}/{t.name}" for m, t in _REGISTRY)
        raise ValueError(f"no model registered for model_type={model_type!r}, task={task.name}; known: {known}")
    return _REGISTRY[(model_type, task)]


def registered() -> list[tuple[str, TaskType]]:
    """Every registered `(model_type, task)`, sorted."""
    return sorted(_REGISTRY, key=lambda k: (k[0], k[1].value))
