"""jaxloom.core.host: when a process is re-run with glibc asking for huge pages, and that the re-run takes effect."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxloom.core import host

GLIBC = (2, 36)


def test_the_mode_is_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert host.thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert host.thp_mode(str(f)) == "always"
    assert host.thp_mode(str(tmp_path / "absent")) is None


def test_the_tunable_is_added_where_the_kernel_waits_to_be_asked():
    env = host.hugepage_environment({"PATH": "/bin"}, "madvise", GLIBC)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    # the user's own tunables stay
    env = host.hugepage_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", GLIBC)
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}


@pytest.mark.parametrize(
    ("environ", "mode", "glibc"),
    [
        ({}, "always", GLIBC),  # the kernel gives huge pages unasked
        ({}, "never", GLIBC),  # nor at all
        ({}, None, GLIBC),  # no THP (not Linux)
        ({}, "madvise", None),  # musl, macOS
        ({}, "madvise", (2, 34)),  # glibc before the tunable
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", GLIBC),  # the user's own choice
        ({"JAXLOOM_HUGEPAGES": "0"}, "madvise", GLIBC),  # turned off
        ({"JAXLOOM_HUGEPAGES": "off"}, "madvise", GLIBC),
    ],
)
def test_nothing_is_re_run_where_it_would_change_nothing(environ, mode, glibc):
    assert host.hugepage_environment(environ, mode, glibc) is None


def test_an_unreadable_opt_out_is_one_clear_error():
    with pytest.raises(ValueError, match="JAXLOOM_HUGEPAGES='nope'; expected 0, false, no or off"):
        host.hugepage_environment({"JAXLOOM_HUGEPAGES": "nope"}, "madvise", GLIBC)
    # an explicit yes is the default
    assert host.hugepage_environment({"JAXLOOM_HUGEPAGES": "1"}, "madvise", GLIBC) is not None


# A child that re-runs itself, then maps and touches 256 MiB through malloc and counts its page faults: 65,536
# with 4-KiB pages, ~128 with 2-MiB ones.
CHILD = """
import ctypes, json, os, resource, sys
from jaxloom.core import host
host.reexec_with_hugepages()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
n = 256 << 20
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
p = libc.malloc(n)
ctypes.memset(p, 1, n)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"faults": faults, "tunables": os.environ.get("GLIBC_TUNABLES", ""), "argv": sys.argv[1:]}))
"""


def _child(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", host.OPT_OUT)} | env
    out = subprocess.run([sys.executable, "-c", CHILD, "a", "b"], env=environ, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    host.thp_mode() != "madvise" or (host.glibc_version() or (0, 0)) < (2, 35),
    reason="needs THP in madvise mode and glibc >= 2.35",
)
def test_the_re_run_process_faults_in_huge_pages():
    asked = _child()
    assert asked["tunables"] == host.HUGEPAGE_TUNABLE and asked["argv"] == ["a", "b"]  # the same command, re-run
    left = _child(JAXLOOM_HUGEPAGES="0")
    assert left["tunables"] == ""
    assert left["faults"] >= 60_000  # 4-KiB pages: one fault each
    assert asked["faults"] < left["faults"] / 20
