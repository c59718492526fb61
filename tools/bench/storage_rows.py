"""Checkpoint formats and stores, side by side in one run (issue 41): save and restore time of a state of
100 MiB and of 2 GiB through `CheckpointManager` with orbax's standard arrays (the default) and with
jaxloom's raw format, against `numpy.save` / `numpy.load` of the same arrays — on the local disk, on the GCS
emulator (`gs://`) and on moto's S3 server (`s3://`), both on loopback. Then the bytes each of two processes
reads when restoring a 32 MiB state saved on one mesh onto another (packages/state/tests/shared_worker.py).

    python tools/bench/storage_rows.py [--sizes 100,2048] [--stores local,gs,s3] [--json OUT] [--dir D] [--skip-bytes]

On a GPU host the arrays live on the GPU: a save copies them to the host, a restore puts them back.

Saves are synchronous (`async_save=False`: the time until the step is complete and listed); restores check
integrity in the same read. Each local operation starts after `os.sync()`. One repetition per cell: a 2 GiB
cell takes a minute on the emulators.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _state(mib: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxloom.state as js

    n = max(1, mib // 16)  # arrays of 16 MiB (2048 x 2048 float32)
    params = {
        f"w{i}": jnp.asarray(np.random.default_rng(i).standard_normal((2048, 2048), np.float32)) for i in range(n)
    }
    state = js.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state={}, rng=jax.random.PRNGKey(0))
    target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    return state, target, sum(x.nbytes for x in params.values()) / 2**20


def _timed(fn) -> float:
    with contextlib.suppress(OSError):
        os.sync()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _numpy(root: str, state) -> tuple[float, float]:
    """`numpy.save` / `numpy.load` of every array, through the same path layer (a local file or an upload)."""
    import io

    import numpy as np

    from jaxloom.core import paths

    if not paths.is_uri(root):
        os.makedirs(root, exist_ok=True)

    def save():
        for k, v in state.params.items():
            buf = io.BytesIO()
            np.save(buf, np.asarray(v))
            with paths.open_write(f"{root}/{k}.npy") as f:
                f.write(buf.getbuffer())

    def load():
        for k in state.params:
            with paths.open_binary(f"{root}/{k}.npy") as f:
                np.load(io.BytesIO(f.read()))

    return _timed(save), _timed(load)


def cell(root: str, mib: int) -> dict:
    import jax

    import jaxloom.state as js

    state, target, size = _state(mib)
    out: dict = {"mib": size}
    for fmt in ("orbax", "raw"):
        m = js.CheckpointManager(f"{root}/{fmt}", array_format=fmt, async_save=False, save_total_limit=None)
        out[f"{fmt}_save_s"] = _timed(lambda m=m: m.save(1, state))
        reader = js.CheckpointManager(f"{root}/{fmt}")
        out[f"{fmt}_restore_s"] = _timed(lambda r=reader: jax.block_until_ready(r.restore(target).state.params))
    out["numpy_save_s"], out["numpy_load_s"] = _numpy(f"{root}/npy", state)
    return out


def bytes_per_process(tmp: str) -> dict:
    """Two processes (4 CPU devices each) restore a 32 MiB state sharded over the eight: bytes each read."""
    import socket

    out = {}
    for fmt in ("orbax", "raw"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        root = tempfile.mkdtemp(dir=tmp)
        worker = ROOT / "packages/state/tests/shared_worker.py"
        procs = [
            subprocess.Popen(
                [sys.executable, str(worker), str(port), str(r), root, "restore", fmt],
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        rows = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
        out[fmt] = [{"read_mib": r["read"] / 2**20, "share_mib": r["share"] / 2**20} for r in rows]
    return out


def _line(store: str, c: dict) -> str:
    save = {k: c[f"{k}_save_s"] for k in ("orbax", "raw", "numpy")}
    load = {"orbax": c["orbax_restore_s"], "raw": c["raw_restore_s"], "numpy": c["numpy_load_s"]}
    return (
        f"{store:5s} {c['mib']:6.0f} MiB | save "
        + ", ".join(f"{k} {v:.2f} s" for k, v in save.items())
        + f" (orbax/numpy {save['orbax'] / save['numpy']:.2f}, raw/numpy {save['raw'] / save['numpy']:.2f}) | restore "
        + ", ".join(f"{k} {v:.2f} s" for k, v in load.items())
        + f" (orbax/numpy {load['orbax'] / load['numpy']:.2f}, raw/numpy {load['raw'] / load['numpy']:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100,2048")
    parser.add_argument("--stores", default="local,gs,s3")
    parser.add_argument("--json", default=None)
    parser.add_argument("--dir", default=None, help="where local checkpoints go (default: the temporary directory)")
    parser.add_argument("--skip-bytes", action="store_true", help="leave out the two-process bytes-read row (CPU)")
    ns = parser.parse_args()
    from jaxloom.state.testing import gcs_emulator, s3_server

    results: dict = {"cells": {}}
    import jax

    results["device"] = jax.devices()[0].device_kind
    print(f"device: {results['device']}", flush=True)
    with tempfile.TemporaryDirectory(dir=ns.dir) as tmp:
        for store in ns.stores.split(","):
            ctx = {"local": contextlib.nullcontext(tmp), "gs": gcs_emulator(), "s3": s3_server()}[store]
            with ctx as base:
                for mib in (int(x) for x in ns.sizes.split(",")):
                    root = f"{base}/bench-{mib}"
                    results["cells"][f"{store}/{mib}"] = c = cell(root, mib)
                    print(_line(store, c), flush=True)
                    if ns.json:
                        Path(ns.json).write_text(json.dumps(results, indent=2))
        b = {} if ns.skip_bytes else bytes_per_process(tmp)
        results["bytes_per_process"] = b
        for fmt, rows in b.items():
            print(
                f"restore onto another mesh, 2 processes, {fmt}: "
                + ", ".join(
                    f"process {i} read {r['read_mib']:.1f} MiB of a {r['share_mib']:.1f} MiB share"
                    for i, r in enumerate(rows)
                )
            )
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
