"""KTOTrainer on jaxloom's core: it learns from thumbs up/down records, resumes bitwise after SIGKILL (and its run
directory plans, evaluates and converts), precomputes the reference without a KL term, and refuses what cannot work."""

import json

import numpy as np
import pytest
from test_dpo import WORDS, rows, write_pairs
from util import TOK, mesh, quiet, tiny

import jaxloom.models as jm
from jaxloom.trainer import KTOConfig, KTOTrainer


def feedback(n: int, seed: int) -> list[dict]:
    """The rule: the answer repeats the word asked for (label true) — or names another (label false)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        w, v = rng.choice(len(WORDS), 2, replace=False)
        good = bool(rng.random() < 0.5)
        out.append({"prompt": f"say {WORDS[w]}:", "completion": f" {WORDS[w if good else v]}", "label": good})
    return out


def kto_trainer(tmp, train, evaluation=None, **kw) -> KTOTrainer:
    base = dict(max_length=16, total_batch_size=8, max_training_steps=6, learning_rate=3e-3, warmup_steps=2)
    return KTOTrainer(
        KTOConfig(**{**base, **quiet(tmp), **kw}),
        model=jm.create_model(tiny(), lazy=True),
        dataset_train=train,
        dataset_eval=evaluation,
        processing_class=TOK,
        mesh=mesh(1),
    )


def test_a_tiny_model_from_scratch_learns_which_completions_are_desirable(tmp_path):
    out = kto_trainer(
        tmp_path,
        feedback(512, 0),
        feedback(64, 1),
        max_training_steps=120,
        evaluation_steps=40,
        logging_steps=40,
        learning_rate=1e-2,
        warmup_steps=10,
        eval_batches=8,
    ).train()
    evals = [r for r in rows(tmp_path) if "eval/rewards/margins" in r]
    print([(r["step"], r["eval/rewards/margins"], r["eval/kl"]) for r in evals])
    assert [r["step"] for r in evals] == [40, 80, 120]
    margins = [r["eval/rewards/margins"] for r in evals]
    assert margins[-1] > margins[0] and margins[-1] > 0.5  # held-out good answers gain on bad ones: it is learnt
    assert out.metrics["loss"] < 0.5  # below the loss of a policy equal to its reference (1 − σ(0))


def test_sigkill_then_resume_ends_bitwise_equal_and_the_run_directory_serves_the_commands(tmp_path, capsys):
    from test_resume_cli import resumes_bitwise

    from jaxloom.trainer.cli import main

    data = write_pairs(tmp_path / "feedback.jsonl", feedback(256, 2))
    extra = ["trainer=kto", f"data.train={data}", "beta=0.2", "undesirable_weight=1.2", "max_length=16"]
    resumes_bitwise(tmp_path, extra)
    assert any("train/kl" in r and "train/rewards/margins" in r for r in rows(tmp_path / "run"))
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["trainer"] == "kto"
    run = str(tmp_path / "run")
    assert main(["plan", run]) == 0
    assert "parameters" in capsys.readouterr().out
    assert main(["eval", run, f"data.eval={data}"]) == 0
    assert "eval/rewards/margins" in capsys.readouterr().out
    assert main(["convert", "--to-hf", run, str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()


def test_precomputed_reference_without_a_kl_term_equals_the_live_one_and_kto_refuses_it(tmp_path):
    train = feedback(16, 3)
    kw = dict(max_training_steps=2, loss_type="apo_zero_unpaired")
    kto_trainer(tmp_path / "live", train, **kw).train()
    t = kto_trainer(tmp_path / "pre", train, precompute_ref_log_probs=True, **kw)
    t.train()
    assert t.ref_state is None and t.reference.cache  # the reference is not held in training
    for k in ("loss", "logps/chosen", "rewards/margins"):
        a, b = rows(tmp_path / "live")[0][f"train/{k}"], rows(tmp_path / "pre")[0][f"train/{k}"]
        np.testing.assert_allclose(a, b, rtol=1e-5, err_msg=k)
    with pytest.raises(ValueError, match="precompute_ref_log_probs = true with loss_type='kto'"):
        KTOConfig(precompute_ref_log_probs=True)


def test_kto_config_takes_trl_names_and_refuses_what_cannot_work(tmp_path):
    a = KTOConfig(max_length=64, beta=0.2, desirable_weight=1.33, learning_rate=5e-7)
    assert (a.max_sequence_length, a.max_length, a.truncation_mode, a.packing) == (64, 64, "keep_start", False)
    assert KTOConfig().max_length == 1024 and KTOConfig().loss_type == "kto"  # TRL's defaults
    with pytest.raises(ValueError, match="undesirable_weight = 0"):
        KTOConfig(undesirable_weight=0)
    with pytest.raises(ValueError, match="1 record per micro-batch: KTO's KL term pairs"):
        kto_trainer(tmp_path, feedback(8, 0), total_batch_size=2, gradient_accumulation_steps=2)
    kto_trainer(tmp_path, feedback(8, 0), total_batch_size=1, loss_type="apo_zero_unpaired")  # no pairs needed
    with pytest.raises(ValueError, match=r"feedback.jsonl:2: label = 'yes'; expected true"):
        bad = feedback(4, 0)
        bad[1]["label"] = "yes"
        kto_trainer(tmp_path / "bad", write_pairs(tmp_path / "feedback.jsonl", bad), max_training_steps=1).train()
