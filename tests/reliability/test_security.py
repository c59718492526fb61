"""Security promises: no pickle from disk, no remote code, loopback by default, configs cannot import
objects, a run writes only inside its save_directory."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SOURCES = sorted((ROOT / "packages").glob("*/src/jaxloom/**/*.py"))


def test_no_pickle_load_anywhere_in_the_sources():
    assert SOURCES
    pattern = re.compile(
        r"\b(pickle|cloudpickle|dill|joblib)\.(load|loads|Unpickler)\b|torch\.load\(|"
        r"allow_pickle\s*=\s*True"
    )
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in SOURCES
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits


# The one import by name a config can ask for: GRPO's reward functions (`reward_funcs=my_rewards.accuracy`,
# the and TRL's way of naming user code), imported only when a run trains — see the test below.
REWARD_IMPORT = "packages/trainer/src/jaxloom/trainer/grpo/rewards.py"


def test_no_eval_exec_or_import_by_name_from_config_values():
    pattern = re.compile(r"\b(eval|exec)\(|importlib\.import_module\((?!f\"\{__name__\})|__import__\(")
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in SOURCES
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    sanctioned = [h for h in hits if h.startswith(REWARD_IMPORT) and "import_module(module)" in h]
    assert len(sanctioned) <= 1 and not set(hits) - set(sanctioned), hits


def test_reading_a_grpo_run_imports_none_of_its_reward_functions(tmp_path, monkeypatch):
    """A run directory from elsewhere names reward functions by path: `convert`, `generate` and `plan` read it
    without importing them (only training or evaluating the run does: scoring is running them)."""
    import json
    import sys

    from jaxloom.trainer.compose import restored

    marker = tmp_path / "imported"
    (tmp_path / "evil_rewards.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef r(prompts, completions, **kw): return []\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    config = {
        "trainer": "grpo",
        "reward_funcs": ["evil_rewards.r"],
        "data": {"train": str(tmp_path / "p.jsonl")},
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1},
        "save_directory": str(run),
    }
    (run / "run_config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError):  # no checkpoint: what matters is what happened before
        restored(run, params_only=True)
    assert not marker.exists() and "evil_rewards" not in sys.modules


def test_yaml_configs_cannot_name_python_objects(tmp_path):
    from jaxloom.trainer.arguments import load_config_file

    (tmp_path / "evil.yaml").write_text("learning_rate: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ValueError, match="malformed YAML"):
        load_config_file(tmp_path / "evil.yaml")


def test_trust_remote_code_is_off_by_default():
    import inspect

    import jaxloom.data as jd

    assert inspect.signature(jd.load_processor).parameters["trust_remote_code"].default is False
    for p in SOURCES:
        assert "trust_remote_code=True" not in p.read_text(), p


def test_ray_binds_loopback_by_default():
    import inspect

    from jaxloom.ray import init_ray

    src = inspect.getsource(init_ray)
    assert "LOOPBACK" in src and inspect.signature(init_ray).parameters["include_dashboard"].default is False
    # the live check (every new listening port on 127.0.0.1) is packages/ray/tests/test_launcher.py


def test_a_run_writes_only_inside_its_save_directory(tmp_path):
    from jaxloom.trainer.compose import build_run

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    run = tmp_path / "run"
    trainer, resolved = build_run(
        None,
        [
            f"save_directory={run}",
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "model.num_hidden_layers=1",
            "max_training_steps=2",
            "total_batch_size=8",
            "max_sequence_length=32",
            "progress_bar=false",
            "save_steps=1",
            "generation_interval=1",
            "generation_max_new_tokens=2",
        ],
    )
    trainer.run_config = resolved
    trainer.train()
    trainer.finish()
    written = {p.relative_to(tmp_path).parts[0] for p in tmp_path.rglob("*")}
    assert written == {"outside", "run"}
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert {p.name for p in run.iterdir()} >= {"checkpoints", "metrics.jsonl", "report.md", "run_config.json"}
