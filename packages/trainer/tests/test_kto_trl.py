"""KTOTrainer against TRL 1.16's KTOTrainer (trl with torch on CPU): the same two HF Llamas (policy A, reference B)
and the same unpaired records in one batch give the same step-1 loss, KL estimate, rewards, log-probs, logits and
entropy, for both loss types and for text and chat records."""

import json

import numpy as np
import pytest
from test_dpo_trl import models  # noqa: F401 — the module's two HF Llamas, shared
from util import TOK, mesh

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

import jaxloom.models as jm  # noqa: E402
from jaxloom.trainer import KTOConfig, KTOTrainer  # noqa: E402

PROMPTS = ["The capital of France is", "Two plus two", "Name a colour:", "Write a verb", "Sky", "A long prompt " * 4]
COMPLETIONS = [" Paris.", " is four", " red", " the number nine", " Lyon, of course.", " is five"]


def records(form: str, n: int = 8) -> list[dict]:
    out = []
    for i in range(n):
        prompt, completion = PROMPTS[i % len(PROMPTS)] + f" #{i}", COMPLETIONS[i % len(COMPLETIONS)] * (1 + i % 3)
        label = i % 3 != 1  # 5 desirable, 3 undesirable: unequal counts, as real feedback data has
        if form == "chat":
            out.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "completion": [{"role": "assistant", "content": completion.strip()}],
                    "label": label,
                }
            )
        else:
            out.append({"prompt": prompt, "completion": completion, "label": label})
    return out


def trl_step_one(policy, ref, rows, loss_type, tmp_path, weights) -> dict[str, float]:
    from datasets import Dataset

    args = trl.KTOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=len(rows),
        max_steps=1,
        learning_rate=0.0,
        beta=0.1,
        loss_type=loss_type,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
        max_length=64,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        bf16=False,
        seed=0,
    )
    trainer = trl.KTOTrainer(
        model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows), processing_class=TOK
    )
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.model.train()
    with torch.no_grad():
        loss = float(trainer.compute_loss(trainer.model, inputs))
    logged = {k: float(v[-1]) for k, v in trainer._metrics["train"].items()}
    return {"loss": loss, **logged}


def jaxloom_step_one(policy_dir, ref_dir, rows, loss_type, tmp_path, weights, **extra) -> dict[str, float]:
    args = KTOConfig(
        max_length=64,
        beta=0.1,
        loss_type=loss_type,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
        total_batch_size=len(rows),
        max_training_steps=1,
        logging_steps=1,
        learning_rate=1e-3,
        shuffle_train_dataset=False,  # TRL's sequential order: the same records pair for the KL term
        save_directory=str(tmp_path / "jaxloom"),
        progress_bar=False,
        use_tensorboard=False,
        **extra,
    )
    trainer = KTOTrainer(
        args,
        model=jm.from_pretrained(str(policy_dir)),
        ref_model=str(ref_dir),
        dataset_train=rows,
        processing_class=TOK,
        mesh=mesh(1),
    )
    trainer.train()
    row = json.loads((tmp_path / "jaxloom" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1
    return {k.removeprefix("train/"): v for k, v in row.items()}


# (loss type, records, weights, policy and reference: the order in which the KL estimate is positive on the records)
CASES = [
    ("kto", "text", (1.0, 1.0), "BA"),
    ("kto", "chat", (1.0, 1.33), "AB"),
    ("apo_zero_unpaired", "text", (1.2, 1.0), "BA"),
]


@pytest.mark.parametrize("loss_type,form,weights,order", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_step_one_equals_trl(models, loss_type, form, weights, order, tmp_path):  # noqa: F811
    named = dict(zip("AB", models, strict=True))
    (policy_dir, policy), (ref_dir, ref) = named[order[0]], named[order[1]]
    rows = records(form)
    theirs = trl_step_one(policy, ref, rows, loss_type, tmp_path, weights)
    ours = jaxloom_step_one(policy_dir, ref_dir, rows, loss_type, tmp_path, weights)
    keys = ["loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"]
    keys += ["logits/chosen", "logits/rejected", "entropy"]
    print({k: (ours.get(k), theirs.get(k)) for k in keys})
    for k in keys:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert ours["loss"] > 0 and abs(ours["rewards/margins"]) > 1e-3  # the models differ: a non-trivial case
    if loss_type == "kto":
        assert ours["kl"] > 0  # the KL term binds (not clamped to 0): the mismatched pairs are TRL's
