"""Every script in examples/ runs, as a user would start it (a fresh process, one CPU device), with tiny
settings, and does what its docstring says."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str, *args: str, timeout: int = 600) -> str:
    # One CPU device and XLA's own optimisation, as on a laptop: unlike the unit tests' programs (compiled to run a
    # few steps, where LLVM's passes cost more than they save), an example trains for hundreds of steps. Measured
    # on the tool-calling example (162 steps, cold compile cache): 67 s with the tests' -O0 settings, 47 s without.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def final_metrics(stdout: str) -> dict:
    line = next(x for x in stdout.splitlines() if x.startswith("final metrics: "))
    return json.loads(line.removeprefix("final metrics: "))


def test_every_example_is_tested():
    tested = set(re.findall(r'run\("(\w+\.py)"', Path(__file__).read_text()))
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_pretrain(tmp_path):
    out = run("pretrain.py", "--out", str(tmp_path), "--steps", "4", "--tiny")
    metrics = final_metrics(out)
    assert 0 < metrics["loss"] < 9 and 0 < metrics["eval_loss"] < 9
    assert "stopped: max_training_steps reached; resumed from: None" in out
    for name in ("report.md", "loss.png", "metrics.jsonl", "checkpoints/4"):
        assert (tmp_path / name).exists(), name
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]


def test_sft_chat_trains_only_on_the_answers(tmp_path):
    out = run("sft_chat.py", "--out", str(tmp_path), "--steps", "4", "--tiny")
    total, trained = map(int, re.search(r"one record: (\d+) tokens, (\d+) of them trained on", out).groups())
    assert 0 < trained < total / 2
    assert final_metrics(out)["loss"] < 9
    assert re.search(r"held-out exact match: \d\.\d\d", out)


def test_reward_model_learns_its_pairs_and_drives_grpo(tmp_path):
    out = run("reward_model.py", "--out", str(tmp_path), "--steps", "20", "--tiny")
    accuracy = float(re.search(r"held-out accuracy (\S+),", out).group(1))
    assert accuracy >= 0.9, out[-2000:]
    assert (tmp_path / "reward_model" / "config.json").is_file()
    assert re.search(r"GRPO with the reward model: 2 steps, last rewards/reward_model/mean -?\d", out), out[-2000:]


def test_kto_feedback_learns_which_answers_are_good(tmp_path):
    out = run("kto_feedback.py", "--out", str(tmp_path), "--steps", "60", "--tiny")
    margin = float(re.search(r"KTO: 60 steps; held-out .* margin (\S+)", out).group(1))
    assert margin > 0.1, out[-2000:]  # held-out good answers rewarded above bad ones: learnt, not known
    assert (tmp_path / "checkpoints" / "60").is_dir()


def test_distillation_trains_a_teacher_then_a_smaller_student(tmp_path):
    out = run("distillation.py", "--out", str(tmp_path), "--steps", "4", "--tiny")
    assert re.search(r"teacher: 20 steps of next-token training, loss \d", out), out[-2000:]
    loss = float(re.search(r"student: 4 steps of distillation, last loss (\S+)", out).group(1))
    assert 0 < loss < 0.7, out[-2000:]  # the JSD is at most ln 2
    assert (tmp_path / "student" / "checkpoints").is_dir()


def test_tool_calling_is_learned_from_the_environments_reward_alone(tmp_path):
    """Issue 54: a tiny chat model that calls the tool in one chat of five before RL makes well-formed calls in most
    completions after 12 GRPO steps whose only reward is the environment's (docs/rl.md states the curve)."""
    out = run("tool_calling.py", "--out", str(tmp_path), "--tiny")
    said = re.search(r"reward \(completions whose call ran\): (\S+) at step 1, (\S+) over", out)
    first, last = map(float, said.groups())
    assert first <= 0.4 and last >= 0.6, out[-2500:]
    assert (tmp_path / "grpo" / "checkpoints").is_dir()


def test_gspo_learns_the_toy_reward(tmp_path):
    """GSPO (`importance_sampling_level="sequence"`, two steps a rollout): the reward at least doubles."""
    out = run("gspo.py", "--out", str(tmp_path), "--tiny")
    first, last = map(float, re.search(r"share of e\): (\S+) over the first 5 steps, (\S+) over", out).groups())
    assert last > 2 * first and last > 0.2, out[-2000:]


def test_finetune_hf_llama_round_trips_through_hf_format(tmp_path):
    out = run("finetune_hf_llama.py", "--make-tiny-model", "--out", str(tmp_path), "--steps", "3")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "hf" / name).is_file(), name
    change = float(re.search(r"largest weight change from the base model: (\S+)", out).group(1))
    assert 0 < change < 0.1  # trained (moved), but from the base weights (not from scratch)


@pytest.mark.alone  # 34 s on a quiet machine; 264-345 s beside busy workers, past the gang's 300 s startup limit once
def test_ray_two_workers(tmp_path):
    run("ray_two_workers.py", "--out", str(tmp_path), "--tiny", "--steps", "4")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["attempts"] == 1 and summary["failures"] == []
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["processes"] == 2 and r["step"] == 4 for r in ranks)
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]  # one model, sharded over both processes
    assert (tmp_path / "checkpoints" / "4").is_dir()


@pytest.mark.alone  # 43 s on a quiet machine, 80-235 s beside two busy workers: the meta target's longest case
def test_tune_sweep(tmp_path):
    out = run("tune_sweep.py", "--out", str(tmp_path), "--tiny", "--steps", "2")
    losses = {int(k): float(v) for k, v in re.findall(r"trial \{'scaling_index': (\d)\}: eval_loss=(\S+)", out)}
    assert set(losses) == {1, 2}
    best = min(losses, key=losses.get)
    assert f"best: {{'scaling_index': {best}}}" in out
    assert (tmp_path / "sweep").is_dir()
