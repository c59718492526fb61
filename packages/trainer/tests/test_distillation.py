"""On-policy distillation (`trainer=distillation`): TRL 1.16's divergence, a smaller student learning toward its
teacher, both models in one step without their logits, exact resume through the command, refusals by name."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from util import TOK, mesh, quiet, tiny

import jaxloom.models as jm
from jaxloom.mesh import gather, named_leaves
from jaxloom.trainer import DistillationConfig, DistillationTrainer

WORDS = ["red", "blue", "green", "cat", "dog", "tree", "sun", "moon"]
PROMPTS = [{"prompt": f"say {w}:"} for w in WORDS * 8]


def sharp_teacher(scale=30.0, seed=5):
    """A teacher wider and deeper than the student (hidden 64, 3 layers vs 32, 2), its output layer scaled so its
    next-token distributions are peaked (a random tiny model's are nearly uniform: nothing to learn from)."""
    teacher = jm.create_model(tiny(hidden=64, layers=3), seed=seed)
    teacher.lm_head.kernel[...] = teacher.lm_head.kernel[...] * scale
    return teacher


def distill_args(tmp, **kw) -> DistillationConfig:
    base = dict(
        max_prompt_length=8,
        max_completion_length=8,
        total_batch_size=8,
        max_training_steps=4,
        learning_rate=1e-2,
        warmup_steps=0,
    )
    return DistillationConfig(**{**base, **quiet(tmp), **kw})


def distill_trainer(tmp, teacher=None, dataset_eval=None, **kw) -> DistillationTrainer:
    return DistillationTrainer(
        distill_args(tmp, **kw),
        model=jm.create_model(tiny(), lazy=True),
        dataset_train=PROMPTS,
        dataset_eval=dataset_eval,
        processing_class=TOK,
        mesh=mesh(1),
        teacher_model=sharp_teacher() if teacher is None else teacher,
    )


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_divergence_equals_trls_kernel(beta):
    """`linear_generalized_jsd` against TRL 1.16's own `_chunked_divergence_loss` (its torch path) on the same
    hidden states and output layers — a teacher of another width, a temperature, a completion mask — the loss
    (TRL: the mean over valid tokens) and the summed entropy."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    rng = np.random.default_rng(0)
    b, t, d, dt, v = 3, 10, 16, 24, 300
    hs, ht = rng.normal(0, 1, (b, t, d)).astype(np.float32), rng.normal(0, 1, (b, t, dt)).astype(np.float32)
    ws, wt = rng.normal(0, 0.3, (v, d)).astype(np.float32), rng.normal(0, 0.5, (v, dt)).astype(np.float32)
    mask = (rng.random((b, t)) > 0.3).astype(np.float32)
    want, want_entropy, n = _chunked_divergence_loss(
        *(torch.tensor(x) for x in (hs, ht, ws, wt, mask)), beta=beta, temperature=0.8
    )
    loss, entropy = jm.linear_generalized_jsd(
        jnp.asarray(hs), jnp.asarray(ws.T), jnp.asarray(ht), jnp.asarray(wt.T), jnp.asarray(mask), beta=beta,
        temperature=0.8, blocks=3,
    )  # fmt: skip
    assert int(n) == int(mask.sum())
    np.testing.assert_allclose(float(loss) / mask.sum(), float(want), rtol=1e-5)
    np.testing.assert_allclose(float(entropy), float(want_entropy), rtol=1e-5)


def test_a_smaller_student_learns_toward_its_teacher(tmp_path):
    """A student of half the width and two thirds of the depth samples its own completions and moves toward the
    teacher's distributions: the JSD (beta 0.5) falls and the student's entropy with it. Measured (seed 0, 30
    steps of 8 completions of 8 tokens, lr 1e-2, the tests' XLA flags): loss 0.645, 0.648, 0.638, 0.628, ... 0.589
    (step 9) ... 0.566 (11) ... 0.527 (21) ... 0.529 (30); entropy 8.31 → 5.5 nats (the vocabulary's uniform 8.32);
    on the held-out prompts 0.641 before training, 0.564 after. The compiled step holds both
    models (the teacher is its argument) and TRL's metrics are logged. The evaluation pass (held-out prompts the
    student completes, scored by the divergence) falls too: logged as `eval/...` at step 30, the same state
    evaluates to the same numbers, and a state given to it is scored without being swapped in."""
    held_out = [{"prompt": f"tell {w}:"} for w in WORDS]
    t = distill_trainer(tmp_path, dataset_eval=held_out, beta=0.5, max_training_steps=30, evaluation_steps=30)
    before = t.evaluate()
    t.train()
    after = [r for r in rows(tmp_path) if "eval/loss" in r]
    assert [r["step"] for r in after] == [30] and after[0]["eval/loss"] < before["loss"] - 0.05, (before, after)
    again = t.evaluate()
    assert again["loss"] == pytest.approx(after[0]["eval/loss"]) and again["entropy"] < before["entropy"]
    trained = t.state  # an untrained student given to the trained run's pass: scored as given, never swapped in
    untrained = t.evaluate(distill_trainer(tmp_path / "fresh", dataset_eval=held_out, beta=0.5).model_state)
    assert untrained["loss"] == pytest.approx(before["loss"]) and t.state is trained
    assert 0 < again["completions/mean_length"] <= 8
    log = [r for r in rows(tmp_path) if "train/loss" in r]
    loss, entropy = [r["train/loss"] for r in log], [r["train/entropy"] for r in log]
    assert len(loss) == 30
    assert np.mean(loss[-5:]) < np.mean(loss[:5]) - 0.05, loss
    assert entropy[-1] < entropy[0] - 1.0, entropy
    for key in ("completions/mean_length", "completions/clipped_ratio", "prompts/truncated", "time/rollout_s"):
        assert f"train/{key}" in log[-1], key
    assert not any(k.startswith("train/reward") for k in log[-1])
    teacher_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(t.teacher.params))
    memory = t.compiled_train_step().memory_analysis()
    assert memory.argument_size_in_bytes > teacher_bytes + 3 * sum(
        x.nbytes for x in jax.tree_util.tree_leaves(t.state.params)
    )


def test_each_beta_trains_and_the_teacher_is_never_changed(tmp_path):
    """Forward KL (0) and reverse KL (1) train too; the teacher's weights are the same after the run. A temperature
    reaches the loss: step 1 of the same rollouts' keys at temperature 2 gives another loss."""
    teacher = sharp_teacher()
    before = {k: np.asarray(v) for k, v in named_leaves(jax.tree_util.tree_map(jnp.copy, teacher_params(teacher)))}
    for beta in (0.0, 1.0):
        t = distill_trainer(tmp_path / str(beta), teacher=teacher, beta=beta, max_training_steps=6)
        t.train()
        loss = [r["train/loss"] for r in rows(tmp_path / str(beta)) if "train/loss" in r]
        assert loss[-1] < loss[0], (beta, loss)
        after = {k: gather(v) for k, v in named_leaves(t.teacher.params)}
        for k in before:
            np.testing.assert_array_equal(before[k], after[k], err_msg=k)
    distill_trainer(tmp_path / "hot", teacher=teacher, beta=1.0, temperature=2.0, max_training_steps=1).train()
    hot = rows(tmp_path / "hot")[0]
    assert hot["train/loss"] != rows(tmp_path / "1.0")[0]["train/loss"] and hot["train/entropy"] > 0


def teacher_params(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_bad_settings_and_inputs_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="beta = 1.5"):
        distill_args(tmp_path, beta=1.5)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        distill_args(tmp_path, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="max_sequence_length = 99"):
        distill_args(tmp_path, max_sequence_length=99)
    with pytest.raises(ValueError, match="needs a teacher"):
        DistillationTrainer(
            distill_args(tmp_path), model=jm.create_model(tiny(), lazy=True), dataset_train=PROMPTS,
            processing_class=TOK, mesh=mesh(1),
        )  # fmt: skip
    other = jm.create_model(jm.LlamaConfig(**{**tiny().__dict__, "vocab_size": len(TOK) + 64}), lazy=True)
    t = distill_trainer(tmp_path / "vocab", teacher=other)
    with pytest.raises(ValueError, match="the same vocabulary"):
        t.train()
    with pytest.raises(ValueError, match="no dataset_eval was given"):
        distill_trainer(tmp_path / "no-eval").evaluate()


def test_sigkill_then_resume_ends_bitwise_equal_through_the_command(tmp_path, capsys):
    """`jaxloom train trainer=distillation teacher_model_name_or_path=DIR` (a transformers teacher directory of
    another size): killed after step 7 and resumed from step 4's checkpoint, it ends bit for bit where an
    uninterrupted run ends (the prompt cursor and the sampling keys are restored, the teacher reloaded), and the
    student learned toward the teacher. `jaxloom plan` counts the teacher in the step's memory."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_resume_cli import resumes_bitwise

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(TOK), hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=TOK.pad_token_id,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        hf.lm_head.weight.mul_(30.0)
    hf.save_pretrained(tmp_path / "teacher")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    extra = [
        "trainer=distillation",
        f"teacher_model_name_or_path={tmp_path / 'teacher'}",
        f"data.train={prompts}",
        "max_prompt_length=16",
        "max_completion_length=16",
        "beta=0.5",
        "learning_rate=1e-2",
        "max_training_steps=8",  # killed after 7, resumed from 4
    ]
    resumes_bitwise(tmp_path, extra)
    from jaxloom.trainer.cli import main

    tiny_run = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2", "total_batch_size=8"]
    assert main(["plan", *extra, *tiny_run]) == 0
    state = json.loads(capsys.readouterr().out)["state_gb_per_device"]
    assert state["teacher"] > state["parameters"] > 0, state
    loss = [r["train/loss"] for r in rows(tmp_path / "ref") if "train/loss" in r]
    assert loss[-1] < loss[0], loss


def test_a_teacher_stored_in_nf4_distills_close_to_the_full_one_in_an_eighth_of_its_bytes(tmp_path):
    """`teacher_model_init_kwargs={"load_in_4bit": True}` (TRL's name; transformers' flag): the teacher's linear
    layers are held in QLoRA's NF4 code, under a sixth of their float32 bytes (codes and block scales); step 1 (the
    same rollouts: the same student and seed) gives a loss within 5 % of the full teacher's, not equal to it; the
    given model object is not changed."""
    teacher = sharp_teacher()
    runs = {}
    for name, kw in (("full", {}), ("nf4", {"teacher_model_init_kwargs": {"load_in_4bit": True}})):
        runs[name] = distill_trainer(tmp_path / name, teacher=teacher, beta=0.5, max_training_steps=1, **kw)
        runs[name].train()
    full, nf4 = (rows(tmp_path / n)[0]["train/loss"] for n in ("full", "nf4"))
    assert full != nf4 and abs(full - nf4) < 0.05 * full, (full, nf4)
    kernels = sum(
        v.nbytes for k, v in named_leaves(runs["full"].teacher.params) if k.endswith("kernel") and "lm_head" not in k
    )
    codes = sum(v.nbytes for k, v in named_leaves(runs["nf4"].teacher.model_state) if "kernel_" in k)
    assert 0 < codes < kernels / 6, (codes, kernels)
    assert not any("kernel_codes" in k for k in nnx_state_names(teacher))
    with pytest.raises(ValueError, match="expected load_in_4bit or load_in_8bit"):
        distill_args(tmp_path, teacher_model_init_kwargs={"device_map": "auto"})


def nnx_state_names(model) -> list[str]:
    from flax import nnx

    return [k for k, _ in named_leaves(nnx.to_pure_dict(nnx.state(model)))]
