"""End-of-run artefacts: the loss / learning-rate plot and the Markdown report (`save_information`)."""

from __future__ import annotations

import functools

import datetime
import json
from pathlib import Path
from collections.abc import Sequence
from typing import Any


def plot_panels(history: list[dict[str, Any]]) -> list[tuple[str, dict[str, list[tuple[int, float]]]]]:
    """What `plot_history` draws, top to bottom: `(y label, {line label: [(step, value)]})`. The reward first for
    a run that has one (GRPO: what it trains for — its loss is near zero by construction), then the train and
    eval loss, then the learning rate."""

    def series(key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in history if key in r]

    panels = []
    if series("train/reward"):
        panels.append(("reward", {"reward": series("train/reward")}))
    losses = {"train loss": series("train/loss"), "eval loss": series("eval/loss")}
    panels.append(("loss", {k: v for k, v in losses.items() if v}))
    if series("train/learning_rate"):
        panels.append(("learning rate", {"learning rate": series("train/learning_rate")}))
    return panels


def plot_history(history: list[dict[str, Any]], path: str | Path) -> Path | None:
    """`plot_panels(history)` as a PNG at `path`, against the step: the reward (when the run has one), the
    train and eval loss, the learning rate. None when nothing was trained."""
    if not any("train/loss" in r for r in history):
        return None
    # A figure of its own on the Agg canvas, not pyplot: no global figure state (safe beside other threads and
    # a user's own pyplot figures) and a third of the import time.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = plot_panels(history)
    fig = Figure(figsize=(7, 3 * len(panels)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)
    for ax, (label, lines) in zip(axes[:, 0], panels, strict=True):
        for name, points in lines.items():
            ax.plot(*zip(*points, strict=True), "o-" if name == "eval loss" else "-", label=name)
        ax.set_ylabel(label)
        if len(lines) > 1:
            ax.legend()
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


# Besides jaxloom's own parts, the libraries whose versions decide a run's numbers.
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "tokenizers", "numpy")


# jaxloom's distributions: the meta-package and its parts.
PARTS = (
    "jaxloom",
    *(f"jaxloom-{p}" for p in ("core", "mesh", "models", "state", "data", "generation", "trainer", "ray")),
)


def versions(libraries: bool = False) -> dict[str, str]:
    """The installed jaxloom parts and their versions; with `libraries`, also those of `LIBRARIES`. Looked up by
    name, once per process (a scan of every installed distribution's metadata took 0.4 s, paid by each run and
    CLI call)."""
    return dict(_versions(libraries))


@functools.cache
def _versions(libraries: bool) -> tuple[tuple[str, str], ...]:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in (*PARTS, *(LIBRARIES if libraries else ())):
        try:
            found.append((name, version(name)))
        except PackageNotFoundError:
            continue
    return tuple(found)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _cell(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


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
    history: Sequence[dict[str, Any]] = (),
    data: dict[str, str] | None = None,
    samples: Sequence[str] = (),
) -> Path:
    """`report.md`: what was trained on what, for how long (wall time and tokens over every segment of a
    resumed run, from its metrics `history`), where it ended (`final`), the eval history, the last
    generated `samples`, the config, and the versions it ran with."""
    last = next((r for r in reversed(history) if "train/loss" in r), {})
    evals = [r for r in history if "eval/loss" in r]
    lines = [
        "# jaxloom training report",
        "",
        f"- written: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- model: {type(model).__name__} ({model.config.model_type}), {n_params:,} parameters",
        f"- mesh: {dict(mesh.shape)} over {mesh.devices.size} {mesh.devices.flat[0].platform} device(s)",
        *[f"- {name} data: {what}" for name, what in (data or {}).items()],
        f"- resumed from: {resumed_from or 'nothing (fresh start)'}",
        f"- stopped because: {stop_reason}",
    ]
    if last:
        lines.append(f"- steps: {last['step']:,}")
    if "train/tokens_seen" in last:
        lines.append(f"- tokens seen: {int(last['train/tokens_seen']):,}")
    if last.get("train/truncated_records"):
        cut, dropped = int(last["train/truncated_records"]), int(last.get("train/truncated_tokens", 0))
        lines.append(
            f"- records longer than max_sequence_length: {cut:,} (tokens cut off them: {dropped:,}; raise "
            "max_sequence_length to keep them whole)"
        )
    if "train/elapsed_time" in last:
        lines.append(f"- wall time training: {_duration(last['train/elapsed_time'])} (every segment of the run)")
    lines += [
        "",
        "## Final metrics",
        "",
        "| metric | value |",
        "| --- | --- |",
        *[f"| {k} | {_cell(v)} |" for k, v in final.items()],
        "",
    ]
    if evals:
        names = [k for k in ("eval/loss", "eval/accuracy", "eval/perplexity") if any(k in r for r in evals)]
        lines += [
            "## Eval history",
            "",
            "| step | " + " | ".join(n.split("/", 1)[1] for n in names) + " |",
            "| --- |" + " --- |" * len(names),
            *[f"| {r['step']} | " + " | ".join(_cell(r.get(n, "")) for n in names) + " |" for r in evals],
            "",
        ]
    benches = [r for r in history if any(k.startswith("lm_eval/") for k in r)]
    if benches:
        names = sorted({k for r in benches for k in r if k.startswith("lm_eval/")})
        lines += [
            "## Benchmarks (lm-evaluation-harness)",
            "",
            "| step | " + " | ".join(n.split("/", 1)[1] for n in names) + " |",
            "| --- |" + " --- |" * len(names),
            *[f"| {r['step']} | " + " | ".join(_cell(r.get(n, "")) for n in names) + " |" for r in benches],
            "",
        ]
    if samples:
        lines += ["## Last samples", "", *[f"- {json.dumps(s, ensure_ascii=False)}" for s in samples], ""]
    lines += [
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
        "## Versions",
        "",
        *[f"- {name} {v}" for name, v in versions(libraries=True).items()],
        "",
    ]
    path = Path(path)
    path.write_text("\n".join(lines))
    return path
