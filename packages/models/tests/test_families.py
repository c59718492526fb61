"""Every family: the export is what was loaded (transformers reloads it to the same logits, jaxloom to the same
weights), and each feature the parity test covers acts at its length (dropping it moves the logits)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxloom.models as jm  # noqa: E402
from hf_util import batch, hf_logits, make_hf, rel_err  # noqa: E402

# The 12-token batch crosses every window (4 or 6), passes Phi-3's original length (8), and its soft-caps bind.
NEW = [
    "qwen2_mixed_window",
    "qwen3",
    "qwen3_moe",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "mistral",
    "smollm3",
    "gpt_oss",
    "deepseek_v3",
]


@pytest.mark.parametrize("family", NEW)
def test_export_reloads_in_transformers_and_jaxloom_exactly(tmp_path, family):
    hf = make_hf(family, tmp_path / "src")
    model = jm.from_pretrained(tmp_path / "src")
    jm.save_hf_model(model, tmp_path / "out")
    again_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again_hf) is type(hf)
    for key in ("sliding_window", "layer_types", "final_logit_softcapping", "attn_logit_softcapping", "head_dim"):
        if hasattr(hf.config, key):  # (an export may add head_dim where it was hidden / heads)
            assert getattr(again_hf.config, key) == getattr(hf.config, key), key
    assert again_hf.config.rope_parameters == hf.config.rope_parameters
    ids, mask, pos = batch("none", lengths=(12, 12, 12, 12))
    ref = hf_logits(hf, ids, mask, pos)
    assert rel_err(hf_logits(again_hf, ids, mask, pos), ref, mask) < 1e-6
    assert rel_err(np.asarray(model(ids, attention_mask=mask, positions=pos).logits), ref, mask) < 1e-4
    a, b = jm.to_hf_state_dict(model), jm.to_hf_state_dict(jm.from_pretrained(tmp_path / "out"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# (family, a config change that undoes one feature): without the feature, the logits must be far from transformers'
DROPPED = [
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": 16}),
    ("gemma2", {"sliding_window": None}),
    ("gemma3", {"rope_local_base_freq": 1000.0}),
    ("gemma3", {"rope_scaling": None}),
    ("gemma3", {"layer_types": ("sliding_attention", "sliding_attention")}),
    ("phi3", {"rope_scaling": None}),
    ("phi3", {"sliding_window": None}),
    ("qwen3_moe", {"norm_topk_prob": True}),
    ("qwen2_mixed_window", {"layer_types": ("sliding_attention", "sliding_attention")}),
    ("qwen3", {"head_dim": 24, "rms_norm_eps": 0.5}),
    ("smollm3", {"no_rope_layers": (1, 1)}),  # RoPE on the NoPE layer
    ("smollm3", {"no_rope_layers": (0, 0)}),  # none on the RoPE layer
    ("smollm3", {"use_sliding_window": False}),
    ("gpt_oss", {"swiglu_limit": 100.0}),  # the clamp unbound
    ("gpt_oss", {"swiglu_alpha": 1.0}),
    ("gpt_oss", {"layer_types": ("full_attention", "full_attention")}),
    ("gpt_oss", {"rope_scaling": None}),  # plain RoPE instead of its YaRN (the attention factor 1.35)
    ("deepseek_v3", {"rope_interleave": False}),
    ("deepseek_v3", {"routed_scaling_factor": 1.0}),
    ("deepseek_v3", {"topk_group": 4}),  # every group open: the group restriction acts
    ("deepseek_v3", {"norm_topk_prob": False}),
    ("deepseek_v3", {"rope_scaling": None}),  # also drops mscale_all_dim's softmax scale
]


@pytest.mark.parametrize(("family", "change"), DROPPED, ids=[f"{f}-{'-'.join(c)}" for f, c in DROPPED])
def test_each_feature_acts_at_the_tested_length(tmp_path, family, change):
    hf = make_hf(family, tmp_path)
    ids, mask, pos = batch("none", lengths=(12, 12, 12, 12))
    ref = hf_logits(hf, ids, mask, pos)
    exact = jm.from_pretrained(tmp_path)
    assert rel_err(np.asarray(exact(ids, attention_mask=mask, positions=pos).logits), ref, mask) < 1e-4
    wrong = jm.from_pretrained(tmp_path, config_overrides=change)
    assert rel_err(np.asarray(wrong(ids, attention_mask=mask, positions=pos).logits), ref, mask) > 1e-3


def test_registered_lists_every_family():
    assert {m for m, _ in jm.registered()} >= {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "mixtral",
        "gemma2",
        "gemma3_text",
        "phi3",
        "olmo2",
        "smollm3",
        "gpt_oss",
        "deepseek_v3",
    }


def test_published_config_keys_load(tmp_path):
    """Keys published configs carry: Gemma 3's `_sliding_window_pattern` / `cache_implementation`, Gemma 2's
    `hidden_act` beside `hidden_activation`, Phi-3's `su` RoPE and top-level `original_max_position_embeddings`,
    Qwen3-MoE's `num_experts`; dropout keys at 0."""
    g3 = jm.config_from_hf_dict(
        dict(
            model_type="gemma3_text",
            num_hidden_layers=12,
            _sliding_window_pattern=6,
            cache_implementation="hybrid",
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            attention_dropout=0.0,
        )
    )
    assert g3.attention_types().count("full_attention") == 2 and g3.rope_of("sliding_attention") == (10000.0, None)
    g2 = jm.config_from_hf_dict(dict(model_type="gemma2", hidden_act="gelu_pytorch_tanh", hidden_activation="gelu"))
    assert g2.mlp_activation == "gelu"
    phi = jm.config_from_hf_dict(
        dict(
            model_type="phi3",
            hidden_size=96,
            num_attention_heads=4,
            original_max_position_embeddings=4096,
            max_position_embeddings=131072,
            rope_scaling={"type": "su", "short_factor": [1.0] * 12, "long_factor": [2.0] * 12},
            resid_pdrop=0.0,
            embd_pdrop=0.0,
        )
    )
    assert phi.rope_scaling["rope_type"] == "longrope" and phi.rope_scaling["original_max_position_embeddings"] == 4096
    moe = jm.config_from_hf_dict(dict(model_type="qwen3_moe", num_experts=16, num_hidden_layers=4))
    assert moe.num_experts == 16 and moe.to_hf_dict()["num_local_experts"] == 16
    assert json.loads(json.dumps(g3.to_hf_dict()))["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0


SMOLLM3_3B = {  # HuggingFaceTB/SmolLM3-3B's config.json
    "architectures": ["SmolLM3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128012,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "layer_types": ["full_attention"] * 36,
    "max_position_embeddings": 65536,
    "max_window_layers": 28,
    "mlp_bias": False,
    "model_type": "smollm3",
    "no_rope_layer_interval": 4,
    "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)],
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 4,
    "pad_token_id": 128004,
    "pretraining_tp": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 5000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.53.0.dev0",
    "use_cache": False,
    "use_sliding_window": False,
    "vocab_size": 128256,
}


@pytest.mark.parametrize("published", [SMOLLM3_3B], ids=["SmolLM3-3B"])
def test_published_full_size_configs_count_the_parameters_transformers_counts(published):
    """A published config.json, full size, is accepted and counts what transformers' model of it holds (built on
    the meta device: nothing allocated on either side)."""
    config = jm.config_from_hf_dict(dict(published))
    ours = jm.count_params(jm.create_model(config, lazy=True))
    keys = {k: v for k, v in published.items() if k not in ("architectures", "transformers_version", "torch_dtype")}
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**keys))
    assert ours == theirs.num_parameters()
    if published["model_type"] == "smollm3":  # every fourth layer without RoPE
        assert [i for i, k in enumerate(config.attention_types()) if k.endswith("+nope")] == list(range(3, 36, 4))


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (dict(model_type="gemma2", attention_dropout=0.1), "attention_dropout = 0.1"),
        (dict(model_type="phi3", resid_pdrop=0.1), "resid_pdrop"),
        (dict(model_type="phi3", partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(model_type="qwen3_moe", num_experts=8, num_local_experts=4), "disagree"),
        (dict(model_type="qwen3_moe", num_hidden_layers=2, mlp_only_layers=[5]), "mlp_only_layers"),
        (dict(model_type="gemma2", num_hidden_layers=2, layer_types=["full_attention"]), "one per layer"),
        (dict(model_type="gemma2", num_hidden_layers=1, layer_types=["chunked_attention"]), "chunked_attention"),
        (
            dict(model_type="phi3", rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
            "_factor = ",
        ),
        (
            dict(
                model_type="gemma3_text",
                rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}},
            ),
            "local layers",
        ),
    ],
)
def test_settings_that_change_the_model_are_refused_by_name(data, words):
    with pytest.raises(ValueError, match=words):
        jm.config_from_hf_dict(data)


def test_mixed_dense_and_sparse_layers_refuse_an_explicit_scan():
    config = jm.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_only_layers=(0,),
    )
    assert not jm.create_model(config, lazy=True).scanned
    with pytest.raises(ValueError, match="scan_layers=True"):
        jm.create_model(config, jm.RuntimeConfig(scan_layers=True), lazy=True)
