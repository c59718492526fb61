"""Errors of the user's code in a run (reward functions, environments, tools, `rollout_func`): one closing line and
the frames the user can fix, none of jaxloom's.

    raise UserCodeError("reward function accuracy raised on dataset_train record 12 (KeyError: 'answer')") from e
    print(for_terminal(error))          # the user's frames, then `jaxloom: error: ...` and the error's notes

The frames come from the user's own exception (`__cause__`), from the thread a call was cut in (`stuck_frames`: where
a function that passed its time limit was waiting), or, when the code returned what the contract does not allow, from
the function's definition (`defined_at`). A frame is the user's when its file is neither jaxloom's, nor Python's
standard library, nor an installed package's. `JAXLOOM_TRACEBACK=full` prints the whole traceback instead.
"""

from __future__ import annotations

import inspect
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

FULL_TRACEBACK = "JAXLOOM_TRACEBACK"
"""The environment variable that shows the whole traceback of a user-code error (`full`), jaxloom's frames too."""


class UserCodeError(RuntimeError):
    """The user's code failed in a run: the message names the function, the record and what it did. `frames`: the
    user's frames to show (`traceback.StackSummary`), when they are not those of `__cause__`."""

    frames: traceback.StackSummary | None = None

    def __init__(self, message: str, *, frames: traceback.StackSummary | None = None):
        super().__init__(message)
        self.frames = frames


def _library_roots() -> tuple[str, ...]:
    """Where code that is not the user's lives: jaxloom's parts, the standard library, installed packages."""
    import jaxloom

    roots = {str(Path(p).resolve()) for p in getattr(jaxloom, "__path__", ())}
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            roots.add(str(Path(paths[key]).resolve()))
    return tuple(sorted(roots))


def is_users(filename: str, roots: tuple[str, ...] | None = None) -> bool:
    """Whether a frame in `filename` is the user's code (not jaxloom's, the standard library's or a package's)."""
    if filename.startswith("<") and filename.endswith(">"):  # <frozen ...>, <string>: not a file the user edits
        return False
    path = str(Path(filename).resolve())
    return not any(path == r or path.startswith(r + os.sep) for r in roots or _library_roots())


def users_frames(frames: traceback.StackSummary) -> traceback.StackSummary:
    """The frames of `frames` that are the user's code (`is_users`), in order."""
    roots = _library_roots()
    return traceback.StackSummary.from_list([f for f in frames if is_users(f.filename, roots)])


def stuck_frames(thread_id: int | None) -> traceback.StackSummary | None:
    """The stack of thread `thread_id` now (where a call past its time limit is waiting), the user's frames only;
    None when the thread has ended."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return None
    frames = users_frames(traceback.extract_stack(frame))
    frames.title = "Where your code was when it was cut (most recent call last):"  # type: ignore[attr-defined]
    return frames


def defined_at(fn: Callable) -> traceback.StackSummary | None:
    """A one-frame summary pointing at `fn`'s definition (its file and first line), for code that returned what the
    contract does not allow (no exception of its own to show); None when its source is not a file."""
    target = inspect.unwrap(getattr(fn, "__func__", fn))
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(fn).__call__  # noqa: B004 - a callable object: its method
    try:
        file = inspect.getsourcefile(target)  # type: ignore[arg-type]
        _, line = inspect.getsourcelines(target)  # type: ignore[arg-type]
    except (TypeError, OSError):
        return None
    if file is None:
        return None
    name = getattr(target, "__qualname__", getattr(target, "__name__", "?"))
    frames = traceback.StackSummary.from_list([traceback.FrameSummary(file, line, name)])
    frames.title = "Your function (what it returned is below):"  # type: ignore[attr-defined]
    return frames


def user_error(error: BaseException) -> UserCodeError | None:
    """The `UserCodeError` that `error` is or was raised from (the run's own wrappers may add causes), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UserCodeError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return None


def for_terminal(error: BaseException) -> str:
    """What the terminal shows for a run stopped by `error`: for a user-code error, its user frames (from its
    cause's traceback, the frames it carries, or none), then one line `jaxloom: error: <kind>: <message>` and the
    error's notes (the step, what is safe on disk); the whole traceback with `JAXLOOM_TRACEBACK=full`."""
    if os.environ.get(FULL_TRACEBACK, "").lower() in ("full", "1", "true"):
        return "".join(traceback.format_exception(error)).rstrip("\n")
    found = user_error(error)
    if found is None:
        return "".join(traceback.format_exception(error)).rstrip("\n")
    frames = found.frames
    cause = found.__cause__
    if frames is None and cause is not None and cause.__traceback__ is not None:
        frames = users_frames(traceback.extract_tb(cause.__traceback__))
    lines = []
    if frames:
        lines.append(getattr(frames, "title", "Traceback of your code (most recent call last):"))
        lines.extend(s.rstrip("\n") for s in frames.format())
    notes = [*getattr(found, "__notes__", ()), *(getattr(error, "__notes__", ()) if error is not found else ())]
    lines.append(f"jaxloom: error: {type(found).__name__}: {found}")
    lines.extend(notes)
    lines.append(f"(jaxloom's own frames too: {FULL_TRACEBACK}=full)")
    return "\n".join(lines)


def awaited(out: Any) -> Any:
    """`out`, or what it returns when it is a coroutine (an `async def` reward function's or tool's, as TRL accepts
    them), run to its end on an event loop of this thread's own."""
    if inspect.iscoroutine(out):
        import asyncio

        return asyncio.run(out)
    return out


def describe(value: Any) -> str:
    """`TypeName: message` of an exception, as the one-line errors quote what the user's code raised."""
    return f"{type(value).__name__}: {value}" if str(value) else type(value).__name__
