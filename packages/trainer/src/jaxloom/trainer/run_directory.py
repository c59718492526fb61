"""The run directory: one owner (a lock), what happens to an earlier run there, and the files that
rebuild the run from the directory alone. Built from the checkpoint group of the arguments; nothing is
touched until `take()`.

    run = RunDirectory(arguments.checkpoint)      # save_directory, checkpoint_directory, overwrite, resume
    run.take(is_process_zero=True)                # lock; an earlier run is resumed, replaced, or an error
    run.write_run_files(resolved_config, tokenizer)
    run.release()
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
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
_STEP_ENTRY = re.compile(r"^\d+(\.orbax-checkpoint-tmp.*|\.corrupt(\.\d+)?)?$")


class RunDirectory:
    """`save_directory` and where its checkpoints go (`checkpoint_directory`, default
    `save_directory/checkpoints`), owned by one run at a time. `config` is the arguments' checkpoint group
    (`CheckpointArgs`), with `save_directory` set."""

    def __init__(self, config: Any):
        self.config = config
        self._lock: js.DirectoryLock | None = None

    @property
    def path(self) -> Path | None:
        d = self.config.save_directory
        return None if d is None else Path(d)

    @property
    def checkpoints(self) -> str:
        """Where the checkpoints are: `checkpoint_directory`, else `save_directory/checkpoints`."""
        c = self.config
        return c.checkpoint_directory or str(Path(c.save_directory) / "checkpoints")

    def take(self, *, is_process_zero: bool) -> bool:
        """One owner per `save_directory` (a lock file, process 0), seen by every process (multi-process
        runs: `check_shared_directory`), and no earlier run replaced silently: checkpoints there are
        resumed (`resume_if_possible`), removed (`overwrite_output_dir`), or an error. Returns True when an
        earlier run was removed (a checkpoint manager opened before must forget what it listed)."""
        c = self.config
        directory = Path(c.save_directory)
        if is_process_zero:
            self._lock = js.DirectoryLock(directory).acquire()
        shared = c.checkpoint_directory or directory  # every process writes its part of each checkpoint there
        try:  # ... and reads it back after a restart (an object store is shared by every host)
            if not paths.is_uri(shared):
                js.check_shared_directory(shared)
        except ValueError:
            self.release()
            raise
        ckpts = paths.as_path(self.checkpoints)
        earlier = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.is_dir() else []
        if earlier and c.overwrite_output_dir:
            log.warning("overwrite_output_dir: removing the earlier run in %s (checkpoints %s)", directory, earlier)
            if is_process_zero:
                for name in RUN_OUTPUTS:
                    target = directory / name
                    if target.is_dir():
                        shutil.rmtree(target)
                    else:
                        target.unlink(missing_ok=True)
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

    def release(self) -> None:
        """Give up the lock (another run may take the directory)."""
        if self._lock is not None:
            self._lock.release()

    def files_missing(self, run_config: dict[str, Any] | None) -> bool:
        """Whether what `write_run_files` wrote is gone (the directory removed under a running run)."""
        directory = Path(self.config.save_directory)
        return (run_config is not None and not (directory / RUN_CONFIG).is_file()) or not (
            directory / "tokenizer"
        ).is_dir()

    def write_run_files(self, run_config: dict[str, Any] | None, tokenizer: Any) -> None:
        """What rebuilds the run from its directory alone, written once the run is known to be valid (call
        on process 0): `run_config.json` (the resolved config of a `jaxloom` command run) and a copy of the
        tokenizer in `tokenizer/` (kept once written), each atomically."""
        directory = Path(self.config.save_directory)
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
