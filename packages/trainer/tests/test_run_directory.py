"""The run directory component alone: one owner, an earlier run's fate, and what overwriting may touch."""

from pathlib import Path

import pytest

from jaxloom.trainer import TrainingArguments
from jaxloom.trainer.run_directory import RunDirectory


def _earlier_run(root: Path, checkpoints: Path) -> None:
    (checkpoints / "4").mkdir(parents=True)
    (checkpoints / "4" / "params").write_text("x")
    (checkpoints / "8.orbax-checkpoint-tmp-1764100000").mkdir()
    (checkpoints / "2.corrupt").mkdir()
    (root / "metrics.jsonl").write_text("{}\n")


def test_overwrite_removes_only_what_jaxloom_wrote(tmp_path):
    """overwrite_output_dir with a checkpoint_directory outside the run: the steps there go, the folder and
    the user's own files stay (issue 43: the whole folder was removed, user files included)."""
    run, ckpts = tmp_path / "run", tmp_path / "shared-ckpts"
    run.mkdir()
    _earlier_run(run, ckpts)
    (ckpts / "notes.txt").write_text("mine")
    (ckpts / "2024-plan").mkdir()
    (run / "my-analysis.ipynb").write_text("mine too")
    args = TrainingArguments(save_directory=str(run), checkpoint_directory=str(ckpts), overwrite_output_dir=True)
    rd = RunDirectory(args.checkpoint)
    assert rd.take(is_process_zero=True) is True
    rd.release()
    assert sorted(p.name for p in ckpts.iterdir()) == ["2024-plan", "notes.txt"]
    assert (run / "my-analysis.ipynb").read_text() == "mine too" and not (run / "metrics.jsonl").exists()


def test_an_earlier_run_is_resumed_or_refused(tmp_path):
    run = tmp_path / "run"
    _earlier_run(run, run / "checkpoints")
    resume = RunDirectory(TrainingArguments(save_directory=str(run)).checkpoint)
    assert resume.take(is_process_zero=True) is False and (run / "checkpoints" / "4").is_dir()
    resume.release()
    refuse = RunDirectory(TrainingArguments(save_directory=str(run), resume_if_possible=False).checkpoint)
    with pytest.raises(ValueError, match=r"holds checkpoints \[4\]"):
        refuse.take(is_process_zero=True)
