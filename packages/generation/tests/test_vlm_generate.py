"""Generation with images (Qwen2.5-VL): greedy tokens equal transformers' `generate` on prompts with one image, two
images and none in one left-padded batch — the image features join the one prefill, each decoded token turns at its
M-RoPE position; a model that reads no images refuses pixels by name."""

import pathlib
import runpy
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxloom.generation as jg  # noqa: E402
import jaxloom.models as jm  # noqa: E402


def _vl():
    """jaxloom-models' Qwen2.5-VL test module's names (its shrunk Hub config, tokenizer, prompts: one place)."""
    return types.SimpleNamespace(
        **runpy.run_path(str(pathlib.Path(__file__).parents[2] / "models/tests/test_qwen2_5_vl.py"))
    )


def test_greedy_with_images_equals_transformers_generate(tmp_path):
    vl = _vl()
    path = vl.write_hub_model(tmp_path / "m")
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model = jm.from_pretrained(path)
    tokens = model.config.vision_config.tokens_of(vl.GRIDS)
    ids, mask = vl.left_padded([vl.image_row(tokens[:1]), vl.image_row(tokens[1:]), [5, 9, 11, 13, 7, 8, 3]])
    pix = vl.pixels(vl.GRIDS)
    n = 12
    with torch.no_grad():
        ref = hf.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            pixel_values=torch.tensor(pix),
            image_grid_thw=torch.tensor(vl.GRIDS),
            mm_token_type_ids=torch.tensor((ids == vl.IMAGE).astype(np.int64)),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        ).numpy()[:, ids.shape[1] :]
    config = jg.GenerationConfig(max_new_tokens=n, pad_token_id=0)
    out = jg.generate(model, ids, mask, config, pixel_values=pix, image_grid_thw=vl.GRIDS)
    assert np.array_equal(np.asarray(out.completion_ids), ref), (np.asarray(out.completion_ids), ref)
    # the images act: other pixels, other tokens (the batch's greedy paths part within 12 tokens)
    other = jg.generate(model, ids, mask, config, pixel_values=vl.pixels(vl.GRIDS, 1), image_grid_thw=vl.GRIDS)
    assert not np.array_equal(np.asarray(other.completion_ids)[:2], ref[:2])
    # two completions of each prompt share its prefill, and equal the one completion (greedy)
    twice = jg.generate(model, ids, mask, config, pixel_values=pix, image_grid_thw=vl.GRIDS, num_return_sequences=2)
    assert np.array_equal(np.asarray(twice.completion_ids)[::2], ref)


def test_pixels_for_a_model_that_reads_no_images_are_refused():
    model = jm.create_model(jm.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2), seed=0)  # fmt: skip
    with pytest.raises(ValueError, match="LlamaForCausalLM reads no images"):
        jg.generate(model, np.ones((1, 4), np.int32), None, jg.GenerationConfig(max_new_tokens=2),
                    pixel_values=np.zeros((4, 96), np.float32), image_grid_thw=[[1, 2, 2]])  # fmt: skip


def test_gemma3_greedy_with_images_equals_transformers_generate(tmp_path):
    """Gemma 3: the prompt's image tokens see each other both ways in the one prefill (transformers passes
    `token_type_ids` there and not after), each decoded token causally; greedy tokens equal transformers'."""
    g3 = types.SimpleNamespace(
        **runpy.run_path(str(pathlib.Path(__file__).parents[2] / "models/tests/test_gemma3_vl.py"))
    )
    path = g3.write_hub_model(tmp_path / "m")
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model = jm.from_pretrained(path)
    ids, mask, types_, pix = g3.batch()
    n = 12
    with torch.no_grad():
        ref = hf.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            pixel_values=torch.tensor(pix),
            token_type_ids=torch.tensor(types_),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        ).numpy()[:, ids.shape[1] :]
    config = jg.GenerationConfig(max_new_tokens=n, pad_token_id=0)
    out = jg.generate(model, ids, mask, config, pixel_values=pix)
    assert np.array_equal(np.asarray(out.completion_ids), ref), (np.asarray(out.completion_ids), ref)
    other = jg.generate(model, ids, mask, config, pixel_values=g3.pixels(seed=1))
    assert not np.array_equal(np.asarray(other.completion_ids)[:2], ref[:2])
