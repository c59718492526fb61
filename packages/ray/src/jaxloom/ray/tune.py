"""Ray Tune sweeps: each trial is a (possibly multi-worker) supervised training run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class SweepResult:
    """What `tune_sweep` returns: the best trial's `best_config`, `best_metrics` and
    `best_checkpoint_dir`, and every trial's config and metrics (`trials`)."""

    best_config: dict[str, Any]
    best_metrics: dict[str, Any]
    best_checkpoint_dir: str
    trials: list[dict[str, Any]]  # {"config", "metrics", "reported_steps"} per trial, in Tune's order


def tune_sweep(
    launcher,
    param_space: dict[str, Any],
    arguments,
    dataset_train,
    dataset_eval,
    *,
    scaling=None,
    metric: str = "eval_loss",
    mode: str = "min",
    max_concurrent_trials: int = 1,
    name: str = "sweep",
    trial_resources: dict[str, float] | None = None,
) -> SweepResult:
    """Sweep `scaling_index` and/or any `TrainingArguments` name over `param_space` (a list is a grid;
    Tune's search spaces work too). Each trial trains with `launcher` (a `RayDistributedTrainer`) on a gang
    of `scaling.num_workers` workers in `save_directory/<name>/<trial>` and reports its final metrics;
    the best trial by `metric` (an eval metric needs `dataset_eval`) is returned with its checkpoint.
    Every trial starts from `arguments` and trains on `dataset_train`; `mode` is 'min' or 'max';
    `max_concurrent_trials` gangs run at once; `trial_resources` is what a trial's supervisor asks Tune
    for (default 0.01 CPU: the gang's workers hold the real resources). While a trial trains, rank 0's
    newest metrics (with `step` and `checkpoint_dir`) are reported to Tune every `report_interval_s` and
    after each checkpoint (once an evaluation ran, so `metric` is in every result), so Tune's schedulers
    and result objects see its progress."""
    from ray import tune

    from .cluster import init_ray

    if mode not in ("min", "max"):
        raise ValueError(f"mode {mode!r}; expected 'min' or 'max'")
    known = set(arguments.to_dict()) | {"scaling_index"}
    unknown = sorted(set(param_space) - known)
    if unknown:
        raise ValueError(f"param_space keys {unknown} are neither scaling_index nor training arguments")
    if metric.startswith("eval_") and dataset_eval is None:
        raise ValueError(f"metric {metric!r} needs a dataset_eval")
    init_ray()
    space = {k: tune.grid_search(list(v)) if isinstance(v, list | tuple) else v for k, v in param_space.items()}
    root = Path(arguments.save_directory).resolve() / name
    trainable = tune.with_parameters(
        _trial,
        launcher=launcher,
        arguments=arguments,
        dataset_train=dataset_train,
        dataset_eval=dataset_eval,
        scaling=scaling,
        root=str(root),
    )
    # The trial process only supervises; its workers hold the resources that matter.
    trainable = tune.with_resources(trainable, trial_resources or {"CPU": 0.01})
    tuner = tune.Tuner(
        trainable,
        param_space=space,
        tune_config=tune.TuneConfig(metric=metric, mode=mode, max_concurrent_trials=max_concurrent_trials),
        run_config=tune.RunConfig(name=name, storage_path=str(root / "_tune"), verbose=0),
    )
    grid = tuner.fit()
    errors = [r.error for r in grid if r.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(grid)} trials failed; first: {errors[0]}")
    best = grid.get_best_result(metric=metric, mode=mode)
    trials = [
        {"config": dict(r.config), "metrics": _scalars(r.metrics), "reported_steps": _reported_steps(r)} for r in grid
    ]
    metrics = best.metrics or {}
    return SweepResult(dict(best.config or {}), _scalars(metrics), metrics["checkpoint_dir"], trials)


def _reported_steps(result) -> list[int]:
    """The `step` of each result the trial reported to Tune: its progress while it trained (rank 0's
    reports), then its final summary."""
    frame = result.metrics_dataframe
    if frame is None or "step" not in frame:
        return []
    return [int(s) for s in frame["step"].tolist()]


def _scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if isinstance(v, int | float | str) and not k.startswith("time_")}


def _trial(config: dict[str, Any], launcher, arguments, dataset_train, dataset_eval, scaling, root: str) -> None:
    from ray import tune

    changes = dict(config)
    scaling_index = int(changes.pop("scaling_index", 1))
    trial_dir = Path(root) / tune.get_context().get_trial_id()
    args = arguments.replace(save_directory=str(trial_dir), **changes)
    res = launcher.train_on_ray(scaling_index, args, dataset_train, dataset_eval, scaling=scaling)
    summary = res.result
    tune.report(
        {
            **{k: v for k, v in summary["metrics"].items() if isinstance(v, int | float)},
            "checkpoint_dir": summary["checkpoint_dir"],
            "step": summary["step"],
            "attempts": res.attempts,
        }
    )
