"""LoRA through the trainer: only the adapters train (and only they have optimizer state), the base's bytes
never change, a LoRA run shards on fsdp × tp as on one device, resumes bitwise after SIGKILL and refuses
another base, DPO's reference is the base with the adapters off (no second copy), and a run converts to a
PEFT adapter directory or to the merged model, which computes what the unmerged adapters compute."""

import json
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_dpo import dpo_args, rule_pairs, rows
from test_resume_cli import run
from util import TOK, TRAIN, args, losses, mesh, params_of, tiny

import jaxloom.models as jm
from jaxloom.mesh import gather, named_leaves
from jaxloom.models.layers import Linear
from jaxloom.trainer import DPOTrainer, Trainer
from jaxloom.trainer.cli import main

LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules="all-linear")


def lora_trainer(tmp, model, mesh_=None, **kw):
    return Trainer(args(tmp, **{**LORA, **kw}), model, dataset_train=TRAIN, processing_class=TOK, mesh=mesh_ or mesh(1))


def base_bytes(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in named_leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))}


def test_a_peft_export_names_the_directory_its_base_was_read_from(tmp_path):
    """An exported adapter had `"base_model_name_or_path": null`, so PEFT's `AutoPeftModelForCausalLM` could not
    find its base (issue 51): a model read with `from_pretrained(DIR)` is recorded, and its adapter names DIR."""
    jm.save_hf_model(jm.create_model(tiny(), seed=0), tmp_path / "base")
    model = jm.from_pretrained(tmp_path / "base")
    assert jm.pretrained_source(model) == str((tmp_path / "base").absolute())
    assert jm.pretrained_source(jm.create_model(tiny(), lazy=True)) is None
    t = lora_trainer(tmp_path / "run", model, max_training_steps=1)
    t.train()
    t.save_pretrained(str(tmp_path / "adapter"), to_torch=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "base").absolute())
    assert (tmp_path / "base" / "config.json").is_file()  # where PEFT will look


def test_only_the_adapters_train_and_the_base_never_changes(tmp_path):
    model = jm.create_model(tiny(), seed=0)
    before = base_bytes(model)
    t = lora_trainer(tmp_path / "run", model, learning_rate=5e-2, max_training_steps=16, warmup_steps=0)
    out = t.train()
    curve = losses(tmp_path / "run")
    assert np.mean(curve[-3:]) < curve[0] - 0.05, curve
    trained = params_of(out.state)
    assert trained and all(k.endswith(("lora_a", "lora_b")) for k in trained)
    assert any(np.abs(v).max() > 0 for k, v in trained.items() if k.endswith("lora_b"))  # B left zero: it trained
    frozen = {k: gather(v) for k, v in named_leaves(out.state.frozen)}
    assert sorted(frozen) == sorted(before)
    for k, v in before.items():
        np.testing.assert_array_equal(frozen[k], v, err_msg=k)  # bitwise: the base never moved
    adam = sum(x.size for x in jax.tree_util.tree_leaves(out.state.opt_state))
    assert adam <= 2 * t.plan.n_trainable + 8  # mu and nu of the adapters, a count: nothing for the base
    assert t.plan.n_trainable < 0.05 * t.plan.n_params
    # what `jaxloom plan` prints: the adapters' optimizer state is a sliver of full fine-tuning's
    full = lora_trainer(tmp_path / "full", jm.create_model(tiny(), seed=0), use_peft=False).plan.state_gb_per_device()
    mine = t.plan.state_gb_per_device()
    assert mine["optimizer"] < 0.05 * full["optimizer"] and mine["frozen"] > 0 and full["frozen"] == 0
    # the checkpoint holds the adapters: resuming onto another base is refused before step 1
    other = lora_trainer(
        tmp_path / "run", jm.create_model(tiny(), seed=1), learning_rate=5e-2, warmup_steps=0, max_training_steps=18
    )
    with pytest.raises(ValueError, match="holds adapters trained on another base model"):
        other.train()


def test_a_lora_run_on_fsdp_x_tp_equals_fsdp_alone(tmp_path):
    # the same rows per data shard on both meshes (fsdp=2); tp=2 splits every weight and adapter further
    one = lora_trainer(tmp_path / "a", jm.create_model(tiny(hidden=64), seed=0), mesh_=mesh(2, fsdp=2)).train()
    four = lora_trainer(tmp_path / "b", jm.create_model(tiny(hidden=64), seed=0), mesh_=mesh(4, fsdp=2, tp=2))
    out = four.train()
    spec = out.state.params["model"]["layers"][0]["self_attn"]["q_proj"]["lora_b"].sharding.spec
    assert "tp" in str(spec)  # B follows its weight's output axis (heads → tp)
    a, b = params_of(one.state), params_of(out.state)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=2e-5, rtol=1e-4, err_msg=k)
    np.testing.assert_allclose(losses(tmp_path / "a"), losses(tmp_path / "b"), rtol=1e-5)


def test_dpo_with_lora_equals_dpo_with_the_base_as_an_explicit_reference(tmp_path):
    model = jm.create_model(tiny(), seed=0)
    jm.save_hf_model(jm.create_model(tiny(), seed=0), tmp_path / "base")
    train = rule_pairs(64, 0)
    runs = {}
    for name, ref in (("off", None), ("explicit", str(tmp_path / "base"))):
        t = DPOTrainer(
            dpo_args(tmp_path / name, ref_model=ref, **LORA),
            model=jm.create_model(tiny(), seed=0) if ref else model,
            dataset_train=train,
            processing_class=TOK,
            mesh=mesh(1),
        )
        t.train()
        runs[name] = [r["train/loss"] for r in rows(tmp_path / name) if "train/loss" in r]
        if ref is None:
            assert t.ref_state is None and t.reference.adapters_off  # no second copy of the weights
    assert runs["off"][0] == pytest.approx(np.log(2), abs=1e-6)  # step 1: the policy is the base
    np.testing.assert_allclose(runs["off"], runs["explicit"], rtol=1e-5, atol=1e-6)


def test_sigkill_then_resume_is_bitwise_and_the_run_converts_to_peft_or_merged(tmp_path, capsys):
    extra = ["use_peft=true", "lora_r=4", "lora_target_modules=all-linear", "learning_rate=1e-2", "lora_dropout=0.05"]
    short = [*extra, "max_training_steps=8"]  # a checkpoint every 4: killed after 5, resumed from 4
    ref, _, err = run(tmp_path / "ref", extra=short)
    assert ref.returncode == 0, err[-3000:]
    killed, _, _ = run(tmp_path / "run", kill_after=5, extra=short)
    assert killed.returncode == -signal.SIGKILL
    again, _, err = run(tmp_path / "run", extra=short)
    assert again.returncode == 0, err[-3000:]
    assert f"resumed from checkpoint {tmp_path / 'run'}/checkpoints/4" in err
    a, b = np.load(tmp_path / "ref" / "final.npz"), np.load(tmp_path / "run" / "final.npz")
    assert sorted(a) == sorted(b) and all(k.endswith(("lora_a", "lora_b")) for k in a)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)

    run_dir = str(tmp_path / "run")  # built as `jaxloom train` builds a run: its directory alone rebuilds it
    assert main(["convert", "--to-hf", run_dir, str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["target_modules"] == sorted(config["target_modules"])
    assert config["lora_dropout"] == 0.05  # PEFT's field, as the run trained
    assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()
    assert main(["convert", "--to-hf", run_dir, str(tmp_path / "merged"), "--merge"]) == 0
    merged = jm.from_pretrained(tmp_path / "merged")
    from jaxloom.trainer.compose import build_run

    trainer, _ = build_run(str(tmp_path / "run" / "run_config.json"), [f"save_directory={run_dir}"])
    state = trainer.restore_checkpoint(params_only=True)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, len(TOK), (2, 12)))
    np.testing.assert_allclose(state.model(ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-5)
    texts = []
    for source in (run_dir, str(tmp_path / "merged")):  # the adapters unmerged, then the merged model
        capsys.readouterr()
        assert main(["generate", source, "--prompt", "the", "--max-new-tokens", "6", "--greedy"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()

    # a PEFT adapter continues training: the run starts from its values
    cont = Trainer(
        args(tmp_path / "cont", lora_from=str(tmp_path / "peft"), max_training_steps=1),
        jm.create_model(trainer.config, seed=0),
        dataset_train=TRAIN,
        processing_class=TOK,
        mesh=mesh(1),
    )
    start = params_of(cont.model_state)
    for k, v in params_of(state).items():
        np.testing.assert_array_equal(start[k], v, err_msg=k)


def test_qlora_trains_on_a_quantized_base_and_each_adapter_setting_acts(tmp_path):
    model = jm.create_model(tiny(hidden=64), seed=0)
    for name, kw, code in (
        ("nf4", dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"), np.uint8),
        ("int8", dict(load_in_8bit=True, use_rslora=True), np.int8),
    ):
        t = lora_trainer(tmp_path / name, model, learning_rate=5e-2, max_training_steps=16, warmup_steps=0, **kw)
        out = t.train()
        curve = losses(tmp_path / name)
        assert np.mean(curve[-3:]) < curve[0] - 0.05, (name, curve)
        codes = [v for k, v in named_leaves(out.state.frozen) if k.endswith("kernel_codes")]
        assert codes and all(c.dtype == code for c in codes)  # every linear layer's base stored quantized
        assert not [k for k, _ in named_leaves(out.state.frozen) if k.endswith("proj/kernel")]
        scale = 8 / np.sqrt(4) if kw.get("use_rslora") else 8 / 4
        assert t.plan.lora.scaling == scale
    with pytest.raises(ValueError, match=r"lora_dropout = 1.0; expected a probability in \[0, 1\)"):
        args(tmp_path, **LORA, lora_dropout=1.0)
    with pytest.raises(ValueError, match="load_in_4bit = true without use_peft"):
        args(tmp_path, load_in_4bit=True)


def test_lora_dropout_drops_the_adapters_input_in_training_only(tmp_path):
    """PEFT's `lora_dropout`: inside the train step's `dropout_key` an adapted layer computes
    `x W + (mask · x / (1 - p)) A B · scaling` (the base path never dropped), outside it (evaluation, generation)
    `x W + x A B · scaling`; averaged over keys the dropped output is the undropped one. In a run (TRL's 0.05 and a
    larger rate, a scanned stack) the adapters train differently from a run without dropout, the same way twice."""
    layer = jm.LoRALinear(
        Linear(16, 8, (None, None), jm.RuntimeConfig(), rngs=nnx.Rngs(0)),
        jm.LoRAConfig(r=4, alpha=8, dropout=0.5),
        jax.random.PRNGKey(1),
        salt=7,
    )
    layer.lora_b[...] = jax.random.normal(jax.random.PRNGKey(2), layer.lora_b[...].shape)
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 16))
    plain = layer(x)
    base = x @ layer.weight()
    np.testing.assert_allclose(plain, base + x @ layer.lora_a[...] @ layer.lora_b[...] * 2.0, rtol=1e-5, atol=1e-5)
    key = jax.random.PRNGKey(4)
    with jm.dropout_key(key):
        dropped = layer(x)
    keep = jax.random.bernoulli(jax.random.fold_in(key, 7), 0.5, x.shape)
    manual = base + (jnp.where(keep, x / 0.5, 0) @ layer.lora_a[...] @ layer.lora_b[...]) * 2.0
    np.testing.assert_allclose(dropped, manual, rtol=1e-5, atol=1e-5)
    assert not np.allclose(dropped, plain)
    np.testing.assert_array_equal(layer(x), plain)  # outside the context: no dropout

    def with_key(k):
        with jm.dropout_key(k):
            return layer(x)

    mean = jnp.mean(jax.vmap(with_key)(jax.random.split(key, 4000)), axis=0)
    np.testing.assert_allclose(mean, plain, atol=0.15 * float(jnp.abs(plain - base).max()))

    def adapters(name, **kw):
        model = jm.create_model(tiny(), jm.RuntimeConfig(scan_layers=True), seed=0)
        out = lora_trainer(tmp_path / name, model, max_training_steps=3, learning_rate=5e-2, **kw).train()
        return {k: np.asarray(v) for k, v in named_leaves(out.state.params)}

    none, dropped_a, dropped_b = adapters("none"), adapters("a", lora_dropout=0.3), adapters("b", lora_dropout=0.3)
    assert sorted(none) == sorted(dropped_a) and any(not np.allclose(none[k], dropped_a[k]) for k in none)
    for k in dropped_a:  # deterministic: the mask follows the state's key, the step and the micro-batch
        np.testing.assert_array_equal(dropped_a[k], dropped_b[k], err_msg=k)
    with pytest.raises(ValueError, match="lora_dropout = 0.05 with lora_target_parameters"):
        args(tmp_path, **LORA, lora_dropout=0.05, lora_target_parameters="mlp.experts.down_proj")


def test_lora_on_the_experts_trains_on_fsdp_x_ep_as_on_fsdp_alone_and_exports_for_peft(tmp_path):
    """`lora_target_parameters` (TRL's name; PEFT's `target_parameters`) adapts a Mixtral's stacked expert weights:
    only the adapters train (the experts' own weights stay frozen), the run on fsdp × ep (each device holding half
    the experts and their adapters, the tokens moving) equals the run on fsdp alone, and the export is a PEFT adapter
    with the experts' pairs under PEFT's names."""
    from safetensors.numpy import load_file

    from jaxloom.mesh import PartitionAxis

    config = jm.MixtralConfig(
        vocab_size=len(TOK),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    experts = "mlp.experts.gate_up_proj,mlp.experts.down_proj"
    settings = {**LORA, "lora_target_modules": "q_proj", "lora_target_parameters": experts, "learning_rate": 5e-2}
    runs = {}
    for name, axes, batch_axis in (
        ("fsdp", dict(fsdp=4), ("fsdp", "dp")),
        ("ep", dict(fsdp=2, ep=2), ("fsdp", "dp", "ep")),
    ):
        runtime = jm.RuntimeConfig(moe_implementation="tiled", partition_axis=PartitionAxis(batch_axis=batch_axis))
        t = Trainer(
            args(tmp_path / name, **settings, warmup_steps=0, max_training_steps=3),
            jm.create_model(config, runtime, seed=0),
            dataset_train=TRAIN,
            processing_class=TOK,
            mesh=mesh(4, **axes),
        )
        runs[name] = (t, t.train())
    trained = params_of(runs["ep"][1].state)
    adapted = [k for k in trained if "gate_up_lora" in k or "down_lora" in k]
    assert len(adapted) == 4 * 2 and all(k.endswith(("lora_a", "lora_b")) for k in trained), sorted(trained)
    assert all(np.abs(trained[k]).max() > 0 for k in adapted if k.endswith("lora_b"))  # B left zero: it trained
    frozen = {k for k, _ in named_leaves(runs["ep"][1].state.frozen)}
    assert any(k.endswith("w_gate") for k in frozen)  # the experts' own weights are the frozen base
    np.testing.assert_allclose(losses(tmp_path / "ep"), losses(tmp_path / "fsdp"), rtol=1e-5)
    ours = params_of(runs["fsdp"][1].state)
    for k in ours:
        np.testing.assert_allclose(trained[k], ours[k], rtol=1e-4, atol=1e-5, err_msg=k)  # Adam: 1/sqrt(v)

    runs["ep"][0].save_pretrained(str(tmp_path / "adapter"), to_torch=True)
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["target_parameters"] == sorted(experts.split(","))
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    inner = tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"]  # gate_up: [r·E, D]
    outer = tensors["base_model.model.model.layers.1.mlp.experts.lora_B.weight"]  # down: [D, r·E]
    assert inner.shape == (4 * 4, 32) and outer.shape == (32, 4 * 4)
