"""A training session: what `train()` does around the loop — set up, say what runs, start the logs, run
the loop with signals handled, then save, evaluate, preview, plot and report (or, resumed at its last
step, nothing). It drives the trainer's components through the trainer; the loop itself is `loop.run_loop`.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from jaxloom.state import LeaseLostError

from . import export
from .functions import StepTooLargeError
from .loop import run_loop
from .metrics import MetricsWriter, NoBar
from .outputs import ALREADY_COMPLETE, TrainerOutput
from .report import plot_history

log = logging.getLogger("jaxloom.trainer")


def train(trainer: Any) -> TrainerOutput:
    """Train `trainer` from its starting point (see `BaseTrainer.train`): set up, run the loop on the
    compiled step, then finish; an error gets a note naming the step and what is safe on disk."""
    try:
        trainer.initialize_trainer_utils()
    except BaseException as e:
        note_out_of_memory(e)
        trainer.run_directory.abandon()  # nothing trained: no half-made run directory is left behind
        raise
    trainer.start_training_hook()
    step = trainer.current_step = int(jax.device_get(trainer.model_state.step))
    if trainer.resumed_from and step >= trainer.total_steps:
        return already_complete(trainer, step)
    announce(trainer, step)
    identity = trainer.run_identity
    trainer.step_log.open(step, trainer.total_steps, {**identity["arguments"], **_prefixed(identity["model"])})
    restore_signals = trainer.stop_control.install_signal_handlers()
    try:
        trainer.compile_aot()  # usually done already: it compiled in the background during setup
        step, stop_reason = run_loop(trainer, step, trainer.all_callbacks(), trainer._train_fn)
        return finish(trainer, step, stop_reason)
    except BaseException as e:
        if isinstance(e, StepTooLargeError):  # refused before any step: the error says so
            raise
        if isinstance(e, LeaseLostError):  # the directory is another run's now: nothing of it is this run's to report
            safe = f"nothing more was written to {trainer.run_directory.checkpoints}"
        else:
            safe = trainer.checkpointing.safe_on_disk(trainer.run_directory.location)
        # a device's error (out of memory) surfaces a step or two after the step it ended, which steps dispatched
        # ahead hide: the first step not known to have run; a host's (a hook, a reward) is the step being set up
        device = isinstance(e, jax.errors.JaxRuntimeError)
        failed = (trainer.completed_step if device else trainer.current_step) + 1
        e.add_note(f"jaxloom: training stopped during step {min(failed, trainer.total_steps)}; {safe}")
        note_out_of_memory(e)
        raise
    finally:  # after the final save: a second Ctrl-C while it is written is absorbed, not fatal
        restore_signals()
        trainer.run_directory.release()


def announce(trainer: Any, step: int) -> None:
    """One start-up summary on process 0: model, mesh, data and tokens per step, steps, where it writes."""
    if not trainer.is_process_zero:
        return
    a, devices = trainer.arguments, trainer.mesh.devices
    start = f"resumed from {trainer.resumed_from}" if trainer.resumed_from else "a new run"
    lines = [
        f"model: {trainer.model_class.__name__} ({trainer.config.model_type}), {trainer.n_params:,} parameters",
        f"mesh: {dict(trainer.mesh.shape)} over {devices.size} × {devices.flat[0].device_kind}"
        f" in {jax.process_count()} process(es)",
        f"data: {export.describe_data(trainer.run_identity['train_data'], trainer.dataset_train)}",
        f"a step: {step_rows(a, trainer.row_width, trainer.data_shards())}",
        f"attention: {trainer.plan.attention}"
        + (f" (auto, on {devices.flat[0].platform})" if trainer.runtime.attn_mechanism == "auto" else ""),
        f"steps: {step} → {trainer.total_steps} ({start})",
        f"save_directory: {trainer.run_directory.location}",
    ]
    plan = trainer.plan
    if plan.lora is not None:  # PEFT's print_trainable_parameters, in its words
        total = plan.n_params + plan.n_trainable
        lines.insert(
            1,
            f"trainable params: {plan.n_trainable:,} || all params: {total:,} || trainable%: "
            f"{100 * plan.n_trainable / max(total, 1):.4f}",
        )
    log.info("training\n  %s", "\n  ".join(lines))


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


def already_complete(trainer: Any, step: int) -> TrainerOutput:
    """Resumed at or past its last step: nothing to train, and nothing rewritten (report, plot, logs)."""
    trainer.run_directory.release()
    directory = trainer.run_directory.local
    history = MetricsWriter(directory, tensorboard=False, bar=NoBar(), start_step=step)
    history.close()
    last_eval = next((r for r in reversed(history.history) if "eval/loss" in r), {})
    final = final_metrics(history.history, {k.split("/", 1)[1]: v for k, v in last_eval.items() if k != "step"})
    trainer.step_log.writer = history
    log.warning(
        "the run in %s is already complete (checkpoint %d, max_training_steps=%d): nothing to train. Raise "
        "max_training_steps to train it further, or choose a new save_directory for a new run.",
        directory,
        step,
        trainer.total_steps,
    )
    report, plot = directory / "report.md", directory / "loss.png"
    return TrainerOutput(
        trainer.state,
        final,
        f"{ALREADY_COMPLETE}: step {step} of {trainer.total_steps}",
        trainer.resumed_from,
        str(trainer.checkpointing.manager.directory),
        str(report) if report.is_file() else None,
        str(plot) if plot.is_file() else None,
    )


def finish(trainer: Any, step: int, stop_reason: str) -> TrainerOutput:
    a, manager = trainer.arguments, trainer.checkpointing.manager
    if not trainer.checkpointing.saved(step):  # save first: the evaluation below can fail
        trainer.save_checkpoint(step)
    final = {}
    hurry = trainer.stop_control.by_signal  # Ctrl-C: out within a second or two, no evaluation or preview first
    if trainer.dataset_eval is not None:
        last_step, final = trainer.evaluator.last
        if last_step != step and not hurry:
            final = trainer._evaluate_and_log(step)
    manager.wait_until_finished()
    history = trainer.step_log.history
    if any("train/loss" in r for r in history):
        final = final_metrics(history, final)
    samples = []
    if a.generation_prompts:  # the final sample, unless the last step already made one
        last_step, last = trainer.generation.last
        samples = last if last_step == step or hurry else trainer.preview(step)
    plot = report = None
    if trainer.is_process_zero:
        plot = plot_history(history, trainer.run_directory.local / "loss.png") if a.plot_loss else None
        report = trainer.save_information(final=final, stop_reason=stop_reason, samples=samples)
    trainer.step_log.close()
    log.info("training stopped at step %d: %s", step, stop_reason)
    where = trainer.run_directory.location
    if hurry and where is not None:
        log.info("checkpoint %d is saved: `jaxloom train %s` (or the same command again) resumes it", step, where)
    return TrainerOutput(
        trainer.state,
        final,
        stop_reason,
        trainer.resumed_from,
        str(manager.directory),
        str(report) if report else None,
        str(plot) if plot else None,
        samples,
        trainer.stop_control.signal,
    )


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
