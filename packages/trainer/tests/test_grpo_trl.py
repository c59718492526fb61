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
SETTINGS = {  # each loss with a setting of its own changed where it acts at step 1
    "cispo": {"epsilon_high": 5.0},
    "luspo": {"importance_sampling_level": "sequence"},
    "sapo": {"sapo_temperature_neg": 2.0},
}


def rollout(prompts, trainer):
    """TRL's `rollout_func`: fixed completions, row by row (the prompts are one text, so the order they come in
    does not matter)."""
    ids = TOK.encode(PROMPT, add_special_tokens=False)
    rows = [COMPLETIONS[i % len(COMPLETIONS)] for i in range(len(prompts))]
    return {"prompt_ids": [ids] * len(prompts), "completion_ids": rows, "logprobs": [[-1.0] * len(c) for c in rows]}


def longer(prompts, completions, **kwargs):
    """Rewards by the completion's length: the groups' advantages have both signs."""
    return [float(len(c)) for c in completions]


def trl_settings(tmp_path) -> dict:
    """One step of 8 rows (two prompts × four completions), learning rate 0, on CPU in float32: TRL's side."""
    return dict(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        max_steps=1, learning_rate=0.0, logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
        seed=0,
    )  # fmt: skip


def jaxloom_settings(tmp_path) -> dict:
    """The same step on jaxloom's side."""
    return dict(
        num_generations=4, max_completion_length=8, total_batch_size=8, max_training_steps=1, logging_steps=1,
        learning_rate=0.0, save_directory=str(tmp_path / "jaxloom"), progress_bar=False, use_tensorboard=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "llama"
    hf_llama(0, directory)
    return directory


def trl_step_one(model_dir, loss_type, tmp_path) -> dict[str, float]:
    from datasets import Dataset

    args = trl.GRPOConfig(**trl_settings(tmp_path), loss_type=loss_type, **SETTINGS.get(loss_type, {}))
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
    args = GRPOConfig(**jaxloom_settings(tmp_path), loss_type=loss_type, **SETTINGS.get(loss_type, {}))
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


# ---- RLOO against TRL 1.16's RLOOTrainer --------------------------------------------------------------------
def sometimes_none(prompts, completions, **kwargs):
    """A second reward that scores only some completions (None: no reward): the leave-one-out baseline averages the
    scored siblings only when every function gave None."""
    return [float(len(c) % 3) if i % 4 else None for i, c in enumerate(completions)]


SEEN: dict = {}  # the prompt's token ids as TRL's RLOOTrainer made them


def trl_rloo_step_one(model_dir, settings, tmp_path) -> dict[str, float]:
    from datasets import Dataset

    args = trl.RLOOConfig(**trl_settings(tmp_path), **settings)
    trainer = trl.RLOOTrainer(
        model=str(model_dir),
        reward_funcs=[longer, sometimes_none],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": PROMPT}] * 16),
        processing_class=TOK,
    )

    def fixed(prompt_ids, images, multimodal_fields):  # TRL's RLOO has no rollout_func: its generation replaced
        SEEN["prompt_ids"] = list(prompt_ids[0])
        return [COMPLETIONS[i % len(COMPLETIONS)] for i in range(len(prompt_ids))]

    trainer._generate_single_turn = fixed
    trainer.train()
    logged = next(row for row in trainer.state.log_history if "grad_norm" in row)
    return logged


def jaxloom_rloo_step_one(model_dir, settings, tmp_path) -> dict[str, float]:
    from jaxloom.trainer import RLOOConfig, RLOOTrainer

    def same_rows(prompts, trainer):  # the prompt as TRL's RLOO tokenized it, the same completions
        out = rollout(prompts, trainer)
        return {**out, "prompt_ids": [SEEN["prompt_ids"]] * len(prompts)}

    args = RLOOConfig(**jaxloom_settings(tmp_path), **settings)
    trainer = RLOOTrainer(
        args,
        model=jm.from_pretrained(str(model_dir)),
        dataset_train=[{"prompt": PROMPT}] * 16,
        processing_class=TOK,
        mesh=mesh(1),
        reward_funcs=[longer, sometimes_none],
        rollout_func=same_rows,
    )
    trainer.train()
    row = json.loads((tmp_path / "jaxloom" / "metrics.jsonl").read_text().splitlines()[0])
    return {k.removeprefix("train/"): v for k, v in row.items()}


@pytest.mark.parametrize(
    "settings",
    [{}, {"normalize_advantages": True, "beta": 0.0, "reward_clip_range": (0.0, 12.0)}],
    ids=["defaults", "normalized-clipped"],
)
def test_rloo_step_one_equals_trls(model_dir, settings, tmp_path):
    """TRL's RLOO defaults (`beta` 0.05: the reference held, its KL a reward penalty), and normalised advantages of
    clipped rewards without a reference: the step-1 loss, gradient norm and TRL's reward metrics agree."""
    theirs = trl_rloo_step_one(model_dir, settings, tmp_path)
    ours = jaxloom_rloo_step_one(model_dir, settings, tmp_path)
    assert theirs["grad_norm"] > 0
    for key in ("loss", "grad_norm", "reward", "reward_std", "rewards/longer/mean", "rewards/sometimes_none/mean"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, ours, theirs)
    if settings.get("beta", 0.05):
        assert ours["kl"] == pytest.approx(theirs["kl"], abs=1e-6)  # 0 at step 1: the reference is the policy
