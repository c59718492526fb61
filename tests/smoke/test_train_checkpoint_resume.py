"""The smoke run on the newest Python and JAX (`nox -s "tests(target='py312-smoke')"`): the `jaxloom`
command trains a tiny model a few steps with a checkpoint, then a second run resumes from it and ends
where it was asked to. Real processes, real files, the bundled data."""

import json
import os
import subprocess
import sys
from pathlib import Path

TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.rms_norm_eps=1e-5",  # a float written as YAML reads it: a string, parsed by the schema
    "total_batch_size=4",
    "max_sequence_length=32",
    "evaluation_steps=null",
    "generation_interval=null",
    "progress_bar=false",
    "save_steps=2",
    "logging_steps=1",
]


def train(run: Path, steps: int) -> dict:
    jaxloom = Path(sys.executable).with_name("jaxloom")
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}",
    }
    out = subprocess.run(
        [str(jaxloom), "train", f"save_directory={run}", f"max_training_steps={steps}", *TINY],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout[out.stdout.index("\n{") + 1 :])  # the summary closes the output


def test_train_checkpoint_and_resume(tmp_path):
    run = tmp_path / "run"
    first = train(run, 4)
    assert first["resumed_from"] is None and first["stop_reason"] == "max_training_steps reached"
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    second = train(run, 6)
    assert second["resumed_from"] == str(run / "checkpoints" / "4")
    assert 6 in [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert (
        steps[0] == 1 and steps[-1] == 6 and all(r["train/loss"] == r["train/loss"] for r in rows if "train/loss" in r)
    )
