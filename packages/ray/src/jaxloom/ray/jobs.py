"""Jobs the launcher runs in each worker."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

log = logging.getLogger("jaxloom.ray")


def summarize(out, history: list[dict[str, Any]]) -> dict[str, Any]:
    """What comes back to the driver from a finished training (`out`, a `TrainerOutput`, and the rows it logged,
    `history`): metrics, paths, the loss history and a fingerprint of the final parameters (SHA-256 over every
    parameter's bytes, the same on every rank)."""
    return {
        "metrics": out.metrics,
        "stop_reason": out.stop_reason,
        "resumed_from": out.resumed_from,
        "checkpoint_dir": out.checkpoint_dir,
        "report_path": out.report_path,
        "plot_path": out.plot_path,
        "samples": out.samples,
        "step": int(out.state.step),
        "history": [dict(r) for r in history],
        "params_sha256": params_fingerprint(out.state.params),
    }


def params_fingerprint(params: Any) -> str:
    """SHA-256 of all `params`, gathered from every process (tiny models only: it copies them whole)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jaxloom.mesh import named_leaves

    digest = hashlib.sha256()
    for name, leaf in named_leaves(params):
        value = multihost_utils.process_allgather(leaf, tiled=True) if jax.process_count() > 1 else leaf
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(jax.device_get(value)).tobytes())
    return digest.hexdigest()


def train_from_config(
    ctx,
    config_path: str | None,
    overrides: list[str],
    faults: tuple = (),
    workdir: str | None = None,
) -> dict[str, Any]:
    """`jaxloom train CONFIG [key=value ...]` in one worker (`ctx`): `config_path` (None: the bundled
    demo) with `overrides`, and `faults` (`jaxloom.ray.testing.FaultInjector`s) as trainer hooks. After a
    restart it always resumes.
    `workdir`: where relative paths in the config point (the driver's directory; kept if absent here)."""
    from jaxloom.trainer.compose import build_run

    if workdir and os.path.isdir(workdir):
        os.chdir(workdir)
    items = list(overrides) + (["resume_if_possible=true"] if ctx.attempt > 0 else [])
    trainer, resolved = build_run(config_path, items)
    trainer.hooks.extend(ctx.hooks() + [b for f in faults if (b := f.bind(ctx)) is not None])
    trainer.run_config = resolved  # written to save_directory/run_config.json once the run is set up
    ctx.beat(0, "ready")
    try:
        out = trainer.train()
        return summarize(out, trainer.writer.history)
    finally:
        trainer.finish()
