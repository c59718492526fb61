"""lm-evaluation-harness on jaxloom (issue 76): lm-eval's `jaxloom` model equals its `hf` model on the same local
tasks; `jaxloom eval --tasks` on an HF directory and a run directory; `eval_tasks` during training, on its cadence,
in metrics.jsonl and report.md, and an evaluation killed by SIGKILL redone on resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

from util import CLI_TINY, TOK  # noqa: E402

WORDS = ["apple", "river", "stone", "cloud", "green", "seven", "light", "music"]


def _records(rng, n, lo, hi):
    return [" ".join(rng.choice(WORDS) for _ in range(rng.integers(lo, hi))) for _ in range(n)]


def write_tasks(root: Path, kill_marker: Path | None = None) -> Path:
    """Three local tasks (no network): multiple choice (loglikelihood), generation to a stop sequence, and rolling
    perplexity over texts longer than the model's 64 positions. With `kill_marker`, `tiny_mc`'s first scored
    document SIGKILLs the process once (the marker records that it did)."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    qs = _records(rng, 12, 3, 9)
    mc = [{"question": q, "choices": _records(rng, 4, 1, 4), "answer": int(rng.integers(4))} for q in qs]
    gen = [{"question": q, "answer": str(rng.choice(WORDS))} for q in _records(rng, 6, 3, 9)]
    text = [{"text": t} for t in _records(rng, 3, 20, 60)]
    for name, rows in (("mc", mc), ("gen", gen), ("text", text)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    killing = ""
    if kill_marker is not None:
        (root / "killer.py").write_text(
            "import os, signal\nfrom pathlib import Path\n"
            f"MARK = Path({str(kill_marker)!r})\n"
            "def process_results(doc, results):\n"
            "    if not MARK.exists():\n"
            "        MARK.write_text('killed')\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            "    import numpy as np\n"
            "    lls = [r[0] for r in results]\n"
            "    return {'acc': float(int(np.argmax(lls)) == doc['answer'])}\n"
        )
        killing = "process_results: !function killer.process_results\n"
    (root / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n"
        + data.format(root / "mc.jsonl")
        + 'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
        + 'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        + killing
        + "metric_list:\n  - metric: acc\n"
        + ("" if killing else "  - metric: acc_norm\n")
    )
    (root / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n"
        + data.format(root / "gen.jsonl")
        + 'output_type: generate_until\ndoc_to_text: "Q: {{question}}\\nA:"\ndoc_to_target: "{{answer}}"\n'
        + 'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 12\n  do_sample: false\n'
        + "metric_list:\n  - metric: exact_match\n"
    )
    (root / "tiny_text.yaml").write_text(
        "task: tiny_text\n"
        + data.format(root / "text.jsonl")
        + 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        + "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    return root


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("hf") / "model"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(TOK),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=TOK.bos_token_id,
        eos_token_id=TOK.eos_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    TOK.save_pretrained(out)
    return out


def _evaluate(model, model_args, tasks_dir, tasks=("tiny_mc", "tiny_gen", "tiny_text"), **kw):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(tasks),
        task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True,
        **kw,
    )


def test_the_jaxloom_model_scores_and_generates_as_lm_evals_hf_model(hf_dir, tmp_path):
    """Every request's log-likelihood (1e-4), greedy flag and generated text, and every metric, equal lm-eval's
    `hf` model on the same directory — rows longer than the model's positions included (rolling windows)."""
    import jaxloom.trainer.harness as harness

    tasks = write_tasks(tmp_path / "tasks")
    hf = _evaluate("hf", f"pretrained={hf_dir},dtype=float32,device=cpu", tasks, batch_size=4)
    ours = _evaluate("jaxloom", f"pretrained={hf_dir},batch_size=4", tasks)
    for task in ("tiny_mc", "tiny_gen", "tiny_text"):
        a, b = hf["samples"][task], ours["samples"][task]
        assert len(a) == len(b) > 0
        for x, y in zip(a, b, strict=True):
            for ra, rb in zip(x["resps"], y["resps"], strict=True):
                if task == "tiny_gen":
                    assert ra == rb
                elif task == "tiny_mc":
                    assert rb[0][0] == pytest.approx(ra[0][0], rel=1e-4) and rb[0][1] == ra[0][1]
                else:
                    assert rb[0] == pytest.approx(ra[0], rel=1e-4)
        for key, value in hf["results"][task].items():
            if isinstance(value, float):
                assert ours["results"][task][key] == pytest.approx(value, rel=1e-4), (task, key)
    texts = [r["resps"][0][0] for r in ours["samples"]["tiny_gen"]]
    assert any(texts), texts  # something was generated, and equal to transformers' tokens
    scores = harness.scores(ours)
    assert set(scores) >= {"tiny_mc/acc", "tiny_mc/acc_norm", "tiny_gen/exact_match", "tiny_text/bits_per_byte"}


def test_chat_templates_and_few_shot_turns_as_lm_evals_hf_model(hf_dir, tmp_path):
    """`apply_chat_template` with one few-shot example (lm-eval's multi-turn chat): the same prompts, through the
    tokenizer's template, and the same answers as lm-eval's `hf` model."""
    tasks = write_tasks(tmp_path / "tasks")
    kw = dict(tasks=("tiny_mc", "tiny_gen"), apply_chat_template=True, num_fewshot=1, limit=4)
    hf = _evaluate("hf", f"pretrained={hf_dir},dtype=float32,device=cpu", tasks, batch_size=4, **kw)
    ours = _evaluate("jaxloom", f"pretrained={hf_dir},batch_size=4", tasks, **kw)
    for task in ("tiny_mc", "tiny_gen"):
        for x, y in zip(hf["samples"][task], ours["samples"][task], strict=True):
            assert x["arguments"] == y["arguments"]
            assert "<|user|>" in str(y["arguments"]) and str(y["arguments"]).count("<|assistant|>") >= 2
            for ra, rb in zip(x["resps"], y["resps"], strict=True):
                if task == "tiny_gen":
                    assert ra == rb
                else:
                    assert rb[0][0] == pytest.approx(ra[0][0], rel=1e-4) and rb[0][1] == ra[0][1]


def _cli(*args, timeout=600, cwd=None, env=None):
    env = {**os.environ, "XLA_FLAGS": os.environ.get("JAXLOOM_TEST_XLA_FLAGS", ""), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "jaxloom.trainer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def test_the_command_on_an_hf_directory_writes_lm_evals_results_outside_it_or_refuses(hf_dir, tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    proc = _cli("eval", str(hf_dir), "--tasks", "tiny_mc,tiny_gen", "--include-path", str(tasks), "--limit", "4",
                "--num-fewshot", "1", "--output-path", str(tmp_path / "out"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert {"lm_eval/tiny_mc/acc", "lm_eval/tiny_gen/exact_match"} <= set(said)
    assert "|tiny_mc " in proc.stdout  # lm-eval's own table
    (written,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(written.read_text())
    assert results["results"]["tiny_mc"]["acc,none"] == said["lm_eval/tiny_mc/acc"]
    assert results["n-samples"]["tiny_mc"]["effective"] == 4 and results["n-shot"]["tiny_mc"] == 1
    assert not list(hf_dir.rglob("results_*.json"))
    inside = _cli("eval", str(hf_dir), "--tasks", "tiny_mc", "--include-path", str(tasks), "--output-path", str(hf_dir))
    assert inside.returncode == 2 and "inside the model directory" in inside.stderr
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "hub_arc.yaml").write_text(
        "task: hub_arc\ndataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\noutput_type: multiple_choice\n"
        'test_split: test\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices.text}}"\ndoc_to_target: 0\n'
    )
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # CI reaches no Hub either: fail at once
    needs = _cli("eval", str(hf_dir), "--tasks", "hub_arc", "--include-path", str(hub), env=offline)
    assert needs.returncode == 2 and "needs the network" in needs.stderr, needs.stderr[-2000:]
    assert "Traceback" not in needs.stderr, needs.stderr[-2000:]  # a line, not a traceback


def test_eval_tasks_during_training_on_their_cadence_and_a_killed_evaluation_is_redone(tmp_path):
    """`eval_tasks` every 2 steps and at the end: lm_eval/ rows in metrics.jsonl, report.md's table, lm-eval's
    results JSON per step. The first evaluation SIGKILLs the run (after checkpoint 2 is saved): the rerun resumes
    from 2, runs step 2's evaluation again before training on, and each step's scores are recorded once."""
    marker = tmp_path / "killed"
    tasks = write_tasks(tmp_path / "tasks", kill_marker=marker)
    run = tmp_path / "run"
    items = [*CLI_TINY, f"save_directory={run}", "max_training_steps=4", "save_steps=2", "logging_steps=1",
             "eval_tasks=tiny_mc,tiny_gen", "eval_tasks_steps=2", "eval_tasks_limit=4", "eval_tasks_num_fewshot=1",
             f"eval_tasks_include_path={tasks}", "evaluation_steps=null", "generation_interval=null"]  # fmt: skip
    first = _cli("train", *items)
    assert first.returncode == -9 and marker.exists(), first.stderr[-3000:]
    assert (run / "checkpoints" / "2").is_dir() and not (run / "lm_eval").exists()
    again = _cli("train", str(run))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "the evaluation of step 2 (eval_tasks) was not recorded: running it again" in again.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    bench = [r for r in rows if "lm_eval/tiny_mc/acc" in r]
    assert [r["step"] for r in bench] == [2, 4] and all("lm_eval/tiny_gen/exact_match" in r for r in bench)
    for step in (2, 4):
        (written,) = (run / "lm_eval" / f"step_{step}").glob("results_*.json")
        recorded = json.loads(written.read_text())
        assert recorded["jaxloom"]["step"] == step and recorded["n-shot"]["tiny_gen"] == 1
        assert recorded["n-samples"]["tiny_mc"]["effective"] == 4  # eval_tasks_limit
    assert not list((run / "lm_eval").rglob("*.tmp"))
    report = (run / "report.md").read_text()
    assert "## Benchmarks (lm-evaluation-harness)" in report and "tiny_mc/acc" in report
    offline = _cli("eval", str(run), "--tasks", "tiny_gen", "--include-path", str(tasks), "--limit", "2", "--step", "2")
    assert offline.returncode == 0, offline.stderr[-3000:]
    said = json.loads(offline.stdout[offline.stdout.index("{") :])
    assert said["step"] == 2 and said["lm_eval/tiny_gen/exact_match"] == 0.0
    assert Path(said["results_file"]).parent == run / "lm_eval"  # a run directory keeps its own evaluations
    refused = _cli("train", *[i.replace(str(run), str(tmp_path / "r2")) for i in items], "eval_tasks=nope")
    assert refused.returncode == 2 and "['nope'] are not lm-eval tasks" in refused.stderr
    assert not (tmp_path / "r2" / "checkpoints").exists()  # refused before step 1


def test_settings_and_generation_kwargs_the_engine_does_not_have_are_refused_by_name():
    """A `model_args` key lm-eval's jaxloom model does not have, and a task's generation setting the engine does not
    have (beam search), are refused naming them — never silently dropped."""
    import types

    import jaxloom.models as jm
    from jaxloom.trainer.harness import JaxloomLM
    from util import tiny

    with pytest.raises(ValueError, match=r"model_args \['dtype'\] are not settings"):
        JaxloomLM(pretrained="somewhere", dtype="bfloat16")
    lm = JaxloomLM(model=jm.create_model(tiny(), seed=0), tokenizer=TOK)
    request = types.SimpleNamespace(args=("Q: apple\nA:", {"until": ["\n"], "num_beams": 4}))
    with pytest.raises(ValueError, match=r"generation_kwargs \['num_beams'\] of an lm-eval task"):
        lm.generate_until([request])


def test_a_new_model_scores_with_the_programs_already_compiled():
    """`set_model` (a run's next evaluation): the scores are the new weights', equal to a fresh model's, and the
    scoring program is the one compiled before."""
    import jaxloom.models as jm
    from jaxloom.trainer.harness_core import LoadedLM
    from util import tiny

    rows = [(None, [5, 6, 7, 8], [9, 10]), (None, [11, 12], [13])]
    lm = LoadedLM(model=jm.create_model(tiny(), seed=0), tokenizer=TOK, batch_size=2)
    first, program = lm._loglikelihood_tokens(rows), lm._score_fn
    other = jm.create_model(tiny(), seed=1)
    lm.set_model(other)
    again = lm._loglikelihood_tokens(rows)
    fresh = LoadedLM(model=other, tokenizer=TOK, batch_size=2)._loglikelihood_tokens(rows)
    assert lm._score_fn is program and again == fresh and again != first
