"""`BaseTrainer`: the trainer core, which holds components that own their state and drives them.

The components, each built on first use by its builder (`components.py`), a function whose keyword parameters name
the collaborators it is built from — never the trainer (`Parts`: `trainer.parts.wiring()` lists what was built, in
order, and from what):

| attribute | component | owns |
| --- | --- | --- |
| `run_directory` | `RunDirectory` | the lock, an earlier run's fate, run_config.json and the tokenizer copy |
| `plan` | `Plan` | mesh, runtime, optimizer and schedule, the state's shapes and shardings, checks |
| `batches` | `Batches` | train/eval loaders and global batches (the kind's `DataSpec`) |
| `functions` | `StepFunctions` | the jitted train and eval steps |
| `setup` | `Setup` | the state restored or created, the loaders started, the train step compiled; once |
| `checkpointing` | `Checkpointing` | the checkpoint manager, its cadence, resume |
| `step_log` | `StepLog` | progress bar, metrics rows, TensorBoard, W&B |
| `evaluator` | `Evaluator` | evaluation and its last result |
| `generation` | `Generation` | generate_unified/aio, previews |
| `stop_control` | `StopControl` | signals, time limit, non-finite loss, stop requests |
| `exporter` | `Exporter` | save_pretrained, save_information |

The run's mutable state (arguments in force, the state, the step) is one `RunState` (`trainer.run`), which the
loop (`loop.run_loop`) and the session (`session.Session`, what `train()` runs) write. A trainer kind (SFT here,
`DPOTrainer`, `GRPOTrainer`) is an `objective()`, a `data_spec()`, its own inputs (`take_inputs()`) and its work
before step 1 (`prepare()`: a reference, a teacher); shared pieces of several kinds are mixins with homes of their
own (`grpo.kind`), never another kind. Constructing a trainer stores what it was given and nothing else: no file,
thread, device query or compilation. EasyDeL's documented members (`configure_model`, `optimizer`, `log_metrics`,
`generate_unified`, ...) are views of the components in the compatibility layer (`compat.surface`), mixed in.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, ClassVar

from flax import nnx

import jaxloom.data as jd
import jaxloom.models as jmod
import jaxloom.state as js
from jaxloom.mesh import MeshConfig

from . import components
from .arguments import TrainingArguments
from .batches import DataSpec
from .callbacks import Callback, Callbacks
from .outputs import (
    TrainerOutput,
)
from .compat.surface import ReferenceSurface
from .run_directory import RUN_CONFIG
from .run_state import RunState, run_field
from .runs import load_model
from .setup import Setup, TokenizerSlot, use_compilation_cache
from .session import Session
from .step import Objective
from .stopping import NonFiniteLossError

__all__ = ["RUN_CONFIG", "BaseTrainer", "NonFiniteLossError", "Trainer", "use_compilation_cache"]
log = logging.getLogger("jaxloom.trainer")
# rebuilt when the starting point changes
_PLANNED = ("source_model", "plan", "functions", "evaluator", "batches", "run_identity", "setup")


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
    `objective()`, `data_spec()`, `take_inputs()` and `prepare()` (see `DPOTrainer`).
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
        # a transformers processor (TRL's `processing_class` for a vision-language model): its tokenizer is the run's
        self._processor = processing_class if hasattr(processing_class, "image_processor") else None
        if self._processor is not None:
            processing_class = processing_class.tokenizer
        self._tokenizer = TokenizerSlot(
            processing_class, lambda: (self._model_source, self._model_given), self.MATCH_BOS
        )
        self._mesh = mesh
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
        "run_identity": components.run_identity,
        "run_view": components.run_view,
    }
    WIDTH_PER_STEP: ClassVar[bool] = False
    """Whether this kind's rows are as wide as each step's data (rollouts): its train step is compiled per width
    when first met, not ahead (`Setup`)."""
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
    setup = components.part(Setup)

    # ---- what the trainer is working on ---------------------------------------------------------------
    @property
    def tokenizer(self):
        """The tokenizer (`processing_class`; else the model's own or the bundled one, loaded on first use), set to
        add BOS by itself exactly when training does (`jaxloom.data.match_bos`): prompts, the run's copy of it and
        an HF export encode text as the model saw it in training."""
        return self._tokenizer.get()

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
    def model_state(self) -> js.TrainState:
        """The `TrainState` being trained: built (restored, or created on its shards) on first access."""
        return self.setup.model_state()

    @property
    def model(self):
        """The model: the trained state's once the state exists, else the one given."""
        return self.state.model if self.state is not None else self._model_in

    # ---- what a trainer kind supplies (public extension points; see DPOTrainer) --------------------------
    def objective(self) -> Objective:
        """What the steps minimise and log: next-token cross entropy over the loss-masked tokens."""
        return Objective()

    def data_spec(self) -> DataSpec:
        """What this trainer reads and feeds its step: next-token rows of `max_sequence_length` tokens; for a
        vision-language model (one with an `image_shape`: Gemma 3), TRL's image records, one a row with its images
        (`DataSpec.with_images`, `max_images_per_row` of them at most)."""
        return self.with_images(DataSpec.tokens(self.arguments))

    def with_images(self, spec: DataSpec) -> DataSpec:
        """`spec` for this run's model: TRL's image records (`DataSpec.with_images`) when it reads images (an
        `image_shape`: Gemma 3), read by `image_processor()`, which the run's directory and exports then keep;
        else `spec` as it is."""
        model = self._model_in
        if not hasattr(model, "image_shape"):
            return spec
        self._tokenizer.processor = self.image_processor
        return spec.with_images(model, self.arguments.max_images_per_row, self.image_processor)

    def image_processor(self) -> Any:
        """transformers' processor of a vision-language model's rows: the one given (`processing_class`), else the
        model directory's own (`jaxloom.data.load_model_processor`), its tokenizer the run's."""
        if self._processor is None:
            source = self._model_source or jmod.pretrained_source(self._model_in)
            if source is None:
                raise ValueError(
                    f"{type(self._model_in).__name__} reads images, and no processor was given (processing_class) "
                    "nor is the model read from a directory holding one; expected transformers' AutoProcessor"
                )
            try:
                self._processor = jd.load_model_processor(source)
            except ValueError as e:
                raise ValueError(
                    f"{type(self._model_in).__name__} reads images, so its rows are read through its processor: {e}; "
                    "or give processing_class=transformers.AutoProcessor.from_pretrained(...)"
                ) from None
        self._processor.tokenizer = self.tokenizer
        return self._processor

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

    def prepare(self) -> None:
        """This kind's own work once the state exists, before step 1 (a frozen reference, a teacher, its checks);
        called by setup after the state is restored or created. Nothing for next-token training."""

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
        if self.parts.built("setup") and self.setup.done:
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
            self.setup.initialize_trainer_utils()
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
