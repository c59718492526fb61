"""`convert_checkpoint`: rewrite checkpoints in the other array format (orbax's standard <-> jaxloom's raw).

Each step is read with its integrity checked (a corrupt step is an error, never converted), onto the
run's target (or this process's first device), and written with the same metadata (step, RNG, data
position, run metadata) into another directory, which a run then resumes from as it would from the
original. The state is read onto the target's devices once per step (a checkpoint is saved as a whole):
run it where the state fits, with the run's mesh (`jaxloom convert --checkpoint` builds the run's target).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import numpy as np

from .checkpoint import CheckpointManager
from .train_state import TrainState


def convert_checkpoint(
    source: str,
    destination: str,
    *,
    array_format: Literal["orbax", "raw"] = "orbax",
    step: int | None = None,
    target: TrainState | None = None,
) -> list[int]:
    """Write checkpoint `step` (None: every complete step) of directory `source` into `destination` with
    arrays in `array_format`; returns the steps written. `source` is never changed; `destination` must not
    hold those steps already.

    `target`: the run's abstract state (shapes, dtypes, shardings; `jax.eval_shape` of its `TrainState`, as
    `restore` takes): the arrays are read onto it and written in its tree structure, so the run resumes from
    the result. Without it the stored tree is used (nested dicts and lists): enough for a tool that reads
    the arrays, not for a run whose optimizer state has other containers (`jaxloom convert --checkpoint` passes
    the run's)."""
    if str(source).rstrip("/") == str(destination).rstrip("/"):
        raise ValueError(f"convert a checkpoint into another directory, not its own ({source})")
    reader = CheckpointManager(source, read_only=True)
    steps = reader.all_steps() if step is None else [step]
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint in {source}")
    writer = CheckpointManager(destination, array_format=array_format, async_save=False, save_total_limit=None)
    clash = sorted(set(steps) & set(writer.all_steps()))
    if clash:
        raise FileExistsError(f"{destination} holds checkpoint(s) {clash} already; convert into an empty directory")
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    for s in steps:
        meta = reader.read_meta(s)
        onto = target or TrainState(
            step=jax.ShapeDtypeStruct((), np.int32, sharding=device),
            params=_placed(reader.restore_shapes(s, "params"), device),
            opt_state=_placed(reader.restore_shapes(s, "opt_state"), device) or {},
            rng=jax.ShapeDtypeStruct(np.asarray(meta["rng"]).shape, np.uint32, sharding=device),
        )
        restored = reader.restore(onto, step=s, fallback=False)
        origin = {"versions": meta.get("versions"), "saved_at": meta.get("saved_at")}
        writer.save(
            s, restored.state, data_state=restored.data_state, metadata={**restored.metadata, "converted_from": origin}
        )
    writer.close()
    return steps


def _placed(shapes: Any, sharding: Any) -> Any:
    if shapes is None:
        return None
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes)
