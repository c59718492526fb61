"""A run's checkpoints, in one place: the manager (orbax underneath; opened on first use), its cadence, the final
save, what each checkpoint records besides the state (the data position, from the component that owns it, and
the run's metadata), the resume decision, and handing the data position back on restore. Built from the
arguments' checkpoint group, the run directory's checkpoint path and the components it saves.

    ckpt = Checkpointing(arguments.checkpoint, "run/checkpoints", data=batches, metadata=lambda step: {...})
    ckpt.resume_step()                      # newest complete step, when resume_if_possible
    ckpt.save(step, state)                  # the state, batches.checkpoint_state() and metadata(step)
    restored = ckpt.restore(target)         # ... and batches.load_checkpoint_state(restored.data_state)

`data` is anything with `checkpoint_state() -> jsonable` and `load_checkpoint_state(state)` (a `Stateful`, as
torchtitan registers its data loader as checkpoint state): the batches component of every trainer kind.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np

import jaxloom.state as js

from .resume import check_resume

log = logging.getLogger("jaxloom.trainer")


class Stateful(Protocol):
    """What a checkpoint saves besides the train state (the data position): `checkpoint_state()` as it is now,
    `load_checkpoint_state(state)` to continue from one restored."""

    def checkpoint_state(self) -> Any: ...

    def load_checkpoint_state(self, state: Any) -> None: ...


class Checkpointing:
    """`manager` (a `jaxloom.state.CheckpointManager` of `directory`, opened when first used) with the
    settings of `config` (`save_steps`, `save_minutes`, `save_total_limit`, `async_checkpointing`,
    `resume_if_possible`). `data`: the `Stateful` whose state each checkpoint saves and a resume restores;
    `metadata(step)`: what each checkpoint records about the run; `fence()`: the run still owns its directory
    (`RunDirectory.fence`). `read_only`: a reader, which never changes the directory (no cleanup of a step
    being written, no corrupt step moved aside)."""

    def __init__(
        self,
        config: Any,
        directory: str,
        *,
        read_only: bool = False,
        fence: Callable[[], int | None] | None = None,
        data: Stateful | None = None,
        metadata: Callable[[int], dict[str, Any]] | None = None,
    ):
        self.config, self.directory, self.read_only = config, directory, read_only
        self.fence, self.data, self.metadata = fence, data, metadata
        self._manager: js.CheckpointManager | None = None
        self.read_step: int | None = None  # the checkpoint the last `restore` read
        self.read_from = ""  # ... and its folder (`<step>`, or `<step>.gN` on a store run taken over)
        self._first_step: int | None = None
        self.preparing: threading.Thread | None = None  # orbax imported in the background (`after_step`)

    @property
    def manager(self) -> js.CheckpointManager:
        if self._manager is None:
            c = self.config
            self._manager = js.CheckpointManager(
                js.CheckpointConfig(
                    directory=self.directory,
                    save_steps=c.save_steps,
                    save_minutes=c.save_minutes,
                    save_total_limit=c.save_total_limit,
                    async_save=c.async_checkpointing,
                    read_only=self.read_only,
                    array_format=c.checkpoint_format,
                    retry_seconds=c.storage_retry_seconds,
                ),
                commit_check=self.fence,  # a save in flight when the run lost its lease never commits
            )
        return self._manager

    def after_step(self, step: int) -> None:
        """Once the run's first step is behind it (at the second step this process runs), import orbax in a
        background thread, so the first save does not pay it (~0.4 s alone), and neither does the start-up before
        step 1: an import holds Python's lock, which the train step's tracing needs at the same time."""
        if self._first_step is None:
            self._first_step = step
        elif self.preparing is None:
            # not a daemon: a short run's interpreter never tears down mid-import (a native extension's loading)
            self.preparing = threading.Thread(target=js.CheckpointManager.prepare, name="jaxloom-orbax")
            self.preparing.start()

    def should_save(self, step: int) -> bool:
        """Whether `step` is due (by steps or wall time; every process agrees)."""
        return self.manager.should_save(step)

    def resume_step(self) -> int | None:
        """The step a new start resumes from: the newest complete checkpoint (not one a run wrote after it lost
        the directory's lease) when `resume_if_possible`."""
        return self.manager.resumable_step() if self.config.resume_if_possible else None

    def check_resume(self, save_directory: str, identity: dict[str, Any]) -> None:
        """Before restoring: the run here must be one this run can continue (the same model, tokenizer,
        training data and optimizer); what may change (steps, cadences, logging) is printed."""
        step = self.resume_step()
        assert step is not None
        try:
            recorded = self.manager.read_meta(step).get("metadata", {}).get("run") or {}
        except (OSError, ValueError):
            recorded = {}  # unreadable metadata: the restore reports it
        changed = check_resume(save_directory, step, recorded, identity)
        if changed:
            log.warning("resuming the run in %s with changed settings:\n  %s", save_directory, "\n  ".join(changed))

    def restore(self, target: js.TrainState, *, params_only: bool = False, step: int | None = None) -> js.Restored:
        """The newest complete checkpoint (or checkpoint `step`, FileNotFoundError naming the steps there are when
        it is not one) into `target`'s shapes and shardings (FileNotFoundError without one); a full restore hands
        its data position to `data` (the run continues where it stopped). `read_step` names the checkpoint read,
        `read_from` its folder."""
        newest = self.manager.latest_step()
        if newest is None:
            raise FileNotFoundError(f"no checkpoint under {self.manager.directory} (none complete)")
        restored = self.manager.restore(target, step, params_only=params_only)
        # the checkpoint read (a params-only restore keeps the target's step 0 in `restored.step`)
        self.read_step = read = restored.step if not params_only else step if step is not None else newest
        self.read_from = str(self.manager.step_folder(read))
        if self.data is not None and not params_only:
            self.data.load_checkpoint_state(restored.data_state)
        return restored

    def save(self, step: int, state: js.TrainState) -> None:
        """Save checkpoint `step` (every process) with `data`'s position and `metadata(step)`, once the fence says
        this run still owns the directory: a run that lost its store lease raises `LeaseLostError` on every
        process and writes nothing."""
        data_state = self.data.checkpoint_state() if self.data is not None else None
        metadata = self.metadata(step) if self.metadata is not None else {}
        generation = self._fenced()
        self.manager.save(step, state, data_state=data_state, metadata=metadata, generation=generation)

    def saved(self, step: int) -> bool:
        """Whether `step` is the newest checkpoint already (the final save is skipped then)."""
        return self.manager.latest_step() == step

    def _fenced(self) -> int | None:
        """The lease generation the next checkpoint records and names its folder by (process 0 renews the lease;
        every process learns whether it was lost, and the generation: all write the same step folder)."""
        error, generation = None, None
        if self.fence is not None:
            try:
                generation = self.fence()
            except js.LeaseLostError as e:
                error = e
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            said = np.asarray([error is not None, -1 if generation is None else generation], np.int32)
            lost, shared = (int(x) for x in multihost_utils.broadcast_one_to_all(said))
            generation = None if shared < 0 else shared
            if lost and error is None:
                error = js.LeaseLostError("process 0 found the run directory's lease taken by another run")
        if error is not None:
            raise error
        return generation

    def safe_on_disk(self, run: str | None = None) -> str:
        """After an error: wait for the checkpoint in flight (never leave it half written) and say what is
        safe on disk — and, given the `run` directory, the command that resumes from it."""
        try:
            self.manager.wait_until_finished()
            latest = self.manager.latest_step()
            if not latest:
                return "no checkpoint was complete"
            resume = f"; once the cause is fixed, `jaxloom train {run}` resumes from it" if run is not None else ""
            return f"the newest complete checkpoint is {self.manager.directory}/{latest}{resume}"
        except Exception as e:  # noqa: BLE001 - the first error is the one to report
            return f"the checkpoint in flight failed too ({type(e).__name__}: {str(e)[:200]})"

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
