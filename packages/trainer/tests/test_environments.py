"""Environments and custom rollouts in GRPO (issue 54, TRL 1.16's `environment_factory` and `rollout_func`): one
instance per rollout row, reset with its record (its text appended to the prompt), its methods the row's tools, its
`get_reward` a reward of its own (no `reward_funcs` needed); a dict of environments routed by each record's
`environment`; faults of `reset` and `get_reward` stop the run naming the class, the method and the record, the
last checkpoint kept; a `rollout_func`'s rows, `env_mask` and extra fields used as TRL uses them. Generation is
scripted (a random tiny model calls no tool): what is checked is what jaxloom does around it."""

import json

import numpy as np
import pytest

pytest.importorskip("trl")
from test_tools import family_tokenizer  # noqa: E402
from util import mesh  # noqa: E402

import jaxloom.models as jm  # noqa: E402
from jaxloom.trainer import GRPOConfig, GRPOTrainer  # noqa: E402
from jaxloom.trainer.grpo import sampler  # noqa: E402

TOK = family_tokenizer("qwen2_5")
MADE: list = []


class Counter:
    """A counter to bring to a target: `increment` is its tool, the reward is reaching the target."""

    def __init__(self):
        MADE.append(self)
        self.count, self.target, self.resets = 0, None, 0

    def reset(self, **row) -> str:
        self.count, self.target, self.resets = 0, row["target"], self.resets + 1
        if row.get("fail") == "reset":
            raise KeyError("no such board")
        return f" Reach {row['target']}."

    def increment(self, step: int) -> str:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return str(self.count)

    def get_reward(self) -> float:
        if self.target == 99:
            raise ZeroDivisionError("scoring broke")
        return float(self.count == self.target)


class Echo:
    """A second environment, without a reward of its own: its rows get none from `Counter`."""

    def reset(self, **row) -> None:
        return None

    def shout(self, text: str) -> str:
        """Shout a text.

        Args:
            text: What to shout.
        """
        return text.upper()


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call><|im_end|>"


def scripted(first):
    """A stand-in for `Sampler.generate`: the first turn of row r is `first(r)`, a later turn replies."""
    reply = TOK.encode("Done.<|im_end|>", add_special_tokens=False)

    def generate(self, prompt, mask, key, *, group=None, max_new_tokens=None, model=None):
        rows = len(prompt) * (group or self.rl.num_generations)
        width = max_new_tokens or self.rl.max_completion_length
        ids, m = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.int32)
        for r in range(rows):
            script = TOK.encode(first(r), add_special_tokens=False) if max_new_tokens is None else reply
            ids[r, : len(script)], m[r, : len(script)] = script[:width], 1
        return ids, m, np.full((rows, width), -0.5, np.float32)

    return generate


def trainer(tmp_path, records, **kw):
    config = jm.LlamaConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    settings = dict(num_generations=2, max_completion_length=64, total_batch_size=4, max_training_steps=2,
                    logging_steps=1, save_steps=1, learning_rate=1e-2, warmup_steps=0)  # fmt: skip
    inputs = {k: v for k, v in kw.items() if k in ("environment_factory", "rollout_func", "reward_funcs", "tools")}
    args = GRPOConfig(
        **{**settings, **{k: v for k, v in kw.items() if k not in inputs}},
        save_directory=str(tmp_path), progress_bar=False, use_tensorboard=False,
    )  # fmt: skip
    return GRPOTrainer(
        args,
        model=jm.create_model(config, lazy=True, seed=3),
        dataset_train=records,
        processing_class=TOK,
        mesh=mesh(1),
        **inputs,
    )


def logged(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_an_environment_gives_each_row_its_tools_and_its_reward_and_trains_without_reward_funcs(tmp_path, monkeypatch):
    """`environment_factory=Counter` and no `reward_funcs`: each row's instance is reset with its record (the text
    it returns ends the prompt, beside the schema of its `increment` method); a row's call reaches its own
    instance; `get_reward` scores it, logged as `rewards/Counter/mean`; instances are made once and reset for each
    rollout; the tool turn's tokens are not trained on; the weights move."""
    monkeypatch.setattr(sampler.Sampler, "generate", scripted(lambda r: call_text("increment", {"step": 1 + r % 2})))
    MADE.clear()
    records = [{"prompt": [{"role": "user", "content": "Count."}], "target": 2} for _ in range(4)]
    t = trainer(tmp_path, records, environment_factory=Counter)
    t.train()
    rows = logged(tmp_path)
    assert [r["train/rewards/Counter/mean"] for r in rows] == [0.5, 0.5]  # rows calling with step 2 reach 2
    assert [r["train/tools/call_frequency"] for r in rows] == [1.0, 1.0]
    assert rows[0]["train/tools/failure_frequency"] == 0.0
    # the probe instance and one per row (4 rows a rollout), reused by the second rollout: reset twice each
    assert len(MADE) == 4 and [e.resets for e in MADE] == [2, 2, 2, 2]
    batch = t.batches.cached[1]
    ids, loss_mask, seg = (np.asarray(batch[k])[0] for k in ("input_ids", "loss_mask", "segment_ids"))
    width = int(np.argmax(loss_mask[0] > 0))
    prompt_text = TOK.decode(ids[0, :width][seg[0, :width] > 0])
    assert "Count. Reach 2.<|im_end|>" in prompt_text and '"name": "increment"' in prompt_text
    completion = ids[1, width:][seg[1, width:] > 0]
    assert "<tool_response>\n2\n</tool_response>" in TOK.decode(completion)  # row 1 called with 2: its count is 2
    kept = loss_mask[1, width:][seg[1, width:] > 0]
    assert 0 < kept.sum() < len(kept)  # the tool turn read, not trained on
    assert all(np.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in rows)  # a reward to learn from


def test_a_dict_of_environments_routes_each_record_and_exposes_only_its_tools(tmp_path, monkeypatch):
    """`environment_factory={"count": Counter, "echo": Echo}`: a record's `environment` picks its class (the field
    is not passed to `reset`), its prompt renders only that class's tools, `Counter`'s reward scores its rows only
    (the `Echo` rows get none: NaN, left out of the mean), and a record naming no known environment is refused
    before step 1 naming the record, the value and the names there are."""

    def first(r):  # rows 0-1 are the Counter record's, rows 2-3 the Echo record's
        return call_text("increment", {"step": 2}) if r < 2 else call_text("shout", {"text": "hi"})

    monkeypatch.setattr(sampler.Sampler, "generate", scripted(first))
    rewards_seen = []

    def length(prompts, completions, environments, **kw):
        rewards_seen.append([type(e).__name__ for e in environments])
        return [0.0] * len(completions)

    records = [
        {"prompt": [{"role": "user", "content": "Count."}], "target": 2, "environment": "count"},
        {"prompt": [{"role": "user", "content": "Shout."}], "target": 0, "environment": "echo"},
    ]
    t = trainer(tmp_path / "a", records, environment_factory={"count": Counter, "echo": Echo}, reward_funcs=[length],
                max_training_steps=1, shuffle_train_dataset=False)  # fmt: skip
    t.train()
    assert rewards_seen[0] == ["Counter", "Counter", "Echo", "Echo"]
    row = logged(tmp_path / "a")[0]
    assert row["train/rewards/Counter/mean"] == 1.0 and row["train/tools/failure_frequency"] == 0.0
    batch = t.batches.cached[1]
    ids, seg = np.asarray(batch["input_ids"])[0], np.asarray(batch["segment_ids"])[0]
    texts = [TOK.decode(ids[i][seg[i] > 0]) for i in (0, 2)]
    assert '"increment"' in texts[0] and '"shout"' not in texts[0]
    assert '"shout"' in texts[1] and '"increment"' not in texts[1]
    assert "<tool_response>\nHI\n</tool_response>" in texts[1]

    bad = [*records, {"prompt": [{"role": "user", "content": "?"}], "target": 0, "environment": "chess"}]
    t = trainer(tmp_path / "b", bad, environment_factory={"count": Counter, "echo": Echo}, reward_funcs=[length])
    refused = r"dataset_train record 2: environment = 'chess'; expected one of \['count', 'echo'\]"
    with pytest.raises(ValueError, match=refused):
        t.train()
    assert not (tmp_path / "b" / "checkpoints").exists()


@pytest.mark.parametrize("method", ["reset", "get_reward"])
def test_a_failing_environment_stops_the_run_naming_class_method_and_record(tmp_path, monkeypatch, method):
    """`reset` (or `get_reward`) raising on a record of the second rollout stops the run with one error naming
    `Counter.<method>` and the record; checkpoint 1 stands and the note says the command that resumes it."""
    monkeypatch.setattr(sampler.Sampler, "generate", scripted(lambda r: call_text("increment", {"step": 2})))
    records = [{"prompt": [{"role": "user", "content": "Count."}], "target": 2} for _ in range(4)]
    records[3] = {**records[3], **({"fail": "reset"} if method == "reset" else {"target": 99})}
    t = trainer(tmp_path, records, environment_factory=Counter, shuffle_train_dataset=False)
    with pytest.raises(RuntimeError, match=rf"environment Counter\.{method} raised on dataset_train record 3") as e:
        t.train()
    note = "\n".join(getattr(e.value, "__notes__", []))
    assert "training stopped during step 2" in note and f"jaxloom train {tmp_path}" in note
    assert (tmp_path / "checkpoints" / "1").is_dir()


def test_a_rollout_func_gives_the_rows_its_mask_and_its_fields(tmp_path):
    """`rollout_func(prompts, trainer)`: called with each prompt `num_generations` times (TRL's rows), its
    `prompt_ids`, `completion_ids` and `logprobs` are the rows trained on, `env_mask` keeps its zeros out of the
    loss, other fields reach the reward functions; a wrong number of rows is one clear error."""
    calls = []
    env_text = TOK.encode(" [env says ok]", add_special_tokens=False)

    def rollout(prompts, trainer):
        calls.append(prompts)
        tok = trainer.tokenizer
        prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
        mine = [tok.encode(" yes" if i % 2 else " no", add_special_tokens=False) for i in range(len(prompts))]
        completion = [m + env_text for m in mine]
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion,
            "logprobs": [[-1.0] * len(c) for c in completion],
            "env_mask": [[1] * len(m) + [0] * len(env_text) for m in mine],
            "verdict": [i % 2 for i in range(len(prompts))],
        }

    def verdict(prompts, completions, verdict, **kw):
        return [float(v) for v in verdict]

    records = [{"prompt": f"question {i}?"} for i in range(4)]
    t = trainer(tmp_path / "a", records, rollout_func=rollout, reward_funcs=[verdict], max_training_steps=1)
    t.train()
    assert len(calls[0]) == 4 and calls[0][0] == calls[0][1] != calls[0][2] == calls[0][3]
    row = logged(tmp_path / "a")[0]
    assert row["train/reward"] == 0.5 and row["train/rewards/verdict/mean"] == 0.5
    batch = t.batches.cached[1]
    ids, loss_mask, seg = (np.asarray(batch[k])[0] for k in ("input_ids", "loss_mask", "segment_ids"))
    width = int(np.argmax(seg[0] > 0) + len(TOK.encode(calls[0][0], add_special_tokens=False)))
    got = ids[0, width:][seg[0, width:] > 0].tolist()
    assert got == TOK.encode(" no", add_special_tokens=False) + env_text
    assert loss_mask[0, width:][seg[0, width:] > 0].tolist() == [1] * (len(got) - len(env_text)) + [0] * len(env_text)

    def short(prompts, trainer):
        return {"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": [[0.0]]}

    with pytest.raises(ValueError, match=r"rollout_func's 'prompt_ids' has 1 entries for 4 rows"):
        trainer(tmp_path / "b", records, rollout_func=short, reward_funcs=[verdict], max_training_steps=1).train()


def test_asynchronous_environments_keep_their_own_instances_and_rebuild_them_on_resume(tmp_path, monkeypatch, caplog):
    """`environment_factory` with `max_staleness=1`: the rollout drawn ahead takes instances of its own (a pool per
    rollout in flight), so the rollout being scored on a thread reads its own instances' state, not the next one's
    (rollout 0's target 2 is reached by the rows that add 2; rollout 1's 4 by none). A checkpoint keeps the calls each
    row made; restored from it, the drawn rollout's instances are reset and the calls made again in order, so
    `get_reward` reads the state the uninterrupted run read. A call that now returns other text is reported."""
    monkeypatch.setattr(sampler.Sampler, "generate", scripted(lambda r: call_text("increment", {"step": 1 + r % 2})))
    MADE.clear()
    prompt = [{"role": "user", "content": "Count."}]
    records = [{"prompt": prompt, "target": t} for t in (2, 2, 4, 4, 1, 1)]
    t = trainer(tmp_path, records, environment_factory=Counter, max_staleness=1, max_training_steps=3,
                shuffle_train_dataset=False)  # fmt: skip
    saved = []
    from jaxloom.trainer.callbacks import Callback

    t.callbacks.append(Callback(on_step_end=lambda run, step, m: saved.append(t.batches.checkpoint_state())))
    t.train()
    assert [r["train/rewards/Counter/mean"] for r in logged(tmp_path)] == [0.5, 0.0, 0.5]
    assert len(MADE) == 1 + 4 * 2  # the probe, and 4 rows for each of the 2 rollouts in flight at once
    (drawn,) = saved[1]["pipeline"]["drawn"]  # after step 2: rollout 2 drawn ahead (target 1), its calls kept
    assert drawn["index"] == 2 and [len(turns) for turns in drawn["turns"]["made"]] == [1, 1, 1, 1]
    for e in MADE:  # what a fresh process holds: instances that never saw the rollout
        e.count = e.target = None
    _, metrics, _ = t.batches.drawer.finish(t.batches.redraw(2, json.loads(json.dumps(drawn))))
    assert metrics["rewards/Counter/mean"] == 0.5  # the rows that added 1 reach 1 again: the state rebuilt

    def increment(self, step: int) -> str:  # now not what it was: another count
        return str(self.count + 100)

    monkeypatch.setattr(Counter, "increment", increment)
    with caplog.at_level("WARNING", logger="jaxloom.trainer"):
        t.batches.redraw(2, json.loads(json.dumps(drawn)))
    (warned,) = [r.getMessage() for r in caplog.records if "made again on its environments" in r.getMessage()]
    assert "4 tool calls of rollout 2" in warned and "increment returned '100'" in warned, warned
