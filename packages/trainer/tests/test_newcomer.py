"""A newcomer's first hour (issue 24), driven as a user drives it: the `jaxloom` command (in process, and
as a subprocess where the working directory or the exit status matter) and the Python API on real files.
Resume says what it does; run directories are self-contained; the CLI lists and shows its settings;
summaries survive resumes; tracking continues across restarts."""

import json
import re
import os
import shutil
import signal
import time
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml
from util import CLI_TINY, CORPUS, TOK, trainer

from jaxloom.trainer import TrainingArguments
from jaxloom.trainer.cli import DEMO_CONFIG, main

TINY = [
    *CLI_TINY,
    "eval_batches=1",
    "evaluation_steps=null",
    "logging_steps=2",
    "generation_interval=null",
    "generation_prompts=[]",
]
ENV = {
    **os.environ,
    "XLA_FLAGS": f"--xla_force_host_platform_device_count=1 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}",
}


def _summary(text: str) -> dict:
    return json.loads(text[text.index("{\n") :])


def _rows(run: Path) -> list[tuple[int, str]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], next(k for k in r if k != "step").split("/")[0]) for r in rows]


def test_resume_is_explicit_and_summaries_cover_the_whole_run(tmp_path, capsys, caplog):
    run = tmp_path / "run"
    base = [*TINY, f"save_directory={run}"]
    assert main(["train", *base, "max_training_steps=4"]) == 0
    first = _summary(capsys.readouterr().out)
    assert first["step"] == 4 and first["resumed_from"] is None
    assert "steps: 0 → 4 (a new run)" in caplog.text and f"save_directory: {run}" in caplog.text  # start-up summary
    assert "attention: xla (auto, on cpu)" in caplog.text  # what `auto` picked for these short rows
    report, rows = (run / "report.md").read_text(), _rows(run)

    # the same run again: nothing to train, a distinct status, nothing rewritten or duplicated
    caplog.clear()
    assert main(["train", *base, "max_training_steps=4"]) == 4
    done = _summary(capsys.readouterr().out)
    assert done["stop_reason"].startswith("already complete") and done["final"]["loss"] == first["final"]["loss"]
    assert "already complete" in caplog.text and "Raise max_training_steps" in caplog.text
    assert _rows(run) == rows and (run / "report.md").read_text() == report

    # settings that cannot continue the run: one error listing each difference and the two ways out
    assert main(["train", *base, "max_training_steps=4", "learning_rate=1e-3", "model.hidden_size=64"]) == 2
    err = capsys.readouterr().err
    assert "learning_rate: 0.003 → 0.001" in err and "model.hidden_size: 32 → 64" in err
    assert "new save_directory" in err and "overwrite_output_dir=true" in err
    assert json.loads((run / "run_config.json").read_text())["model"]["hidden_size"] == 32  # left as it was

    # settings that can: applied and printed; the run directory stands for its config
    caplog.clear()
    assert main(["train", str(run), "max_training_steps=7", "logging_steps=1"]) == 0
    printed = capsys.readouterr().out
    out = _summary(printed)
    assert out["step"] == 7 and out["resumed_from"].endswith("/checkpoints/4")
    assert "max_training_steps: 4 → 7" in caplog.text and "logging_steps: 2 → 1" in caplog.text
    assert main(["config", "show", str(run)]) == 0  # a run directory stands for its resolved config
    assert yaml.safe_load(capsys.readouterr().out)["save_directory"] == str(run)
    assert main(["eval", str(run)]) == 0 and _summary(capsys.readouterr().out)["eval/loss"] > 0
    train_steps = [s for s, kind in _rows(run) if kind == "train"]
    assert train_steps == [2, 4, 5, 6, 7]  # the first session's rows kept once, the second's added

    # the report covers both segments: tokens and wall time of the whole run, every evaluation, versions
    report = (run / "report.md").read_text()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["train/tokens_seen"] for r in train_rows] == [s * 8 * 32 for s in train_steps]
    elapsed = [r["train/elapsed_time"] for r in train_rows]
    assert elapsed == sorted(elapsed) and elapsed[2] > elapsed[1]  # the second segment continues the first's
    assert "- steps: 7\n- tokens seen: 1,792\n- wall time training: 0:0" in report
    assert "- training data: " in report and "- evaluation data: " in report
    assert [r["step"] for r in rows if "eval/loss" in r] == [4, 7]
    assert "| 4 | " in report.split("## Eval history")[1] and "| 7 | " in report.split("## Eval history")[1]
    from importlib.metadata import version

    assert f"- jaxloom-trainer {version('jaxloom-trainer')}" in report and f"- jax {version('jax')}" in report
    assert "[train] step 6/7 eta 0:00:0" in printed and "[train] step 7/7: loss=" in printed  # without a terminal


def test_resume_keeps_history_drops_rows_past_the_checkpoint_and_plots_it_all(tmp_path):
    t = trainer(tmp_path, max_training_steps=4, save_steps=2, logging_steps=1)
    t.train()
    t.finish()
    # a kill after step 4's row but before its checkpoint: the file has a row the checkpoint does not
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "train/lo')  # and a cut line
    t = trainer(tmp_path, max_training_steps=5, save_steps=2, logging_steps=1, plot_loss=True)
    out = t.train()
    t.finish()
    steps = [r["step"] for r in t.writer.history if "train/loss" in r]
    assert out.resumed_from.endswith("/checkpoints/2") and steps == [1, 2, 3, 4, 5]
    on_disk = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in on_disk if "train/loss" in r] == [
        1,
        2,
        3,
        4,
        5,
    ]  # rows 3-4 of the killed session replaced, the cut line gone
    assert out.plot_path and Path(out.plot_path).stat().st_size > 0
    # the report ends with the last generated samples
    t = trainer(
        tmp_path, max_training_steps=6, save_steps=2, generation_prompts=["A list"], generation_max_new_tokens=2
    )
    out = t.train()
    t.finish()
    report = (tmp_path / "report.md").read_text()
    assert out.samples and out.samples[0].startswith("A list")
    assert f"## Last samples\n\n- {json.dumps(out.samples[0])}" in report


def test_python_api_without_save_directory_gets_a_new_directory_per_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    outs = []
    for lr in (1e-3, 2e-3):
        t = trainer(None, learning_rate=lr, max_training_steps=2, save_directory=None)
        outs.append((t.train(), t.arguments.save_directory))
        t.finish()
    (a, dir_a), (b, dir_b) = outs
    assert dir_a != dir_b and dir_a.startswith("jaxloom-runs/run-") and dir_b.startswith("jaxloom-runs/run-")
    assert int(a.state.step) == int(b.state.step) == 2 and b.resumed_from is None and b.metrics["loss"] is not None
    assert TrainingArguments().save_directory is None


def test_a_copied_run_directory_converts_and_generates_from_anywhere(tmp_path):
    """The run trained on a relative data file with a relative tokenizer directory; copied elsewhere, its
    directory alone rebuilds model and tokenizer (subprocesses, other working directories)."""
    work = tmp_path / "work"
    (work / "tok").mkdir(parents=True)
    TOK.save_pretrained(str(work / "tok"))
    (work / "data.jsonl").write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in CORPUS[:60]))
    cmd = [sys.executable, "-m", "jaxloom.trainer.cli"]
    train = subprocess.run(
        [
            *cmd,
            "train",
            *TINY,
            "max_training_steps=2",
            "save_directory=run",
            "data.train=data.jsonl",
            "data.tokenizer=tok",
        ],
        cwd=work,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    for noise in ("PyTorch was not found", "libtpu", "Unable to initialize backend"):  # start-up notices left out
        assert noise not in train.stderr
    assert "INFO jaxloom.trainer: training\n  model: LlamaForCausalLM" in train.stderr  # the start-up summary
    copied = tmp_path / "elsewhere" / "copied"
    shutil.copytree(work / "run", copied)
    shutil.rmtree(work)  # the data and the tokenizer are gone
    other = tmp_path / "other"
    other.mkdir()
    conv = subprocess.run(
        [*cmd, "convert", "--to-hf", str(copied), "hf"], cwd=other, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert conv.returncode == 0, conv.stderr[-3000:]
    assert (other / "hf" / "model.safetensors").is_file() and (other / "hf" / "tokenizer.json").is_file()
    gen = subprocess.run(
        [*cmd, "generate", str(copied), "--prompt", "A list", "--max-new-tokens", "3"],
        cwd=other,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert gen.returncode == 0 and gen.stdout.startswith(">>> A list\n"), gen.stderr[-3000:]
    # the same run cannot be resumed without its data, and says so by name (exit 2, not a traceback)
    again = subprocess.run(
        [*cmd, "train", str(copied), "max_training_steps=3"],
        cwd=other,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 2 and "data.jsonl" in again.stderr, again.stderr[-3000:]


def test_ctrl_c_after_a_clean_save_exits_130(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxloom.trainer.cli",
            "train",
            *TINY,
            "max_training_steps=100000",
            "logging_steps=1",
            f"save_directory={tmp_path / 'run'}",
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:
        if line.startswith("[train] step 2/100000"):
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.communicate(timeout=240)[0]
    assert proc.returncode == 130, rest[-3000:]
    summary = _summary(rest)
    assert summary["stop_reason"] == "stop signal received"
    assert (tmp_path / "run" / "checkpoints" / str(summary["step"])).is_dir()
    # the way out is short (issue 42: an evaluation and previews ran first, ~10 s): saved, plotted, reported
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not any("eval/loss" in r for r in rows) and (tmp_path / "run" / "report.md").is_file()
    assert f"is saved: `jaxloom train {tmp_path / 'run'}` (or the same command again) resumes it" in rest


def test_the_cli_lists_and_shows_its_settings(tmp_path, capsys):
    for argv in (["--version"], ["train", "--help"]):
        try:
            main(argv)
        except SystemExit as e:
            assert e.code == 0
    out = capsys.readouterr().out
    from importlib.metadata import version

    assert f"\njaxloom-trainer {version('jaxloom-trainer')}\n" in out and "jaxloom config keys" in out
    assert main(["config", "keys"]) == 0
    keys = capsys.readouterr().out
    for f in TrainingArguments.fields():
        assert f"{f['name']}: {f['type']} = {f['default']!r}  {f['doc']}" in keys
    assert "model.rope_theta: " in keys and "data.train: str | list[str]" in keys  # data keys typed (issue 51)
    assert "data.eval_fraction: float = 0.05" in keys
    # keys of several kinds (beta, loss_type, ref_model, the sampling settings) each under its kind, with that kind's
    # default (issue 51)
    assert "beta: float = 0.1  DPO" in keys and "beta: float = 1.0  distillation" in keys
    assert (keys.count("[dpo]"), keys.count("[kto]"), keys.count("[grpo]"), keys.count("[distillation]")) == (
        4,
        4,
        8,
        6,
    )
    assert "# kto (trainer=kto only" in keys
    assert "# distillation (trainer=distillation only" in keys
    assert "# rl (trainer=grpo and rloo" in keys and "# preference (trainer=dpo only" in keys
    assert "normalize_advantages: bool = False" in keys and "[rloo]" in keys
    # what config keys left out or claimed wrongly (issue 42): the pretrained model, TRL's names, the --ray keys
    assert "model.from_pretrained: str = None  a local Hugging Face model directory" in keys and "HUB_ID" not in keys
    assert "max_length: the same as max_sequence_length" in keys and "max_steps: the same as max_training_steps" in keys
    assert "per_device_train_batch_size: refused; use total_batch_size" in keys
    assert "--ray num_workers: " in keys or "pip install jaxloom-ray" in keys
    assert main(["config", "show", "learning_rate=1e-5", "model.rms_norm_eps=1e-6"]) == 0
    text = capsys.readouterr().out
    shown = yaml.safe_load(text)
    assert shown["learning_rate"] == 1e-5 and shown["model"]["rms_norm_eps"] == 1e-6
    assert TrainingArguments(**{k: v for k, v in shown.items() if k not in ("model", "data")}).learning_rate == 1e-5
    assert "# adam_beta2: 0.95" in text and shown["data"]["train"] == "bundled"  # defaults and the demo's data
    assert "#   scheduler: the demo's config" in text  # where what the user did not give comes from
    assert main(["config", "show", "learning_rate=fast"]) == 2


def test_floats_written_as_1e_5_train_from_yaml_and_the_command_line(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    extra = {"learning_rate": "1e-5", **dict(x.split("=", 1) for x in TINY if not x.startswith("model."))}
    kept = [ln for ln in DEMO_CONFIG.read_text().splitlines() if ln.split(":", 1)[0] not in extra]  # each key once
    config.write_text("\n".join(kept) + "\n" + "\n".join(f"{k}: {v}" for k, v in extra.items()) + "\n")
    assert (
        main(
            [
                "train",
                str(config),
                "model.rms_norm_eps=1e-5",
                "--model.rope_theta",  # HF's / argparse's forms: --key value and --key=value
                "1e6",
                "model.hidden_size=32",
                "model.intermediate_size=64",
                "model.num_hidden_layers=1",
                "--max-training-steps=1",
                f"save_directory={tmp_path / 'run'}",
            ]
        )
        == 0
    )
    out = _summary(capsys.readouterr().out)
    saved = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert out["step"] == 1 and saved["learning_rate"] == 1e-5 and saved["model"]["rope_theta"] == 1e6


def test_tensorboard_hparams_and_one_wandb_run_across_resumes(tmp_path, monkeypatch):
    from tensorboardX.proto import plugin_hparams_pb2
    from test_tbevents import read_events

    inits = []
    fake = types.ModuleType("wandb")  # stands in for wandb (an optional extra): records what it is given
    fake.init = lambda **kw: inits.append(kw) or types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for steps in (2, 3):
        t = trainer(tmp_path, max_training_steps=steps, use_wandb=True, use_tensorboard=True, learning_rate=2e-3)
        t.train()
        t.finish()
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"] and inits[1]["resume"] == "allow"
    assert inits[0]["name"] == tmp_path.name and inits[0]["config"]["learning_rate"] == 2e-3
    assert inits[0]["config"]["model.hidden_size"] == 32

    starts = []
    for path in sorted((tmp_path / "tensorboard").iterdir()):
        for event in read_events(path):
            for v in event.summary.value:
                if v.tag == "_hparams_/session_start_info":
                    data = plugin_hparams_pb2.HParamsPluginData.FromString(v.metadata.plugin_data.content)
                    starts.append(data.session_start_info.hparams)
    assert starts and starts[0]["learning_rate"].number_value == 2e-3
    assert starts[0]["optimizer"].string_value == "adamw" and starts[0]["packing"].bool_value is True


def test_what_a_resume_may_and_may_not_change():
    """`resume.compare` on identities as checkpoints record them: the model, tokenizer, training data and
    optimizer are the run; steps, cadences and runtime are not. Unrecorded parts (older checkpoints) pass."""
    import datasets

    from jaxloom.trainer.resume import compare, data_identity, run_identity

    from util import tiny

    base = run_identity(TrainingArguments(learning_rate=1e-3), tiny(), TOK, ["a.jsonl"])
    same = run_identity(
        TrainingArguments(learning_rate=1e-3, max_training_steps=9, remat="full"), tiny(), TOK, ["a.jsonl"]
    )
    assert compare(base, same) == ([], ["max_training_steps: null → 9", "remat: null → 'full'"])
    other = run_identity(TrainingArguments(learning_rate=1e-3, seed=1), tiny(hidden=64), TOK, ["b.jsonl"])
    fixed, _ = compare(base, other)
    assert "seed: 42 → 1" in fixed and "model.hidden_size: 32 → 64" in fixed
    assert any(line.startswith("training data: ") for line in fixed)
    assert compare({"arguments": base["arguments"]}, other)[0] == ["seed: 42 → 1"]  # model etc. not recorded
    ds = datasets.Dataset.from_dict({"text": ["a", "b"]})
    assert data_identity(ds) == data_identity(datasets.Dataset.from_dict({"text": ["a", "b"]}))
    assert data_identity(ds) != data_identity(datasets.Dataset.from_dict({"text": ["a", "c"]}))
    assert data_identity([{"text": "a"}]) != data_identity([{"text": "b"}])


def _model_with_its_own_tokenizer(path: Path, vocab: int = 300) -> None:
    """A tiny HF Llama directory with a tokenizer of its own (not the bundled one: another vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    import jaxloom.data as jd
    import jaxloom.models as jm

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    texts = [r["text"] for r in jd.JsonlSource(jd.bundled_corpus_path()).read_shard(str(jd.bundled_corpus_path()))]
    special = ["<unk>", "<s>", "</s>", "<pad>"]
    tok.train_from_iterator(texts[:200], trainers.BpeTrainer(vocab_size=vocab, special_tokens=special))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    config = jm.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    jm.save_hf_model(jm.create_model(config, seed=0), path)  # the directory whole, then its tokenizer beside
    fast.save_pretrained(str(path))


def test_a_pretrained_model_brings_its_own_tokenizer(tmp_path):
    """`jaxloom train model.from_pretrained=DIR` with no tokenizer chosen trained with the demo's bundled
    tokenizer, recorded "bundled" and exported it (issue 42). The model directory is the source of truth:
    its tokenizer is used, recorded and copied; `data.tokenizer=...` still chooses another."""
    from jaxloom.trainer.compose import build_run

    model_dir = tmp_path / "model"
    _model_with_its_own_tokenizer(model_dir)
    base = [f"model.from_pretrained={model_dir}", "max_training_steps=1", "max_sequence_length=32"]
    trainer, resolved = build_run(None, [*base, f"save_directory={tmp_path / 'run'}"])
    own = len(trainer.tokenizer)
    assert own < 4096 and resolved["data"]["tokenizer"] == str(model_dir.absolute())
    chosen, _ = build_run(None, [*base, "data.tokenizer=bundled", f"save_directory={tmp_path / 'b'}"])
    assert len(chosen.tokenizer) == 4096
    with pytest.raises(ValueError, match="a pretrained model's tokenizer is its own"):  # 4096 > the model's 300
        chosen.configure_dataloaders()


def test_key_value_forms_of_hf_and_argparse(capsys):
    from jaxloom.trainer.cli import key_value_forms

    got = key_value_forms(
        ["train", "c.yaml", "--learning_rate=1e-3", "--max-steps", "5", "x=1", "--ray", "num_workers=2"]
    )
    assert got == ["train", "c.yaml", "learning_rate=1e-3", "max_steps=5", "x=1", "--ray", "num_workers=2"]
    assert key_value_forms(["generate", "--prompt", "hi"]) == ["generate", "--prompt", "hi"]  # its own options
    assert main(["train", "--learning_rate"]) == 2
    assert "--learning_rate needs a value: --learning_rate=VALUE" in capsys.readouterr().err


def test_the_program_re_runs_itself_for_huge_pages_before_it_computes(monkeypatch, capsys):
    """`jaxloom train|eval|plan|generate|convert` (the program, sys.argv) re-runs itself with glibc asking for huge
    pages (jaxloom.core.host, which has the re-run's own test); `config`, a Ray driver and a call from Python
    (`main([...])`) do not."""
    from jaxloom.trainer import cli

    calls = []
    monkeypatch.setattr(cli.host, "reexec_with_hugepages", lambda: calls.append(list(sys.argv)))
    for argv in (["jaxloom", "train", "--learning_rate"], ["jaxloom", "plan", "--learning_rate"]):
        monkeypatch.setattr(sys, "argv", argv)
        assert cli.main() == 2  # then parsed as always (a bad setting here)
    assert calls == [["jaxloom", "train", "--learning_rate"], ["jaxloom", "plan", "--learning_rate"]]
    for argv in (["jaxloom", "config", "keys"], ["jaxloom", "train", "--learning_rate", "--ray", "num_workers=2"]):
        monkeypatch.setattr(sys, "argv", argv)
        cli.main()
    assert cli.main(["train", "--learning_rate"]) == 2
    assert len(calls) == 2
    capsys.readouterr()
    monkeypatch.undo()  # the real re-run: an unreadable opt-out is one clear error before anything runs
    monkeypatch.setattr(sys, "argv", ["jaxloom", "train"])
    monkeypatch.setenv("JAXLOOM_HUGEPAGES", "nope")
    assert cli.main() == 2
    assert "JAXLOOM_HUGEPAGES='nope'; expected 0, false, no or off" in capsys.readouterr().err


def test_a_pretrained_model_without_a_config_file_gets_fine_tuning_defaults(tmp_path, caplog):
    """The demo's pretraining settings (lr 3e-3, warmup 30, previews) are not a fine-tune's: a run from
    model.from_pretrained with no config file takes TRL's defaults for its job (SFT 2e-5, DPO 1e-6, linear, no
    warmup, no weight decay, no previews) and says so; what the command line gives wins; the demo keeps its own."""
    import logging

    from jaxloom.trainer.compose import FINETUNE_DEFAULTS, build_run

    model_dir = tmp_path / "model"
    _model_with_its_own_tokenizer(model_dir)
    base = [f"model.from_pretrained={model_dir}", "max_training_steps=1", "max_sequence_length=32"]
    with caplog.at_level(logging.INFO, logger="jaxloom"):
        sft, resolved = build_run(None, [*base, f"save_directory={tmp_path / 'sft'}"])
    a = sft.arguments
    assert (a.learning_rate, a.scheduler, a.warmup_steps, a.weight_decay) == (2e-5, "linear", 0, 0.0)
    assert not a.generation_prompts and resolved["learning_rate"] == 2e-5
    assert re.search(r"learning_rate +\= 2e-05  \(fine-tuning defaults \(TRL's\)\)", caplog.text)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "chosen": " b", "rejected": " c"}) + "\n")
    dpo, _ = build_run(None, [*base, "trainer=dpo", f"data.train={pairs}", f"save_directory={tmp_path / 'dpo'}"])
    assert dpo.arguments.learning_rate == FINETUNE_DEFAULTS["dpo"]["learning_rate"] == 1e-6
    mine, _ = build_run(None, [*base, "learning_rate=1e-4", f"save_directory={tmp_path / 'mine'}"])
    assert mine.arguments.learning_rate == 1e-4 and mine.arguments.scheduler == "linear"
    demo, _ = build_run(None, ["max_training_steps=1", f"save_directory={tmp_path / 'demo'}"])
    assert demo.arguments.learning_rate == 3e-3 and demo.arguments.generation_prompts

    # nothing of the demo's run is kept (300 steps, 16 rows of 128 tokens, logging every 25): the data's epochs
    # (num_train_epochs honoured), TRL's 8 rows and logging every 10, rows as long as the model's positions allow
    records = tmp_path / "forty.jsonl"
    records.write_text("".join(json.dumps({"text": f"record {i} " * 5}) + "\n" for i in range(40)))
    plain = [f"model.from_pretrained={model_dir}", f"data.train={records}", f"save_directory={tmp_path / 'ft'}"]
    with caplog.at_level(logging.INFO, logger="jaxloom"):
        ft, resolved = build_run(None, plain)
    a = ft.arguments
    assert (a.max_training_steps, a.num_train_epochs, a.total_batch_size, a.logging_steps) == (None, 3, 8, 10)
    assert a.max_sequence_length == 64 == resolved["max_sequence_length"]  # min(TRL's 1024, the model's 64)
    # every setting the user did not give is said with where it came from (issue 51)
    assert re.search(r"max_sequence_length +\= 64  \(TRL's max_length 1024, within the model's", caplog.text)
    assert re.search(r"total_batch_size +\= 8  \(fine-tuning defaults \(TRL's\)\)", caplog.text)
    one, _ = build_run(None, [*plain, "num_train_epochs=1", "max_length=48"])
    assert one.arguments.num_train_epochs == 1 and one.arguments.max_sequence_length == 48
    assert 0 < one.total_steps < 40 and ft.total_steps == ft.batches.steps_for_epochs() < 300  # epochs, not 300


def test_a_mixture_is_described_by_its_parts_and_weights(tmp_path):
    """The start-up summary and the report said "Mixture" (issue 42): each part's path and its share."""
    import jaxloom.data as jd
    from jaxloom.trainer.export import describe_data
    from jaxloom.trainer.resume import data_identity

    mix = jd.Mixture(
        [{"path": str(tmp_path / "code.jsonl"), "weight": 3}, {"path": str(tmp_path / "web.jsonl"), "weight": 1}]
    )
    text = describe_data(data_identity(mix), mix)
    assert text == f"a mixture of {tmp_path / 'code.jsonl'} (75%), {tmp_path / 'web.jsonl'} (25%)"


def test_eval_fraction_with_data_of_ones_own_is_not_silently_ignored(tmp_path, caplog):
    """`data.eval_fraction` holds out part of the bundled corpus only: asked for on the command line with other
    data it is an error naming data.eval; from a config file (a copy of the demo's) a warning says it."""
    import logging

    from jaxloom.trainer.compose import build_run

    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20)))
    base = [f"data.train={mine}", "max_training_steps=1", f"save_directory={tmp_path / 'run'}"]
    with pytest.raises(
        ValueError, match="data.eval_fraction = 0.2 holds out part of the bundled corpus only.*data.eval=FILE"
    ):
        build_run(None, [*base, "data.eval_fraction=0.2"])
    with caplog.at_level(logging.WARNING, logger="jaxloom"):
        build_run(str(DEMO_CONFIG), base)
    assert "data.eval_fraction = 0.05 holds out part of the bundled corpus only" in caplog.text


def test_ctrl_c_during_setup_or_the_first_compile_is_one_line(tmp_path):
    """Ctrl-C before step 1 (setup, the first compile in the background) printed a 124-line KeyboardInterrupt
    traceback (issue 43): one line saying nothing was lost, exit 130, at once (the compile thread is not waited
    for). Python raises KeyboardInterrupt in the main thread on SIGINT; here it is raised where setup runs."""
    code = (
        "import sys\n"
        "import jaxloom.trainer.setup as t\n"
        "def interrupted(self):\n    raise KeyboardInterrupt\n"
        "t.Setup.initialize_trainer_utils = interrupted\n"
        "from jaxloom.trainer.cli import main\n"
        f"sys.exit(main(['train', *{TINY!r}, 'max_training_steps=3', 'save_directory={tmp_path / 'run'}']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "jaxloom: interrupted before training began: nothing was trained" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_run_directory_removed_mid_run_gets_its_files_back(tmp_path):
    """`rm -rf RUN` while training: the run went on and saved its checkpoint, but run_config.json, the tokenizer
    copy and metrics.jsonl were never written again, so the run could not be converted or resumed by directory
    (issue 43). After the next checkpoint they are there again (the metrics with the whole history)."""
    from jaxloom.trainer.compose import build_run

    run = tmp_path / "run"
    overrides = [*TINY, "max_training_steps=4", "save_steps=2", "logging_steps=1", f"save_directory={run}"]
    trainer_, resolved = build_run(None, overrides)
    trainer_.run_config = resolved

    def wipe(run_, step):
        if step == 3:  # between saves (a save in flight whose folder is removed fails, with one clear error)
            run_.checkpoints.wait_until_finished()
            shutil.rmtree(run)

    trainer_.add_callback(wipe, every=1, name="rm -rf")
    trainer_.train()
    trainer_.finish()
    assert (run / "run_config.json").is_file() and (run / "tokenizer" / "tokenizer.json").is_file()
    steps = [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert {1, 2, 3, 4} <= set(steps)
    assert main(["convert", "--to-hf", str(run), str(tmp_path / "hf")]) == 0


def test_bad_data_is_named_at_its_first_line_before_the_run_starts_and_leaves_no_run_directory(tmp_path, capsys):
    """Every line bad: the error named line 2 of a shuffled order, came after the run's banner, and left a
    half-made run directory (issue 51): the first bad line in file order, before anything is written."""
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps({"text": i}) + "\n" for i in range(20)))
    run = tmp_path / "run"
    argv = ["train", f"data.train={data}", "max_training_steps=2", *CLI_TINY, f"save_directory={run}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{data}:1: column 'text' holds int" in err and "model: LlamaForCausalLM" not in err
    assert not run.exists()  # nothing was trained: nothing is left behind
    # a model directory that does not exist is named as missing (it said "no config.json"; issue 51)
    assert main(["train", f"model.from_pretrained={tmp_path / 'nope'}", f"save_directory={run}"]) == 2
    assert f"model.from_pretrained = '{tmp_path / 'nope'}' does not exist" in capsys.readouterr().err
    (run / "mine").mkdir(parents=True)  # a directory the user made: kept, whatever happens
    assert main(argv) == 2 and (run / "mine").is_dir()


def test_data_prepare_conflicts_are_one_line_and_write_nothing(tmp_path, capsys):
    """A prepare resumed after its source changed, and a second prepare while another writes the same store, were
    `FileExistsError` tracebacks (issue 52): one line each, exit 2, the unfinished store left as it was."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(40)))
    partial = tmp_path / "store.partial"
    partial.mkdir()
    files = {str(data): [data.stat().st_size, data.stat().st_mtime_ns - 1]}  # begun before the last edit
    (partial / "plan.json").write_text(json.dumps({"source_files": files}))
    before = sorted(p.name for p in partial.iterdir())
    capsys.readouterr()
    assert main(["data", "prepare", str(data), str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxloom: error: ") and "which has changed since" in err, err
    assert sorted(p.name for p in partial.iterdir()) == before and not (tmp_path / "store").exists()

    (partial / "plan.json").unlink()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (partial / "prepare.lock").write_text(str(sleeper.pid))  # another prepare, alive, writes it
        assert main(["data", "prepare", str(data), str(tmp_path / "store")]) == 2
    finally:
        sleeper.kill()
        sleeper.wait()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"being written by another `jaxloom data prepare` (pid {sleeper.pid})" in err
    assert not (tmp_path / "store").exists()


def test_ctrl_c_during_data_prepare_stops_at_once_and_the_same_command_continues(tmp_path):
    """Ctrl-C during `jaxloom data prepare` was sometimes swallowed and the prepare ran on to exit 0 (issue 43):
    it exits 130 at once saying what is kept, and the same command finishes the store."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 30}) + "\n" for i in range(3000)))
    code = (
        "import sys, time\n"
        "import jaxloom.data.store_prepare as s\n"
        "real = s._tokenize_unit\n"
        "def slow(args, **kw):\n    time.sleep(0.3)\n    return real(args, **kw)\n"
        "s._tokenize_unit = slow\n"
        "units = s._units\n"
        "s._units = lambda source, unit_bytes: units(source, 16384)  # many small units\n"
        "from jaxloom.trainer.cli import main\n"
        f"sys.exit(main(['data', 'prepare', {str(data)!r}, {str(tmp_path / 'store')!r}]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    partial = tmp_path / "store.partial"
    deadline = time.monotonic() + 120
    while not list(partial.glob("*.done.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "prepare interrupted (signal 2): its finished units are kept" in err and "Traceback" not in err
    assert main(["data", "prepare", str(data), str(tmp_path / "store")]) == 0


def test_the_versions_in_reports_name_every_installed_part():
    from importlib.metadata import distributions

    from jaxloom.trainer.report import versions

    installed = {}
    for dist in distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "jaxloom" or name.startswith("jaxloom-"):
            installed[name] = dist.version
    assert versions() == installed and "jaxloom-trainer" in installed
    assert versions(libraries=True)["jax"] == __import__("jax").__version__
