"""LoRA and QLoRA against PEFT itself: adapters written here load in `peft.PeftModel` with the same logits,
adapters made by PEFT load here with the same logits, a merged export loads in transformers alone; the
quantized base stays within a measured error of the model it was made from."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_util import batch, hf_logits, make_hf

import jaxloom.models as jm

torch = pytest.importorskip("torch")
if os.environ.get("NOX_CURRENT_SESSION"):  # `nox -s tests` installs peft beside the CPU torch: never skipped there
    import peft
else:
    peft = pytest.importorskip("peft")


def _ours(model, ids, mask, positions):
    return np.asarray(
        model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), positions=jnp.asarray(positions)).logits
    )


def _randomize_adapters(model, seed=1):
    """B is zero at init (the adapters add nothing): draw both, so the test sees them act."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 1000))
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and path[-1] in ("lora_a", "lora_b"):
            var.set_value(0.2 * jax.random.normal(next(keys), var.get_value().shape))


@pytest.mark.parametrize(
    "family, targets, scan",
    [
        ("llama", "all-linear", True),
        ("llama", ("q_proj", "v_proj", "down_proj"), False),
        ("mixtral", ("q_proj", "v_proj"), False),
    ],
)
def test_adapters_written_here_load_in_peft_with_the_same_logits(tmp_path, family, targets, scan):
    hf = make_hf(family, tmp_path / "base")
    model = jm.from_pretrained(tmp_path / "base", jm.RuntimeConfig(scan_layers=scan))
    jm.apply_lora(model, jm.LoRAConfig(r=4, alpha=8, target_modules=targets, use_rslora=not scan))
    _randomize_adapters(model)
    jm.save_peft_adapter(model, tmp_path / "adapter", base=str(tmp_path / "base"))
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 8 and written["peft_type"] == "LORA"
    ids, mask, positions = batch("right")
    plain = hf_logits(hf, ids, mask, positions)
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()  # adapts `hf` in place
    want = hf_logits(peft_model, ids, mask, positions)
    got = _ours(model, ids, mask, positions)
    assert np.abs((want - plain) * mask[..., None]).max() > 1e-2  # the adapters act
    np.testing.assert_allclose(got * mask[..., None], want * mask[..., None], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_adapters_made_by_peft_load_here_and_merge_for_transformers(tmp_path, family):
    import transformers

    hf = make_hf(family, tmp_path / "base")
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "o_proj"], init_lora_weights=False)
    peft_model = peft.get_peft_model(hf, config).eval()  # init_lora_weights=False: B is drawn, not zero
    peft_model.save_pretrained(tmp_path / "adapter")
    ids, mask, positions = batch("left")
    want = hf_logits(peft_model, ids, mask, positions)

    base = jm.from_pretrained(tmp_path / "base", jm.RuntimeConfig(scan_layers=True))
    jm.apply_lora(base, jm.read_peft_config(tmp_path / "adapter"))
    jm.load_peft_weights(base, tmp_path / "adapter")
    got = _ours(base, ids, mask, positions)
    np.testing.assert_allclose(got * mask[..., None], want * mask[..., None], atol=1e-5, rtol=1e-5)

    merged = jm.merge_lora(base)
    jm.save_hf_model(merged, tmp_path / "merged")
    alone = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(
        hf_logits(alone, ids, mask, positions) * mask[..., None], want * mask[..., None], atol=1e-5, rtol=1e-5
    )


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize(
    "family, scan, params",
    [
        ("mixtral", True, EXPERTS),
        ("gpt_oss", False, EXPERTS),
        ("deepseek_v3", False, ["down_proj"]),
        ("qwen3_moe", False, ["experts.gate_up_proj"]),
    ],
)
def test_adapters_on_the_experts_interchange_with_peft_target_parameters(tmp_path, family, scan, params):
    """PEFT's `target_parameters` (its `ParamWrapper`: one low-rank pair per expert on transformers' stacked
    `gate_up_proj` / `down_proj`): written here, PEFT's model gives our logits; drawn by PEFT, they load here
    with its logits, train alone, and merge into a model transformers loads with the same logits."""
    import transformers

    hf = make_hf(family, tmp_path / "base")
    ids, mask, positions = batch("right")
    plain = hf_logits(hf, ids, mask, positions)
    model = jm.from_pretrained(tmp_path / "base", jm.RuntimeConfig(scan_layers=scan))
    jm.apply_lora(model, jm.LoRAConfig(r=2, alpha=4, target_modules=("o_proj",), target_parameters=params))
    _randomize_adapters(model)
    for path, var in nnx.iter_graph(model):  # o_proj's adapters added nothing: what moves the logits is the experts'
        if isinstance(var, nnx.Param) and path[-2:] == ("o_proj", "lora_b"):
            var.set_value(jnp.zeros_like(var.get_value()))
    jm.save_peft_adapter(model, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert written["target_parameters"] == sorted(params)
    mine = peft.PeftModel.from_pretrained(hf, str(tmp_path / "ours")).eval()
    want = hf_logits(mine, ids, mask, positions)
    got = _ours(model, ids, mask, positions)
    np.testing.assert_allclose(got * mask[..., None], want * mask[..., None], atol=2e-5, rtol=2e-5)
    assert np.abs((want - plain) * mask[..., None]).max() > 1e-2  # the experts' adapters act, in PEFT as here

    hf = make_hf(family, tmp_path / "base")  # a fresh transformers model; PEFT draws B too (init_lora_weights=False)
    config = peft.LoraConfig(
        r=2, lora_alpha=8, target_modules=["o_proj"], target_parameters=params, init_lora_weights=False
    )
    theirs = peft.get_peft_model(hf, config).eval()
    theirs.save_pretrained(tmp_path / "theirs")
    want = hf_logits(theirs, ids, mask, positions)
    base = jm.from_pretrained(tmp_path / "base", jm.RuntimeConfig(scan_layers=scan))
    read = jm.read_peft_config(tmp_path / "theirs")
    assert read.target_parameters == tuple(sorted(params))
    jm.apply_lora(base, read)
    jm.load_peft_weights(base, tmp_path / "theirs")
    got = _ours(base, ids, mask, positions)
    np.testing.assert_allclose(got * mask[..., None], want * mask[..., None], atol=2e-5, rtol=2e-5)
    trained = {"/".join(map(str, p)) for p, v in nnx.iter_graph(base) if isinstance(v, nnx.Param)}
    assert trained and all("lora_" in p for p in trained), sorted(trained)[:5]  # the experts' base weights frozen
    assert any("experts" in p or "down_lora" in p or "gate_up_lora" in p for p in trained)

    merged = jm.merge_lora(base)
    jm.save_hf_model(merged, tmp_path / "merged")
    alone = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(
        hf_logits(alone, ids, mask, positions) * mask[..., None], want * mask[..., None], atol=2e-5, rtol=2e-5
    )


def test_expert_targets_are_checked_by_name():
    """A name that selects no stacked expert weight, or a model without experts, is one error naming what exists."""
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    moe = jm.create_model(jm.MixtralConfig(**small, num_key_value_heads=2, num_local_experts=4))
    with pytest.raises(ValueError, match=r"no such parameter.*model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        jm.apply_lora(moe, jm.LoRAConfig(target_parameters=("mlp.experts.up_proj",)))
    dense = jm.create_model(jm.LlamaConfig(**small, num_key_value_heads=2))
    with pytest.raises(ValueError, match="has no stacked expert weights"):
        jm.apply_lora(dense, jm.LoRAConfig(target_parameters=("gate_up_proj",)))


def test_an_adapter_for_another_base_or_module_is_refused_by_name(tmp_path):
    small = jm.create_model(
        jm.LlamaConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(ValueError, match=r"no such linear layer; its linear layers are \['down_proj', 'gate_proj'"):
        jm.apply_lora(small, jm.LoRAConfig(target_modules=("q_proj", "qkv")))
    with pytest.raises(ValueError, match="lora_r = 0; expected a positive integer"):
        jm.LoRAConfig(r=0)
    with pytest.raises(ValueError, match="lm_head, the output layer"):
        jm.apply_lora(small, jm.LoRAConfig(target_modules=("lm_head",)))
    make_hf("llama", tmp_path / "base")
    other = jm.from_pretrained(tmp_path / "base")  # hidden 64: the adapter below was made for hidden 32
    jm.apply_lora(small, jm.LoRAConfig(r=4))
    jm.save_peft_adapter(small, tmp_path / "adapter")
    jm.apply_lora(other, jm.read_peft_config(tmp_path / "adapter"))
    with pytest.raises(
        ValueError, match=r"lora_A of model.layers.0.self_attn.q_proj has shape \(32, 4\).*another base"
    ):
        jm.load_peft_weights(other, tmp_path / "adapter")


def test_quantized_base_stays_within_its_measured_error_and_shrinks():
    """Measured on this tiny Llama (hidden 128, seed 3): the logits of the int8 base differ from the
    bf16-parameter model's by at most 0.53 % of their range, NF4's by 7.8 % (bounds 1 % and 10 %); the quantized
    kernels take 0.514 (int8, a float32 scale per column) and 0.281 (NF4, a float32 absmax per 64) of their
    bf16 bytes."""
    config = jm.LlamaConfig(
        vocab_size=97,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 16)))
    ref = jm.create_model(config, jm.RuntimeConfig(param_dtype="bfloat16"), seed=3)
    want = np.asarray(ref(ids).logits, np.float32)
    span = want.max() - want.min()
    for kind, bound, ratio in (("int8", 0.01, 0.52), ("nf4", 0.1, 0.3)):
        model = jm.create_model(config, jm.RuntimeConfig(param_dtype="bfloat16"), seed=3)
        jm.apply_lora(model, jm.LoRAConfig(r=4, target_modules="all-linear", quantize=kind))
        got = np.asarray(model(ids).logits, np.float32)
        err = np.abs(got - want).max() / span
        assert 0 < err < bound, (kind, err)
        frozen = nnx.to_pure_dict(nnx.state(model, jm.Frozen))
        q = sum(
            x.nbytes for p, x in jax.tree_util.tree_leaves_with_path(frozen) if "kernel_" in jax.tree_util.keystr(p)
        )
        bf16 = sum(
            2 * np.prod(x.shape)
            for p, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(ref, nnx.Param)))
            if "kernel" in jax.tree_util.keystr(p) and "lm_head" not in jax.tree_util.keystr(p)
        )
        assert q / bf16 <= ratio, (kind, q / bf16)
        merged = jm.merge_lora(model)  # the dequantized base (+ the zero adapters): the same function
        np.testing.assert_allclose(np.asarray(merged(ids).logits, np.float32), got, atol=2e-2 * span)
    with pytest.raises(ValueError, match="not a multiple of the NF4 block size 64"):
        odd = jm.create_model(config.replace(hidden_size=96, intermediate_size=96), seed=0)
        jm.apply_lora(odd, jm.LoRAConfig(quantize="nf4"))
