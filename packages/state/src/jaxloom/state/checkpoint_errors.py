"""Why a checkpoint write or read failed, said once: a store out of reach (retried), a full disk (with the space
it needs), orbax's writer threads kept to one line. Used by `checkpoint.CheckpointManager`."""

from __future__ import annotations

import errno
import logging
import sys
import time
from pathlib import Path
from typing import Any

from jaxloom.core import paths

log = logging.getLogger("jaxloom.state.checkpoint")


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


def quiet_writer_threads() -> None:
    """Install, once, the filters that keep orbax's writer threads to one line per failed write (their tracebacks
    dropped: the save's one `CheckpointSaveError` says what happened) and tensorstore's closed-loop callbacks quiet."""
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


def holding_checkpoints(directory: Any, steps: list[int], said: set[int]) -> list[int]:
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


def retry_unreachable(attempt: Any, seconds: float, what: str) -> None:
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
