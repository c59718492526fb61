"""Issue 78: the user's code in an RL run (reward functions, environments, tools, `rollout_func`) fails in one closing
line plus the user's own frames — none of jaxloom's — and never hangs the run: a tool turn waits its limit once,
however many calls block, on a bounded set of threads; `async def` rewards and tools run concurrently.

The functions below are "the user's code": this file is neither jaxloom's nor an installed package's."""

import asyncio
import functools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxloom.trainer.grpo.environments import Environments, EnvironmentCallError
from jaxloom.trainer.grpo.rewards import RewardError, RewardTimeoutError, call_reward, concurrently, is_async
from jaxloom.trainer.grpo.drawing import RolloutFuncError, call_rollout
from jaxloom.trainer.grpo.tools import ToolError, ToolSet, ToolWorkers
from jaxloom.trainer.usercode import FULL_TRACEBACK, for_terminal, is_users

HERE = str(Path(__file__).resolve())
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
PROMPTS, COMPLETIONS = ["a", "b", "c"], ["x", "yy", "zzz"]
WHERE = ["dataset_train record 7", "dataset_train record 7", "dataset_train record 9"]


def parse_answer(text):
    return {"x": 1.0, "yy": 0.5}[text]


def raises(prompts, completions, **kwargs):
    return [parse_answer(c) for c in completions]


def too_few(prompts, completions, **kwargs):
    return [1.0]


def not_a_number(prompts, completions, **kwargs):
    return [0.0, float("nan"), 1.0]


def hangs(prompts, completions, **kwargs):
    threading.Event().wait()


async def judge_raises(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [parse_answer(c) for c in completions]


@functools.cache
def chat_tokenizer():
    """The tool-calling example's chat tokenizer (the bundled one with Qwen-style tool tokens and template)."""
    sys.path.insert(0, str(EXAMPLES))
    from tool_calling import chat_tokenizer as make

    return make()


def shown(error):
    """What the terminal shows for `error` (the run's notes added as the session adds them)."""
    error.add_note("jaxloom: training stopped during step 3; the newest complete checkpoint is run/checkpoints/2")
    return for_terminal(error)


def assert_only_users_frames(text):
    files = [line.split('"')[1] for line in text.splitlines() if line.strip().startswith('File "')]
    assert files, text
    assert all(is_users(f) for f in files), text
    assert all(f == HERE for f in files), text  # the frames are this file's: the user's
    assert text.splitlines()[-3].startswith("jaxloom: error: "), text
    assert "training stopped during step 3" in text.splitlines()[-2]


@pytest.mark.parametrize(
    ("fn", "kind", "said"),
    [
        (raises, RewardError, "reward function raises raised on dataset_train record 9 (KeyError: 'zzz')"),
        (too_few, RewardError, "reward function too_few returned 1 rewards for 3 completions"),
        (not_a_number, RewardError, "returned nan for completion 1 (dataset_train record 7)"),
        (hangs, RewardTimeoutError, "did not return within reward_timeout = 0.3 s"),
        (judge_raises, RewardError, "judge_raises raised on dataset_train record 9 (KeyError: 'zzz')"),
    ],
)
def test_a_failing_reward_is_one_line_and_the_users_frames(fn, kind, said):
    with pytest.raises(kind) as caught:
        call_reward(fn, PROMPTS, COMPLETIONS, {}, timeout=0.3, where=WHERE)
    assert said in str(caught.value)
    text = shown(caught.value)
    assert_only_users_frames(text)
    if fn is raises:  # the user's traceback: the reward, then the helper that raised
        assert "in raises" in text and "in parse_answer" in text and "return {" in text
    if fn is hangs:  # where the function was waiting when it was cut
        assert "when it was cut" in text and "threading.Event().wait()" in text
    if fn in (too_few, not_a_number):  # nothing raised: the function itself is pointed at
        assert "def " + fn.__name__ in text


def test_the_whole_traceback_is_behind_a_setting(monkeypatch):
    with pytest.raises(RewardError) as caught:
        call_reward(raises, PROMPTS, COMPLETIONS, {}, where=WHERE)
    monkeypatch.setenv(FULL_TRACEBACK, "full")
    text = for_terminal(caught.value)
    assert "jaxloom/trainer/grpo/rewards.py" in text and "in parse_answer" in text


class Broken:
    def reset(self, **row):
        return self.lookup(row["name"])

    def lookup(self, name: str) -> str:
        """Look a name up.

        Args:
            name: The name.
        """
        raise ConnectionError(f"no such host {name}")


def test_an_environments_reset_and_a_rollout_func_fail_in_one_line(tmp_path):
    envs = Environments(Broken, tokenizer=chat_tokenizer())
    with pytest.raises(EnvironmentCallError) as caught:
        envs.reset(envs.draw([None]), [{"name": "db"}], ["dataset_train record 4"])
    assert "Broken.reset raised on dataset_train record 4 (ConnectionError: no such host db)" in str(caught.value)
    text = shown(caught.value)
    assert_only_users_frames(text)
    assert "in reset" in text and "in lookup" in text

    def my_rollout(prompts):
        return {"prompt_ids": [parse_answer(p) for p in prompts]}

    with pytest.raises(RolloutFuncError) as caught:
        call_rollout(my_rollout, ["q"])
    assert "rollout_func my_rollout raised on this step's 1 prompts (KeyError: 'q')" in str(caught.value)
    assert_only_users_frames(shown(caught.value))


def exits(city: str) -> str:
    """Leaves the process.

    Args:
        city: A city.
    """
    sys.exit(3)


def block(city: str) -> str:
    """Blocks for ever.

    Args:
        city: A city.
    """
    threading.Event().wait()
    return "never"


def call(name):
    return [{"type": "function", "function": {"name": name, "arguments": {"city": "Oslo"}}}]


def test_a_tool_turn_waits_its_limit_once_on_bounded_threads():
    """Eight rows whose tool blocks for ever: the turn ends at the limit (once, not once per call), every call cut
    and counted; a second such turn does too, with the threads still bounded (the ninth row onwards never starts a
    thread: it waits for one and is cut at the limit)."""
    workers = ToolWorkers(10)
    tools = ToolSet([block], chat_tokenizer(), timeout=0.5, workers=workers)
    for _ in range(2):
        started = time.monotonic()
        out = tools.run_turn([(call("block"), None) for _ in range(8)])
        assert time.monotonic() - started < 0.5 + 2.0  # the limit once, not 8 × 0.5 s
        assert [failed for _, failed in out] == [1] * 8
        assert all("block took longer than 0.5 s and was cut" in m[0]["content"] for m, _ in out)
        assert workers.threads <= 10


def test_a_rows_calls_run_in_order_and_rows_run_concurrently():
    barrier = threading.Barrier(4, timeout=10)

    def meet(city: str) -> str:
        """Waits for the other rows' calls.

        Args:
            city: A city.
        """
        barrier.wait()  # passes only if the four rows' calls run at once
        return f"met in {city}"

    tools = ToolSet([meet, block], chat_tokenizer(), timeout=20.0)
    out = tools.run_turn([(call("meet"), None) for _ in range(4)])
    assert [m[0]["content"] for m, _ in out] == ["met in Oslo"] * 4
    cut = ToolSet([block, meet], chat_tokenizer(), timeout=0.3)
    ((messages, failed),) = cut.run_turn([(call("block") + call("meet"), None)])
    assert failed == 2 and "was cut" in messages[0]["content"] and "not run" in messages[1]["content"]


def test_a_tool_that_leaves_the_process_stops_the_run_by_name():
    tools = ToolSet([exits], chat_tokenizer(), timeout=5.0)
    with pytest.raises(ToolError, match=r"tool exits raised SystemExit: 3, which stops the run") as caught:
        tools.run_turn([(call("exits"), None)])
    assert_only_users_frames(shown(caught.value))


def test_async_rewards_and_tools_run_concurrently():
    """Two `async def` rewards that each wait for the other (a barrier of two, in their event loops' threads) finish
    only when they run at once, beside a synchronous one; an `async def` tool is awaited."""
    barrier = threading.Barrier(2, timeout=10)

    async def judge_a(prompts, completions, **kwargs):
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
        return [1.0] * len(completions)

    async def judge_b(prompts, completions, **kwargs):
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
        return [2.0] * len(completions)

    def plain(prompts, completions, **kwargs):
        return [3.0] * len(completions)

    funcs = [judge_a, plain, judge_b]
    out = concurrently(
        lambda f: call_reward(f, PROMPTS, COMPLETIONS, {}, timeout=20), funcs, list(map(is_async, funcs))
    )
    np.testing.assert_array_equal(np.stack(out, axis=1)[0], [1.0, 3.0, 2.0])

    async def weather(city: str) -> str:
        """The weather.

        Args:
            city: A city.
        """
        await asyncio.sleep(0)
        return f"sunny in {city}"

    ((messages, failed),) = ToolSet([weather], chat_tokenizer()).run_turn([(call("weather"), None)])
    assert failed == 0 and messages[0]["content"] == "sunny in Oslo"


# ---- through the command line -----------------------------------------------------------------------------
USER_MODULE = '''
import json
import os
import threading


def score(c):
    return {"never": 1.0}[c]


def fails_when_told(prompts, completions, **kwargs):
    calls = int(open("calls").read()) if os.path.exists("calls") else 0
    open("calls", "w").write(str(calls + 1))
    if calls >= 1 and os.path.exists("FAIL"):
        return [score(c) for c in completions]
    return [c.count("e") / max(len(c), 1) for c in completions]


def block(city: str) -> str:
    """Blocks for ever.

    Args:
        city: A city.
    """
    threading.Event().wait()
    return "never"


def calls_block(prompts, trainer):
    tok = trainer.tokenizer
    call = json.dumps({"name": "block", "arguments": {"city": "Oslo"}})
    ids = tok.encode(f"<tool_call>\\n{call}\\n</tool_call><|im_end|>", add_special_tokens=False)
    return {
        "prompt_ids": [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
                       for p in prompts],
        "completion_ids": [ids for _ in prompts],
        "logprobs": [[-1.0] * len(ids) for _ in prompts],
    }


def length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def told(prompts, completions, **kwargs):
    """Fails as the file FAIL says, from its second call on: nan, hang."""
    calls = int(open("calls").read()) if os.path.exists("calls") else 0
    open("calls", "w").write(str(calls + 1))
    how = open("FAIL").read().strip() if calls >= 1 and os.path.exists("FAIL") else ""
    if how == "hang":
        threading.Event().wait()
    return [float("nan") if how == "nan" else 0.5 + 0.1 * (i % 2) for i in range(len(completions))]


class Lookup:
    def reset(self, **row):
        return fetch(row["prompt"])

    def get_reward(self):
        return 1.0


def fetch(prompt):
    raise ConnectionError("no route to the environment's host")


def my_rollout(prompts, trainer):
    return fetch(prompts[0])
'''
TINY = [
    "trainer=grpo", "num_generations=2", "total_batch_size=8", "model.hidden_size=32", "model.intermediate_size=64",
    "model.num_hidden_layers=1", "progress_bar=false", "use_tensorboard=false", "plot_loss=false", "save_directory=run",
]  # fmt: skip


def jaxloom(work, *argv):
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=1 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}",
    }
    return subprocess.run(
        [sys.executable, "-m", "jaxloom.trainer.cli", "train", *TINY, *argv],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_reward_that_fails_mid_run_from_the_command_line(tmp_path):
    """Exit 1; stderr ends in the user's frames and the closing lines (the error, the step, the checkpoint to
    resume from), no frame of jaxloom's; every trained step is checkpointed; fixed, the same command resumes."""
    (tmp_path / "user_rewards.py").write_text(USER_MODULE)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"say w{i}:"}) + "\n" for i in range(16)))
    (tmp_path / "FAIL").touch()
    argv = ["data.train=p.jsonl", "reward_funcs=user_rewards.fails_when_told", "max_completion_length=8"]
    argv += ["max_training_steps=3", "save_steps=1", "async_checkpointing=false"]
    failed = jaxloom(tmp_path, *argv)
    assert failed.returncode == 1, failed.stderr[-3000:]
    err = failed.stderr
    assert "Traceback (most recent call last)" not in err and "jaxloom/trainer" not in err, err
    tail = err[err.index("Traceback of your code") :].splitlines()
    assert [line.split('"')[1] for line in tail if line.strip().startswith('File "')] == [
        str(tmp_path / "user_rewards.py")
    ] * 3  # the reward, its list comprehension, the helper that raised
    assert tail[-3].startswith("jaxloom: error: RewardError: reward function fails_when_told raised on dataset_train")
    assert "(KeyError: " in tail[-3]
    assert tail[-2].startswith("jaxloom: training stopped during step 2; the newest complete checkpoint is")
    assert "resumes from it" in tail[-2]
    assert (tmp_path / "run" / "checkpoints" / "1").is_dir()
    (tmp_path / "FAIL").unlink()
    again = jaxloom(tmp_path, *argv)
    assert again.returncode == 0 and "resumed from checkpoint" in again.stderr, again.stderr[-3000:]


def test_eight_rows_whose_tool_blocks_for_ever_from_the_command_line(tmp_path):
    """A step's 8 rows each call a tool that never returns: each step waits the limit once (`time/tools_s`), the
    calls are counted as failures (`tools/failure_frequency` 1) and the run ends."""
    chat_tokenizer().save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "user_rewards.py").write_text(USER_MODULE)
    chats = [{"prompt": [{"role": "user", "content": f"Weather {i}?"}]} for i in range(16)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    done = jaxloom(
        tmp_path, "data.train=p.jsonl", "data.tokenizer=tokenizer", "tools=user_rewards.block",
        "rollout_func=user_rewards.calls_block", "reward_funcs=user_rewards.length", "max_completion_length=48",
        "max_sequence_length=null", "model.max_position_embeddings=512", "max_training_steps=2", "logging_steps=1",
        "tool_timeout=1", "max_tool_calling_iterations=1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/tools/failure_frequency" in r]
    assert len(steps) == 2, rows
    assert all(r["train/tools/failure_frequency"] == 1.0 and r["train/tools/call_frequency"] == 1.0 for r in steps)
    assert all(r["train/time/tools_s"] < 1 + 1.0 for r in steps)  # the 1 s limit once, not 8 × 1 s


@pytest.mark.parametrize(
    ("case", "argv", "closing"),
    [
        ("nan", ["reward_funcs=user_rewards.told"], "RewardError: reward function told returned nan for completion 0"),
        (
            "hang",
            ["reward_funcs=user_rewards.told", "reward_timeout=2"],
            "RewardTimeoutError: reward function told did not return within reward_timeout = 2 s",
        ),
        (
            "reset",
            ["environment_factory=user_rewards.Lookup", "data.tokenizer=tokenizer", "max_sequence_length=null"],
            "EnvironmentCallError: environment Lookup.reset raised on dataset_train record",
        ),
        (
            "rollout_func",
            ["rollout_func=user_rewards.my_rollout", "reward_funcs=user_rewards.length"],
            "RolloutFuncError: rollout_func my_rollout raised on this step's",
        ),
    ],
    ids=["nan", "hang", "reset", "rollout_func"],
)
def test_each_kind_of_user_code_fails_in_its_own_frames_from_the_command_line(tmp_path, case, argv, closing):
    """A reward's NaN and its hang (cut by `reward_timeout`: where it waited is shown), an environment's `reset` and a
    `rollout_func` that raise: exit 1, the user's frames and the closing line on stderr, none of jaxloom's frames."""
    (tmp_path / "user_rewards.py").write_text(USER_MODULE)
    (tmp_path / "FAIL").write_text(case)
    records = [{"prompt": f"say w{i}:"} for i in range(16)]
    if case == "reset":  # an environment's rows are chats, rendered by a template that renders tools
        chat_tokenizer().save_pretrained(tmp_path / "tokenizer")
        records = [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in records]
        argv = [*argv, "model.max_position_embeddings=512"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    failed = jaxloom(tmp_path, "data.train=p.jsonl", "max_completion_length=8", "max_training_steps=3", *argv)
    assert failed.returncode == 1, failed.stderr[-3000:]
    err = failed.stderr
    assert "Traceback (most recent call last)" not in err and "jaxloom/trainer" not in err, err
    lines = err[err.index("jaxloom: error: ") :].splitlines()
    assert lines[0].startswith(f"jaxloom: error: {closing}"), lines[0]
    assert lines[1].startswith("jaxloom: training stopped during step") or case in ("reset", "rollout_func"), lines
    files = {line.split('"')[1] for line in err.splitlines() if line.strip().startswith('File "')}
    assert files == {str(tmp_path / "user_rewards.py")}, err


def test_tool_workers_sizes_the_runs_threads_and_the_setting_is_checked():
    import jaxloom.models as jm
    from jaxloom.trainer import GRPOConfig, GRPOTrainer

    from util import tiny

    args = GRPOConfig(num_generations=2, total_batch_size=4, max_completion_length=8, tool_workers=3)
    trainer = GRPOTrainer(
        args, model=jm.create_model(tiny(), lazy=True), processing_class=chat_tokenizer(), tools=[block],
        reward_funcs=[raises], dataset_train=[{"prompt": [{"role": "user", "content": "hi"}]}] * 4,
    )  # fmt: skip
    assert trainer.tool_set.workers.size == 3
    with pytest.raises(ValueError, match="tool_workers = 0; expected a positive finite number"):
        GRPOConfig(num_generations=2, total_batch_size=4, tool_workers=0)
