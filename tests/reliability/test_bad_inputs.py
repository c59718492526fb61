"""Every bad input gives one clear error naming the value and what was expected, and loses nothing."""

import re
from pathlib import Path

import pytest
from bad_inputs import CASES, run_case

DOC = Path(__file__).parents[2] / "docs" / "reliability.md"


@pytest.mark.parametrize("name, function, pattern", CASES, ids=[c[1] for c in CASES])
def test_bad_input_gives_one_clear_error(tmp_path, name, function, pattern):
    (tmp_path / "earlier.txt").write_text("written before")
    err = run_case(function, tmp_path)
    assert re.search(pattern, str(err)), f"{name}: {type(err).__name__}: {err}"
    assert "Traceback" not in str(err) and len(str(err)) < 2000
    assert (tmp_path / "earlier.txt").read_text() == "written before"
    if function != "checkpoint_shape":  # nothing half-written for a run that never started
        assert not (tmp_path / "run" / "checkpoints").exists() or function == "missing_checkpoint"


def test_checkpoint_of_another_shape_leaves_the_checkpoint_intact(tmp_path):
    run_case("checkpoint_shape", tmp_path)
    from jaxloom.state import CheckpointManager

    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).all_steps() == [2]


def test_docs_list_every_case():
    text = DOC.read_text()
    missing = [name for name, _, _ in CASES if f"| {name} |" not in text]
    assert not missing, f"docs/reliability.md lacks {missing}"


def test_inputs_as_users_write_them_are_named_with_the_fix(tmp_path):
    """Issue 43's messages that named neither the input nor the fix: JSON nested too deep (a RecursionError
    traceback), a lone surrogate (a tokenizer TypeError without file:line), a file whose name has brackets (read
    as a glob), a directory named like a .jsonl, a prompt holding a number, a YAML date as a path."""
    import json

    import jaxloom.data as jd
    from jaxloom.trainer.arguments import apply_overrides, load_config_file

    tok = jd.load_processor()
    config = jd.DataConfig(max_sequence_length=16, batch_size=2, shuffle_buffer_size=1, prefetch=0)

    def first_batch(path):
        return next(iter(jd.DataLoader(jd.as_source(str(path)), tok, config)))

    cases = [  # (file, its content, the error, what it says)
        (
            "deep.jsonl",
            '{"text": ' + "[" * 5000 + "]" * 5000 + "}\n",
            ValueError,
            ":1: malformed JSONL line \\(nested deeper",
        ),
        ("lone.jsonl", '{"text": "abc \\ud800 def"}\n', ValueError, ":1: column 'text' holds a lone surrogate"),
        (
            "number.jsonl",
            json.dumps({"prompt": 5, "completion": "x"}) + "\n",
            ValueError,
            ":1: column 'prompt' holds int",
        ),
    ]
    for name, content, error, says in cases:
        (tmp_path / name).write_text(content)
        with pytest.raises(error, match=rf"{tmp_path / name}{says}"):
            first_batch(tmp_path / name)
    brackets = tmp_path / "data[1].jsonl"
    brackets.write_text("".join(json.dumps({"text": f"document {i} words"}) + "\n" for i in range(8)))
    assert first_batch(brackets)["input_ids"].shape == (2, 16)  # the file itself, not a glob matching nothing
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(FileNotFoundError, match="is a directory, not a data file"):
        first_batch(tmp_path / "dir.jsonl")
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("save_directory: 2024-01-01\n")
    with pytest.raises(ValueError, match=r"save_directory = 2024-01-01 is read by YAML as a date; expected text"):
        load_config_file(yaml_file)
    with pytest.raises(ValueError, match="the command line: save_directory = 2024-01-01"):
        apply_overrides({}, ["save_directory=2024-01-01"])


def test_damaged_files_a_user_points_at_are_named(tmp_path, caplog):
    """A truncated Parquet file, a malformed config.json, a tokenizer directory transformers cannot load (each
    an error naming the file and what was expected), and a stray step directory (`mkdir checkpoints/7`: ignored
    with a warning, never restored as if it were the newest checkpoint)."""
    import logging

    import pyarrow as pa
    import pyarrow.parquet as pq

    import jaxloom.data as jd
    import jaxloom.models as jm
    import jaxloom.state as js

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": ["hello world"] * 200}), good)
    (tmp_path / "cut.parquet").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    source = jd.as_source(str(tmp_path / "cut.parquet"))
    with pytest.raises(ValueError, match=r"cut.parquet: not a readable Parquet file .*a truncated copy"):
        next(source.open_shard(source.shard_names[0]))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(ValueError, match=r"hf/config.json: malformed JSON"):
        jm.from_pretrained(tmp_path / "hf")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "vocab.txt").write_text("a")
    with pytest.raises(ValueError, match=r"tok: not a tokenizer transformers can load .*\['vocab.txt'\]"):
        jd.load_processor(str(tmp_path / "tok"))
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "state" / "tests"))
    from state_util import make_state, mesh_of, target  # the state part's test helpers

    manager = js.CheckpointManager(str(tmp_path / "ckpt"), async_save=False)
    manager.save(1, make_state(mesh_of(fsdp=1)))
    (tmp_path / "ckpt" / "7").mkdir()
    fresh = js.CheckpointManager(str(tmp_path / "ckpt"))
    with caplog.at_level(logging.WARNING):
        assert fresh.all_steps() == [1] and fresh.latest_step() == 1
        assert fresh.restore(target(mesh_of(fsdp=1))).step == 1
    assert "ignoring" in caplog.text and "a step directory without a checkpoint" in caplog.text
