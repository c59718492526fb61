"""GRPOTrainer against TRL 1.16's GRPOTrainer (torch on CPU), each of TRL's eight `loss_type`s (issue 74): the same
HF Llama, the same fixed rollouts through TRL's `rollout_func` (rows of different lengths), the same reward; the
step-1 loss and gradient norm agree to 1e-4 relative. Two of each group are right and two wrong by the reward, so
the advantages are ±; `num_iterations=1`, so the ratio is 1 and the losses differ by their weights and averages."""

import json
import math

import pytest
from test_dpo_trl import hf_llama
from util import TOK, mesh

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

import jaxloom.models as jm  # noqa: E402
from jaxloom.trainer import GRPOConfig, GRPOTrainer  # noqa: E402
from jaxloom.trainer.grpo.loss import LOSS_TYPES  # noqa: E402

PROMPT = "Count the letters:"
# the completion of each row of a step (two prompts × four completions), of 3 to 8 tokens, none an end id
COMPLETIONS = [[11 + (7 * r + 3 * i) % 60 for i in range(3 + (r * 5) % 6)] for r in range(8)]
SETTINGS = {"cispo": {"epsilon_high": 5.0}, "luspo": {"importance_sampling_level": "sequence"}}


def rollout(prompts, trainer):
    """TRL's `rollout_func`: fixed completions, row by row (the prompts are one text, so the order they come in
    does not matter)."""
    ids = TOK.encode(PROMPT, add_special_tokens=False)
    rows = [COMPLETIONS[i % len(COMPLETIONS)] for i in range(len(prompts))]
    return {"prompt_ids": [ids] * len(prompts), "completion_ids": rows, "logprobs": [[-1.0] * len(c) for c in rows]}


def longer(prompts, completions, **kwargs):
    """Rewards by the completion's length: the groups' advantages have both signs."""
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "llama"
    hf_llama(0, directory)
    return directory


def trl_step_one(model_dir, loss_type, tmp_path) -> dict[str, float]:
    from datasets import Dataset

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=1,
        learning_rate=0.0,
        logging_steps=1,
        loss_type=loss_type,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        **SETTINGS.get(loss_type, {}),
    )
    trainer = trl.GRPOTrainer(
        model=str(model_dir),
        reward_funcs=longer,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": PROMPT}] * 16),
        processing_class=TOK,
        rollout_func=rollout,
    )
    trainer.train()
    logged = next(row for row in trainer.state.log_history if "grad_norm" in row)
    return {"loss": logged["loss"], "grad_norm": logged["grad_norm"]}


def jaxloom_step_one(model_dir, loss_type, tmp_path) -> dict[str, float]:
    args = GRPOConfig(
        num_generations=4,
        max_completion_length=8,
        total_batch_size=8,
        max_training_steps=1,
        logging_steps=1,
        learning_rate=0.0,
        loss_type=loss_type,
        save_directory=str(tmp_path / "jaxloom"),
        progress_bar=False,
        use_tensorboard=False,
        **SETTINGS.get(loss_type, {}),
    )
    trainer = GRPOTrainer(
        args,
        model=jm.from_pretrained(str(model_dir)),
        dataset_train=[{"prompt": PROMPT}] * 16,
        processing_class=TOK,
        mesh=mesh(1),
        reward_funcs=[longer],
        rollout_func=rollout,
    )
    trainer.train()
    row = json.loads((tmp_path / "jaxloom" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1
    return {"loss": row["train/loss"], "grad_norm": row["train/grad_norm"]}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_step_one_loss_and_grad_norm_equal_trls(model_dir, loss_type, tmp_path):
    theirs = trl_step_one(model_dir, loss_type, tmp_path)
    ours = jaxloom_step_one(model_dir, loss_type, tmp_path)
    assert theirs["grad_norm"] > 0 and math.isfinite(theirs["loss"])
    for key in ("loss", "grad_norm"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, ours, theirs)
