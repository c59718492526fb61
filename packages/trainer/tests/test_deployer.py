import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxloom.trainer import Deployer

WORKER = Path(__file__).with_name("deployer_worker.py")


def run(workdir, epochs, kill_at=None):
    err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe nobody reads until the end (it can fill)
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(workdir), str(epochs)],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env=os.environ,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if kill_at is not None and line.startswith(f"EPOCH {kill_at} "):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=300)
    err.seek(0)
    with err:
        return proc.returncode, lines, err.read()


def test_custom_loop_is_killed_resumes_and_ends_where_an_uninterrupted_run_ends(tmp_path):
    rc, ref_lines, err = run(tmp_path / "ref", 4)
    assert rc == 0, err[-3000:]
    losses = [float(x) for x in ref_lines[-1].split()[1:]]
    assert losses[-1] < losses[0] * 0.8  # it learns
    rc, _, _ = run(tmp_path / "run", 4, kill_at=1)
    assert rc == -signal.SIGKILL
    rc, lines, err = run(tmp_path / "run", 4)
    assert rc == 0, err[-3000:]
    assert "loading last checkpoint" in err
    assert not any(line.startswith("EPOCH 0 ") for line in lines)  # epoch 0 was not redone
    a, b = np.load(tmp_path / "ref" / "final.npz"), np.load(tmp_path / "run" / "final.npz")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_redco_methods(tmp_path):
    d = Deployer(jax_seed=0, n_model_shards=2, workdir=str(tmp_path), run_tensorboard=True)
    assert dict(d.mesh.shape) == {"dp": 4, "fsdp": 1, "ep": 1, "tp": 2, "sp": 1} and d.workdir == str(tmp_path)
    k1, k2 = d.gen_rng(), d.gen_model_step_rng()
    assert not np.array_equal(k1, k2)
    assert d.get_local_global_micro_batch_size(8) == (32, 32)
    assert d.get_accumulate_grad_batches(global_batch_size=128, per_device_batch_size=8) == 4
    lr = d.get_lr_schedule_fn(
        train_size=640,
        per_device_batch_size=8,
        n_epochs=2,
        learning_rate=1e-3,
        schedule_type="linear",
        warmup_ratio=0.1,
    )
    assert float(lr(4)) == pytest.approx(1e-3 * 4 / 4) and float(lr(40)) == pytest.approx(0.0, abs=1e-9)
    params = {"dense": {"kernel": np.ones((16, 6), np.float32), "bias": np.zeros(6, np.float32)}, "odd": np.ones(3)}
    rules = d.get_sharding_rules(params)
    specs = d.get_params_spec(params, rules)
    assert specs["dense"]["kernel"] == P("tp", None) and specs["odd"] == P(None)
    tx = optax.adamw(1e-3)
    opt_specs = d.get_opt_state_spec(params, specs, tx)
    adam = opt_specs[0]
    assert adam.count == P() and adam.mu["dense"]["kernel"] == P("tp", None) and adam.nu["odd"] == P(None)
    sharded = d.shard_params(params, specs)
    assert sharded["dense"]["kernel"].sharding.spec == P("tp", None)
    opt_state = tx.init(sharded)
    d.save_ckpt(str(tmp_path / "ckpts" / "step_3"), sharded, opt_state, step=3, note="hello")
    assert d.load_params_shape(str(tmp_path / "ckpts" / "step_3"))["dense"]["kernel"].shape == (16, 6)
    ckpt, info = d.load_last_ckpt(optimizer=tx, params_sharding_rules=rules)
    assert info == {"step": 3, "note": "hello"}
    np.testing.assert_array_equal(np.asarray(ckpt["params"]["dense"]["kernel"]), params["dense"]["kernel"])
    assert ckpt["params"]["dense"]["kernel"].sharding.spec == P("tp", None)
    ckpt, _ = d.load_ckpt(str(tmp_path / "ckpts" / "step_3"), rules, float_dtype=np.float16, load_opt_state=False)
    assert ckpt["params"]["dense"]["kernel"].dtype == np.float16 and ckpt["opt_state"] is None
    examples = [{"x": np.full(4, i, np.float32)} for i in range(100)]
    collate = lambda b: {"x": np.stack([e["x"] for e in b])}  # noqa: E731
    batches = list(d.get_model_input_batches(examples, 2, collate, True, jax.random.PRNGKey(0), "train", True, 2))
    assert len(batches) == 100 // 16 and batches[0]["x"].shape == (2, 8, 4)
    seen = np.concatenate([np.asarray(b["x"])[..., 0].reshape(-1) for b in batches])
    assert len(set(seen.tolist())) == len(seen)  # no example twice
    evals = list(d.get_model_input_batches(examples, 2, collate, False, None, "eval"))
    assert len(evals) == 13 and evals[0]["x"].shape == (8, 4)
    d.log_info({"a": 1}, title="config", step=0)
    d.log_metrics({"loss": np.float32(1.5)}, step=1)
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["metrics/loss"] == 1.5
    assert json.loads(d.save_outputs([{"id": 1}], "preds", 5).read_text()) == [{"id": 1}]


def test_errors_name_the_numbers():
    with pytest.raises(ValueError, match="n_model_shards 3 must divide the 8 devices"):
        Deployer(jax_seed=0, n_model_shards=3)
    d = Deployer(jax_seed=0)
    with pytest.raises(ValueError, match=r"global_batch_size 20 must be a positive multiple of the global micro-b"):
        d.get_accumulate_grad_batches(20, 2)
    with pytest.raises(ValueError, match="make no full batch"):
        next(d.get_model_input_batches([{"x": 1}] * 3, 2, lambda b: b, False, None, "", is_train=True))
