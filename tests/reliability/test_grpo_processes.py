"""GRPO across processes: a run killed with SIGKILL resumes bitwise (the rollouts' sampling key is part of the
training state, the prompts' order is derived from the step), and two processes joined over gloo train as
one process does on the same two devices (rollouts generated on the mesh, rewards on every process)."""

import json
import signal

import numpy as np
import pytest
from faultrun import TINY, run_worker
from test_two_process_dpo import launch

WORDS = ["red", "blue", "green", "cat", "dog", "tree", "sun", "moon", "fish", "bird", "rock", "leaf"]


def prompts(path, n=48):
    with open(path, "w") as fh:
        for i in range(n):
            w = WORDS[i % len(WORDS)]
            fh.write(json.dumps({"prompt": f"say {w}:", "answer": w}) + "\n")
    return str(path)


def grpo(data, *extra):
    return [
        "trainer=grpo",
        f"data.train={data}",
        "reward_funcs=[grpo_rewards.letter_e,grpo_rewards.says_the_answer]",
        "reward_weights=[1.0,0.5]",
        "num_generations=4",
        "max_prompt_length=16",
        "max_completion_length=16",  # TINY: max_sequence_length=32
        "learning_rate=3e-3",
        *extra,
    ]


def killed_then_resumed(tmp_path, args, kill_after=5) -> list[dict]:
    """A reference run of `args`, then the same run killed (SIGKILL) after step `kill_after` and resumed: their
    final weights are bitwise equal. Returns the resumed run's metrics rows."""
    ref, _, err = run_worker(tmp_path / "ref", *args)
    assert ref.returncode == 0, err[-3000:]
    killed, _, _ = run_worker(tmp_path / "run", *args, stop_after=kill_after)
    assert killed.returncode == -signal.SIGKILL
    again, _, err = run_worker(tmp_path / "run", *args)
    assert again.returncode == 0, err[-3000:]
    assert "resumed from checkpoint" in err
    a, b = np.load(tmp_path / "ref" / "final.npz"), np.load(tmp_path / "run" / "final.npz")
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_sigkill_during_grpo_then_resume_ends_bitwise_equal(tmp_path, engine):
    """With either sampler (`generation_backend`): the paged engine's samples depend on the step's key, the request
    and the position only, so the resumed run samples what the uninterrupted one did."""
    # synchronous saves: checkpoint 4 is complete when step 5 runs, whatever the machine's load
    args = [*TINY, *grpo(prompts(tmp_path / "p.jsonl")), "max_training_steps=8", "async_checkpointing=false"]
    args.append(f"generation_backend={engine}")
    rows = killed_then_resumed(tmp_path, args)
    assert any("train/rewards/letter_e/mean" in r and "train/reward" in r for r in rows), rows[-1]


def test_sigkill_during_a_multi_turn_grpo_run_then_resume_ends_bitwise_equal(tmp_path):
    """Tool exchanges in the rollouts (issue 54) resume bitwise: an environment per row (`Counter`, its reward its
    own), a `rollout_func` whose first turn calls the row's tool, the tool's answer appended and the model's
    continuation sampled in process — all on the command line, as dotted paths."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from tool_calling import chat_tokenizer

    chat_tokenizer().save_pretrained(tmp_path / "tokenizer")
    with open(tmp_path / "p.jsonl", "w") as fh:
        for i in range(16):
            fh.write(json.dumps({"prompt": [{"role": "user", "content": f"Count {i}."}], "target": 1 + i % 3}) + "\n")
    args = [
        *TINY, "trainer=grpo", f"data.train={tmp_path / 'p.jsonl'}", f"data.tokenizer={tmp_path / 'tokenizer'}",
        "environment_factory=grpo_rewards.Counter", "rollout_func=grpo_rewards.first_turn", "num_generations=2",
        "max_completion_length=48", "max_sequence_length=null", "model.max_position_embeddings=512",
        "learning_rate=3e-3", "max_training_steps=6", "save_steps=2", "async_checkpointing=false",
    ]  # fmt: skip
    rows = killed_then_resumed(tmp_path, args, kill_after=3)
    tools = [r for r in rows if "train/tools/call_frequency" in r]
    assert tools and all(
        r["train/tools/call_frequency"] == 1.0 and r["train/tools/failure_frequency"] == 0.0 for r in tools
    )
    assert all(r["train/tools/turns"] == 1.0 for r in tools)  # the tool's turn is in every row, a reply after it
    assert all(0 <= r["train/rewards/Counter/mean"] <= 1 for r in tools)


@pytest.mark.parametrize("staleness", [0, 1])
def test_two_processes_train_grpo_as_one_process(tmp_path, staleness):
    """Synchronous, and asynchronous (`max_staleness=1`: each process draws the next rollout on the mesh and scores
    it on its threads while the step trains)."""
    args = [*grpo(prompts(tmp_path / "p.jsonl")), "max_sequence_length=32", "max_training_steps=4", "save_steps=2"]
    args += [f"max_staleness={staleness}"]
    launch(tmp_path / "one", 1, args, devices=2)
    outs = launch(tmp_path / "two", 2, args, devices=1)
    assert all("STEP 4" in o for o in outs)
    one, two = np.load(tmp_path / "one" / "final.npz"), np.load(tmp_path / "two" / "final.npz")
    assert sorted(one) == sorted(two)
    for k in one:  # the same global mesh, the same rollouts; only the reductions' transport differs
        np.testing.assert_allclose(one[k], two[k], rtol=2e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("devices", [2, 3], ids=["device-to-device", "through-the-hosts"])
def test_two_processes_give_each_a_device_to_sampling_and_train_as_one_process(tmp_path, devices):
    """`sampling_devices=2` over two processes: each process gives its first device to the sampler's mesh and trains
    on the others; the next rollout is drawn there on a thread while the step trains (`max_staleness=1`) — and the run
    ends where one process of as many devices, split alike, ends. With 2 devices a process the weights reach the
    sampler device to device within each process (each holds the parts its sampling device needs); with 3 the
    training mesh cuts them in 4 and the sampler's in 2, so they go through the hosts (`sampler.moved`)."""
    args = [*grpo(prompts(tmp_path / "p.jsonl")), "max_sequence_length=32", "max_training_steps=4", "save_steps=2"]
    args += ["max_staleness=1", "sampling_devices=2"]
    launch(tmp_path / "one", 1, args, devices=2 * devices)
    outs = launch(tmp_path / "two", 2, args, devices=devices)
    assert all("STEP 4" in o for o in outs)
    one, two = np.load(tmp_path / "one" / "final.npz"), np.load(tmp_path / "two" / "final.npz")
    assert sorted(one) == sorted(two)
    for k in one:
        np.testing.assert_allclose(one[k], two[k], rtol=2e-5, atol=1e-6, err_msg=k)


def test_a_grpo_run_from_the_command_line_is_usable_afterwards(tmp_path, capsys):
    """A GRPO run started as docs/rl.md shows (the demo's defaults underneath, no max_sequence_length given)
    used to record the demo's 128-token rows in run_config.json, so `generate`, `convert` and `train RUN_DIR`
    all refused its directory (issue 51): what a run directory records is what ran."""
    from jaxloom.trainer.cli import main

    run = tmp_path / "run"
    model = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1"]
    argv = ["train", "trainer=grpo", f"data.train={prompts(tmp_path / 'p.jsonl', n=8)}"]
    argv += ["reward_funcs=grpo_rewards.letter_e", "num_generations=2", "max_completion_length=8"]
    argv += ["total_batch_size=8", "max_training_steps=2", *model, f"save_directory={run}", "progress_bar=false"]
    assert main(argv) == 0
    recorded = json.loads((run / "run_config.json").read_text())
    assert "max_sequence_length" not in recorded and recorded["trainer"] == "grpo"
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "say red:", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith(">>> say red:\n")
    assert main(["convert", "--to-hf", str(run), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    assert main(["train", str(run)]) == 4  # resumed by its directory: already complete (exit 4)
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{\n") :])["stop_reason"].startswith("already complete"), out
    # its evaluation pass (TRL's): held-out prompts completed by the trained policy and scored by its rewards
    assert main(["eval", str(run), f"data.eval={prompts(tmp_path / 'e.jsonl', n=4)}"]) == 0
    scores = json.loads(capsys.readouterr().out)  # under metrics.jsonl's eval/ names, as docs/rl.md says (issue 70)
    assert scores["step"] > 0 and 0 <= scores["eval/reward"] <= 1
    assert scores["eval/rewards/letter_e/mean"] == pytest.approx(scores["eval/reward"])
    assert 0 < scores["eval/completions/mean_length"] <= 8 and "eval/evaluation_time" in scores
