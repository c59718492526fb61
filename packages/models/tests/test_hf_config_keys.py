"""Config keys as transformers reads them: every key takes effect or is refused by name, and an export writes
back what was loaded. Each test here failed on jaxloom-models 0.9.0 (silently wrong or wrongly refused)."""

import pytest

import jaxloom.models as jm

BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def test_keys_transformers_ignores_are_accepted():
    """Qwen2.5 base / DeepSeek-R1-Distill-Qwen carry use_mrope: false; SmolLM2 carries is_llama_config and
    rope_interleaved. transformers reads none of them for these families."""
    jm.config_from_hf_dict({"model_type": "qwen2", **BASE, "use_mrope": False})
    jm.config_from_hf_dict({"model_type": "llama", **BASE, "is_llama_config": True, "rope_interleaved": False})
    with pytest.raises(ValueError, match="use_mrope"):  # Qwen2-VL's multimodal RoPE: it would change the model
        jm.config_from_hf_dict({"model_type": "qwen2", **BASE, "use_mrope": True})
    with pytest.raises(ValueError, match="unknown config key"):  # a misspelt key still fails
        jm.config_from_hf_dict({"model_type": "llama", **BASE, "num_hiden_layers": 2})


def test_qwen2_windows_follow_max_window_layers_and_layer_types():
    """transformers windows Qwen2's layers from max_window_layers on (or those layer_types marks): all of them,
    none, or a mix (each layer its own window; the parity test runs a mix against transformers)."""
    on = {"model_type": "qwen2", **BASE, "use_sliding_window": True, "sliding_window": 4}
    full, local = "full_attention", "sliding_attention"
    assert jm.config_from_hf_dict({**on, "max_window_layers": 0}).attention_types() == (local, local)
    assert jm.config_from_hf_dict({**on, "max_window_layers": 2}).attention_types() == (full, full)
    assert jm.config_from_hf_dict({**on, "max_window_layers": 1}).attention_types() == (full, local)
    off = jm.config_from_hf_dict({**on, "use_sliding_window": False, "layer_types": [local, local]})
    assert off.sliding_window is None and off.window_of(local) is None  # as transformers: no window at all
    mixed = jm.config_from_hf_dict({**on, "layer_types": [local, full]})
    assert [mixed.window_of(k) for k in mixed.attention_types()] == [4, None]
    with pytest.raises(ValueError, match="one per layer"):
        jm.config_from_hf_dict({**on, "layer_types": [local]})


def test_rope_scaling_keys_take_effect_or_are_refused():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    jm.config_from_hf_dict({"model_type": "llama", **BASE, "rope_scaling": {**yarn, "mscale": 1.0, "truncate": False}})
    with pytest.raises(ValueError, match=r"rope_scaling key\(s\) \['mscale_typo'\]"):
        jm.config_from_hf_dict({"model_type": "llama", **BASE, "rope_scaling": {**yarn, "mscale_typo": 1.0}})
    with pytest.raises(ValueError, match="needs .*low_freq_factor"):  # was a KeyError deep in the model
        jm.config_from_hf_dict({"model_type": "llama", **BASE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        jm.config_from_hf_dict({"model_type": "llama", **BASE, "rope_scaling": {**yarn, "partial_rotary_factor": 0.5}})
    with pytest.raises(ValueError, match="factor = 0"):
        jm.config_from_hf_dict({"model_type": "llama", **BASE, "rope_scaling": {"rope_type": "linear", "factor": 0}})


def test_a_mistral_without_a_window_is_exported_without_one(tmp_path):
    """Mistral v0.2/v0.3 say "sliding_window": null; the export must too, or transformers (and jaxloom) read
    the family default back: a 4096-token window on a model trained without one."""
    transformers = pytest.importorskip("transformers")
    config = jm.config_from_hf_dict({"model_type": "mistral", **BASE, "sliding_window": None})
    assert config.sliding_window is None and config.to_hf_dict()["sliding_window"] is None
    model = jm.create_model(config, seed=0)
    jm.save_hf_model(model, tmp_path / "out")
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").sliding_window is None
    assert jm.from_pretrained(tmp_path / "out").config.sliding_window is None


@pytest.mark.parametrize("key", ["rope_theta", "rms_norm_eps"])
def test_a_zero_rope_base_or_norm_epsilon_is_refused_before_anything_runs(key):
    """rope_theta = 0 trained a whole step to NaN (issue 43); now one error naming the key."""
    with pytest.raises(ValueError, match=f"{key} = 0"):
        jm.config_from_hf_dict({"model_type": "llama", **BASE, key: 0})
