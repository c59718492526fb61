"""`BaseTrainer`: the loop. Model, data, checkpoints and logging come from their packages; this file
wires them around one jitted step."""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import Future, ThreadPoolExecutor
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jaxloom.data as jd
import jaxloom.generation as jg
import jaxloom.models as jmod
import jaxloom.state as js
from jaxloom.mesh import DATA_AXES, MeshConfig, named_leaves

from .arguments import TrainingArguments
from .metrics import MetricsWriter, memory_in_use, peak_flops
from .optim import make_optimizer
from .report import plot_history, write_report
from .step import StepConfig, eval_step, train_step

log = logging.getLogger("jaxloom.trainer")


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN or infinite loss or gradient (with `nan_policy="stop"`)."""


@dataclasses.dataclass
class TrainerOutput:
    """What `train()` returns: the final `state` and `metrics`, why it stopped (`stop_reason`), the
    checkpoint it resumed from (`resumed_from`), where checkpoints, report and plot are
    (`checkpoint_dir`, `report_path`, `plot_path`) and the last preview `samples`."""

    state: js.TrainState
    metrics: dict[str, float]
    stop_reason: str
    resumed_from: str | None
    checkpoint_dir: str | None
    report_path: str | None
    plot_path: str | None
    samples: list[str] = dataclasses.field(default_factory=list)


class BaseTrainer:
    """Train `model` (an `nnx` model, concrete or abstract from `create_model(lazy=True)`) or a
    `model_state` on `dataset_train` (anything `jaxloom.data.as_source` reads) with `arguments`.

    Hooks: objects with optional `on_step_start(trainer, step)` / `on_step_end(trainer, step, metrics)`.

    Arguments, grouped:

    - `arguments`: `TrainingArguments` (default: all defaults).
    - `model`, `model_state`: what to train (one of them).
    - `dataset_train`, `dataset_eval`: training data and, optionally, evaluation data.
    - `processing_class`: the tokenizer (default: the bundled one).
    - `mesh`: a `jax.sharding.Mesh` to use instead of the one the arguments describe.
    - `hooks`: objects called at every step, as above.
    """

    def __init__(self, arguments: TrainingArguments | None = None, model: nnx.Module | None = None, *,
                 model_state: js.TrainState | None = None, dataset_train: Any = None, dataset_eval: Any = None,
                 processing_class: Any = None, mesh=None, hooks: list | None = None):
        self.arguments = arguments or TrainingArguments()
        if dataset_train is None:
            raise ValueError("dataset_train is required")
        if model is None and model_state is None:
            raise ValueError("give a model (concrete or lazy) or a model_state")
        self.dataset_train, self.dataset_eval = dataset_train, dataset_eval
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxloom-setup")
        self._tokenizer = processing_class if processing_class is not None else self._pool.submit(jd.load_processor)
        self._pool.submit(js.CheckpointManager.prepare)
        self.hooks = list(hooks or [])
        self._model_in = model if model is not None else model_state.model
        self._state_in = model_state
        self._mesh = mesh
        self.resumed_from: str | None = None
        self._stop_requested = False
        self.train_loader = None
        if self.arguments.compilation_cache_dir:
            use_compilation_cache(self.arguments.compilation_cache_dir)
        self.configure_model()
        if self.train_loader is None:  # resumed: the loader starts at the restored data position
            self.configure_dataloaders()

    @property
    def tokenizer(self):
        if isinstance(self._tokenizer, Future):  # loaded in the background during setup
            self._tokenizer = self._tokenizer.result()
        return self._tokenizer

    # ---- protocol properties -------------------------------------------------------------------------
    mesh = property(lambda self: self._mesh)
    model_state = property(lambda self: self.state)
    model = property(lambda self: self.state.model)
    optimizer = property(lambda self: self.tx)
    scheduler = property(lambda self: self.schedule)
    dtype = property(lambda self: self.runtime.dtype)
    param_dtype = property(lambda self: self.runtime.param_dtype)
    is_process_zero = property(lambda self: jax.process_index() == 0)
    process_zero_is_admin = property(lambda self: jax.process_index() == 0)

    # ---- setup ----------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Build the mesh, optimizer, schedule and state shardings; start compiling the step; restore the
        newest checkpoint (`resume_if_possible`) or start the loader and create the state on its shards."""
        a = self.arguments
        if self._mesh is None:
            self._mesh = MeshConfig(a.sharding_axis_dims, a.sharding_axis_names, a.sharding_dcn_axis_dims).build()
        template = self._model_in
        self.config, self.runtime, self.model_class = template.config, template.runtime, type(template)
        self._check_attention()
        self.total_steps = a.max_training_steps or self._steps_for_epochs()
        self.tx, self.schedule = make_optimizer(a.optim, self.total_steps)
        self.n_params = jmod.count_params(template)
        abstract_model = jmod.create_model(self.config, self.runtime, lazy=True, model_class=self.model_class)
        build = self._state_builder(template)
        self._abstract_state = jax.eval_shape(build[0], *build[1])
        self.state_shardings = js.state_shardings(
            self._abstract_state, jmod.param_shardings(abstract_model, self._mesh), self._mesh)
        self._batch_sharding, self._eval_sharding = self._batch_shardings()
        self.configure_functions()  # starts compiling the train step in the background
        ckpt_dir = Path(a.save_directory) / "checkpoints"
        self.checkpoints = js.CheckpointManager(js.CheckpointConfig(
            directory=str(ckpt_dir), save_steps=a.save_steps, save_minutes=a.save_minutes,
            save_total_limit=a.save_total_limit, async_save=a.async_checkpointing))
        self._data_state = None
        if a.resume_if_possible and self.checkpoints.latest_step() is not None:
            target = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                            self._abstract_state, self.state_shardings)
            restored = self.checkpoints.restore(target)
            self.state, self._data_state = restored.state, restored.data_state
            self.resumed_from = f"{ckpt_dir}/{restored.step}"
            log.warning("resumed from checkpoint %s (step %d, data position %s)", self.resumed_from,
                        restored.step, restored.data_state)
        else:
            if a.resume_if_possible:
                log.warning("resume_if_possible: no complete checkpoint in %s; starting from scratch", ckpt_dir)
            self.configure_dataloaders()  # from the start of the data: tokenizing overlaps creating the state
            self.state = self._initial_state(build)

    def _check_attention(self) -> None:
        """The model's attention backend must run on this mesh's platform at this length, before anything
        compiles; cuDNN's kernel cannot keep packed documents apart."""
        rt, a = self.runtime, self.arguments
        platform = self._mesh.devices.flat[0].platform
        jmod.choose_implementation(rt.attn_mechanism, q_len=a.max_sequence_length, kv_len=a.max_sequence_length,
                                   cached=False, window=self.config.sliding_window, platform=platform)
        if rt.attn_mechanism == "cudnn" and a.packing:
            raise ValueError("attn_mechanism='cudnn' cannot keep packed documents apart (it knows lengths, not "
                             "segments): set packing=false, or use attn_mechanism='flash' or 'auto'")

    def _initial_state(self, build) -> js.TrainState:
        """The state created on its shards by one jitted program. From a seed on a one-device mesh, op by
        op instead: a few small kernels shared by same-shaped layers compile faster than one program with
        a random-number pipeline per parameter (seconds of start-up on CPU; same values to rounding)."""
        if self._mesh.devices.size > 1 or build[1]:  # from given parameters: copies, never aliases of them
            return jax.jit(build[0], out_shardings=self.state_shardings)(*build[1])
        return jax.device_put(build[0](*build[1]), self.state_shardings)

    def _state_builder(self, template):
        seed, tx = self.arguments.seed, self.tx
        leaves = jax.tree_util.tree_leaves(nnx.state(template, nnx.Param))
        if leaves and isinstance(leaves[0], jax.ShapeDtypeStruct):  # abstract: initialise from the seed
            config, runtime, cls = self.config, self.runtime, self.model_class
            return (lambda: js.TrainState.create(jmod.create_model(config, runtime, seed=seed, model_class=cls), tx,
                                                 seed=seed)), ()
        graphdef, params, rest = nnx.split(template, nnx.Param, ...)
        return (lambda p: js.TrainState.create(nnx.merge(graphdef, p, rest), tx, seed=seed)), (params,)

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
        settings = dict(max_sequence_length=a.max_sequence_length, packing=a.packing,
                        truncation_mode=a.truncation_mode, shuffle=a.shuffle_train_dataset, seed=a.seed)
        cfg = jd.DataConfig(**{**settings, **overrides})
        return jd.MeshLoader(data, self.tokenizer, cfg, self._mesh, global_rows or a.total_batch_size,
                             accumulation=accum, state=state)

    def _batch_shardings(self):
        axes = tuple(x for x in DATA_AXES if x in self._mesh.shape) or None
        return NamedSharding(self._mesh, PartitionSpec(None, axes)), NamedSharding(self._mesh, PartitionSpec(axes))

    def configure_dataloaders(self) -> None:
        """Create this process's training loader (at the restored data position) and start it."""
        self.train_loader = self._loader(self.dataset_train, state=self._data_state)
        self.train_loader.start()  # the first batches are made while the step compiles

    def configure_functions(self) -> None:
        """Jit the train and eval steps with explicit shardings and donation; compile in the background."""
        a = self.arguments
        aux = getattr(self.config, "router_aux_loss_coef", 0.0)
        self.step_config = StepConfig(z_loss=a.z_loss, aux_loss_coef=aux, skip_nonfinite=a.nan_policy == "skip",
                                      schedule=self.schedule)
        repl = NamedSharding(self._mesh, PartitionSpec())
        donate = a.donate_state if a.donate_state is not None else self._mesh.devices.flat[0].platform != "cpu"
        self._train_jit = jax.jit(functools.partial(train_step, cfg=self.step_config),
                                  in_shardings=(self.state_shardings, self._batch_sharding),
                                  out_shardings=(self.state_shardings, repl), donate_argnums=0 if donate else ())
        self._eval_jit = jax.jit(functools.partial(eval_step, cfg=self.step_config),
                                 in_shardings=(self.state_shardings, self._eval_sharding), out_shardings=repl)
        self._train_fn = self._pool.submit(self.compile_aot)

    def compile_aot(self):
        """Compile the train step for the exact shapes and shardings before the first batch."""
        a = self.arguments
        shape = (a.gradient_accumulation_steps, a.total_batch_size, a.max_sequence_length)
        batch = {k: jax.ShapeDtypeStruct(shape, np.int32, sharding=self._batch_sharding)
                 for k in ("input_ids", "segment_ids", "positions", "loss_mask")}
        state = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                       self._abstract_state, self.state_shardings)
        with jax.set_mesh(self._mesh):
            return self._train_jit.lower(state, batch).compile()

    # ---- the loop -------------------------------------------------------------------------------------
    def _global_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        a = self.arguments
        accum = a.gradient_accumulation_steps
        shape = (accum, a.total_batch_size, a.max_sequence_length)
        return {k: jax.make_array_from_process_local_data(
            self._batch_sharding, v.reshape(accum, -1, v.shape[-1]), shape) for k, v in local.items()}

    def apply_training_hooks(self, step: int, metrics: dict[str, Any]) -> str | None:
        """Built-in checks after `step` on its `metrics`: non-finite loss (stop with the step named, or
        count a skip) and the wall-clock limit. Returns a stop reason or None."""
        if not bool(metrics["finite"]):
            if self.arguments.nan_policy == "stop":
                raise NonFiniteLossError(f"loss is {float(metrics['loss'])} (grad norm "
                                         f"{float(metrics['grad_norm'])}) at step {step}; stopping. The last "
                                         f"checkpoint in {self.checkpoints.directory} is untouched.")
            self._skipped += 1
            log.warning("non-finite loss at step %d: update skipped (%d so far)", step, self._skipped)
        limit = self.arguments.training_time_limit
        if limit and time.monotonic() - self._t0 >= limit:
            return f"training_time_limit of {limit} s reached"
        if self._stop_requested:
            return "stop signal received"
        return None

    def train(self) -> TrainerOutput:
        """Run until `max_training_steps` (or the epochs, a time limit, a stop signal or the end of the
        data); log, evaluate, preview, checkpoint on schedule. Returns a `TrainerOutput`.

        One step is always in flight: step n+1 is dispatched (its batch staged on the device meanwhile)
        before step n's metrics are read, so the host's checks, logging, TensorBoard and progress bar run
        while the device computes. Evaluation, previews and checkpoints need the state of their own
        step; they settle it first."""
        a = self.arguments
        self._t0, self._skipped, self._last_eval, self._last_preview = time.monotonic(), 0, (None, {}), (None, [])
        if isinstance(self._train_fn, Future):
            self._train_fn = self._train_fn.result()
        step = int(jax.device_get(self.state.step))
        self.writer = MetricsWriter(a.save_directory, tensorboard=a.use_tensorboard, use_wandb=a.use_wandb,
                                    wandb_project=a.wandb_project, progress_total=self.total_steps,
                                    progress_bar=a.progress_bar, initial=step)
        self._window, self._t_log = [], time.perf_counter()
        self._flops_token = jmod.flops_per_token(self.config, a.max_sequence_length)   # constants of the run,
        self._peak = peak_flops(override=a.peak_flops_per_device)                      # not of each log row
        restore_signals = self._install_signal_handlers()
        stop_reason, pending, profiling = "max_training_steps reached", None, False
        try:
            while step < self.total_steps:
                for h in self.hooks:  # steps are numbered like checkpoints: the update count after the step
                    getattr(h, "on_step_start", lambda *_: None)(self, step + 1)
                if a.profile_steps and step + 1 == a.profile_steps[0]:
                    jax.profiler.start_trace(str(Path(a.save_directory) / "profile"))
                    profiling = True
                try:
                    local = next(self.train_loader)
                except StopIteration:
                    stop_reason = "training data exhausted"
                    break
                self.state, metrics = self._train_fn(self.state, self._global_batch(local))
                step += 1
                if profiling and step == a.profile_steps[1]:
                    profiling = self._stop_profile(metrics)
                for h in self.hooks:
                    getattr(h, "on_step_end", lambda *_: None)(self, step, metrics)
                reason = self._after_step(*pending) if pending else None  # the previous step, now done
                pending = (step, metrics)
                due = self._due(step)
                if any(due):  # evaluation, preview or checkpoint of this step's state: settle it first
                    reason = self._after_step(*pending) or reason
                    pending = None
                    self._scheduled(step, due)
                if reason:
                    stop_reason = reason
                    break
            if pending:
                self._after_step(*pending)
        finally:
            if profiling:
                jax.profiler.stop_trace()
            restore_signals()
        return self._finish(step, stop_reason, self.writer)

    def _after_step(self, step: int, metrics: dict[str, Any]) -> str | None:
        """The host's share of `step`, run once the next step is dispatched: the built-in checks, the
        metrics row every `logging_steps` (and at the last step), the progress bar. Returns a stop reason."""
        a = self.arguments
        reason = self.apply_training_hooks(step, _checked(metrics))
        self._window.append(metrics)
        if step % a.logging_steps == 0 or step == self.total_steps:
            host, now = jax.device_get(self._window), time.perf_counter()
            dt = now - self._t_log
            tps = a.training_batch_size * a.max_sequence_length * len(host) / dt
            flops_token, peak = self._flops_token, self._peak
            row = {k: float(np.mean([m[k] for m in host])) for k in ("loss", "accuracy", "grad_norm")}
            row.update(perplexity=math.exp(min(row["loss"], 50)), learning_rate=float(host[-1]["learning_rate"]),
                       tokens_per_second=tps, step_time=dt / len(host),
                       tflops_per_device=flops_token * tps / self._mesh.devices.size / 1e12, **memory_in_use())
            if peak:
                row["mfu"] = flops_token * tps / self._mesh.devices.size / peak
            self.writer.write(step, row)
            if a.log_weight_distribution:
                for name, leaf in named_leaves(self.state.params):
                    self.writer.histogram(step, f"weights/{name}", np.asarray(jax.device_get(leaf)))
            self._window, self._t_log = [], now
        self.writer.advance(1)
        return reason

    def _due(self, step: int) -> tuple[bool, bool, bool]:
        """Whether evaluation, a preview and a checkpoint are due after `step` (asked once per step: the
        time-based checkpoint decision is a collective)."""
        a = self.arguments
        return (bool(a.evaluation_steps and step % a.evaluation_steps == 0 and self.dataset_eval is not None),
                bool(a.generation_interval and a.generation_prompts and step % a.generation_interval == 0),
                self.checkpoints.should_save(step))

    def _scheduled(self, step: int, due: tuple[bool, bool, bool]) -> None:
        """Run the evaluation, preview and checkpoint `due` at `step`."""
        evaluate, preview, save = due
        if evaluate:
            self._last_eval = (step, self.evaluate())
            self.writer.write(step, self._last_eval[1], prefix="eval")
        if preview:
            self.preview(step)
        if save:
            self._save(step)

    def _stop_profile(self, metrics) -> bool:
        jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        log.warning("profiler trace of steps %d-%d in %s/profile (TensorBoard's profile plugin)",
                    *self.arguments.profile_steps, self.arguments.save_directory)
        return False

    def _finish(self, step: int, stop_reason: str, writer: MetricsWriter) -> TrainerOutput:
        a = self.arguments
        final = {}
        if self.dataset_eval is not None:
            last_step, final = self._last_eval
            if last_step != step:
                final = self.evaluate()
                writer.write(step, final, prefix="eval")
        if self.checkpoints.latest_step() != step:
            self._save(step)
        self.checkpoints.wait_until_finished()
        train_rows = [r for r in writer.history if "train/loss" in r]
        if train_rows:
            final = {**{k.split("/", 1)[1]: v for k, v in train_rows[-1].items() if k != "step"},
                     **{f"eval_{k}": v for k, v in final.items()}}
        samples = []
        if a.generation_prompts:  # the final sample, unless the last step already made one
            samples = self._last_preview[1] if self._last_preview[0] == step else self.preview(step)
        plot = report = None
        if self.is_process_zero:
            plot = plot_history(writer.history, Path(a.save_directory) / "loss.png")
            report = self.save_information(final=final, stop_reason=stop_reason)
        writer.close()
        log.info("training stopped at step %d: %s", step, stop_reason)
        return TrainerOutput(self.state, final, stop_reason, self.resumed_from, str(self.checkpoints.directory),
                             str(report) if report else None, str(plot) if plot else None, samples)

    def preview(self, step: int) -> list[str]:
        """Generate from `generation_prompts` with the current parameters and log the samples under
        `step` (also the sampling seed). Every process runs the (sharded) decode together; process 0
        writes."""
        a = self.arguments
        prompts = [p for p in a.generation_prompts for _ in range(a.generation_num_samples)]
        res = jg.generate_unified(self.state.model, self.tokenizer, prompts=prompts, mesh=self._mesh,
                                  max_new_tokens=a.generation_max_new_tokens, seed=step,
                                  do_sample=a.generation_temperature > 0, temperature=a.generation_temperature)
        self.writer.samples(step, res.decoded_prompts, res.generation_results)
        self._last_preview = (step, res.completion_prompts)
        return res.completion_prompts

    def _save(self, step: int) -> None:
        self.checkpoints.save(step, self.state, data_state=self.train_loader.global_state_dict(),
                              metadata={"tokens_seen": step * self.arguments.training_batch_size
                                        * self.arguments.max_sequence_length,
                                        "arguments": js.to_jsonable(self.arguments.to_dict())})

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum, _frame):
            log.warning("signal %d: finishing this step, saving a checkpoint and stopping", signum)
            self._stop_requested = True

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return lambda: [signal.signal(s, h) for s, h in old.items()]

    # ---- evaluation and outputs ------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Loss, perplexity and accuracy over up to `eval_batches` batches of `dataset_eval`."""
        if self.dataset_eval is None:
            raise ValueError("no dataset_eval was given")
        a = self.arguments
        loader = self._loader(self.dataset_eval, global_rows=a.eval_batch_size, accumulation=1, num_epochs=1,
                              shuffle=False, prefetch=0)
        total = {"loss_sum": 0.0, "tokens": 0.0, "correct": 0.0}
        shape = (a.eval_batch_size, a.max_sequence_length)
        with jax.set_mesh(self._mesh):
            for i, local in enumerate(loader):
                if i >= a.eval_batches:
                    break
                batch = {k: jax.make_array_from_process_local_data(self._eval_sharding, v, shape)
                         for k, v in local.items()}
                out = jax.device_get(self._eval_jit(self.state, batch))
                total = {k: total[k] + float(out[k]) for k in total}
        if total["tokens"] == 0:
            raise ValueError("dataset_eval gave no tokens to evaluate")
        loss = total["loss_sum"] / total["tokens"]
        return {"loss": loss, "perplexity": math.exp(min(loss, 50)), "accuracy": total["correct"] / total["tokens"]}

    def save_pretrained(self, path: str | Path, *, to_hf: bool = True) -> Path:
        """Write the current parameters to `path` (a Hugging Face directory with `to_hf`)."""
        return js.save_pretrained(self.state, path, to_hf=to_hf, tokenizer=self.tokenizer)

    def save_information(self, path: str | Path | None = None, *, final: dict | None = None,
                         stop_reason: str = "not finished") -> Path:
        """A Markdown report of the run (model, parameters, mesh, arguments, `final` metrics and the
        `stop_reason`) at `path` (default `save_directory/report.md`)."""
        path = Path(path or Path(self.arguments.save_directory) / "report.md")
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_report(path, model=self._model_in, n_params=self.n_params, mesh=self._mesh,
                            arguments=self.arguments, final=final or {}, resumed_from=self.resumed_from,
                            stop_reason=stop_reason)

    def finish(self) -> None:
        """Wait for checkpoint writes, stop the data threads and the setup pool."""
        self.checkpoints.close()
        self.train_loader.close()
        self._pool.shutdown(wait=False)


def use_compilation_cache(directory: str | Path) -> None:
    """Keep every program this process compiles from now on in `directory` (JAX's persistent
    compilation cache) and look there before compiling; with several processes JAX writes from one."""
    from jax.experimental.compilation_cache import compilation_cache

    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # small programs too: start-up
    compilation_cache.reset_cache()  # takes effect even if something was compiled before


def _checked(metrics: dict) -> dict:
    """The few values the per-step checks read."""
    return jax.device_get({k: metrics[k] for k in ("finite", "loss", "grad_norm")})


class Trainer(BaseTrainer):
    """Causal language modelling: pretraining on text, SFT on prompt/completion or chat records (loss
    on completions only). MoE load balancing is weighted by the config's `router_aux_loss_coef`.
    Arguments as `BaseTrainer`'s: `arguments`, `model` or `model_state`, `dataset_train`,
    `dataset_eval`, `processing_class`, `mesh`, `hooks`."""
