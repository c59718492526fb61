"""End-of-run artefacts: the loss / learning-rate plot and the Markdown report (`save_information`)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any


def plot_history(history: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Train and eval loss, and the learning rate, against the step, as PNG."""
    train = [(r["step"], r["train/loss"]) for r in history if "train/loss" in r]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [(r["step"], r["eval/loss"]) for r in history if "eval/loss" in r]
    lrs = [(r["step"], r["train/learning_rate"]) for r in history if "train/learning_rate" in r]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    a.plot(*zip(*train, strict=True), label="train loss")
    if evals:
        a.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    a.set_ylabel("loss")
    a.legend()
    a.grid(alpha=0.3)
    if lrs:
        b.plot(*zip(*lrs, strict=True), color="tab:green")
    b.set_ylabel("learning rate")
    b.set_xlabel("step")
    b.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(
    path: str | Path,
    *,
    model,
    n_params: int,
    mesh,
    arguments,
    final: dict[str, Any],
    resumed_from: str | None,
    stop_reason: str,
) -> Path:
    lines = [
        "# jaxloom training report",
        "",
        f"- written: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- model: {type(model).__name__} ({model.config.model_type}), {n_params:,} parameters",
        f"- mesh: {dict(mesh.shape)} over {mesh.devices.size} {mesh.devices.flat[0].platform} device(s)",
        f"- resumed from: {resumed_from or 'nothing (fresh start)'}",
        f"- stopped because: {stop_reason}",
        "",
        "## Final metrics",
        "",
        "| metric | value |",
        "| --- | --- |",
        *[f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in final.items()],
        "",
        "## Model config",
        "",
        "```json",
        json.dumps(model.config.to_hf_dict(), indent=2, default=str),
        "```",
        "",
        "## Arguments",
        "",
        "```json",
        json.dumps(arguments.to_dict(), indent=2, default=str),
        "```",
        "",
    ]
    path = Path(path)
    path.write_text("\n".join(lines))
    return path
