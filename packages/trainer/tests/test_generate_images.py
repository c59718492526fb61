"""`jaxloom generate DIR --image PATH`: a Qwen2.5-VL directory with its tokenizer, chat template and image processor
prints what transformers' `generate` decodes for the same prompt and image (with `--chat` and without); images for
a model that reads none, a missing file, a URL and a directory without an image processor are one line each."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxloom.data as jd  # noqa: E402
from jaxloom.trainer.cli import main  # noqa: E402
from util import models_tests  # noqa: E402


def _vl():
    """jaxloom-models' Qwen2.5-VL test module's names (its shrunk Hub config, tokenizer, prompts: one place)."""
    return models_tests("test_qwen2_5_vl")


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    vl = _vl()
    path = vl.write_hub_model(tmp_path_factory.mktemp("vl") / "model")
    tokenizer = vl.write_processor_files(path)
    from PIL import Image

    image = path.parent / "square.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 40, 3), dtype=np.uint8)).save(image)
    return vl, path, tokenizer, image


def _reference(vl, path, tokenizer, image, prompt, chat, n):
    """transformers' greedy completion of the prompt ids jaxloom builds (its processor's rule: one placeholder per
    image, expanded to the image's merged patches), on transformers' own pixels."""
    processor = transformers.AutoImageProcessor.from_pretrained(str(path))
    from PIL import Image

    inputs = processor(images=[Image.open(image).convert("RGB")], return_tensors="np")
    grid = np.asarray(inputs["image_grid_thw"])
    ids = jd.image_prompt(tokenizer, prompt, 1, chat=chat, tokens=(vl.START, vl.IMAGE, vl.END))
    ids = np.asarray([jd.expand_image_tokens(ids, grid, vl.IMAGE, 2)])
    assert (ids == vl.IMAGE).sum() == grid.prod() // 4 and (ids == vl.START).sum() == 1
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.ones_like(torch.tensor(ids)),
            pixel_values=torch.tensor(inputs["pixel_values"]),
            image_grid_thw=torch.tensor(grid),
            mm_token_type_ids=torch.tensor((ids == vl.IMAGE).astype(np.int64)),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=vl.HUB_CONFIG["eos_token_id"],
            pad_token_id=0,
        )
    completion = out[0, ids.shape[1] :].tolist()
    return tokenizer.decode(completion, skip_special_tokens=True)


@pytest.mark.parametrize("chat", [False, True])
def test_generate_with_an_image_prints_what_transformers_decodes(vl_dir, chat, capsys):
    vl, path, tokenizer, image = vl_dir
    args = ["generate", str(path), "--image", str(image), "--prompt", "w5 w6 w7", "--greedy", "--max-new-tokens", "8"]
    assert main(args + (["--chat"] if chat else [])) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == ">>> w5 w6 w7"
    reference = _reference(vl, path, tokenizer, image, "w5 w6 w7", chat, 8)
    assert printed[1] == reference and len(reference.split()) >= 3  # a completion of several words, not an empty end


def test_bad_images_are_one_line_each(vl_dir, tmp_path, capsys):
    vl, path, _, image = vl_dir
    base = ["generate", str(path), "--prompt", "w5", "--max-new-tokens", "2"]
    assert main([*base, "--image", str(tmp_path / "missing.png")]) == 2
    err = capsys.readouterr().err
    assert f"--image image 0: image file {tmp_path / 'missing.png'} does not exist" in err
    assert main([*base, "--image", "https://example.com/cat.png"]) == 2
    assert "is a URL; jaxloom reads images from files" in capsys.readouterr().err
    (tmp_path / "not.png").write_text("text")
    assert main([*base, "--image", str(tmp_path / "not.png")]) == 2
    assert "is not an image PIL reads" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (bare / name).write_bytes((path / name).read_bytes())
    assert main(["generate", str(bare), "--prompt", "w5", "--image", str(image)]) == 2
    assert "no preprocessor_config.json" in capsys.readouterr().err
    import jaxloom.models as jm

    text = tmp_path / "text"
    config = jm.LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2)  # fmt: skip
    jm.save_hf_model(jm.create_model(config, seed=0), text)
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (text / name).write_bytes((path / name).read_bytes())
    assert main(["generate", str(text), "--prompt", "w5", "--image", str(image)]) == 2
    assert "--image: LlamaForCausalLM reads no images" in capsys.readouterr().err


def test_expand_image_tokens_counts_each_images_merged_patches():
    ids = [1, 90, 2, 90, 3]
    out = jd.expand_image_tokens(ids, [[1, 4, 4], [1, 2, 6]], 90, 2)
    assert out == [1, *[90] * 4, 2, *[90] * 3, 3]
    with pytest.raises(ValueError, match=r"the prompt has 2 image placeholder\(s\) \(token 90\) for 1 image\(s\)"):
        jd.expand_image_tokens(ids, [[1, 4, 4]], 90, 2)


@pytest.mark.parametrize("chat", [False, True])
def test_gemma3_generate_with_an_image_through_its_processor(tmp_path, chat, capsys):
    """Gemma 3: the directory's own processor (AutoProcessor) makes the prompt's ids and pixels; what is printed is
    what transformers' `generate` decodes for the processor's outputs."""
    g3 = models_tests("test_gemma3_vl")
    path = g3.write_hub_model(tmp_path / "model")
    processor = g3.write_processor_files(path)
    from PIL import Image

    image = tmp_path / "square.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 40, 3), dtype=np.uint8)).save(image)
    args = ["generate", str(path), "--image", str(image), "--prompt", "w5 w6 w7", "--greedy", "--max-new-tokens", "6"]
    assert main(args + (["--chat"] if chat else [])) == 0
    printed = capsys.readouterr().out.splitlines()
    if chat:
        content = [{"type": "image"}, {"type": "text", "text": "w5 w6 w7"}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    else:
        text = "<bos><start_of_image>w5 w6 w7"
    inputs = processor(text=[text], images=[[Image.open(image).convert("RGB")]], return_tensors="pt",
                       add_special_tokens=False)  # fmt: skip
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=106)
    reference = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :].tolist(), skip_special_tokens=True)
    assert printed[0] == ">>> w5 w6 w7" and printed[1] == reference and reference
