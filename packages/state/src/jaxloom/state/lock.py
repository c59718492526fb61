"""`DirectoryLock`: one live owner per run directory.

A lock file holds its owner's pid, host, process start time and (under a launcher that restarts
workers, e.g. Ray) an owner token. A second run on the same directory is refused with one error naming
the owner; a lock whose owner is dead (same host, pid gone or reused) is taken over, and so is one with
the same owner token (a restarted gang of the same launcher).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

LOCK_FILE = ".jaxloom.lock"
OWNER_ENV = "JAXLOOM_RUN_OWNER"
"""Environment variable: a token shared by every restart of one launcher's run (set by jaxloom-ray)."""


class DirectoryLockedError(RuntimeError):
    """Another live run owns the directory."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(owner: dict[str, Any]) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    started = _start_time(pid)
    return started is None or owner.get("started") in (None, started)


class DirectoryLock:
    """`acquire()` takes `directory` for this process (creating it), `release()` gives it back; also a
    context manager. Taking a lock this process already holds is a no-op."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / LOCK_FILE
        self.held = False

    def _me(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _start_time(os.getpid()),
            "owner": os.environ.get(OWNER_ENV),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def owner(self) -> dict[str, Any] | None:
        """The lock file's contents, or None when there is none (or it cannot be read)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _stale(self, owner: dict[str, Any] | None) -> bool:
        if owner is None:  # unreadable: a writer that died between creating and filling it, or one mid-write
            try:
                return time.time() - self.path.stat().st_mtime > 5
            except FileNotFoundError:
                return True
        me = self._me()
        if owner.get("owner") and owner.get("owner") == me["owner"]:
            return True  # an earlier process of the same launcher run (a restarted gang)
        if owner.get("host") != me["host"]:
            return False  # cannot see that host's processes: assume it lives
        return owner.get("pid") == me["pid"] or not _alive(owner)

    def acquire(self) -> DirectoryLock:
        """Take the lock (a stale one, whose owner is dead, is taken over); raise `DirectoryLockedError`
        naming the live owner otherwise. Returns self; taking a lock already held is a no-op."""
        if self.held:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(50):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self.owner()
                if not self._stale(owner):
                    if owner is None:  # being written right now
                        time.sleep(0.1)
                        continue
                    raise DirectoryLockedError(
                        f"{self.path.parent} is in use by another run (pid {owner.get('pid')} on "
                        f"{owner.get('host')}, since {owner.get('since')}); two runs in one save_directory would "
                        f"overwrite each other's checkpoints. Wait for it, stop it, or choose another "
                        f"save_directory. If that run is gone, delete {self.path}."
                    ) from None
                stale = self.path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
                try:  # one taker wins: the rename is atomic, the loser retries and finds the new lock
                    self.path.rename(stale)
                    stale.unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._me(), f)
            self.held = True
            return self
        raise DirectoryLockedError(f"could not take {self.path}: it keeps changing hands")

    def release(self) -> None:
        """Remove the lock file if this process holds it."""
        if self.held:
            owner = self.owner()
            if owner is not None and owner.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
