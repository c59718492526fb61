"""Every `TrainingArguments` field changes behaviour: set to a non-default value, something a user can
observe differs from the default's. Cheap fields are probed here (the optimizer's updates; what setup
builds: mesh, model runtime, state, batches, schedules); fields whose effect needs a whole run are checked
by the named tests, which set them and assert their effect (this file checks that those tests exist)."""

import ast
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from util import EVAL, TOK, TRAIN, args, mesh, tiny

import jaxloom.models as jm
from jaxloom.trainer import Trainer, TrainingArguments, make_optimizer

# ---- the optimizer group: three updates of a fixed problem, and the schedule ------------------------------
OPTIMIZER = {
    "learning_rate": 1e-2,
    "optimizer": "sgd",
    "scheduler": "linear",
    "warmup_steps": 3,
    "warmup_ratio": 0.5,
    "init_learning_rate": 1e-4,
    "end_learning_rate": 1e-4,
    "weight_decay": 0.1,
    "decay_norms_and_biases": True,
    "max_grad_norm": 1e-3,
    "adam_beta1": 0.5,
    "adam_beta2": 0.5,
    "adam_epsilon": 1.0,
    "momentum": 0.9,
}
BASE_OPT = {"warmup_steps": 1}  # so that warmup_ratio / init_learning_rate have something to change


def _updates(**changes) -> np.ndarray:
    base = {**BASE_OPT, **changes}
    if "warmup_ratio" in changes:
        base["warmup_steps"] = None
    if changes.get("momentum") or "max_grad_norm" in changes:
        base["optimizer"] = "sgd"  # momentum belongs to SGD; Adam's updates do not see a gradient's scale
    a = TrainingArguments(**base)
    tx, schedule = make_optimizer(a.optim, total_steps=10)
    params = {"w": jnp.linspace(-1.0, 1.0, 8), "input_layernorm": {"weight": jnp.linspace(0.5, 1.5, 4)}}
    state = tx.init(params)
    trace = []
    for i in range(3):
        grads = jax.tree_util.tree_map(lambda p, k=i + 1: jnp.sin(p * k) + 0.5, params)
        updates, state = tx.update(grads, state, params)
        params = jax.tree_util.tree_map(lambda p, u: p + u, params, updates)
        trace.append(np.concatenate([np.asarray(x) for x in jax.tree_util.tree_leaves(params)]))
    return np.concatenate([*trace, [float(schedule(s)) for s in range(10)]])


@pytest.mark.parametrize("name", sorted(OPTIMIZER))
def test_optimizer_field_changes_the_updates(name):
    base = {"optimizer": "sgd"} if name in ("momentum", "max_grad_norm") else {}
    if name == "decay_norms_and_biases":  # only with a weight decay to apply
        base = {"weight_decay": 0.1}
    default = _updates(**base)
    changed = _updates(**{**base, name: OPTIMIZER[name]})
    assert not np.allclose(default, changed), name


# ---- what setup builds ----------------------------------------------------------------------------------
def _setup(tmp_path, **kw):
    t = Trainer(args(tmp_path, **kw), jm.create_model(tiny(), lazy=True), dataset_train=TRAIN, processing_class=TOK)
    assert t.plan is not None  # everything abstract, nothing allocated
    return t


SETUP = {
    # name: (value, what to read from a planned trainer)
    "max_training_steps": (3, lambda t: t.total_steps),
    "num_train_epochs": (2, lambda t: t.total_steps),  # with max_training_steps=None
    "dtype": ("bfloat16", lambda t: t.runtime.dtype),
    "param_dtype": ("bfloat16", lambda t: jax.tree_util.tree_leaves(t.plan.abstract.params)[0].dtype),
    "attn_mechanism": ("chunked", lambda t: t.runtime.attn_mechanism),
    "attn_block_size": (8, lambda t: t.runtime.attn_block_size),
    "attn_max_documents": (8, lambda t: t.runtime.attn_max_documents),  # what it does on a GPU: models' test
    "remat": ("full", lambda t: t.runtime.remat),
    "scan_layers": (True, lambda t: "layers" in t.plan.abstract.params["model"] and _stacked(t)),
    "moe_implementation": ("dense", lambda t: t.runtime.moe_implementation),
    "scan_unroll": (1, lambda t: t.runtime.unroll(t.config.num_hidden_layers)),  # its program: models' test
    "batch_axis": (("fsdp", "dp", "ep"), lambda t: (t.data_axes, t.runtime.partition_axis.batch_axis)),
    "sharding_axis_dims": ((2, -1, 1, 1, 1), lambda t: dict(t.mesh.shape)),
    "sharding_axis_names": (("dp", "fsdp", "ep", "mp", "sp"), lambda t: tuple(t.mesh.shape)),
    "save_directory": ("elsewhere", lambda t: Path(t.checkpoints.directory).parent.name),
    "checkpoint_directory": ("ckpts", lambda t: Path(t.checkpoints.directory).name),
    "checkpoint_format": ("raw", lambda t: t.checkpoints.config.array_format),
}


def _stacked(t):
    leaves = jax.tree_util.tree_leaves(t.plan.abstract.params["model"]["layers"])
    return leaves[0].shape[0] == t.config.num_hidden_layers


@pytest.mark.parametrize("name", sorted(SETUP))
def test_setup_field_changes_what_setup_builds(tmp_path, name):
    value, read = SETUP[name]
    base = {"max_training_steps": None} if name == "num_train_epochs" else {}
    if name in ("save_directory", "checkpoint_directory"):
        value = str(tmp_path / value)
    default = read(_setup(tmp_path / "a", **base))
    changed = read(_setup(tmp_path / "b", **{**base, name: value}))
    assert default != changed, (name, default, changed)


def _first_batches(tmp_path, **kw):
    t = Trainer(
        args(tmp_path, **kw),
        jm.create_model(tiny(), lazy=True),
        dataset_train=TRAIN,
        dataset_eval=EVAL,
        processing_class=TOK,
        mesh=mesh(1),
    )
    t.configure_dataloaders()
    return {**next(t.train_loader), "eval_input_ids": next(iter(t.batches.eval_loader()))["input_ids"]}


DATA = {
    "total_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "max_sequence_length": 16,
    "truncation_mode": "keep_start",
    "packing": False,
    "shuffle_train_dataset": False,
    "shuffle_buffer_size": 4,  # shuffled in blocks of 4 records instead of all at once
    "seed": 7,  # the shuffle order
    "evaluation_batch_size": 2,
}


@pytest.mark.parametrize("name", sorted(DATA))
def test_data_field_changes_the_batches(tmp_path, name):
    base = {"packing": False} if name == "truncation_mode" else {}  # truncation shows on unpacked rows
    key = "eval_input_ids" if name.startswith("evaluation") else "input_ids"
    default = _first_batches(tmp_path / "a", **base)[key]
    changed = _first_batches(tmp_path / "b", **{**base, name: DATA[name]})[key]
    assert default.shape != changed.shape or not np.array_equal(default, changed), name


# ---- fields whose effect is a run's behaviour: short runs, each against a baseline run --------------------
def _run(tmp_path, hooks=None, **kw):
    from util import trainer

    base = dict(max_training_steps=4, save_steps=2, generation_interval=2, generation_prompts=("The",))
    t = trainer(tmp_path, hooks=hooks, **{**base, **kw})
    out = t.train()
    t.finish()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return t, out, rows


def _saved(tmp_path) -> list[int]:
    return sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())


def _events(tmp_path) -> bytes:
    return b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").rglob("*tfevents*"))


def test_run_level_fields_against_a_baseline_run(tmp_path):
    a, out_a, rows_a = _run(tmp_path / "a", use_tensorboard=True)
    b, out_b, rows_b = _run(
        tmp_path / "b",
        use_tensorboard=True,
        save_total_limit=1,
        z_loss=0.1,
        peak_flops_per_device=1e12,
        log_weight_distribution=True,
        generation_max_new_tokens=3,
        generation_num_samples=2,
        generation_temperature=1.0,
        progress_bar=True,
        plot_loss=True,
    )
    assert type(a.pbar).__name__ == "NoBar" and type(b.pbar).__name__ != "NoBar"  # progress_bar
    assert (tmp_path / "b" / "loss.png").is_file() and not (tmp_path / "a" / "loss.png").exists()  # plot_loss
    assert _saved(tmp_path / "a") == [2, 4] and _saved(tmp_path / "b") == [4]  # save_total_limit
    loss = lambda rows: next(r["train/loss"] for r in rows if r["step"] == 1)  # noqa: E731
    assert loss(rows_b) > loss(rows_a)  # z_loss: the same first batch and parameters, plus the penalty
    assert any("train/mfu" in r for r in rows_b) and not any("train/mfu" in r for r in rows_a)  # peak_flops
    assert b"weights/" in _events(tmp_path / "b") and b"weights/" not in _events(tmp_path / "a")
    assert len(out_a.samples) == 1 and len(out_b.samples) == 2  # generation_num_samples
    n_tokens = [len(TOK(s, add_special_tokens=False)["input_ids"]) for s in out_b.samples]
    # max_new_tokens: 3 tokens, decoded then encoded again (which may split them further), against the default's
    assert max(n_tokens) <= 2 * 3 < len(TOK(out_a.samples[0], add_special_tokens=False)["input_ids"])
    greedy = out_a.samples[0][: len(out_b.samples[0])]
    assert len(set(out_b.samples)) == 2 or out_b.samples[0] != greedy  # temperature: sampled, not greedy


def test_run_level_fields_second_set(tmp_path, monkeypatch):
    import sys
    import types

    inits, logged = [], []
    fake = types.ModuleType("wandb")  # stands in for wandb (an optional extra): records what it is given
    fake.init = lambda **kw: (
        inits.append(kw) or types.SimpleNamespace(log=lambda row, step: logged.append(step), finish=lambda: None)
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    base_t, _, _ = _run(tmp_path / "a", max_training_steps=3, save_steps=None, generation_interval=None)
    assert _saved(tmp_path / "a") == [3] and inits == [] and not (tmp_path / "a" / "tensorboard").exists()
    t, _, _ = _run(
        tmp_path / "b",
        max_training_steps=3,
        save_steps=None,
        save_minutes=1e-9,  # due after every step
        generation_interval=None,
        use_wandb=True,
        wandb_project="my-project",
        hooks=[_Poison()],
        nan_policy="skip",  # the poisoned step is skipped, the run goes on (the default stops: test_training)
    )
    assert _saved(tmp_path / "b") == [1, 2, 3]  # save_minutes
    assert inits and inits[0]["project"] == "my-project" and logged  # use_wandb, wandb_project
    assert int(t.state.step) == 3
    # resume_if_possible=false: a directory with checkpoints is an error (the default resumes); with
    # overwrite_output_dir the run starts over there
    _, resumed, _ = _run(tmp_path / "a", max_training_steps=4, save_steps=None, generation_interval=None)
    assert resumed.resumed_from is not None
    once = dict(max_training_steps=4, save_steps=None, generation_interval=None, resume_if_possible=False)
    with pytest.raises(ValueError, match=r"holds checkpoints \[3, 4\] of an earlier run and resume_if_possible=false"):
        _run(tmp_path / "a", **once)
    _, fresh, _ = _run(tmp_path / "a", **once, overwrite_output_dir=True)
    assert fresh.resumed_from is None and _saved(tmp_path / "a") == [4]


class _Poison:
    """NaN gradients at step 2 only (the parameters are restored after)."""

    def on_step_start(self, run, step):
        if step == 2:
            self.keep = run.state.params
            run.state = run.state.replace(params=jax.tree_util.tree_map(lambda p: p * jnp.nan, self.keep))

    def on_step_end(self, run, step, metrics):
        if step == 2:
            run.state = run.state.replace(params=self.keep)


# ---- the rest: fields whose effect the named tests check, each setting the field itself ------------------
HERE = Path(__file__).parent
RUN_LEVEL = {
    **{
        name: "test_lm_eval.py::test_eval_tasks_during_training_on_their_cadence_and_a_killed_evaluation_is_redone"
        for name in ("eval_tasks", "eval_tasks_steps", "eval_tasks_limit", "eval_tasks_num_fewshot")
    },
    "eval_tasks_include_path": (
        "test_lm_eval.py::test_eval_tasks_during_training_on_their_cadence_and_a_killed_evaluation_is_redone"
    ),
    "evaluation_steps": "test_training.py::test_eval_loss_falls_on_the_corpus",
    "eval_batches": "test_reference_base_trainer.py::test_base_trainer_members_in_the_reference_order",
    "logging_steps": "test_training.py::test_eval_loss_falls_on_the_corpus",
    "training_time_limit": "test_training.py::test_time_limit_saves_and_stops",
    "async_checkpointing": (
        "../../../tests/reliability/test_faults.py::"
        "test_full_disk_during_a_save_is_a_clear_error_and_keeps_earlier_checkpoints"
    ),
    "donate_state": "test_training.py::test_state_is_donated_to_the_step_except_on_cpu_unless_asked",
    "compilation_cache_dir": "test_compile_cache.py::test_second_run_loads_compiled_programs",
    # one process: DCN dims are ignored (nothing crosses hosts); with many, the mesh multiplies them
    "sharding_dcn_axis_dims": "../../mesh/tests/test_config.py::test_dcn_dims_multiply_per_axis",
    "profile_steps": "test_training.py::test_profiler_trace_of_chosen_steps",
    "loss_block_size": "test_training.py::test_fused_loss_blocks_train_as_the_whole_logits_do_without_holding_them",
    "generation_interval": "test_training.py::test_eval_loss_falls_on_the_corpus",
    "skip_bad_records": "test_training.py::test_a_bad_record_stops_once_naming_it_or_is_skipped_and_counted",
    "generation_prompts": "test_training.py::test_eval_loss_falls_on_the_corpus",
    **{
        name: "test_lora.py::test_qlora_trains_on_a_quantized_base_and_each_adapter_setting_acts"
        for name in ("load_in_4bit", "bnb_4bit_quant_type", "load_in_8bit", "use_rslora")
    },
    "lora_dropout": "test_lora.py::test_lora_dropout_drops_the_adapters_input_in_training_only",
    **{
        name: "test_lora.py::test_only_the_adapters_train_and_the_base_never_changes"
        for name in ("use_peft", "lora_r", "lora_alpha", "lora_target_modules")
    },
    "lora_from": "test_lora.py::test_sigkill_then_resume_is_bitwise_and_the_run_converts_to_peft_or_merged",
    "lora_target_parameters": (
        "test_lora.py::test_lora_on_the_experts_trains_on_fsdp_x_ep_as_on_fsdp_alone_and_exports_for_peft"
    ),
    "storage_endpoint_url": "test_resume_cli.py::test_run_directory_on_a_store_sigkill_then_resume_ends_bitwise_equal",
    "storage_retry_seconds": (
        "../../../tests/reliability/test_store_faults.py::"
        "test_a_store_gone_for_good_stops_the_run_with_one_error_and_a_rerun_resumes"
    ),
    "storage_lease_seconds": (
        "../../../tests/reliability/test_store_faults.py::"
        "test_a_run_paused_past_its_lease_stops_before_writing_and_the_run_that_took_over_is_intact"
    ),
    "router_bias_update_rate": "test_training.py::test_router_bias_update_rate_takes_effect_in_a_run",
    "fp8": "test_fp8.py::test_an_fp8_run_trains_as_the_unquantized_one_and_its_checkpoint_restores_either_way",
    **{
        name: "test_trl_keys.py::test_the_loss_mask_keys_train_on_what_trl_trains_on"
        for name in ("completion_only_loss", "assistant_only_loss")
    },
    "max_images_per_row": "test_vlm_sft.py::test_bad_image_records_are_one_error_before_step_1",
    "lora_exclude_modules": (
        "test_vlm_sft.py::test_lora_on_images_adapts_the_language_model_unless_lora_exclude_modules_says_otherwise"
    ),
    "overwrite_output_dir": (
        "../../../tests/reliability/test_run_directory.py::test_an_earlier_run_is_never_replaced_silently"
    ),
}
RUNS = {
    "save_total_limit", "z_loss", "peak_flops_per_device", "log_weight_distribution", "generation_max_new_tokens",
    "generation_num_samples", "generation_temperature", "save_minutes", "use_wandb", "wandb_project", "nan_policy",
    "use_tensorboard", "save_steps", "progress_bar", "resume_if_possible", "plot_loss",
}  # fmt: skip


def test_every_field_has_an_effect_test():
    covered = set(OPTIMIZER) | set(SETUP) | set(DATA) | set(RUN_LEVEL) | RUNS
    fields = {r["name"] for r in TrainingArguments.fields()}
    assert fields - covered == set(), "fields with no effect test"
    assert covered - fields == set(), "effect tests for fields that do not exist"


@pytest.mark.parametrize("name", sorted(RUN_LEVEL))
def test_run_level_field_is_set_by_the_named_test(name):
    """The named test exists, and its file sets the field (a keyword `name=`, a dict key, or `name=value`
    on a command line; the mesh's own field name for the DCN dims)."""
    file, func = RUN_LEVEL[name].split("::")
    tree = ast.parse((HERE / file).read_text())
    assert any(isinstance(n, ast.FunctionDef) and n.name == func for n in ast.walk(tree)), RUN_LEVEL[name]
    keywords = {k.arg for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords}
    keys = {c.value for n in ast.walk(tree) if isinstance(n, ast.Dict) for c in n.keys if isinstance(c, ast.Constant)}
    strings = [c.value for c in ast.walk(tree) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    wanted = "dcn_axis_dims" if name == "sharding_dcn_axis_dims" else name
    in_code = any(f"{wanted}=" in text for text in strings)  # `key=value` overrides, or code run in a subprocess
    assert wanted in keywords | keys or in_code, f"{RUN_LEVEL[name]} does not set {name}"


@pytest.mark.parametrize("optimizer", ["adamw", "lion", "adafactor", "sgd"])
def test_weight_decay_skips_biases_and_norm_weights_as_hf_trainer(optimizer):
    """HF Trainer's convention: no decay on biases and norm weights (`*norm`, `*layernorm`); every other weight
    decays. With zero gradients and lr 1, only the decay moves a weight."""
    a = TrainingArguments(
        optimizer=optimizer,
        learning_rate=1.0,
        weight_decay=0.1,
        warmup_steps=0,
        max_grad_norm=None,
        scheduler="constant",
    )
    tx, _ = make_optimizer(a.optim, total_steps=10)
    params = {
        "model": {
            "norm": {"weight": jnp.ones(4)},
            "layers": {"q_proj": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}, "q_norm": {"weight": jnp.ones(4)}},
            "embed_tokens": {"embedding": jnp.ones((8, 4))},
        }
    }
    updates, _ = tx.update(jax.tree_util.tree_map(jnp.zeros_like, params), tx.init(params), params)
    moved = {
        "/".join(str(k.key) for k in path): bool(jnp.any(u != 0))
        for path, u in jax.tree_util.tree_leaves_with_path(updates)
    }
    assert moved == {
        "model/norm/weight": False,
        "model/layers/q_proj/kernel": True,
        "model/layers/q_proj/bias": False,
        "model/layers/q_norm/weight": False,
        "model/embed_tokens/embedding": True,
    }, moved


def test_warmup_ratio_is_rounded_up_as_hf():
    """HF's `get_warmup_steps` is `ceil(ratio * steps)`: 0.15 of 10 steps is 2 warmup steps, not 1."""
    a = TrainingArguments(learning_rate=1.0, warmup_ratio=0.15, scheduler="constant")
    _, schedule = make_optimizer(a.optim, total_steps=10)
    assert float(schedule(1)) == pytest.approx(0.5) and float(schedule(2)) == pytest.approx(1.0)
