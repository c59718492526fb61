"""The run directory: one owner (a lock), what happens to an earlier run there, and the files that
rebuild the run from the directory alone. Built from the checkpoint group of the arguments; nothing is
touched until `take()`.

    run = RunDirectory(arguments.checkpoint)      # save_directory, checkpoint_directory, overwrite, resume
    run.take(is_process_zero=True)                # lock; an earlier run is resumed, replaced, or an error
    run.write_run_files(resolved_config, tokenizer)
    run.sync()                                    # a run directory on a store: upload what changed
    run.release()

`save_directory` may be a URI (`s3://bucket/run`, `gs://bucket/run`): then the lock is a lease object on the
store (`jaxloom.state.StoreLease`), checkpoints go to `<uri>/checkpoints` directly, and the run's other files
(metrics, config, tokenizer, report, plot, TensorBoard events) are written in a local staging folder (`local`),
filled from the store when the run is taken (so a resumed run continues its history) and uploaded — each file
whole, in one request, so a reader sees the old copy or the new — after every checkpoint and when the run
ends. A multi-node run needs no shared disk: only process 0 writes those files.
"""

from __future__ import annotations

import json
import logging
import os
import hashlib
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax

import jaxloom.state as js
from jaxloom.core import paths

log = logging.getLogger("jaxloom.trainer")
RUN_CONFIG = "run_config.json"

# What a run writes in its save_directory, removed by `overwrite_output_dir` (run_config.json is the
# new run's own, rewritten at setup from `run_config`).
RUN_OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "tensorboard",
    "report.md",
    "loss.png",
    "profile",
    "tokenizer",
    "wandb_run_id",
)


# What jaxloom writes in a checkpoint directory: step folders, steps being written, steps set aside as corrupt.
_STEP_ENTRY = re.compile(r"^\d+(\.g\d+)?(\.orbax-checkpoint-tmp.*|\.corrupt(\.\d+)?)?$")


class RunDirectory:
    """`save_directory` and where its checkpoints go (`checkpoint_directory`, default
    `save_directory/checkpoints`), owned by one run at a time. `config` is the arguments' checkpoint group
    (`CheckpointArgs`), with `save_directory` set."""

    def __init__(self, config: Any):
        self.config = config
        self._lock: js.DirectoryLock | js.StoreLease | None = None
        self._synced: dict[str, tuple[int, int]] = {}  # file -> (size, mtime) last uploaded (a URI run)
        self._created = False  # whether take() made the local directory (a run that fails at setup removes it)
        self.on_lost: Any = None  # called when the lease renewal finds the directory taken over (a URI run)

    @property
    def location(self) -> str | None:
        """The run directory as given (`save_directory`: a path or an `s3://` / `gs://` URI); None when unset."""
        d = self.config.save_directory
        return None if d is None else str(d)

    @property
    def is_remote(self) -> bool:
        """Whether `save_directory` is on an object store (a URI)."""
        return self.config.save_directory is not None and paths.is_uri(self.config.save_directory)

    @property
    def path(self) -> Path | None:
        """Where this process writes the run's files (`local`)."""
        return self.local

    @property
    def local(self) -> Path | None:
        """The run's files' folder on this host: `save_directory`, or for a URI a staging folder under the
        temporary directory, named by the URI."""
        d = self.config.save_directory
        if d is None:
            return None
        return staging_folder(d) if paths.is_uri(d) else Path(d)

    @property
    def folder(self) -> Path:
        """`local` of a run directory whose `save_directory` is set (every one a run writes to: its builder chose one
        when none was given)."""
        local = self.local
        if local is None:
            raise ValueError("save_directory is not set: this run directory has no folder")
        return local

    @property
    def checkpoints(self) -> str:
        """Where the checkpoints are: `checkpoint_directory`, else `save_directory/checkpoints`."""
        c = self.config
        if c.checkpoint_directory:
            return c.checkpoint_directory
        if paths.is_uri(c.save_directory):
            return f"{c.save_directory.rstrip('/')}/checkpoints"
        return str(Path(c.save_directory) / "checkpoints")

    def take(self, *, is_process_zero: bool) -> bool:
        """One owner per `save_directory` (a lock file, process 0), seen by every process (multi-process
        runs: `check_shared_directory`), and no earlier run replaced silently: checkpoints there are
        resumed (`resume_if_possible`), removed (`overwrite_output_dir`), or an error. Returns True when an
        earlier run was removed (a checkpoint manager opened before must forget what it listed)."""
        c = self.config
        directory = self.local
        assert directory is not None
        paths.check_writable_target(c.save_directory, "save_directory")  # before the lock: nothing written yet
        paths.check_writable_target(c.checkpoint_directory, "checkpoint_directory")
        self._created = not directory.exists()
        if is_process_zero:
            remote = self.is_remote
            lock = (  # a store's lease: a generation past every one that wrote the checkpoints there
                js.StoreLease(
                    c.save_directory,
                    ttl=c.storage_lease_seconds,
                    after=js.newest_generation(paths.as_path(self.checkpoints)),
                )
                if remote
                else js.DirectoryLock(directory)
            )
            if isinstance(lock, js.StoreLease):
                lock.on_lost = lambda: self.on_lost() if self.on_lost is not None else None
            self._lock = lock.acquire()
            if remote:
                self._pull()
        shared = c.checkpoint_directory or c.save_directory  # every process writes its part of each checkpoint there
        try:  # ... and reads it back after a restart (an object store is shared by every host)
            if not paths.is_uri(shared):
                js.check_shared_directory(shared)
        except ValueError:
            self.release()
            raise
        ckpts = paths.as_path(self.checkpoints)
        earlier = sorted(js.step_folders(ckpts))
        if earlier and c.overwrite_output_dir:
            log.warning("overwrite_output_dir: removing the earlier run in %s (checkpoints %s)", directory, earlier)
            if is_process_zero:
                for name in RUN_OUTPUTS:
                    target = directory / name
                    if target.is_dir():
                        shutil.rmtree(target)
                    else:
                        target.unlink(missing_ok=True)
                    if self.is_remote:
                        paths.remove_tree(paths.as_path(f"{c.save_directory.rstrip('/')}/{name}"))
                if c.checkpoint_directory:  # only the steps jaxloom wrote there: never the folder, never user files
                    for entry in paths.as_path(c.checkpoint_directory).iterdir():
                        if _STEP_ENTRY.match(entry.name):
                            paths.remove_tree(entry)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("jaxloom-overwrite-output-dir")
            return True
        if earlier and not c.resume_if_possible:
            self.release()
            raise ValueError(
                f"save_directory {directory} holds checkpoints {earlier} of an earlier run and "
                "resume_if_possible=false; expected an empty directory. Set resume_if_possible=true to continue "
                "that run, overwrite_output_dir=true to replace it, or choose a new save_directory."
            )
        return False

    def fence(self) -> int | None:
        """Before a write into the run directory (process 0): on a store, renew the lease now and return its
        generation (a checkpoint records it); `jaxloom.state.LeaseLostError` naming the run that took the lease
        over when this run lost it — it must not write there again. None on a local disk or on another process."""
        if self._lock is None or not self._lock.held:
            return None
        try:
            return self._lock.check()
        except js.LeaseLostError:
            raise
        except Exception as e:  # noqa: BLE001 - the store out of reach: the write itself retries or fails clearly
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            log.warning("the lease %s could not be checked (%s); writing as its generation", self.config.save_directory,
                        first)  # fmt: skip
            return getattr(self._lock, "generation", None)

    @property
    def lost(self) -> bool:
        """Whether another run took this run's lease (a run directory on a store): nothing is written there."""
        return getattr(self._lock, "lost", None) is not None

    def release(self) -> None:
        """Upload what changed (a URI run) and give up the lock (another run may take the directory). A run
        that lost its lease uploads nothing: its files stay in the staging folder (`local`)."""
        if self._lock is not None and self._lock.held:
            try:
                if not self.lost:
                    self.sync()
            except js.LeaseLostError as e:
                log.error("%s; the run's files stay in %s", e, self.local)
            finally:
                self._lock.release()

    def abandon(self) -> None:
        """A run that failed before step 1: give the directory back, and remove what this run made of it when
        that is nothing but empty folders (the lock gone) — no half-made run directory is left behind; one that
        holds anything else (an earlier run, the user's files) is left as it is."""
        self.release()
        directory = self.local
        if not self._created or directory is None or not directory.is_dir():
            return
        for root, _, _ in sorted(os.walk(directory), key=lambda w: -len(w[0])):  # deepest first
            try:
                os.rmdir(root)  # only an empty folder
            except OSError:
                return

    def sync(self) -> list[str]:
        """A run directory on a store (process 0, which holds the lock): upload the files of `local` that
        changed since the last upload, each in one request; returns their names. A no-op otherwise."""
        if not self.is_remote or self._lock is None or not self._lock.held:
            return []
        local, dest = self.local, self.config.save_directory.rstrip("/")
        assert local is not None
        self.fence()  # never upload into a directory another run took over
        sent: list[str] = []
        for name in sorted(paths.files_with_sizes(local)):
            if name.startswith(".") or "/." in name:  # a file being written (.tmp) or the local lock
                continue
            st = os.stat(local / name)
            key = (st.st_size, st.st_mtime_ns)
            if self._synced.get(name) == key:
                continue
            try:
                with open(local / name, "rb") as src, paths.open_write(f"{dest}/{name}") as out:
                    shutil.copyfileobj(src, out, 4 << 20)
            except Exception as e:  # noqa: BLE001 - the store out of reach: the files wait here for the next sync
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                log.warning("uploading the run's files to %s failed (%s); they are kept in %s and sent at the next "
                            "checkpoint", dest, first, local)  # fmt: skip
                return sent
            self._synced[name] = key
            sent.append(name)
        return sent

    def _pull(self) -> None:
        """Fill the staging folder from the store (what an earlier segment of this run uploaded): the
        history continues where the checkpoint resumed from; nothing local from another run stays."""
        local = self.local
        assert local is not None
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True, exist_ok=True)
        got = paths.download_tree(self.config.save_directory, local, skip=("checkpoints/", js.lock.LOCK_FILE))
        for name in got:
            st = os.stat(local / name)
            self._synced[name] = (st.st_size, st.st_mtime_ns)

    def files_missing(self, run_config: dict[str, Any] | None) -> bool:
        """Whether what `write_run_files` wrote is gone (the directory removed under a running run)."""
        directory = self.local
        assert directory is not None
        return (run_config is not None and not (directory / RUN_CONFIG).is_file()) or not (
            directory / "tokenizer"
        ).is_dir()

    def write_run_files(self, run_config: dict[str, Any] | None, tokenizer: Any) -> None:
        """What rebuilds the run from its directory alone, written once the run is known to be valid (call
        on process 0): `run_config.json` (the resolved config of a `jaxloom` command run) and a copy of the
        tokenizer in `tokenizer/` (kept once written), each atomically; a URI run uploads them at once."""
        directory = self.local
        assert directory is not None
        directory.mkdir(parents=True, exist_ok=True)
        if run_config is not None:
            tmp = directory / f".{RUN_CONFIG}.tmp"
            tmp.write_text(json.dumps(run_config, indent=2, default=str))
            os.replace(tmp, directory / RUN_CONFIG)
        target = directory / "tokenizer"
        if not target.is_dir() and hasattr(tokenizer, "save_pretrained"):
            tmp_dir = directory / ".tokenizer.tmp"
            shutil.rmtree(tmp_dir, ignore_errors=True)
            tokenizer.save_pretrained(str(tmp_dir))
            os.replace(tmp_dir, target)
        self.sync()


def use_endpoint(url: str | None) -> None:
    """`storage_endpoint_url`: the S3-compatible store's endpoint, as `AWS_ENDPOINT_URL` for this process (s3fs,
    botocore and tensorstore read it; child processes inherit it). None leaves the environment as it is."""
    if not url or os.environ.get("AWS_ENDPOINT_URL") == url:
        return
    os.environ["AWS_ENDPOINT_URL"] = url
    paths.forget_clients()  # a client cached with the old endpoint is dropped


def staging_folder(uri: str) -> Path:
    """The local folder where the files of run directory `uri` are written before they are uploaded."""
    digest = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "jaxloom-staging" / f"{uri.rstrip('/').rsplit('/', 1)[-1]}-{digest}"
