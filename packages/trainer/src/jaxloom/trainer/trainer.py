"""`BaseTrainer`: a composition root of builders around one jitted step, and a one-screen loop.

Constructing a trainer stores what it was given and nothing else: no file, thread, device query or
compilation. The builders (`configure_model`, `configure_dataloaders`, `configure_functions`, each
returning EasyDeL's output type) do the work when called; `initialize_trainer_utils()` calls them in
the order that overlaps the slow parts (compiling, tokenizing, restoring), and `train()`, `evaluate()`
and the generation methods call it on first use. Checkpoints, evaluation and previews are `Callback`s
with their own cadence; the loop only runs steps and asks which callbacks are due."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jaxloom.data as jd
import jaxloom.generation as jg
import jaxloom.models as jmod
import jaxloom.state as js
from jaxloom.mesh import MeshConfig, local_batch_slice, named_leaves, paths

from .arguments import TrainingArguments
from .callbacks import Callback
from .metrics import MetricsWriter, _NoBar, create_progress_bar, memory_in_use, peak_flops
from .optim import make_optimizer
from .outputs import (
    ALREADY_COMPLETE,
    TrainerConfigureDataloaderOutput,
    TrainerConfigureFunctionOutput,
    TrainerConfigureModelOutput,
    TrainerOutput,
)
from .report import plot_history, write_report
from .resume import check_resume, data_identity, fresh_run_directory, run_identity
from .step import STOP_KEY, Objective, StepConfig, eval_step, train_step

log = logging.getLogger("jaxloom.trainer")

# Why a process asks to stop; with several processes the largest code of any process wins (see request_stop).
_STOP_SIGNAL, _STOP_TIME_LIMIT, _STOP_REQUESTED = 1, 2, 3
RUN_CONFIG = "run_config.json"
# Step metrics that are not averaged into a log row (bookkeeping; tokens and the learning rate are logged apart).
_NOT_AVERAGED = {"finite", "learning_rate", "tokens", STOP_KEY}


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN or infinite loss or gradient (with `nan_policy="stop"`)."""


class _Finish:
    """`finish` as the reference has it, a static method (`BaseTrainer.finish()` ends the wandb run if one
    is active), which called on a trainer also releases that trainer's threads and checkpoint writer."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return _finish_logging
        return functools.partial(_finish_trainer, obj)


def _finish_logging() -> None:
    try:
        import wandb
    except ImportError:
        return
    if getattr(wandb, "run", None) is not None:
        wandb.finish()


def _finish_trainer(trainer: BaseTrainer) -> None:
    trainer._release_directory()
    if trainer.checkpoints is not None:
        trainer.checkpoints.close()
    if trainer.train_loader is not None:
        trainer.train_loader.close()
    if trainer._pool is not None:
        trainer._pool.shutdown(wait=False)
    _finish_logging()


class BaseTrainer:
    """Train `model` (an `nnx` model, concrete or abstract from `create_model(lazy=True)`) or a
    `model_state` on `dataset_train` (anything `jaxloom.data.as_source` reads) with `arguments`.
    EasyDeL's signature, in its order:

    - `arguments`: `TrainingArguments` (default: all defaults).
    - `model_state`: a `TrainState` to train (its parameters, and its optimizer state when it matches
      this run's optimizer). A module given here is taken as `model`.
    - `model`: the model to train; its runtime settings are replaced by the arguments that set them
      (`dtype`, `param_dtype`, `attn_mechanism`, `remat`, ...).
    - `dataset_train`, `dataset_eval`: training data and, optionally, evaluation data.
    - `data_collator`: `fn(batch) -> batch` applied to this process's rows of every training batch
      (numpy arrays `input_ids`, `segment_ids`, `positions`, `loss_mask`) before they go to the device;
      it must keep their keys, shapes and dtypes.
    - `finetune`: True (default) trains the given parameters; False trains the given architecture from
      new parameters drawn from `arguments.seed`.
    - `processing_class`: the tokenizer (default: the bundled one).
    - `mesh`: a `jax.sharding.Mesh` to use instead of the one the arguments describe.
    - `hooks`: objects with optional `on_step_start(trainer, step)` / `on_step_end(trainer, step, metrics)` /
      `on_save(trainer, step)` (after checkpoint `step` is written, or handed to the async writer).
    - `deprecated_kwargs`: none are accepted; any name here is an error naming it.

    Subclasses may override `on_step_start(state, step)`, `on_step_end(state, metrics, step)`,
    `start_training_hook()` and `start_evaluation_hook()`; the loop calls them.
    """

    finish = _Finish()

    def __init__(
        self,
        arguments: TrainingArguments | None = None,
        model_state: js.TrainState | None = None,
        model: nnx.Module | None = None,
        dataset_train: Any = None,
        dataset_eval: Any = None,
        data_collator: Any = None,
        finetune: bool = True,
        processing_class: Any = None,
        *,
        mesh=None,
        hooks: list | None = None,
        **deprecated_kwargs: Any,
    ):
        if deprecated_kwargs:
            raise TypeError(f"{type(self).__name__}: unknown argument(s) {sorted(deprecated_kwargs)}")
        if isinstance(model_state, nnx.Module) and model is None:
            model, model_state = model_state, None
        if dataset_train is None:
            raise ValueError("dataset_train is required")
        if model is None and model_state is None:
            raise ValueError("give a model (concrete or lazy) or a model_state")
        if data_collator is not None and not callable(data_collator):
            raise TypeError(f"data_collator {data_collator!r} is not callable")
        self.arguments = arguments or TrainingArguments()
        self.dataset_train, self.dataset_eval = dataset_train, dataset_eval
        self.data_collator, self.finetune = data_collator, bool(finetune)
        self.hooks = list(hooks or [])
        self.callbacks: list[Callback] = []
        self._model_in = model if model is not None else model_state.model
        self._state_in = model_state
        self._tokenizer = processing_class
        self._tokenizer_matched = False
        self._mesh = mesh
        # Filled by the builders.
        self.state: js.TrainState | None = None
        self.tx = self.schedule = self.checkpoints = self.writer = self.pbar = None
        self.train_loader: Any = None  # set by configure_dataloaders()
        self.resumed_from: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._planned = self._initialized = False
        self._data_state = None
        self._stop_code, self._stop_note = 0, ""  # this process's stop request (_STOP_* code)
        self._stop_reason: str | None = None
        self._t0 = self._eval_t0 = None
        self._elapsed_base = 0.0
        # The resolved config of a `jaxloom train` run (sections model, data, arguments): written to
        # save_directory/run_config.json at setup, so that eval, generate, convert and plan rebuild the run.
        self.run_config: dict[str, Any] | None = None

    # ---- what the trainer is working on ---------------------------------------------------------------
    @property
    def tokenizer(self):
        """The tokenizer (`processing_class`; the bundled one, loaded on first use), set to add BOS by itself
        exactly when training does (`jaxloom.data.match_bos`): prompts, the run's copy of it and an HF
        export encode text as the model saw it in training."""
        if self._tokenizer is None:
            self._tokenizer = jd.load_processor()
        if isinstance(self._tokenizer, Future):  # loaded in the background during setup
            self._tokenizer = self._tokenizer.result()
        if not self._tokenizer_matched:
            self._tokenizer = jd.match_bos(self._tokenizer, jd.DataConfig.add_bos)
            self._tokenizer_matched = True
        return self._tokenizer

    processing_class = tokenizer

    @property
    def mesh(self):
        """The device mesh (built from the arguments on first use unless one was given)."""
        if self._mesh is None:
            a = self.arguments
            self._mesh = MeshConfig(a.sharding_axis_dims, a.sharding_axis_names, a.sharding_dcn_axis_dims).build()
        return self._mesh

    @property
    def runtime(self) -> jmod.RuntimeConfig:
        """The model's `RuntimeConfig` with the arguments that set runtime fields applied."""
        return self.arguments.runtime.apply(self._model_in.runtime)

    dtype = property(lambda self: self.runtime.dtype, doc="Computation dtype (the arguments', else the model's).")
    param_dtype = property(
        lambda self: self.runtime.param_dtype, doc="Parameter dtype (the arguments', else the model's)."
    )
    model_state = property(lambda self: self.state, doc="The `TrainState` (None before `configure_model()`).")
    _model_state = model_state
    optimizer = property(lambda self: self.tx, doc="The optax optimizer (None before `configure_model()`).")
    scheduler = property(lambda self: self.schedule, doc="The learning-rate schedule (None before configuring).")
    checkpoint_manager = property(lambda self: self.checkpoints, doc="The run's `jaxloom.state.CheckpointManager`.")
    is_process_zero = property(lambda self: jax.process_index() == 0, doc="Whether this is process 0.")
    process_zero_is_admin = property(lambda self: True, doc="Process 0 writes logs, reports and exports: always.")
    is_enable = property(
        lambda self: self.is_process_zero or not self.process_zero_is_admin,
        doc="Whether this process does the writing (process 0, since it is the admin).",
    )
    training_batch_size = property(
        lambda self: self.arguments.training_batch_size,
        doc="Rows per optimizer step: total_batch_size × gradient_accumulation_steps.",
    )
    evaluation_batch_size = property(lambda self: self.arguments.eval_batch_size, doc="Rows per evaluation batch.")
    _train_source = property(lambda self: jd.as_source(self.dataset_train), doc="The training data as a source.")
    _eval_source = property(
        lambda self: None if self.dataset_eval is None else jd.as_source(self.dataset_eval),
        doc="The evaluation data as a source, or None.",
    )

    @property
    def model(self):
        """The model: the trained state's once `configure_model()` has run, else the one given."""
        return self.state.model if self.state is not None else self._model_in

    # ---- builders ------------------------------------------------------------------------------------
    def _plan(self) -> None:
        """Everything abstract: mesh, runtime, optimizer and schedule, the state's shapes and shardings,
        the checkpoint manager. Nothing is allocated or compiled."""
        if self._planned:
            return
        a = self.arguments
        template = self._model_in
        self.config, self.model_class = template.config, type(template)
        runtime = self.runtime
        self._check_attention(runtime)
        self._check_shapes()
        self.total_steps = a.max_training_steps or self._steps_for_epochs()
        self.tx, self.schedule = make_optimizer(a.optim, self.total_steps)
        self.n_params = jmod.count_params(template)
        abstract_model = jmod.create_model(self.config, runtime, lazy=True, model_class=self.model_class)
        self._build = self._state_builder(template, abstract_model, runtime)
        self._abstract_state = jax.eval_shape(self._build[0], *self._build[1])
        self.state_shardings = js.state_shardings(
            self._abstract_state, jmod.param_shardings(abstract_model, self.mesh), self.mesh
        )
        self._batch_sharding, self._eval_sharding = self._batch_shardings()
        self.checkpoints = self._checkpoint_manager() if a.save_directory is not None else None
        self._planned = True

    def _checkpoint_manager(self) -> js.CheckpointManager:
        a = self.arguments
        return js.CheckpointManager(
            js.CheckpointConfig(
                directory=a.checkpoint_directory or str(Path(a.save_directory) / "checkpoints"),
                save_steps=a.save_steps,
                save_minutes=a.save_minutes,
                save_total_limit=a.save_total_limit,
                async_save=a.async_checkpointing,
            )
        )

    def _directory(self) -> Path:
        """The run's `save_directory`; without one, a new one for this run (chosen once, at setup)."""
        if self.arguments.save_directory is None:
            self.arguments = self.arguments.replace(save_directory=fresh_run_directory())
            log.info("save_directory not set: this run writes to %s", self.arguments.save_directory)
            if self._planned:
                self.checkpoints = self._checkpoint_manager()
        return Path(self.arguments.save_directory)

    def configure_model(self) -> TrainerConfigureModelOutput:
        """The state this run trains, on its shards: restored from the newest checkpoint of
        `save_directory` (`resume_if_possible`), else from the given state or model, else new from
        `seed`. Also builds the mesh, the optimizer and schedule (`optimizer`, `scheduler`)."""
        self._plan()
        if self.state is None:
            self.state = self._restore() if self._resume_step() is not None else self._initial_state()
        return TrainerConfigureModelOutput(
            model=self.state.model, state=self.state, tx=self.tx, scheduler=self.schedule, config=self.config
        )

    def configure_dataloaders(self) -> TrainerConfigureDataloaderOutput:
        """This process's training loader, started at the restored data position (so call it after
        `configure_model()` when resuming), and a fresh evaluation loader."""
        self._plan()
        if self.train_loader is None:
            self._check_vocab()
            self._check_previews()
            self._check_eval_data()
            self.train_loader = self._loader(self.dataset_train, state=self._data_state)
            self.train_loader.start()  # the first batches are made while the step compiles
        return TrainerConfigureDataloaderOutput(
            self.train_loader,
            self._eval_loader(),
            self.total_steps,
            self.arguments.eval_batches if self.dataset_eval is not None else None,
        )

    def configure_functions(self) -> TrainerConfigureFunctionOutput:
        """The train and eval steps jitted with explicit shardings and donation; the train step starts
        compiling for the exact shapes in the background."""
        self._jit_steps()
        self._train_fn = self._setup_pool().submit(self._compile_train_step)
        return TrainerConfigureFunctionOutput(self._train_jit, self._eval_jit, self.mesh, self.checkpoints)

    # ---- what a trainer on this core supplies (a subclass overrides these: see DPOTrainer) -------------------
    def objective(self) -> Objective:
        """What the steps minimise and log: next-token cross entropy over the loss-masked tokens."""
        return Objective()

    @property
    def row_width(self) -> int:
        """Token columns of one batch row (`max_sequence_length`; a preference pair's row holds two sequences)."""
        return self.arguments.max_sequence_length

    def data_settings(self) -> dict[str, Any]:
        """`jaxloom.data.DataConfig` fields of this trainer's loaders (rows, packing, truncation, shuffling)."""
        a = self.arguments
        return dict(
            max_sequence_length=a.max_sequence_length,
            packing=a.packing,
            truncation_mode=a.truncation_mode,
            shuffle=a.shuffle_train_dataset,
            shuffle_buffer_size=a.shuffle_buffer_size,
            seed=a.seed,
        )

    def data_shards(self) -> int:
        """How many ways the batch rows are split over the mesh (the data-parallel size)."""
        a = self.arguments
        rows = a.total_batch_size
        return max(
            1, rows // self._batch_sharding.shard_shape((a.gradient_accumulation_steps, rows, self.row_width))[1]
        )

    def batch_spec(self, rows: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        """`{key: (shape, dtype)}` of the train step's batch for `rows` global rows per micro-batch, with the
        accumulation axis first: what the step is compiled for and what `_global_batch` makes."""
        shape = (self.arguments.gradient_accumulation_steps, rows, self.row_width)
        return {k: (shape, np.int32) for k in ("input_ids", "segment_ids", "positions", "loss_mask")}

    def _jit_steps(self) -> None:
        self._plan()
        a = self.arguments
        aux = getattr(self.config, "router_aux_loss_coef", 0.0)
        self.step_config = StepConfig(
            z_loss=a.z_loss,
            loss_block_size=a.loss_block_size,
            data_shards=self.data_shards(),
            aux_loss_coef=aux,
            skip_nonfinite=a.nan_policy == "skip",
            schedule=self.schedule,
            objective=self.objective(),
        )
        repl = NamedSharding(self.mesh, PartitionSpec())
        donate = a.donate_state if a.donate_state is not None else self.mesh.devices.flat[0].platform != "cpu"
        self._train_jit = jax.jit(
            functools.partial(train_step, cfg=self.step_config),
            in_shardings=(self.state_shardings, self._batch_sharding),
            out_shardings=(self.state_shardings, repl),
            donate_argnums=0 if donate else (),
        )
        self._eval_jit = jax.jit(
            functools.partial(eval_step, cfg=self.step_config),
            in_shardings=(self.state_shardings, self._eval_sharding),
            out_shardings=repl,
        )

    def initialize_trainer_utils(self) -> None:
        """Run the builders once, ordered so that the slow parts overlap: the tokenizer loads and the
        train step compiles in the background while the state is restored or created; a new run starts
        its loader (tokenizing) before creating the state, a resumed one after restoring its position.
        Process-wide settings (the compilation cache) are applied here, at the start of a run."""
        if self._initialized:
            return
        self._directory()
        self._take_directory()
        if self.arguments.compilation_cache_dir:
            use_compilation_cache(self.arguments.compilation_cache_dir)
        pool = self._setup_pool()
        if self._tokenizer is None:
            self._tokenizer = pool.submit(jd.load_processor)
        pool.submit(js.CheckpointManager.prepare)
        self._plan()
        if not hasattr(self, "_train_fn"):
            self.configure_functions()
        if self.state is None and self._resume_step() is not None:
            self._check_resume()
            self.configure_model()
            self.configure_dataloaders()
        else:
            self.configure_dataloaders()
            self.configure_model()
        self._add_builtin_callbacks()
        self._identity()  # recorded by every checkpoint: computed once, now, not at the first save
        self._write_run_files()
        self._initialized = True

    def _write_run_files(self) -> None:
        """What rebuilds the run from its directory alone, written by process 0 once the run is known to be
        valid: `run_config.json` (the resolved config, when the `jaxloom` command gave one as
        `run_config`) and a copy of the tokenizer in `tokenizer/` (kept once written), each atomically."""
        if not self.is_process_zero:
            return
        directory = self._directory()
        if self.run_config is not None:
            tmp = directory / f".{RUN_CONFIG}.tmp"
            tmp.write_text(json.dumps(self.run_config, indent=2, default=str))
            os.replace(tmp, directory / RUN_CONFIG)
        target = directory / "tokenizer"
        if not target.is_dir() and hasattr(self.tokenizer, "save_pretrained"):
            tmp_dir = directory / ".tokenizer.tmp"
            shutil.rmtree(tmp_dir, ignore_errors=True)
            self.tokenizer.save_pretrained(str(tmp_dir))
            os.replace(tmp_dir, target)

    def restore_checkpoint(self, *, params_only: bool = False) -> js.TrainState:
        """The newest checkpoint of `save_directory` as this trainer's state, with nothing else set up
        (no loader, no compile): for commands that only read a run (`eval`, `generate`, `convert`).
        `params_only` leaves the optimizer state abstract. FileNotFoundError when there is none."""
        self._plan()
        if self.checkpoints is None:
            raise FileNotFoundError("save_directory is not set: there is no run to restore a checkpoint from")
        if self.checkpoints.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint under {self.checkpoints.directory} (none complete)")
        target = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self._abstract_state, self.state_shardings
        )
        restored = self.checkpoints.restore(target, params_only=params_only)
        self.resumed_from = f"{self.checkpoints.directory}/{restored.step or self.checkpoints.latest_step()}"
        self.state = restored.state
        return self.state

    # What a run writes in its save_directory, removed by `overwrite_output_dir` (run_config.json is the
    # new run's own, rewritten at setup from `run_config`).
    RUN_OUTPUTS = (
        "checkpoints",
        "metrics.jsonl",
        "tensorboard",
        "report.md",
        "loss.png",
        "profile",
        "tokenizer",
        "wandb_run_id",
    )

    def _take_directory(self) -> None:
        """One owner per `save_directory` (a lock file, process 0), seen by every process (multi-process
        runs: `check_shared_directory`), and no earlier run replaced silently:
        checkpoints there are resumed (`resume_if_possible`), removed (`overwrite_output_dir`), or an error."""
        a = self.arguments
        directory = Path(a.save_directory)
        if self.is_process_zero:
            self._lock = js.DirectoryLock(directory).acquire()
        shared = a.checkpoint_directory or directory  # every process writes its part of each checkpoint there
        try:  # ... and reads it back after a restart (an object store is shared by every host)
            if not paths.is_uri(shared):
                js.check_shared_directory(shared)
        except ValueError:
            self._release_directory()
            raise
        ckpts = paths.as_path(a.checkpoint_directory or directory / "checkpoints")
        earlier = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.is_dir() else []
        if earlier and a.overwrite_output_dir:
            log.warning("overwrite_output_dir: removing the earlier run in %s (checkpoints %s)", directory, earlier)
            if self.is_process_zero:
                for name in self.RUN_OUTPUTS:
                    target = directory / name
                    if target.is_dir():
                        shutil.rmtree(target)
                    else:
                        target.unlink(missing_ok=True)
                if a.checkpoint_directory:
                    paths.remove_tree(paths.as_path(a.checkpoint_directory))
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("jaxloom-overwrite-output-dir")
            if self.checkpoints is not None:
                self.checkpoints.reload()
        elif earlier and not a.resume_if_possible:
            self._release_directory()
            raise ValueError(
                f"save_directory {directory} holds checkpoints {earlier} of an earlier run and "
                "resume_if_possible=false; expected an empty directory. Set resume_if_possible=true to continue "
                "that run, overwrite_output_dir=true to replace it, or choose a new save_directory."
            )

    def _release_directory(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()

    def _setup_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxloom-setup")
        return self._pool

    def _resume_step(self) -> int | None:
        if not self.arguments.resume_if_possible:
            return None
        return self.checkpoints.latest_step()

    def _identity(self) -> dict[str, Any]:
        """What this run is (arguments, model config, tokenizer, training data), recorded in every checkpoint."""
        if getattr(self, "_run_identity", None) is None:
            self._run_identity = run_identity(self.arguments, self.config, self.tokenizer, self.dataset_train)
        return self._run_identity

    def _check_resume(self) -> None:
        """Before restoring: the run in `save_directory` must be one this run can continue (the same model,
        tokenizer, training data and optimizer); what may change (steps, cadences, logging) is printed."""
        step = self._resume_step()
        assert step is not None
        try:
            recorded = self.checkpoints.read_meta(step).get("metadata", {}).get("run") or {}
        except (OSError, ValueError):
            recorded = {}  # unreadable metadata: the restore reports it
        changed = check_resume(self.arguments.save_directory, step, recorded, self._identity())
        if changed:
            log.warning(
                "resuming the run in %s with changed settings:\n  %s",
                self.arguments.save_directory,
                "\n  ".join(changed),
            )

    def _restore(self) -> js.TrainState:
        target = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self._abstract_state, self.state_shardings
        )
        restored = self.checkpoints.restore(target)
        self._data_state = restored.data_state
        self.resumed_from = f"{self.checkpoints.directory}/{restored.step}"
        # a warning: a Python user who configured no logging still sees that the run continued an earlier one
        log.warning("resumed from checkpoint %s (step %d)", self.resumed_from, restored.step)
        log.debug("data position at step %d: %s", restored.step, restored.data_state)
        return restored.state

    def _initial_state(self) -> js.TrainState:
        """The state created on its shards by one jitted program. From a seed on a one-device mesh, op by
        op instead: a few small kernels shared by same-shaped layers compile faster than one program with
        a random-number pipeline per parameter (seconds of start-up on CPU; same values to rounding)."""
        if self.arguments.resume_if_possible:
            log.info(
                "resume_if_possible: no complete checkpoint in %s; starting from scratch", self.checkpoints.directory
            )
        fn, inputs = self._build
        if self._state_in is not None and _matches(self._state_in, self._abstract_state):
            return jax.jit(lambda s: s, out_shardings=self.state_shardings)(self._state_in)  # its optimizer state too
        if self.mesh.devices.size > 1 or inputs:  # from given parameters: copies, never aliases of them
            return jax.jit(fn, out_shardings=self.state_shardings)(*inputs)
        return jax.device_put(fn(*inputs), self.state_shardings)

    def _state_builder(self, template, abstract_model, runtime):
        """`(fn, inputs)`: `fn(*inputs)` makes the initial state. From the seed when the model is abstract
        (or `finetune=False`); else from the given parameters, cast to `param_dtype` and put into the
        model rebuilt with this run's runtime."""
        seed, tx, config, cls = self.arguments.seed, self.tx, self.config, self.model_class
        # The given state's class (EasyDeL's `state_class`, a `TrainState` subclass) is kept for the run.
        state_cls = type(self._state_in) if isinstance(self._state_in, js.TrainState) else js.TrainState
        leaves = jax.tree_util.tree_leaves(nnx.state(template, nnx.Param))
        if not self.finetune or (leaves and isinstance(leaves[0], jax.ShapeDtypeStruct)):
            return (
                lambda: state_cls.create(jmod.create_model(config, runtime, seed=seed, model_class=cls), tx, seed=seed)
            ), ()
        _, params, rest = nnx.split(template, nnx.Param, ...)
        graphdef, target, _ = nnx.split(abstract_model, nnx.Param, ...)
        if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(target):
            raise ValueError(
                "the arguments change the layout of the given model's parameters (scan_layers "
                f"{self._model_in.runtime.scan_layers} -> {runtime.scan_layers}); create the model with "
                "the layout you want, or leave scan_layers unset"
            )
        cast = jax.tree_util.tree_map(lambda p, t: p.astype(t.dtype) if p.dtype != t.dtype else p, params, target)
        return (lambda p: state_cls.create(nnx.merge(graphdef, p, rest), tx, seed=seed)), (cast,)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch rows are split over, in order: the model's `partition_axis.batch_axis`
        (default fsdp, then dp) as far as the mesh has them. The loaders lay rows out the same way, so
        no batch is resharded inside the step; with `ep` in it, a mixture of experts moves its tokens
        between the expert-parallel devices, which are data-parallel everywhere else."""
        axes = self.runtime.partition_axis.batch_axis
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        return tuple(x for x in axes if x in self.mesh.shape)

    def _check_shapes(self) -> None:
        """Before anything runs: rows fit the model's positions, and both batch sizes divide over the
        data axes (the evaluation batch is checked now, not at the first evaluation, after training)."""
        a = self.arguments
        if a.max_sequence_length > self.config.max_position_embeddings:
            raise ValueError(
                f"max_sequence_length = {a.max_sequence_length}; expected at most the model's "
                f"max_position_embeddings ({self.config.max_position_embeddings}): positions past it were never "
                "trained and exported models refuse them. Shorten the rows or raise model.max_position_embeddings"
            )
        local_batch_slice(self.mesh, a.total_batch_size, self.data_axes)
        if self.dataset_eval is not None:
            try:
                local_batch_slice(self.mesh, a.eval_batch_size, self.data_axes)
            except ValueError as e:
                raise ValueError(f"evaluation_batch_size = {a.eval_batch_size}: {e}") from None

    def _check_vocab(self) -> None:
        """Every token id the tokenizer can produce has a row in the model's embedding (a larger id
        would be clamped by the gather: a silently wrong model, NaN soon after)."""
        n = len(self.tokenizer)
        if n > self.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {n} tokens but the model's vocab_size is {self.config.vocab_size}; expected "
                f"vocab_size >= {n} (set model.vocab_size, or use the model's own tokenizer)"
            )

    def _check_previews(self) -> None:
        """Every preview prompt, with the tokens to generate after it, fits the model's positions: checked
        now, not at the first preview (which comes after training steps that would then be lost)."""
        a = self.arguments
        if not a.generation_prompts:
            return
        try:
            encoded = jg.encode_prompts(self.tokenizer, list(a.generation_prompts))
        except ValueError as e:
            raise ValueError(f"generation_prompts {list(a.generation_prompts)!r}: {e}") from None
        limit = self.config.max_position_embeddings
        for i, (prompt, ids) in enumerate(zip(a.generation_prompts, encoded, strict=True)):
            if len(ids) + a.generation_max_new_tokens > limit:
                raise ValueError(
                    f"generation_prompts[{i}] = {prompt[:60]!r}{'...' if len(prompt) > 60 else ''} is {len(ids)} "
                    f"tokens, + generation_max_new_tokens = {a.generation_max_new_tokens}; expected at most the "
                    f"model's max_position_embeddings ({limit}) in all: shorten the prompt or generate fewer tokens"
                )

    def _check_eval_data(self) -> None:
        """The first evaluation batch is read and tokenized now: a bad evaluation file fails before the
        first step, not at the first evaluation after training steps that would then be lost."""
        loader = self._eval_loader()
        if loader is None:
            return
        try:
            first = next(iter(loader), None)
        except (ValueError, TypeError, KeyError, OSError) as e:
            e.add_note("jaxloom: while reading the first batch of the evaluation data (dataset_eval), before training")
            raise
        if first is None:
            raise ValueError(
                f"dataset_eval gives no batch of evaluation_batch_size = {self.arguments.eval_batch_size} rows; "
                "expected at least one (add evaluation records, lower the batch size, or drop dataset_eval)"
            )

    def _check_attention(self, runtime) -> None:
        """The attention backend must run on this mesh's platform at this length, before anything
        compiles; cuDNN's kernel cannot keep packed documents apart."""
        a = self.arguments
        platform = self.mesh.devices.flat[0].platform
        jmod.choose_implementation(
            runtime.attn_mechanism,
            q_len=a.max_sequence_length,
            kv_len=a.max_sequence_length,
            cached=False,
            window=self.config.sliding_window,
            platform=platform,
        )
        if runtime.attn_mechanism == "cudnn" and a.packing:
            raise ValueError(
                "attn_mechanism='cudnn' cannot keep packed documents apart (it knows lengths, not "
                "segments): set packing=false, or use attn_mechanism='flash' or 'auto'"
            )

    def _steps_for_epochs(self) -> int:
        """Optimizer steps in `num_train_epochs` passes, counted by running the loader over one epoch."""
        loader = self._loader(self.dataset_train, num_epochs=1, shuffle=False, prefetch=0)
        batches = sum(1 for _ in loader)
        if batches == 0:
            raise ValueError("dataset_train is empty")
        return max(1, batches * self.arguments.num_train_epochs)

    def _loader(self, data, *, global_rows=None, state=None, **overrides) -> jd.MeshLoader:
        """This process's rows of global batches: one stream per data-parallel shard, so the data depends
        on the mesh's data-parallel size only, not on how many processes share it."""
        a = self.arguments
        accum = overrides.pop("accumulation", a.gradient_accumulation_steps)
        cfg = jd.DataConfig(**{**self.data_settings(), **overrides})
        return jd.MeshLoader(
            data,
            self.tokenizer,
            cfg,
            self.mesh,
            global_rows or a.total_batch_size,
            accumulation=accum,
            state=state,
            data_axes=self.data_axes,
        )

    def _eval_loader(self) -> jd.MeshLoader | None:
        """A new pass over `dataset_eval` (not started), or None without evaluation data."""
        if self.dataset_eval is None:
            return None
        return self._loader(
            self.dataset_eval,
            global_rows=self.arguments.eval_batch_size,
            accumulation=1,
            num_epochs=1,
            shuffle=False,
            prefetch=0,
        )

    def _batch_shardings(self):
        axes = self.data_axes or None
        return NamedSharding(self.mesh, PartitionSpec(None, axes)), NamedSharding(self.mesh, PartitionSpec(axes))

    def _compile_train_step(self):
        return self.lower_train_step().compile()

    def lower_train_step(self):
        """The train step lowered for the run's exact shapes and shardings (`jax.stages.Lowered`:
        `.as_text()` is the program before XLA's optimisations, `.compile()` the executable)."""
        if not hasattr(self, "_train_jit"):
            self._jit_steps()
        a = self.arguments
        batch = {
            k: jax.ShapeDtypeStruct(shape, dtype, sharding=self._batch_sharding)
            for k, (shape, dtype) in self.batch_spec(a.total_batch_size).items()
        }
        if jax.process_count() > 1:
            shape = (a.gradient_accumulation_steps, a.total_batch_size, 1)
            batch[STOP_KEY] = jax.ShapeDtypeStruct(shape, np.int32, sharding=self._batch_sharding)
        state = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self._abstract_state, self.state_shardings
        )
        with jax.set_mesh(self.mesh):
            return self._train_jit.lower(state, batch)

    def compile_aot(self) -> bool:
        """Compile the train step for the run's exact shapes and shardings now, before the first batch
        (the loop uses this executable). Returns True when it compiled it, False when it already was."""
        if not self._planned or not hasattr(self, "_train_fn"):
            self.configure_functions()
        if isinstance(self._train_fn, Future):
            self._train_fn = self._train_fn.result()
            return True
        return False

    def compiled_train_step(self):
        """The AOT-compiled train step (compiling it if needed): `memory_analysis()`, `cost_analysis()`."""
        self.compile_aot()
        return self._train_fn

    def _add_builtin_callbacks(self) -> None:
        """Checkpoint first (saved before anything that can fail runs on the step), then evaluation and
        the generation preview, each on its cadence; users' callbacks after them."""
        a = self.arguments
        builtin = [Callback(lambda t, step: t._save(step), when=self.checkpoints.should_save, name="checkpoint")]
        if a.evaluation_steps and self.dataset_eval is not None:
            builtin.append(
                Callback(lambda t, step: t._evaluate_and_log(step), every=a.evaluation_steps, name="evaluation")
            )
        if a.generation_interval and a.generation_prompts:
            builtin.append(Callback(lambda t, step: t.preview(step), every=a.generation_interval, name="preview"))
        self.callbacks[:0] = builtin

    def add_callback(self, fn, *, every: int | None = None, when=None, name: str = "") -> Callback:
        """Run `fn(trainer, step)` after every `every`-th step (and/or whenever `when(step)` is true),
        on that step's state; `name` labels it. Returns the `Callback`."""
        cb = Callback(fn, every=every, when=when, name=name)
        self.callbacks.append(cb)
        return cb

    # ---- the loop --------------------------------------------------------------------------------------
    def train(self, model_parameters: Any = None, state: js.TrainState | None = None) -> TrainerOutput:
        """Run until `max_training_steps` (or the epochs, a time limit, a stop signal or the end of the
        data); log, evaluate, preview, checkpoint on their cadence. Start from `state` (a `TrainState`;
        its optimizer state is kept when it fits this run's optimizer) or `model_parameters` (the model's
        `nnx.Param` state) when given, else from what the trainer was given; a checkpoint in
        `save_directory` wins when `resume_if_possible`. Returns a `TrainerOutput` (`.state` is the final
        state).

        One step is always in flight: step n+1 is dispatched (its batch staged on the device meanwhile)
        before step n's metrics are read, so the host's checks, logging and progress bar run while the
        device computes. Callbacks need their own step's state; the loop settles it first."""
        self._take_starting_point(model_parameters, state)
        try:
            self.initialize_trainer_utils()
        except BaseException as e:
            _note_out_of_memory(e)
            raise
        self.start_training_hook()
        step = int(jax.device_get(self.state.step))
        if self.resumed_from and step >= self.total_steps:
            return self._already_complete(step)
        self._announce(step)
        self.pbar = self.create_progress_bar(
            self.total_steps, desc="train", disabled=not self.arguments.progress_bar, initial=step
        )
        self._step = step
        self.writer = self._metrics_writer()
        restore_signals = self._install_signal_handlers()
        try:
            step, stop_reason = self._loop(step)
            return self._finish(step, stop_reason)
        except BaseException as e:
            self._after_error(e)
            raise
        finally:  # after the final save: a second Ctrl-C while it is written is absorbed, not fatal
            restore_signals()
            self._release_directory()

    def _announce(self, step: int) -> None:
        """One start-up summary on process 0: model, mesh, data and tokens per step, steps, where it writes."""
        if not self.is_process_zero:
            return
        a, devices = self.arguments, self.mesh.devices
        tokens = a.training_batch_size * self.row_width
        start = f"resumed from {self.resumed_from}" if self.resumed_from else "a new run"
        lines = [
            f"model: {self.model_class.__name__} ({self.config.model_type}), {self.n_params:,} parameters",
            f"mesh: {dict(self.mesh.shape)} over {devices.size} × {devices.flat[0].device_kind}"
            f" in {jax.process_count()} process(es)",
            f"data: {_describe_data(self._identity()['train_data'], self.dataset_train)}; "
            f"{a.training_batch_size} rows × {self.row_width} tokens = {tokens:,} tokens per step",
            f"steps: {step} → {self.total_steps} ({start})",
            f"save_directory: {a.save_directory}",
        ]
        log.info("training\n  %s", "\n  ".join(lines))

    def _already_complete(self, step: int) -> TrainerOutput:
        """Resumed at or past its last step: nothing to train, and nothing rewritten (report, plot, logs)."""
        self._release_directory()
        a = self.arguments
        history = MetricsWriter(a.save_directory, tensorboard=False, bar=_NoBar(), start_step=step)
        history.close()
        last_eval = next((r for r in reversed(history.history) if "eval/loss" in r), {})
        final = _final_metrics(history.history, {k.split("/", 1)[1]: v for k, v in last_eval.items() if k != "step"})
        self.writer = history
        directory = Path(a.save_directory)
        log.warning(
            "the run in %s is already complete (checkpoint %d, max_training_steps=%d): nothing to train. Raise "
            "max_training_steps to train it further, or choose a new save_directory for a new run.",
            directory,
            step,
            self.total_steps,
        )
        return TrainerOutput(
            self.state,
            final,
            f"{ALREADY_COMPLETE}: step {step} of {self.total_steps}",
            self.resumed_from,
            str(self.checkpoints.directory),
            str(directory / "report.md") if (directory / "report.md").is_file() else None,
            str(directory / "loss.png") if (directory / "loss.png").is_file() else None,
        )

    def _after_error(self, error: BaseException) -> None:
        """Training stopped on `error`: let the checkpoint being written finish (never leave it half
        written), and say in the error at which step training stopped and what is safe on disk."""
        try:
            self.checkpoints.wait_until_finished()
            latest = self.checkpoints.latest_step()
            safe = (
                f"the newest complete checkpoint is {self.checkpoints.directory}/{latest}"
                if latest
                else ("no checkpoint was complete")
            )
        except Exception as e:  # noqa: BLE001 - the first error is the one to report
            safe = f"the checkpoint in flight failed too ({type(e).__name__}: {str(e)[:200]})"
        error.add_note(f"jaxloom: training stopped during step {self._step + 1}; {safe}")
        _note_out_of_memory(error)

    def _loop(self, step: int) -> tuple[int, str]:
        self.compile_aot()  # usually done already: it compiled in the background during setup
        profiler = _Profiler(self.arguments.profile_steps, Path(self.arguments.save_directory) / "profile")
        pending, stop_reason = None, "max_training_steps reached"
        try:
            while step < self.total_steps and not self._stop_reason:
                self._call_step_start(step + 1)  # steps are numbered like checkpoints: updates after the step
                profiler.before(step + 1)
                try:
                    local = next(self.train_loader)
                except StopIteration:
                    stop_reason = "training data exhausted"
                    break
                self.state, metrics = self._train_fn(self.state, self._global_batch(local))
                step = self._step = step + 1
                metrics = self._call_step_end(step, metrics)
                profiler.after(step, metrics)
                if pending:
                    self._after_step(*pending)  # the previous step, now done on the device
                pending = (step, metrics)
                due = [c for c in self.callbacks if c.due(step)]
                if due:  # they need this step's state: settle it first
                    self._after_step(*pending)
                    pending = None
                    for cb in due:
                        cb.fn(self, step)
            if pending:
                self._after_step(*pending)
        finally:
            profiler.close()
        return step, self._stop_reason or stop_reason

    def _call_step_start(self, step: int) -> None:
        assert self.state is not None
        self.state = self.on_step_start(self.state, step)
        for h in self.hooks:
            getattr(h, "on_step_start", lambda *_: None)(self, step)

    def _call_step_end(self, step: int, metrics: dict) -> dict:
        assert self.state is not None
        self.state, metrics = self.on_step_end(self.state, metrics, step)
        for h in self.hooks:
            getattr(h, "on_step_end", lambda *_: None)(self, step, metrics)
        return metrics

    def on_step_start(self, state: js.TrainState, step: int) -> js.TrainState:
        """Called before training step `step`; returns the state to train on (override to change it)."""
        return state

    def on_step_end(self, state: js.TrainState, metrics: dict[str, Any], step: int) -> tuple[js.TrainState, dict]:
        """Called after step `step` is dispatched with its (on-device) `metrics`; returns the state and
        metrics to go on with (override to change them). Reading a metric here waits for the step."""
        return state, metrics

    def start_training_hook(self) -> None:
        """Called when `train()` starts, after setup: records the start time (for `training_time_limit`)."""
        self._t0 = time.monotonic()
        self._stop_reason, self._skipped = None, 0
        self._stop_code, self._stop_note, self._signal = 0, "", None
        self._last_eval, self._last_preview = (None, {}), (None, [])

    def start_evaluation_hook(self) -> None:
        """Called when an evaluation starts: records its start time (`evaluation_time` in its metrics)."""
        self._eval_t0 = time.monotonic()

    def _global_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        a = self.arguments
        if self.data_collator is not None:
            local = _collated(self.data_collator, local)
        accum = a.gradient_accumulation_steps
        if jax.process_count() > 1:  # every process's stop request rides with its rows: see request_stop()
            local = {**local, STOP_KEY: np.full((len(next(iter(local.values()))), 1), self._stop_code, np.int32)}
        return {
            k: jax.make_array_from_process_local_data(
                self._batch_sharding,
                v.reshape(accum, -1, v.shape[-1]),
                (accum, a.total_batch_size, v.shape[-1]),
            )
            for k, v in local.items()
        }

    def request_stop(self, reason: str = "stop requested") -> None:
        """Ask training to stop: the step in flight finishes, a checkpoint is saved and `train()` returns
        with `reason` as its `stop_reason`. With several processes, a request made by any one of them
        (here, in a hook or from another thread) stops all of them after the same step: the request
        travels inside the next step's batch and comes back in its metrics. Later requests change nothing."""
        if not self._stop_code:
            self._stop_code, self._stop_note = _STOP_REQUESTED, reason

    def apply_training_hooks(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The built-in checks on a finished step's host `metrics` (with its `step`): a non-finite loss
        raises `NonFiniteLossError` naming the step (`nan_policy="stop"`) or counts a skipped update; the
        wall-clock limit and a stop signal end training after this step. Returns the metrics."""
        step = metrics["step"]
        if not bool(metrics["finite"]):
            if self.arguments.nan_policy == "stop":
                raise NonFiniteLossError(
                    f"loss is {float(metrics['loss'])} (grad norm "
                    f"{float(metrics['grad_norm'])}) at step {step}; stopping. The last "
                    f"checkpoint in {self.checkpoints.directory} is untouched."
                )
            self._skipped += 1
            log.warning("non-finite loss at step %d: update skipped (%d so far)", step, self._skipped)
        limit = self.arguments.training_time_limit
        if limit and not self._stop_code and time.monotonic() - self._t0 >= limit:
            self._stop_code = _STOP_TIME_LIMIT  # each process's own clock: agreed through the batch below
        agreed = int(metrics[STOP_KEY]) if STOP_KEY in metrics else self._stop_code
        if agreed and not self._stop_reason:
            self._stop_reason = {
                _STOP_SIGNAL: "stop signal received",
                _STOP_TIME_LIMIT: f"training_time_limit of {limit} s reached",
                _STOP_REQUESTED: self._stop_note or "stop requested by another process",
            }[agreed]
        return metrics

    def _after_step(self, step: int, metrics: dict[str, Any]) -> None:
        """The host's share of `step`, run once the next step is dispatched: the checks, the metrics row
        every `logging_steps` (and at the last step), the progress bar."""
        a = self.arguments
        self.apply_training_hooks(
            {
                **jax.device_get({k: metrics[k] for k in ("finite", "loss", "grad_norm", STOP_KEY) if k in metrics}),
                "step": step,
            }
        )
        self._window.append(metrics)
        if step % a.logging_steps == 0 or step == self.total_steps:
            host, now = jax.device_get(self._window), time.perf_counter()
            dt = now - self._t_log
            tps = a.training_batch_size * self.row_width * len(host) / dt
            keys = ["loss", *sorted(k for k in host[-1] if k not in _NOT_AVERAGED and k != "loss")]
            row = {k: float(np.mean([m[k] for m in host])) for k in keys}
            if self.step_config.objective.perplexity:
                row["perplexity"] = math.exp(min(row["loss"], 50))
            row.update(
                learning_rate=float(host[-1]["learning_rate"]),
                tokens_seen=step * a.training_batch_size * self.row_width,
                elapsed_time=self._elapsed_base + time.monotonic() - self._t0,  # over every segment of the run
                tokens_per_second=tps,
                step_time=dt / len(host),
                tflops_per_device=self._flops_token * tps / self.mesh.devices.size / 1e12,
                **memory_in_use(),
            )
            if self._peak:
                row["mfu"] = self._flops_token * tps / self.mesh.devices.size / self._peak
            row.update(self.data_metrics())
            self.log_metrics(row, self.pbar, step)
            if a.log_weight_distribution and self.state is not None:
                self.log_weight_distribution(self.state, step)
            self._window, self._t_log = [], now
        self.pbar.update(1)

    def data_metrics(self) -> dict[str, float]:
        """Metrics of the data read so far, added to each log row (a mixture's shares)."""
        return self._mixture_shares()

    def _mixture_shares(self) -> dict[str, float]:
        """With a data mixture: each part's share of the tokens read so far (this process's streams)."""
        loaders = getattr(self.train_loader, "loaders", None) or []
        if not loaders or getattr(loaders[0], "mixture", None) is None:
            return {}
        tokens = np.sum([loader.state_dict()["tokens"] for loader in loaders], axis=0)
        total = float(tokens.sum())
        return {f"data_share_part{i}": float(t) / total for i, t in enumerate(tokens)} if total else {}

    def _metrics_writer(self) -> MetricsWriter:
        a = self.arguments
        self._window, self._t_log = [], time.perf_counter()
        self._flops_token = jmod.flops_per_token(self.config, a.max_sequence_length)  # constants of the run,
        self._peak = peak_flops(override=a.peak_flops_per_device)  # not of each log row
        identity = self._identity()
        config = {**identity["arguments"], **{f"model.{k}": v for k, v in identity["model"].items()}}
        writer = MetricsWriter(
            a.save_directory,
            tensorboard=a.use_tensorboard,
            use_wandb=a.use_wandb,
            wandb_project=a.wandb_project,
            bar=self.pbar,
            start_step=self._step,
            config=config,
            total_steps=self.total_steps,
        )
        # training time of the segments before this one (their rows up to the checkpoint resumed from)
        self._elapsed_base = next(
            (r["train/elapsed_time"] for r in reversed(writer.history) if "train/elapsed_time" in r), 0.0
        )
        return writer

    def _finish(self, step: int, stop_reason: str) -> TrainerOutput:
        a, writer = self.arguments, self.writer
        if self.checkpoints.latest_step() != step:  # save first: the evaluation below can fail
            self._save(step)
        final = {}
        if self.dataset_eval is not None:
            last_step, final = self._last_eval
            if last_step != step:
                final = self._evaluate_and_log(step)
        self.checkpoints.wait_until_finished()
        if any("train/loss" in r for r in writer.history):
            final = _final_metrics(writer.history, final)
        samples = []
        if a.generation_prompts:  # the final sample, unless the last step already made one
            samples = self._last_preview[1] if self._last_preview[0] == step else self.preview(step)
        plot = report = None
        if self.is_process_zero:
            plot = plot_history(writer.history, Path(a.save_directory) / "loss.png")
            report = self.save_information(final=final, stop_reason=stop_reason, samples=samples)
        writer.close()
        log.info("training stopped at step %d: %s", step, stop_reason)
        return TrainerOutput(
            self.state,
            final,
            stop_reason,
            self.resumed_from,
            str(self.checkpoints.directory),
            str(report) if report else None,
            str(plot) if plot else None,
            samples,
            self._signal,
        )

    def _save(self, step: int) -> None:
        self.checkpoints.save(
            step,
            self.state,
            data_state=self.train_loader.global_state_dict(),
            metadata={
                "tokens_seen": step * self.arguments.training_batch_size * self.row_width,
                "arguments": js.to_jsonable(self.arguments.to_dict()),
                "run": self._identity(),
            },
        )
        for h in self.hooks:
            getattr(h, "on_save", lambda *_: None)(self, step)

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum, _frame):
            if self._stop_code:
                log.warning("signal %d again: still saving the final checkpoint; it is not interrupted", signum)
                return
            log.warning("signal %d: finishing this step, saving a checkpoint and stopping", signum)
            self._stop_code, self._signal = _STOP_SIGNAL, signum

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return lambda: [signal.signal(s, h) for s, h in old.items()]

    def _take_starting_point(self, model_parameters: Any, state: js.TrainState | None) -> None:
        """`train(model_parameters=..., state=...)`: what the run starts from (before setup)."""
        if state is None and model_parameters is None:
            return
        if self._initialized:
            raise RuntimeError(
                "train(state=..., model_parameters=...) must come before the trainer is set up "
                "(a previous train() or evaluate() already chose its starting point)"
            )
        if state is not None:
            self._state_in, self._model_in = state, state.model
        else:
            graphdef, _, rest = nnx.split(self._model_in, nnx.Param, ...)  # type: ignore[misc]
            self._state_in, self._model_in = None, nnx.merge(graphdef, model_parameters, rest)
        self.state, self._planned = None, False

    # ---- evaluation -------------------------------------------------------------------------------------
    def evaluate(self, state: js.TrainState | None = None, metric_calculator=None) -> dict[str, float]:
        """Loss, perplexity and accuracy of `state` (default: the trainer's) over up to `eval_batches`
        batches of `dataset_eval`, plus `evaluation_time`. `metric_calculator(state, batch) -> dict` adds
        metrics of its own, averaged over the batches (`batch`: the global on-device batch)."""
        if self.dataset_eval is None:
            raise ValueError("no dataset_eval was given")
        if state is None and self.state is None:
            self.initialize_trainer_utils()
        state = self.state if state is None else self._as_own_state(state)
        if not hasattr(self, "_eval_jit"):
            self._jit_steps()
        self.start_evaluation_hook()
        a = self.arguments
        total: dict[str, float] = {}
        custom: dict[str, list[float]] = {}
        shape = (a.eval_batch_size, self.row_width)
        with jax.set_mesh(self.mesh):
            loader = self._eval_loader()
            assert loader is not None  # dataset_eval was checked above
            for i, local in enumerate(loader):
                if i >= a.eval_batches:
                    break
                batch = self._eval_batch(local, shape)
                out = jax.device_get(self._eval_jit(state, batch))
                total = {k: total.get(k, 0.0) + float(v) for k, v in out.items()}
                for k, v in (metric_calculator(state, batch) if metric_calculator else {}).items():
                    custom.setdefault(k, []).append(float(v))
        objective = self.step_config.objective
        if not total.get(objective.weight):
            raise ValueError(f"dataset_eval gave no {objective.weight} to evaluate")
        loss = total["loss_sum"] / total[objective.weight]
        sums = {k: np.float64(v) for k, v in total.items() if k != "loss_sum"}
        metrics = {k: float(v) for k, v in objective.metrics(sums).items() if k not in (objective.weight, "tokens")}
        return {
            "loss": loss,
            **({"perplexity": math.exp(min(loss, 50))} if objective.perplexity else {}),
            **metrics,
            **{k: float(np.mean(v)) for k, v in custom.items()},
            "evaluation_time": time.monotonic() - self._eval_t0,
        }

    def _eval_batch(self, local: dict[str, np.ndarray], shape: tuple[int, int]) -> dict[str, jax.Array]:
        """This process's rows of an evaluation batch as one global on-device batch of `shape`."""
        return {k: jax.make_array_from_process_local_data(self._eval_sharding, v, shape) for k, v in local.items()}

    def _as_own_state(self, state: js.TrainState) -> js.TrainState:
        """A state from elsewhere (another trainer, a restore) in this run's tree and shardings: its
        parameters in this trainer's state."""
        self._plan()
        if jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(self._abstract_state):
            return state
        own = self.state if self.state is not None else self.configure_model().state
        return own.replace(params=jax.device_put(state.params, self.state_shardings.params))

    def _evaluate_and_log(self, step: int) -> dict[str, float]:
        metrics = self.evaluate()
        self._last_eval = (step, metrics)
        self.log_metrics(metrics, self.pbar, step, mode="eval")
        return metrics

    # ---- logging ----------------------------------------------------------------------------------------
    def create_progress_bar(self, total: int, desc: str = "", disabled: bool = False, initial: int = 0):
        """A progress bar over `total` steps labelled `desc`, starting at `initial` (a no-op object when
        `disabled`, or on any process but 0): `update(n)`, `set_postfix(...)`, `write(line)`, `close()`."""
        return create_progress_bar(total, desc, disabled=disabled or not self.is_process_zero, initial=initial)

    def log_metrics(self, metrics: dict[str, Any], pbar, step: int, mode: str = "train") -> None:
        """Write `metrics` of `step` as `mode/name` to metrics.jsonl, TensorBoard, wandb and the console
        (through `pbar`, whose postfix shows the loss)."""
        self.writer.write(step, metrics, prefix=mode)
        if pbar is not None and "loss" in metrics:
            pbar.set_postfix({f"{mode}_loss": f"{metrics['loss']:.4g}"})

    def log_weight_distribution(self, state: js.TrainState, step: int) -> None:
        """A TensorBoard histogram of every parameter of `state`, labelled `step`."""
        for name, leaf in named_leaves(state.params):
            self.writer.histogram(step, f"weights/{name}", np.asarray(jax.device_get(leaf)))

    # ---- generation -------------------------------------------------------------------------------------
    def maybe_generate(self, state: js.TrainState, step: int, metrics: dict | None = None) -> list[str] | None:
        """A preview from `generation_prompts` with `state` when one is due at `step` (every
        `generation_interval`); returns the samples, or None when none was due. `metrics` is unused."""
        a = self.arguments
        if not (a.generation_interval and a.generation_prompts and step % a.generation_interval == 0):
            return None
        return self.preview(step, state)

    def preview(self, step: int, state: js.TrainState | None = None) -> list[str]:
        """Generate from `generation_prompts` with `state` (default: the current one) and log the samples
        under `step` (also the sampling seed). Every process runs the (sharded) decode; process 0 writes."""
        a = self.arguments
        prompts = [p for p in a.generation_prompts for _ in range(a.generation_num_samples)]
        res = self.generate_unified(
            prompts=prompts,
            state=state,
            max_new_tokens=a.generation_max_new_tokens,
            seed=step,
            do_sample=a.generation_temperature > 0,
            temperature=a.generation_temperature,
        )
        if self.writer is not None:
            self.writer.samples(step, res.decoded_prompts, res.generation_results)
        self._last_preview = (step, res.completion_prompts)
        return res.completion_prompts

    def generate_unified(
        self,
        input_ids=None,
        attention_mask=None,
        prompts=None,
        *,
        state=None,
        use_esurge: bool | None = None,
        apply_chat_template: bool = False,
        generation_config=None,
        shard_inputs: bool | None = None,
        config_overrides: dict | None = None,
        all_gather: bool = False,
        **generate_kwargs,
    ) -> jg.GenerationResults:
        """Generate from `input_ids` (+ `attention_mask`) or text `prompts` (chat messages with
        `apply_chat_template`) with `state`'s model (default: the trained one); `generation_config` (a
        `jaxloom.generation.GenerationConfig` or a transformers one) updated by `config_overrides` and
        `generate_kwargs`. `shard_inputs` (default True) spreads the batch over the mesh. Results are on
        the host of every process, so `all_gather` changes nothing. `use_esurge=True` is an error: there
        is no eSurge engine here."""
        model, config, mesh = self._generation_setup(
            state, use_esurge, generation_config, shard_inputs, config_overrides, generate_kwargs
        )
        del all_gather  # always gathered: the results are numpy arrays on every process
        return jg.generate_unified(
            model,
            self.tokenizer,
            input_ids,
            attention_mask,
            prompts,
            apply_chat_template=apply_chat_template,
            generation_config=config,
            mesh=mesh,
        )

    def generate_aio(
        self,
        input_ids,
        attention_mask=None,
        *,
        state=None,
        generation_config=None,
        shard_inputs: bool | None = None,
        config_overrides: dict | None = None,
        return_metadata: bool = False,
        all_gather: bool = False,
        **generate_kwargs,
    ):
        """`(sequences, completion_ids, completion_mask)` decoded after `input_ids` (+ `attention_mask`)
        with `state`'s model; `generation_config`, `shard_inputs`, `config_overrides`, `all_gather` and
        `generate_kwargs` as in `generate_unified`. With `return_metadata`, also a dict with the
        `generation_config` used and the `prompt_length`."""
        model, config, mesh = self._generation_setup(
            state, None, generation_config, shard_inputs, config_overrides, generate_kwargs
        )
        del all_gather
        out = jg.generate_aio(model, input_ids, attention_mask, generation_config=config, mesh=mesh)
        if return_metadata:
            return out, {"generation_config": config, "prompt_length": int(np.shape(input_ids)[-1])}
        return out

    def create_generate_function(
        self,
        generation_config=None,
        *,
        shard_inputs: bool = True,
        config_overrides: dict | None = None,
        **generate_kwargs,
    ):
        """`fn(state, input_ids, attention_mask) -> (sequences, completion_ids, completion_mask)` decoding
        with `generation_config` updated by `config_overrides` and `generate_kwargs`; with `shard_inputs`
        the prompts are spread over this mesh's batch axes."""
        config = _generation_config(generation_config, self.tokenizer)
        return jg.create_generate_function(
            config,
            shard_inputs=shard_inputs,
            config_overrides={**(config_overrides or {}), **generate_kwargs},
            mesh=self.mesh,
        )

    def _generation_setup(self, state, use_esurge, generation_config, shard_inputs, config_overrides, kwargs):
        if use_esurge:
            raise ValueError(
                "use_esurge=True: jaxloom has no eSurge engine; it decodes with a KV cache (leave use_esurge unset)"
            )
        if state is None:
            self.initialize_trainer_utils()
            state = self.state
        config = _generation_config(generation_config, self.tokenizer).replace(**{**(config_overrides or {}), **kwargs})
        return state.model, config, (self.mesh if shard_inputs is not False else None)

    # ---- data helpers -------------------------------------------------------------------------------------
    def create_collect_function(
        self, max_sequence_length: int, truncation_mode: Literal["keep_end", "keep_start"] = "keep_end"
    ):
        """`collate(examples) -> dict of arrays`: tokenized examples (`{"input_ids": [...], ...}`) truncated
        by `truncation_mode` and right-padded with the tokenizer's pad id to `max_sequence_length`."""
        return jd.create_collect_function(
            max_sequence_length, truncation_mode, pad_token_id=self.tokenizer.pad_token_id or 0
        )

    def create_grain_collect_function(
        self, max_sequence_length: int, truncation_mode: Literal["keep_end", "keep_start"] = "keep_end"
    ):
        """The same collate function as `create_collect_function(max_sequence_length, truncation_mode)`,
        for a grain pipeline's batch map."""
        return self.create_collect_function(max_sequence_length, truncation_mode)

    def create_tfds_collect_function(
        self, max_sequence_length: int, truncation_mode: Literal["keep_end", "keep_start"] = "keep_end"
    ):
        """The same collate function as `create_collect_function(max_sequence_length, truncation_mode)`,
        for TFDS-style batches of examples."""
        return self.create_collect_function(max_sequence_length, truncation_mode)

    def specs_to_name_sharding(self, tree, mesh=None):
        """`tree` with every `PartitionSpec` replaced by a `NamedSharding` on `mesh` (default: the trainer's)."""
        mesh = mesh or self.mesh
        return jax.tree_util.tree_map(
            lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )

    @staticmethod
    def count_model_parameters(prm) -> int:
        """How many numbers `prm` holds (a model, an `nnx.State`, a dict of arrays or shape structs)."""
        if isinstance(prm, nnx.Module):
            prm = nnx.state(prm, nnx.Param)
        return int(sum(math.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(prm)))

    def calculate_number_total_flops(self, params, is_training: bool = True) -> float:
        """FLOPs of one optimizer step (`training_batch_size × max_sequence_length` tokens) of a model
        with `params`: `2·N` per token for the weights (N counted from `params`) plus causal attention
        from the config, tripled when `is_training` (forward and backward)."""
        self._plan()
        a, c = self.arguments, self.config
        attention = 2 * c.num_hidden_layers * a.max_sequence_length * c.num_attention_heads * c.head_dim
        per_token = 2 * self.count_model_parameters(params) + attention
        return per_token * (3 if is_training else 1) * a.training_batch_size * a.max_sequence_length

    # ---- outputs ------------------------------------------------------------------------------------------
    def save_pretrained(
        self,
        state: js.TrainState | str | os.PathLike | None = None,
        save_directory: str | os.PathLike | js.TrainState | None = None,
        gather_fns=None,
        to_torch: bool = False,
        easystate_to_huggingface_model_kwargs: dict | None = None,
        torch_save_pretrained_kwargs: dict | None = None,
        *,
        to_hf: bool | None = None,
    ) -> Path | str:
        """Write `state` (default: the trainer's) to `save_directory`: with `to_torch` (or `to_hf`) a
        Hugging Face directory `transformers` loads (safetensors, config, tokenizer), else an orbax
        checkpoint of the whole state. The protocol's order `save_pretrained(ckpt_path, state)` works too.
        `easystate_to_huggingface_model_kwargs` takes `dtype` (cast the weights on the way out);
        `torch_save_pretrained_kwargs` takes `max_shard_size` (bytes, or "500MB"-style). `gather_fns`
        must be None: sharded arrays are gathered one at a time by the exporter."""
        if isinstance(state, str | os.PathLike):
            state, save_directory = save_directory, state  # type: ignore[assignment]
        if save_directory is None:
            raise ValueError("save_pretrained needs a save_directory")
        if gather_fns is not None:
            raise ValueError("gather_fns is not used by jaxloom: the exporter gathers each sharded array itself")
        to_hf = bool(to_torch) if to_hf is None else to_hf
        convert = dict(easystate_to_huggingface_model_kwargs or {})
        save_kw = dict(torch_save_pretrained_kwargs or {})
        unknown = sorted(set(convert) - {"dtype"}) + sorted(set(save_kw) - {"max_shard_size"})
        if unknown:
            raise ValueError(
                f"save_pretrained: unsupported export option(s) {unknown}; supported: "
                "easystate_to_huggingface_model_kwargs={'dtype'}, "
                "torch_save_pretrained_kwargs={'max_shard_size'}"
            )
        if state is None:
            if self.state is None:  # a restored state (jaxloom convert) needs no loader, compile or lock
                self.initialize_trainer_utils()
            state = self.state
        assert isinstance(state, js.TrainState) and isinstance(save_directory, str | os.PathLike)
        extra = {"max_shard_bytes": _bytes(save_kw["max_shard_size"])} if "max_shard_size" in save_kw else {}
        return js.save_pretrained(
            state,
            os.fspath(save_directory),
            to_hf=to_hf,
            tokenizer=self.tokenizer,
            dtype=convert.get("dtype"),
            generation_config=_hf_generation_fields(state.model.config, self.tokenizer),
            **extra,
        )

    def save_information(
        self,
        output_path: str | Path | None = None,
        *,
        final: dict | None = None,
        stop_reason: str = "not finished",
        samples: list[str] | None = None,
    ) -> Path:
        """A Markdown report of the run at `output_path` (default `save_directory/report.md`): model,
        parameters, mesh, data, steps, tokens seen and wall time over every segment of the run, why it
        stopped (`stop_reason`), `final` metrics, the eval history, the last generated `samples`,
        arguments, and package versions."""
        self._plan()
        path = Path(output_path or self._directory() / "report.md")
        path.parent.mkdir(parents=True, exist_ok=True)
        identity = self._identity()
        data = {"training": _describe_data(identity["train_data"], self.dataset_train)}
        if self.dataset_eval is not None:
            data["evaluation"] = _describe_data(data_identity(self.dataset_eval), self.dataset_eval)
        tmp = path.with_name(f".{path.name}.tmp")
        write_report(
            tmp,
            model=self._model_in,
            n_params=self.n_params,
            mesh=self.mesh,
            arguments=self.arguments,
            final=final or {},
            resumed_from=self.resumed_from,
            stop_reason=stop_reason,
            history=self.writer.history if self.writer is not None else [],
            data=data,
            samples=samples or [],
        )
        os.replace(tmp, path)
        return path


class _Profiler:
    """A JAX profiler trace of steps `first..last` (`profile_steps`) into `directory`."""

    def __init__(self, steps, directory: Path):
        self.steps, self.directory, self.active = steps, directory, False

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0]:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, metrics) -> None:
        if self.active and step == self.steps[1]:
            jax.block_until_ready(metrics)
            self.close()
            log.warning(
                "profiler trace of steps %d-%d in %s (TensorBoard's profile plugin)", *self.steps, self.directory
            )

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def _final_metrics(history: list[dict[str, Any]], evaluation: dict[str, Any]) -> dict[str, Any]:
    """A run's final metrics: its last train row (names without the `train/` prefix), then `evaluation`
    as `eval_*`."""
    last = next((r for r in reversed(history) if "train/loss" in r), {})
    return {
        **{k.split("/", 1)[1]: v for k, v in last.items() if k != "step"},
        **{f"eval_{k}": v for k, v in evaluation.items()},
    }


def _describe_data(identity: Any, data: Any) -> str:
    if isinstance(identity, str):
        return identity
    if isinstance(identity, list):
        return identity[0] + (f" (+{len(identity) - 1} more)" if len(identity) > 1 else "")
    if isinstance(identity, dict) and "records" in identity:
        return f"{identity['records']:,} records in memory"
    return type(data).__name__


def _note_out_of_memory(error: BaseException) -> None:
    """A device out of memory gets a note saying how to see the run's memory and what shrinks it."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        error.add_note(
            "jaxloom: the device ran out of memory. `jaxloom plan CONFIG [key=value ...]` prints the memory per "
            "device without running (parameters, optimizer state, activations, against the device's capacity); "
            "lower total_batch_size or max_sequence_length (raise gradient_accumulation_steps to keep the batch), "
            "set remat (e.g. remat=checkpoint_dots), or shard parameters over more devices (sharding_axis_dims)"
        )


def use_compilation_cache(directory: str | Path) -> None:
    """Keep every program this process compiles from now on in `directory` (JAX's persistent
    compilation cache) and look there before compiling; with several processes JAX writes from one."""
    from jax.experimental.compilation_cache import compilation_cache

    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # small programs too: start-up
    compilation_cache.reset_cache()  # takes effect even if something was compiled before


def _matches(state: js.TrainState, abstract: js.TrainState) -> bool:
    """Whether a given state fits this run's state exactly (same tree, shapes and dtypes): then its
    optimizer state and step are kept; otherwise only its parameters are."""
    try:
        pairs = zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(abstract), strict=True)
        same = jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(abstract)
        return same and all(
            isinstance(x, jax.Array | np.ndarray) and x.shape == y.shape and x.dtype == y.dtype for x, y in pairs
        )
    except (ValueError, AttributeError):
        return False


def _collated(collator, local: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = collator(dict(local))
    bad = {
        k: (np.shape(out.get(k)), np.asarray(v).dtype)
        for k, v in local.items()
        if k not in out or np.shape(out[k]) != v.shape
    }
    if bad or set(out) != set(local):
        raise ValueError(
            f"data_collator must return the batch's keys {sorted(local)} with their shapes "
            f"{ {k: v.shape for k, v in local.items()} }; got {sorted(out)} "
            f"{ {k: np.shape(v) for k, v in out.items()} }"
        )
    return {k: np.asarray(out[k], local[k].dtype) for k in local}


def _generation_config(config, tokenizer) -> jg.GenerationConfig:
    """A `jaxloom.generation.GenerationConfig` from ours, a transformers `GenerationConfig` or None, with
    the tokenizer's EOS and pad ids where the config has none."""
    if config is None:
        config = jg.GenerationConfig()
    elif not isinstance(config, jg.GenerationConfig):  # transformers' GenerationConfig
        fields = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id")
        given = {k: getattr(config, k) for k in fields if getattr(config, k, None) is not None}
        if isinstance(given.get("eos_token_id"), list | tuple):
            given["eos_token_id"] = tuple(given["eos_token_id"])
        config = jg.GenerationConfig(**given)
    if config.eos_token_id is None and tokenizer.eos_token_id is not None:
        config = config.replace(eos_token_id=tokenizer.eos_token_id)
    return config


def _hf_generation_fields(config, tokenizer) -> dict[str, Any]:
    """The special-token ids of an export's `generation_config.json`: the model config's, else the
    tokenizer's; EOS also lists the tokenizer's EOS and its chat template's end-of-turn token, so that
    `transformers`' `generate` stops at the end of a document and of an assistant turn."""
    given = config.eos_token_id
    eos = [*((given,) if isinstance(given, int) else tuple(given or ()))]
    eos += [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    eos += list(jg.end_of_turn_ids(tokenizer))
    eos = list(dict.fromkeys(eos))
    fields = {
        k: getattr(config, k, None) if getattr(config, k, None) is not None else getattr(tokenizer, k, None)
        for k in ("bos_token_id", "pad_token_id")
    }
    return {**fields, "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None}


def _bytes(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    text = str(size).strip().upper()
    for unit, scale in units.items():
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * scale)
    raise ValueError(f"max_shard_size {size!r}; expected bytes or e.g. '500MB', '2GB'")


class Trainer(BaseTrainer):
    """Causal language modelling: pretraining on text, SFT on prompt/completion or chat records (loss
    on completions only). MoE load balancing is weighted by the config's `router_aux_loss_coef`.
    Arguments as `BaseTrainer`'s: `arguments`, `model_state`, `model`, `dataset_train`, `dataset_eval`,
    `data_collator`, `finetune`, `processing_class`, `mesh`, `hooks`, `deprecated_kwargs`."""
