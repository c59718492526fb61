"""What the trainer's builders and `train()` return: EasyDeL's output types, under their names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple


class TrainerConfigureModelOutput(NamedTuple):
    """What `configure_model()` returns: the `model` (its module), the `state` it trains (a
    `jaxloom.state.TrainState` on its shards, restored or new), the optimizer `tx`, the learning-rate
    `scheduler` and the model `config`. Build it by keyword: the protocol's `(model, state)` and
    EasyDeL's `(model, tx, scheduler, config)` both fit."""

    model: Any
    state: Any = None
    tx: Any = None
    scheduler: Any = None
    config: Any = None


class TrainerConfigureDataloaderOutput(NamedTuple):
    """What `configure_dataloaders()` returns: `dataloader_train` (this process's rows of each global
    batch, at the resume position), `dataloader_eval` (a fresh pass over the evaluation data, or None),
    `max_training_steps` (optimizer steps of the run) and `max_evaluation_steps` (batches per evaluation)."""

    dataloader_train: Any
    dataloader_eval: Any = None
    max_training_steps: int | None = None
    max_evaluation_steps: int | None = None


class TrainerConfigureFunctionOutput(NamedTuple):
    """What `configure_functions()` returns: `train_step_fn(state, batch) -> (state, metrics)` and
    `eval_step_fn(state, batch) -> metrics`, both jitted with explicit shardings, the `mesh` they run
    on and the `checkpoint_manager` of the run."""

    train_step_fn: Callable
    eval_step_fn: Callable | None = None
    mesh: Any = None
    checkpoint_manager: Any = None


@dataclasses.dataclass
class TrainerOutput:
    """What `train()` returns: the final `state` and `metrics`, why it stopped (`stop_reason`), the
    checkpoint it resumed from (`resumed_from`), where checkpoints, report and plot are
    (`checkpoint_dir`, `report_path`, `plot_path`), the last preview `samples`, and the `signal` number
    that stopped it when this process received one (SIGINT, SIGTERM). A run resumed when it had already
    reached its last step trains nothing: its `stop_reason` starts with `ALREADY_COMPLETE`."""

    state: Any
    metrics: dict[str, float]
    stop_reason: str
    resumed_from: str | None
    checkpoint_dir: str | None
    report_path: str | None
    plot_path: str | None
    samples: list[str] = dataclasses.field(default_factory=list)
    signal: int | None = None


ALREADY_COMPLETE = "already complete"
