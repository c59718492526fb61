"""Qwen2.5-VL against transformers' `Qwen2_5_VLForConditionalGeneration`: logits with one image, two images and
none in one left-padded batch; the vision tower alone; the export and the Hub's config and name layouts; pixels from
transformers' own image processor; the model under jit; bad inputs refused by name."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import jaxloom.models as jm  # noqa: E402

IMAGE, START, END = 90, 91, 92
# A published config (Qwen/Qwen2.5-VL-3B-Instruct's config.json, the Hub's flat layout) shrunk in size: every key it
# has, the text fields at the top, `rope_scaling: mrope`, the tower's `in_chans` / `spatial_patch_size`.
HUB_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 93,
    "eos_token_id": 94,
    "vision_start_token_id": START,
    "vision_end_token_id": END,
    "vision_token_id": 95,
    "image_token_id": IMAGE,
    "video_token_id": 96,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "max_position_embeddings": 256,
    "max_window_layers": 70,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 3,
        "hidden_act": "silu",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "in_chans": 3,
        "out_hidden_size": 64,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "spatial_patch_size": 4,
        "window_size": 16,
        "fullatt_block_indexes": [1],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "vocab_size": 128,
}
GRIDS = np.array([[1, 8, 8], [1, 4, 12], [1, 12, 4]])  # patches: rows 8 (4 windows of 2×2 merged), 4×12, 12×4


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory):
    return write_hub_model(tmp_path_factory.mktemp("qwen2_5_vl"))


def write_hub_model(path):
    """A Hub-layout directory (flat config, `model.*` / `visual.*` names) whose weights are drawn wide enough that
    every part moves the logits (the initialiser's 0.02 would leave the tower's share in the noise). Generation's
    tests build theirs with it."""
    config = transformers.Qwen2_5_VLConfig(**{k: v for k, v in HUB_CONFIG.items() if k != "architectures"})
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name or "ln_q" in name
            p.copy_(torch.randn_like(p) * (0.3 if norm else 0.15) + (1.0 if norm else 0.0))
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(HUB_CONFIG))  # as the Hub has it
    return path


# The special tokens of Qwen2.5-VL at the ids HUB_CONFIG gives them, and a Qwen2-VL-style chat template
SPECIAL = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>", "<|im_end|>", "<|vision_pad|>",
           "<|video_pad|>", "<|im_start|>"]  # fmt: skip
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_processor_files(path):
    """A word-level tokenizer (`w4` … `w89`, then the special tokens at HUB_CONFIG's ids) with the chat template, and
    transformers' image processor for this tower (patches of 4, merged 2 × 2), written into model directory `path`:
    what `jaxloom generate --image` and the trainer read. Returns the tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "user": 1, "assistant": 2, "system": 3, **{f"w{i}": i for i in range(4, 90)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})  # in order: ids 90 … 97
    tokenizer.pad_token, tokenizer.eos_token = "<|endoftext|>", "<|im_end|>"
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL] == list(range(90, 98))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    transformers.Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=32 * 48
    ).save_pretrained(str(path))
    return tokenizer


@pytest.fixture(scope="module")
def hf(hub_dir):
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(hub_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(hub_dir):
    return jm.from_pretrained(hub_dir)


def image_row(tokens):
    ids = [5, 6]
    for n in tokens:
        ids += [START] + [IMAGE] * int(n) + [END, 7, 8]
    return ids


def left_padded(rows):
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    return ids, mask


def pixels(grids, seed=0):
    patches = int(grids.prod(-1).sum())
    return np.random.default_rng(seed).normal(size=(patches, 3 * 2 * 4 * 4)).astype(np.float32)


def hf_logits(hf, ids, mask, pix=None, grids=None):
    args = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    if pix is not None:
        args.update(
            pixel_values=torch.tensor(pix),
            image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)),
        )
    with torch.no_grad():
        return hf(**args).logits.numpy()


def batch(model):
    tokens = model.config.vision_config.tokens_of(GRIDS)
    # row 0: one image; row 1: two; row 2: text alone (left padded: the positions skip the padding)
    ids, mask = left_padded([image_row(tokens[:1]), image_row(tokens[1:]), [5, 9, 11, 13, 7, 8, 3]])
    return ids, mask, pixels(GRIDS)


def close(ours, ref, mask):
    real = mask.astype(bool)
    return float(np.abs(np.asarray(ours)[real] - ref[real]).max() / np.abs(ref[real]).max())


def test_logits_with_one_two_and_no_images_equal_transformers(model, hf):
    ids, mask, pix = batch(model)
    ref = hf_logits(hf, ids, mask, pix, GRIDS)
    out = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), pixel_values=jnp.asarray(pix), image_grid_thw=GRIDS)
    assert close(out.logits, ref, mask) < 1e-5
    # each part acts: the tower's features (other pixels), M-RoPE (the tokens' own positions instead), the windows
    other = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), pixel_values=jnp.asarray(pixels(GRIDS, 1)),
                  image_grid_thw=GRIDS).logits  # fmt: skip
    assert close(other, ref, mask) > 1e-2
    flat = np.broadcast_to(np.maximum(np.cumsum(mask, -1) - 1, 0), (3, *ids.shape))
    plain = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), pixel_values=jnp.asarray(pix),
                  image_grid_thw=GRIDS, rope_positions=flat).logits  # fmt: skip
    assert close(plain, ref, mask) > 1e-3
    # the text-only row is Qwen2's: the same as transformers with no image in the batch
    text = ids[2:, -7:], mask[2:, -7:]
    assert close(model(jnp.asarray(text[0])).logits, hf_logits(hf, *text), text[1]) < 1e-5


def test_the_tower_alone_equals_transformers_and_its_windows_act(model, hf):
    pix = pixels(GRIDS)
    with torch.no_grad():
        ref = hf.model.visual(torch.tensor(pix), grid_thw=torch.tensor(GRIDS)).pooler_output.numpy()
    layout = jm.vision_layout(GRIDS, model.config.vision_config)
    ours = np.asarray(model.visual(jnp.asarray(pix), layout))
    assert ours.shape == (int(model.config.vision_config.tokens_of(GRIDS).sum()), 64)
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-5
    whole = layout._replace(window_segments=layout.image_segments)  # every block over the whole image
    assert np.abs(np.asarray(model.visual(jnp.asarray(pix), whole)) - ref).max() / np.abs(ref).max() > 1e-3
    # transformers' own window order and windows, taken apart: the order is a permutation within each image
    assert sorted(layout.window_index.tolist()) == list(range(len(layout.window_index)))
    assert np.bincount(layout.window_segments)[1:].tolist() == [16] * 4 + [16, 16, 16] + [16, 16, 16]


def test_rope_index_equals_transformers(model, hf):
    ids, mask, _ = batch(model)
    ours, deltas = jm.rope_index(ids, GRIDS, mask, model.config)
    ref, ref_deltas = hf.model.get_rope_index(
        torch.tensor(ids), torch.tensor((ids == IMAGE).astype(np.int64)), torch.tensor(GRIDS),
        attention_mask=torch.tensor(mask),
    )  # fmt: skip
    real = np.broadcast_to(mask.astype(bool), ours.shape)
    assert np.array_equal(ours[real], ref.numpy()[real])
    assert np.array_equal(deltas, ref_deltas.numpy().reshape(-1))


def test_export_loads_in_transformers_with_the_same_logits(model, hf, hub_dir, tmp_path):
    jm.save_hf_model(model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert written["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    again = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert again.config.vision_config.fullatt_block_indexes == [1] and again.config.tie_word_embeddings
    ids, mask, pix = batch(model)
    ref = hf_logits(hf, ids, mask, pix, GRIDS)
    assert close(hf_logits(again, ids, mask, pix, GRIDS), ref, mask) < 1e-6
    a, b = jm.to_hf_state_dict(model), jm.to_hf_state_dict(jm.from_pretrained(tmp_path / "out"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(load_file(hub_dir / "model.safetensors"))


def test_transformers_in_memory_names_and_nested_config_are_read(model, hub_dir, tmp_path):
    tensors = load_file(hub_dir / "model.safetensors")

    def in_memory(name):  # transformers 5's module names
        return "model.language_model." + name[6:] if name.startswith("model.") else "model." + name

    renamed = {in_memory(k) if not k.startswith("lm_head") else k: v for k, v in tensors.items()}
    (tmp_path / "m").mkdir()
    save_file(renamed, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    nested = transformers.Qwen2_5_VLConfig.from_pretrained(hub_dir)
    nested.save_pretrained(tmp_path / "m")
    assert "text_config" in json.loads((tmp_path / "m" / "config.json").read_text())
    again = jm.from_pretrained(tmp_path / "m")
    assert again.config.replace(layer_types=None) == model.config  # transformers 5 writes the layer types out
    a, b = jm.to_hf_state_dict(model), jm.to_hf_state_dict(again)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    both = {**tensors, **renamed}
    save_file(both, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="twice"):
        jm.from_pretrained(tmp_path / "m")


def test_pixels_from_transformers_image_processor(model, hf):
    from PIL import Image

    processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=32 * 48
    )
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((30, 45), (20, 20))]
    inputs = processor(images=images, return_tensors="np")
    grids = np.asarray(inputs["image_grid_thw"])
    ids, mask = left_padded([image_row(model.config.vision_config.tokens_of(grids))])
    pix = np.asarray(inputs["pixel_values"], np.float32)
    ref = hf_logits(hf, ids, mask, pix, grids)
    out = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), pixel_values=jnp.asarray(pix),
                image_grid_thw=grids)  # fmt: skip
    assert close(out.logits, ref, mask) < 1e-5


def test_the_fused_loss_and_the_decoders_see_it_can_stop_before_its_output_layer(model):
    """The trainer's fused output-layer loss and the decoders' last-position logits read `return_hidden` in the
    model's signature: named there, the text rows of a Qwen2.5-VL train without the `[B, T, V]` logits."""
    import inspect

    assert "return_hidden" in inspect.signature(type(model).__call__).parameters
    ids, mask, pix = batch(model)
    args = dict(attention_mask=jnp.asarray(mask), pixel_values=jnp.asarray(pix), image_grid_thw=GRIDS)
    out = model(jnp.asarray(ids), return_hidden=True, **args)
    kernel, dtype, _ = model.output_projection()
    assert out.logits is None
    np.testing.assert_allclose(np.asarray(out.hidden @ kernel), np.asarray(model(jnp.asarray(ids), **args).logits),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_under_jit_with_the_layout_made_on_the_host(model):
    from flax import nnx

    ids, mask, pix = batch(model)
    layout = jm.vision_layout(GRIDS, model.config.vision_config)
    rope, _ = jm.rope_index(ids, GRIDS, mask, model.config)
    eager = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), pixel_values=jnp.asarray(pix),
                  image_grid_thw=GRIDS).logits  # fmt: skip

    @nnx.jit
    def run(m, ids, mask, pix, layout, rope):
        return m(ids, attention_mask=mask, pixel_values=pix, image_grid_thw=GRIDS, vision_layout=layout,
                 rope_positions=rope).logits  # fmt: skip

    jitted = run(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(pix), layout, jnp.asarray(rope))
    assert np.abs(np.asarray(jitted) - np.asarray(eager)).max() < 1e-5

    @nnx.jit
    def no_layout(m, ids, grid, pix):
        return m(ids, pixel_values=pix, image_grid_thw=grid).logits

    with pytest.raises(ValueError, match="traced .*vision_layout="):
        no_layout(model, jnp.asarray(ids), jnp.asarray(GRIDS), jnp.asarray(pix))


def test_bad_inputs_are_one_error_naming_what_disagrees(model):
    ids, mask, pix = batch(model)
    with pytest.raises(ValueError, match=r"pixel_values has \d+ patches, image_grid_thw"):
        model(jnp.asarray(ids), pixel_values=jnp.asarray(pix[:-4]), image_grid_thw=GRIDS)
    short = ids.copy()
    short[1, np.flatnonzero(short[1] == IMAGE)[0]] = 7  # one image token fewer than the images give
    words = (
        r"row 1 of input_ids: image 1 \(image_grid_thw \[1, 4, 12\]\) needs 12 image tokens, the row has a run of 11"
    )
    with pytest.raises(ValueError, match=words):
        model(jnp.asarray(short), attention_mask=jnp.asarray(mask), pixel_values=jnp.asarray(pix), image_grid_thw=GRIDS)
    with pytest.raises(ValueError, match=r"row 1 of input_ids has image tokens .* past the 2 image\(s\)"):
        jm.rope_index(ids, GRIDS[:2], mask, model.config)  # more image tokens than images
    with pytest.raises(ValueError, match=r"image_grid_thw has 3 image\(s\), input_ids' image tokens .* place 0"):
        jm.rope_index(ids[2:], GRIDS, mask[2:], model.config)  # more images than image tokens
    with pytest.raises(ValueError, match="multiples of spatial_merge_size 2"):
        jm.vision_layout([[1, 3, 4]], model.config.vision_config)
    with pytest.raises(ValueError, match="without image_grid_thw"):
        model(jnp.asarray(ids), pixel_values=jnp.asarray(pix))
    with pytest.raises(ValueError, match="videos are not read yet"):
        model(jnp.asarray(ids), pixel_values_videos=jnp.asarray(pix), video_grid_thw=GRIDS)
    bad = dict(HUB_CONFIG, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 4]})
    with pytest.raises(ValueError, match="mrope_section"):
        jm.config_from_hf_dict(bad)
    with pytest.raises(ValueError, match="in_chans = 1 and in_channels = 3 disagree"):
        jm.config_from_hf_dict(dict(HUB_CONFIG, vision_config={**HUB_CONFIG["vision_config"], "in_channels": 3,
                                                              "in_chans": 1}))  # fmt: skip
    assert jax.tree.leaves(model.config.vision_config.fullatt_block_indexes) == [1]


def test_sharded_over_fsdp_and_tp_equals_one_device(model, hub_dir):
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from jaxloom.mesh import MeshConfig, gather

    mesh = MeshConfig.from_axes(fsdp=4, tp=2).build()
    sharded = jm.from_pretrained(hub_dir, mesh=mesh)
    qkv = sharded.visual.blocks[0].attn.qkv.kernel[...]
    assert qkv.sharding.spec == P("fsdp", "tp")  # the tower's weights are sharded by the same rules as the decoder's
    ids, mask, pix = batch(model)
    layout = jm.vision_layout(GRIDS, model.config.vision_config)
    rope, _ = jm.rope_index(ids, GRIDS, mask, model.config)
    graphdef, state = nnx.split(sharded)

    @jax.jit
    def forward(state, ids, mask, pix, layout, rope):
        return nnx.merge(graphdef, state)(
            ids, attention_mask=mask, pixel_values=pix, image_grid_thw=GRIDS, vision_layout=layout, rope_positions=rope
        ).logits

    with jax.set_mesh(mesh):
        logits = forward(state, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(pix), layout, jnp.asarray(rope))
    ref = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), pixel_values=jnp.asarray(pix), image_grid_thw=GRIDS)
    np.testing.assert_allclose(gather(logits), np.asarray(ref.logits), rtol=2e-5, atol=2e-5)


def test_exclude_modules_match_the_names_peft_matches(hub_dir):
    """PEFT matches `exclude_modules` against the modules' names in transformers' model (`model.visual.*`,
    `model.language_model.*`), not the checkpoint's: an expression in the checkpoint's form excludes nothing there,
    so it excludes nothing here either."""

    def adapted(exclude):
        lora = jm.apply_lora(
            jm.from_pretrained(hub_dir), jm.LoRAConfig(target_modules="all-linear", exclude_modules=exclude)
        )
        return {p for p, v in nnx_paths(lora) if p[-1] == "lora_a"}

    tower = {p for p in adapted(()) if p[0] == "visual"}
    assert tower and not {p for p in adapted(r"model\.visual\..*") if p[0] == "visual"}
    assert {p for p in adapted(r"visual\..*") if p[0] == "visual"} == tower  # PEFT's names start with model.
    assert not {p for p in adapted(r"model\.language_model\..*") if p[0] == "model"}


def nnx_paths(module):
    from flax import nnx

    return ((path, v) for path, v in nnx.iter_graph(module) if isinstance(v, nnx.Param))


@pytest.mark.parametrize("exclude", [None, ()], ids=["language-model-only", "with-the-tower"])
def test_lora_adapters_load_in_peft_with_the_same_logits(model, hub_dir, tmp_path, exclude):
    """LoRA's default on a vision-language model leaves the tower out (PEFT's `exclude_modules`, written so PEFT
    builds the same); `exclude_modules=()` adapts the tower too (`mlp.0`: the merger's numbered layers by their
    parent). PEFT over transformers' model gives the same logits with images; jaxloom reads the adapter back."""
    peft = pytest.importorskip("peft")
    from flax import nnx

    lora = jm.from_pretrained(hub_dir)
    jm.apply_lora(lora, jm.LoRAConfig(r=4, alpha=8, target_modules="all-linear", exclude_modules=exclude))
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 1000))
    for path, var in nnx.iter_graph(lora):
        if isinstance(var, nnx.Param) and path[-1] in ("lora_a", "lora_b"):  # B is zero at init: make both act
            var.set_value(0.2 * jax.random.normal(next(keys), var.get_value().shape))
    jm.save_peft_adapter(lora, tmp_path / "adapter")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    names = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    tower = {n for n in names if ".visual." in n}
    assert all(n.startswith("base_model.model.model.language_model.") for n in names - tower)  # PEFT's module names
    if exclude is None:
        assert written["exclude_modules"] == ".*visual.*" and not tower
    else:
        assert written["exclude_modules"] is None and "mlp.0" in written["target_modules"] and tower
    ids, mask, pix = batch(model)
    ours = lora(jnp.asarray(ids), attention_mask=jnp.asarray(mask), pixel_values=jnp.asarray(pix), image_grid_thw=GRIDS)
    base = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(hub_dir, dtype=torch.float32)
    ref = hf_logits(peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval(), ids, mask, pix, GRIDS)
    assert close(ours.logits, ref, mask) < 1e-5
    plain = hf_logits(transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(hub_dir, dtype=torch.float32),
                      ids, mask, pix, GRIDS)  # fmt: skip
    assert close(ours.logits, plain, mask) > 1e-2  # the adapters act
    again = jm.from_pretrained(hub_dir)
    jm.apply_lora(again, jm.read_peft_config(tmp_path / "adapter"))
    jm.load_peft_weights(again, tmp_path / "adapter")
    back = again(
        jnp.asarray(ids), attention_mask=jnp.asarray(mask), pixel_values=jnp.asarray(pix), image_grid_thw=GRIDS
    )
    assert np.array_equal(np.asarray(back.logits), np.asarray(ours.logits))
