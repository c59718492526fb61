"""Every bad input gives one clear error naming the value and what was expected, and loses nothing."""

import re
from pathlib import Path

import pytest
from bad_inputs import CASES, run_case

DOC = Path(__file__).parents[2] / "docs" / "reliability.md"


@pytest.mark.parametrize("name, function, pattern", CASES, ids=[c[1] for c in CASES])
def test_bad_input_gives_one_clear_error(tmp_path, name, function, pattern):
    (tmp_path / "earlier.txt").write_text("written before")
    err = run_case(function, tmp_path)
    assert re.search(pattern, str(err)), f"{name}: {type(err).__name__}: {err}"
    assert "Traceback" not in str(err) and len(str(err)) < 2000
    assert (tmp_path / "earlier.txt").read_text() == "written before"
    if function != "checkpoint_shape":  # nothing half-written for a run that never started
        assert not (tmp_path / "run" / "checkpoints").exists() or function == "missing_checkpoint"


def test_checkpoint_of_another_shape_leaves_the_checkpoint_intact(tmp_path):
    run_case("checkpoint_shape", tmp_path)
    from jaxloom.state import CheckpointManager

    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).all_steps() == [2]


def test_docs_list_every_case():
    text = DOC.read_text()
    missing = [name for name, _, _ in CASES if f"| {name} |" not in text]
    assert not missing, f"docs/reliability.md lacks {missing}"
