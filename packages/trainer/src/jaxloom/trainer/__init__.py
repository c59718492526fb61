"""jaxloom.trainer: the training loop, its arguments, metrics, and the `jaxloom` command."""

from .__about__ import __version__
from .arguments import TrainingArguments
from .dpo_config import DPOConfig
from .grpo.config import GRPOConfig
from .batches import DataSpec
from .callbacks import Callback, Callbacks
from .compat.deployer import Deployer
from .distillation import DistillationTrainer
from .distillation_config import DistillationConfig
from .dpo import DPOTrainer
from .kto import KTOTrainer
from .kto_config import KTOConfig
from .grpo.trainer import GRPOTrainer
from .grpo.rloo import RLOOConfig, RLOOTrainer
from .reward import RewardTrainer
from .reward_config import RewardConfig
from .optim import get_lr_schedule_fn, make_optimizer
from .outputs import (
    TrainerConfigureDataloaderOutput,
    TrainerConfigureFunctionOutput,
    TrainerConfigureModelOutput,
    TrainerOutput,
)
from .compat.protocol import BaseTrainerProtocol, TrainerProtocol
from .plan import Plan
from .step import Objective, StepConfig, eval_step, token_loss, train_step
from .trainer import BaseTrainer, NonFiniteLossError, Trainer

__all__ = [
    "BaseTrainer",
    "BaseTrainerProtocol",
    "Callback",
    "Callbacks",
    "DPOConfig",
    "DistillationConfig",
    "DistillationTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "DPOTrainer",
    "KTOConfig",
    "KTOTrainer",
    "DataSpec",
    "Deployer",
    "NonFiniteLossError",
    "Objective",
    "Plan",
    "RLOOConfig",
    "RLOOTrainer",
    "RewardConfig",
    "RewardTrainer",
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
    "token_loss",
    "train_step",
]
