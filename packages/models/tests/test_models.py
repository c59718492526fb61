import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxloom.models as jm
from jaxloom.models import safetensors_io

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_registry_resolves_and_names_what_is_known():
    assert jm.get_model_class("llama", jm.TaskType.CAUSAL_LM) is jm.LlamaForCausalLM
    assert jm.MixtralForCausalLM.model_type == "mixtral" and jm.MixtralForCausalLM.task is jm.TaskType.CAUSAL_LM
    with pytest.raises(
        ValueError,
        match=r"model_type='gpt9'.*known: \['deepseek_v3/CAUSAL_LM', .*'gemma2/CAUSAL_LM', 'gemma3/CAUSAL_LM', "
        r"'gemma3_text/CAUSAL_LM'",
    ):
        jm.get_model_class("gpt9")
    with pytest.raises(ValueError, match="unknown task 'translate'"):
        jm.get_model_class("llama", "translate")


# what a family's config needs beyond TINY to be valid (a vision-language model's tower and image tokens)
FAMILY_EXTRA = {
    "qwen2_5_vl": dict(
        mrope_section=(2, 3, 3),
        vision_config=jm.Qwen2_5_VLVisionConfig(
            depth=2, hidden_size=32, num_heads=2, out_hidden_size=64, fullatt_block_indexes=(1,)
        ),  # fmt: skip
        image_token_id=90,
        vision_start_token_id=91,
        vision_end_token_id=92,
    ),
}


@pytest.mark.parametrize("cls", list(jm.CONFIG_CLASSES.values()))
def test_hf_config_round_trip(tmp_path, cls):
    config = cls(**TINY, **FAMILY_EXTRA.get(cls.model_type, {}), rope_scaling={"rope_type": "linear", "factor": 2.0})
    config.save_pretrained(tmp_path)
    back = cls.from_pretrained(tmp_path)
    assert back == config and hash(back) == hash(config)
    assert jm.config_from_hf_dict(json.loads((tmp_path / "config.json").read_text())) == config


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['hidden_sise'\]"):
        jm.LlamaConfig.from_hf_dict({"hidden_sise": 3})
    with pytest.raises(ValueError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        jm.LlamaConfig(**{**TINY, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="hidden_size = -1; expected a positive integer"):
        jm.LlamaConfig(**{**TINY, "hidden_size": -1})
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        jm.config_from_hf_dict({"model_type": "bert"})
    with pytest.raises(ValueError, match="attn_mechanism = 'flash9'; expected one of"):
        jm.RuntimeConfig(attn_mechanism="flash9")
    with pytest.raises(ValueError, match="'float33' is not a dtype"):
        jm.RuntimeConfig(dtype="float33")


def test_lazy_model_holds_no_arrays_and_counts_params():
    model = jm.create_model(jm.LlamaConfig(**TINY), lazy=True)
    kernel = model.model.layers[0].self_attn.q_proj.kernel.get_value()
    assert isinstance(kernel, jax.ShapeDtypeStruct) and kernel.shape == (64, 64)
    d, f, v, layers = 64, 96, 96, 2
    expected = v * d * 2 + layers * (d * 64 + 2 * d * 32 + 64 * d + 3 * d * f + 2 * d) + d
    assert jm.count_params(model) == expected


def test_flops_per_token_counts_the_matmuls():
    cfg = jm.LlamaConfig(**TINY)
    n_matmul = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 96) + 64 * 96
    assert jm.flops_per_token(cfg, 16, training=False) == 2 * n_matmul + 2 * 2 * 16 * 64 * 2
    assert jm.flops_per_token(cfg, 16) == 3 * jm.flops_per_token(cfg, 16, training=False)


def test_packed_rows_equal_separate_documents():
    """Segment ids keep packed documents apart: logits match running each document alone."""
    model = jm.create_model(jm.LlamaConfig(**TINY), seed=2)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 96, 5), rng.integers(0, 96, 7)
    packed = np.concatenate([a, b, [0, 0, 0, 0]])[None].astype(np.int32)
    seg = np.array([[1] * 5 + [2] * 7 + [0] * 4])
    pos = np.array([list(range(5)) + list(range(7)) + [0] * 4])
    out = np.asarray(model(packed, segment_ids=seg, positions=pos).logits[0])
    alone_a = np.asarray(model(a[None].astype(np.int32)).logits[0])
    alone_b = np.asarray(model(b[None].astype(np.int32)).logits[0])
    np.testing.assert_allclose(out[:5], alone_a, atol=1e-5)
    np.testing.assert_allclose(out[5:12], alone_b, atol=1e-5)


def test_sliding_window_mask():
    seg = jnp.ones((1, 6), jnp.int32)
    pos = jnp.arange(6)[None]
    mask = np.asarray(jm.make_attention_mask(seg, pos, pos, sliding_window=2)[0])
    assert mask[5].tolist() == [False, False, False, False, True, True]
    assert mask[0].tolist() == [True, False, False, False, False, False]


def test_bad_checkpoints_are_clear_errors(tmp_path):
    model = jm.create_model(jm.LlamaConfig(**TINY))
    jm.save_hf_model(model, tmp_path / "ok")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        jm.from_pretrained(tmp_path / "nothing")
    # missing and unexpected weights
    tensors = safetensors_io.load(tmp_path / "ok" / "model.safetensors")
    tensors = {k: np.asarray(v) for k, v in tensors.items()}
    tensors["model.extra.weight"] = tensors.pop("model.norm.weight")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    safetensors_io.save(tensors, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights \['model.norm.weight'\]; unexpected weights \['model.extra"):
        jm.from_pretrained(tmp_path / "bad")
    # a checkpoint of another shape
    with pytest.raises(ValueError, match=r"weight (lm_head|model.embed_tokens).weight has shape \(\d+, \d+\), but"):
        jm.from_pretrained(tmp_path / "ok", config_overrides={"vocab_size": 128})
    # a truncated file
    data = (tmp_path / "ok" / "model.safetensors").read_bytes()
    (tmp_path / "ok" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="the file is truncated"):
        jm.from_pretrained(tmp_path / "ok")


def test_bfloat16_params_load_and_cast(tmp_path):
    model = jm.create_model(jm.LlamaConfig(**TINY))
    jm.save_hf_model(model, tmp_path, dtype="bfloat16")
    back = jm.from_pretrained(tmp_path, jm.RuntimeConfig(param_dtype="bfloat16", dtype="bfloat16"))
    kernel = back.model.layers[0].mlp.down_proj.kernel[...]
    assert kernel.dtype == jnp.bfloat16
    ref = np.asarray(model.model.layers[0].mlp.down_proj.kernel[...]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(kernel), ref)
    assert np.isfinite(np.asarray(back(np.ones((1, 4), np.int32)).logits, np.float32)).all()


def test_easydel_names_and_enums_run_on_our_backends():
    from jaxloom.models import AttentionMechanisms, EasyDeLGradientCheckPointers, RuntimeConfig

    rt = RuntimeConfig(attn_mechanism=AttentionMechanisms.SPLASH, remat=EasyDeLGradientCheckPointers.SELECTIVE)
    assert (rt.attn_mechanism, rt.remat) == ("flash", "dots_saveable")
    assert RuntimeConfig(attn_mechanism="blockwise", remat="nothing_saveable").attn_mechanism == "chunked"
    assert RuntimeConfig(remat="everything_saveable").remat == "none"
    with pytest.raises(ValueError, match=r"attn_mechanism = 'ring'; expected one of \['auto', 'blockwise'"):
        RuntimeConfig(attn_mechanism="ring")


def test_configs_are_parsed_by_their_field_types():
    cfg = jm.LlamaConfig.from_hf_dict({"rms_norm_eps": "1e-5", "rope_theta": "1e6", "hidden_size": 64})
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 1e6 and isinstance(cfg.hidden_size, int)
    with pytest.raises(ValueError, match=r"LlamaConfig: hidden_size = 3.5; expected a valid integer"):
        jm.LlamaConfig.from_hf_dict({"hidden_size": 3.5})


def test_an_export_onto_a_symlink_writes_where_it_points(tmp_path):
    """Exporting to `latest -> v1` replaced the link with a directory: readers of v1 kept stale weights (issue
    43). The export goes to v1, atomically, and `latest` stays a link."""
    import numpy as np

    config = jm.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    jm.save_hf_model(jm.create_model(config, seed=0), tmp_path / "v1")
    (tmp_path / "latest").symlink_to(tmp_path / "v1", target_is_directory=True)
    newer = jm.create_model(config, seed=1)
    jm.save_hf_model(newer, tmp_path / "latest")
    assert (tmp_path / "latest").is_symlink() and (tmp_path / "latest").resolve() == (tmp_path / "v1").resolve()
    a, b = jm.to_hf_state_dict(newer), jm.to_hf_state_dict(jm.from_pretrained(tmp_path / "v1"))
    assert all(np.array_equal(a[k], b[k]) for k in a)
