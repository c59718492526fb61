"""DPOTrainer on jaxloom's core: it learns a preference, resumes bitwise after SIGKILL, precomputes the
reference, and names or skips bad records."""

import json
import signal

import numpy as np
import pytest
from test_resume_cli import run
from util import TOK, mesh, params_of, quiet, tiny

import jaxloom.models as jm
from jaxloom.trainer import DPOConfig, DPOTrainer

WORDS = ["red", "blue", "green", "cat", "dog", "tree", "sun", "moon", "fish", "bird", "rock", "leaf"]


def rule_pairs(n: int, seed: int) -> list[dict]:
    """The rule: the answer repeats the word asked for. Chosen follows it, rejected names another word."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        w, v = rng.choice(len(WORDS), 2, replace=False)
        out.append({"prompt": f"say {WORDS[w]}:", "chosen": f" {WORDS[w]}", "rejected": f" {WORDS[v]}"})
    return out


def dpo_args(tmp, **kw) -> DPOConfig:
    base = dict(max_length=16, total_batch_size=8, max_training_steps=6, learning_rate=3e-3, warmup_steps=2)
    return DPOConfig(**{**base, **quiet(tmp), **kw})


def dpo_trainer(tmp, train, evaluation=None, **kw) -> DPOTrainer:
    return DPOTrainer(
        dpo_args(tmp, **kw),
        model=jm.create_model(tiny(), lazy=True),
        dataset_train=train,
        dataset_eval=evaluation,
        processing_class=TOK,
        mesh=mesh(1),
    )


def rows(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_tiny_model_from_scratch_learns_the_preferred_rule(tmp_path):
    train, held_out = rule_pairs(512, 0), rule_pairs(64, 1)
    out = dpo_trainer(
        tmp_path,
        train,
        held_out,
        max_training_steps=200,
        evaluation_steps=50,
        logging_steps=50,
        learning_rate=1e-2,
        warmup_steps=10,
        eval_batches=8,
    ).train()
    evals = [r for r in rows(tmp_path) if "eval/rewards/accuracies" in r]
    print([(r["step"], r["eval/rewards/accuracies"], r["eval/rewards/margins"]) for r in evals])
    assert [r["step"] for r in evals] == [50, 100, 150, 200]
    assert evals[0]["eval/rewards/accuracies"] < 0.9  # not known before training: it is learnt
    assert evals[-1]["eval/rewards/accuracies"] >= 0.9
    assert out.metrics["eval_rewards/margins"] > 0
    assert out.metrics["loss"] < np.log(2)  # below the loss of a policy equal to its reference


def write_pairs(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_sigkill_then_resume_ends_bitwise_equal(tmp_path):
    extra = ["trainer=dpo", f"data.train={write_pairs(tmp_path / 'pairs.jsonl', rule_pairs(256, 2))}", "beta=0.2"]
    ref, _, err = run(tmp_path / "ref", extra=extra)
    assert ref.returncode == 0, err[-3000:]
    killed, _, _ = run(tmp_path / "run", kill_after=7, extra=extra)
    assert killed.returncode == -signal.SIGKILL
    again, lines, err = run(tmp_path / "run", extra=extra)
    assert again.returncode == 0, err[-3000:]
    assert f"resumed from checkpoint {tmp_path / 'run'}/checkpoints/4" in err
    a, b = np.load(tmp_path / "ref" / "final.npz"), np.load(tmp_path / "run" / "final.npz")
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # the reference is rebuilt from its source, never written into the checkpoints
    meta = (tmp_path / "run" / "checkpoints" / "16").rglob("*")
    assert not [p for p in meta if "ref" in p.name.lower()]
    assert any("train/rewards/margins" in r for r in rows(tmp_path / "run"))


def test_precomputed_reference_log_probs_equal_the_live_reference_and_free_it(tmp_path, caplog):
    caplog.set_level("INFO", logger="jaxloom.trainer")
    train = rule_pairs(16, 3)
    live = dpo_trainer(tmp_path / "live", train, max_training_steps=2).train()
    t = dpo_trainer(tmp_path / "pre", train, max_training_steps=2, precompute_ref_log_probs=True)
    pre = t.train()
    distinct = {json.dumps(r, sort_keys=True) for r in train}
    assert t.ref_state is None and len(t.reference.cache) == len(distinct)  # the reference is not held in training
    for k in ("loss", "logps/chosen", "rewards/margins"):
        a, b = rows(tmp_path / "live")[0][f"train/{k}"], rows(tmp_path / "pre")[0][f"train/{k}"]
        np.testing.assert_allclose(a, b, rtol=1e-5, err_msg=k)
    assert pre.metrics["loss"] == pytest.approx(live.metrics["loss"], rel=1e-5)
    saved = list((tmp_path / "pre" / "ref_logps").glob("*.process_0.npz"))
    assert len(saved) == 1  # kept beside the run: a resume reads it instead of computing again
    again = dpo_trainer(tmp_path / "pre", train, max_training_steps=3, precompute_ref_log_probs=True)
    again.train()
    assert again.ref_state is None and sorted(again.reference.cache) == sorted(t.reference.cache)
    for k, v in t.reference.cache.items():
        np.testing.assert_array_equal(again.reference.cache[k], v)
    assert "read from" in caplog.text and str(saved[0]) in caplog.text


def test_a_bad_record_is_named_or_skipped_and_counted(tmp_path):
    records = rule_pairs(15, 4)
    records.insert(5, {"prompt": "say red:", "chosen": "", "rejected": " blue"})
    path = write_pairs(tmp_path / "pairs.jsonl", records)
    with pytest.raises(ValueError, match=r"pairs.jsonl:6: the 'chosen' completion is empty"):
        dpo_trainer(tmp_path / "strict", path, max_training_steps=2, shuffle_train_dataset=False).train()
    dpo_trainer(
        tmp_path / "skip", path, max_training_steps=2, skip_bad_records=True, shuffle_train_dataset=False
    ).train()
    assert rows(tmp_path / "skip")[-1]["train/skipped_records"] == 1.0


def test_dpo_config_takes_trl_names_and_refuses_what_it_cannot_do():
    a = DPOConfig(max_length=1024, beta=0.05, loss_type="ipo")
    assert (a.max_sequence_length, a.max_length, a.truncation_mode, a.packing) == (1024, 1024, "keep_start", False)
    with pytest.raises(ValueError, match="loss_type"):
        DPOConfig(loss_type="kto")
    with pytest.raises(ValueError, match="packing"):
        DPOConfig(packing=True)
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOConfig(loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(TypeError, match="DPOConfig"):
        from jaxloom.trainer import TrainingArguments

        DPOTrainer(TrainingArguments(), model=jm.create_model(tiny(), lazy=True), dataset_train=[])


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_fused_output_layer_trains_as_the_whole_logits_do(tmp_path, loss_type):
    """With `loss_block_size` the policy's and the reference's log-probs come from blocks (no logits) and
    the gradient through `cross_entropy_gradient` weighted by d loss / d logp: the same metrics and the same
    parameters after three updates as with the whole logits (`loss_block_size=0`), on two data shards, and
    a step that needs less temporary memory than the policy's logits of a micro-batch."""
    train = rule_pairs(64, 3)
    out = {}
    for size in (0, 4):
        t = DPOTrainer(
            dpo_args(tmp_path / str(size), max_training_steps=3, loss_type=loss_type, loss_block_size=size),
            model=jm.create_model(tiny(), lazy=True),
            dataset_train=train,
            processing_class=TOK,
            mesh=mesh(2),
        )
        temp = t.compiled_train_step().memory_analysis().temp_size_in_bytes
        out[size] = (t.train(), rows(tmp_path / str(size)), temp)
    for a, b in zip(out[0][1], out[4][1], strict=True):
        for k in ("train/loss", "train/rewards/margins", "train/logps/chosen", "train/logits/rejected"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
    logits_per_device = 8 * 16 * len(TOK) * 4  # 4 pairs (8 sequences) x 16 positions x vocabulary, float32
    assert out[0][2] - out[4][2] > logits_per_device, (out[0][2], out[4][2])
    whole, fused = params_of(out[0][0].state), params_of(out[4][0].state)
    for k in whole:
        np.testing.assert_allclose(whole[k], fused[k], rtol=1e-4, atol=1e-6, err_msg=k)
