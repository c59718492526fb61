"""The README's first command, `python3 -m nox -s demo`, exits with jaxloom's code: 0 for a run, 4 when the run
directory is already complete (the README says so). nox's `session.run` returns True, not the code, so the
session runs the command itself; here the session function runs with the real `jaxloom` of this environment
(tiny sizes) and a stand-in for nox's session object (no new venv)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("nox")  # installed by `nox -s tests` (meta target)

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
    "max_sequence_length=32",
    "total_batch_size=8",
    "progress_bar=false",
    "max_training_steps=2",
    "evaluation_steps=2",
    "generation_prompts=[]",
]


class Session:
    """What the demo session uses of nox's: install (a no-op: the parts are installed here), bin, env, posargs, log."""

    venv_backend = "none"

    def __init__(self, posargs):
        self.posargs, self.bin, self.env, self.logged = posargs, os.path.dirname(sys.executable), {}, []

    def install(self, *args, **kwargs):
        pass

    def log(self, text):
        self.logged.append(text)


def test_the_finished_demo_exits_4_through_the_nox_session(tmp_path):
    spec = importlib.util.spec_from_file_location("jaxloom_noxfile", ROOT / "noxfile.py")
    noxfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noxfile)
    if not (Path(os.path.dirname(sys.executable)) / "jaxloom").exists():
        pytest.skip("the jaxloom command is not installed in this environment")
    run = [f"save_directory={tmp_path / 'demo'}", *TINY]
    first = Session(run)
    noxfile.demo(first)  # trains: exit 0, no SystemExit
    assert (tmp_path / "demo" / "report.md").is_file()
    again = Session(run)
    with pytest.raises(SystemExit) as stopped:
        noxfile.demo(again)
    assert stopped.value.code == 4 and any("already complete" in line for line in again.logged)
