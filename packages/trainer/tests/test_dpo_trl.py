"""DPOTrainer against TRL's DPOTrainer (trl with torch on CPU): the same two HF Llamas (policy A, reference B)
and the same 8 pairs in one batch give the same step-1 loss, reward margin and log-probabilities."""

import json

import numpy as np
import pytest
from util import TOK, mesh

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

import jaxloom.models as jm  # noqa: E402
from jaxloom.trainer import DPOConfig, DPOTrainer  # noqa: E402

PROMPTS = ["The capital of France is", "Two plus two", "Name a colour:", "Write a verb", "Sky", "A long prompt " * 5]
COMPLETIONS = [(" Paris.", " Lyon, of course."), (" is four", " is five"), (" red", " the number nine")]


def pairs(form: str) -> list[dict]:
    out = []
    for i in range(8):
        prompt = PROMPTS[i % len(PROMPTS)] + f" #{i}"
        chosen, rejected = COMPLETIONS[i % len(COMPLETIONS)]
        chosen, rejected = chosen * (1 + i % 3), rejected * (1 + (i + 1) % 2)
        if form == "chat":
            out.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": chosen.strip()}],
                    "rejected": [{"role": "assistant", "content": rejected.strip()}],
                }
            )
        elif form == "implicit":  # no prompt column: chosen and rejected share their start
            out.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
        else:
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def hf_config(**extra):
    """The tiny HF Llama config of these tests (the bundled tokenizer's special tokens)."""
    return transformers.LlamaConfig(
        vocab_size=len(TOK) + 8,  # room for the turn tokens of the family chat formats
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=TOK.bos_token_id,
        eos_token_id=TOK.eos_token_id,
        pad_token_id=TOK.pad_token_id,
        **extra,
    )


def hf_llama(seed: int, directory):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config()).float()
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return (root / "A", hf_llama(0, root / "A")), (root / "B", hf_llama(1, root / "B"))


def trl_step_one(policy, ref, records, loss_type, tmp_path, tok=TOK) -> dict[str, float]:
    from datasets import Dataset

    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=8,
        max_steps=1,
        learning_rate=0.0,
        beta=0.1,
        loss_type=[loss_type],
        max_length=64,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        bf16=False,
        seed=0,
    )
    trainer = trl.DPOTrainer(
        model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(records), processing_class=tok
    )
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.model.train()
    with torch.no_grad():
        loss = float(trainer.compute_loss(trainer.model, inputs))
    logged = {k: float(v[-1]) for k, v in trainer._metrics["train"].items()}
    return {"loss": loss, **logged}


def jaxloom_step_one(policy_dir, ref_dir, records, loss_type, tmp_path, tok=TOK) -> dict[str, float]:
    args = DPOConfig(
        max_length=64,
        beta=0.1,
        loss_type=loss_type,
        total_batch_size=8,
        max_training_steps=1,
        logging_steps=1,
        learning_rate=1e-3,
        save_directory=str(tmp_path / "jaxloom"),
        progress_bar=False,
        use_tensorboard=False,
    )
    trainer = DPOTrainer(
        args,
        model=jm.from_pretrained(str(policy_dir)),
        ref_model=str(ref_dir),
        dataset_train=records,
        processing_class=tok,
        mesh=mesh(1),
    )
    trainer.train()
    row = json.loads((tmp_path / "jaxloom" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1
    return {k.removeprefix("train/"): v for k, v in row.items()}


CASES = [(loss, form) for loss in ("sigmoid", "ipo", "hinge") for form in ("text", "chat")] + [("sigmoid", "implicit")]
CASES += [("sigmoid", "chat-gemma"), ("sigmoid", "chat-qwen3")]  # the families' chat formats (Gemma's, Qwen3's)


def chat_tokenizer(style: str):
    """jaxloom-data's test tokenizers in a family's chat format (its tests/chat_styles.py: one place)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "data" / "tests" / "chat_styles.py"
    spec = importlib.util.spec_from_file_location("data_chat_styles", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.chat_tokenizer(style)


@pytest.mark.parametrize("loss_type,form", CASES, ids=[f"{loss}-{form}" for loss, form in CASES])
def test_step_one_equals_trl(models, loss_type, form, tmp_path):
    (a_dir, a), (b_dir, b) = models
    tok = chat_tokenizer(form.split("-")[1]) if "-" in form else TOK
    records = pairs(form.split("-")[0])
    theirs = trl_step_one(a, b, records, loss_type, tmp_path, tok)
    ours = jaxloom_step_one(a_dir, b_dir, records, loss_type, tmp_path, tok)
    keys = ["loss", "rewards/margins", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"]
    keys += ["rewards/accuracies", "logits/chosen", "logits/rejected"]
    print({k: (ours[k], theirs[k]) for k in keys})
    for k in keys:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert ours["loss"] > 0 and abs(ours["rewards/margins"]) > 1e-3  # the models differ: a non-trivial case
