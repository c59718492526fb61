"""`BaseTrainerProtocol`: what every jaxloom trainer offers, as EasyDeL's reference defines it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ..outputs import TrainerConfigureDataloaderOutput, TrainerConfigureFunctionOutput, TrainerConfigureModelOutput


@runtime_checkable
class BaseTrainerProtocol(Protocol):
    """EasyDeL's `BaseTrainerProtocol`. `BaseTrainer` implements it; a custom trainer may subclass it
    (as the reference's skeleton does) and assign the attributes in its constructor.

    The attributes are plain (settable) members: `arguments`, `dataset_train`, `dataset_eval`, and,
    once `configure_model()` has run, `model`, `_model_state`, `optimizer` and `scheduler`;
    `dtype` and `param_dtype` come from the arguments."""

    arguments: Any
    dataset_train: Any
    dataset_eval: Any
    model: Any
    _model_state: Any
    dtype: Any
    param_dtype: Any
    scheduler: Any
    optimizer: Any

    def train(self, model_parameters: Any = None, state: Any = None) -> Any:
        """Train from `state` (or `model_parameters`, or what the trainer was given, or the newest
        checkpoint); returns the outcome (the final state, or an object carrying it as `.state`)."""

    def evaluate(self, state: Any = None, metric_calculator: Callable | None = None) -> dict[str, float]:
        """Metrics of `state` over the evaluation data; `metric_calculator` adds custom ones."""

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        """Write a state (default: the current one) where it can be loaded again."""

    def configure_functions(self) -> TrainerConfigureFunctionOutput:
        """The (jitted) train and eval step functions."""

    def configure_model(self) -> TrainerConfigureModelOutput:
        """The model and the state it trains."""

    def configure_dataloaders(self) -> TrainerConfigureDataloaderOutput:
        """The training and evaluation data loaders."""


TrainerProtocol = BaseTrainerProtocol
"""The earlier name of `BaseTrainerProtocol` (kept as an alias)."""
