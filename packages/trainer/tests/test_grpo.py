"""GRPO on the core: each loss type equals an independent numpy reference, a tiny model learns a rule from a
reward alone, `num_iterations > 1` trains on the stored old log-probs, the KL to the initial policy is zero at
step 1, and bad settings or data are refused before step 1 with one clear error each."""

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from util import TOK, mesh, quiet, tiny

import jaxloom.models as jm
from jaxloom.trainer import GRPOConfig, GRPOTrainer
from jaxloom.trainer.grpo import advantages, aggregate, per_token_loss
from jaxloom.trainer.grpo.loss import LOSS_TYPES

WORDS = ["red", "blue", "green", "cat", "dog", "tree", "sun", "moon"]
RECORDS = [{"prompt": f"say {w}:", "answer": w} for w in WORDS * 8]


def letter_e(prompts, completions, **kwargs):
    return [c.count("e") / max(len(c), 1) for c in completions]


def grpo_args(tmp, **kw) -> GRPOConfig:
    base = dict(
        num_generations=4,
        max_prompt_length=8,
        max_completion_length=8,
        total_batch_size=16,
        max_training_steps=4,
        learning_rate=3e-3,
        warmup_steps=0,
    )
    return GRPOConfig(**{**base, **quiet(tmp), **kw})


def grpo_trainer(tmp, rewards=(letter_e,), records=RECORDS, dataset_eval=None, **kw) -> GRPOTrainer:
    return GRPOTrainer(
        grpo_args(tmp, **kw),
        model=jm.create_model(tiny(), lazy=True),
        dataset_train=records,
        dataset_eval=dataset_eval,
        processing_class=TOK,
        mesh=mesh(1),
        reward_funcs=list(rewards),
    )


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def reference_loss(logp, old, ref, adv, mask, beta, lo, hi, loss_type, max_len, level="token", delta=None):
    """TRL 1.16's formulas, written out in numpy (`level="sequence"`: GSPO's one ratio per sequence)."""
    token_log_ratio = logp - old
    ratio = np.exp(token_log_ratio)
    if level == "sequence":
        ratio = np.exp((token_log_ratio * mask).sum(1, keepdims=True) / np.maximum(mask.sum(1, keepdims=True), 1))
    a = adv[:, None]
    if loss_type == "cispo":
        loss = -np.minimum(ratio, hi) * a * logp
    elif loss_type == "sapo":
        tau = np.where(a > 0, 1.0, 1.05)
        loss = -(1 / (1 + np.exp(-tau * (ratio - 1)))) * 4 / tau * a
    elif loss_type == "vespo":
        log_w = np.clip((np.clip(token_log_ratio, -20, 20) * mask).sum(1, keepdims=True), np.log(1e-8), 20)
        k, lam = np.where(a >= 0, 2.0, 3.0), np.where(a >= 0, 3.0, 2.0)
        loss = -np.exp(lam + k * log_w - lam * np.exp(log_w)) * a * logp
    else:
        capped = ratio if delta is None else np.minimum(ratio, delta)
        loss = -np.minimum(capped * a, np.clip(ratio, 1 - lo, 1 + hi) * a)
    loss = loss + beta * (np.exp(ref - logp) - (ref - logp) - 1) * ratio  # use_bias_correction_kl, TRL's default
    if loss_type in ("grpo", "sapo"):
        return np.mean((loss * mask).sum(1) / np.maximum(mask.sum(1), 1))
    if loss_type == "dr_grpo":
        return (loss * mask).sum() / (len(loss) * max_len)
    if loss_type == "luspo":
        return (loss * mask).sum(1).mean()
    return (loss * mask).sum() / mask.sum()  # bnpo, dapo, cispo, vespo (one micro-batch)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_equals_a_numpy_reference(loss_type, level):
    """Each of TRL 1.16's loss types, with a ratio per token or (GSPO, `importance_sampling_level="sequence"`) per
    sequence; the clipped ones also with `delta` (the two-sided clip)."""
    rng = np.random.default_rng(0)
    b, t = 6, 10
    logp, old, ref = (rng.normal(-2, 0.5, (b, t)).astype(np.float32) for _ in range(3))
    adv = rng.normal(0, 1, b).astype(np.float32)
    mask = (rng.random((b, t)) > 0.3).astype(np.float32)
    hi = 5.0 if loss_type == "cispo" else 0.28  # cispo's cap: ScaleRL's epsilon_max
    for delta in (None, 1.5):
        loss, _, _ = per_token_loss(
            jnp.asarray(logp),
            jnp.asarray(old),
            jnp.asarray(ref),
            jnp.asarray(adv),
            beta=0.04,
            epsilon_low=0.2,
            epsilon_high=hi,
            mask=jnp.asarray(mask),
            level=level,
            loss_type=loss_type,
            delta=delta,
        )
        total, units = aggregate(loss, jnp.asarray(mask), loss_type, t)
        want = reference_loss(logp, old, ref, adv, mask, 0.04, 0.2, hi, loss_type, t, level, delta)
        np.testing.assert_allclose(float(total / units), want, rtol=1e-5)


@pytest.mark.parametrize("correction", [True, False])
def test_the_kl_bias_correction_gives_trls_gradient(correction):
    """`use_bias_correction_kl` (TRL 1.16's default on): the k3 KL weighted by the importance ratio changes the KL's
    gradient even on-policy, where the ratio is 1 — the gradient of jaxloom's loss equals TRL's formula's, written
    in torch as TRL's `_compute_loss` writes it (`per_token_kl * coef_1`, `coef_1 = exp(logp - old)`); off, the
    plain k3 gradient."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    logp, ref = (rng.normal(-2, 0.5, (3, 7)).astype(np.float32) for _ in range(2))
    adv = rng.normal(0, 1, 3).astype(np.float32)
    mask = (rng.random((3, 7)) > 0.2).astype(np.float32)

    def ours(lp):
        loss, _, _ = per_token_loss(lp, jax.lax.stop_gradient(lp), jnp.asarray(ref), jnp.asarray(adv), beta=0.5,
                                    epsilon_low=0.2, epsilon_high=0.2, mask=jnp.asarray(mask), loss_type="bnpo",
                                    bias_correction_kl=correction)  # fmt: skip
        return jnp.sum(loss * mask) / mask.sum()

    lp = torch.tensor(logp, requires_grad=True)
    r, a, m = torch.tensor(ref), torch.tensor(adv)[:, None], torch.tensor(mask)
    coef_1 = torch.exp(lp - lp.detach())
    per_token = -torch.min(coef_1 * a, torch.clamp(coef_1, 0.8, 1.2) * a)
    kl = torch.exp(r - lp) - (r - lp) - 1
    per_token = per_token + 0.5 * (kl * coef_1 if correction else kl)
    ((per_token * m).sum() / m.sum()).backward()
    np.testing.assert_allclose(np.asarray(jax.grad(ours)(jnp.asarray(logp))), lp.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_gspo_trains_with_one_ratio_per_sequence(tmp_path):
    """`importance_sampling_level="sequence"` (GSPO, loss_type grpo) over two iterations of each rollout (the second
    step's ratios differ from 1): the run trains, with finite losses, to other weights than the token-level ratio
    gives on the same rollouts (the formula itself: `test_each_loss_type_equals_a_numpy_reference`)."""
    runs = {}
    for level in ("token", "sequence"):
        t = grpo_trainer(
            tmp_path / level, loss_type="grpo", importance_sampling_level=level, num_iterations=2, max_training_steps=2
        )
        runs[level] = t.train()
    a, b = (
        jax.tree_util.tree_leaves(runs["token"].state.params),
        jax.tree_util.tree_leaves(runs["sequence"].state.params),
    )
    assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(np.isfinite(r["train/loss"]) for r in rows(tmp_path / "sequence") if "train/loss" in r)


def test_group_advantages_are_trls():
    rewards = np.asarray([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 1.0])
    adv, std = advantages(rewards, 4, "group")
    g = rewards.reshape(2, 4)
    want = (g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(adv, want.reshape(-1))
    np.testing.assert_allclose(advantages(rewards, 4, "none")[0], (g - g.mean(1, keepdims=True)).reshape(-1))
    assert advantages(np.ones(4), 4, "group")[0].tolist() == [0.0] * 4  # one reward for all: no signal


def test_a_tiny_model_learns_a_letter_from_the_reward_alone(tmp_path):
    """The reward is the share of the letter e in a completion; nothing else tells the model. Sampling from the
    16 likeliest tokens (top_k=16; over all 4,096 the 128 tokens a step see too little to move in 30 steps).
    Measured (seed 0, 30 steps of 16 completions of 8 tokens, lr 1e-2): reward per step 0.11, 0.09, 0.12, 0.15,
    0.18, ... 0.30, 0.25, 0.29, ... 0.32, 0.31 — the mean of steps 1-5 is 0.13, of steps 26-30 0.31."""
    grpo_trainer(tmp_path, max_training_steps=30, learning_rate=1e-2, top_k=16, plot_loss=True).train()
    rewards = [r["train/reward"] for r in rows(tmp_path) if "train/reward" in r]
    assert len(rewards) == 30
    assert np.mean(rewards[-5:]) > 2 * np.mean(rewards[:5]) and np.mean(rewards[-5:]) > 0.2, rewards
    last = rows(tmp_path)[-1]
    for key in (
        "reward_std",
        "rewards/letter_e/mean",
        "completions/mean_length",
        "completions/clipped_ratio",
        "kl",
        "clip_ratio",
        "entropy",
        "time/rollout_s",
        "time/reward_s",
    ):
        assert f"train/{key}" in last, key
    # the plot shows what GRPO trains for: its reward on top (its loss is near zero by construction; issue 51)
    from jaxloom.trainer.report import plot_panels

    panels = plot_panels(rows(tmp_path))
    assert [label for label, _ in panels] == ["reward", "loss", "learning rate"]
    assert [v for _, v in panels[0][1]["reward"]] == rewards
    assert (tmp_path / "loss.png").is_file()


def test_num_iterations_trains_on_the_stored_old_log_probs(tmp_path):
    # one rollout serves two steps: on the second the policy has moved, so the ratio leaves 1 and the clip acts
    t = grpo_trainer(tmp_path / "two", num_iterations=2, max_training_steps=4, learning_rate=5e-2, epsilon=0.01)
    t.train()
    clip = [r["train/clip_ratio"] for r in rows(tmp_path / "two") if "train/clip_ratio" in r]
    assert clip[0] == 0 and clip[2] == 0  # the first step on a rollout: ratio 1
    assert clip[1] > 0 and clip[3] > 0  # the second: against the stored old log-probs
    grpo_trainer(tmp_path / "one", max_training_steps=3, learning_rate=5e-2, epsilon=0.01).train()
    assert all(r["train/clip_ratio"] == 0 for r in rows(tmp_path / "one") if "train/clip_ratio" in r)


def test_the_kl_to_the_initial_policy_is_zero_at_step_one_then_grows(tmp_path):
    grpo_trainer(tmp_path, beta=0.1, max_training_steps=3, learning_rate=5e-2).train()
    kl = [r["train/kl"] for r in rows(tmp_path) if "train/kl" in r]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[-1] > 1e-4, kl


def test_bad_settings_and_data_are_refused_before_step_one(tmp_path):
    with pytest.raises(ValueError, match="total_batch_size = 10 is not a multiple of num_generations = 4"):
        grpo_args(tmp_path, total_batch_size=10)
    with pytest.raises(ValueError, match=r"reward_funcs: 'no_such_module.fn' does not import"):
        grpo_trainer(tmp_path, rewards=["no_such_module.fn"]).train()
    with pytest.raises(TypeError, match=r"reward function bad\(x\): expected TRL's form"):
        grpo_trainer(tmp_path, rewards=[lambda x: x] and [_bad()])
    with pytest.raises(ValueError, match="record 0 has no 'prompt' column"):
        grpo_trainer(tmp_path, records=[{"text": "hello"}] * 8).train()
    with pytest.raises(ValueError, match="num_generations = 1; expected at least 2"):
        grpo_args(tmp_path, num_generations=1)


def test_the_evaluation_pass_scores_held_out_prompts_with_the_rewards(tmp_path):
    """TRL's GRPO evaluation: completions of the held-out prompts (not the training ones), `num_generations` each,
    sampled from the policy and scored by the reward functions; the metrics are those rewards' means, logged as
    `eval/...` on the evaluation cadence and at the end; the same state evaluates to the same numbers; a given state
    is evaluated without being swapped in for the run's."""
    seen: list[tuple[list, list]] = []
    watch: dict = {}  # the trainer and state whose place is checked as the rewards are called
    in_place: list[bool] = []

    def length(prompts, completions, **kwargs):
        seen.append((list(prompts), list(kwargs["answer"])))
        if watch:
            in_place.append(watch["trainer"].state is watch["state"])
        return [float(len(c)) for c in completions]

    held_out = [{"prompt": f"name {w}:", "answer": w.upper()} for w in ["one", "two", "three", "four", "five"]]
    evaluating = dict(dataset_eval=held_out, max_training_steps=2, eval_batches=2)
    t = grpo_trainer(tmp_path, [length], evaluation_steps=2, **evaluating)
    t.train()
    logged = [r for r in rows(tmp_path) if "eval/reward" in r]
    assert [r["step"] for r in logged] == [2]  # on the cadence; the end of the run does not evaluate step 2 again
    seen.clear()
    again = t.evaluate()
    # two groups of total_batch_size / num_generations = 4 prompts: the five held-out prompts, in order, 4 each
    asked = [p for prompts, _ in seen for p in prompts]
    assert asked == [r["prompt"] for r in held_out for _ in range(4)]
    assert [a for _, answers in seen for a in answers] == [r["answer"] for r in held_out for _ in range(4)]
    assert again["reward"] == pytest.approx(again["rewards/length/mean"])
    assert {k: logged[0][f"eval/{k}"] for k in again if k != "evaluation_time"} == pytest.approx(
        {k: v for k, v in again.items() if k != "evaluation_time"}
    )
    assert 0 <= again["completions/clipped_ratio"] <= 1 and again["completions/mean_length"] > 0

    # another state is scored as it is given, never swapped in for the run's (issue 72): while the untrained state
    # samples, the run's own state stays in place, and the scores are those a fresh run's own evaluation gives
    fresh = grpo_trainer(tmp_path / "fresh", [length], **evaluating)
    trained = t.state
    watch.update(trainer=t, state=trained)
    given = t.evaluate(fresh.model_state)
    assert in_place and all(in_place) and t.state is trained
    watch.clear()
    untrained = fresh.evaluate()
    assert {k: v for k, v in given.items() if k != "evaluation_time"} == pytest.approx(
        {k: v for k, v in untrained.items() if k != "evaluation_time"}
    )


def _bad():
    def bad(x):
        return x

    return bad


def test_a_failing_reward_names_itself_and_the_prompt_and_loses_nothing(tmp_path):
    def fails_on_moon(prompts, completions, **kwargs):
        if any("moon" in p for p in prompts):
            raise ZeroDivisionError("boom")
        return [0.0] * len(prompts)

    def returns_nan(prompts, completions, **kwargs):
        return [float("nan")] * len(prompts)

    records = [{"prompt": f"say {w}:"} for w in WORDS]  # 4 prompts a step: moon is the 8th, in the 2nd rollout
    t = grpo_trainer(
        tmp_path / "a",
        rewards=[fails_on_moon],
        records=records,
        shuffle_train_dataset=False,
        save_steps=1,
        max_training_steps=3,
    )
    with pytest.raises(RuntimeError, match=r"reward function fails_on_moon raised on dataset_train record 7 .*boom"):
        t.train()
    assert (tmp_path / "a" / "checkpoints" / "1").is_dir()  # the step before stands
    with pytest.raises(RuntimeError, match="reward function returns_nan returned nan for completion 0"):
        grpo_trainer(tmp_path / "b", rewards=[returns_nan]).train()

    def hangs_at_step_2(prompts, completions, **kwargs):  # a reward that hangs (a judge that never answers)
        calls.append(1)
        if len(calls) == 2:
            time.sleep(60)
        return [0.0] * len(prompts)

    calls: list = []
    t = grpo_trainer(tmp_path / "c", rewards=[hangs_at_step_2], reward_timeout=1.0, save_steps=1, max_training_steps=3)
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"reward function hangs_at_step_2 did not return within reward_timeout = 1 s"
    ):
        t.train()
    assert time.monotonic() - started < 50  # cut, not waited for
    assert (tmp_path / "c" / "checkpoints" / "1").is_dir()  # the step before stands
    with pytest.raises(ValueError, match="reward_timeout"):
        grpo_args(tmp_path / "d", reward_timeout=0)


def test_long_prompts_are_truncated_at_their_start_and_counted(tmp_path):
    records = [{"prompt": " ".join(WORDS * 3)}] * 8
    grpo_trainer(tmp_path, records=records, max_training_steps=1).train()
    assert rows(tmp_path)[-1]["train/prompts/truncated"] == 4  # every prompt of the step: 4 prompts × 4 completions


def test_grpo_with_lora_trains_adapters_against_the_base_without_a_copy(tmp_path):
    t = GRPOTrainer(
        grpo_args(
            tmp_path,
            use_peft=True,
            lora_r=4,
            lora_target_modules="all-linear",
            beta=0.1,
            max_training_steps=3,
            learning_rate=5e-2,
        ),
        model=jm.create_model(tiny(), seed=0),
        dataset_train=RECORDS,
        processing_class=TOK,
        mesh=mesh(1),
        reward_funcs=[letter_e],
    )
    out = t.train()
    assert t._reference is None  # the reference is the base with the adapters off: no second copy
    assert all(k[-1].key in ("lora_a", "lora_b") for k, _ in jax.tree_util.tree_leaves_with_path(out.state.params))
    kl = [r["train/kl"] for r in rows(tmp_path) if "train/kl" in r]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[-1] > 1e-5, kl


def test_an_external_rollout_engine_replaces_the_generation(tmp_path):
    seen = []

    def engine(prompt_ids, prompt_mask, key):
        """Three tokens for every prompt, then padding: what an external generator hands back."""
        seen.append(prompt_ids.shape)
        ids = np.zeros((len(prompt_ids), 8), np.int32)
        ids[:, :3] = TOK.encode("e e e", add_special_tokens=False)[:3]
        return ids, (np.arange(8) < 3).astype(np.int32)[None].repeat(len(prompt_ids), 0)

    t = GRPOTrainer(
        grpo_args(tmp_path, max_training_steps=2),
        model=jm.create_model(tiny(), lazy=True),
        dataset_train=RECORDS,
        processing_class=TOK,
        mesh=mesh(1),
        reward_funcs=[letter_e],
        rollout_engine=engine,
    )
    t.train()
    assert seen == [(16, 16), (16, 16)]  # 4 prompts × 4 completions; the prompts' bucket (>= 16 columns), not the cap
    assert all(r["train/completions/mean_length"] == 3 for r in rows(tmp_path) if "train/completions/mean_length" in r)


def test_mask_truncated_completions_leaves_cut_completions_out_of_the_loss(tmp_path):
    # 8 tokens from a random model: no completion reaches EOS, so with the mask nothing is left to train on
    for name, mask in (("on", True), ("off", False)):
        grpo_trainer(tmp_path / name, max_training_steps=2, mask_truncated_completions=mask).train()
    on = [r for r in rows(tmp_path / "on") if "train/grad_norm" in r]
    off = [r for r in rows(tmp_path / "off") if "train/grad_norm" in r]
    assert all(r["train/completions/clipped_ratio"] == 1 for r in on)
    assert all(r["train/grad_norm"] == 0 for r in on) and all(r["train/grad_norm"] > 0 for r in off)


# ---- issue 50: cost follows the data ----------------------------------------------------------------------------
def test_rows_follow_the_data_not_the_prompt_cap(tmp_path):
    """The same prompts make rows of the same width whether max_prompt_length is 32, 512 or unset (TRL 1.16: no
    cap); the width is the longest prompt's bucket + the longest completion's; the train step is compiled once
    per width met (and the generator once per prompt bucket)."""
    widths = {}
    for cap in (32, 512, None):
        out = tmp_path / f"cap-{cap}"
        t = grpo_trainer(out, max_prompt_length=cap, max_training_steps=3, max_completion_length=12)
        t.train()
        seen = [r["train/rows/width"] for r in rows(out) if "train/rows/width" in r]
        widths[cap] = seen
        assert sorted(t.setup.train_fn.compiled) == sorted(set(seen))  # one compile per width, reused after
    # prompts of ~4 tokens: bucket 16; completions of 12 tokens: the bucket 16 cut to max_completion_length
    assert widths[32] == widths[512] == widths[None] == [16 + 12] * 3, widths
    tokens = [r["train/tokens_seen"] for r in rows(tmp_path / "cap-512") if "train/tokens_seen" in r]
    assert tokens == [16 * 28, 2 * 16 * 28, 3 * 16 * 28]  # the rows' own width, not the cap's
    assert GRPOConfig().rl.max_prompt_length is None and GRPOConfig().rl.max_completion_length == 512  # TRL's


def test_trl_grpo_keys_without_a_prompt_cap_run_on_a_short_model(tmp_path):
    """A TRL 1.16 GRPOConfig's keys, no max_prompt_length, on a model of 256 positions: the rows are the data's
    width, never 512 + completion. Each key is checked to be TRL's own."""
    trl = pytest.importorskip("trl")
    keys = dict(
        num_generations=4,
        max_completion_length=64,
        temperature=1.0,
        top_k=16,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
    )
    fields = trl.GRPOConfig.__dataclass_fields__
    assert all(k in fields for k in keys) and "max_prompt_length" not in fields

    def trainer(out, records):
        cfg = GRPOConfig(
            **keys,
            total_batch_size=8,
            max_training_steps=2,
            save_directory=str(out),
            progress_bar=False,
            use_tensorboard=False,
            warmup_steps=0,
        )
        return GRPOTrainer(
            cfg,
            model=jm.create_model(tiny(max_position_embeddings=256), lazy=True),
            dataset_train=records,
            processing_class=TOK,
            mesh=mesh(1),
            reward_funcs=letter_e,
        )

    trainer(tmp_path / "a", RECORDS).train()
    assert all(r["train/rows/width"] <= 16 + 64 for r in rows(tmp_path / "a") if "train/rows/width" in r)
    long = [{"prompt": " ".join(WORDS * 30)}] * 8  # ~240 tokens + 64 > 256 positions: refused before step 1
    with pytest.raises(
        ValueError, match=r"the longest prompt \(record 0\) is \d+ tokens, \+ max_completion_length = 64"
    ):
        trainer(tmp_path / "b", long).train()
    assert not (tmp_path / "b" / "checkpoints").exists()


def test_sampler_log_probs_equal_the_trainers_in_float32_and_are_reported_in_bf16(tmp_path):
    """The log-probs recorded while sampling equal the training forward's on the same tokens (float32: within
    1e-6, the step's `sampling/sampling_logp_difference/max`); in bf16 the difference is reported every step."""
    grpo_trainer(tmp_path / "f32", max_training_steps=2).train()
    logged = [r for r in rows(tmp_path / "f32") if "train/sampling/sampling_logp_difference/max" in r]
    assert len(logged) == 2 and all(r["train/sampling/sampling_logp_difference/max"] <= 1e-6 for r in logged), logged
    grpo_trainer(tmp_path / "bf16", max_training_steps=2, dtype="bfloat16").train()
    logged = [r for r in rows(tmp_path / "bf16") if "train/sampling/sampling_logp_difference/max" in r]
    assert len(logged) == 2 and all(r["train/sampling/sampling_logp_difference/mean"] >= 0 for r in logged)


def test_bucketed_rows_give_the_loss_of_rows_padded_to_the_caps(tmp_path):
    """The bucketed rollout rows, padded on the right to the caps' full width (masked columns), give the same
    loss, metrics and gradients: narrowing the rows changes no number, early-ended completions stay masked."""
    t = grpo_trainer(tmp_path, max_training_steps=1, beta=0.05, num_iterations=2)
    t.initialize_trainer_utils()
    batch = t.batches.rollout(0)

    def pad(x, left, right):  # per-token arrays (ids with the pad id 0, masks 0, log-probs 0) widened
        x = np.asarray(x)
        return jnp.asarray(x if x.ndim < 3 else np.pad(x, ((0, 0), (0, 0), (left, right))))

    right = {k: pad(v, 0, 32) for k, v in batch.items()}  # completions padded to a cap
    left = {k: pad(v, 32, 0) for k, v in batch.items()}  # prompts left-padded to a cap: the layout before issue 50
    assert TOK.pad_token_id == 0
    objective = t.step_config.objective
    cfg = t.step_config

    def run(b):
        mb = {k: v[0] for k, v in b.items()}
        (loss, sums), grads = jax.value_and_grad(lambda p: objective.loss(t.state, p, mb, cfg), has_aux=True)(
            t.state.params
        )
        return loss, sums, grads

    with jax.set_mesh(t.mesh):
        a = run(batch)
        for wide in (right, left):
            b = run(wide)
            np.testing.assert_allclose(a[0], b[0], atol=1e-5)  # the loss is ~0 at ratio 1: float32 rounding
            for k in a[1]:
                np.testing.assert_allclose(a[1][k], b[1][k], rtol=1e-5, atol=1e-6, err_msg=k)
            ga, gb = (np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(g)]) for g in (a[2], b[2]))
            assert np.linalg.norm(ga - gb) <= 1e-4 * np.linalg.norm(ga), (np.linalg.norm(ga - gb), np.linalg.norm(ga))
    t.finish()


def test_no_step_or_rollout_program_holds_the_whole_logits(tmp_path):
    """No `[B, T, V]` logits in the compiled train step, the reference/old log-probs program or the generator:
    the output layer runs in blocks of positions (loss_block_size) and a prompt's prefill projects its last
    position only."""
    import re

    import jaxloom.generation as jg
    from jaxloom.generation import decode

    t = grpo_trainer(tmp_path, max_training_steps=1, loss_block_size=64, beta=0.1, max_completion_length=16)
    t.initialize_trainer_utils()
    vocab, rows_ = len(TOK), t.arguments.total_batch_size
    batch = t.batches.rollout(0)
    width = batch["input_ids"].shape[-1]
    with jax.set_mesh(t.mesh):
        texts = {
            "train step": t.functions.lower(rows_, width).compile().as_text(),
            "log-probs": t._logps_fn.lower(t.state, batch, False, False).compile().as_text(),
        }
    config = jg.GenerationConfig(max_new_tokens=16, do_sample=True)
    prompt = np.ones((4, 16), np.int32)
    graphdef, state = jax.tree_util.tree_map(lambda x: x, __import__("flax").nnx.split(t.state.model))
    texts["generation"] = (
        decode._compiled(graphdef, config, 4).lower(state, prompt, prompt, jax.random.PRNGKey(0)).compile().as_text()
    )
    for name, text in texts.items():
        shapes = {tuple(int(d) for d in m.split(",")) for m in re.findall(r"\[(\d+(?:,\d+)+)\]", text)}
        whole = [s for s in shapes if s and s[-1] == vocab and int(np.prod(s[:-1])) >= rows_ * (width - 1)]
        assert not whole, f"{name}: {whole}"
    t.finish()


def test_the_prompt_cursor_is_saved_with_the_state_and_checked_on_resume(tmp_path):
    """The prompt order is a cursor saved in each checkpoint (its position = the steps served) and restored with
    the state; resuming on other prompts, or with another seed, is refused naming what changed."""
    from jaxloom.trainer.grpo import PromptOrder

    order = PromptOrder(RECORDS, 4, seed=3, shuffle=True, iterations=2)
    served = [next(order) for _ in range(5)]
    assert served == [0, 0, 1, 1, 2] and order.global_state_dict()["position"] == 5
    again = PromptOrder(RECORDS, 4, seed=3, shuffle=True, iterations=2, state=order.global_state_dict())
    assert next(again) == next(order) == 2 and again.prompts(2) == order.prompts(2)
    with pytest.raises(ValueError, match=r"the prompts or their order changed .*records: 64 → 8"):
        PromptOrder(RECORDS[:8], 4, seed=3, shuffle=True, iterations=2, state=order.global_state_dict())
    with pytest.raises(ValueError, match=r"seed: 3 → 4"):
        PromptOrder(RECORDS, 4, seed=4, shuffle=True, iterations=2, state=order.global_state_dict())
    grpo_trainer(tmp_path, max_training_steps=2, save_steps=2).train()
    resumed = grpo_trainer(tmp_path, max_training_steps=3)
    resumed.train()
    assert resumed.batches.train.position == 3  # continued from the saved position 2, then one step


def test_rollouts_through_the_paged_engine(tmp_path):
    """`generation_backend="paged"` (TRL's `use_transformers_paged=true` too) samples through `LLMEngine`: the sampler's
    log-probs equal the training forward's (float32, the step's `sampling/sampling_logp_difference/max`), completions
    end at EOS, and the same seed samples the same rollouts again."""
    assert GRPOConfig(use_transformers_paged=True).rl.generation_backend == "paged"
    assert GRPOConfig().rl.generation_backend == "static"
    with pytest.raises(ValueError, match="generation_backend"):
        GRPOConfig(generation_backend="vllm")
    runs = []
    for name in ("a", "b"):
        grpo_trainer(tmp_path / name, max_training_steps=2, generation_backend="paged").train()
        runs.append(rows(tmp_path / name))
    logged = [r for r in runs[0] if "train/sampling/sampling_logp_difference/max" in r]
    assert len(logged) == 2 and all(r["train/sampling/sampling_logp_difference/max"] <= 1e-6 for r in logged), logged
    assert [r.get("train/loss") for r in runs[0]] == [r.get("train/loss") for r in runs[1]]
    assert any(r.get("train/completions/mean_length", 0) > 0 for r in runs[0])


def test_the_plan_counts_a_rollouts_kv_cache_at_its_most(tmp_path, monkeypatch):
    """`jaxloom plan`'s `rollout_kv_cache_gb` (`Sampler.kv_cache_bytes`, issue 71): `total_batch_size`
    completions of the widest row, every layer's keys and values; the static sampler with the prompts' prefill
    beside the group's copy, the paged engine in whole pages with its trash page. A paged rollout's pool, made
    from the prompts it really got, is never larger."""
    config = tiny()
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # float32 k and v
    model = jm.create_model(config, lazy=True)
    static = grpo_trainer(tmp_path / "s")
    width = static.batches.widest_row()
    assert width == 16 + 8  # the prompt cap's bucket (prompt widths go by 16) and max_completion_length
    most = static.batches.sampler.kv_cache_bytes(model, prompts=4, width=width)
    assert most == (16 + 4) * width * per_position  # 16 completions of 4 prompts, the 4 prompts' prefill beside
    paged = grpo_trainer(tmp_path / "p", max_training_steps=1, generation_backend="paged")
    planned = paged.batches.sampler.kv_cache_bytes(model, prompts=4, width=width)
    assert planned == (1 + 16 * 2) * 16 * per_position  # a 24-position row takes two pages
    from jaxloom.trainer.grpo import sampler

    made, close = [], sampler.PagedRollout.close

    def closing(self):  # the real pool each rollout made, read as it is freed
        made.append(self.engine.pool.num_pages)
        close(self)

    monkeypatch.setattr(sampler.PagedRollout, "close", closing)
    paged.train()
    assert made and all(1 < pages <= planned // (16 * per_position) for pages in made), (made, planned)


def test_paged_tool_turns_run_only_the_turns_tokens():
    """With tool turns to follow, the paged rollout keeps each completion's pages: a row continued after its tool
    turn runs only that turn's tokens (and its last sampled one), and decodes what the whole history decoded afresh
    does (greedy); every page returns at `close`."""
    import jaxloom.generation as jg
    from jaxloom.trainer.grpo.sampler import PagedRollout

    model = jm.create_model(tiny(), seed=4)
    prompt = np.array([[0, 5, 6, 7], [8, 9, 10, 11]], np.int32)
    mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1]], np.int32)
    config = jg.GenerationConfig(max_new_tokens=24, pad_token_id=0, eos_token_id=tuple(range(30, 2048)))
    paged = PagedRollout(model, prompt, mask, jax.random.PRNGKey(0), 2, config, None, keep=True)
    ids, m, _ = paged.completions()
    rows, turn = [0, 3], [[20, 21, 22], [23, 24]]
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    histories = [prompts[r // 2] + ids[r][m[r] > 0].tolist() + t for r, t in zip(rows, turn, strict=True)]
    before = paged.engine.stats["prefill_tokens"]
    new = paged.continue_rows(rows, histories, max_completion_length=24)
    assert paged.engine.stats["prefill_tokens"] - before == sum(1 + len(t) for t in turn)
    for r, (got, logps), h in zip(rows, new, histories, strict=True):
        room = 24 - (len(h) - len(prompts[r // 2]))
        (fresh,) = jg.LLMEngine(model, config).generate([h], max_new_tokens=room)
        assert got == fresh.outputs[0].token_ids and len(logps) == len(got) > 0 and room > 0
    paged.close()
    assert paged.engine.pool.free == paged.engine.pool.usable


def test_rloo_from_the_command_line_learns_the_letter_from_the_reward_alone(tmp_path, monkeypatch, capsys):
    """`trainer=rloo` (TRL's RLOOTrainer: the leave-one-out baseline, its KL a reward penalty with TRL's default
    beta 0.05, so the initial policy is held as the reference) on the letter task of the GRPO test above; the run
    directory then converts and evaluates."""
    from jaxloom.trainer.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "letters.py").write_text(
        "def letter_e(prompts, completions, **kwargs):\n"
        "    return [c.count('e') / max(len(c), 1) for c in completions]\n"
    )
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    model = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2"]
    argv = ["train", "trainer=rloo", "data.train=p.jsonl", "reward_funcs=letters.letter_e", "num_generations=4"]
    argv += ["max_prompt_length=8", "max_completion_length=8", "total_batch_size=16", "max_training_steps=30"]
    argv += ["learning_rate=1e-2", "warmup_steps=0", "top_k=16", "save_directory=run", "progress_bar=false", *model]
    argv += ["logging_steps=1"]
    assert main(argv) == 0
    got = rows(tmp_path / "run")
    rewards = [r["train/reward"] for r in got if "train/reward" in r]
    assert len(rewards) == 30
    assert np.mean(rewards[-5:]) > 1.5 * np.mean(rewards[:5]), rewards
    last = [r for r in got if "train/reward" in r][-1]
    assert {"train/kl", "train/clip_ratio/region_mean", "train/rewards/letter_e/std"} <= set(last)
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["trainer"] == "rloo"
    assert main(["convert", "--to-hf", "run", "hf"]) == 0 and (tmp_path / "hf" / "config.json").is_file()
    capsys.readouterr()
    assert main(["plan", "run"]) == 0
    planned = capsys.readouterr().out
    assert "parameters" in planned and json.loads(planned[planned.index("{") :])["rollout_kv_cache_gb"] > 0
    assert main(["eval", "run", "data.eval=p.jsonl"]) == 0
    out = capsys.readouterr().out
    scores = json.loads(out[out.index('{\n  "step"') :])
    assert scores["step"] == 30 and "eval/reward" in scores, scores
    with pytest.raises(ValueError, match="loss_type = 'grpo' is GRPO's; RLOO's loss is its own"):
        from jaxloom.trainer import RLOOConfig

        RLOOConfig(loss_type="grpo", reward_funcs=["letters.letter_e"])


def test_rloo_sigkill_then_resume_ends_bitwise_equal(tmp_path, monkeypatch):
    """`jaxloom train trainer=rloo`, killed by SIGKILL after step 7 and started again, resumes from step 4's
    checkpoint (its prompt cursor, sampling keys and reference restored) and ends bit for bit where an
    uninterrupted run ends."""
    from test_resume_cli import resumes_bitwise

    monkeypatch.chdir(tmp_path)  # the workers import the reward module from their working directory
    (tmp_path / "letters.py").write_text(
        "def letter_e(prompts, completions, **kwargs):\n"
        "    return [c.count('e') / max(len(c), 1) for c in completions]\n"
    )
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    extra = ["trainer=rloo", "data.train=p.jsonl", "reward_funcs=letters.letter_e", "num_generations=4"]
    extra += ["max_prompt_length=16", "max_completion_length=16", "max_training_steps=8", "learning_rate=1e-2"]
    resumes_bitwise(tmp_path, extra)
    assert any("train/reward" in r for r in rows(tmp_path / "run"))


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_the_samplers_corrections_equal_trls(mode):
    """TRL 1.16's importance-sampling correction of the sampler's log-probs (its lines in
    `GRPOTrainer._generate_and_score_completions`, written out in torch) and its off-policy sequence mask (TRL's own
    `get_off_policy_mask`), on the same tensors, to 1e-6."""
    torch = pytest.importorskip("torch")
    from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer

    from jaxloom.trainer.grpo.loss import off_policy_mask, sampler_correction

    rng = np.random.default_rng(1)
    b, t = 6, 9
    old, sampled = rng.normal(-2, 0.4, (b, t)).astype(np.float32), rng.normal(-2, 0.4, (b, t)).astype(np.float32)
    sampled[0, 2] = np.nan  # a token the sampler could not score
    mask = (rng.random((b, t)) > 0.2).astype(np.float32)
    adv = rng.normal(0, 1, b).astype(np.float32)
    lo, hi = 0.5, 1.8
    diff = torch.nan_to_num((torch.tensor(old) - torch.tensor(sampled)) * torch.tensor(mask), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        want = torch.clamp(ratio, min=lo, max=hi)
    else:
        want = ratio.masked_fill((ratio < lo) | (ratio > hi), value=0.0)
    got = sampler_correction(jnp.asarray(old), jnp.asarray(sampled), jnp.asarray(mask), mode, lo, hi)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6, atol=1e-7)
    keep = TRLGRPOTrainer.get_off_policy_mask(
        torch.tensor(adv)[:, None], torch.tensor(old), torch.tensor(sampled), torch.tensor(mask), 0.05
    )
    mine = off_policy_mask(jnp.asarray(adv), jnp.asarray(old), jnp.asarray(sampled), jnp.asarray(mask), 0.05)
    np.testing.assert_array_equal(np.asarray(mine), keep.numpy())
    assert 0 < float(keep.mean()) < 1  # some sequences dropped, some kept


def test_the_samplers_correction_takes_effect_in_a_run(tmp_path):
    """On: a token-mask correction whose bounds exclude ratio 1 masks every token (the float32 sampler agrees with
    the trainer), so the loss and its gradient are 0; the same run without it trains."""
    on = dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_mask")
    grpo_trainer(tmp_path / "on", max_training_steps=1, vllm_importance_sampling_clip_max=0.5, **on).train()
    grpo_trainer(tmp_path / "off", max_training_steps=1).train()
    masked, plain = rows(tmp_path / "on")[0], rows(tmp_path / "off")[0]
    assert masked["train/grad_norm"] == 0 and plain["train/grad_norm"] > 0
    ratio = [masked[f"train/sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")]
    assert ratio == [0, 0, 0] and "train/sampling/importance_sampling_ratio/mean" not in plain  # TRL's: when on
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction correct the sampler by its log-probs"):
        GRPOTrainer(  # an external engine records no log-probs: refused when the trainer is made
            grpo_args(tmp_path / "engine", **on),
            model=jm.create_model(tiny(), lazy=True),
            dataset_train=RECORDS,
            processing_class=TOK,
            reward_funcs=[letter_e],
            rollout_engine=lambda prompt, mask, key: (prompt, mask),
        )


def test_prompts_with_images_for_a_policy_that_reads_none_are_refused_before_step_1(tmp_path):
    """A text policy would be shown none of a prompt's images (TRL refuses such data too): one error naming the
    record, before any rollout."""
    records = [*RECORDS[:3], {**RECORDS[3], "images": ["cat.png"]}]
    with pytest.raises(ValueError, match=r"dataset_train record 3: column 'images' holds 1 image\(s\), and this run"):
        grpo_trainer(tmp_path, records=records, max_training_steps=1).train()
