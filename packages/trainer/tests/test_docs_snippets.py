"""The Python snippets of the docs run as written (issue 70): each ```python block of the training pages is executed
in a folder holding the files it names, with its placeholders (`BASE_DIR`, `"A"`, `path/to/tokenizer`, ...) made
real and only its sizes shrunk (steps, rows, lengths): the imports, names, signatures and defaults a user copies
are the ones that run. A snippet that cannot run on one CPU as written (a Ray cluster's, a template with `...`)
is listed in NOT_RUN with the reason; every other block is run."""

import json
import re
from pathlib import Path

import pytest
from test_newcomer import _model_with_its_own_tokenizer

DOCS = Path(__file__).parents[3] / "docs"
NOT_RUN = {
    "ray.md": "a Ray cluster's launch templates (`...` in a job); the ray part's tests run the same calls",
    "storage.md": "reads a checkpoint of step 400 of an earlier run; test_storage_snippet runs it on a run of its own",
    "benchmarks.md": "lm-eval's Hub tasks (arc_easy) need the network; test_lm_eval runs the same calls on local tasks",
    "models.md": "Qwen2.5-VL and Gemma 3 checkpoints and their processors from the Hub; test_qwen2_5_vl, "
    "test_gemma3_vl and test_vlm_sft make the same calls on shrunk models and transformers' own processors",
}
# Sizes only: what a snippet trains is a real run, made small. (pattern, replacement)
SHRINK = [
    (r"total_batch_size=\d+", "total_batch_size=8"),
    (r"max_completion_length=\d+", "max_completion_length=6"),
    (r"max_length=\d+", "max_length=48"),
    (r"max_sequence_length=\d+", "max_sequence_length=32"),
    (r"max_training_steps=\d+", "max_training_steps=2"),
    (r"num_generations=\d+", "num_generations=4"),
    (
        r"hidden_size=256, intermediate_size=768, num_hidden_layers=6",
        "hidden_size=32, intermediate_size=64, num_hidden_layers=1",
    ),
]
# A doc's whole Python before its run: every block, in order, in one namespace (later blocks use earlier ones).
PAGES = ["quickstart.md", "adapters.md", "preference.md", "kto.md", "reward.md", "distillation.md", "rl.md"]


def blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


def test_every_page_with_python_is_run_or_said_why_not():
    with_python = {p.name for p in DOCS.glob("*.md") if blocks(p.name)}
    assert with_python == set(PAGES) | set(NOT_RUN), with_python ^ (set(PAGES) | set(NOT_RUN))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The files the snippets name: a model directory with its tokenizer (at every placeholder of one), chat,
    text, preference and prompt records."""
    from transformers import AutoTokenizer

    where = tmp_path_factory.mktemp("docs")
    _model_with_its_own_tokenizer(where / "model")
    tokenizer = AutoTokenizer.from_pretrained(str(where / "model"))  # a chat model's tokenizer has a template
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    tokenizer.save_pretrained(str(where / "model"))
    config = json.loads((where / "model" / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # rotary positions: no weight depends on it; TrainingArguments' 512 fits
    (where / "model" / "config.json").write_text(json.dumps(config))

    def jsonl(name, rows):
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    chat = [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
        for i in range(8)
    ]
    jsonl("chat.jsonl", chat)
    jsonl("data/train-0.jsonl", [{"text": f"record {i} says something " * 4} for i in range(16)])
    jsonl("data/eval.jsonl", [{"text": f"held out {i} " * 4} for i in range(8)])
    pairs = [{"prompt": f"q{i}", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(8)]
    jsonl("pairs.jsonl", pairs)
    jsonl("pairs-eval.jsonl", pairs)
    jsonl("feedback.jsonl", [{"prompt": f"q{i}", "completion": f" yes {i}", "label": i % 3 > 0} for i in range(8)])
    jsonl("prompts.jsonl", [{"prompt": f"say {w}:", "answer": w} for w in ["a", "b", "c", "d"] * 2])
    return where


def _placeholders(code: str, folder: Path) -> str:
    import jaxloom.data as jd

    model = str(folder / "model")
    for name in ("BASE_DIR", "BASE", "STUDENT", "TEACHER", "A", "B"):
        code = code.replace(f'"{name}"', repr(model))
    code = code.replace('"path/to/tokenizer"', repr(str(jd.bundled_tokenizer_path())))
    for pattern, replacement in SHRINK:
        code = re.sub(pattern, replacement, code)
    return code


@pytest.mark.parametrize("page", PAGES)
def test_the_python_of_a_page_runs_as_written(page, folder, tmp_path, monkeypatch):
    code = "\n".join(blocks(page))
    assert code.strip(), page
    monkeypatch.chdir(tmp_path)
    for f in folder.iterdir():
        (tmp_path / f.name).symlink_to(f, target_is_directory=f.is_dir())
    namespace: dict = {}
    exec(compile(_placeholders(code, folder), f"docs/{page}", "exec"), namespace)
    if page == "quickstart.md":
        assert namespace["out"].state is not None and (tmp_path / "runs" / "mine" / "checkpoints").is_dir()
    if page == "rl.md":
        assert "Counter" in namespace
    if page == "adapters.md":  # the first block's export, read by PEFT in the second
        assert (tmp_path / "OUT" / "adapter_config.json").is_file() and namespace["model"] is not None


def test_storage_snippet(folder, tmp_path, monkeypatch):
    """docs/storage.md's snippet reads a run's checkpoint with orbax alone: run on a run of this test's own."""
    from jaxloom.trainer.cli import main

    (code,) = blocks("storage.md")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "a"
    base = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1", "max_sequence_length=32"]
    assert (
        main(
            [
                "train",
                *base,
                "total_batch_size=8",
                "max_training_steps=2",
                "progress_bar=false",
                f"save_directory={run}",
            ]
        )
        == 0
    )
    namespace: dict = {}
    exec(compile(code.replace("400", "2"), "docs/storage.md", "exec"), namespace)
    assert namespace["step"]["meta"]["step"] == 2 and namespace["params"]
