"""DeepSeek-V3 beyond the shared family tests (parity, export, generation, sharding, each feature acting: the family
lists): the router's correction bias acts, the published config counts what transformers counts, the published
files' extra layers (multi-token prediction) are skipped on load and their FP8 weights refused by name, and the
token dispatch equals the dense reference."""

import copy
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


def test_the_correction_bias_acts_and_extra_layers_in_the_files_are_skipped(tmp_path):
    """The router's `e_score_correction_bias` is read (zeroed, the logits leave transformers'); a checkpoint with a
    layer past the model's (the published multi-token-prediction layer) loads to the same model."""
    hf = make_hf("deepseek_v3", tmp_path / "src")
    ids, mask, pos = batch("right", lengths=(12, 12, 12, 12))
    ref = hf_logits(hf, ids, mask, pos)
    model = jm.from_pretrained(tmp_path / "src")
    assert rel_err(np.asarray(model(ids, attention_mask=mask, positions=pos).logits), ref, mask) < 1e-4
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    bias[...] = jnp.zeros_like(bias[...])
    assert rel_err(np.asarray(model(ids, attention_mask=mask, positions=pos).logits), ref, mask) > 1e-3

    tensors = dict(safetensors_io.load(tmp_path / "src" / "model.safetensors"))
    tensors.update(
        {k.replace("model.layers.1.", "model.layers.2."): v for k, v in tensors.items() if ".layers.1." in k}
    )
    tensors["model.layers.2.eh_proj.weight"] = np.zeros((64, 128), np.float32)  # an MTP layer's own projection
    (tmp_path / "mtp").mkdir()
    safetensors_io.save({k: np.asarray(v) for k, v in tensors.items()}, tmp_path / "mtp" / "model.safetensors")
    (tmp_path / "mtp" / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    again = jm.from_pretrained(tmp_path / "mtp")
    assert rel_err(np.asarray(again(ids, attention_mask=mask, positions=pos).logits), ref, mask) < 1e-4


def test_a_kimi_k2_checkpoint_loads_as_deepseek_v3_and_exports_without_remote_code(tmp_path):
    """Moonshot publishes Kimi K2 as `model_type: kimi_k2` with its own remote code over DeepSeek-V3's tensors: it
    loads as DeepSeek-V3 (logits equal transformers' DeepSeek-V3 on the same files) and exports as `deepseek_v3`,
    which transformers reads without remote code."""
    hf = make_hf("deepseek_v3", tmp_path / "src")
    ids, mask, pos = batch("right", lengths=(12, 12, 12, 12))
    ref = hf_logits(hf, ids, mask, pos)
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config |= {
        "model_type": "kimi_k2",
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
    }
    (kimi / "config.json").write_text(json.dumps(config))
    (kimi / "model.safetensors").write_bytes((tmp_path / "src" / "model.safetensors").read_bytes())
    model = jm.from_pretrained(kimi)
    assert isinstance(model, jm.DeepseekV3ForCausalLM) and model.config.model_type == "deepseek_v3"
    assert rel_err(np.asarray(model(ids, attention_mask=mask, positions=pos).logits), ref, mask) < 1e-4
    jm.save_hf_model(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "deepseek_v3"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert rel_err(hf_logits(back, ids, mask, pos), ref, mask) < 1e-4


def test_generation_caches_the_compressed_latent_and_decodes_as_the_full_forward(tmp_path):
    """The KV cache holds one head of `kv_lora_rank + qk_rope_head_dim` a token (no value slot), and attention over
    it (projections absorbed into the query and output, LoRA adapters on `kv_b_proj` merged in) gives the logits
    of the uncached forward, token by token."""
    make_hf("deepseek_v3", tmp_path / "src")
    model = jm.from_pretrained(tmp_path / "src")
    c = model.config
    keys, values = model.init_cache(2, 12)[0]
    assert keys.shape == (2, 12, 1, c.kv_lora_rank + c.qk_rope_head_dim) and values.shape == (2, 12, 1, 0)
    lora = jm.LoRAConfig(r=4, target_modules=("kv_b_proj",))
    adapted = jm.apply_lora(model, lora, seed=1)
    changed = 0
    for path, leaf in nnx.iter_graph(adapted):
        if path and path[-1] == "lora_b":  # non-zero adapters: the merged kernel must be what decoding uses
            leaf[...] = jax.random.normal(jax.random.PRNGKey(len(path)), leaf[...].shape) * 0.1
            changed += 1
    assert changed == c.num_hidden_layers
    ids, mask, pos = batch("right", lengths=(12, 12, 12, 12))
    ids, pos = ids[:2], pos[:2]
    full = np.asarray(adapted(ids, positions=pos).logits)
    cache = adapted.init_cache(2, 12)
    seg = jnp.ones((2, 12), jnp.int32)
    for t in range(12):
        out = adapted(
            ids[:, t : t + 1],
            positions=pos[:, t : t + 1],
            segment_ids=seg[:, t : t + 1],
            cache=cache,
            cache_index=t,
            kv_positions=pos,
            kv_segment_ids=seg.at[:, t + 1 :].set(0),
        )
        cache = out.cache
        np.testing.assert_allclose(np.asarray(out.logits[:, 0]), full[:, t], atol=2e-4, err_msg=f"token {t}")


DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3's config.json (its FP8 quantization_config apart: see below)
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_the_published_config_counts_the_parameters_transformers_counts_and_fp8_is_refused_by_name():
    config = jm.config_from_hf_dict(dict(DEEPSEEK_V3))
    ours = jm.count_params(jm.create_model(config, lazy=True))
    # a deep copy: transformers rewrites the rope_scaling dict it is given in place
    keys = copy.deepcopy({k: v for k, v in DEEPSEEK_V3.items() if k not in ("architectures", "transformers_version")})
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**keys))
    bias = config.n_routed_experts * (config.num_hidden_layers - config.first_k_dense_replace)  # a buffer there
    assert ours == theirs.num_parameters() + bias
    print(f"\nDeepSeek-V3: {ours:,} parameters ({ours - bias:,} without the router biases), 671B published")
    assert 670e9 < ours < 672e9
    fp8 = {**DEEPSEEK_V3, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert jm.config_from_hf_dict(fp8) == config  # the published file as it is: its weights dequantized on load
    with pytest.raises(ValueError, match="quant_method = 'awq'; expected fp8"):
        jm.config_from_hf_dict({**DEEPSEEK_V3, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="scoring_func = 'softmax'"):
        jm.config_from_hf_dict({**DEEPSEEK_V3, "scoring_func": "softmax"})
    for bad, words in (
        ({"kv_lora_rank": 0}, "kv_lora_rank = 0; expected a positive integer"),
        ({"q_lora_rank": -1}, "q_lora_rank = -1"),
        ({"n_group": 3}, "n_group = 3, topk_group = 4 for 256 experts"),
        ({"routed_scaling_factor": 0}, "routed_scaling_factor = 0"),
    ):
        with pytest.raises(ValueError, match=words):
            jm.config_from_hf_dict({**DEEPSEEK_V3, **bad})
    assert jm.config_from_hf_dict({**DEEPSEEK_V3, "q_lora_rank": None}).q_lora_rank is None  # one q_proj
    with pytest.raises(ValueError, match="qk_head_dim = 100"):
        jm.config_from_hf_dict({**DEEPSEEK_V3, "qk_head_dim": 100})
    assert json.loads(json.dumps(config.to_hf_dict()))["n_routed_experts"] == 256


def test_token_dispatch_equals_the_dense_reference():
    config = jm.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=1,  # one sparse layer: what is compared; the compile of each variant is the cost
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=0,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=64,
    )
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 64, (3, 16)))

    def run(impl):
        model = jm.create_model(config, jm.RuntimeConfig(moe_implementation=impl), seed=5)
        graphdef, state = nnx.split(model)

        @jax.jit  # one program (eager, each op compiles on its own: minutes)
        def logits_and_grads(state):
            def loss(state):
                logits = nnx.merge(graphdef, state)(ids).logits
                return jnp.sum(jnp.sin(logits)), logits

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


def test_block_scaled_fp8_weights_load_as_transformers_dequantizes_them(tmp_path):
    """The published layout: `NAME.weight` in float8 e4m3 beside `NAME.weight_scale_inv` (a float32 scale per
    128 × 128 block; here 16 × 16 with ragged edges), `quantization_config: fp8`. Each weight reads as transformers'
    `_dequantize_fp8_weight` gives it, bit for bit, and the model's logits are those of transformers' model on the
    dequantized weights."""
    import ml_dtypes
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    src, packed = tmp_path / "src", tmp_path / "fp8"
    make_hf("deepseek_v3", src)
    tensors = dict(safetensors_io.load(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    block = (16, 16)
    rng = np.random.default_rng(0)
    dequantized = {}
    for name in [k for k in tensors if k.endswith("proj.weight") and ".layers." in k]:
        w = np.asarray(tensors[name])
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        scale = rng.uniform(1.0, 2.0, (rows, cols)).astype(np.float32) * np.abs(w).max() / 448  # within e4m3
        expanded = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[: w.shape[0], : w.shape[1]]
        tensors[name] = (w / expanded).astype(ml_dtypes.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
        theirs = _dequantize_fp8_weight(
            torch.tensor(tensors[name].view(np.uint8)).view(torch.float8_e4m3fn),
            torch.tensor(scale),
            list(block),
            torch.float32,
        )
        dequantized[name] = theirs.numpy()
    packed.mkdir()
    safetensors_io.save({k: np.asarray(v) for k, v in tensors.items()}, packed / "model.safetensors")
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block), "fmt": "e4m3"}
    (packed / "config.json").write_text(json.dumps(config))

    ours = jm.from_pretrained(packed)
    weights = jm.to_hf_state_dict(ours)
    assert len(dequantized) > 10
    for name, reference in dequantized.items():
        np.testing.assert_array_equal(weights[name], reference, err_msg=name)
    plain = dict(safetensors_io.load(src / "model.safetensors"))
    plain.update(dequantized)
    (tmp_path / "plain").mkdir()
    safetensors_io.save({k: np.asarray(v) for k, v in plain.items()}, tmp_path / "plain" / "model.safetensors")
    (tmp_path / "plain" / "config.json").write_text((src / "config.json").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
    ids, mask, pos = batch("right", lengths=(12, 12, 12, 12))
    ref = hf_logits(hf, ids, mask, pos)
    assert rel_err(np.asarray(ours(ids, attention_mask=mask, positions=pos).logits), ref, mask) < 1e-4


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_the_flop_count_reads_the_latent_attentions_own_weights(q_lora_rank):
    """`flops_per_token` counts MLA's projections as built (bottleneck or one q_proj; the latent's two steps), and
    each sparse layer's routed experts (k of them), shared experts and router."""
    from jaxloom.models.layers import Linear

    config = jm.DeepseekV3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
    )
    model = jm.create_model(config, lazy=True)
    attention = model.model.layers[0].self_attn
    built = sum(int(np.prod(m.kernel.shape)) for m in vars(attention).values() if isinstance(m, Linear))
    assert config.attention_matmul_params == built
    d, f = config.hidden_size, config.moe_intermediate_size
    mlp = (
        3 * d * config.intermediate_size + 3 * d * f * 2 + d * 8 + 3 * d * f
    )  # dense layer; sparse: k=2, router, shared
    forward = 2 * (2 * built + mlp + d * config.vocab_size) + 2 * 2 * 128 * 4 * (24 + 12)
    assert jm.flops_per_token(config, 128) == 3 * forward
