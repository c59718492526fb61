"""The reference documents' trainer surface (EasyDeL's `BaseTrainer` names), layered on jaxloom's trainer core.

`BaseTrainer` (`trainer.py`) is the core: the components it holds (`Parts`), the run's state, the loop's entry
points and a trainer kind's extension points. Everything here is the documented surface a user of the reference
reaches for under its documented name, each member a view of a component or of the core: forwarding members
(`log_metrics` is the `step_log` component's, `configure_model` the `setup` component's), read-only properties
(`optimizer` is the plan's `tx`), aliases (`processing_class` for `tokenizer`), the overridable hooks, and `finish`.
It holds no state of its own: every attribute it reads lives in a component or in the core.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import jax
from jax.sharding import NamedSharding, PartitionSpec

import jaxloom.data as jd
import jaxloom.state as js

import jaxloom.models as jmod

from ..components import forward
from ..plan import data_axes
from ..run_directory import RUN_OUTPUTS, RunDirectory

__all__ = ["ReferenceSurface"]


class _Finish:
    """`finish` as the reference has it, a static method (`BaseTrainer.finish()` ends the wandb run if one
    is active), which called on a trainer also releases that trainer's threads and checkpoint writer."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return _finish_logging
        return obj._release_and_finish


def _finish_logging() -> None:
    try:
        import wandb
    except ImportError:
        return
    if getattr(wandb, "run", None) is not None:
        wandb.finish()


class ReferenceSurface:
    """EasyDeL's documented trainer members that are views of jaxloom's components (see the module docstring);
    mixed into `BaseTrainer`."""

    finish = _Finish()
    RUN_OUTPUTS = RUN_OUTPUTS

    def _release_and_finish(self) -> None:
        """Release what this trainer opened (only the components it built), then end the wandb run."""
        parts = self.parts
        if parts.built("run_directory"):
            self.run_directory.release()
        if parts.built("checkpointing"):
            self.checkpointing.close()
        if parts.built("batches"):
            self.batches.close()
        if parts.built("setup"):
            self.setup.close()
        _finish_logging()

    # ---- setting up (EasyDeL's names: the `setup` component's) --------------------------------------------
    configure_model = forward("setup")
    configure_dataloaders = forward("setup")
    configure_functions = forward("setup")
    initialize_trainer_utils = forward("setup")
    compile_aot = forward("setup")
    lower_train_step = forward("setup")
    compiled_train_step = forward("setup")
    restore_checkpoint = forward("setup")

    # ---- read-only views ---------------------------------------------------------------------------------
    @property
    def runtime(self) -> jmod.RuntimeConfig:
        """The model's `RuntimeConfig` with the arguments that set runtime fields applied."""
        return self.arguments.runtime.apply(self._model_in.runtime)

    row_width = property(lambda self: self.batches.spec.row_width, doc="Token columns of one batch row.")
    run_identity = property(
        lambda self: self.parts.get("run_identity", self),
        doc="What this run is (arguments, model config, tokenizer, training data), recorded in every checkpoint.",
    )
    run_view = property(lambda self: self.parts.get("run_view", self), doc="What callbacks see of the run.")

    def data_shards(self) -> int:
        """How many ways the batch rows are split over the mesh (the data-parallel size)."""
        return self.batches.data_shards()

    processing_class = property(lambda self: self.tokenizer, doc="The tokenizer (the reference's name).")
    _model_state = property(lambda self: self.model_state, doc="The `TrainState` being trained.")
    dtype = property(lambda self: self.runtime.dtype, doc="Computation dtype (the arguments', else the model's).")
    param_dtype = property(
        lambda self: self.runtime.param_dtype, doc="Parameter dtype (the arguments', else the model's)."
    )
    optimizer = property(lambda self: self.plan.tx, doc="The optax optimizer of the run.")
    tx = optimizer
    scheduler = property(lambda self: self.plan.schedule, doc="The learning-rate schedule of the run.")
    schedule = scheduler
    config = property(lambda self: self.plan.config, doc="The model's config.")
    model_class = property(lambda self: self.plan.model_class, doc="The model's class.")
    n_params = property(lambda self: self.plan.n_params, doc="Parameters of the model.")
    total_steps = property(lambda self: self.plan.total_steps, doc="Optimizer steps of the run.")
    state_shardings = property(lambda self: self.plan.shardings, doc="The state's shardings.")
    step_config = property(lambda self: self.functions.config, doc="The steps' static `StepConfig`.")
    data_axes = property(lambda self: data_axes(self.runtime, self.mesh), doc="Mesh axes the batch rows split over.")
    train_loader = property(lambda self: self.batches.train, doc="This process's training loader (once set up).")
    writer = property(lambda self: self.step_log.writer, doc="The run's `MetricsWriter` (once training started).")
    pbar = property(lambda self: self.step_log.pbar, doc="The progress bar (once training started).")
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
    def checkpoints(self) -> js.CheckpointManager | None:
        """The run's `jaxloom.state.CheckpointManager` (None while the run has no save_directory)."""
        return None if RunDirectory(self.arguments.checkpoint).location is None else self.checkpointing.manager

    checkpoint_manager = checkpoints

    # ---- hooks (EasyDeL's names; the loop calls them through `trainer_hooks()`) --------------------------
    def on_step_start(self, state: js.TrainState, step: int) -> js.TrainState:
        """Called before training step `step`; returns the state to train on (override to change it)."""
        return state

    def on_step_end(self, state: js.TrainState, metrics: dict[str, Any], step: int) -> tuple[js.TrainState, dict]:
        """Called after step `step` is dispatched with its (on-device) `metrics`; returns the state and
        metrics to go on with (override to change them). Reading a metric here waits for the step."""
        return state, metrics

    def start_training_hook(self) -> None:
        """Called when `train()` starts, after setup: starts the clock of `training_time_limit` and clears
        any earlier stop request."""
        self.stop_control.start()

    def start_evaluation_hook(self) -> None:
        """Called when an evaluation starts: records its start time (`evaluation_time` in its metrics)."""
        self.evaluator.started = time.monotonic()

    request_stop = forward("stop_control")
    apply_training_hooks = forward("stop_control")

    # ---- logging (EasyDeL's names, with their signatures: the `step_log` component's) -----------------
    create_progress_bar = forward("step_log")
    log_metrics = forward("step_log")
    log_weight_distribution = forward("step_log")

    # ---- generation (EasyDeL's names, with their signatures: the `generation` component's) --------------
    maybe_generate = forward("generation")
    preview = forward("generation")
    generate_unified = forward("generation")
    generate_aio = forward("generation")
    create_generate_function = forward("generation")

    # ---- collate functions (EasyDeL's) ---------------------------------------------------------------------
    def create_collect_function(
        self, max_sequence_length: int, truncation_mode: Literal["keep_end", "keep_start"] = "keep_end"
    ):
        """`collate(examples) -> dict of arrays`: tokenized examples (`{"input_ids": [...], ...}`) truncated
        by `truncation_mode` and right-padded with the tokenizer's pad id to `max_sequence_length`."""
        pad = self.tokenizer.pad_token_id or 0
        return jd.create_collect_function(max_sequence_length, truncation_mode, pad_token_id=pad)

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

    count_model_parameters = forward("plan")  # a static method: no plan is built for it
    calculate_number_total_flops = forward("plan")

    # ---- outputs (EasyDeL's names, with their signatures: the `exporter` component's) --------------------
    save_pretrained = forward("exporter")
    save_information = forward("exporter")
