"""The registry `(model_type, task) → model class` (and `TaskType`, from `tasks`)."""

from __future__ import annotations

from .tasks import TaskType


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
    if (model_type, task) not in _REGISTRY and task == TaskType.SEQUENCE_CLASSIFICATION:
        if (model_type, TaskType.CAUSAL_LM) in _REGISTRY:  # made from the causal LM, the first time it is asked for
            from .classifier import classifier_class

            _REGISTRY[(model_type, task)] = classifier_class(_REGISTRY[(model_type, TaskType.CAUSAL_LM)])
    if (model_type, task) not in _REGISTRY:
        known = sorted(f"{m}/{t.name}" for m, t in _REGISTRY)
        raise ValueError(f"no model registered for model_type={model_type!r}, task={task.name}; known: {known}")
    return _REGISTRY[(model_type, task)]


def registered() -> list[tuple[str, TaskType]]:
    """Every registered `(model_type, task)`, sorted."""
    return sorted(_REGISTRY, key=lambda k: (k[0], k[1].value))
