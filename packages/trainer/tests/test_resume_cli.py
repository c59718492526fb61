import json
import re
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from util import CLI_TINY

from jaxloom.trainer.cli import main
from jaxloom.trainer.compose import DEMO_CONFIG, build_run

WORKER = Path(__file__).with_name("run_worker.py")


def run(out, kill_after=None, mode="sync", extra=(), drop_env=()):
    err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe nobody reads until the end (it can fill)
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}",
    }  # now: an emulator's endpoint
    for key in drop_env:
        env.pop(key, None)
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(out), mode, *extra], stdout=subprocess.PIPE, stderr=err, text=True, env=env
    )
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if kill_after and line.strip() == f"STEP {kill_after}":
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=300)
    err.seek(0)
    with err:
        return proc, lines, err.read()


def resumes_bitwise(tmp_path, extra, kill_after=7, checkpoint=4):
    """Run the worker with `extra` overrides uninterrupted (`tmp_path/ref`) and killed by SIGKILL after step
    `kill_after`, then again (`tmp_path/run`): the second start resumes from `checkpoint` and ends with the
    uninterrupted run's parameters bit for bit. Returns both runs' final parameters."""
    ref, _, err = run(tmp_path / "ref", extra=extra)
    assert ref.returncode == 0, err[-3000:]
    killed, _, _ = run(tmp_path / "run", kill_after=kill_after, extra=extra)
    assert killed.returncode == -signal.SIGKILL
    again, _, err = run(tmp_path / "run", extra=extra)
    assert again.returncode == 0, err[-3000:]
    assert f"resumed from checkpoint {tmp_path / 'run'}/checkpoints/{checkpoint}" in err
    a, b = np.load(tmp_path / "ref" / "final.npz"), np.load(tmp_path / "run" / "final.npz")
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    return a, b


def data_overrides(kind, tmp_path):
    """The bundled records in memory, the bundled JSONL streamed in blocks, or a token store of it."""
    import jaxloom.data as jd

    if kind == "records":
        return []
    blocks = ["shuffle_buffer_size=64"]  # ~20 blocks: the kill lands mid-file
    if kind == "stream":
        return [f"data.train={jd.bundled_corpus_path()}", *blocks]
    jd.prepare(jd.bundled_corpus_path(), tmp_path / "store", progress=False)
    return [f"data.train={tmp_path / 'store'}", *blocks]


@pytest.fixture(scope="module")
def stream_reference(tmp_path_factory):
    """One uninterrupted run on the bundled JSONL streamed in blocks: the end every run below reaches, whether its
    data is that file, a token store of it or the same file in a bucket (one data order, whatever the source)."""
    out = tmp_path_factory.mktemp("stream-reference")
    ref, _, err = run(out, extra=data_overrides("stream", out))
    assert ref.returncode == 0, err[-3000:]
    return np.load(out / "final.npz")


# async saves (the default) killed at random steps: tests/reliability/test_faults.py
@pytest.mark.parametrize("kill_after, mode, data", [(7, "sync", "stream"), (7, "sync", "store")])
def test_sigkill_then_resume_ends_bitwise_equal(tmp_path, kill_after, mode, data, stream_reference):
    """Killed after step 7 and resumed: the end of the uninterrupted run on the streamed file, bitwise (a token
    store of the file trains exactly as the file does)."""
    extra = data_overrides(data, tmp_path)
    killed, _, _ = run(tmp_path / "run", kill_after=kill_after, mode=mode, extra=extra)
    assert killed.returncode == -signal.SIGKILL
    again, lines, err = run(tmp_path / "run", mode=mode, extra=extra)
    assert again.returncode == 0, err[-3000:]
    resumed = [line for line in lines if line.startswith("RESUMED_FROM")][0]
    step = int(resumed.rsplit("/", 1)[-1]) if "checkpoints/" in resumed else None
    if mode == "sync":  # a synchronous save is complete when save() returns: step 4 must be there
        assert step is not None and step % 4 == 0 and 0 < step <= kill_after, resumed
    if step is None:  # async: the kill may beat the first finalisation; then the log must say so
        assert "no complete checkpoint" in err and "starting from scratch" in err
    else:
        assert f"resumed from checkpoint {tmp_path / 'run'}/checkpoints/{step}" in err
    a, b = stream_reference, np.load(tmp_path / "run" / "final.npz")
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_data_and_checkpoints_on_gcs_sigkill_then_resume_ends_bitwise_equal(tmp_path, stream_reference):
    """A real GCS server on loopback: the training JSONL is streamed from the bucket, checkpoints go there
    (checkpoint_directory=gs://...), the run's logs stay local; a run killed mid-training resumes from the
    bucket to the same end as an uninterrupted run on the same file read locally."""
    import fsspec

    import jaxloom.data as jd
    from jaxloom.state.testing import gcs_emulator

    with gcs_emulator() as bucket:
        fs, _ = fsspec.core.url_to_fs(bucket)
        fs.put_file(str(jd.bundled_corpus_path()), f"{fs._strip_protocol(bucket)}/data/corpus.jsonl")
        data = [f"data.train={bucket}/data/corpus.jsonl", "shuffle_buffer_size=64"]
        extra = [*data, f"checkpoint_directory={bucket}/runs/a"]
        killed, _, err = run(tmp_path / "run", kill_after=7, extra=extra)
        assert killed.returncode == -signal.SIGKILL, err[-3000:]
        os.environ["EXPORT_TO"] = f"{bucket}/hf"  # the resumed run's HF export, written into the bucket
        try:
            again, lines, err = run(tmp_path / "run", extra=extra)
        finally:
            del os.environ["EXPORT_TO"]
        assert again.returncode == 0, err[-3000:]
        resumed = [line for line in lines if line.startswith("RESUMED_FROM")][0]
        assert resumed.startswith(f"RESUMED_FROM {bucket}/runs/a/") and resumed.rsplit("/", 1)[-1] in ("4", "8")
        assert not (tmp_path / "run" / "checkpoints").exists()  # nothing local but the run's logs
        fs.get(f"{fs._strip_protocol(bucket)}/hf/", str(tmp_path / "hf") + "/", recursive=True)
    import jaxloom.models as jm

    exported = jm.to_hf_state_dict(jm.from_pretrained(tmp_path / "hf"))
    a, b = stream_reference, np.load(tmp_path / "run" / "final.npz")  # the bucket's file trains as the local one
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    embed = np.asarray(exported["model.embed_tokens.weight"])
    assert any(np.array_equal(embed, b[k]) for k in b), "the export holds that run's final parameters"


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """One uninterrupted local run (the default demo's tiny settings), the end every resumed run must reach."""
    out = tmp_path_factory.mktemp("reference")
    ref, _, err = run(out)
    assert ref.returncode == 0, err[-3000:]
    return np.load(out / "final.npz")


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_run_directory_on_a_store_sigkill_then_resume_ends_bitwise_equal(tmp_path, scheme, reference_run):
    """save_directory is a bucket URI (a real S3 / GCS server on loopback): the lock is a lease object there,
    checkpoints, metrics, config, tokenizer, report, plot and TensorBoard events all land in the bucket, nothing
    in a shared local folder. A run killed mid-training is resumed by `jaxloom train <uri>`'s own resolution of
    the run directory (its config and tokenizer read from the bucket) to the uninterrupted run's end, bitwise;
    its metrics continue the killed run's history; the lease is gone once the run ends."""
    import fsspec

    from jaxloom.state.testing import gcs_emulator, s3_server
    from jaxloom.trainer.compose import split_target

    with (s3_server if scheme == "s3" else gcs_emulator)() as bucket:
        uri = f"{bucket}/runs/a"
        extra = ["use_tensorboard=true", "plot_loss=true"]
        drop = ()
        if scheme == "s3":  # the endpoint given as a setting, not by the environment: storage_endpoint_url acts
            extra.append(f"storage_endpoint_url={os.environ['AWS_ENDPOINT_URL']}")
            drop = ("AWS_ENDPOINT_URL",)
        os.environ["FINAL_TO"] = str(tmp_path)
        try:
            # async saves, killed as step 8's checkpoint is being uploaded (the save callback runs before the hook
            # that prints STEP 8): an upload cut off mid-way
            killed, _, err = run(uri, kill_after=8, mode="async", extra=extra, drop_env=drop)
            assert killed.returncode == -signal.SIGKILL, err[-3000:]
            fs, root = fsspec.core.url_to_fs(uri)
            names = {p[len(root) + 1 :] for p in fs.find(root)}
            assert "run_config.json" in names and "tokenizer/tokenizer.json" in names, sorted(names)
            assert ".jaxloom.lock" in names  # the dead run's lease
            complete = sorted(
                int(n.split("/")[1]) for n in names if re.fullmatch(r"checkpoints/\d+/commit_success.txt", n)
            )
            config, items = split_target([uri])  # what `jaxloom train <uri>` resumes from
            assert json.loads(Path(config).read_text())["save_directory"] == uri
            again, lines, err = run(uri, mode="async", extra=extra, drop_env=drop)
        finally:
            del os.environ["FINAL_TO"]
        assert again.returncode == 0, err[-3000:]
        resumed = [line for line in lines if line.startswith("RESUMED_FROM")][0]
        # the newest step whose commit marker was written before the kill; a step cut off is never chosen
        assert resumed == (f"RESUMED_FROM {uri}/checkpoints/{complete[-1]}" if complete else "RESUMED_FROM None")
        names = {p[len(root) + 1 :] for p in fs.find(root, refresh=True)}
        assert {"report.md", "loss.png", "metrics.jsonl"} <= names and ".jaxloom.lock" not in names, sorted(names)
        assert [n for n in names if n.startswith("tensorboard/events.out.tfevents")]
        rows = [json.loads(line) for line in fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()]
        logged = [r["step"] for r in rows if "train/loss" in r]
        assert logged == sorted(set(logged)) and logged[-2:] == [12, 16] and set(logged) <= {4, 8, 12, 16}, rows
    b = np.load(tmp_path / "final.npz")
    for k in reference_run:
        np.testing.assert_array_equal(reference_run[k], b[k], err_msg=k)


def test_shipped_configs_parse():
    configs = sorted(DEMO_CONFIG.parent.glob("*.yaml"))
    assert configs
    for c in configs:
        trainer, _ = build_run(
            str(c),
            [
                "max_training_steps=1",
                "model.num_hidden_layers=1",
                "model.hidden_size=32",
                "model.intermediate_size=64",
                "save_directory=/tmp/jaxloom-parse-test",
                "resume_if_possible=false",
            ],
        )
        assert trainer.configure_model().state.params and trainer.total_steps == 1


def test_cli_train_plan_convert_and_errors(tmp_path, capsys):
    tiny = [
        f"save_directory={tmp_path}",
        "max_training_steps=4",
        *CLI_TINY,
        "eval_batches=2",
        "evaluation_steps=null",
    ]
    assert main(["train", *tiny]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{\n") :])["stop_reason"] == "max_training_steps reached"
    assert (tmp_path / "report.md").is_file() and (tmp_path / "checkpoints" / "4").is_dir()
    assert main(["eval", *tiny]) == 0  # the run's newest checkpoint, evaluated
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{\n") :])["eval/loss"] > 0
    # `config show` with the same arguments is the config that ran, as run_config.json records it (issue 51)
    assert main(["config", "show", *tiny]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    recorded = json.loads((tmp_path / "run_config.json").read_text())
    assert shown == recorded
    assert main(["plan", *tiny]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out[out.index("{\n") :])
    assert plan["parameters"] > 0 and plan["flops_per_token"] > 0 and plan["memory_per_device"]["total_gb"] > 0
    assert main(["convert", "--to-hf", str(tmp_path), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()
    capsys.readouterr()
    for source in (str(tmp_path), str(tmp_path / "hf")):  # a run directory and an HF directory
        assert main(["generate", source, "--prompt", "The list", "--max-new-tokens", "4"]) == 0
        assert capsys.readouterr().out.startswith(">>> The list\n")  # the prompt apart from the completion
    # sampling: each prompt and each sample its own key (the same prompt twice differs), one seed reproduces all
    argv = ["generate", str(tmp_path), "--prompt", "The list", "--prompt", "The list", "--temperature", "1.0"]
    argv += ["--num-return-sequences", "2", "--max-new-tokens", "6", "--seed", "3"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    lines = first.splitlines()
    assert [x[:4] for x in lines] == [">>> ", "[1] ", "[2] ", ">>> ", "[1] ", "[2] "], lines
    assert len({x[4:] for x in lines if x.startswith("[")}) == 4, lines
    assert main(argv) == 0 and capsys.readouterr().out == first
    assert main(["generate", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    # eval of a run without a checkpoint is an error, never the score of a random model
    empty = [f"save_directory={tmp_path / 'empty'}", *tiny[1:]]
    assert main(["eval", *empty]) == 2 and "no checkpoint under" in capsys.readouterr().err
    assert main(["train", *tiny, "learnig_rate=1"]) == 2
    assert "did you mean 'learning_rate'" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert main(["train", *tiny, "model.model_type=gpt9"]) == 2


def test_ray_launcher_is_found_by_entry_point_and_missing_is_clear(monkeypatch, capsys):
    """`--ray` is looked up in the `jaxloom.launchers` entry points (the trainer imports no later part);
    without jaxloom-ray installed the command says what to install."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])
    assert main(["train", "max_training_steps=1", "--ray", "num_workers=1"]) == 2
    assert "--ray needs the jaxloom-ray package" in capsys.readouterr().err


def test_data_prepare_then_train_on_a_mixture_of_a_store_and_a_stream(tmp_path, capsys):
    """`jaxloom data prepare` makes a store; a config trains on a weighted mixture of it and a JSONL file,
    and the metrics carry each part's share of the tokens."""
    import jaxloom.data as jd

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} " + "words " * (i % 9)}) + "\n" for i in range(400)))
    assert main(["data", "prepare", str(corpus), str(tmp_path / "store")]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["documents"] == 400 and printed["tokens"] > 400 and jd.is_store(tmp_path / "store")
    assert main(["data", "prepare", str(corpus), str(tmp_path / "s2"), "--num-proc", "0"]) == 2
    assert "--num-proc 0; expected a positive integer" in capsys.readouterr().err
    assert main(["data", "prepare", str(tmp_path / "nothing*.jsonl"), str(tmp_path / "s3")]) == 2
    config = tmp_path / "mix.yaml"
    config.write_text(
        "model: {num_attention_heads: 4, num_key_value_heads: 2}\ndata:\n  train:\n"
        f"    - {{path: {tmp_path / 'store'}, weight: 3}}\n"
        f"    - {{path: {jd.bundled_corpus_path()}, weight: 1}}\n"
    )
    run = [str(config), f"save_directory={tmp_path / 'run'}", "max_training_steps=4", "logging_steps=4", *CLI_TINY]
    assert main(["train", *run]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    shares = [r for r in rows if "train/data_share_part0" in r][-1]
    assert abs(shares["train/data_share_part0"] - 0.75) < 0.05 and abs(shares["train/data_share_part1"] - 0.25) < 0.05
    config.write_text("data:\n  train:\n    - {path: a.jsonl, weight: -2}\n")
    assert main(["train", *run]) == 2
    assert "mixture part 0 (a.jsonl) has weight -2" in capsys.readouterr().err


def test_resuming_by_directory_never_applies_a_recorded_overwrite(tmp_path):
    """`jaxloom train RUN_DIR` of a run started with overwrite_output_dir=true continues it (issue 43: the
    recorded setting deleted its checkpoints and trained from step 0); one given now still applies."""
    import json

    from jaxloom.trainer.compose import split_target

    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.json").write_text(json.dumps({"overwrite_output_dir": True, "max_training_steps": 4}))
    config, items = split_target([str(run)])
    trainer, _ = build_run(config, items)
    assert trainer.arguments.overwrite_output_dir is False and trainer.arguments.save_directory == str(run)
    config, items = split_target([str(run), "overwrite_output_dir=true"])
    assert build_run(config, items)[0].arguments.overwrite_output_dir is True
