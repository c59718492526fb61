"""The host process's memory: transparent huge pages for the large buffers XLA's CPU runtime allocates.

XLA's CPU runtime allocates a step's temporaries as one buffer per execution (`posix_memalign`), and glibc
serves a buffer that large with a fresh `mmap` and returns it with `munmap` when the step ends: every step
faults its whole working set in again, 4 KiB at a time. Measured on the bench's 18-layer CPU Llama
(docs/performance.md): a 1.86 GB arena a step, 460,000 page faults and 1.2 s of kernel time in a 3.4-s step.
Where the kernel gives transparent huge pages only to memory that asks for them (`madvise`, Debian's and
Ubuntu's default), glibc ≥ 2.35 asks when `GLIBC_TUNABLES` holds `glibc.malloc.hugetlb=1` — read once, when
the process starts. `reexec_with_hugepages` re-runs the same command with it (the `jaxloom` command does, first
thing); in a program of your own, set the variable in its environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb=1"
"""The glibc tunable that makes `malloc` ask for transparent huge pages on the memory it maps (glibc ≥ 2.35)."""

OPT_OUT = "JAXLOOM_HUGEPAGES"
"""`JAXLOOM_HUGEPAGES=0` (or false/no/off) in the environment: `reexec_with_hugepages` leaves the process as it is."""

_OFF, _ON = ("0", "false", "no", "off"), ("1", "true", "yes", "on", "")


def _wanted(environ: Mapping[str, str]) -> bool:
    value = environ.get(OPT_OUT, "").strip().lower()
    if value not in _OFF + _ON:
        raise ValueError(
            f"{OPT_OUT}={environ[OPT_OUT]!r}; expected 0, false, no or off (leave it unset for huge pages)"
        )
    return value not in _OFF


THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's transparent-huge-page mode — `'always'`, `'madvise'` or `'never'` (the bracketed word of
    `path`) — or None where there is no such file (not Linux, or a kernel without THP)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library this process runs on, or None where it is not glibc (musl, macOS)."""
    try:
        name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
    except (ValueError, OSError, AttributeError):
        return None
    parts = version.split(".")
    if name != "glibc" or len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        return None
    return int(parts[0]), int(parts[1])


def hugepage_environment(
    environ: Mapping[str, str], mode: str | None, glibc: tuple[int, int] | None
) -> dict[str, str] | None:
    """The environment to re-run a process with so that glibc's `malloc` asks for huge pages, or None where that
    would change nothing: the kernel's THP `mode` is not `'madvise'` (`'always'` gives them unasked, `'never'`
    not at all), the C library is not glibc ≥ 2.35, `environ` already sets `glibc.malloc.hugetlb`, or it says
    `JAXLOOM_HUGEPAGES=0`. Other tunables in `GLIBC_TUNABLES` are kept. Raises ValueError for a
    `JAXLOOM_HUGEPAGES` that is neither on nor off."""
    if not _wanted(environ) or mode != "madvise" or glibc is None or glibc < (2, 35):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(t.partition("=")[0] == "glibc.malloc.hugetlb" for t in tunables.split(":")):
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(t for t in (tunables, HUGEPAGE_TUNABLE) if t)}


def reexec_with_hugepages() -> None:
    """Re-run this process's own command line (`sys.orig_argv`) with `glibc.malloc.hugetlb=1` added to
    `GLIBC_TUNABLES`, where `hugepage_environment` says it would take effect; otherwise return at once. Call it
    first in a program's entry point, before it starts threads or writes anything: the process image is
    replaced (same PID, same open files), and the re-run does not re-exec again, since its environment already
    asks. Raises ValueError for a `JAXLOOM_HUGEPAGES` that is neither on nor off."""
    env = hugepage_environment(os.environ, thp_mode(), glibc_version())
    if env is None or not sys.orig_argv:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:  # an interpreter that cannot be re-run (removed, a frozen app): run as we are
        return
