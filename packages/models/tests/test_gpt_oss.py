"""GPT-OSS beyond the shared family tests (parity, export, generation, sharding: the family lists): the published
MXFP4 experts load as transformers dequantizes them, the attention sinks act, the published configs count what
transformers counts, and the token dispatch with the experts' biases and clamped SwiGLU equals the dense
reference in values and gradients."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxloom.models as jm  # noqa: E402
from hf_util import batch, hf_logits, make_hf, rel_err  # noqa: E402
from jaxloom.models import safetensors_io  # noqa: E402


def test_mxfp4_experts_load_as_transformers_dequantizes_them_and_export_unquantized(tmp_path):
    """A checkpoint in the published layout (`experts.*_blocks` / `*_scales`, `quantization_config: mxfp4`):
    transformers (`Mxfp4Config(dequantize=True)`) and jaxloom read the same expert weights, bit for bit, and the
    same logits; the export holds plain float tensors and no quantization_config, and transformers reads it back
    to the same logits."""
    src, packed = tmp_path / "src", tmp_path / "mxfp4"
    make_hf("gpt_oss", src)
    tensors = dict(safetensors_io.load(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    e, d, f = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    rng = np.random.default_rng(0)
    for layer in range(config["num_hidden_layers"]):
        for name, (rows, inner) in {"gate_up_proj": (2 * f, d), "down_proj": (d, f)}.items():
            key = f"model.layers.{layer}.mlp.experts.{name}"
            del tensors[key]
            tensors[f"{key}_blocks"] = rng.integers(0, 256, (e, rows, inner // 32, 16), dtype=np.uint8)
            tensors[f"{key}_scales"] = rng.integers(120, 124, (e, rows, inner // 32), dtype=np.uint8)
    packed.mkdir()
    safetensors_io.save({k: np.asarray(v) for k, v in tensors.items()}, packed / "model.safetensors")
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (packed / "config.json").write_text(json.dumps(config))

    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        packed, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    ours = jm.from_pretrained(packed)
    weights = jm.to_hf_state_dict(ours)
    for name in ("gate_up_proj", "down_proj"):
        reference = getattr(theirs.model.layers[1].mlp.experts, name).detach().float().numpy()
        np.testing.assert_array_equal(weights[f"model.layers.1.mlp.experts.{name}"], reference)
    ids, mask, pos = batch("right", lengths=(12, 12, 12, 12))
    ref = hf_logits(theirs, ids, mask, pos)
    assert rel_err(np.asarray(ours(ids, attention_mask=mask, positions=pos).logits), ref, mask) < 1e-5

    jm.save_hf_model(ours, tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in exported
    names = set(safetensors_io.read_header(next((tmp_path / "out").glob("*.safetensors")))[0])
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(n.endswith("_blocks") for n in names)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert rel_err(hf_logits(again, ids, mask, pos), ref, mask) < 1e-5


def test_dequantize_mxfp4_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (3, 10, 4), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32).numpy()
    np.testing.assert_array_equal(jm.dequantize_mxfp4(blocks, scales), theirs)
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        jm.dequantize_mxfp4(blocks, scales[:, :5])


def test_the_attention_sinks_act(tmp_path):
    """Sinks pushed to -1e9 (no share of any softmax) leave GPT-OSS's numbers: they are read and they act."""
    hf = make_hf("gpt_oss", tmp_path)
    ids, mask, pos = batch("right", lengths=(12, 12, 12, 12))
    ref = hf_logits(hf, ids, mask, pos)
    model = jm.from_pretrained(tmp_path)
    assert rel_err(np.asarray(model(ids, attention_mask=mask, positions=pos).logits), ref, mask) < 1e-4
    for layer in model.model.layers:
        layer.self_attn.sinks[...] = jnp.full_like(layer.self_attn.sinks[...], -1e9)
    assert rel_err(np.asarray(model(ids, attention_mask=mask, positions=pos).logits), ref, mask) > 1e-3


GPT_OSS_20B = {  # openai/gpt-oss-20b's config.json
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128}
GPT_OSS_120B["layer_types"] = ["sliding_attention", "full_attention"] * 18


@pytest.mark.parametrize("published", [GPT_OSS_20B, GPT_OSS_120B], ids=["gpt-oss-20b", "gpt-oss-120b"])
def test_published_configs_count_the_parameters_transformers_counts(published):
    config = jm.config_from_hf_dict(dict(published))
    assert config.rope_scaling["rope_type"] == "yarn" and config.attention_types()[:2] == (
        "sliding_attention",
        "full_attention",
    )
    ours = jm.count_params(jm.create_model(config, lazy=True))
    keys = {
        k: v for k, v in published.items() if k not in ("architectures", "transformers_version", "quantization_config")
    }
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**keys))
    assert ours == theirs.num_parameters()
    print(f"\n{published['num_local_experts']} experts × {published['num_hidden_layers']} layers: {ours:,} parameters")


def test_rope_and_quantization_settings_read_as_transformers_reads_them():
    plain = jm.config_from_hf_dict(
        dict(model_type="gpt_oss", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    )
    assert plain.rope_scaling is None and plain.rope_theta == 1e4
    assert jm.config_from_hf_dict(dict(model_type="gpt_oss")).rope_scaling["factor"] == 32.0  # transformers' default
    with pytest.raises(ValueError, match="quant_method = 'bitsandbytes'"):
        jm.config_from_hf_dict(dict(model_type="gpt_oss", quantization_config={"quant_method": "bitsandbytes"}))


def test_token_dispatch_with_biases_and_the_clamp_equals_the_dense_reference():
    """The experts' biases (per sorted row's expert) and the clamped SwiGLU through the grouped matmuls (`tiled`,
    `ragged`): the dense reference's logits and gradients, with the clamp binding (limit 0.3)."""
    config = jm.GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        num_hidden_layers=1,  # one layer: what is compared; the compile of each variant is the cost
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=4,
        swiglu_limit=0.3,
    )
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 64, (3, 16)))

    def run(impl):
        model = jm.create_model(config, jm.RuntimeConfig(moe_implementation=impl), seed=5)
        graphdef, state = nnx.split(model)
        for layer in model.model.layers:  # biases drawn (they start at zero)
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                v = getattr(layer.mlp.experts, name)
                v[...] = 0.5 * jax.random.normal(jax.random.key(len(name)), v.shape)
        graphdef, state = nnx.split(model)

        @jax.jit  # one program (eager, each op compiles on its own: minutes)
        def logits_and_grads(state):
            def loss(state):
                out = nnx.merge(graphdef, state)(ids)
                return jnp.sum(jnp.sin(out.logits)) + out.aux_loss, out.logits

            grads, logits = jax.grad(loss, has_aux=True)(state)
            return logits, grads

        logits, grads = logits_and_grads(state)
        return np.asarray(logits), grads

    ref_logits, ref_grads = run("dense")
    for impl in ("tiled", "ragged"):
        logits, grads = run(impl)
        np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
        for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-4)


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_all_linear_lora_targets_what_peft_targets(tmp_path, family):
    """`lora_target_modules=all-linear` picks the layers PEFT's all-linear picks on transformers' model: its
    `nn.Linear`s but the output layer (GPT-OSS's router and DeepSeek's gate are not linear layers there)."""
    hf = make_hf(family, tmp_path)
    theirs = {n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    model = jm.from_pretrained(tmp_path)
    ours = {".".join(path) for _, _, path in jm.lora.targets(model, jm.LoRAConfig(target_modules="all-linear"))}
    assert ours == theirs and ours
