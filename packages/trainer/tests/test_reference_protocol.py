"""EasyDeL's trainer protocol reference (shared/seeds/easydel-trainer-protocol.md): its required methods
and properties in the doc's order, and its implementation skeleton as a working custom trainer."""

from abc import abstractmethod

import jax
import jax.numpy as jnp
import numpy as np
import optax
from util import EVAL, TOK, TRAIN, args, mesh, tiny

import jaxloom.data as jd
import jaxloom.models as jm
import jaxloom.state as js
from jaxloom.trainer import (
    BaseTrainerProtocol,
    Trainer,
    TrainerConfigureDataloaderOutput,
    TrainerConfigureFunctionOutput,
    TrainerConfigureModelOutput,
    TrainerProtocol,
    eval_step,
    train_step,
)
from jaxloom.trainer.step import StepConfig

REQUIRED = [
    "train",
    "evaluate",
    "save_pretrained",
    "configure_functions",
    "configure_model",
    "configure_dataloaders",
    "arguments",
    "dataset_train",
    "dataset_eval",
    "model",
    "_model_state",
    "dtype",
    "param_dtype",
    "scheduler",
    "optimizer",
]


class Skeleton(BaseTrainerProtocol):
    """The reference's skeleton, as written there: attributes assigned in the constructor, then the
    three configure_* calls; the methods stay abstract."""

    def __init__(self, arguments, dataset_train, dataset_eval=None, **kwargs):
        self.arguments = arguments
        self.dataset_train = dataset_train
        self.dataset_eval = dataset_eval
        self.dtype = getattr(jnp, arguments.dtype) if arguments.dtype else jnp.float32
        self.param_dtype = getattr(jnp, arguments.param_dtype) if arguments.param_dtype else jnp.float32
        self.model = None
        self._model_state = None
        self.optimizer = None
        self.scheduler = None
        model_output = self.configure_model()
        self.model, self._model_state = model_output.model, model_output.state
        loaders = self.configure_dataloaders()
        self.dataloader_train, self.dataloader_eval = loaders.dataloader_train, loaders.dataloader_eval
        fns = self.configure_functions()
        self.train_step_fn, self.eval_step_fn = fns.train_step_fn, fns.eval_step_fn

    @abstractmethod
    def configure_model(self) -> TrainerConfigureModelOutput:
        raise NotImplementedError

    @abstractmethod
    def configure_dataloaders(self) -> TrainerConfigureDataloaderOutput:
        raise NotImplementedError

    @abstractmethod
    def configure_functions(self) -> TrainerConfigureFunctionOutput:
        raise NotImplementedError

    @abstractmethod
    def train(self, model_parameters=None, state=None):
        raise NotImplementedError

    @abstractmethod
    def evaluate(self, state, metric_calculator=None):
        raise NotImplementedError

    @abstractmethod
    def save_pretrained(self, ckpt_path, state=None):
        raise NotImplementedError


class MyCustomTrainer(Skeleton):
    """The skeleton filled in with jaxloom's parts (model, state, loader, step functions)."""

    def configure_model(self):
        self.scheduler = optax.constant_schedule(1e-2)
        self.optimizer = optax.adamw(self.scheduler)
        model = jm.create_model(tiny(), jm.RuntimeConfig(dtype=self.dtype, param_dtype=self.param_dtype), seed=0)
        return TrainerConfigureModelOutput(model=model, state=js.TrainState.create(model, self.optimizer))

    def configure_dataloaders(self):
        train = jd.DataLoader(self.dataset_train, TOK, jd.DataConfig(max_sequence_length=32, batch_size=8, prefetch=0))
        return TrainerConfigureDataloaderOutput(dataloader_train=train, dataloader_eval=None)

    def configure_functions(self):
        cfg = StepConfig(schedule=self.scheduler)
        return TrainerConfigureFunctionOutput(
            train_step_fn=jax.jit(lambda s, b: train_step(s, b, cfg)),
            eval_step_fn=jax.jit(lambda s, b: eval_step(s, b, cfg)),
        )

    def train(self, model_parameters=None, state=None):
        state = state or self._model_state
        for _ in range(3):
            batch = next(self.dataloader_train)
            state, _ = self.train_step_fn(state, {k: v[None] for k, v in batch.items()})
        self._model_state = state
        return state

    def evaluate(self, state, metric_calculator=None):
        batch = next(self.dataloader_train)
        out = self.eval_step_fn(state, batch)
        return {"loss": float(out["loss_sum"] / out["tokens"])}

    def save_pretrained(self, ckpt_path, state=None):
        return js.save_pretrained(state or self._model_state, ckpt_path, to_hf=False)


def test_required_members_in_the_reference_order_and_the_skeleton_works(tmp_path):
    assert TrainerProtocol is BaseTrainerProtocol
    for name in REQUIRED:
        assert name in dir(BaseTrainerProtocol) or name in BaseTrainerProtocol.__annotations__, name
    trainer = MyCustomTrainer(args(tmp_path, dtype="float32"), TRAIN, EVAL)
    assert isinstance(trainer, BaseTrainerProtocol)
    assert trainer.dtype == jnp.float32 and trainer.model is not None and trainer.optimizer is not None
    before = trainer.evaluate(trainer._model_state)["loss"]
    state = trainer.train()
    assert int(state.step) == 3 and trainer.evaluate(state)["loss"] < before
    path = trainer.save_pretrained(str(tmp_path / "ckpt"))
    assert js.CheckpointManager(str(path)).latest_step() == 3
    trainer.dataloader_train.close()


def test_base_trainer_conforms_with_the_reference_return_types(tmp_path):
    """BaseTrainer satisfies the protocol, and each required method returns what the reference says."""
    t = Trainer(
        args(tmp_path, max_training_steps=2),
        model=jm.create_model(tiny(), lazy=True),
        dataset_train=TRAIN,
        dataset_eval=EVAL,
        processing_class=TOK,
        mesh=mesh(1),
    )
    assert isinstance(t, BaseTrainerProtocol)
    model_out = t.configure_model()
    assert isinstance(model_out, TrainerConfigureModelOutput) and model_out.state is t._model_state
    assert isinstance(t.configure_dataloaders(), TrainerConfigureDataloaderOutput)
    assert isinstance(t.configure_functions(), TrainerConfigureFunctionOutput)
    assert t.dtype == jnp.float32 and t.param_dtype == jnp.float32 and t.optimizer is not None
    assert callable(t.scheduler) and float(t.scheduler(0)) >= 0
    out = t.train(model_parameters=None, state=None)
    assert int(out.state.step) == 2  # TrainerOutput carries the final state as `.state`
    metrics = t.evaluate(out.state, metric_calculator=lambda s, b: {"one": 1.0})
    assert metrics["one"] == 1.0 and np.isfinite(metrics["loss"])
    saved = t.save_pretrained(str(tmp_path / "ckpt"), out.state)  # save_pretrained(ckpt_path, state)
    assert js.CheckpointManager(str(saved)).latest_step() == 2
    t.finish()
