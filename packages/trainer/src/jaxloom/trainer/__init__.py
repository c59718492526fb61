"""jaxloom.trainer: the training loop, its arguments, metrics, and the `jaxloom` command."""

from .__about__ import __version__
from .arguments import TrainingArguments
from .deployer import Deployer
from .optim import get_lr_schedule_fn, make_optimizer
from .protocol import TrainerProtocol
from .step import StepConfig, eval_step, train_step
from .trainer import BaseTrainer, NonFiniteLossError, Trainer, TrainerOutput

__all__ = [
    "BaseTrainer", "Deployer", "NonFiniteLossError", "StepConfig", "Trainer", "TrainerOutput", "TrainerProtocol",
    "TrainingArguments", "__version__", "eval_step", "get_lr_schedule_fn", "make_optimizer", "train_step",
]
