"""The test run's own plumbing: the longest-first order (root conftest.py), the durations file's writer
(tools/durations.py), and compiled bytecode reused under nox (the suite's largest saving)."""

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("jaxloom_root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_longest_cases_move_first_and_a_module_with_shared_fixtures_moves_whole():
    order = _root_conftest()
    items = [SimpleNamespace(nodeid=n) for n in ("a.py::t1", "a.py::t2", "b.py::t1", "b.py::t2", "c.py::t1")]
    known = {"a.py::t2": 30.0, "b.py::t2": 60.0, "c.py::t1": 2.0}  # c.py's case is under FIRST_AFTER: not moved
    shared = {"b.py"}  # b.py has a module-wide fixture: its cases stay together, in their order
    got = order.longest_first(items, known, lambda it: it.nodeid.split("::")[0] not in shared)
    assert [it.nodeid for it in got] == ["b.py::t1", "b.py::t2", "a.py::t2", "a.py::t1", "c.py::t1"]
    assert order.longest_first(items, {}, lambda it: True) == items  # nothing known: pytest's order


def test_the_durations_file_keeps_the_cases_worth_moving(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import durations

    kept = durations.write({"x::slow": 12.345, "x::quick": 0.4, "y::edge": 5.0}, tmp_path / "d.json")
    assert kept == {"x::slow": 12.3, "y::edge": 5.0}
    assert json.loads((tmp_path / "d.json").read_text()) == kept


def test_each_worker_gets_its_own_cores_unless_workers_outnumber_them():
    cores = _root_conftest().worker_cores
    assert cores(0, 2, {0, 1}) == {0} and cores(1, 2, {0, 1}) == {1}
    assert cores(1, 4, range(8)) == {1, 5} and cores(3, 2, {4, 6}) == {6}  # the cores a process may use, in order
    assert cores(0, 3, {0, 1}) is None and cores(0, 1, {0, 1}) is None  # more workers than cores; no xdist


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="one core")
def test_xdist_workers_are_pinned_and_each_case_s_cpu_seconds_are_recorded(tmp_path):
    """A real pytest run of two workers with the root conftest: each worker on one core of its own (and the
    processes its cases start), and `JAXLOOM_RECORD_CPU` writing each case's CPU seconds."""
    import shutil
    import subprocess

    pytest.importorskip("xdist")
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(
        "import os, subprocess, sys\n"
        "def _record(name):\n"
        "    child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],\n"
        "                           capture_output=True, text=True).stdout.strip()\n"
        "    with open(os.path.join(os.environ['OUT'], name), 'w') as f:\n"
        '        f.write(f"{sorted(os.sched_getaffinity(0))} {child}")\n'
        "    sum(i * i for i in range(300000))\n"
        "def test_a(): _record('a')\n"
        "def test_b(): _record('b')\n"
    )
    env = {**os.environ, "OUT": str(tmp_path), "JAXLOOM_RECORD_CPU": str(tmp_path / "cpu.json")}
    env.pop("JAXLOOM_TEST_PIN", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "test_cases.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for name in ("a", "b"):
        own, child = (tmp_path / name).read_text().split(" ", 1)
        assert len(json.loads(own)) < len(os.sched_getaffinity(0)) and child == own, (own, child)
    cpu = json.loads((tmp_path / "cpu.json").read_text())
    assert set(cpu) == {"test_cases.py::test_a", "test_cases.py::test_b"} and all(v >= 0 for v in cpu.values())


@pytest.mark.skipif(not os.environ.get("NOX_CURRENT_SESSION"), reason="the setting is nox's test environment's")
def test_processes_under_nox_write_and_reuse_compiled_bytecode():
    """An image that sets PYTHONDONTWRITEBYTECODE made every test process compile its imports from source
    (noxfile.TEST_ENV clears it): this process and the subprocesses it starts reuse bytecode."""
    assert not sys.dont_write_bytecode
