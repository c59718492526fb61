"""RewardTrainer (issue 55) against TRL's RewardTrainer (trl with torch on CPU): the same HF classifier and the same
8 pairs give the same step-1 loss, accuracy, margin and rewards (text, implicit prompt, chat; with
`center_rewards_coefficient`); a reward model trained here from a causal LM separates two kinds of text, and its
export scores as transformers' `AutoModelForSequenceClassification` scores it."""

import json
import os

import numpy as np
import pytest
from test_dpo_trl import hf_config, pairs
from util import TOK, mesh, tiny

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

import jaxloom.models as jm  # noqa: E402
from jaxloom.trainer import RewardConfig, RewardTrainer  # noqa: E402


def hf_classifier(directory, seed=0):
    torch.manual_seed(seed)
    model = transformers.LlamaForSequenceClassification(hf_config(num_labels=1)).float()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.3)  # rewards spread out, so accuracy and margin say something
    model.save_pretrained(directory)
    return model


def trl_step_one(model, records, tmp_path, center) -> dict[str, float]:
    from datasets import Dataset

    args = trl.RewardConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=8,
        max_steps=1,
        learning_rate=0.0,
        max_length=64,
        center_rewards_coefficient=center,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        bf16=False,
        seed=0,
    )
    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=TOK)
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.model.train()
    with torch.no_grad():
        loss = float(trainer.compute_loss(trainer.model, inputs))
    logged = {k: float(v[-1]) for k, v in trainer._metrics["train"].items()}
    return {"loss": loss, **logged}


def jaxloom_step_one(model_dir, records, tmp_path, center) -> dict[str, float]:
    args = RewardConfig(
        max_length=64,
        center_rewards_coefficient=center,
        total_batch_size=8,
        max_training_steps=1,
        logging_steps=1,
        learning_rate=1e-3,
        save_directory=str(tmp_path / "jaxloom"),
        progress_bar=False,
        use_tensorboard=False,
    )
    model = jm.from_pretrained(str(model_dir), task=jm.TaskType.SEQUENCE_CLASSIFICATION)
    RewardTrainer(args, model=model, dataset_train=records, processing_class=TOK, mesh=mesh(1)).train()
    row = json.loads((tmp_path / "jaxloom" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1
    return {k.removeprefix("train/"): v for k, v in row.items()}


@pytest.mark.parametrize("form,center", [("text", None), ("implicit", 0.01), ("chat", None), ("margin", None)])
def test_step_one_equals_trl(tmp_path, form, center):
    """The forms of TRL's preference data, and its optional `margin` column (a number per pair, in the loss)."""
    model = hf_classifier(tmp_path / "model")
    records = pairs("text" if form == "margin" else form)
    if form == "margin":
        records = [{**r, "margin": [0.0, 0.5, -1.0, 2.0][i % 4]} for i, r in enumerate(records)]
    want = trl_step_one(model, records, tmp_path, center)
    got = jaxloom_step_one(tmp_path / "model", records, tmp_path, center)
    for key in ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward"):
        assert got[key] == pytest.approx(want[key], abs=1e-4), (key, got, want)
    assert 0 < want["accuracy"] < 1  # the pairs are neither all right nor all wrong: accuracy is compared


def separable(n, seed):
    """Pairs whose chosen completion praises and whose rejected one complains (random words around them)."""
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "far", "away"]
    out = []
    for _ in range(n):
        prompt = " ".join(rng.choice(words, 4))
        tail = " ".join(rng.choice(words, 3))
        out.append({"prompt": prompt, "chosen": f" great, wonderful {tail}", "rejected": f" awful, terrible {tail}"})
    return out


def test_a_reward_model_learns_to_separate_exports_for_transformers_and_drives_grpo(tmp_path):
    """A reward model from a causal LM learns to score praise above complaint; its export is a transformers
    classifier with the same scores; given to GRPO as `reward_funcs=[its directory]` (TRL's form), it scores
    completions as TRL's GRPOTrainer scores with a model (sharded over a mesh too), and a GRPO run on two devices
    reads it sharded over its training mesh and logs its reward under its name."""
    args = RewardConfig(
        max_length=24,
        total_batch_size=16,
        max_training_steps=30,
        learning_rate=3e-3,
        warmup_steps=0,
        logging_steps=10,
        evaluation_steps=30,
        save_directory=str(tmp_path / "run"),
        progress_bar=False,
        use_tensorboard=False,
    )
    causal = jm.create_model(tiny(), seed=0)
    t = RewardTrainer(
        args,
        model=causal,
        dataset_train=separable(160, 0),
        dataset_eval=separable(32, 1),
        processing_class=TOK,
        mesh=mesh(2),
    )
    before = t.evaluate()
    out = t.train()
    print("reward model accuracy", before["accuracy"], "->", out.metrics["eval_accuracy"])
    assert out.metrics["eval_accuracy"] == 1.0 and out.metrics["eval_margin"] > 1.0
    assert before["accuracy"] < 1.0 or before["margin"] < 0.5  # it learned it, it did not start there
    assert type(t.state.model).__name__ == "LlamaForSequenceClassification" and t.state.model.lm_head is None

    t.save_pretrained(str(tmp_path / "export"), to_torch=True)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == TOK.pad_token_id
    texts = [r["prompt"] + r["chosen"] + TOK.eos_token for r in separable(4, 2)]
    encoded = TOK(texts, padding=True, return_tensors="np")
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(encoded["input_ids"]), attention_mask=torch.tensor(encoded["attention_mask"]))
    import jax.numpy as jnp

    ours = t.state.model(jnp.asarray(encoded["input_ids"]), attention_mask=jnp.asarray(encoded["attention_mask"]))
    np.testing.assert_allclose(np.asarray(ours.logits), want.logits.numpy(), atol=1e-4, rtol=1e-4)

    TOK.save_pretrained(str(tmp_path / "export"))  # beside the model, as TRL's reward models come
    from jaxloom.trainer.grpo.rewards import RewardModel

    prompts = ["the cat sat", "a mat and", "it ran far", "then the"]
    completions = [" great, wonderful day", " awful, terrible day", " great", " terrible"]
    scored = RewardModel(str(tmp_path / "export"))(prompts=prompts, completions=completions)
    # TRL's recipe: prompt + completion as text, no special tokens added, right padding, the model's logits[:, 0]
    encoded = TOK(
        [p + c for p, c in zip(prompts, completions, strict=True)],
        padding=True,
        add_special_tokens=False,
        return_tensors="pt",
    )
    with torch.no_grad():
        trl_way = hf(**encoded).logits[:, 0].numpy()
    np.testing.assert_allclose(scored, trl_way, atol=1e-4, rtol=1e-4)
    assert scored[0] > scored[1] and scored[2] > scored[3]  # what it learned
    # read sharded over a mesh of 4, three rows split over its data axes (one empty row added): the same scores
    sharded = RewardModel(str(tmp_path / "export"), mesh=mesh(4), data_axes=("dp", "fsdp"))
    np.testing.assert_allclose(sharded(prompts=prompts[:3], completions=completions[:3]), scored[:3], atol=1e-5)

    from jaxloom.trainer import GRPOConfig, GRPOTrainer

    grpo = GRPOTrainer(
        GRPOConfig(
            num_generations=4,
            max_prompt_length=8,
            max_completion_length=6,
            total_batch_size=8,
            max_training_steps=2,
            logging_steps=1,
            save_directory=str(tmp_path / "grpo"),
            progress_bar=False,
            use_tensorboard=False,
        ),
        model=jm.create_model(tiny(), lazy=True),
        dataset_train=[{"prompt": p} for p in prompts * 4],
        processing_class=TOK,
        mesh=mesh(2),
        reward_funcs=[str(tmp_path / "export")],
    )
    grpo.train()
    logged = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["train/rewards/export/mean"]) for r in logged if "train/loss" in r), logged
    # the reward model lies on the training mesh, split over its devices as the policy is
    rm = grpo.reward_functions[0]
    assert rm.mesh is grpo.mesh and rm.data_axes == tuple(grpo.data_axes)
    import jax
    from flax import nnx

    placed = [x.sharding for x in jax.tree_util.tree_leaves(nnx.state(rm._load()[0]))]
    assert all(len(s.device_set) == 2 for s in placed) and any(not s.is_fully_replicated for s in placed)


def test_sigkill_then_resume_ends_bitwise_equal_and_the_run_converts_to_a_classifier(tmp_path):
    """`jaxloom train trainer=reward`: killed after step 7 and resumed, it ends where an uninterrupted run ends, bit
    for bit; `jaxloom convert --to-hf` of the run directory alone gives the classifier transformers loads."""
    from test_dpo import write_pairs
    from test_resume_cli import resumes_bitwise

    from jaxloom.trainer.cli import main

    extra = ["trainer=reward", f"data.train={write_pairs(tmp_path / 'pairs.jsonl', separable(256, 3))}"]
    extra += ["max_length=24", "center_rewards_coefficient=0.01"]
    a, _ = resumes_bitwise(tmp_path, extra)
    assert any(k.startswith("score") for k in a), sorted(a)[:5]

    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1


def test_a_lora_reward_model_trains_its_score_and_loads_in_peft_with_the_same_scores(tmp_path):
    """LoRA on a reward model (TRL's `use_peft` with PEFT's `SEQ_CLS` task): the adapters and the new `score` train
    (PEFT's `modules_to_save`), the base does not; the adapter directory loads in `peft.PeftModel` over transformers'
    classifier of the same base with the scores computed here."""
    if os.environ.get("NOX_CURRENT_SESSION"):  # `nox -s tests` installs peft beside the CPU torch: never skipped
        import peft
    else:
        peft = pytest.importorskip("peft")
    jm.save_hf_model(jm.create_model(tiny(), seed=0), tmp_path / "base")
    args = RewardConfig(
        max_length=24,
        total_batch_size=16,
        max_training_steps=4,
        learning_rate=1e-2,
        use_peft=True,
        lora_r=4,
        lora_target_modules="all-linear",
        save_directory=str(tmp_path / "run"),
        progress_bar=False,
        use_tensorboard=False,
    )
    t = RewardTrainer(
        args, model=jm.from_pretrained(tmp_path / "base"), dataset_train=separable(64, 0), processing_class=TOK
    )
    t.train()
    from flax import nnx

    names = {"/".join(map(str, p)) for p, v in nnx.iter_graph(t.state.model) if isinstance(v, nnx.Param)}
    assert "score/kernel" in names and all(n.endswith(("lora_a", "lora_b")) or n == "score/kernel" for n in names)
    t.save_pretrained(str(tmp_path / "adapter"), to_torch=True)
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["task_type"] == "SEQ_CLS" and written["modules_to_save"] == ["classifier", "score"]

    base = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "base", num_labels=1, pad_token_id=TOK.pad_token_id
    )
    theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    texts = [r["prompt"] + r["rejected"] + TOK.eos_token for r in separable(4, 5)]
    encoded = TOK(texts, padding=True, return_tensors="np")
    with torch.no_grad():
        want = theirs(
            input_ids=torch.tensor(encoded["input_ids"]), attention_mask=torch.tensor(encoded["attention_mask"])
        )
    import jax.numpy as jnp

    ours = t.state.model(jnp.asarray(encoded["input_ids"]), attention_mask=jnp.asarray(encoded["attention_mask"]))
    np.testing.assert_allclose(np.asarray(ours.logits), want.logits.numpy(), atol=1e-4, rtol=1e-4)
