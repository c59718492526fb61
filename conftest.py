"""Plumbing shared by every part's tests (pytest loads this file for any path under the repository).

The longest cases start first. pytest-xdist hands tests to its workers in collection order, so a 200-second
case collected last keeps one core busy while the other has nothing left to do. `.ci/durations.json` holds each
case's seconds from an earlier run (`tools/durations.py` writes it). A case whose fixtures are all per-test or
per-session moves alone; the cases of a module with module- or class-wide fixtures move together, in their own
order (a fixture is set up once per worker, as before). Whatever holds a case of at least `FIRST_AFTER` seconds
moves to the front, longest first; everything else keeps pytest's order. A case not in the file, or a missing
file, changes nothing; nor does a run without xdist workers (the ray target), where the order cannot shorten
anything and moving a case away from the cases that compile the same programs first only moves cache misses.

Opt-in (`JAXLOOM_TEST_ORDER=longest-first`): measured back to back on the trainer target, the order took 971 s
and pytest's own 904 s (docs/performance.md), so CI keeps pytest's order until an A/B says otherwise.

`JAXLOOM_RECORD_DURATIONS=FILE pytest ...` writes this run's seconds per case (set-up + call + tear-down) to FILE,
merged into what FILE holds; `JAXLOOM_RECORD_CPU=FILE` the CPU seconds each case used (its process's user + system
time, and its subprocesses' once they are waited for; not a Ray cluster's daemons): on 2 cores the suite's CPU time,
not its cases' wall time, bounds how short it can be.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parent / ".ci" / "durations.json"
FIRST_AFTER = 8.0  # seconds
_MOVABLE_SCOPES = {"function", "session"}


def _known() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError):
        return {}


def _movable(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name) or ()
        if any(d.scope not in _MOVABLE_SCOPES for d in defs):
            return False
    return True


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("JAXLOOM_TEST_ORDER") != "longest-first":  # opt-in: see the module docstring
        return
    if not hasattr(config, "workerinput"):  # only pytest-xdist's workers: one process runs in order anyway
        return
    known = _known()
    if not known:
        return
    items[:] = longest_first(items, known, _movable)


def longest_first(items: list, known: dict[str, float], movable) -> list:
    """`items` with the blocks holding a case of at least FIRST_AFTER known seconds first, longest first: a
    `movable(item)` case is a block of its own, the other cases of one module one block (in their order)."""
    blocks: list[list] = []
    by_module: dict[str, list] = {}
    for item in items:
        if movable(item):
            blocks.append([item])
            continue
        module = item.nodeid.split("::")[0]
        if module not in by_module:
            by_module[module] = []
            blocks.append(by_module[module])
        by_module[module].append(item)

    def weight(block: list) -> float:
        longest = max(known.get(it.nodeid, 0.0) for it in block)
        return longest if longest >= FIRST_AFTER else 0.0

    blocks.sort(key=lambda b: -weight(b))  # stable: blocks under FIRST_AFTER keep their order
    return [it for block in blocks for it in block]


def _pin_worker(config) -> None:
    """An xdist worker runs on its own share of the cores (worker i of n: cores i, i + n, ...), and so do the
    processes its cases start: XLA's CPU runtime sizes its threads to the cores a process may use, and its threads
    spin. Two workers each running a 2-thread XLA on 2 cores took 63 s for two copies of a training case that took
    48 s with each worker on its own core (the case alone: 35 s on both cores, 51 s on one). Not when workers
    outnumber the cores (a target whose cases mostly wait), nor with `JAXLOOM_TEST_PIN=0`."""
    info = getattr(config, "workerinput", None)
    if info is None or os.environ.get("JAXLOOM_TEST_PIN") == "0" or not hasattr(os, "sched_setaffinity"):
        return
    index = int(str(info.get("workerid", "gw0")).removeprefix("gw"))
    share = worker_cores(index, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")), os.sched_getaffinity(0))
    if share:
        os.sched_setaffinity(0, share)


def worker_cores(index: int, workers: int, cores) -> set[int] | None:
    """The cores of worker `index` of `workers` among `cores` (i, i + n, ...), or None (leave it unpinned) for
    fewer than 2 workers or more workers than cores."""
    cores = sorted(cores)
    if workers < 2 or workers > len(cores):
        return None
    return set(cores[index % workers :: workers])


_RECORDED: dict[str, float] = {}
_RECORDED_CPU: dict[str, float] = {}
_RECORDING = [False]
_RECORDING_CPU = [False]


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_CPU_START: dict[str, float] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if os.environ.get("JAXLOOM_RECORD_CPU"):
        _CPU_START[item.nodeid] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and item.nodeid in _CPU_START:  # the teardown report carries the case's CPU time
        outcome.get_result().user_properties.append(("cpu_s", _cpu_seconds() - _CPU_START.pop(item.nodeid)))


def pytest_configure(config):
    _pin_worker(config)
    # the controller (or a run without workers) records; an xdist worker's reports reach the controller
    _RECORDING[0] = bool(os.environ.get("JAXLOOM_RECORD_DURATIONS")) and not hasattr(config, "workerinput")
    _RECORDING_CPU[0] = bool(os.environ.get("JAXLOOM_RECORD_CPU")) and not hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
    if _RECORDING[0]:
        _RECORDED[report.nodeid] = _RECORDED.get(report.nodeid, 0.0) + report.duration
    if _RECORDING_CPU[0]:  # user_properties travel from an xdist worker with its reports
        for key, value in report.user_properties:
            if key == "cpu_s":
                _RECORDED_CPU[report.nodeid] = value


def pytest_sessionfinish(session, exitstatus):
    if _RECORDING[0]:
        _merge_into(os.environ["JAXLOOM_RECORD_DURATIONS"], _RECORDED)
    if _RECORDING_CPU[0]:
        _merge_into(os.environ["JAXLOOM_RECORD_CPU"], _RECORDED_CPU)


def _merge_into(target: str, recorded: dict[str, float]) -> None:
    """`recorded` (seconds per case) merged into the JSON file `target`."""
    if not recorded:
        return
    path = Path(target)
    try:
        merged = json.loads(path.read_text())
    except (OSError, ValueError):
        merged = {}
    merged.update({k: round(v, 2) for k, v in recorded.items()})
    path.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")
