"""`DirectoryLock`: one live owner per run directory.

A lock file holds its owner's pid, host, process start time and (under a launcher that restarts
workers, e.g. Ray) an owner token. A second run on the same directory is refused with one error naming
the owner; a lock whose owner is dead (same host, pid gone or reused) is taken over, and so is one with
the same owner token (a restarted gang of the same launcher). On an object store (`StoreLease`) the lock is
a lease object written with conditional writes and renewed while held.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
LOCK_FILE = ".jaxloom.lock"
OWNER_ENV = "JAXLOOM_RUN_OWNER"
"""Environment variable: a token shared by every restart of one launcher's run (set by jaxloom-ray)."""


class DirectoryLockedError(RuntimeError):
    """Another live run owns the directory."""


class LeaseLostError(DirectoryLockedError):
    """This run's lease on its store directory was taken by another run (this one was paused or cut off past
    the lease's expiry): it must not write there again."""


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


def _identity() -> dict[str, Any]:
    """Who holds a lock: this process's pid, host, start time, launcher owner token, and since when."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": _start_time(os.getpid()),
        "owner": os.environ.get(OWNER_ENV),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


class DirectoryLock:
    """`acquire()` takes `directory` for this process (creating it), `release()` gives it back; also a
    context manager. Taking a lock this process already holds is a no-op."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / LOCK_FILE
        self.held = False

    def _me(self) -> dict[str, Any]:
        return _identity()

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

    def check(self) -> None:
        """The fence before a write (see `StoreLease.check`): a lock on a local disk cannot be taken from a
        live owner, so there is nothing to check; None (no lease generation)."""
        return None

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


class StoreLease:
    """`DirectoryLock` for a run directory on an object store (`s3://`, `gs://`): a lease object
    `<directory>/.jaxloom.lock` holding its owner and an expiry time, created and renewed with conditional
    writes (the store lets exactly one of two racing writers win), renewed every `ttl / 3` seconds by a
    background thread while held. A second run is refused naming the owner; a lease is taken over when it
    expired (its owner stopped renewing it: killed, or its host gone), when its owner is a dead process on this
    host, or when it carries this launcher's owner token (a restarted Ray gang). Each holder is a generation, one
    more than the previous holder's and than `after`, the newest generation that wrote in the directory (its
    checkpoints' folder names, `step_names.newest_generation`): a lease taken where none is (the last run released
    it) never goes back to a generation a late writer may still hold."""

    def __init__(self, directory: str, ttl: float = 60.0, after: int = 0):
        self.path = f"{str(directory).rstrip('/')}/{LOCK_FILE}"
        self.ttl, self.after = ttl, int(after)
        self.held = False
        self.generation = 0  # one more than the lease's previous holder's: a takeover is a new generation
        self.lost: dict[str, Any] | None = None  # the new owner, once another run took the lease
        self._version: str | None = None
        self._stop: Any = None
        self._since = ""
        self._renewing = threading.Lock()  # the background renewal and a fence (`check`) never interleave
        self.on_lost: Any = None  # called (from the renewal thread) when the renewal finds the lease taken

    def _me(self) -> dict[str, Any]:
        return {**_identity(), "since": self._since, "generation": self.generation, "expires": time.time() + self.ttl}

    def owner(self) -> dict[str, Any] | None:
        """The lease's contents, or None when there is none (or it cannot be read)."""
        from jaxloom.core import paths

        found = paths.read_versioned(self.path)
        if found is None:
            return None
        try:
            data = json.loads(found[0])
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def _stale(self, owner: dict[str, Any]) -> bool:
        if float(owner.get("expires") or 0) < time.time():
            return True
        me = _identity()
        if owner.get("owner") and owner.get("owner") == me["owner"]:
            return True
        return owner.get("host") == me["host"] and (owner.get("pid") == me["pid"] or not _alive(owner))

    def acquire(self) -> StoreLease:
        """Take the lease (an expired or dead one is taken over); `DirectoryLockedError` naming the live owner
        otherwise. Returns self; taking a lease already held is a no-op."""
        from jaxloom.core import paths

        if self.held:
            return self
        for _ in range(20):
            found = paths.read_versioned(self.path)
            version = None
            if found is not None:
                try:
                    owner = json.loads(found[0])
                except ValueError:
                    owner = {}
                if not self._stale(owner):
                    raise DirectoryLockedError(
                        f"{self.path.rsplit('/', 1)[0]} is in use by another run (pid {owner.get('pid')} on "
                        f"{owner.get('host')}, since {owner.get('since')}; its lease runs until "
                        f"{time.strftime('%H:%M:%S', time.localtime(float(owner.get('expires') or 0)))} unless "
                        "renewed); two runs in one save_directory would overwrite each other's checkpoints. Wait "
                        f"for it, stop it, or choose another save_directory. If that run is gone, delete {self.path}."
                    )
                version = found[1]
                held = int(owner.get("generation") or 0) if isinstance(owner, dict) else 0
                self.generation = max(held, self.after) + 1
            else:
                self.generation = self.after + 1
            self._since = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            try:
                paths.write_if(self.path, json.dumps(self._me()).encode(), version)
            except paths.PreconditionFailed:
                continue  # another taker won this round: look again
            self._version = paths.read_versioned(self.path)[1]  # type: ignore[index]
            self.held, self.lost = True, None
            self._renew_in_background()
            return self
        raise DirectoryLockedError(f"could not take {self.path}: it keeps changing hands")

    def _renew_in_background(self) -> None:
        stop = self._stop = threading.Event()

        def renew() -> None:
            while not stop.wait(self.ttl / 3):
                try:
                    self._renew()
                except LeaseLostError as e:
                    log.warning("%s", e)
                    if self.on_lost is not None:
                        self.on_lost()
                    return
                except Exception as e:  # noqa: BLE001 - the store out of reach: try again at the next renewal
                    log.warning("renewing the lease %s failed (%s); retrying", self.path, str(e)[:200])

        threading.Thread(target=renew, name="jaxloom-lease", daemon=True).start()

    def _renew(self) -> None:
        """Extend the lease by one conditional write on the version this run last wrote; `LeaseLostError`
        naming the new owner when the lease changed hands since."""
        from jaxloom.core import paths

        with self._renewing:
            self._renew_locked(paths)

    def _renew_locked(self, paths: Any) -> None:  # `paths`: jaxloom.core.paths (imported late: no I/O at import)
        if self.lost is not None:
            raise LeaseLostError(self._lost_message())
        found = paths.read_versioned(self.path)
        try:
            if found is None or found[1] != self._version:  # taken over (and maybe released since)
                raise paths.PreconditionFailed(self.path)
            paths.write_if(self.path, json.dumps(self._me()).encode(), self._version)
        except paths.PreconditionFailed:
            self.lost = self.owner() or {}
            raise LeaseLostError(self._lost_message()) from None
        found = paths.read_versioned(self.path)
        self._version = found[1] if found is not None else self._version

    def _lost_message(self) -> str:
        o = self.lost or {}
        who = (
            f"pid {o.get('pid')} on {o.get('host')}, since {o.get('since')}, generation {o.get('generation')}"
            if o
            else "which has released it since"
        )
        return (
            f"the lease {self.path} was taken by another run ({who}; this run held generation {self.generation}) "
            f"while this run did not renew it for {self.ttl:.0f} s (paused, suspended or cut off from the store): "
            "this run stops without writing there again; the other run owns the directory now"
        )

    def check(self) -> int:
        """The fence before a write to the directory: renew the lease now and return its generation (which the
        write records), or raise `LeaseLostError` naming the run that took it. A run paused past the lease's
        expiry finds out here, before it writes, never after."""
        if not self.held:
            raise LeaseLostError(f"the lease {self.path} is not held by this run; it writes nothing there")
        self._renew()
        return self.generation

    def release(self) -> None:
        """Stop renewing and remove the lease if this process still holds it."""
        from jaxloom.core import paths

        if not self.held:
            return
        self._stop.set()
        self.held = False
        if self.lost is not None:  # another run's lease now: never touched
            return
        try:
            found = paths.read_versioned(self.path)
            if found is not None and found[1] == self._version:
                paths.remove_file(self.path)
        except Exception as e:  # noqa: BLE001 - the lease expires by itself
            log.warning("could not remove the lease %s (%s); it expires in %.0f s", self.path, str(e)[:200], self.ttl)

    def __enter__(self) -> StoreLease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
