import numpy as np
import pytest

from jaxloom.trainer import TrainingArguments, get_lr_schedule_fn


def test_flat_names_live_in_groups():
    a = TrainingArguments(
        learning_rate=1e-4,
        total_batch_size=8,
        gradient_accumulation_steps=4,
        max_training_steps=100,
        save_directory="out",
        resume_if_possible=True,
    )
    assert a.learning_rate == a.optim.learning_rate == 1e-4
    assert a.loop.total_batch_size == 8 and a.training_batch_size == 32
    assert a.checkpoint.save_directory == "out"
    assert a.replace(learning_rate=2e-4).learning_rate == 2e-4 and a.learning_rate == 1e-4
    assert "learning_rate=0.0001" in repr(a)
    with pytest.raises(AttributeError, match="frozen"):
        a.learning_rate = 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(learnig_rate=1e-3), r"unknown training argument\(s\): 'learnig_rate' \(did you mean 'learning_rate'\?\)"),
        (dict(learning_rate=-1e-3), r"learning_rate = -0.001; expected a non-negative finite number"),
        (dict(learning_rate=float("inf")), r"learning_rate = inf; expected a non-negative finite number"),
        (dict(total_batch_size=0), r"total_batch_size = 0; expected a positive finite number"),
        (dict(total_batch_size=1.5), r"total_batch_size = 1.5; expected a valid integer"),
        (dict(max_training_steps="3.5"), r"max_training_steps = '3.5'; expected a valid integer"),
        (dict(optimizer="adam9"), r"optimizer = 'adam9'; expected 'adamw', 'adafactor', 'lion' or 'sgd'"),
        (dict(scheduler="step"), r"scheduler = 'step'; expected 'linear', 'cosine' or 'constant'"),
        (dict(nan_policy="ignore"), r"nan_policy = 'ignore'"),
        (dict(warmup_ratio=1.5), r"warmup_ratio 1.5; expected a value in \[0, 1\)"),
        (dict(adam_beta2=1.0), r"adam_beta2 = 1.0; expected a value in \[0, 1\)"),
        (dict(seed=2**40), r"seed = 1099511627776; expected an integer in \[0, 2\*\*32\)"),
        (dict(save_directory=""), r"save_directory = ''; expected a directory path"),
        (dict(use_wandb="maybe"), r"use_wandb = 'maybe'; expected a valid boolean"),
        (dict(generation_prompts="hi"), r"generation_prompts = 'hi'; expected a valid tuple"),
        (dict(generation_max_new_tokens=-3), r"generation_max_new_tokens = -3; expected a positive"),
        (dict(generation_num_samples=0), r"generation_num_samples = 0; expected a positive"),
        (dict(profile_steps=[5, 2]), r"profile_steps \[5, 2\]; expected \[first, last\]"),
        (dict(sharding_axis_dims=[1, -1]), r"sharding_axis_dims \(1, -1\) and sharding_axis_names"),
        (dict(dtype="float33"), r"'float33' is not a dtype"),
        (dict(remat="sometimes"), r"remat = 'sometimes'; expected one of"),
        (dict(batch_axis=["fsdp", "exp"]), r"batch_axis \('fsdp', 'exp'\); expected distinct names of mesh axes"),
        (dict(batch_axis=[]), r"batch_axis \(\); expected distinct names of mesh axes"),
    ],
)
def test_bad_arguments_are_clear(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainingArguments(**kwargs)


def test_values_are_parsed_by_the_schema_types():
    import inspect
    from pathlib import Path

    import jax.numpy as jnp

    from jaxloom.models import AttentionMechanisms

    a = TrainingArguments(learning_rate="1e-5", max_training_steps="20", use_wandb="false", save_directory=Path("r"))
    assert (a.learning_rate, a.max_training_steps, a.use_wandb, a.save_directory) == (1e-5, 20, False, "r")
    b = TrainingArguments(
        dtype=jnp.bfloat16, attn_mechanism=AttentionMechanisms.CHUNKED, sharding_axis_dims=[1, -1, 1, 1, 1]
    )
    assert (b.dtype, b.attn_mechanism, b.sharding_axis_dims) == ("bfloat16", "chunked", (1, -1, 1, 1, 1))
    params = inspect.signature(TrainingArguments).parameters  # help() and IDEs see every argument
    assert params["learning_rate"].default == 3e-4 and params["max_training_steps"].annotation == int | None
    rows = {r["name"]: r for r in TrainingArguments.fields()}
    assert set(rows) == set(TrainingArguments().to_dict()) and rows["seed"]["group"] == "loop"


def test_files_and_overrides(tmp_path):
    (tmp_path / "a.yaml").write_text("learning_rate: 0.001\nmax_training_steps: 10\nsave_directory: x\n")
    a = TrainingArguments.from_file(tmp_path / "a.yaml", ["max_training_steps=20", "use_wandb=false"])
    assert (a.learning_rate, a.max_training_steps, a.use_wandb) == (0.001, 20, False)
    (tmp_path / "b.yaml").write_text("learning_rate: [1, 2\n")
    with pytest.raises(ValueError, match=r"b.yaml: malformed YAML at line 2"):
        TrainingArguments.from_file(tmp_path / "b.yaml")
    (tmp_path / "c.yaml").write_text("!!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ValueError, match="malformed YAML"):  # safe_load: no Python objects from configs
        TrainingArguments.from_file(tmp_path / "c.yaml")
    with pytest.raises(ValueError, match="expected key=value"):
        TrainingArguments.from_file(tmp_path / "a.yaml", ["max_training_steps"])
    with pytest.raises(FileNotFoundError, match="nope.yaml does not exist"):
        TrainingArguments.from_file(tmp_path / "nope.yaml")


def test_lr_schedules():
    f = get_lr_schedule_fn(
        learning_rate=1.0,
        schedule_type="linear",
        warmup_steps=10,
        init_learning_rate=0.0,
        end_learning_rate=0.1,
        total_steps=110,
    )
    assert float(f(0)) == 0.0 and float(f(5)) == pytest.approx(0.5) and float(f(10)) == pytest.approx(1.0)
    assert float(f(110)) == pytest.approx(0.1)
    c = get_lr_schedule_fn(100, 2, 1, 1.0, "cosine", warmup_ratio=0.1)  # RedCo's positional form: 50 steps
    assert float(c(5)) == pytest.approx(1.0) and float(c(50)) == pytest.approx(0.0, abs=1e-6)
    assert np.all(np.diff([float(c(i)) for i in range(5, 50)]) <= 1e-7)
    constant = get_lr_schedule_fn(learning_rate=0.3, schedule_type="constant", total_steps=5)
    assert float(constant(4)) == pytest.approx(0.3)


def test_every_argument_has_its_help_text_on_its_field():
    """The help `jaxloom config keys` prints sits on each field (one place), for every group and DPO's too."""
    from jaxloom.trainer import DPOConfig

    for f in DPOConfig.fields():
        assert f["doc"].strip(), f"{f['group']}.{f['name']} has no description on its field"
        group = DPOConfig.GROUPS[f["group"]]
        assert group.model_fields[f["name"]].description == f["doc"]


def test_other_frameworks_names_are_understood_or_refused_with_the_name_to_use():
    """The names EasyDeL's Ray guide and HF/TRL users write: same meaning → accepted; another meaning →
    refused naming jaxloom's setting; an alias given with its own name → one error."""
    a = TrainingArguments(total_steps=10, batch_size=4, output_dir="runs/x")
    assert (a.max_training_steps, a.total_batch_size, a.save_directory) == (10, 4, "runs/x")
    assert TrainingArguments(max_steps=7).max_training_steps == 7
    with pytest.raises(ValueError, match=r"per_device_train_batch_size' \(use total_batch_size"):
        TrainingArguments(per_device_train_batch_size=2)
    with pytest.raises(ValueError, match="one setting"):
        TrainingArguments(max_steps=3, max_training_steps=4)


def test_hf_and_trl_names_do_what_they_say_or_are_refused_with_what_jaxloom_does():
    """Issue 51's hints, now honoured (issue 74): gradient_checkpointing is remat, report_to turns TensorBoard and W&B
    on or off, bf16 is the compute dtype, optim picks the optax optimizer, max_steps=-1 (TRL's default) is no step
    limit; dataset_text_field is the text column at 'text' and refused elsewhere; TRL's max_length is
    max_sequence_length for SFT as for DPO; one reward function is accepted as TRL accepts it."""
    from jaxloom.trainer import GRPOConfig
    from jaxloom.trainer.kinds import arguments_of

    a = TrainingArguments(gradient_checkpointing=True, report_to=["wandb"], bf16=True, optim="adamw_torch_fused")
    assert (a.remat, a.use_tensorboard, a.use_wandb, a.dtype, a.optimizer) == ("full", False, True, "bfloat16", "adamw")
    b = TrainingArguments(gradient_checkpointing=False, report_to="none", max_steps=-1, disable_tqdm=True)
    assert (b.remat, b.use_tensorboard, b.use_wandb, b.max_training_steps, b.progress_bar) == (
        "none", False, False, None, False
    )  # fmt: skip
    assert TrainingArguments(optim="lion_32bit", train_sampling_strategy="sequential").shuffle_train_dataset is False
    assert TrainingArguments(dataset_text_field="text", torch_compile=False, push_to_hub=False).optimizer == "adamw"
    for given, said in (
        ({"dataset_text_field": "body"}, "dataset_text_field = 'body': jaxloom reads a 'text' column"),
        ({"torch_compile": True}, "torch_compile = True: jaxloom runs on JAX"),
        ({"fp16": True}, "fp16 = True: float16 training needs loss scaling"),
        ({"optim": "adamw_8bit"}, "optim = 'adamw_8bit': jaxloom's optimizers are optax's"),
        ({"report_to": ["comet_ml"]}, "report_to = \\['comet_ml'\\]"),
        ({"push_to_hub": True}, "push_to_hub = True: nothing leaves this machine"),
        ({"bf16": True, "dtype": "float32"}, "bf16 = True and dtype = 'float32' are one setting"),
    ):
        with pytest.raises(ValueError, match=said):
            TrainingArguments(**given)
    kind, a = arguments_of({"max_length": 256})
    assert kind == "sft" and a.max_sequence_length == 256
    assert GRPOConfig(reward_funcs="my_rewards.accuracy").rl.reward_funcs == ("my_rewards.accuracy",)


def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path):
    """YAML and JSON readers keep the last of two equal keys without a word (issue 43); jaxloom names it."""
    from jaxloom.trainer.arguments import load_config_file

    (tmp_path / "a.yaml").write_text("learning_rate: 1e-3\nmodel:\n  hidden_size: 64\nlearning_rate: 1e-4\n")
    with pytest.raises(ValueError, match=r"a.yaml.*line 4.*'learning_rate' given twice \(first at line 1\)"):
        load_config_file(tmp_path / "a.yaml")
    (tmp_path / "b.json").write_text('{"seed": 1, "seed": 2}')
    with pytest.raises(ValueError, match=r"b.json: key\(s\) \['seed'\] given twice"):
        load_config_file(tmp_path / "b.json")
    (tmp_path / "c.yaml").write_text("model:\n  hidden_size: 64\ndata:\n  hidden_size: 64\n")  # other mappings: fine
    assert load_config_file(tmp_path / "c.yaml")["data"] == {"hidden_size": 64}


def test_home_and_variables_in_paths_are_expanded_as_a_shell_does(tmp_path, monkeypatch):
    """`save_directory: ~/runs/a` in YAML became a directory literally named `~` (issue 43)."""
    import os

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RUNS", "/data/runs")
    from jaxloom.trainer import DPOConfig

    a = DPOConfig(save_directory="~/runs/a", checkpoint_directory="$RUNS/ckpt", ref_model="${RUNS}/ref")
    assert a.save_directory == os.path.join(str(tmp_path), "runs/a")
    assert (a.checkpoint_directory, a.ref_model) == ("/data/runs/ckpt", "/data/runs/ref")
    assert TrainingArguments(checkpoint_directory="gs://bucket/run").checkpoint_directory == "gs://bucket/run"
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(ValueError, match=r"save_directory = '\$NOT_SET_ANYWHERE/a'.*not set"):
        TrainingArguments(save_directory="$NOT_SET_ANYWHERE/a")


def test_rows_with_nothing_to_predict_and_sections_that_are_not_sections_are_refused(tmp_path):
    """max_sequence_length=1 trained 4 steps on no target, then failed in evaluation; `data:` given as a list
    was a traceback (issue 43). Each is one error naming the setting, before anything runs."""
    from jaxloom.trainer.compose import build_run

    with pytest.raises(ValueError, match="max_sequence_length = 1; expected at least 2"):
        TrainingArguments(max_sequence_length=1)
    (tmp_path / "c.yaml").write_text("data:\n  - a.jsonl\n  - b.jsonl\n")
    with pytest.raises(ValueError, match=r"data: \['a.jsonl', 'b.jsonl'\] \(list\); expected a section"):
        build_run(str(tmp_path / "c.yaml"), [])


def test_the_migration_table_names_every_hf_and_trl_name():
    """docs/migration.md's table lists every alias and every refused name of `TrainingArguments`."""
    from pathlib import Path

    from jaxloom.trainer.arguments import ALIASES, RENAMED

    docs = Path(__file__).resolve().parents[3] / "docs" / "migration.md"
    if not docs.is_file():
        pytest.skip("the docs are not beside this checkout of the package")
    table = docs.read_text()
    hf_names = set(ALIASES) - {"total_steps", "batch_size"} | set(RENAMED)  # (EasyDeL's names: the Ray guide)
    missing = sorted(n for n in hf_names if f"`{n}`" not in table)
    assert not missing, missing
    assert TrainingArguments(lr_scheduler_type="linear").scheduler == "linear"
    assert TrainingArguments(eval_steps=7).evaluation_steps == 7
    with pytest.raises(ValueError, match=r"'logging_dir' \(use save_directory"):
        TrainingArguments(logging_dir="logs")


def test_weight_decay_skips_what_hf_trainer_skips():
    """HF Trainer's `get_decay_parameter_names`: no decay for any name holding `bias` or ending in a norm; the rest
    decays (GPT-OSS's expert biases and its router's bias are biases; its sinks and expert weights decay)."""
    import torch
    import transformers

    from jaxloom.trainer.optim import decays

    tiny = dict(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = transformers.GptOssConfig(**tiny, num_key_value_heads=1, head_dim=16, num_local_experts=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    hf = set(transformers.Trainer.get_decay_parameter_names(None, model))
    for name, _ in model.named_parameters():
        assert decays(name.split(".")) == (name in hf), name
    assert not decays("model.layers.0.mlp.experts.gate_up_proj_bias".split("."))
