"""The bad inputs the reliability suite tries, each with the error it must give.

python tests/reliability/bad_inputs.py      # prints the table for docs/reliability.md
"""

from __future__ import annotations

import json
from pathlib import Path

CASES: list[tuple[str, str, str]] = [  # (name, function below, regex the error must match)
    ("malformed YAML config", "malformed_yaml", r"malformed YAML at line 3: expected .,. or .\]."),
    ("malformed JSON config", "malformed_json", r"malformed JSON at line 1"),
    (
        "unknown training argument",
        "unknown_key",
        r"unknown training argument\(s\): 'learning_rat' \(did you mean "
        r"'learning_rate'\?\)",
    ),
    ("unknown key in a config's data section", "unknown_data_key", r"unknown key\(s\) in section data: \['trian'\]"),
    ("wrong type", "wrong_type", r"max_training_steps = 'many'; expected a valid integer"),
    ("negative learning rate", "negative_lr", r"learning_rate = -0.001; expected a non-negative finite number"),
    ("impossible mesh", "impossible_mesh", r"axis_dims \(3, -1\).*8 devices"),
    (
        "batch not divisible by the data axes",
        "indivisible_batch",
        r"global batch size 6 is not divisible by the "
        r"data-parallel size 4",
    ),
    ("missing dataset file", "missing_file", r"dataset file .*nope.jsonl does not exist"),
    ("malformed JSONL line", "malformed_jsonl", r"bad.jsonl:2"),
    ("empty dataset", "empty_dataset", r"empty"),
    ("missing text column", "missing_column", r"'text'"),
    ("tokenizer without pad or eos", "no_pad_no_eos", r"neither a pad token nor an eos token"),
    ("unknown model type", "unknown_model_type", r"model_type 'gpt9' is not supported"),
    ("checkpoint of another shape", "checkpoint_shape", r"model\.hidden_size: 32 → 64"),
    ("scaling_index <= 0", "scaling_index_zero", r"scaling_index 0; expected a positive integer"),
    (
        "missing checkpoint (jaxloom convert)",
        "missing_checkpoint",
        r"jaxloom: error: no checkpoint under .*nowhere/checkpoints",
    ),
    ("unknown --ray setting", "unknown_ray_key", r"--ray 'workers=2'; expected key=value"),
]

# One `key=value` on the command line (parsed and checked as the `jaxloom` command does, before anything runs):
# (name, the override, regex the error must match).
OVERRIDES: list[tuple[str, str, str]] = [
    ("infinite learning rate", "learning_rate=inf", r"learning_rate = inf; expected a non-negative finite number"),
    ("NaN learning rate", "learning_rate=.nan", r"learning_rate = nan; expected a non-negative finite number"),
    ("fractional batch size", "total_batch_size=1.5", r"total_batch_size = 1.5; expected a valid integer"),
    ("zero batch size", "total_batch_size=0", r"total_batch_size = 0; expected a positive"),
    ("seed past 2**32", "seed=1099511627776", r"seed = 1099511627776; expected an integer in \[0, 2\*\*32\)"),
    ("empty save_directory", "save_directory=''", r"save_directory = ''; expected a directory path"),
    ("negative generation_max_new_tokens", "generation_max_new_tokens=-3", r"generation_max_new_tokens = -3"),
    ("zero generation_num_samples", "generation_num_samples=0", r"generation_num_samples = 0"),
    ("warmup_ratio of 1.5", "warmup_ratio=1.5", r"warmup_ratio 1.5; expected a value in \[0, 1\)"),
    ("adam_beta1 of 1", "adam_beta1=1.0", r"adam_beta1 = 1.0; expected a value in \[0, 1\)"),
    ("unknown optimizer", "optimizer=adam9", r"optimizer = 'adam9'; expected 'adamw', 'adafactor', 'lion' or 'sgd'"),
    ("unknown scheduler", "scheduler=wavy", r"scheduler = 'wavy'; expected 'linear', 'cosine' or 'constant'"),
    ("unknown nan_policy", "nan_policy=ignore", r"nan_policy = 'ignore'; expected 'stop' or 'skip'"),
    ("zero gradient_accumulation_steps", "gradient_accumulation_steps=0", r"gradient_accumulation_steps = 0"),
    ("zero logging_steps", "logging_steps=0", r"logging_steps = 0; expected a positive"),
    ("zero max_sequence_length", "max_sequence_length=0", r"max_sequence_length = 0; expected a positive"),
    ("negative z_loss", "z_loss=-1", r"z_loss = -1"),
    ("negative weight_decay", "weight_decay=-0.1", r"weight_decay = -0.1; expected a non-negative"),
    ("zero training_time_limit", "training_time_limit=0", r"training_time_limit = 0"),
    ("zero save_total_limit", "save_total_limit=0", r"save_total_limit = 0"),
    ("profile_steps backwards", "profile_steps=[5,2]", r"profile_steps \[5, 2\]; expected \[first, last\]"),
    ("unknown attention backend", "attn_mechanism=fast", r"attn_mechanism = 'fast'; expected one of"),
    ("unknown remat policy", "remat=sometimes", r"remat = 'sometimes'; expected one of"),
    ("unknown dtype", "dtype=float7", r"'float7' is not a dtype"),
    (
        "integer param_dtype (issue 57)",
        "param_dtype=int8",
        r"param_dtype = 'int8'; int8 is not a floating dtype; expected one of float32, bfloat16, float16, float64",
    ),
    ("integer dtype", "dtype=int32", r"dtype = 'int32'; int32 is not a floating dtype; expected one of float32"),
    ("unknown MoE implementation", "moe_implementation=magic", r"moe_implementation = 'magic'; expected 'auto'"),
    ("zero attn_block_size", "attn_block_size=0", r"attn_block_size = 0; expected a positive"),
    ("mesh dims and names of different lengths", "sharding_axis_dims=[1,-1]", r"sharding_axis_dims \(1, -1\)"),
    ("batch split over an axis the mesh lacks", "batch_axis=[fsdp,expert]", r"batch_axis \('fsdp', 'expert'\)"),
    (
        "boolean as a number",
        "max_training_steps=true",
        r"max_training_steps = True; expected a number or text, not true/false",
    ),
]

# A model setting (`model.key=value`): (name, the override, regex).
MODEL_OVERRIDES: list[tuple[str, str, str]] = [
    ("fractional hidden_size", "model.hidden_size=3.5", r"hidden_size = 3.5; expected a valid integer"),
    ("text as rms_norm_eps", "model.rms_norm_eps=tiny", r"rms_norm_eps = 'tiny'; expected a valid number"),
    ("unknown model key", "model.hiden_size=64", r"unknown config key\(s\) \['hiden_size'\]"),
    ("heads not a multiple of kv heads", "model.num_key_value_heads=3", r"not a multiple of num_key_value_heads 3"),
    ("unknown activation", "model.hidden_act=swish9", r"hidden_act 'swish9'; expected silu"),
    ("unknown rope scaling", "model.rope_scaling={rope_type: warp}", r"rope_scaling type 'warp'"),
    (
        "vocab smaller than the tokenizer",
        "model.vocab_size=64",
        r"tokenizer has 4096 tokens but the model's vocab_size is 64",
    ),
    (
        "rows longer than the model's positions",
        "model.max_position_embeddings=16",
        r"max_sequence_length = 32; expected at most the model's max_position_embeddings \(16\)",
    ),
]

for _name, _item, _regex in OVERRIDES + MODEL_OVERRIDES:
    CASES.append((_name, "override:" + _item, _regex))

CASES += [
    ("YAML alias (a config that could explode)", "yaml_alias", r"c.yaml:2: YAML alias \*a; expected plain values"),
    ("JSONL line that is not UTF-8", "not_utf8", r"latin1.jsonl:2: not valid UTF-8"),
    ("record whose text is a number", "text_is_a_number", r"nums.jsonl:2: column 'text' holds int, expected text"),
    ("tokenizer path that does not exist", "tokenizer_typo", r"tokenizer directory .*tokz does not exist"),
    ("safetensors header that is a list", "safetensors_list_header", r"corrupt safetensors header \(a JSON list"),
    ("safetensors entry without dtype", "safetensors_no_dtype", r"corrupt safetensors header entry 'w'"),
    ("overlapping safetensors tensors", "safetensors_overlap", r"tensors 'a' and 'b' overlap"),
    ("evaluation batch not divisible by the data axes", "indivisible_eval_batch", r"evaluation_batch_size = 6"),
    (
        "unknown MeshConfig key",
        "mesh_unknown_key",
        r"MeshConfig: unknown key 'axis_dim' \(did you mean 'axis_dims'\?\)",
    ),
    ("top_p above 1", "generation_top_p", r"top_p = 1.5; expected a value in \(0, 1\]"),
    ("unknown Ray platform", "ray_platform", r"ScalingConfig: platform = 'quantum'; expected 'cpu', 'gpu'"),
    ("zero Ray workers", "ray_zero_workers", r"ScalingConfig: num_workers = 0; expected a positive integer"),
    (
        "preview prompt longer than the context",
        "long_preview_prompt",
        r"generation_prompts\[0\] = 'word word .*'\.\.\. is \d+ tokens, \+ generation_max_new_tokens = 8; expected at "
        r"most the model's max_position_embeddings \(32\)",
    ),
    (
        "a step too large for the host's memory (CPU)",
        "step_too_large",
        r"the train step needs [\d.]+ GiB on this host \(8 CPU devices × what XLA compiled for each, and a "
        r"checkpoint's copy\), and this host has [\d.]+ GiB free: expected a smaller total_batch_size",
    ),
    (
        "evaluation file with no records",
        "empty_eval_file",
        r"dataset_eval gives no batch of evaluation_batch_size = 8 rows; expected at least one",
    ),
    (
        "bad record in the evaluation file (read at setup)",
        "bad_eval_record",
        r"eval.jsonl:2: column 'text' holds list, expected text",
    ),
    ("evaluation file that does not exist", "missing_eval_file", r"dataset file .*nope-eval.jsonl does not exist"),
    (
        "chat record without an assistant turn (would train on nothing)",
        "chat_without_assistant",
        r"chat.jsonl:2: messages with roles \['system', 'user'\] have no 'assistant' turn; expected at least one",
    ),
    (
        "jaxloom eval of a run with no checkpoint (never a random model's score)",
        "eval_without_checkpoint",
        r"jaxloom: error: no checkpoint under .*run/checkpoints \(none complete\)",
    ),
    (
        "bad record deep in a small training file (read whole before step 1; issue 57)",
        "bad_record_at_line_61",
        r"data.jsonl:61: column 'text' holds int, expected text; fix that record, or set skip_bad_records=true",
    ),
    (
        "bad record met while streaming (names the way past it; issue 57)",
        "bad_record_streamed",
        r"big.jsonl:61: column 'text' holds int, expected text; fix that record, or set skip_bad_records=true .* "
        r"rerunning as it is stops at the same record",
    ),
    (
        "save_directory under a regular file (issue 57)",
        "save_directory_under_a_file",
        r"save_directory = '.*afile/run': .*afile is a file where a directory is needed",
    ),
    (
        "checkpoint_directory under a regular file (issue 57)",
        "checkpoint_directory_under_a_file",
        r"checkpoint_directory = '.*afile/ckpt': .*afile is a file where a directory is needed",
    ),
    (
        "export directory under a regular file (issue 57)",
        "export_under_a_file",
        r"the convert target = '.*afile/hf': .*afile is a file where a directory is needed",
    ),
    (
        "resuming on a dataset that shrank since the checkpoint",
        "shrunk_dataset",
        r"the dataset changed since this data position was saved: shard .*d.jsonl has 3 record\(s\)",
    ),
]


def _tiny(tmp: Path, *extra: str) -> list[str]:
    return [
        f"save_directory={tmp / 'run'}",
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_hidden_layers=1",
        "max_training_steps=2",
        "total_batch_size=8",
        "max_sequence_length=32",
        "progress_bar=false",
        "use_tensorboard=false",
        "plot_loss=false",
        *extra,
    ]


def malformed_yaml(tmp):
    from jaxloom.trainer.compose import build_run

    (tmp / "c.yaml").write_text("learning_rate: 0.1\nmodel: [unclosed\n")
    build_run(str(tmp / "c.yaml"), [])


def malformed_json(tmp):
    from jaxloom.trainer import TrainingArguments

    (tmp / "c.json").write_text("{learning_rate: 0.1}")
    TrainingArguments.from_file(tmp / "c.json")


def unknown_key(tmp):
    from jaxloom.trainer import TrainingArguments

    TrainingArguments(learning_rat=1e-3)


def unknown_data_key(tmp):
    from jaxloom.trainer.compose import build_run

    build_run(None, _tiny(tmp, "data.trian=x.jsonl"))


def wrong_type(tmp):
    from jaxloom.trainer.compose import build_run

    build_run(None, _tiny(tmp, "max_training_steps=many"))


def negative_lr(tmp):
    from jaxloom.trainer import TrainingArguments

    TrainingArguments(learning_rate=-1e-3)


def impossible_mesh(tmp):
    from jaxloom.mesh import MeshConfig

    MeshConfig((3, -1), ("fsdp", "tp")).build()


def _set_up(tmp, *items):
    """What `jaxloom train` does before step 1: build the run, then its builders (constructing a trainer
    does no work of its own)."""
    from jaxloom.trainer.compose import build_run

    trainer, _ = build_run(None, _tiny(tmp, *items))
    try:
        trainer.initialize_trainer_utils()
    finally:
        trainer.finish()


def indivisible_batch(tmp):
    _set_up(tmp, "total_batch_size=6", "sharding_axis_dims=[1,4,1,2,1]")


def missing_file(tmp):
    _set_up(tmp, f"data.train={tmp / 'nope.jsonl'}", "data.eval=null")


def malformed_jsonl(tmp):
    import jaxloom.data as jd

    (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    jd.JsonlSource(tmp / "bad.jsonl").read_shard(str(tmp / "bad.jsonl"))


def empty_dataset(tmp):
    import jaxloom.data as jd

    (tmp / "empty.jsonl").write_text("")
    next(jd.DataLoader(str(tmp / "empty.jsonl"), jd.load_processor(), jd.DataConfig(prefetch=0)))


def missing_column(tmp):
    import jaxloom.data as jd

    next(jd.DataLoader([{"body": "no text column"}], jd.load_processor(), jd.DataConfig(prefetch=0)))


def no_pad_no_eos(tmp):
    import jaxloom.data as jd

    tok = jd.load_processor()
    tok.pad_token = None
    tok.eos_token = None
    tok.save_pretrained(tmp / "tok")
    cfg = json.loads((tmp / "tok" / "tokenizer_config.json").read_text())
    for key in ("pad_token", "eos_token"):
        cfg.pop(key, None)
    (tmp / "tok" / "tokenizer_config.json").write_text(json.dumps(cfg))
    jd.load_processor(tmp / "tok")


def unknown_model_type(tmp):
    from jaxloom.trainer.compose import build_run

    build_run(None, _tiny(tmp, "model.model_type=gpt9"))


def checkpoint_shape(tmp):
    from jaxloom.trainer.compose import build_run

    trainer, _ = build_run(None, _tiny(tmp, "save_steps=2"))
    trainer.train()
    trainer.finish()
    _set_up(tmp, "model.hidden_size=64", "max_training_steps=3")


def scaling_index_zero(tmp):
    from jaxloom.ray import RayDistributedTrainer

    (tmp / "base").mkdir()
    (tmp / "base" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64}))
    RayDistributedTrainer(str(tmp / "base")).create_config(0)


def _command(argv: list[str]) -> None:
    """Run the `jaxloom` command; when it prints one error line and exits with 2, raise that line."""
    import contextlib
    import io

    from jaxloom.trainer.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    if rc == 2:
        raise FileNotFoundError(err.getvalue().strip().splitlines()[-1])


def missing_checkpoint(tmp):
    demo = Path(__file__).parents[2] / "packages/trainer/src/jaxloom/trainer/configs/demo.yaml"
    _command(["convert", "--to-hf", str(tmp / "nowhere"), str(tmp / "out"), "--config", str(demo)])


def eval_without_checkpoint(tmp):
    _command(["eval", *_tiny(tmp)])


def unknown_ray_key(tmp):
    from jaxloom.ray import ScalingConfig

    ScalingConfig.from_items(["workers=2"])


def _override(tmp, item):
    """The `jaxloom train` path up to the first step: parse, build, and set up (validation before step 1)."""
    from jaxloom.trainer.compose import build_run

    trainer, _ = build_run(None, _tiny(tmp, item))
    assert trainer.plan is not None  # everything abstract: the settings checked against the model and mesh
    trainer.configure_dataloaders()


def yaml_alias(tmp):
    from jaxloom.trainer.arguments import load_config_file

    (tmp / "c.yaml").write_text("a: &a [1, 2, 3]\nb: [*a, *a, *a]\n")
    load_config_file(tmp / "c.yaml")


def not_utf8(tmp):
    import jaxloom.data as jd

    (tmp / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    jd.JsonlSource(tmp / "latin1.jsonl").read_shard(str(tmp / "latin1.jsonl"))


def text_is_a_number(tmp):
    (tmp / "nums.jsonl").write_text('{"text": "fine words here"}\n{"text": 12345}\n')
    _override(tmp, f"data.train={tmp / 'nums.jsonl'}")
    _read_rows(tmp / "nums.jsonl", 4)


def _read_rows(path, rows: int, length: int = 8) -> None:
    """Read `rows` one-row batches of the file at `path`, in order."""
    import jaxloom.data as jd

    cfg = jd.DataConfig(max_sequence_length=length, batch_size=1, packing=False, shuffle=False, prefetch=0)
    loader = jd.DataLoader(jd.JsonlSource(path), jd.load_processor(), cfg)
    for _ in range(rows):
        next(loader)


def tokenizer_typo(tmp):
    import jaxloom.data as jd

    jd.load_processor(tmp / "tokz")


def _safetensors(tmp, header: object) -> None:
    from jaxloom.models import safetensors_io

    blob = json.dumps(header).encode()
    (tmp / "w.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(64))
    safetensors_io.load(tmp / "w.safetensors")


def safetensors_list_header(tmp):
    _safetensors(tmp, [1, 2])


def safetensors_no_dtype(tmp):
    _safetensors(tmp, {"w": {"shape": [2], "data_offsets": [0, 8]}})


def safetensors_overlap(tmp):
    entry = {"dtype": "F32", "shape": [4]}
    _safetensors(tmp, {"a": {**entry, "data_offsets": [0, 16]}, "b": {**entry, "data_offsets": [8, 24]}})


def indivisible_eval_batch(tmp):
    _override(tmp, "evaluation_batch_size=6")


def mesh_unknown_key(tmp):
    from jaxloom.mesh import MeshConfig

    MeshConfig.from_dict({"axis_dim": [1, -1]})


def generation_top_p(tmp):
    from jaxloom.generation import GenerationConfig

    GenerationConfig(top_p=1.5)


def ray_platform(tmp):
    from jaxloom.ray import ScalingConfig

    ScalingConfig.from_items(["platform=quantum"])


def ray_zero_workers(tmp):
    from jaxloom.ray import ScalingConfig

    ScalingConfig.from_items(["num_workers=0"])


def run_case(function: str, tmp: Path) -> BaseException:
    """Run one case; returns the exception it raised (or raises AssertionError if it did not)."""
    try:
        if function.startswith("override:"):
            _override(tmp, function.removeprefix("override:"))
        else:
            globals()[function](tmp)
    except (ValueError, TypeError, FileNotFoundError, KeyError) as e:
        return e
    raise AssertionError(f"{function}: no error was raised")


def long_preview_prompt(tmp):
    _set_up(
        tmp,
        "model.max_position_embeddings=32",
        "generation_max_new_tokens=8",
        "generation_prompts=['" + "word " * 40 + "']",
    )


def step_too_large(tmp):
    """A step that cannot fit the host's memory (on CPU XLA reports no limit; the host's free memory is): refused
    when the step is compiled, before step 1, with both numbers."""
    from jaxloom.trainer.compose import build_run

    long = ("max_sequence_length=262144", "model.max_position_embeddings=262144", "total_batch_size=64")
    trainer, _ = build_run(None, _tiny(tmp, *long, "loss_block_size=0"))
    try:
        trainer.initialize_trainer_utils()
        trainer.compile_aot()
    finally:
        trainer.finish()


def empty_eval_file(tmp):
    (tmp / "eval.jsonl").write_text("")
    _set_up(tmp, f"data.eval={tmp / 'eval.jsonl'}")


def bad_eval_record(tmp):
    (tmp / "eval.jsonl").write_text('{"text": "fine words here"}\n{"text": ["a", "list"]}\n' * 4)
    _set_up(tmp, f"data.eval={tmp / 'eval.jsonl'}", "evaluation_steps=100")


def missing_eval_file(tmp):
    _set_up(tmp, f"data.eval={tmp / 'nope-eval.jsonl'}")


def chat_without_assistant(tmp):
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    lone = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    (tmp / "chat.jsonl").write_text("\n".join(json.dumps({"messages": m}) for m in (turn, lone, turn)) + "\n")
    _read_rows(tmp / "chat.jsonl", 4, length=16)


def shrunk_dataset(tmp):
    import jaxloom.data as jd

    path = tmp / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(20)))
    cfg = jd.DataConfig(max_sequence_length=8, batch_size=2, packing=False, shuffle=False, prefetch=0)
    loader = jd.DataLoader(jd.JsonlSource(path), jd.load_processor(), cfg)
    for _ in range(4):
        next(loader)
    path.write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(3)))
    next(jd.DataLoader(jd.JsonlSource(path), jd.load_processor(), cfg, state=loader.state_dict()))


def _records_with_a_number_at_line_61(path: Path) -> None:
    rows = [{"text": f"record number {i} " * 4} for i in range(80)]
    rows[60] = {"text": 12345}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def bad_record_at_line_61(tmp):
    _records_with_a_number_at_line_61(tmp / "data.jsonl")
    _set_up(tmp, f"data.train={tmp / 'data.jsonl'}", "data.eval=null")


def bad_record_streamed(tmp):
    """Data the up-front check does not read (here: read by the loader directly, as any file past
    `jaxloom.data.pipeline.PRECHECK_BYTES` is): the error at the record says how to get past it."""
    _records_with_a_number_at_line_61(tmp / "big.jsonl")
    _read_rows(tmp / "big.jsonl", 80)


def save_directory_under_a_file(tmp):
    (tmp / "afile").write_text("a file, not a directory")
    _command(["train", *_tiny(tmp, f"save_directory={tmp / 'afile' / 'run'}")])


def checkpoint_directory_under_a_file(tmp):
    (tmp / "afile").write_text("a file, not a directory")
    _command(["train", *_tiny(tmp, f"checkpoint_directory={tmp / 'afile' / 'ckpt'}")])


def export_under_a_file(tmp):
    (tmp / "afile").write_text("a file, not a directory")
    _command(["convert", "--to-hf", str(tmp / "run"), str(tmp / "afile" / "hf")])


if __name__ == "__main__":
    import tempfile

    print("| bad input | error |\n|---|---|")
    for name, function, _ in CASES:
        with tempfile.TemporaryDirectory() as d:
            err = run_case(function, Path(d))
        text = str(err).replace(d, "…").replace("|", "\\|").splitlines()[0]
        print(f"| {name} | `{type(err).__name__}: {text[:220]}` |")
