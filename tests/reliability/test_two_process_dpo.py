"""DPO with precomputed reference log-probs on two processes (gloo on 127.0.0.1) trains as one process
does on the same two devices: each process computes and keeps the reference log-probs of the pairs its
data shard reads (its own `ref_logps/<key>.process_<i>.npz`; reading them back on resume is tested on one
process in packages/trainer/tests/test_dpo.py)."""

import json
import os
import random
import socket
import subprocess
import sys

import numpy as np
from faultrun import WORKER

WORDS = ["red", "blue", "green", "cat", "dog", "tree", "sun", "moon", "fish", "bird", "rock", "leaf"]


def pairs(path, n=64):
    rng = random.Random(5)
    with open(path, "w") as fh:
        for _ in range(n):
            w, v = rng.sample(WORDS, 2)
            fh.write(json.dumps({"prompt": f"say {w}:", "chosen": f" {w}", "rejected": f" {v}"}) + "\n")
    return path


def launch(out, count, args, devices):
    """`count` worker processes (`devices` CPU devices each) joined over gloo; returns their outputs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}",
        "JAXLOOM_RUN_OWNER": "two-process-dpo",  # the processes of one run share its directory lock
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, **({"TEST_PROCESS": f"{r}/{count}/{port}"} if count > 1 else {})},
        )
        for r in range(count)
    ]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * count, "\n".join(o[-3000:] for o in outs)
    return outs


def test_two_processes_precompute_their_shards_and_train_as_one_process(tmp_path):
    data = pairs(tmp_path / "pairs.jsonl")
    args = [
        "trainer=dpo",
        f"data.train={data}",
        "precompute_ref_log_probs=true",
        "beta=0.2",
        "max_length=16",
        "max_training_steps=6",
        "save_steps=3",
    ]
    launch(tmp_path / "one", 1, args, devices=2)
    outs = launch(tmp_path / "two", 2, args, devices=1)
    assert all("STEP 6" in o for o in outs)
    one, two = np.load(tmp_path / "one" / "final.npz"), np.load(tmp_path / "two" / "final.npz")
    assert sorted(one) == sorted(two)
    for k in one:  # the same global mesh; only the reductions' transport differs
        np.testing.assert_allclose(one[k], two[k], rtol=2e-5, atol=1e-6, err_msg=k)
    # each process keeps the log-probs of what its shard reads; together they cover every pair
    files = sorted((tmp_path / "two" / "ref_logps").glob("*.npz"))
    assert [f.name.rsplit(".", 2)[1] for f in files] == ["process_0", "process_1"], files
    keys = [{bytes(k) for k in np.load(f)["keys"]} for f in files]
    (single,) = ({bytes(k) for k in np.load(f)["keys"]} for f in (tmp_path / "one" / "ref_logps").glob("*.npz"))
    assert keys[0] | keys[1] == single and keys[0] != single and keys[1] != single
