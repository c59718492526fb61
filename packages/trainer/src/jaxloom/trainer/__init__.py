"""jaxloom.trainer: the training loop, its arguments, metrics, and the `jaxloom` command."""

from .__about__ import __version__
from .arguments import DPOConfig, TrainingArguments
from .callbacks import Callback
from .deployer import Deployer
from .dpo import DPOTrainer
from .optim import get_lr_schedule_fn, make_optimizer
from .outputs import (
    TrainerConfigureDataloaderOutput,
    TrainerConfigureFunctionOutput,
    TrainerConfigureModelOutput,
    TrainerOutput,
)
from .protocol import BaseTrainerProtocol, TrainerProtocol
from .step import Objective, StepConfig, eval_step, train_step
from .trainer import BaseTrainer, NonFiniteLossError, Trainer

__all__ = [
    "BaseTrainer",
    "BaseTrainerProtocol",
    "Callback",
    "DPOConfig",
    "DPOTrainer",
    "Deployer",
    "NonFiniteLossError",
    "Objective",
    "StepConfig",
    "Trainer",
    "TrainerConfigureDataloaderOutput",
    "TrainerConfigureFunctionOutput",
    "TrainerConfigureModelOutput",
    "TrainerOutput",
    "TrainerProtocol",
    "TrainingArguments",
    "__version__",
    "eval_step",
    "get_lr_schedule_fn",
    "make_optimizer",
    "train_step",
]
