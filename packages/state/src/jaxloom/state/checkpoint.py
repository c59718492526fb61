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
import errno
import hashlib
import json
import logging
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np

from jaxloom.core.schema import PositiveFloat, PositiveInt, config

from jaxloom.core import paths

from . import arrays, integrity, stores
from .arrays import CheckpointCorruptError
from .train_state import TrainState

log = logging.getLogger(__name__)
CHECKSUMS = "jaxloom_checksums.json"
DIGESTS = "jaxloom_digests.process_"  # + "<process index>.json": that process's partial array digests


# What the store clients (aiohttp for gcsfs, botocore for s3fs, curl in tensorstore) say when a connection could
# not be made or was lost.
_GONE = (
    "Cannot connect to host",
    "Connection refused",
    "Could not connect to the endpoint URL",
    "Couldn't connect to server",
    "Failed to connect",
    "Connection reset",
    "Connection was closed",
    "Server disconnected",
    "Empty reply from server",
)


def _unreachable(error: BaseException | None) -> bool:
    """Whether `error` (or its cause) is a connection that could not be made or was lost: the store is gone."""
    seen = 0
    while error is not None and seen < 8:
        name = type(error).__name__
        if isinstance(error, ConnectionError) or name in (
            "ClientConnectorError",
            "ServerDisconnectedError",
            "EndpointConnectionError",
            "ConnectionClosedError",
            "ClientOSError",
        ):
            return True
        if any(s in str(error) for s in _GONE):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (disk full, permissions, ...). The partial write is never chosen on
    restore; the earlier checkpoints are untouched. After an I/O error orbax's writer threads may not
    stop: exit the process (the `jaxloom` command does) rather than keep training."""


class _WriterErrorsOneLine(logging.Filter):
    """orbax's background writer logs each failed write of a save with its traceback (five for one full disk);
    the save then fails with one `CheckpointSaveError` that says what happened. Those records keep their
    one-line message, without the traceback."""

    SAID = (
        "raised an exception",
        "Handler Commit operations",
        "background save thread",
        "Finalize thread",
        "Checkpointer failed",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and any(s in str(record.msg) for s in self.SAID):
            record.exc_info, record.exc_text = None, None
        return True


_WRITER_FILTER = _WriterErrorsOneLine()


def _quiet_writer_threads() -> None:
    absl = logging.getLogger("absl")
    if _WRITER_FILTER not in absl.filters:
        absl.addFilter(_WRITER_FILTER)
    if not getattr(sys.unraisablehook, "jaxloom", False):
        sys.unraisablehook = _closed_loop_callbacks_dropped(sys.unraisablehook)


def _closed_loop_callbacks_dropped(previous: Any) -> Any:
    """An `unraisablehook` that drops `RuntimeError: Event loop is closed` raised in tensorstore's callbacks
    after a failed write made orbax close its event loop (a dozen bare tracebacks for one full disk; the save
    fails with one `CheckpointSaveError` that says what happened); anything else goes to `previous`."""

    def hook(unraisable: Any) -> None:
        value = unraisable.exc_value
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return
        previous(unraisable)

    hook.jaxloom = True  # type: ignore[attr-defined]
    return hook


def _holding_checkpoints(directory: Any, steps: list[int], said: set[int]) -> list[int]:
    """`steps` whose directories hold a checkpoint (`params`, `meta`): a stray `mkdir checkpoints/7` is not one,
    is never chosen, and is warned of once (`said`). A bucket's steps are committed by marker: orbax's list."""
    if not isinstance(directory, Path):
        return steps
    out = []
    for step in steps:
        folder = directory / str(step)
        if not folder.exists() or (folder / "meta").exists() or (folder / "params").exists():
            out.append(step)  # (a step orbax knows whose folder is not there yet: a save in flight)
        elif step not in said:
            said.add(step)
            log.warning("ignoring %s: a step directory without a checkpoint in it (params, meta)", folder)
    return out


def save_failure(directory: Any, step: int | None, e: Exception) -> CheckpointSaveError:
    """The one error a failed save of checkpoint `step` (None: a background write) in `directory` raises, from
    what the writer raised (`e`): what failed, what is still safe, what to do."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:500]
    what = f"checkpoint {step}" if step is not None else "a background checkpoint write"
    if _unreachable(e):  # listing it again would only wait for the client's retries once more
        return CheckpointSaveError(
            f"saving {what} in {directory} failed: the store cannot be reached ({first}). Checkpoints "
            "saved before are untouched there; the partial write will never be restored. Rerun when the store "
            "is back: the run resumes from its newest complete checkpoint."
        )
    steps: Any
    try:
        steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []
    except Exception:  # noqa: BLE001 - the first error is the one to report
        steps = "(cannot be listed)"
    full = _disk_full(e)
    if full is not None:
        return CheckpointSaveError(
            f"the disk is full: saving {what} in {directory} failed ({full}). {_space_needed(directory, steps)}, then "
            f"rerun: the run resumes from its newest complete checkpoint. Earlier checkpoints {steps} are untouched; "
            "the partial write will never be restored."
        )
    return CheckpointSaveError(
        f"saving {what} in {directory} failed: {first}. Earlier checkpoints "
        f"{steps} are untouched; the partial write will never be restored."
    )


_FULL = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded", errno.EFBIG: "File too large"}


def _disk_full(error: BaseException | None) -> str | None:
    """The reason when `error` (or what caused it) is a write the disk refused for space — full, over quota, a
    file over the size limit — whatever wrapped it (tensorstore's OCDBT writer reports it as text); None
    otherwise."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno in _FULL:
            return _FULL[error.errno]
        for reason in _FULL.values():
            if reason.lower() in str(error).lower():
                return reason
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def _space_needed(directory: Any, steps: Any) -> str:
    """How much to free: the newest complete checkpoint's size (what the next one takes) against the space
    free on that filesystem."""
    import shutil

    advice = "(or lower save_total_limit, or save elsewhere)"
    try:
        free = shutil.disk_usage(str(directory if directory.exists() else directory.parent)).free
    except (OSError, ValueError):
        return f"Free space there {advice}"
    size = 0
    if isinstance(steps, list) and steps:
        try:
            size = sum(paths.files_with_sizes(directory / str(steps[-1])).values())
        except Exception:  # noqa: BLE001 - the size is advice only
            size = 0
    said = f"{_size(free)} is free there"
    if size > free:
        return f"A checkpoint takes about {_size(size)} and {said}: free at least {_size(size - free)} {advice}"
    if size:
        return f"A checkpoint takes about {_size(size)} and {said} now: free more {advice}"
    return f"{said.capitalize()}: free more {advice}"


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


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


class CheckpointManager:
    """Orbax checkpoints of a `TrainState` plus the data position and run metadata, with
    integrity checked in the same read (file sizes, metadata checksums, array digests), keep-N/keep-every-M
    retention, async writes, and restore onto any mesh.
    `config`: a `CheckpointConfig` or a directory (with `overrides` as its fields)."""

    def __init__(self, config: CheckpointConfig | str, **overrides: Any):
        if isinstance(config, str | Path):
            config = CheckpointConfig(directory=str(config), **overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        self.directory = paths.as_path(config.directory)  # a local Path, or an epath.Path for a URI
        self._manager = None  # orbax.checkpoint.CheckpointManager, opened on first use
        self._last_save_time = time.monotonic()
        self._stray_seen: set[int] = set()  # step directories without a checkpoint, said once
        self._fenced_said: set[int] = set()  # steps written after the lease changed hands, said once
        self._digests: dict[int, integrity.Pending] = {}  # step -> array digests dispatched, not yet written
        self._lock = threading.Lock()
        if self.directory.is_dir():
            self._open()

    # ---- orbax ------------------------------------------------------------------------------------
    @staticmethod
    def prepare() -> None:
        """Import orbax now (about 0.4 s), e.g. in a background thread, so the first save does not pay it."""
        _ocp()

    def _open(self):
        if self._manager is None:
            _quiet_writer_threads()
            ocp = _ocp()
            c = self.config
            stores.prepare_orbax(self.directory)  # s3://: tensorstore's s3 driver, commit by marker
            options = ocp.CheckpointManagerOptions(
                temporary_path_class=stores.temporary_path_class(self.directory),
                max_to_keep=c.save_total_limit,
                keep_period=c.keep_period,
                enable_async_checkpointing=c.async_save,
                cleanup_tmp_directories=not c.read_only,  # a reader never deletes the step a writer is saving
                lightweight_initialize=True,  # no per-step metadata read on open: retention here is by step
                create=not c.read_only,
                async_options=ocp.AsyncOptions(post_finalization_callback=self._write_checksums)
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
        step's (`save(generation=...)`): a run paused
        past its lease that wrote after another run took the directory over. Checkpoints without a generation (a
        local disk) are never fenced out."""
        steps = self.all_steps() if steps is None else steps
        newest, stale = 0, set()
        for s in sorted(steps):
            try:
                generation = self.read_meta(s).get("lease_generation")
            except (OSError, ValueError):
                continue  # unreadable: the restore reports it
            if generation is None:
                continue
            if generation < newest:
                stale.add(s)
                if s in self._fenced_said:
                    continue
                self._fenced_said.add(s)
                log.warning(
                    "checkpoint %s was written by a run that had lost this directory's lease (generation %d, after "
                    "generation %d took over); it is never resumed",
                    self.directory / str(s),
                    generation,
                    newest,
                )
            newest = max(newest, generation)
        return stale

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        manager = self._listing()
        if manager is None:
            return []
        return _holding_checkpoints(self.directory, sorted(manager.all_steps()), self._stray_seen)

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
        resumed after a newer generation's step (`resumable_step`)."""
        if self.config.read_only:
            raise ValueError(f"checkpoint manager of {self.directory} is read-only (a reader); it saves nothing")
        _retry_unreachable(
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
        params = state.params
        if self.config.float_dtype:
            dtype = np.dtype(jax.numpy.dtype(self.config.float_dtype))
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
        if self.config.array_format == "raw":
            _, save_args, _ = arrays.orbax_types()
            items = {k: save_args(v, copy=self.config.async_save) for k, v in trees.items()}  # sync: no staging copy
        else:
            items = {k: ocp.args.StandardSave(v) for k, v in trees.items()}
            if self.config.verify:  # computed on the devices beside the write; recorded once it is finalised
                with self._lock:
                    self._digests[int(step)] = integrity.dispatch(_named(trees))
        items["meta"] = ocp.args.JsonSave(meta)
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

    def _save_failed(self, step: int | None, e: Exception) -> CheckpointSaveError:
        self._manager = None  # not reused after an I/O error; a new one opens on the next call
        return save_failure(self.directory, step, e)

    def close(self) -> None:
        """Finish background writes (raising if one failed) and release orbax."""
        if self._manager is not None:
            self.wait_until_finished()
            self._manager.close()
            self._manager = None

    def _write_checksums(self) -> None:
        """After a write is finalised, every process records the digests of the arrays it saved (orbax's
        format: `jaxloom_digests.process_<i>.json`, computed on the devices at save time), and process 0 the
        manifest: `{"files": {path: [size, sha256 or None]}}` (its presence marks a verified checkpoint).
        Array data files get only their size: their digests are in the digest parts (orbax's format) or the
        item's index files (raw), which the manifest hashes."""
        if self._manager is None:
            return
        me = jax.process_index()
        with self._lock:
            steps = self._manager.all_steps()
            for step in steps:
                folder = self.directory / str(step)
                try:
                    if step in self._digests:
                        part = {"process_count": jax.process_count(), "arrays": integrity.fetch(self._digests[step])}
                        paths.write_atomic(folder / f"{DIGESTS}{me}.json", json.dumps(part, sort_keys=True))
                        del self._digests[step]
                    if me == 0 and not (folder / CHECKSUMS).exists():
                        paths.write_atomic(
                            folder / CHECKSUMS, json.dumps({"files": _checksums(folder)}, sort_keys=True)
                        )
                except FileNotFoundError:  # not renamed into place yet, or deleted by keep-N meanwhile
                    continue
            for step in [s for s in self._digests if steps and s < min(steps)]:  # removed by keep-N
                del self._digests[step]

    # ---- restoring --------------------------------------------------------------------------------
    def verify(self, step: int) -> dict[str, list]:
        """Raise `CheckpointCorruptError` if a file of checkpoint `step` is missing, has another size than
        written, or (metadata files, not array data) another checksum. Reads only the small files; array
        data is checked by `restore` as it is read, against the digests returned here (`{}` when the
        checkpoint has none)."""
        return verify_folder(self.directory / str(step))

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
                log.info("restoring checkpoint %s …", self.directory / str(s))
                restored = self._restore_one(target, s, params_only)
                read = restored.state.params if params_only else (restored.state.params, restored.state.opt_state)
                size = sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(read))
                seconds = time.monotonic() - started
                log.info(  # the checkpoint's step (a params-only restore keeps the target's step 0)
                    "restored checkpoint %s (step %d%s): %.2f GB in %.1f s",
                    self.directory / str(s),
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
                        self.directory / str(s),
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
        """Rename corrupt checkpoint `step` to `<step>.corrupt` (process 0), so that it is never chosen
        again and a new checkpoint of that step can be written."""
        folder = self.directory / str(step)
        dest, n = folder.with_name(f"{step}.corrupt"), 1
        while dest.exists():
            dest, n = folder.with_name(f"{step}.corrupt.{n}"), n + 1
        if jax.process_index() == 0:
            paths.move(folder, dest)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxloom-set-aside-{step}")
        self._manager = None  # orbax lists steps once: open again without the corrupt one
        return dest

    def _restore_one(self, target: TrainState, step: int, params_only: bool) -> Restored:
        expected = self.verify(step) if self.config.verify else {}
        self._check_target(target, step, params_only)
        trees = {"params": target.params}
        if not params_only and jax.tree_util.tree_leaves(target.opt_state):
            trees["opt_state"] = target.opt_state
        error = None
        try:
            out = self._read(step, trees)
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
            raise CheckpointCorruptError(f"checkpoint {self.directory / str(step)} {error}")
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

    def _read(self, step: int, trees: dict[str, Any]) -> Any:
        """The items `trees` names (onto their shapes and shardings) and `meta` of checkpoint `step`: read
        directly in jaxloom's format, through orbax for a checkpoint of jaxloom-state < 0.9."""
        folder = self.directory / str(step)
        meta = json.loads((folder / "meta" / "metadata").read_text())
        if arrays.is_ours(folder / "params"):
            out = {k: arrays.restore(folder / k, _as_abstract(v), verify=self.config.verify) for k, v in trees.items()}
            return types.SimpleNamespace(meta=meta, **out)
        ocp = _ocp()
        stores.prepare_orbax(self.directory)
        read = {
            k: ocp.StandardCheckpointHandler().restore(folder / k, args=ocp.args.StandardRestore(_as_abstract(v)))
            for k, v in trees.items()
        }
        return types.SimpleNamespace(meta=meta, **read)

    def restore_shapes(self, step: int | None = None, item: str = "params") -> Any:
        """The stored shapes and dtypes (`jax.ShapeDtypeStruct` tree) of `item` (`"params"` or
        `"opt_state"`) of checkpoint `step` (default: the newest), without reading weights; None when the
        checkpoint has no such item."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        folder = self.directory / str(step) / item
        if arrays.is_ours(self.directory / str(step) / "params"):
            return arrays.shapes(folder) if folder.exists() else None
        if not folder.exists():
            return None
        stores.prepare_orbax(self.directory)
        tree = _ocp().StandardCheckpointHandler().metadata(folder)
        tree = getattr(tree, "tree", tree)
        return jax.tree_util.tree_map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype),
            tree,
            is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"),
        )

    def read_meta(self, step: int | None = None) -> dict:
        """The JSON metadata (step, data position, versions, ...) of checkpoint `step` (default: newest)."""
        step = self.latest_step() if step is None else step
        file = self.directory / str(step) / "meta" / "metadata"
        return json.loads(file.read_text())

    def _check_target(self, target: TrainState, step: int, params_only: bool) -> None:
        """Compare shapes before reading anything, and that the target's shardings divide them."""
        items = {"params": target.params}
        if not params_only and jax.tree_util.tree_leaves(target.opt_state):
            items["opt_state"] = target.opt_state
        for item, tree in items.items():
            try:
                found = self.restore_shapes(step, item)
            except (ValueError, OSError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise CheckpointCorruptError(
                    f"checkpoint {self.directory / str(step)}: metadata unreadable ({type(e).__name__}: {str(e)[:200]})"
                ) from e
            stored = {k: v.shape for k, v in _flat(found).items()} if found is not None else {}
            wanted = {k: v.shape for k, v in _flat(tree).items()}
            problems = [
                f"{k}: stored {stored.get(k, 'nothing')} vs this run's {wanted.get(k, 'nothing')}"
                for k in sorted(set(stored) | set(wanted))
                if stored.get(k) != wanted.get(k)
            ]
            if problems:
                what = "model shape" if item == "params" else "optimizer (its state differs)"
                raise ValueError(
                    f"checkpoint {self.directory / str(step)} was written for another configuration, another "
                    f"{what}: "
                    + "; ".join(problems[:10])
                    + (" …" if len(problems) > 10 else "")
                    + ". Train into a new save_directory, or set overwrite_output_dir=true to start over in this one."
                )
        for name, leaf in _flat(target.params).items():
            sharding = getattr(leaf, "sharding", None)
            if sharding is None:
                raise ValueError(
                    f"restore target parameter {name} has no sharding; build the target with "
                    "jax.eval_shape and attach shardings (see state_shardings)"
                )
            if hasattr(sharding, "spec"):
                from jaxloom.mesh import validate_specs

                try:
                    validate_specs({name: sharding.spec}, {name: leaf}, sharding.mesh)
                except ValueError as e:
                    raise ValueError(
                        f"parameter {name} with shape {tuple(leaf.shape)} cannot be placed on the target mesh: {e}"
                    ) from None


def verify_folder(folder: Any) -> dict[str, list]:
    """`CheckpointManager.verify` of the checkpoint in `folder` (see there)."""
    manifest = folder / CHECKSUMS
    if not manifest.exists():
        log.warning("checkpoint %s has no checksums (written before finalisation ended); not verified", folder)
        return {}
    try:
        written = json.loads(manifest.read_text())
        if not isinstance(written, dict):
            raise ValueError(f"expected a JSON object, found {type(written).__name__}")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"checkpoint {folder}: checksum manifest {CHECKSUMS} is unreadable ({e})") from e
    expected = written["files"] if "files" in written else written  # state < 0.8: {path: [size, sha256]}
    listed = paths.files_with_sizes(folder)
    actual = _checksums(folder, listed)
    for name, (size, digest) in sorted(expected.items()):
        if name not in actual:
            raise CheckpointCorruptError(f"checkpoint {folder}: file {name} is missing")
        if actual[name][0] != size:
            raise CheckpointCorruptError(
                f"checkpoint {folder}: file {name} is corrupt (size {actual[name][0]} vs {size} written)"
            )
        if actual[name][1] is not None and actual[name][1] != digest:  # array data: checked as read
            raise CheckpointCorruptError(f"checkpoint {folder}: file {name} is corrupt (checksum differs)")
    return _saved_digests(folder, listed)


def _saved_digests(folder: Any, listed: dict[str, int]) -> dict[str, list]:
    """The arrays' digests: every saving process's part added up; `{}` (not checked, with a warning)
    when a part is missing (a process stopped before writing it)."""
    names = sorted(n for n in listed if n.startswith(DIGESTS))
    if not names:  # jaxloom's array format: each piece is checked against its digest as it is read
        return {}
    try:
        parts = [json.loads((folder / n).read_text()) for n in names]
        count = parts[0]["process_count"] if parts else 0
        if not parts or len(parts) != count:
            log.warning("checkpoint %s has %d of %d digest parts; array data not verified", folder, len(parts), count)
            return {}
        return integrity.combine([p["arrays"] for p in parts])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"checkpoint {folder}: array digests unreadable ({e})") from e


def _retry_unreachable(attempt: Any, seconds: float, what: str) -> None:
    """`attempt()`, again after 1 s, 2 s, 4 s, ... (at most 30 s apart) while it fails with a
    `CheckpointSaveError` caused by a store out of reach, for `seconds` after the first failure."""
    deadline, delay = None, 1.0
    while True:
        try:
            return attempt()
        except CheckpointSaveError as e:
            if not _unreachable(e.__cause__):
                raise
            if deadline is None:  # counted from the first failure (the client's own retries took their time)
                deadline = time.monotonic() + seconds
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s: the store cannot be reached; trying again in %.0f s", what, delay)
            time.sleep(delay)
            delay = min(2 * delay, 30.0)


def _ocp():
    """orbax, imported on first use: it costs ~0.4 s, and a run that neither saves nor restores needs none."""
    import orbax.checkpoint as ocp

    return ocp


def _as_abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


def _flat(tree: Any) -> dict[str, Any]:
    from jaxloom.mesh import named_leaves

    return dict(named_leaves(tree))


def _named(items: dict[str, Any]) -> dict[str, Any]:
    """`{"params": tree, ...}` to `{"params/<leaf path>": array}`."""
    return {f"{item}/{name}": leaf for item, tree in items.items() for name, leaf in _flat(tree).items()}


def _agree(error: str | None) -> str | None:
    """The same outcome on every process: the first error any process met, or None."""
    if jax.process_count() == 1:
        return error
    from jax.experimental import multihost_utils

    failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None)))
    if error is None and failed.any():
        error = f"could not be read by process {int(np.argmax(failed))} (see its log)"
    return error


def _is_array_data(relative: Path) -> bool:
    """Array bytes (jaxloom's `process_<i>.bin`, or orbax/OCDBT `d/` files of jaxloom-state < 0.9): checked by
    their digests as they are read, not hashed."""
    return relative.suffix == ".bin" or "d" in relative.parts[:-1]


# Files orbax may rewrite after a step is committed on an object store (the commit time stamped into
# _CHECKPOINT_METADATA, OCDBT manifests updated as the per-process databases are merged): not in the manifest.
# Nothing is restored from the first two; a damaged OCDBT manifest fails the read itself (-> corrupt).
_ORBAX_BOOKKEEPING = ("_CHECKPOINT_METADATA", "commit_success.txt", "manifest.ocdbt")


def _checksums(folder: Any, listed: dict[str, int] | None = None) -> dict[str, list]:
    """`{relative path: [size, sha256 or None]}`: array data files get only their size (from the listing).
    jaxloom's own files (the manifest, the digest parts, written beside it) are not listed."""
    out: dict[str, list] = {}
    listed = paths.files_with_sizes(folder) if listed is None else listed
    for name, size in sorted(listed.items()):
        base = name.rsplit("/", 1)[-1]
        if base.startswith("jaxloom_") or base in _ORBAX_BOOKKEEPING:
            continue
        digest = None
        if not _is_array_data(Path(name)):
            h = hashlib.sha256()
            with (folder / name).open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):  # noqa: B023 - consumed at once
                    h.update(chunk)
            digest = h.hexdigest()
        out[name] = [size, digest]
    return out


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("jax", "flax", "optax", "orbax-checkpoint", "jaxloom-mesh", "jaxloom-models", "jaxloom-state"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out
