"""SFT of a vision-language model (Gemma 3) on TRL's image data: `messages` with the images in `images`, through
transformers' own processor (`AutoProcessor`, read from the model directory or given as `processing_class`). The
first loss equals transformers' on TRL's `DataCollatorForVisionLanguageModeling` batch; a small image-caption set
is learnt (held-out loss falls, and the caption follows the image); bad records are one error naming them before
step 1."""

import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

import jaxloom.models as jm  # noqa: E402
from jaxloom.trainer import Trainer, TrainingArguments  # noqa: E402

from util import models_tests, quiet  # noqa: E402

RGB = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 50, 220)}


@pytest.fixture(scope="module")
def g3_dir(tmp_path_factory):
    g3 = models_tests("test_gemma3_vl")
    path = g3.write_hub_model(tmp_path_factory.mktemp("g3") / "model")
    g3.write_processor_files(path)
    return g3, path


def captions(folder, n, seed):
    """`n` records of TRL's conversational image data: a square of one colour, captioned with its name."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        name = list(RGB)[i % 3]
        pixels = np.clip(np.array(RGB[name]) + rng.normal(0, 20, (40, 40, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
        messages = [{"role": "user", "content": "w7 w8"}, {"role": "assistant", "content": name}]
        out.append({"messages": messages, "images": [str(folder / f"{i}.png")]})
    return out


def arguments(tmp, **kw):
    base = dict(learning_rate=3e-3, warmup_steps=0, total_batch_size=8, max_sequence_length=24, max_training_steps=1,
                packing=False, eval_batches=1)  # fmt: skip
    return TrainingArguments(**{**base, **quiet(tmp), **kw})


def eval_losses(out):
    rows = [json.loads(line) for line in (pathlib.Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["eval/loss"] for r in rows if "eval/loss" in r]


def test_first_loss_equals_transformers_on_trls_collator(g3_dir, tmp_path):
    """Every token a target (TRL's default, `assistant_only_loss=False`): jaxloom's evaluation loss before any step
    equals transformers' loss on the batch TRL's collator makes of the same records with the same processor."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    g3, path = g3_dir
    records = captions(tmp_path / "img", 8, 0)
    settings = arguments(tmp_path / "run", assistant_only_loss=False, eval_steps=1, learning_rate=0.0)  # step 1: none
    Trainer(settings, str(path), dataset_train=records, dataset_eval=records).train()
    ours = eval_losses(tmp_path / "run")[0]
    processor = transformers.AutoProcessor.from_pretrained(path)
    collate = DataCollatorForVisionLanguageModeling(processor)
    from PIL import Image

    batch = collate([{**r, "images": [Image.open(p).convert("RGB") for p in r["images"]]} for r in records])
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = float(hf(**batch).loss)
    assert abs(ours - ref) < 1e-4 * ref, (ours, ref)


def test_sft_on_image_captions_learns_and_the_caption_follows_the_image(g3_dir, tmp_path):
    g3, path = g3_dir
    train, held_out = captions(tmp_path / "train", 24, 1), captions(tmp_path / "held", 8, 2)
    processor = transformers.AutoProcessor.from_pretrained(path)
    trainer = Trainer(arguments(tmp_path / "run", max_training_steps=20, eval_steps=1, learning_rate=1e-2),
                      jm.from_pretrained(path), dataset_train=train, dataset_eval=held_out,
                      processing_class=processor)  # fmt: skip
    trainer.train()
    first, last = eval_losses(tmp_path / "run")[0], eval_losses(tmp_path / "run")[-1]
    assert last < 0.1 * first, (first, last)  # held-out loss after step 1, after step 20
    # the caption follows the image: each held-out square's own colour is the likeliest of the three
    from PIL import Image

    model = trainer.model
    right = 0
    for record in held_out:
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w7 w8"}]}]
        text = processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=[[Image.open(record["images"][0]).convert("RGB")]], return_tensors="np",
                           add_special_tokens=False)  # fmt: skip
        logits = model(jnp.asarray(inputs["input_ids"]), pixel_values=jnp.asarray(inputs["pixel_values"]),
                       token_type_ids=jnp.asarray(inputs["token_type_ids"])).logits[0, -1]  # fmt: skip
        scores = {name: float(logits[g3.COLOURS[name]]) for name in RGB}
        right += max(scores, key=scores.get) == record["messages"][1]["content"]
    assert right == len(held_out)
    # the run directory and the export keep the processor: transformers reads both back, with the same logits
    assert (tmp_path / "run" / "tokenizer" / "processor_config.json").is_file()
    trainer.save_pretrained(tmp_path / "hf", to_torch=True)
    again = transformers.AutoProcessor.from_pretrained(tmp_path / "hf")
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    pt = again(text=[text], images=[[Image.open(held_out[0]["images"][0]).convert("RGB")]], return_tensors="pt",
               add_special_tokens=False)  # fmt: skip
    with torch.no_grad():
        ref = hf(**pt).logits[0, -1].numpy()
    args = {k: jnp.asarray(pt[k].numpy()) for k in ("pixel_values", "token_type_ids")}
    ours = np.asarray(model(jnp.asarray(pt["input_ids"].numpy()), **args).logits[0, -1])
    assert np.abs(ours - ref).max() < 1e-4 * np.abs(ref).max()


def test_bad_image_records_are_one_error_before_step_1(g3_dir, tmp_path):
    g3, path = g3_dir
    good = captions(tmp_path / "img", 3, 0)
    missing = [*good, {**good[0], "images": [str(tmp_path / "gone.png")]}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in missing))
    with pytest.raises(ValueError, match=r"data.jsonl:4.*column 'images' image 0: image file .*gone.png does not"):
        Trainer(arguments(tmp_path / "a"), str(path), dataset_train=str(tmp_path / "data.jsonl")).train()
    two = [{**good[0], "images": good[0]["images"] * 2}]
    (tmp_path / "two.jsonl").write_text(json.dumps(two[0]) + "\n")
    with pytest.raises(ValueError, match=r"two.jsonl:1.*holds 2 images; a row holds at most 1 \(max_images_per_row\)"):
        Trainer(arguments(tmp_path / "b"), str(path), dataset_train=str(tmp_path / "two.jsonl")).train()
    roomy = Trainer(
        arguments(tmp_path / "b2", max_images_per_row=2), str(path), dataset_train=str(tmp_path / "two.jsonl")
    )
    roomy.batches.check_train_data()  # two image slots a row: the record is read
    assert roomy.batches.spec.extra["pixel_values"][0] == (2, 3, 32, 32)
    with pytest.raises(ValueError, match="packing = true: Gemma3ForConditionalGeneration's rows hold images"):
        Trainer(arguments(tmp_path / "c", packing=True), str(path), dataset_train=good).train()
    url = [{**good[0], "images": ["https://example.com/cat.png"]}]
    with pytest.raises(ValueError, match="is a URL; jaxloom reads images from files"):
        Trainer(arguments(tmp_path / "d"), str(path), dataset_train=url).train()


def image_pairs(folder, n=8):
    """TRL's vision preference records: the prompt shows a square, chosen names its colour, rejected another."""
    records = captions(folder, n, 3)
    names = list(RGB)
    return [
        {
            "prompt": [{"role": "user", "content": "w7 w8"}],
            "chosen": [{"role": "assistant", "content": r["messages"][1]["content"]}],
            "rejected": [{"role": "assistant", "content": names[(names.index(r["messages"][1]["content"]) + 1) % 3]}],
            "images": r["images"],
        }
        for r in records
    ]


def test_dpo_step_one_equals_trls_dpo_trainer_on_image_pairs(g3_dir, tmp_path):
    """Policy and reference two different Gemma 3 models, 8 image pairs in one batch: the step-1 loss, rewards and
    log-probabilities equal TRL's `DPOTrainer` (its `DataCollatorForVisionPreference`) with the same processor."""
    from datasets import Dataset
    from PIL import Image

    import trl
    from jaxloom.trainer import DPOConfig, DPOTrainer

    g3, path = g3_dir
    ref_dir = g3.write_hub_model(tmp_path / "ref", seed=1)
    records = image_pairs(tmp_path / "img")
    processor = transformers.AutoProcessor.from_pretrained(path)
    hf = [transformers.Gemma3ForConditionalGeneration.from_pretrained(d, dtype=torch.float32) for d in (path, ref_dir)]
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, max_steps=1,
                         learning_rate=0.0, beta=0.1, max_length=None, report_to=[], use_cpu=True,
                         save_strategy="no", bf16=False, seed=0)  # fmt: skip
    opened = [{**r, "images": [Image.open(p).convert("RGB") for p in r["images"]]} for r in records]
    trainer = trl.DPOTrainer(model=hf[0], ref_model=hf[1], args=args, train_dataset=Dataset.from_list(opened),
                             processing_class=processor)  # fmt: skip
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.model.train()
    with torch.no_grad():
        loss = float(trainer.compute_loss(trainer.model, inputs))
    theirs = {"loss": loss, **{k: float(v[-1]) for k, v in trainer._metrics["train"].items()}}
    ours_args = DPOConfig(max_length=24, beta=0.1, total_batch_size=8, max_training_steps=1, learning_rate=1e-3,
                          **quiet(tmp_path / "ours"))  # fmt: skip
    DPOTrainer(ours_args, model=str(path), ref_model=str(ref_dir), dataset_train=records).train()
    row = json.loads((tmp_path / "ours" / "metrics.jsonl").read_text().splitlines()[0])
    ours = {k.removeprefix("train/"): v for k, v in row.items()}
    keys = ["loss", "rewards/margins", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"]
    for k in keys:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert abs(ours["rewards/margins"]) > 1e-3  # the models differ: a non-trivial case


def test_an_image_run_stopped_and_resumed_ends_bitwise_equal(g3_dir, tmp_path):
    """Four steps in one run, or two then two more resumed from the step-2 checkpoint: the same parameters, bit for
    bit (the data position, images included, is saved with the state; a constant schedule, as the two runs' lengths
    differ)."""
    from util import params_of

    _, path = g3_dir
    train = captions(tmp_path / "img", 24, 4)

    def run(where, steps, **kw):
        settings = arguments(
            where, max_training_steps=steps, save_steps=2, learning_rate=1e-2, scheduler="constant", **kw
        )
        trainer = Trainer(settings, str(path), dataset_train=train)
        trainer.train()
        return params_of(trainer.state)

    whole = run(tmp_path / "whole", 4)
    run(tmp_path / "parts", 2)
    resumed = run(tmp_path / "parts", 4, resume_if_possible=True)
    assert sorted(whole) == sorted(resumed)
    for k in whole:
        np.testing.assert_array_equal(whole[k], resumed[k], err_msg=k)


@pytest.mark.parametrize("exclude", [None, ()], ids=["language-model-only", "with-the-tower"])
def test_lora_on_images_adapts_the_language_model_unless_lora_exclude_modules_says_otherwise(g3_dir, tmp_path, exclude):
    """A LoRA run on image rows: by default (`lora_exclude_modules` None) the adapters go on the language model only,
    as PEFT's `exclude_modules` default for the model says; `lora_exclude_modules=()` adapts the tower too. Only the
    adapters move."""
    from flax import nnx

    _, path = g3_dir
    settings = arguments(tmp_path / "run", use_peft=True, lora_target_modules="all-linear", learning_rate=1e-2,
                         lora_exclude_modules=exclude)  # fmt: skip
    trainer = Trainer(settings, str(path), dataset_train=captions(tmp_path / "img", 8, 5))
    trainer.train()
    adapted = {p[0] for p, v in nnx.iter_graph(trainer.state.model) if isinstance(v, nnx.Param) and p[-1] == "lora_a"}
    # the projector's weight is a bare matrix (as in transformers: no Linear for PEFT to adapt either)
    assert adapted == ({"model"} if exclude is None else {"model", "vision_tower"})


def low_for_red(prompts, completions, colour, **kwargs):
    """An image-dependent reward: for a red square, the share of a completion's words from the lower half of the
    vocabulary (`w5` … `w54`); for a blue one, from the upper half. The prompt's text is the same for both: a
    policy that does not see the image cannot beat 0.5 on average."""
    import re

    out = []
    for completion, name in zip(completions, colour, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        words = [int(n) for n in re.findall(r"w(\d+)", text)]
        low = float(np.mean([n < 55 for n in words])) if words else 0.5
        out.append(low if name == "red" else 1.0 - low)
    return out


def test_grpo_with_image_prompts_learns_an_image_dependent_reward(g3_dir, tmp_path):
    """GRPO on chat prompts that show a square (TRL's `images` column): each prompt's group of completions shares one
    prefill with its image, the train step reads the images too, and the reward — which only the image decides — is
    learnt."""
    from jaxloom.trainer import GRPOConfig, GRPOTrainer

    _, path = g3_dir
    squares = captions(tmp_path / "img", 16, 6)
    records = [
        {"prompt": [{"role": "user", "content": "w7 w8"}], "images": r["images"], "colour": r["messages"][1]["content"]}
        for r in squares
        if r["messages"][1]["content"] != "green"
    ]
    args = GRPOConfig(num_generations=8, total_batch_size=16, max_completion_length=4, learning_rate=5e-3,
                      max_training_steps=40, warmup_steps=0, **quiet(tmp_path / "run"))  # fmt: skip
    trainer = GRPOTrainer(args, model=str(path), dataset_train=records, reward_funcs=[low_for_red])
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["train/reward"] for r in rows if "train/reward" in r]
    assert len(rewards) == 40  # measured (seed 0): steps 1-5 average 0.52, steps 36-40 0.94
    assert np.mean(rewards[-5:]) > 0.8 and np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.2, rewards
    # what was learnt follows the image: the trained policy's greedy words are low for a red square, high for blue
    import jaxloom.data as jd
    import jaxloom.generation as jg

    processor = transformers.AutoProcessor.from_pretrained(path)
    shown = {}
    for record in records:
        shown.setdefault(record["colour"], jd.shown_prompt(record["prompt"], record["images"], processor)[1])
    for colour, inputs in shown.items():
        out = jg.generate(trainer.state.model, np.asarray(inputs["input_ids"]), None,
                          jg.GenerationConfig(max_new_tokens=4, pad_token_id=0),
                          pixel_values=np.asarray(inputs["pixel_values"]))  # fmt: skip
        text = processor.tokenizer.decode(np.asarray(out.completion_ids)[0].tolist(), skip_special_tokens=True)
        assert low_for_red(None, [text], [colour])[0] >= 0.75, (colour, text)
    # what the image rollouts do not take yet is one error naming it, before any rollout; a cut would drop image tokens
    with pytest.raises(
        ValueError, match="image prompts are rolled out by the static sampler.*generation_backend='paged'"
    ):
        paged = GRPOConfig(num_generations=4, total_batch_size=8, generation_backend="paged", **quiet(tmp_path / "p"))
        GRPOTrainer(paged, model=str(path), dataset_train=records, reward_funcs=[low_for_red]).train()
    with pytest.raises(ValueError, match=r"dataset_train record \d+: its prompt shows images in \d+ tokens, more than"):
        short = GRPOConfig(
            num_generations=4, total_batch_size=8, max_prompt_length=4, max_completion_length=4, **quiet(tmp_path / "s")
        )
        GRPOTrainer(short, model=str(path), dataset_train=records, reward_funcs=[low_for_red]).train()
