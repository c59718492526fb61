"""A training session: what `train()` does around the loop — set up, say what runs, start the logs, run
the loop with signals handled, then save, evaluate, preview, plot and report (or, resumed at its last
step, nothing). `Session` is built from the collaborators it names (`Parts.call(Session, trainer)`), each
given as a function that returns it when the session needs it (setup builds them in its own order); the loop
itself is `loop.run_loop`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from jaxloom.state import LeaseLostError

from . import export
from .functions import StepTooLargeError
from .loop import Profiler, run_loop
from .metrics import MetricsWriter, NoBar
from .outputs import ALREADY_COMPLETE, TrainerOutput
from .report import plot_history
from .run_state import RunState

if TYPE_CHECKING:
    from .batches import Batches
    from .callbacks import Callbacks, RunView
    from .checkpointing import Checkpointing
    from .collaborators import Later
    from .evaluation import Evaluator
    from .export import Exporter
    from .monitor import StepLog
    from .plan import Plan
    from .previews import Generation
    from .run_directory import RunDirectory
    from .setup import Setup
    from .stopping import StopControl

log = logging.getLogger("jaxloom.trainer")


@dataclasses.dataclass(kw_only=True)
class Session:
    """One `train()`: its collaborators by name (the components as functions that build them when first asked,
    the trainer kind's hooks and steps, the run's `RunState`, which the loop writes)."""

    run: RunState
    setup: Later[Setup]
    start_training_hook: Callable[[], None]
    model_state: Later[Any]
    all_callbacks: Callable[[], Callbacks]
    save_checkpoint: Callable[[int], None]
    evaluate_and_log: Callable[[int], dict[str, float]]
    data_metrics: Callable[..., dict[str, float]]
    plan: Later[Plan]
    batches: Later[Batches]
    run_directory: Later[RunDirectory]
    run_identity: Later[dict[str, Any]]
    checkpointing: Later[Checkpointing]
    step_log: Later[StepLog]
    stop_control: Later[StopControl]
    evaluator: Later[Evaluator]
    generation: Later[Generation]
    exporter: Later[Exporter]
    run_view: Later[RunView]
    mesh: Later[Any]
    runtime: Later[Any]
    dataset_train: Any
    dataset_eval: Any
    is_process_zero: bool

    def train(self) -> TrainerOutput:
        """Train from the run's starting point (see `BaseTrainer.train`): set up, run the loop on the compiled
        step, then finish; an error gets a note naming the step and what is safe on disk."""
        run = self.run
        try:
            self.setup().initialize_trainer_utils()
        except BaseException as e:
            note_out_of_memory(e)
            self.run_directory().abandon()  # nothing trained: no half-made run directory is left behind
            raise
        self.start_training_hook()
        step = run.step = int(jax.device_get(self.model_state().step))
        total = self.plan().total_steps
        if run.resumed_from and step >= total:
            return self.already_complete(step)
        self.announce(step)
        identity, stop, directory = self.run_identity(), self.stop_control(), self.run_directory()
        self.step_log().open(step, total, {**identity["arguments"], **_prefixed(identity["model"])})
        restore_signals = stop.install_signal_handlers()
        try:
            setup = self.setup()
            setup.compile_aot()  # usually done already: it compiled in the background during setup
            profiler = Profiler(run.arguments.profile_steps, directory.folder / "profile")
            step, stop_reason = run_loop(
                run=run,
                step=step,
                total=total,
                train_fn=setup.train_fn,
                batches=self.batches(),
                callbacks=self.all_callbacks(),
                view=self.run_view(),
                stop=stop,
                step_log=self.step_log(),
                data_metrics=self.data_metrics,
                profiler=profiler,
            )
            return self.finish(step, stop_reason)
        except BaseException as e:
            if isinstance(e, StepTooLargeError):  # refused before any step: the error says so
                raise
            if isinstance(e, LeaseLostError):  # the directory is another run's now: nothing of it is this run's
                safe = f"nothing more was written to {directory.checkpoints}"
            else:
                safe = self.checkpointing().safe_on_disk(directory.location)
            # a device's error (out of memory) surfaces a step or two after the step it ended, which steps
            # dispatched ahead hide: the first step not known to have run; a host's (a hook, a reward) is the step
            # being set up
            device = isinstance(e, jax.errors.JaxRuntimeError)
            failed = (run.completed if device else run.step) + 1
            e.add_note(f"jaxloom: training stopped during step {min(failed, total)}; {safe}")
            note_out_of_memory(e)
            raise
        finally:  # after the final save: a second Ctrl-C while it is written is absorbed, not fatal
            restore_signals()
            directory.release()

    def announce(self, step: int) -> None:
        """One start-up summary on process 0: model, mesh, data and tokens per step, steps, where it writes."""
        if not self.is_process_zero:
            return
        a, mesh, plan, data = self.run.arguments, self.mesh(), self.plan(), self.batches()
        devices = mesh.devices
        start = f"resumed from {self.run.resumed_from}" if self.run.resumed_from else "a new run"
        lines = [
            f"model: {plan.model_class.__name__} ({plan.config.model_type}), {plan.n_params:,} parameters",
            f"mesh: {dict(mesh.shape)} over {devices.size} × {devices.flat[0].device_kind}"
            f" in {jax.process_count()} process(es)",
            f"data: {export.describe_data(self.run_identity()['train_data'], self.dataset_train)}",
            f"a step: {step_rows(a, data.spec.row_width, data.data_shards())}",
            f"attention: {plan.attention}"
            + (f" (auto, on {devices.flat[0].platform})" if self.runtime().attn_mechanism == "auto" else ""),
            f"steps: {step} → {plan.total_steps} ({start})",
            f"save_directory: {self.run_directory().location}",
        ]
        if plan.lora is not None:  # PEFT's print_trainable_parameters, in its words
            total = plan.n_params + plan.n_trainable
            lines.insert(
                1,
                f"trainable params: {plan.n_trainable:,} || all params: {total:,} || trainable%: "
                f"{100 * plan.n_trainable / max(total, 1):.4f}",
            )
        log.info("training\n  %s", "\n  ".join(lines))

    def already_complete(self, step: int) -> TrainerOutput:
        """Resumed at or past its last step: nothing to train, and nothing rewritten (report, plot, logs)."""
        run_directory, total = self.run_directory(), self.plan().total_steps
        run_directory.release()
        directory = run_directory.folder
        history = MetricsWriter(directory, tensorboard=False, bar=NoBar(), start_step=step)
        history.close()
        last_eval = next((r for r in reversed(history.history) if "eval/loss" in r), {})
        final = final_metrics(history.history, {k.split("/", 1)[1]: v for k, v in last_eval.items() if k != "step"})
        self.step_log().writer = history
        log.warning(
            "the run in %s is already complete (checkpoint %d, max_training_steps=%d): nothing to train. Raise "
            "max_training_steps to train it further, or choose a new save_directory for a new run.",
            directory,
            step,
            total,
        )
        report, plot = directory / "report.md", directory / "loss.png"
        return TrainerOutput(
            self.run.state,
            final,
            f"{ALREADY_COMPLETE}: step {step} of {total}",
            self.run.resumed_from,
            str(self.checkpointing().manager.directory),
            str(report) if report.is_file() else None,
            str(plot) if plot.is_file() else None,
        )

    def finish(self, step: int, stop_reason: str) -> TrainerOutput:
        """After the loop: the last checkpoint first (what follows can fail), then the final evaluation, the last
        preview, the plot and report (process 0); a second Ctrl-C's hurry skips the evaluation and preview."""
        a, checkpointing, steps, stop = self.run.arguments, self.checkpointing(), self.step_log(), self.stop_control()
        manager = checkpointing.manager
        if not checkpointing.saved(step):  # save first: the evaluation below can fail
            self.save_checkpoint(step)
        final = {}
        hurry = stop.by_signal  # Ctrl-C: out within a second or two, no evaluation or preview first
        if self.dataset_eval is not None:
            last_step, final = self.evaluator().last
            if last_step != step and not hurry:
                final = self.evaluate_and_log(step)
        manager.wait_until_finished()
        history = steps.history
        if any("train/loss" in r for r in history):
            final = final_metrics(history, final)
        samples = []
        if a.generation_prompts:  # the final sample, unless the last step already made one
            last_step, last = self.generation().last
            samples = last if last_step == step or hurry else self.generation().preview(step)
        plot = report = None
        directory = self.run_directory()
        if self.is_process_zero:
            plot = plot_history(history, directory.folder / "loss.png") if a.plot_loss else None
            report = self.exporter().save_information(final=final, stop_reason=stop_reason, samples=samples)
        steps.close()
        log.info("training stopped at step %d: %s", step, stop_reason)
        where = directory.location
        if hurry and where is not None:
            log.info("checkpoint %d is saved: `jaxloom train %s` (or the same command again) resumes it", step, where)
        return TrainerOutput(
            self.run.state,
            final,
            stop_reason,
            self.run.resumed_from,
            str(manager.directory),
            str(report) if report else None,
            str(plot) if plot else None,
            samples,
            stop.signal,
        )


def step_rows(a: Any, row_width: int, data_shards: int) -> str:
    """What one optimizer step trains, in one line, with TRL's `per_device_train_batch_size ×
    gradient_accumulation_steps × devices` beside it; a kind that samples (GRPO, distillation) counts its rows'
    prompt + completion widths as its steps do (each step's rows as wide as its data, up to the caps)."""
    accumulation = a.gradient_accumulation_steps
    rows = a.training_batch_size
    micro = f" ({accumulation} micro-batches of {a.total_batch_size})" if accumulation > 1 else ""
    per_device = a.total_batch_size // max(data_shards, 1)
    trl = (
        f"TRL's per_device_train_batch_size={per_device} × gradient_accumulation_steps={accumulation} × "
        f"{data_shards} data-parallel device(s)"
    )
    completion = getattr(a, "max_completion_length", None) if hasattr(a, "num_generations") else None
    if completion is not None:
        prompt = a.max_prompt_length
        width = f"prompt ({'≤ ' + str(prompt) if prompt else 'as long as it is'}) + completion (≤ {completion})"
        return (
            f"{rows} completions{micro} of {a.num_generations} per prompt, rows of {width} tokens, as wide as each "
            f"step's data, ≤ {row_width:,} tokens: ≤ {rows * row_width:,} tokens per step ({trl})"
        )
    return f"{rows} rows{micro} × {row_width} tokens = {rows * row_width:,} tokens per step ({trl})"


def _prefixed(model: dict[str, Any]) -> dict[str, Any]:
    return {f"model.{k}": v for k, v in model.items()}


def final_metrics(history: list[dict[str, Any]], evaluation: dict[str, Any]) -> dict[str, Any]:
    """A run's final metrics: its last train row (names without the `train/` prefix), then `evaluation`
    as `eval_*`."""
    last = next((r for r in reversed(history) if "train/loss" in r), {})
    return {
        **{k.split("/", 1)[1]: v for k, v in last.items() if k != "step"},
        **{f"eval_{k}": v for k, v in evaluation.items()},
    }


def note_out_of_memory(error: BaseException) -> None:
    """A device out of memory gets a note saying how to see the run's memory and what shrinks it."""
    text = str(error)
    if isinstance(error, OSError) or "No space left on device" in text:  # a full disk (tensorstore says
        return  # RESOURCE_EXHAUSTED for it too), reported as itself
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        error.add_note(
            "jaxloom: the device ran out of memory. `jaxloom plan CONFIG [key=value ...]` prints the memory per "
            "device without running (parameters, optimizer state, activations, against the device's capacity); "
            "lower total_batch_size or max_sequence_length (raise gradient_accumulation_steps to keep the batch), "
            "set remat (e.g. remat=checkpoint_dots), or shard parameters over more devices (sharding_axis_dims)"
        )
