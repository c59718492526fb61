"""`CheckpointManager`: checkpoints that are async, atomic, verified and restorable onto any mesh.

A checkpoint `DIR/<step>/` holds three items: `params`, `opt_state` (arrays in jaxloom's format, see
`arrays`: each process writes the shards it owns as raw bytes with a digest per 4 MiB piece) and `meta`
(JSON: step, rng, the data iterator's state, run metadata, versions). Orbax runs the writes in the
background and makes a step visible only once complete; after it is finalised, process 0 adds
`jaxloom_checksums.json`: the size of every file and the SHA-256 of every file that is not array data
(metadata and the pieces' digests, a few KB).

Integrity costs no extra read. A restore checks sizes (a `stat` per file) and the small files' hashes,
then each process reads only the pieces its devices restore (a local file is mapped: no copy) and checks
each against its digest as it reads it. No process hashes a file it does not restore; a flipped,
truncated or missing file is a `CheckpointCorruptError`, and `restore` falls back to an older step.
Checkpoints of jaxloom-state < 0.9 (orbax's own array format, with on-device digests, see `integrity`)
are still restored.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np

from jaxloom.core.schema import PositiveFloat, PositiveInt, config

from jaxloom.core import paths

from . import arrays, integrity, stores
from .arrays import CheckpointCorruptError
from .lock import LeaseLostError
from .train_state import TrainState

from .checkpoint_errors import (
    CheckpointSaveError,
    holding_checkpoints,
    quiet_writer_threads,
    retry_unreachable,
    save_failure,
)
from .checkpoint_files import (
    CHECKSUMS,
    DIGESTS,
    flat_leaves,
    check_target,
    fenced_steps,
    read_items,
    set_aside,
    stored_shapes,
    verify_folder,
    commit_records,
    write_checksums,
)
from .step_names import StepNames, step_folders

log = logging.getLogger(__name__)
__all__ = [
    "CHECKSUMS",
    "DIGESTS",
    "CheckpointConfig",
    "CheckpointManager",
    "CheckpointSaveError",
    "Restored",
    "save_failure",
    "verify_folder",
]


@config
class CheckpointConfig:
    """Args:
    directory: where checkpoints live (local path, or any path orbax/etils supports).
    save_steps: save when `step % save_steps == 0`. save_minutes: also when this long passed since the last.
    time_check_steps: with several processes, how often (in steps) process 0's clock is shared for
      `save_minutes`: one small broadcast every this many steps instead of one per step.
    save_total_limit: keep the newest K. keep_period: also keep every step divisible by M.
    async_save: write in the background; training continues once arrays are copied to host.
    float_dtype: store floating parameters in this dtype (e.g. 'bfloat16'); restored to the target's.
    verify: check files (sizes, metadata checksums) before restoring and the arrays' digests as they are
      read (no extra read of the array data).
    read_only: a reader (`jaxloom convert`, `generate`, `eval`, a second process): it never changes the
      directory — no cleanup of a step being written (`<step>.orbax-checkpoint-tmp`), no corrupt step moved
      aside (the next older one is read instead), no directory created, and `save` is an error.
    array_format: how arrays are written — `orbax` (default): orbax's standard format (tensorstore, OCDBT),
      which `orbax.checkpoint.StandardCheckpointer().restore(<step>/params)` reads without jaxloom; `raw`:
      jaxloom's own format (see `arrays`; faster on a local disk, readable by jaxloom only). Either is
      restored whatever this says; `convert_checkpoint` turns one into the other.
    retry_seconds: a save that finds the store out of reach (connection refused, reset, lost) is tried again
      after 1 s, 2 s, 4 s, ... (at most 30 s apart) for this long after its first failure, then fails with one
      `CheckpointSaveError`.
      A background write cut off by an outage is never listed (no commit marker); the next save replaces it.
    """

    directory: str
    save_steps: PositiveInt | None = None
    save_minutes: PositiveFloat | None = None
    time_check_steps: PositiveInt = 10
    save_total_limit: PositiveInt | None = 3
    keep_period: PositiveInt | None = None
    async_save: bool = True
    float_dtype: str | None = None
    verify: bool = True
    read_only: bool = False
    array_format: Literal["orbax", "raw"] = "orbax"
    retry_seconds: float = 120.0


@dataclasses.dataclass
class Restored:
    """What a restore returns: the `state`, its `step`, the loaders' `data_state` and the `metadata`."""

    state: TrainState
    step: int
    data_state: Any
    metadata: dict


def _lease_lost(error: BaseException | None) -> LeaseLostError | None:
    """The `LeaseLostError` in `error`'s chain (orbax re-raises a background thread's error wrapped), or None."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, LeaseLostError):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


class CheckpointManager:
    """Orbax checkpoints of a `TrainState` plus the data position and run metadata, with
    integrity checked in the same read (file sizes, metadata checksums, array digests), keep-N/keep-every-M
    retention, async writes, and restore onto any mesh.
    `config`: a `CheckpointConfig` or a directory (with `overrides` as its fields). `commit_check()`: called on
    process 0 before an asynchronous checkpoint commits; one that raises keeps that checkpoint from committing
    (a run directory's lease fence: a save in flight when the run lost its lease never becomes visible)."""

    def __init__(self, config: CheckpointConfig | str, *, commit_check: Any = None, **overrides: Any):
        if isinstance(config, str | Path):
            config = CheckpointConfig(directory=str(config), **overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        # called on process 0 before an asynchronous checkpoint commits (after its files are written): raising
        # (a run that lost its store lease: `LeaseLostError`) leaves it uncommitted, never resumed from
        self.commit_check = commit_check
        self.directory = paths.as_path(config.directory)  # a local Path, or an epath.Path for a URI
        self._manager = None  # orbax.checkpoint.CheckpointManager, opened on first use
        self._last_save_time = time.monotonic()
        self._stray_seen: set[int] = set()  # step directories without a checkpoint, said once
        self._fenced_said: set[int] = set()  # steps written after the lease changed hands, said once
        # step -> its array digests (a function: they may still be computing; None: none to record), for the steps
        # saved whose integrity record is not written yet
        self._digests: dict[int, Any] = {}
        self._lock = threading.Lock()
        # the step folders' names: `<step>`, or `<step>.g<generation>` for a lease generation past the first (a run
        # that took a store directory over never writes where the run it took it from may still be writing)
        self._names = StepNames(stores.temporary_path_class(self.directory))
        if self.directory.is_dir():
            self._open()

    # ---- orbax ------------------------------------------------------------------------------------
    @staticmethod
    def prepare() -> None:
        """Import orbax now (about 0.4 s), e.g. in a background thread, so the first save does not pay it."""
        _ocp()

    def _open(self):
        if self._manager is None:
            quiet_writer_threads()
            ocp = _ocp()
            c = self.config
            stores.prepare_orbax(self.directory)  # s3://: tensorstore's s3 driver, commit by marker
            options = ocp.CheckpointManagerOptions(
                temporary_path_class=self._names.temporary_path_class,
                step_name_format=self._names,
                max_to_keep=c.save_total_limit,
                keep_period=c.keep_period,
                enable_async_checkpointing=c.async_save,
                cleanup_tmp_directories=not c.read_only,  # a reader never deletes the step a writer is saving
                lightweight_initialize=True,  # no per-step metadata read on open: retention here is by step
                create=not c.read_only,
                async_options=ocp.AsyncOptions(post_finalization_callback=self._commit_integrity)
                if c.async_save
                else None,
            )
            handler = arrays.orbax_types()[0] if c.array_format == "raw" else ocp.StandardCheckpointHandler
            handlers = {
                "params": handler(),
                "opt_state": handler(),
                "meta": ocp.JsonCheckpointHandler(),
            }
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        return self._manager

    def reload(self) -> None:
        """Forget what orbax listed: the directory changed outside this manager (removed, replaced)."""
        if self._manager is not None:
            self.wait_until_finished()
            self._manager.close()
        self._manager = None
        if self.directory.is_dir():
            self._open()

    def _listing(self) -> Any:
        """orbax's manager for the step listing (opened again after a checkpoint was set aside); None while
        the directory does not exist."""
        if self._manager is None and self.directory.is_dir():
            self._open()
        return self._manager

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (partial writes are never counted)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def resumable_step(self) -> int | None:
        """The newest complete checkpoint a run may resume from: `latest_step`, less any step written late by
        a run that had lost the directory's lease (`fenced_out`)."""
        steps = self.all_steps()
        stale = self.fenced_out(steps)
        steps = [s for s in steps if s not in stale]
        return steps[-1] if steps else None

    def fenced_out(self, steps: list[int] | None = None) -> set[int]:
        """Of `steps` (default: every complete step), those written by an older lease generation than a lower
        step's (`save(generation=...)`; see `checkpoint_files.fenced_steps`), each warned about once."""
        stale = set()
        for s, generation, newest in fenced_steps(self.all_steps() if steps is None else steps, self.read_meta):
            stale.add(s)
            if s not in self._fenced_said:
                self._fenced_said.add(s)
                log.warning(
                    "checkpoint %s was written by a run that had lost this directory's lease (generation %d, after "
                    "generation %d took over); it is never resumed",
                    self.step_folder(s),
                    generation,
                    newest,
                )
        return stale

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        manager = self._listing()
        if manager is None:
            return []
        return holding_checkpoints(self.directory, sorted(manager.all_steps()), self._stray_seen)

    # ---- saving -----------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether `step` is due, by step count or wall time. With several processes, time is decided by
        process 0 and shared every `time_check_steps` steps (no collective on the other steps), so all
        processes always agree (they must all call `save` together)."""
        c = self.config
        due = bool(c.save_steps and step > 0 and step % c.save_steps == 0)
        if c.save_minutes and not due:
            late = time.monotonic() - self._last_save_time >= 60 * c.save_minutes
            if jax.process_count() > 1:
                if step % c.time_check_steps:
                    return False
                from jax.experimental import multihost_utils

                late = bool(multihost_utils.broadcast_one_to_all(np.int32(late)))
            due = late
        return due

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        data_state: Any = None,
        metadata: dict | None = None,
        generation: int | None = None,
    ) -> None:
        """Save `state` as checkpoint `step` (all processes call this). Returns once arrays are on the
        host; the write continues in the background when `async_save`. `data_state` (the loaders'
        position) and `metadata` are stored as JSON beside the arrays. A store out of reach is retried with
        backoff for `retry_seconds` (see `CheckpointConfig`). `generation`: the writer's lease generation on a
        store (`StoreLease.check`), recorded so that a step written late by a run that lost the lease is never
        resumed after a newer generation's step (`resumable_step`), and naming the step's folder (`step_names`):
        every process passes the same one."""
        if self.config.read_only:
            raise ValueError(f"checkpoint manager of {self.directory} is read-only (a reader); it saves nothing")
        retry_unreachable(
            lambda: self._save_once(step, state, data_state, metadata, generation),
            self.config.retry_seconds,
            f"saving checkpoint {step} in {self.directory}",
        )

    def _save_once(
        self, step: int, state: TrainState, data_state: Any, metadata: dict | None, generation: int | None = None
    ) -> None:
        try:  # on an object store these list and read it: a store out of reach is a save that failed
            manager, ocp = self._open(), _ocp()
            self._write_checksums()  # the manifests of earlier saves finalised since
        except Exception as e:  # noqa: BLE001 - one clear error, whatever the store's client raised
            raise self._save_failed(step, e) from e
        trees, meta = _trees_and_meta(state, step, data_state, metadata, generation, self.config.float_dtype)
        found = None
        if self.config.array_format == "raw":
            _, save_args, _ = arrays.orbax_types()
            items = {k: save_args(v, copy=self.config.async_save) for k, v in trees.items()}  # sync: no staging copy
        else:
            items = {k: ocp.args.StandardSave(v) for k, v in trees.items()}
            if self.config.verify:  # computed on the devices beside the write; recorded before it commits
                found = integrity.deferred(_named(trees))
        with self._lock:
            self._digests[int(step)] = found
        items["meta"] = ocp.args.JsonSave(meta)
        self._names.generation = generation  # one run holds one generation: its steps' folder names
        try:
            manager.save(int(step), args=ocp.args.Composite(**items), force=True)
            self._last_save_time = time.monotonic()
            if not self.config.async_save:
                self._write_checksums()
        except Exception as e:  # noqa: BLE001 - one clear error, whatever orbax raised
            raise self._save_failed(step, e) from e

    def wait_until_finished(self) -> None:
        """Block until background writes are done; raises if one failed (errors are never swallowed)."""
        if self._manager is not None:
            try:
                self._manager.wait_until_finished()
                self._write_checksums()
            except Exception as e:  # noqa: BLE001
                raise self._save_failed(None, e) from e

    def _save_failed(self, step: int | None, e: Exception) -> Exception:
        self._manager = None  # not reused after an I/O error; a new one opens on the next call
        lost = _lease_lost(e)
        if lost is not None:  # a commit refused by `commit_check`: the run lost its directory, said as such
            return lost
        return save_failure(self.directory, step, e)

    def close(self) -> None:
        """Finish background writes (raising if one failed) and release orbax."""
        if self._manager is not None:
            self.wait_until_finished()
            self._manager.close()
            self._manager = None

    def _commit_integrity(self) -> None:
        """orbax's post-finalisation callback (process 0, after every process's write and before the commit): the
        integrity record of each step being committed, written into its in-progress folder, so that a committed
        checkpoint carries it from the moment it is visible (a kill -9 right after still resumes verified)."""
        if self.commit_check is not None:
            self.commit_check()  # raises: orbax does not commit, and the error reaches the next save or wait
        with self._lock:
            commit_records(self.directory, self._digests, self._names.build_name)

    def _write_checksums(self) -> None:
        """Process 0's integrity record of the finalised steps that lack one (`write_checksums`): a synchronous
        save's, and any an asynchronous commit could not write."""
        if self._manager is not None:
            with self._lock:
                write_checksums(self.step_folder, self._manager.all_steps(), self._digests)

    def step_folder(self, step: int) -> Any:
        """The folder of checkpoint `step`: its newest committed generation's (`step_names`), else the folder this
        manager writes it in (a save in flight)."""
        found = step_folders(self.directory, self._names.committed, step).get(int(step))
        return found if found is not None else self.directory / self._names.build_name(step)

    # ---- restoring --------------------------------------------------------------------------------
    def verify(self, step: int) -> dict[str, list]:
        """Raise `CheckpointCorruptError` if a file of checkpoint `step` is missing, has another size than
        written, or (metadata files, not array data) another checksum. Reads only the small files; array
        data is checked by `restore` as it is read, against the digests returned here (`{}` when the
        checkpoint has none)."""
        return verify_folder(self.step_folder(step))

    def restore(
        self, target: TrainState, step: int | None = None, *, params_only: bool = False, fallback: bool = True
    ) -> Restored:
        """Restore onto `target`'s shapes, dtypes and shardings (an abstract `TrainState`, e.g. from
        `jax.eval_shape`, whose leaves carry `.sharding`): any mesh, any number of processes.

        `step=None` takes the newest; with `fallback`, a corrupt newest is reported, moved aside to
        `<step>.corrupt` (so the run can save that step again; delete it when you like) and the next older
        complete one is used. `params_only` keeps `target.opt_state` and step 0 (fine-tuning). A checkpoint
        of another configuration (shapes, optimizer) is a `ValueError` listing the differences, never
        reported as corruption."""
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(
                f"no complete checkpoint in {self.directory}"
                + ("" if self.directory.is_dir() else " (the directory does not exist)")
            )
        if step is not None and step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; available: {steps}")
        if step is None:
            stale = self.fenced_out(steps)
            candidates = sorted((s for s in steps if s not in stale), reverse=True)
        else:
            candidates = [step]
        errors: list[str] = []
        vanished = 0
        while candidates:
            s = candidates.pop(0)
            try:
                started = time.monotonic()
                log.info("restoring checkpoint %s …", self.step_folder(s))
                restored = self._restore_one(target, s, params_only)
                read = restored.state.params if params_only else (restored.state.params, restored.state.opt_state)
                size = sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(read))
                seconds = time.monotonic() - started
                log.info(  # the checkpoint's step (a params-only restore keeps the target's step 0)
                    "restored checkpoint %s (step %d%s): %.2f GB in %.1f s",
                    self.step_folder(s),
                    s,
                    ", parameters only" if params_only else "",
                    size / 1e9,
                    seconds,
                )
                return restored
            except Exception as e:
                if self._vanished(s) and step is None and vanished < 8:
                    # another run removed it while it was read (its save_total_limit): not corruption; read the
                    # newest complete step as it is now
                    vanished += 1
                    self._manager = None
                    log.warning(
                        "checkpoint %s disappeared while it was read (the run writing %s removed it); reading the "
                        "newest complete checkpoint now",
                        self.step_folder(s),
                        self.directory,
                    )
                    candidates = sorted(self.all_steps(), reverse=True)
                    continue
                if not isinstance(e, CheckpointCorruptError):
                    raise
                errors.append(str(e))
                if not fallback or step is not None:
                    raise
                if self.config.read_only:  # a reader changes nothing: it reads the next older one
                    log.error("%s; reading an older checkpoint (left in place: this manager only reads)", e)
                    continue
                log.error("%s; moved aside to %s; falling back to an older checkpoint", e, self._set_aside(s))
        if not errors:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory} (they were removed while being read)")
        where = "left in place: this manager only reads" if self.config.read_only else "moved aside as <step>.corrupt"
        raise CheckpointCorruptError(
            f"every checkpoint in {self.directory} is corrupt ({where}): " + " | ".join(errors)
        )

    def _vanished(self, step: int) -> bool:
        """Whether complete step `step` is gone from the directory (removed by the run that writes it)."""
        self._manager = None
        try:
            return step not in self.all_steps()
        except OSError:
            return False

    def _set_aside(self, step: int) -> Path:
        """Move corrupt checkpoint `step` aside (`set_aside`): never chosen again, and that step can be saved anew."""
        dest = set_aside(self.step_folder(step), step)
        self._manager = None  # orbax lists steps once: open again without the corrupt one
        return dest

    def _restore_one(self, target: TrainState, step: int, params_only: bool) -> Restored:
        expected = self.verify(step) if self.config.verify else {}
        check_target(self, target, step, params_only)
        trees = {"params": target.params}
        if not params_only and jax.tree_util.tree_leaves(target.opt_state):
            trees["opt_state"] = target.opt_state
        error = None
        try:
            out = read_items(self.step_folder(step), trees, self.config.verify)
        except (ValueError, OSError, RuntimeError, KeyError) as e:
            error = f"could not be read: {type(e).__name__}: {str(e)[:500]}"
        error = _agree(error)  # every process raises, or none: no process waits on another that gave up
        if error is None and expected:
            read = {"params": out.params, **({"opt_state": out.opt_state} if "opt_state" in trees else {})}
            bad = integrity.mismatches(_named(read), expected)
            if bad:
                error = (
                    f"array data differs from what was saved in {len(bad)} array(s): "
                    + ", ".join(bad[:5])
                    + (" …" if len(bad) > 5 else "")
                )
        if error is not None:
            raise CheckpointCorruptError(f"checkpoint {self.step_folder(step)} {error}")
        meta = out.meta
        rng_sharding = getattr(target.rng, "sharding", None)
        rng = np.asarray(meta["rng"], dtype=np.uint32)
        rng = jax.device_put(rng, rng_sharding) if rng_sharding is not None else jax.numpy.asarray(rng)
        if params_only:
            state = target.replace(params=out.params)
            return Restored(state=state, step=0, data_state=None, metadata=meta.get("metadata", {}))
        step_sharding = getattr(target.step, "sharding", None)
        step_arr = np.asarray(meta["step"], np.int32)
        step_arr = jax.device_put(step_arr, step_sharding) if step_sharding is not None else jax.numpy.asarray(step_arr)
        opt_state = out.opt_state if "opt_state" in trees else target.opt_state
        state = target.replace(step=step_arr, params=out.params, opt_state=opt_state, rng=rng)
        return Restored(
            state=state, step=int(meta["step"]), data_state=meta.get("data"), metadata=meta.get("metadata", {})
        )

    def restore_shapes(self, step: int | None = None, item: str = "params") -> Any:
        """The stored shapes and dtypes (`jax.ShapeDtypeStruct` tree) of `item` (`"params"` or
        `"opt_state"`) of checkpoint `step` (default: the newest), without reading weights; None when the
        checkpoint has no such item."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        return stored_shapes(self.step_folder(step), item)

    def read_meta(self, step: int | None = None) -> dict:
        """The JSON metadata (step, data position, versions, ...) of checkpoint `step` (default: newest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        file = self.step_folder(step) / "meta" / "metadata"
        return json.loads(file.read_text())


def _trees_and_meta(
    state: TrainState, step: int, data_state: Any, metadata: dict | None, generation: int | None, float_dtype: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a save writes: the array items (`params`, cast to `float_dtype` when set, and `opt_state` unless empty)
    and the `meta` JSON (step, rng, the data position, metadata, versions, time, the lease generation)."""
    params = state.params
    if float_dtype:
        dtype = np.dtype(jax.numpy.dtype(float_dtype))
        params = jax.tree_util.tree_map(
            lambda x: x.astype(dtype) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, params
        )
    trees = {"params": params}
    if jax.tree_util.tree_leaves(state.opt_state):  # no item for an empty tree (e.g. optax.identity)
        trees["opt_state"] = state.opt_state
    meta = {
        "step": int(step),
        "rng": np.asarray(jax.device_get(state.rng)).tolist(),
        "data": data_state,
        "metadata": metadata or {},
        "versions": _versions(),
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        **({"lease_generation": int(generation)} if generation is not None else {}),
    }
    return trees, meta


def _ocp():
    """orbax, imported on first use: it costs ~0.4 s, and a run that neither saves nor restores needs none."""
    import orbax.checkpoint as ocp

    return ocp


def _named(items: dict[str, Any]) -> dict[str, Any]:
    """`{"params": tree, ...}` to `{"params/<leaf path>": array}`."""
    return {f"{item}/{name}": leaf for item, tree in items.items() for name, leaf in flat_leaves(tree).items()}


def _agree(error: str | None) -> str | None:
    """The same outcome on every process: the first error any process met, or None."""
    if jax.process_count() == 1:
        return error
    from jax.experimental import multihost_utils

    failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None)))
    if error is None and failed.any():
        error = f"could not be read by process {int(np.argmax(failed))} (see its log)"
    return error


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("jax", "flax", "optax", "orbax-checkpoint", "jaxloom-mesh", "jaxloom-models", "jaxloom-state"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out
