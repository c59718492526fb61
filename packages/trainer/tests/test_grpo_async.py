"""Asynchronous GRPO (`max_staleness >= 1`, TRL's `AsyncGRPOConfig` names): the next step's rollout is drawn
before the current step trains and scored on a thread while it trains; its samples are a version stale (the
sampler's log-probs differ from the trainer's); a rollout older than `max_staleness` is dropped and counted; what
is drawn and untrained is saved with each checkpoint, so a run killed by SIGKILL resumes bit for bit."""

import json
import threading

import numpy as np
import pytest
from test_grpo import RECORDS, grpo_args, grpo_trainer, letter_e, rows

from jaxloom.trainer.callbacks import Callback
from jaxloom.trainer.grpo.pipeline import Pipeline, pack, unpack


def test_the_next_rollout_is_scored_on_a_thread_while_the_step_trains(tmp_path):
    """Each step's `on_step_end` waits for the reward call of the rollout the next step trains: it has started
    (on a rollout thread) while this step trains — a synchronous run would only call it after this step. The rows
    of steps 2.. were sampled by the policy a version back: staleness 1, and the sampler's log-probs differ from
    the trainer's (in float32 they agree to 1e-6 when fresh, step 1)."""
    started = [threading.Event() for _ in range(8)]
    threads: list[str] = []

    def reward(prompts, completions, **kwargs):
        started[len(threads)].set()
        threads.append(threading.current_thread().name)
        return letter_e(prompts, completions)

    waited = {}

    def on_step_end(run, step, metrics):
        if step < 4:
            waited[step] = started[step].wait(60)  # rollout `step` (0-based) trains at step + 1

    correction = dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate")
    trainer = grpo_trainer(
        tmp_path, rewards=(reward,), max_staleness=1, logging_steps=1, use_tensorboard=True, **correction
    )
    trainer.callbacks.append(Callback(on_step_end=on_step_end, name="overlap"))
    trainer.train()
    assert waited == {1: True, 2: True, 3: True}, waited
    assert len(threads) == 4, threads
    logged = [r for r in rows(tmp_path) if "train/sample/staleness_max" in r]
    assert [r["train/sample/staleness_max"] for r in logged] == [0, 1, 1, 1]
    assert all(r["train/sample/dropped_stale_total"] == 0 and r["train/perf/rollout_wait_s"] >= 0 for r in logged)
    diff = [r["train/sampling/sampling_logp_difference/max"] for r in logged]
    assert diff[0] <= 1e-6 and min(diff[1:]) > 1e-4, diff
    ratio = [[r[f"train/sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")] for r in logged]
    assert np.allclose(ratio[0], 1, atol=1e-5), ratio  # TRL's names: the correction of the stale rows, not of fresh
    assert all(lo < 1 < hi <= 3.0 for lo, _, hi in ratio[1:]), ratio
    # the time split and the staleness in TensorBoard and report.md too
    from test_tbevents import read_events

    split = ("time/rollout_s", "time/reward_s", "perf/rollout_wait_s", "step_time", "sample/staleness_mean")
    tags = {v.tag for f in (tmp_path / "tensorboard").iterdir() for e in read_events(f) for v in e.summary.value}
    assert {f"train/{k}" for k in split} <= tags, sorted(tags)
    report = (tmp_path / "report.md").read_text()
    assert all(k in report for k in split), report


def test_a_rollout_older_than_max_staleness_is_dropped_counted_and_drawn_again():
    """The pipeline alone: rollouts drawn a step ahead under the version of their time; after a jump of two
    versions the one waiting is too stale: dropped (counted, never returned) and drawn again with the weights now."""
    version, draws = [0], []

    def draw(i):
        draws.append((i, version[0]))
        return (i, version[0])

    p = Pipeline(draw, lambda d: ({}, {"drawn": d}, None), lambda: version[0], depth=1, max_staleness=1, last=5)
    _, m, _ = p.take(0)
    assert m["drawn"] == (0, 0) and m["sample/staleness_max"] == 0 and draws == [(0, 0), (1, 0)]
    version[0] = 1
    _, m, _ = p.take(1)
    assert m["drawn"] == (1, 0) and m["sample/staleness_max"] == 1 and draws[-1] == (2, 1)
    version[0] = 3
    _, m, _ = p.take(2)
    assert m["drawn"] == (2, 3) and m["sample/staleness_max"] == 0 and m["sample/dropped_stale_total"] == 1
    assert draws[-2:] == [(2, 3), (3, 3)]
    version[0] = 4
    p.take(3)
    assert draws[-1] == (4, 4)
    p.take(4)
    assert draws[-1] == (4, 4)  # nothing past the run's last rollout is drawn
    p.close()

    def failing(i):  # the next rollout's drawing fails (on the drawing thread): the checkpoint is still written
        if i == 1:

            def fail():
                raise RuntimeError("the sampler's devices are gone")

            return fail
        return lambda: (i, 0)

    q = Pipeline(failing, lambda d: ({}, {"drawn": d}, None), lambda: 0, depth=1, max_staleness=1, last=5)
    q.save = lambda drawn: {"drawn": list(drawn)}
    assert q.take(0)[1]["drawn"] == (0, 0)
    assert q.state()["drawn"] == []  # rollout 1 failed to draw: left out, the save goes on
    with pytest.raises(RuntimeError, match="devices are gone"):
        q.take(1)  # and the step that needs it fails, naming why
    q.close()
    arrays = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.float32([0.1, np.nan])}
    back = unpack(json.loads(json.dumps(pack(arrays))))
    assert all(np.array_equal(arrays[k], back[k], equal_nan=True) and arrays[k].dtype == back[k].dtype for k in arrays)


def test_asynchronous_settings_are_checked_before_step_one(tmp_path, caplog):
    """Bad settings are refused when the config is made; `queue_maxsize` and `max_inflight_tasks` bound how many
    steps ahead rollouts are drawn (`depth_of`)."""
    from jaxloom.trainer.grpo.pipeline import depth_of

    assert depth_of(grpo_args(tmp_path).rl, 16) == 0
    assert depth_of(grpo_args(tmp_path, max_staleness=4).rl, 16) == 4
    assert depth_of(grpo_args(tmp_path, max_staleness=4, queue_maxsize=40).rl, 16) == 2
    assert depth_of(grpo_args(tmp_path, max_staleness=4, max_inflight_tasks=16).rl, 16) == 1
    with caplog.at_level("WARNING", logger="jaxloom.trainer"):
        grpo_trainer(tmp_path / "plain", max_staleness=1)
        grpo_trainer(tmp_path / "corrected", max_staleness=1, vllm_importance_sampling_correction=True)
    warned = [r.getMessage() for r in caplog.records if "without vllm_importance_sampling_correction" in r.getMessage()]
    assert len(warned) == 1, warned  # the stale rows would train uncorrected: said once, when the trainer is made
    with pytest.raises(ValueError, match="num_iterations = 2 with max_staleness = 1"):
        grpo_args(tmp_path, max_staleness=1, num_iterations=2)
    with pytest.raises(ValueError, match="queue_maxsize = 8 with max_staleness = 1: .* expected at least 16"):
        grpo_args(tmp_path, max_staleness=1, queue_maxsize=8)
    with pytest.raises(ValueError, match="weight_sync_steps = 2: the sampler reads the policy's weights of every"):
        grpo_args(tmp_path, max_staleness=1, weight_sync_steps=2)  # TRL's AsyncGRPOConfig key: 1 only
    assert grpo_args(tmp_path, max_staleness=1, weight_sync_steps=1).rl.max_staleness == 1
    with pytest.raises(ValueError, match="max_inflight_tasks = 0; expected -1"):
        grpo_args(tmp_path, max_inflight_tasks=0)
    with pytest.raises(ValueError, match="partial_rollout_tokens = 2 with environment_factory: a partial rollout"):
        import jaxloom.models as jm
        from util import TOK, tiny

        from jaxloom.trainer import GRPOTrainer

        GRPOTrainer(
            grpo_args(tmp_path, max_staleness=2, partial_rollout_tokens=2),
            model=jm.create_model(tiny(), lazy=True),
            dataset_train=RECORDS,
            processing_class=TOK,
            reward_funcs=[letter_e],
            environment_factory=dict,
        )


MOE_REPLAY = ["model.model_type=mixtral", "model.num_local_experts=4", "routing_replay=true"]


PARTIAL = ["sampling_devices=1", "partial_rollout_tokens=4", "vllm_importance_sampling_correction=true"]  # 2 ahead


@pytest.mark.parametrize(
    "split",
    [[], ["sampling_devices=1"], MOE_REPLAY, PARTIAL],
    ids=["one-mesh", "split-1-1", "mixtral-routing-replay", "split-partial-rollouts"],
)
def test_asynchronous_grpo_sigkill_then_resume_ends_bitwise_equal(tmp_path, monkeypatch, split):
    """`jaxloom train max_staleness=1` (on the training mesh, or with the sampler on one of the 2 devices), killed
    by SIGKILL after step 7 (the next rollout drawn, its scoring under way) and started again, resumes from step 4's
    checkpoint — the rollout drawn then by step 3's weights restored from it and scored again — and ends bit for
    bit where an uninterrupted run ends. A Mixtral policy with `routing_replay`: the drawn rollout's experts per
    token are saved with it and replayed after the resume. Partial rollouts (two steps ahead) on the sampler's own
    device: the rollout two steps ahead has its first part (4 tokens of each completion) saved with each checkpoint
    and is finished after the resume by the resumed weights, as the uninterrupted run finishes it."""
    from test_resume_cli import resumes_bitwise

    monkeypatch.chdir(tmp_path)
    source = (
        "import time\n"
        "def letter_e(prompts, completions, **kwargs):\n"
        "    time.sleep(0.2)\n"
        "    return [c.count('e') / max(len(c), 1) for c in completions]\n"
    )
    extra = [*grpo_cli(tmp_path, source, "letter_e"), f"max_staleness={2 if split is PARTIAL else 1}", *split]
    resumes_bitwise(tmp_path, extra)
    logged = [r for r in rows(tmp_path / "run") if "train/sample/staleness_max" in r]
    assert logged
    if split is MOE_REPLAY:  # replayed on the resumed run's rows too (a lost record would leave only -1s: 0 too)
        assert all(r["train/routing/disagreement"] == 0 for r in logged)
    if split is PARTIAL:  # completions drawn ahead continued under the next version; their parts saved mid-way
        assert max(r["train/sample/partial_ratio"] for r in logged) > 0
        assert all(r["train/sample/token_staleness_mean"] <= r["train/sample/staleness_max"] for r in logged)


def test_on_eight_devices_split_four_and_four_the_letter_is_learned_a_step_stale(tmp_path):
    """`sampling_devices=4` on the 8 CPU devices: the training mesh is the last 4, the sampler's own mesh the first
    4, the policy's weights copied device to device for each rollout, drawn on a thread while the step trains. The
    letter task of `test_grpo.py` (the reward is the share of e; 30 steps, lr 1e-2, top_k 16) with
    `max_staleness=1` and TRL's truncated token correction learns to the synchronous run's bar (the last 5 steps'
    mean reward above twice the first 5's, and above 0.2)."""
    import jax
    import jaxloom.models as jm
    from util import TOK, tiny

    from jaxloom.trainer import GRPOTrainer

    args = grpo_args(
        tmp_path,
        max_training_steps=30,
        learning_rate=1e-2,
        top_k=16,
        max_staleness=1,
        sampling_devices=4,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
    )
    model = jm.create_model(tiny(), lazy=True)
    trainer = GRPOTrainer(args, model=model, dataset_train=RECORDS, processing_class=TOK, reward_funcs=[letter_e])
    trainer.train()
    training, sampling = set(trainer.mesh.devices.flat), set(trainer.batches.sampler.mesh.devices.flat)
    assert training == set(jax.devices()[4:]) and sampling == set(jax.devices()[:4])
    copied = jax.tree.leaves(trainer.batches.sampler.weights())
    assert copied and all(set(x.sharding.device_set) <= sampling for x in copied)
    logged = [r for r in rows(tmp_path) if "train/reward" in r]
    rewards = [r["train/reward"] for r in logged]
    assert len(rewards) == 30 and {r["train/sample/staleness_max"] for r in logged[1:]} == {1}
    assert np.mean(rewards[-5:]) > 2 * np.mean(rewards[:5]) and np.mean(rewards[-5:]) > 0.2, rewards
    with pytest.raises(ValueError, match="sampling_devices = 8 of 8 devices leaves none to train on"):
        _ = GRPOTrainer(
            grpo_args(tmp_path / "all", sampling_devices=8),
            model=model,
            dataset_train=RECORDS,
            processing_class=TOK,
            reward_funcs=[letter_e],
        ).mesh


def test_a_rollout_drawn_by_the_drawer_alone_then_finished_on_another_thread():
    """The RL pieces without a trainer: a `Drawer` over a `Sampler` of a tiny model draws a rollout (prompt rows
    left-padded to their bucket, completions cut to theirs, the sampler's log-probs recorded); `finish` on another
    thread decodes and scores it with the score function it was given, and lays out host rows; the same key draws the
    same rollout again."""
    import concurrent.futures as cf

    import jax
    import jaxloom.models as jm
    from util import TOK, mesh, tiny

    from jaxloom.trainer.grpo.drawing import Drawer
    from jaxloom.trainer.grpo.rollouts import Policy
    from jaxloom.trainer.grpo.sampler import Sampler

    rl = grpo_args("unused", max_completion_length=8).rl
    model = jm.create_model(tiny())
    policy = Policy(state=None, step=lambda: 0, logps=None, rewards=lambda: ([], []))
    sampler = Sampler(rl, lambda: model, lambda: TOK, lambda: (TOK.eos_token_id,), mesh(1))
    scored = []

    def score(prompts, completions, columns, completion, completion_mask, where=None):
        scored.append((list(prompts), list(completions), columns))
        return {"advantages": np.arange(len(prompts), dtype=np.float32)}, {"reward": 1.0}

    drawer = Drawer(rl, lambda: TOK, policy, sampler, None, lambda: (TOK.eos_token_id,), score)
    records = [{"prompt": "say red:", "answer": "red"}, {"prompt": "say a much longer thing:", "answer": "x"}]
    encoded = [np.asarray(TOK(r["prompt"])["input_ids"], np.int32) for r in records]
    key = jax.random.PRNGKey(3)
    drawn = drawer.draw(records, encoded, key)
    rows_ = 2 * rl.num_generations
    assert drawn.prompt.shape == (rows_, 16) and drawn.prompt_mask[0, -len(encoded[0]) :].all()
    assert drawn.completion.shape[0] == rows_ and drawn.completion.shape[1] in (8, 16) and drawn.sampled is not None
    with cf.ThreadPoolExecutor(1) as pool:
        rows, metrics, sampled = pool.submit(drawer.finish, drawn).result()
    assert scored[0][0] == ["say red:"] * 4 + ["say a much longer thing:"] * 4
    assert scored[0][2] == {"answer": ["red"] * 4 + ["x"] * 4}
    assert rows["input_ids"].shape == (rows_, 16 + drawn.completion.shape[1]) and int(rows["width"]) == 16
    assert list(rows["advantages"]) == list(range(rows_)) and metrics["reward"] == 1.0
    on = drawn.completion_mask > 0
    assert np.all(sampled[~on] == 0) and np.all(sampled[on] < 0)  # the sampler's log-probs, on the tokens only
    again = drawer.draw(records, encoded, key)
    np.testing.assert_array_equal(again.completion, drawn.completion)


def test_a_rollout_funcs_rows_drawn_ahead_resume_bitwise_with_their_fields(tmp_path, monkeypatch):
    """`rollout_func` with `max_staleness=1`: its rows are drawn a step ahead, and a checkpoint saves them with the
    function's own prompt tokens and fields (JSON), so a run killed by SIGKILL resumes bit for bit — the resumed
    run's rewards read the saved fields (a field lost would be a missing argument). A field JSON would not give
    back as it is (a tuple) is one clear error when the rollout is drawn, before any step trains on it."""
    from test_resume_cli import resumes_bitwise, run

    monkeypatch.chdir(tmp_path)
    source = (
        "def rollout(prompts, trainer):\n"
        "    tok = trainer.tokenizer\n"
        "    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]\n"
        "    text = [' e' * (1 + i % 3) + ' x' * (i % 2) for i in range(len(ids))]\n"
        "    done = [tok.encode(t, add_special_tokens=False) for t in text]\n"
        "    return {'prompt_ids': ids, 'completion_ids': done, 'logprobs': [[-1.0] * len(c) for c in done],\n"
        "            'weight': [0.5 + (i % 4) / 4 for i in range(len(ids))]}\n"
        "def weighted(prompts, completions, weight, **kwargs):\n"
        "    return [w * c.count('e') / max(len(c), 1) for w, c in zip(weight, completions)]\n"
        "def tupled(prompts, trainer):\n"
        "    out = rollout(prompts, trainer)\n"
        "    return {**out, 'weight': [(w,) for w in out['weight']]}\n"
    )
    extra = grpo_cli(tmp_path, source, "weighted")
    resumes_bitwise(tmp_path, [*extra, "max_staleness=1", "rollout_func=custom.rollout"])
    logged = [r for r in rows(tmp_path / "run") if "train/sample/staleness_max" in r]
    assert [r["train/sample/staleness_max"] for r in logged][-1] == 1

    failed, lines, err = run(tmp_path / "tupled", extra=[*extra, "max_staleness=1", "rollout_func=custom.tupled"])
    assert failed.returncode != 0 and "STEP 1" not in lines
    assert "rollout_func's field 'weight' row 0 holds tuple (0.5,), which a checkpoint cannot save" in err, err[-2000:]


def grpo_cli(tmp_path, source: str, reward: str) -> list[str]:
    """A GRPO command line's overrides: RECORDS as `p.jsonl`, `source` as the module `custom` (its reward function
    `reward`, a rollout), 8 steps of 4 completions of 16 tokens at most, in `tmp_path` (the working directory)."""
    (tmp_path / "custom.py").write_text(source)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    extra = ["trainer=grpo", "data.train=p.jsonl", f"reward_funcs=custom.{reward}", "num_generations=4"]
    return [*extra, "max_prompt_length=16", "max_completion_length=16", "max_training_steps=8", "learning_rate=1e-2"]


def test_partial_rollouts_in_the_pipeline_continue_under_each_version_and_resume_where_they_were():
    """The pipeline alone with partial rollouts (`advance`), two steps ahead: a rollout drawn ahead draws a part under
    the version of its time and the rest at the `take` of the step before its own (so it is scored while that step
    trains); it is scored once, when whole; each token's version gives `sample/token_staleness_mean` and
    `sample/partial_ratio`. Its state saved mid-way (the parts drawn so far) and restored continues as the
    uninterrupted pipeline does."""
    version, scored = [0], []
    need = 4  # tokens a completion has; a part is one token, the rest when finished

    def draw(i):
        return (i, (version[0],))

    def advance(i, get, finish):
        index, parts = get()
        return (index, parts + (version[0],) * ((need - len(parts)) if finish else 1))

    def finish(drawn):
        scored.append(drawn)
        return {}, {"drawn": drawn}, None

    def make():
        return Pipeline(
            draw,
            finish,
            lambda: version[0],
            save=lambda d: {"d": [d[0], list(d[1])]},
            depth=2,
            max_staleness=2,
            last=6,
            advance=advance,
            running=lambda d: len(d[1]) < need,
            versions=lambda d: np.asarray([d[1]], np.int32),
        )

    p = make()
    got = [p.take(0)[1]]
    for v in (1, 2):
        version[0] = v
        got.append(p.take(v)[1])
    assert [m["drawn"] for m in got] == [(0, (0, 0, 0, 0)), (1, (0, 0, 0, 0)), (2, (0, 1, 1, 1))]
    assert [m["sample/staleness_max"] for m in got] == [0, 1, 2]
    assert np.isclose(got[2]["sample/token_staleness_mean"], (2 + 1 + 1 + 1) / 4)
    assert [m["sample/partial_ratio"] for m in got] == [0.0, 0.0, 1.0]
    p.pending[3].scored.result()  # rollout 3 whole already: scored on a thread while step 3 trains
    assert sorted(d[0] for d in scored) == [0, 1, 2, 3]  # each scored once, when whole
    saved = json.loads(json.dumps(p.state()))
    assert [(d["index"], d["version"], d["d"][1]) for d in saved["drawn"]] == [(3, 1, [1, 2, 2, 2]), (4, 2, [2])]
    version[0] = 3
    want = p.take(3)[1]["drawn"], p.take(4)[1]["drawn"]
    p.close()
    q = make()
    q.restore(saved, lambda i, s: (s["d"][0], tuple(s["d"][1])))
    assert (q.take(3)[1]["drawn"], q.take(4)[1]["drawn"]) == want == ((3, (1, 2, 2, 2)), (4, (2, 3, 3, 3)))
    q.close()


def test_partial_rollouts_in_a_run_draw_most_tokens_with_fresher_weights(tmp_path):
    """A GRPO run on the training mesh with `max_staleness=2` and `partial_rollout_tokens=2`: each rollout draws 2
    tokens per completion two versions ahead and the rest one version ahead (scored while the step before its own
    trains): the rollout is 2 versions stale (it began then), its tokens less on average
    (`sample/token_staleness_mean`), and the completions span versions (`sample/partial_ratio`). Partial rollouts
    with tools or recorded experts, or fewer than 2 steps ahead, are refused before step 1."""
    trainer = grpo_trainer(tmp_path, max_staleness=2, partial_rollout_tokens=2, logging_steps=1, top_k=16)
    trainer.train()
    logged = [r for r in rows(tmp_path) if "train/sample/staleness_max" in r]
    assert [r["train/sample/staleness_max"] for r in logged] == [0, 1, 2, 2]
    later = logged[2:]
    assert all(r["train/sample/partial_ratio"] > 0 for r in later), later
    assert all(1 < r["train/sample/token_staleness_mean"] < 2 for r in later), later
    with pytest.raises(ValueError, match="partial_rollout_tokens = 2 with routing_replay: a partial rollout"):
        grpo_trainer(tmp_path / "moe", max_staleness=2, partial_rollout_tokens=2, routing_replay=True)
    with pytest.raises(ValueError, match="partial_rollout_tokens = 2 with rollouts drawn 1 step ahead"):
        grpo_args(tmp_path, max_staleness=2, partial_rollout_tokens=2, queue_maxsize=16)


def test_a_partial_rollouts_tokens_carry_the_log_probs_of_the_version_that_drew_them():
    """`Drawer.draw(budget=)` draws a part of each completion with one model; `Drawer.extend` continues the rows still
    running with another (their `[prompt | part]` prefilled by it): every completion token is tagged with the version
    that drew it, and its sampler log-prob is that version's model's own (a full forward of the finished sequence, at
    temperature 1), so the per-token corrections weigh each token by the policy that drew it."""
    import jax
    import jaxloom.models as jm
    from util import TOK, mesh, tiny

    from jaxloom.trainer.grpo.drawing import Drawer
    from jaxloom.trainer.grpo.rollouts import Policy
    from jaxloom.trainer.grpo.sampler import Sampler

    rl = grpo_args("unused", max_completion_length=12, max_staleness=2, partial_rollout_tokens=3, temperature=1.0).rl
    models = [jm.create_model(tiny(), seed=seed) for seed in (0, 1)]
    policy = Policy(state=None, step=lambda: 0, logps=None, rewards=lambda: ([], []))
    no_eos = (len(TOK) + 7,)  # no completion ends early: every row runs to the cap
    sampler = Sampler(rl, lambda: models[0], lambda: TOK, lambda: no_eos, mesh(1))
    drawer = Drawer(rl, lambda: TOK, policy, sampler, None, lambda: no_eos, lambda *a, **k: ({}, {}))
    records = [{"prompt": "say red:"}, {"prompt": "say a much longer thing:"}]
    encoded = [np.asarray(TOK(r["prompt"])["input_ids"], np.int32) for r in records]
    part = drawer.draw(records, encoded, jax.random.PRNGKey(3), budget=3, version=5, model=models[0])
    assert (part.completion_mask.sum(axis=1) == 3).all() and drawer.running(part).all()
    whole = drawer.extend(part, jax.random.PRNGKey(4), 6, finish=True, model=models[1])
    assert not drawer.running(whole).any() and (whole.completion_mask.sum(axis=1) == 12).all()
    assert (whole.versions[:, :3] == 5).all() and (whole.versions[:, 3:12] == 6).all()
    np.testing.assert_array_equal(whole.completion[:, :3], part.completion[:, :3])
    for r in (0, len(whole.kept) - 1):
        ids = np.concatenate([whole.kept[r], whole.completion[r, :12]])
        for v, model in ((5, models[0]), (6, models[1])):
            logp = jax.nn.log_softmax(model(ids[None]).logits[0].astype(np.float32), axis=-1)
            at = np.flatnonzero(whole.versions[r, :12] == v)
            want = np.asarray(logp)[len(whole.kept[r]) - 1 + at, whole.completion[r, at]]
            np.testing.assert_allclose(whole.sampled[r, at], want, atol=1e-4)
    with pytest.raises(ValueError, match="partial_rollout_tokens = 3 with max_staleness = 0: .* expected max_stale"):
        grpo_args("unused", max_completion_length=12, partial_rollout_tokens=3)
    with pytest.raises(ValueError, match="partial_rollout_tokens = 12 with max_completion_length = 12"):
        grpo_args("unused", max_completion_length=12, max_staleness=2, partial_rollout_tokens=12)


def test_a_rollout_funcs_fields_are_checked_saveable_nan_included():
    """`check_saveable`: what JSON gives back as it is passes — NaN too (JSON keeps it, though `NaN != NaN`), in
    lists and dicts; a tuple (back as a list) or a key that is not a string is one error naming field and row."""
    from jaxloom.trainer.grpo.drawing import check_saveable

    check_saveable({"score": [float("nan"), 1.0, None], "meta": [{"a": [float("nan"), "x"]}, {}, {"b": True}]})
    with pytest.raises(ValueError, match="field 'pair' row 1 holds tuple"):
        check_saveable({"pair": [[1, 2], (1, 2)]})
    with pytest.raises(ValueError, match="field 'by_id' row 0 holds dict"):
        check_saveable({"by_id": [{1: "a"}]})


def test_the_sampling_devices_are_each_processs_first_ones_the_training_mesh_does_not_hold():
    """`sampler.sampling_devices(n, held)`: of the 8 CPU devices, the first `n` (one process) — or, beside a training
    mesh given over the first 4, the first `n` after them; too few left, or none left to train on, is one error."""
    import jax

    from jaxloom.trainer.grpo.sampler import sampling_devices

    devices = jax.devices()
    assert sampling_devices(3) == devices[:3]
    assert sampling_devices(2, set(devices[:4])) == devices[4:6]
    with pytest.raises(ValueError, match="a process has 2 devices outside the training mesh; expected 3"):
        sampling_devices(3, set(devices[:6]))
    with pytest.raises(ValueError, match="8 devices of each process sample, and a process has 8"):
        sampling_devices(8)
