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
    ("negative learning rate", "negative_lr", r"learning_rate = -0.001; expected a positive finite number"),
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
    ("checkpoint of another shape", "checkpoint_shape", r"shape"),
    ("scaling_index <= 0", "scaling_index_zero", r"scaling_index 0; expected a positive integer"),
    (
        "missing checkpoint (jaxloom convert)",
        "missing_checkpoint",
        r"jaxloom: error: no checkpoint under .*nowhere/checkpoints",
    ),
    ("unknown --ray setting", "unknown_ray_key", r"--ray 'workers=2'; expected key=value"),
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
        *extra,
    ]


def malformed_yaml(tmp):
    from jaxloom.trainer.cli import build_run

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
    from jaxloom.trainer.cli import build_run

    build_run(None, _tiny(tmp, "data.trian=x.jsonl"))


def wrong_type(tmp):
    from jaxloom.trainer.cli import build_run

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
    from jaxloom.trainer.cli import build_run

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
    from jaxloom.trainer.cli import build_run

    build_run(None, _tiny(tmp, "model.model_type=gpt9"))


def checkpoint_shape(tmp):
    from jaxloom.trainer.cli import build_run

    trainer, _ = build_run(None, _tiny(tmp, "save_steps=2"))
    trainer.train()
    trainer.finish()
    _set_up(tmp, "model.hidden_size=64", "max_training_steps=3")


def scaling_index_zero(tmp):
    from jaxloom.ray import RayDistributedTrainer

    (tmp / "base").mkdir()
    (tmp / "base" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64}))
    RayDistributedTrainer(str(tmp / "base")).create_config(0)


def missing_checkpoint(tmp):
    import contextlib
    import io

    from jaxloom.trainer.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(
            [
                "convert",
                "--to-hf",
                str(tmp / "nowhere"),
                str(tmp / "out"),
                "--config",
                str(Path(__file__).parents[2] / "packages/trainer/src/jaxloom/trainer/configs/demo.yaml"),
            ]
        )
    if rc == 2:  # the command printed one line and exited with 2: hand that line on
        raise FileNotFoundError(err.getvalue().strip().splitlines()[-1])


def unknown_ray_key(tmp):
    from jaxloom.ray import ScalingConfig

    ScalingConfig.from_items(["workers=2"])


def run_case(function: str, tmp: Path) -> BaseException:
    """Run one case; returns the exception it raised (or raises AssertionError if it did not)."""
    try:
        globals()[function](tmp)
    except (ValueError, TypeError, FileNotFoundError, KeyError) as e:
        return e
    raise AssertionError(f"{function}: no error was raised")


if __name__ == "__main__":
    import tempfile

    print("| bad input | error |\n|---|---|")
    for name, function, _ in CASES:
        with tempfile.TemporaryDirectory() as d:
            err = run_case(function, Path(d))
        text = str(err).replace(d, "…").replace("|", "\\|").splitlines()[0]
        print(f"| {name} | `{type(err).__name__}: {text[:220]}` |")
