"""`BaseTrainer`: the trainer core, which holds components that own their state and drives them.

The components, each built on first use by its builder in `components.py` (`Parts`: `trainer.parts.wiring()`
lists what was built, in order, and from what):

| attribute | component | owns |
| --- | --- | --- |
| `run_directory` | `RunDirectory` | the lock, an earlier run's fate, run_config.json and the tokenizer copy |
| `plan` | `Plan` | mesh, runtime, optimizer and schedule, the state's shapes and shardings, checks |
| `batches` | `Batches` | train/eval loaders and global batches (the kind's `DataSpec`) |
| `functions` | `StepFunctions` | the jitted train and eval steps |
| `checkpointing` | `Checkpointing` | the checkpoint manager, its cadence, resume |
| `step_log` | `StepLog` | progress bar, metrics rows, TensorBoard, W&B |
| `evaluator` | `Evaluator` | evaluation and its last result |
| `generation` | `Generation` | generate_unified/aio, previews |
| `stop_control` | `StopControl` | signals, time limit, non-finite loss, stop requests |

A trainer kind (SFT here, `DPOTrainer`, `GRPOTrainer`) is an `objective()` and a `data_spec()` (plus any
frozen state it builds in `configure_model()`); the loop (`loop.run_loop`) is the same for all. Constructing a
trainer stores what it was given and nothing else: no file, thread, device query or compilation. The reference
documents' members that are views of the components (`optimizer`, `log_metrics`, `generate_unified`, ...) are
in `surface.py`, mixed in.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import jax
from flax import nnx

import jaxloom.data as jd
import jaxloom.models as jmod
import jaxloom.state as js
from jaxloom.mesh import MeshConfig

from . import components
from .arguments import TrainingArguments
from .batches import DataSpec
from .checkpointing import Checkpointing
from .functions import Compilation, later_memory
from .callbacks import Callback, Callbacks
from .outputs import (
    TrainerConfigureDataloaderOutput,
    TrainerConfigureFunctionOutput,
    TrainerConfigureModelOutput,
    TrainerOutput,
)
from .surface import ReferenceSurface
from .run_directory import RUN_CONFIG, RunDirectory
from .run_state import RunState, run_field
from .runs import default_tokenizer, load_model
from .session import Session
from .step import Objective
from .stopping import NonFiniteLossError

__all__ = ["RUN_CONFIG", "BaseTrainer", "NonFiniteLossError", "Trainer", "use_compilation_cache"]
log = logging.getLogger("jaxloom.trainer")
# rebuilt when the starting point changes
_PLANNED = ("source_model", "plan", "functions", "evaluator", "batches", "run_identity")


def _kind_signature(cls: type) -> inspect.Signature:
    """The constructor's signature as `cls` takes it: the common parameters, then the kind's own keyword inputs
    (`take_inputs`) before `**deprecated_kwargs`."""
    common = list(inspect.signature(BaseTrainer.__init__).parameters.values())[1:]
    own = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for p in inspect.signature(cls.take_inputs).parameters.values()
        if p.name != "self"
    ]
    arguments = common[0].replace(annotation=f"{cls.arguments_class.__name__} | None")
    return inspect.Signature([arguments, *common[1:-1], *own, common[-1]])


class BaseTrainer(ReferenceSurface):
    """Train `model` (an `nnx` model, concrete or abstract from `create_model(lazy=True)`) or a
    `model_state` on `dataset_train` (anything `jaxloom.data.as_source` reads) with `arguments`.
    EasyDeL's signature, in its order:

    - `arguments`: `TrainingArguments` (default: all defaults).
    - `model_state`: a `TrainState` to train (its parameters, and its optimizer state when it matches
      this run's optimizer). A module or a directory given here is taken as `model`.
    - `model`: the model to train, or (TRL's string form) an HF model directory or a jaxloom run directory (its
      newest checkpoint), read when the run needs it; its runtime settings are replaced by the arguments that
      set them (`dtype`, `param_dtype`, `attn_mechanism`, `remat`, ...).
    - `dataset_train`, `dataset_eval`: training data and, optionally, evaluation data.
    - `data_collator`: `fn(batch) -> batch` applied to this process's rows of every training batch
      (numpy arrays `input_ids`, `segment_ids`, `positions`, `loss_mask`) before they go to the device;
      it must keep their keys, shapes and dtypes.
    - `finetune`: True (default) trains the given parameters; False trains the given architecture from
      new parameters drawn from `arguments.seed`.
    - `processing_class`: the tokenizer (default: the model's own when it was read from a directory holding one,
      as TRL takes it; else the bundled one).
    - `mesh`: a `jax.sharding.Mesh` to use instead of the one the arguments describe.
    - `hooks`: objects with optional `on_step_start(run, step)` / `on_step_end(run, step, metrics)` /
      `on_save(run, step)` (after checkpoint `step` is saved or handed to the async writer), each a `Callback`
      (`Callback.of`); `run` is the run's `RunView` (state, arguments, checkpoints, stop request).
    - `deprecated_kwargs`: none are accepted; any name here is an error naming it.

    Subclasses may override `on_step_start(state, step)`, `on_step_end(state, metrics, step)`,
    `start_training_hook()` and `start_evaluation_hook()`; a trainer kind sets `arguments_class` and overrides
    `objective()`, `data_spec()` and `take_inputs()` (see `DPOTrainer`).
    """

    MATCH_BOS = True  # the tokenizer adds BOS exactly when training does (next-token data); DPO keeps its own
    arguments_class: ClassVar[type[TrainingArguments]] = TrainingArguments
    """The arguments this kind takes (`DPOTrainer`: `DPOConfig`); its constructor refuses any other."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__signature__ = _kind_signature(cls)  # help() and IDEs show the kind's own inputs

    def __init__(
        self,
        arguments: TrainingArguments | None = None,
        model_state: js.TrainState | None = None,
        model: nnx.Module | str | os.PathLike | None = None,
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
        own = inspect.signature(self.take_inputs).parameters
        inputs = {k: deprecated_kwargs.pop(k) for k in list(deprecated_kwargs) if k in own}
        if deprecated_kwargs:
            raise TypeError(f"{type(self).__name__}: unknown argument(s) {sorted(deprecated_kwargs)}")
        arguments = self.arguments_class() if arguments is None else arguments
        if not isinstance(arguments, self.arguments_class):
            raise TypeError(
                f"{type(self).__name__} takes a {self.arguments_class.__name__}, got {type(arguments).__name__}"
            )
        if isinstance(model_state, (nnx.Module, str, os.PathLike)) and model is None:
            model, model_state = model_state, None
        model = str(model) if isinstance(model, (str, os.PathLike)) else model  # TRL's form: read when needed
        self._model_source = model if isinstance(model, str) else None
        if dataset_train is None:
            raise ValueError("dataset_train is required")
        if model is None and model_state is None:
            raise ValueError("give a model (concrete or lazy) or a model_state")
        if data_collator is not None and not callable(data_collator):
            raise TypeError(f"data_collator {data_collator!r} is not callable")
        self.run = RunState(arguments)  # the run's mutable state: arguments in force, state, step
        self.dataset_train, self.dataset_eval = dataset_train, dataset_eval
        self.data_collator, self.finetune = data_collator, bool(finetune)
        self.hooks = list(hooks or [])
        self.callbacks: list[Callback] = []
        self.parts = components.Parts.of(type(self))  # the components, built on first use
        self._model_given: nnx.Module | str = model if model is not None else model_state.model  # type: ignore[union-attr]
        self._state_in = model_state
        self._tokenizer = processing_class
        self._tokenizer_matched = False  # set to add BOS as training does: checked once, not on every access
        self._mesh = mesh
        self._pool: ThreadPoolExecutor | None = None
        self._train_fn: Any = None  # the compiled train step (a Compilation while it compiles)
        self._initialized = False
        # The resolved config of a `jaxloom train` run (sections model, data, arguments): written to
        # save_directory/run_config.json at setup, so that eval, generate, convert and plan rebuild the run.
        self.run_config: dict[str, Any] | None = None
        self.take_inputs(**inputs)

    def take_inputs(self) -> None:
        """A kind's own keyword inputs (DPO's `ref_model`), checked and kept: the one constructor passes the
        keyword arguments this method names to it, after storing the common ones. No I/O."""

    # ---- the run's state (`RunState`) and components (built on first use by their builders in components.py) --
    arguments = run_field("arguments", "The arguments in force (`save_directory` filled in once chosen).")
    state = run_field("state", "The `TrainState` being trained, once `configure_model()` has run (else None).")
    current_step = run_field("step", "The step being run.")
    completed_step = run_field("completed", "The newest step known to have run on the device.")
    resumed_from = run_field("resumed_from", "The checkpoint the state was restored from, if any.")
    INPUTS: ClassVar[dict[str, str]] = components.CORE_INPUTS
    BUILDERS: ClassVar[dict[str, Any]] = {
        "source_model": components.source_model,
        "benchmarks": components.benchmarks,
        "run_files": components.run_files,
    }
    plan = components.part(components.plan)
    batches = components.part(components.batches)
    functions = components.part(components.functions)
    run_directory = components.part(components.run_directory)
    checkpointing = components.part(components.checkpointing)
    step_log = components.part(components.step_log)
    evaluator = components.part(components.evaluator)
    generation = components.part(components.generation)
    stop_control = components.part(components.stop_control)
    exporter = components.part(components.exporter)
    run_identity = components.part(components.run_identity)
    run_view = components.part(components.run_view)

    # ---- what the trainer is working on ---------------------------------------------------------------
    @property
    def tokenizer(self):
        """The tokenizer (`processing_class`; the bundled one, loaded on first use), set to add BOS by itself
        exactly when training does (`jaxloom.data.match_bos`): prompts, the run's copy of it and an HF
        export encode text as the model saw it in training."""
        if self._tokenizer is None:
            self._tokenizer = default_tokenizer(self._model_source, self._model_given)
        if isinstance(self._tokenizer, Future):  # loaded in the background during setup
            self._tokenizer = self._tokenizer.result()
        if self.MATCH_BOS and not self._tokenizer_matched:
            self._tokenizer = jd.match_bos(self._tokenizer, jd.DataConfig.add_bos)
            self._tokenizer_matched = True
        return self._tokenizer

    @property
    def _model_in(self) -> nnx.Module:
        """The model given (one given as a directory, read on first use: an HF model directory with the arguments'
        layout, or a run directory's newest checkpoint)."""
        if isinstance(self._model_given, str):
            runtime = self.arguments.runtime.apply(jmod.RuntimeConfig())
            self._model_given = load_model(self._model_given, runtime)
        return self._model_given

    @_model_in.setter
    def _model_in(self, model: nnx.Module) -> None:
        self._model_given = model

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

    @property
    def model_state(self) -> js.TrainState:
        """The `TrainState` being trained: built (restored, or created on its shards) on first access."""
        return self.state if self.state is not None else self.configure_model().state

    @property
    def model(self):
        """The model: the trained state's once `configure_model()` has run, else the one given."""
        return self.state.model if self.state is not None else self._model_in

    # ---- what a trainer kind supplies (public extension points; see DPOTrainer) --------------------------
    def objective(self) -> Objective:
        """What the steps minimise and log: next-token cross entropy over the loss-masked tokens."""
        return Objective()

    def data_spec(self) -> DataSpec:
        """What this trainer reads and feeds its step: next-token rows of `max_sequence_length` tokens."""
        return DataSpec.tokens(self.arguments)

    def data_metrics(self, step: int | None = None) -> dict[str, float]:
        """Metrics of the data read so far, added to the log row of `step`: a mixture's shares, the bad
        records skipped so far (with `skip_bad_records`), and the records longer than a row with the tokens cut
        off them (once there is one: `truncated_records`, `truncated_tokens`)."""
        del step
        out = self.batches.mixture_shares()
        if self.arguments.skip_bad_records:
            out["skipped_records"] = float(self.batches.skipped_records())
        records, tokens = self.batches.truncated_records()
        if records:
            out["truncated_records"], out["truncated_tokens"] = float(records), float(tokens)
        return out

    @property
    def row_width(self) -> int:
        """Token columns of one batch row (`data_spec().row_width`)."""
        return self.batches.spec.row_width

    def data_shards(self) -> int:
        """How many ways the batch rows are split over the mesh (the data-parallel size)."""
        return self.batches.data_shards()

    # ---- builders (EasyDeL's) --------------------------------------------------------------------------
    def configure_model(self) -> TrainerConfigureModelOutput:
        """The state this run trains, on its shards: restored from the newest checkpoint of
        `save_directory` (`resume_if_possible`), else from the given state or model, else new from
        `seed`. Also builds the mesh, the optimizer and schedule (`optimizer`, `scheduler`)."""
        plan = self.plan
        if self.state is None:
            self.state = self._restore() if self._resume_step() is not None else self._initial_state()
        return TrainerConfigureModelOutput(
            model=self.state.model, state=self.state, tx=plan.tx, scheduler=plan.schedule, config=plan.config
        )

    def configure_dataloaders(self) -> TrainerConfigureDataloaderOutput:
        """This process's training loader, started at the restored data position (so call it after
        `configure_model()` when resuming), and a fresh evaluation loader."""
        plan, data = self.plan, self.batches
        if data.train is None:
            data.check_vocab(plan.config.vocab_size)
            self.generation.check_prompts(plan.config.max_position_embeddings)
            data.check_train_data()
            data.check_eval_data()
            data.train_loader()  # at the data position a restored checkpoint handed over (`Checkpointing.restore`)
        evaluation = self.arguments.eval_batches if self.dataset_eval is not None else None
        return TrainerConfigureDataloaderOutput(data.train, data.eval_loader(), plan.total_steps, evaluation)

    def configure_functions(self) -> TrainerConfigureFunctionOutput:
        """The train and eval steps jitted with explicit shardings and donation; the train step starts
        compiling for the exact shapes in the background."""
        fns = self.functions
        later = later_memory(self.arguments, self.plan, has_eval=self.dataset_eval is not None)
        self._train_fn = Compilation(self._setup_pool(), self.lower_train_step, **later)
        return TrainerConfigureFunctionOutput(fns.train, fns.evaluate, self.mesh, self.checkpoints)

    def initialize_trainer_utils(self) -> None:
        """Run the builders once, ordered so that the slow parts overlap: the tokenizer loads and the
        train step compiles in the background while the state is restored or created; a new run starts
        its loader (tokenizing) before creating the state, a resumed one after restoring its position.
        Process-wide settings (the compilation cache) are applied here, at the start of a run."""
        if self._initialized:
            return
        if self.run_directory.take(is_process_zero=self.is_process_zero) and self.parts.built("checkpointing"):
            self.checkpointing.manager.reload()
        if self.arguments.compilation_cache_dir:
            use_compilation_cache(self.arguments.compilation_cache_dir)
        pool = self._setup_pool()
        if self._tokenizer is None:
            self._tokenizer = pool.submit(default_tokenizer, self._model_source, self._model_given)
        if self._train_fn is None:
            self.configure_functions()
        if self.state is None and self._resume_step() is not None:
            self.checkpointing.check_resume(self.run_directory.location, self.run_identity)
            self.configure_model()
            self.configure_dataloaders()
        else:
            self.configure_dataloaders()
            self.configure_model()
        if self.is_process_zero:  # what rebuilds the run from its directory, once the run is known to be valid
            self.run_directory.write_run_files(self.run_config, self.tokenizer)
        self._initialized = True

    def restore_checkpoint(self, *, params_only: bool = False, step: int | None = None) -> js.TrainState:
        """The newest checkpoint of `save_directory` (or checkpoint `step`) as this trainer's state, with nothing
        else set up (no loader, no compile): for commands that only read a run (`eval`, `generate`, `convert`).
        `params_only` leaves the optimizer state abstract. FileNotFoundError when there is none (or no `step`:
        the error lists the steps there are)."""
        if RunDirectory(self.arguments.checkpoint).location is None:
            raise FileNotFoundError("save_directory is not set: there is no run to restore a checkpoint from")
        # a reader never changes the run (it may be training): not the run's own manager, which cleans up
        reader = Checkpointing(self.arguments.checkpoint, self.run_directory.checkpoints, read_only=True)
        try:
            restored = reader.restore(self.plan.target(), params_only=params_only, step=step)
        finally:
            reader.close()
        self.resumed_from = reader.read_from
        self.state = self._with_base(restored, self.resumed_from)
        return self.state

    def _setup_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxloom-setup")
        return self._pool

    def _resume_step(self) -> int | None:
        return None if self.checkpoints is None else self.checkpointing.resume_step()

    def _restore(self) -> js.TrainState:
        restored = self.checkpointing.restore(self.plan.target())
        self.resumed_from = self.checkpointing.read_from
        restored = dataclasses.replace(restored, state=self._with_base(restored, self.resumed_from))
        # a warning: a Python user who configured no logging still sees that the run continued an earlier one
        log.warning("resumed from checkpoint %s (step %d)", self.resumed_from, restored.step)
        log.debug("data position at step %d: %s", restored.step, restored.data_state)
        return restored.state

    def _with_base(self, restored: js.Restored, where: str) -> js.TrainState:
        """A restored state completed by the plan (a LoRA run's base; see `restored_with_base`)."""
        state, digest = restored_with_base(self.plan, restored, where)
        if digest is not None:
            self._base_digest = digest
        return state

    @functools.cached_property
    def _base_digest(self) -> str | None:
        """The digest of a LoRA run's frozen base (recorded with each checkpoint), else None."""
        return None if self.plan.lora is None else base_digest(self.state)  # type: ignore[arg-type]

    def _initial_state(self) -> js.TrainState:
        if self.arguments.resume_if_possible and self.checkpoints is not None:
            log.info(
                "resume_if_possible: no complete checkpoint in %s; starting from scratch", self.checkpoints.directory
            )
        return self.plan.initial_state(after=getattr(self._train_fn, "traced", None))

    # ---- compiling ------------------------------------------------------------------------------------
    def lower_train_step(self):
        """The train step lowered for the run's exact shapes and shardings (`jax.stages.Lowered`:
        `.as_text()` is the program before XLA's optimisations, `.compile()` the executable)."""
        return self.functions.lower(self.arguments.total_batch_size)

    def compile_aot(self) -> bool:
        """Compile the train step for the run's exact shapes and shardings now, before the first batch
        (the loop uses this executable). Returns True when it compiled it, False when it already was."""
        if self._train_fn is None:
            self.configure_functions()
        if isinstance(self._train_fn, Compilation):
            self._train_fn = self._train_fn.result()
            return True
        return False

    def compiled_train_step(self):
        """The AOT-compiled train step (compiling it if needed): `memory_analysis()`, `cost_analysis()`."""
        self.compile_aot()
        return self._train_fn

    # ---- callbacks --------------------------------------------------------------------------------------
    def add_callback(self, fn, *, every: int | None = None, when=None, name: str = "") -> Callback:
        """Run `fn(run, step)` after every `every`-th step (and/or whenever `when(step)` is true), on that step's
        state (`run` is the run's `RunView`: `run.state`, `run.checkpoints`, `run.request_stop()`, ...); `name`
        labels it. Returns the `Callback`."""
        cb = Callback(fn, every=every, when=when, name=name)
        self.callbacks.append(cb)
        return cb

    def all_callbacks(self) -> Callbacks:
        """Every callback in the order they run: checkpoint first (saved before anything that can fail runs
        on the step), evaluation and preview on their cadence, the trainer's own hooks, `hooks`, then
        `callbacks` added with `add_callback`."""
        return self.parts.call(components.callbacks, self)

    def save_checkpoint(self, step: int) -> None:
        """Save the current state as checkpoint `step` (with the data position and the run's metadata: see
        `Checkpointing`), then tell the callbacks (`on_save`)."""
        self.checkpointing.save(step, self.state)  # type: ignore[arg-type]
        self.all_callbacks().saved(self.run_view, step)

    # ---- the loop --------------------------------------------------------------------------------------
    def train(self, model_parameters: Any = None, state: js.TrainState | None = None) -> TrainerOutput:
        """Run until `max_training_steps` (or the epochs, a time limit, a stop signal or the end of the
        data); log, evaluate, preview, checkpoint on their cadence. Start from `state` (a `TrainState`;
        its optimizer state is kept when it fits this run's optimizer) or `model_parameters` (the model's
        `nnx.Param` state) when given, else from what the trainer was given; a checkpoint in
        `save_directory` wins when `resume_if_possible`. Returns a `TrainerOutput` (`.state` is the final
        state)."""
        self._take_starting_point(model_parameters, state)
        return self.parts.call(Session, self).train()

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
        self.state = None
        self.parts.forget(_PLANNED)

    # ---- evaluation -------------------------------------------------------------------------------------
    no_evaluation = "expected held-out records: dataset_eval= (data.eval=FILE on the command line)"
    """What the error of `evaluate()` without evaluation data says to do (a kind without an evaluation pass says so)."""

    def evaluate(self, state: js.TrainState | None = None, metric_calculator=None) -> dict[str, float]:
        """Loss, perplexity and accuracy of `state` (default: the trainer's) over up to `eval_batches`
        batches of `dataset_eval`, plus `evaluation_time`. `metric_calculator(state, batch) -> dict` adds
        metrics of its own, averaged over the batches (`batch`: the global on-device batch)."""
        if self.dataset_eval is None:
            raise ValueError(f"no dataset_eval was given; {self.no_evaluation}")
        if state is None and self.state is None:
            self.initialize_trainer_utils()
        state = self.state if state is None else self.plan.as_own(state, lambda: self.model_state)
        self.start_evaluation_hook()
        return self.evaluator.run(state, metric_calculator, started=getattr(self.evaluator, "started", None))

    def _evaluate_and_log(self, step: int) -> dict[str, float]:
        metrics = self.evaluate()
        self.evaluator.last = (step, metrics)
        self.log_metrics(metrics, self.pbar, step, mode="eval")
        return metrics


class Trainer(BaseTrainer):
    """Causal language modelling: pretraining on text, SFT on prompt/completion or chat records (loss
    on completions only). MoE load balancing is weighted by the config's `router_aux_loss_coef`.
    Arguments as `BaseTrainer`'s: `arguments`, `model_state`, `model`, `dataset_train`, `dataset_eval`,
    `data_collator`, `finetune`, `processing_class`, `mesh`, `hooks`, `deprecated_kwargs`."""


def restored_with_base(plan: Any, restored: js.Restored, where: str) -> tuple[js.TrainState, str | None]:
    """`(state, base digest)`: a restored LoRA state with its frozen base built from its source by `plan`
    (checkpoints hold the adapters alone), refused when the checkpoint at `where` was trained on another
    base (its recorded digest differs); other states as they are, with None."""
    state = plan.complete(restored.state)
    if plan.lora is None:
        return state, None
    recorded = (restored.metadata or {}).get("lora_base")
    mine = base_digest(state)
    if recorded is not None and recorded != mine:
        raise ValueError(
            f"checkpoint {where} holds adapters trained on another base model (base digest {recorded}; the base "
            f"given now has {mine}): resume with the base the adapters were trained on (model.from_pretrained), "
            "or start a new run (another save_directory)"
        )
    return state, mine


def base_digest(state: js.TrainState) -> str:
    """A digest of `state`'s frozen weights (a LoRA run's base), the same on any mesh and process count: the
    identity of the base its adapters belong to. Every process calls this together."""
    import hashlib
    import json

    from jaxloom.mesh import named_leaves
    from jaxloom.state import integrity

    found = integrity.digests(dict(named_leaves(state.frozen)))
    return hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()[:16]


def use_compilation_cache(directory: str | Path) -> None:
    """Keep every program this process compiles from now on in `directory` (JAX's persistent
    compilation cache) and look there before compiling; with several processes JAX writes from one."""
    from jax.experimental.compilation_cache import compilation_cache

    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # small programs too: start-up
    compilation_cache.reset_cache()  # takes effect even if something was compiled before
