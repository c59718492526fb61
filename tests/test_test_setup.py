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


@pytest.mark.skipif(not os.environ.get("NOX_CURRENT_SESSION"), reason="the setting is nox's test environment's")
def test_processes_under_nox_write_and_reuse_compiled_bytecode():
    """An image that sets PYTHONDONTWRITEBYTECODE made every test process compile its imports from source
    (noxfile.TEST_ENV clears it): this process and the subprocesses it starts reuse bytecode."""
    assert not sys.dont_write_bytecode
