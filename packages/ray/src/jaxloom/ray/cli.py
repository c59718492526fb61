"""`jaxloom train ... --ray KEY=VALUE ...`: registered with the `jaxloom` command as the `ray` launcher
(entry-point group `jaxloom.launchers`), so the trainer's CLI never imports this part."""

from __future__ import annotations

import json
import os


def under_storage_path(config: str | None, items: list[str], storage_path: str) -> list[str]:
    """`items` with the run's save_directory (from `config` and `items`) placed under `storage_path` when it
    is relative (Ray's `RunConfig.storage_path`: where every run of the cluster writes)."""
    from jaxloom.trainer.arguments import apply_overrides, load_config_file
    from jaxloom.trainer.compose import DEMO_CONFIG

    directory = apply_overrides(load_config_file(config or DEMO_CONFIG), items).get("save_directory")
    if directory is None or os.path.isabs(str(directory)):
        return items
    return [*items, f"save_directory={os.path.join(os.path.abspath(storage_path), str(directory))}"]


def train_on_ray(config: str | None, items: list[str], ray_items: list[str]) -> int:
    """The run of `config` (None: the bundled demo) with `items` (`key=value` overrides) as a supervised
    gang of Ray workers configured by `ray_items` (`ScalingConfig` settings); prints the summary."""
    from jaxloom.trainer.outputs import ALREADY_COMPLETE

    from .jobs import train_from_config
    from .launcher import ScalingConfig, launch

    scaling = ScalingConfig.from_items(ray_items)
    if scaling.storage_path is not None:
        items = under_storage_path(config, items, scaling.storage_path)
    res = launch(train_from_config, config, items, workdir=os.getcwd(), scaling=scaling)
    r = res.result
    summary = {  # the keys of a plain `jaxloom train`, then the gang's
        "stop_reason": r["stop_reason"],
        "step": r["step"],
        "resumed_from": r["resumed_from"],
        "final": r["metrics"],
        "report": r["report_path"],
        "plot": r["plot_path"],
        "checkpoints": r["checkpoint_dir"],
    }
    failures = [
        {
            "attempt": f.attempt,
            "rank": f.rank,
            "kind": f.kind,
            "message": f.message,
            "restart_to_first_step_s": f.restart_to_first_step_s,
        }
        for f in res.failures
    ]
    print(
        json.dumps(
            {**summary, "attempts": res.attempts, "failures": failures, "wall_s": res.wall_s}, indent=2, default=str
        )
    )
    if str(r["stop_reason"]).startswith(ALREADY_COMPLETE):
        return 4
    return 128 + res.signal if res.signal else 0
