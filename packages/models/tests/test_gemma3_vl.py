"""Gemma 3 with images against transformers' `Gemma3ForConditionalGeneration`: logits with one image, two images and
none in one left-padded batch (each image's tokens seeing each other both ways, a sliding window shorter than an
image), the tower and projector alone, the export and the Hub's config and name layouts, LoRA through PEFT, the model
under jit and on the blockwise backend, bad inputs refused by name."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import jaxloom.models as jm  # noqa: E402

BOI, EOI, IMAGE = 118, 119, 120
# google/gemma-3-4b-it's config.json (the Hub's: `text_config` only where it differs from Gemma 3's defaults, linear
# RoPE scaling on the global layers) shrunk in size; the window (3) shorter than an image's 4 tokens.
HUB_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": BOI,
    "eoi_token_index": EOI,
    "eos_token_id": [1, 106],
    "image_token_index": IMAGE,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 4,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 3,
        "sliding_window_pattern": 3,
        "vocab_size": 128,
        "max_position_embeddings": 256,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 32,
        "image_size": 32,
        "intermediate_size": 48,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "patch_size": 4,
        "vision_use_head": False,
    },
}


def hub_name(name):
    """transformers 5's file name of a tensor → the Hub's (google/gemma-3-4b-it: the tower under `vision_model.`)."""
    return "vision_tower.vision_model." + name[len("vision_tower.") :] if name.startswith("vision_tower.") else name


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory):
    return write_hub_model(tmp_path_factory.mktemp("gemma3"))


def write_hub_model(path, seed=0):
    """A Hub-layout directory (sparse `text_config`, `language_model.model.*` / `vision_tower.vision_model.*` names)
    whose weights are drawn (from `seed`) wide enough that every part moves the logits. Generation's and the
    trainer's tests build theirs with it."""
    config = transformers.Gemma3Config(**{k: v for k, v in HUB_CONFIG.items() if k != "architectures"})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            siglip_norm = "vision_tower" in name and "norm" in name
            norm = "norm" in name
            p.copy_(torch.randn_like(p) * (0.3 if norm else 0.15) + (1.0 if siglip_norm and "weight" in name else 0.0))
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    save_file({hub_name(k): v for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(HUB_CONFIG))  # as the Hub has it
    return path


@pytest.fixture(scope="module")
def hf(hub_dir):
    return transformers.Gemma3ForConditionalGeneration.from_pretrained(hub_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(hub_dir):
    return jm.from_pretrained(hub_dir)


def image_row(images):
    ids = [2, 5, 6]
    for _ in range(images):
        ids += [BOI] + [IMAGE] * 4 + [EOI, 7, 8]
    return ids


def left_padded(rows):
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    return ids, mask


def pixels(n=3, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 3, 32, 32)).astype(np.float32)


def batch():
    """Row 0: one image; row 1: two; row 2: text alone (left padded)."""
    ids, mask = left_padded([image_row(1), image_row(2), [2, 9, 11, 13, 7, 8, 3]])
    return ids, mask, (ids == IMAGE).astype(np.int64), pixels()


def hf_logits(hf, ids, mask, pix=None, types=None):
    args = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    if pix is not None:
        args.update(pixel_values=torch.tensor(pix))
    if types is not None:
        args.update(token_type_ids=torch.tensor(types))
    with torch.no_grad():
        return hf(**args).logits.numpy()


def ours(model, ids, mask, pix=None, types=None, **kw):
    extra = {} if pix is None else {"pixel_values": jnp.asarray(pix)}
    if types is not None:
        extra["token_type_ids"] = jnp.asarray(types)
    return model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), **extra, **kw).logits


def close(a, ref, mask):
    real = mask.astype(bool)
    return float(np.abs(np.asarray(a)[real] - ref[real]).max() / np.abs(ref[real]).max())


def test_logits_with_one_two_and_no_images_equal_transformers(model, hf):
    ids, mask, types, pix = batch()
    ref = hf_logits(hf, ids, mask, pix, types)
    assert close(ours(model, ids, mask, pix, types), ref, mask) < 1e-5
    # without token_type_ids both attend causally, as transformers' do
    assert close(ours(model, ids, mask, pix), hf_logits(hf, ids, mask, pix), mask) < 1e-5
    # each part acts: the images' features, the image tokens seeing each other both ways
    assert close(ours(model, ids, mask, pixels(seed=1), types), ref, mask) > 1e-2
    assert close(ours(model, ids, mask, pix), ref, mask) > 1e-3
    text = ids[2:, -7:], mask[2:, -7:]  # the text-only row is Gemma 3's
    assert close(model(jnp.asarray(text[0])).logits, hf_logits(hf, *text), text[1]) < 1e-5


def test_the_tower_and_projector_alone_equal_transformers(model, hf):
    pix = pixels()
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.tensor(pix)).pooler_output.numpy()
    got = np.asarray(model.image_features(jnp.asarray(pix)))
    assert got.shape == (3, 4, 64)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5


def test_the_window_is_counted_from_each_token_and_images_see_both_ways():
    """The mask transformers builds (sliding: window AND (causal OR same image)), from `q_horizon` on the reference
    backend: an image's last token does not see its first when the window (3) is shorter than the image (4)."""
    from jaxloom.models.attention.backends import make_attention_mask
    from jaxloom.models.gemma import image_horizon

    ids, mask = left_padded([image_row(1)])
    types = jnp.asarray(ids == IMAGE, jnp.int32)
    pos = jnp.asarray(np.maximum(np.cumsum(mask, -1) - 1, 0))
    horizon = image_horizon(types, pos)
    at = np.flatnonzero(ids[0] == IMAGE)
    assert np.asarray(horizon)[0, at].tolist() == [int(pos[0, at[-1]])] * 4
    from jaxloom.models.attention.backends import _block_mask

    seg = jnp.asarray(mask, jnp.int32)
    sliding = np.asarray(_block_mask(seg, pos, seg, pos, True, 3, horizon))[0]
    assert sliding[at[0], at[3]] and not sliding[at[3], at[0]] and sliding[at[3], at[1]]
    full = np.asarray(_block_mask(seg, pos, seg, pos, True, None, horizon))[0]
    assert full[at[3], at[0]] and full[at[0], at[3]] and not full[at[0], at[-1] + 1]
    causal = np.asarray(_block_mask(seg, pos, seg, pos, True, None))  # without a horizon: the causal mask
    assert np.array_equal(np.asarray(make_attention_mask(seg, pos, pos)), causal) and not causal[0, at[0], at[3]]


def test_blockwise_backend_and_its_gradient_equal_the_reference(hub_dir):
    """`chunked` (the long-sequence backend, with its own backward) takes the image horizon: logits and gradients
    equal `xla`'s; the fused kernels refuse it by name."""
    from flax import nnx

    from jaxloom.models.attention.backends import AttentionUnavailableError, choose_implementation

    ids, mask, types, pix = batch()

    def loss_and_grad(mechanism):
        m = jm.from_pretrained(hub_dir, jm.RuntimeConfig(attn_mechanism=mechanism, attn_block_size=4))

        def loss(m):
            return jnp.mean(jnp.square(ours(m, ids, mask, pix, types)) * mask[..., None])  # padding's is no output

        value, grads = nnx.value_and_grad(loss)(m)
        return value, jax.tree.leaves(nnx.state(grads, nnx.Param))

    (a, ga), (b, gb) = loss_and_grad("xla"), loss_and_grad("chunked")
    assert abs(float(a) - float(b)) < 1e-5 * abs(float(a))
    scale = max(float(jnp.abs(x).max()) for x in ga)  # k_proj's bias has no gradient (softmax ignores a shift): 0 ± ε
    assert max(float(jnp.abs(x - y).max()) for x, y in zip(ga, gb, strict=True)) < 1e-5 * scale
    for kind in ("cudnn", "flash"):
        with pytest.raises(AttentionUnavailableError, match="both ways"):
            choose_implementation(kind, q_len=8, kv_len=8, cached=False, window=None, platform="gpu", horizon=True)
    assert choose_implementation("auto", q_len=8, kv_len=8, cached=False, window=None, platform="gpu",
                                 horizon=True) == "xla"  # fmt: skip


def test_under_jit(model):
    from flax import nnx

    ids, mask, types, pix = batch()
    eager = ours(model, ids, mask, pix, types)

    @nnx.jit
    def run(m, ids, mask, pix, types):
        return m(ids, attention_mask=mask, pixel_values=pix, token_type_ids=types).logits

    jitted = run(model, *(jnp.asarray(x) for x in (ids, mask, pix, types)))
    assert np.abs(np.asarray(jitted) - np.asarray(eager)).max() < 1e-5


def test_export_loads_in_transformers_with_the_same_logits(model, hf, tmp_path):
    jm.save_hf_model(model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["Gemma3ForConditionalGeneration"] and written["mm_tokens_per_image"] == 4
    assert written["text_config"]["model_type"] == "gemma3_text"
    names = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert {n.split(".")[0] for n in names} == {"language_model", "vision_tower", "multi_modal_projector"}
    again = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids, mask, types, pix = batch()
    ref = hf_logits(hf, ids, mask, pix, types)
    assert close(hf_logits(again, ids, mask, pix, types), ref, mask) < 1e-6
    a, b = jm.to_hf_state_dict(model), jm.to_hf_state_dict(jm.from_pretrained(tmp_path / "out"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_transformers_layouts_are_read_and_a_name_given_twice_refused(model, hf, hub_dir, tmp_path):
    tensors = load_file(hub_dir / "model.safetensors")
    (tmp_path / "m").mkdir()
    hf.save_pretrained(tmp_path / "m")  # transformers 5's: the nested config written out whole
    again = jm.from_pretrained(tmp_path / "m")
    assert again.config.replace(layer_types=None, eos_token_id=model.config.eos_token_id) == model.config.replace(
        layer_types=None
    )
    a = jm.to_hf_state_dict(model)
    assert all(np.array_equal(a[k], v) for k, v in jm.to_hf_state_dict(again).items())

    def in_memory(name):  # transformers' module names
        for old, new in (
            ("language_model.model.", "model.language_model."),
            ("vision_tower.vision_model.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        ):
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "config.json").write_text(json.dumps(HUB_CONFIG))
    save_file({in_memory(k): v for k, v in tensors.items()}, tmp_path / "mem" / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    mem = jm.to_hf_state_dict(jm.from_pretrained(tmp_path / "mem"))
    assert all(np.array_equal(a[k], mem[k]) for k in a)
    both = {**tensors, **{in_memory(k): v for k, v in tensors.items()}}
    save_file(both, tmp_path / "mem" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="twice"):
        jm.from_pretrained(tmp_path / "mem")


def test_bad_inputs_are_one_error_naming_what_disagrees(model):
    ids, mask, types, pix = batch()
    with pytest.raises(ValueError, match=r"input_ids hold 12 image tokens .* the 2 image\(s\) give 8 features"):
        ours(model, ids, mask, pix[:2], types)
    with pytest.raises(ValueError, match=r"the 2 image\(s\) need 8"):
        model.image_inputs(ids, mask, pix[:2])
    with pytest.raises(ValueError, match="all one size"):
        model.image_inputs(ids, mask, pix, np.array([[1, 8, 8]]))
    with pytest.raises(ValueError, match="mm_tokens_per_image = 5"):
        jm.config_from_hf_dict(dict(HUB_CONFIG, mm_tokens_per_image=5))
    with pytest.raises(ValueError, match="hidden_size = 64 at the top and 32 in text_config"):
        jm.config_from_hf_dict(dict(HUB_CONFIG, hidden_size=64, text_config={**HUB_CONFIG["text_config"],
                                                                             "hidden_size": 32}))  # fmt: skip
    with pytest.raises(ValueError, match="vision_use_head"):
        jm.config_from_hf_dict(dict(HUB_CONFIG, vision_config={**HUB_CONFIG["vision_config"], "vision_use_head": True}))


@pytest.mark.parametrize("exclude", [None, ()], ids=["language-model-only", "with-the-tower"])
def test_lora_adapters_load_in_peft_with_the_same_logits(model, hub_dir, tmp_path, exclude):
    """LoRA's default leaves the tower and the projector out (PEFT's `exclude_modules`); `exclude_modules=()` adapts
    the tower too. PEFT over transformers' model gives the same logits with images; jaxloom reads the adapter back."""
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
    tower = {n for n in names if ".vision_tower." in n}
    assert all(n.startswith("base_model.model.model.language_model.") for n in names - tower)  # PEFT's module names
    assert bool(tower) == (exclude == ())
    if exclude is None:
        assert written["exclude_modules"] == ".*(vision_tower|multi_modal_projector).*"
    ids, mask, types, pix = batch()
    got = ours(lora, ids, mask, pix, types)
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(hub_dir, dtype=torch.float32)
    ref = hf_logits(peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval(), ids, mask, pix, types)
    assert close(got, ref, mask) < 1e-5
    plain = transformers.Gemma3ForConditionalGeneration.from_pretrained(hub_dir, dtype=torch.float32).eval()
    assert close(got, hf_logits(plain, ids, mask, pix, types), mask) > 1e-2  # the adapters act
    again = jm.from_pretrained(hub_dir)
    jm.apply_lora(again, jm.read_peft_config(tmp_path / "adapter"))
    jm.load_peft_weights(again, tmp_path / "adapter")
    assert np.array_equal(np.asarray(ours(again, ids, mask, pix, types)), np.asarray(got))


def test_sharded_over_fsdp_and_tp_equals_one_device(model, hub_dir):
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from jaxloom.mesh import MeshConfig, gather

    mesh = MeshConfig.from_axes(fsdp=4, tp=2).build()
    sharded = jm.from_pretrained(hub_dir, mesh=mesh)
    assert sharded.vision_tower.encoder.layers[0].self_attn.q_proj.kernel[...].sharding.spec == P("fsdp", "tp")
    assert sharded.multi_modal_projector.mm_input_projection_weight[...].sharding.spec == P(None, "fsdp")
    ids, mask, types, pix = batch()
    graphdef, state = nnx.split(sharded)

    @jax.jit
    def forward(state, ids, mask, pix, types):
        return nnx.merge(graphdef, state)(ids, attention_mask=mask, pixel_values=pix, token_type_ids=types).logits

    with jax.set_mesh(mesh):
        logits = forward(state, *(jnp.asarray(x) for x in (ids, mask, pix, types)))
    np.testing.assert_allclose(gather(logits), np.asarray(ours(model, ids, mask, pix, types)), rtol=2e-5, atol=2e-5)


# Gemma 3's turn and image tokens at the ids HUB_CONFIG gives them, and a Gemma-style chat template
SPECIAL = {"<start_of_turn>": 105, "<end_of_turn>": 106, "<start_of_image>": BOI, "<end_of_image>": EOI,
           "<image_soft_token>": IMAGE}  # fmt: skip
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' "
    "%}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
COLOURS = {"red": 110, "green": 111, "blue": 112}


def write_processor_files(path):
    """transformers' `Gemma3Processor` for this model written into model directory `path`: a word-level tokenizer
    (`w5` … `w104`, the colour words, Gemma's turn and image tokens at HUB_CONFIG's ids; `boi_token` … as Gemma's
    tokenizer names them) with the chat template, and Gemma 3's image processor at the tower's 32 pixels, 4 image
    tokens an image. What the trainer and `jaxloom generate --image` read. Returns the processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "user": 3, "model": 4, **{f"w{i}": i for i in range(5, 105)},
             **SPECIAL, **COLOURS}  # fmt: skip
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<pad>", pad_token="<pad>", bos_token="<bos>", eos_token="<end_of_turn>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL] == list(SPECIAL.values())
    tokenizer.chat_template = CHAT_TEMPLATE
    image = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = transformers.Gemma3Processor(
        image_processor=image, tokenizer=tokenizer, image_seq_length=4, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(str(path))
    return processor


def test_the_processors_token_types_and_pixels_are_what_the_model_reads(model, hf, tmp_path):
    """transformers' own `Gemma3Processor` (AutoProcessor, no torchvision needed) expands each image to
    `mm_tokens_per_image` tokens and marks them; the model reads its outputs as transformers' does."""
    from PIL import Image

    write_processor_files(tmp_path)
    processor = transformers.AutoProcessor.from_pretrained(tmp_path)
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 255, (40, 30, 3), dtype=np.uint8)) for _ in range(2)]
    out = processor(text=["w5 <start_of_image> w6 <start_of_image> w7"], images=[images], return_tensors="np")
    ids, types = np.asarray(out["input_ids"]), np.asarray(out["token_type_ids"])
    assert (ids == IMAGE).sum() == 8 and np.array_equal(types, (ids == IMAGE).astype(types.dtype))
    mask, pix = np.ones_like(ids), np.asarray(out["pixel_values"], np.float32)
    assert close(ours(model, ids, mask, pix, types), hf_logits(hf, ids, mask, pix, types), mask) < 1e-5
