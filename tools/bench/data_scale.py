"""Data at scale: does memory follow the dataset's size? One JSON line of figures.

`python data_scale.py [SMALL_MB,BIG_MB]` (default 20,2000; `BENCH_DATA_MB` too) writes two JSONL
corpora of those sizes under a temporary directory (never committed), and measures, each in a fresh
process through the `jaxloom` command (`jaxloom train data.train=FILE max_training_steps=4`, tiny
model, defaults on): peak RSS and wall time, streaming the JSONL and from a token store made by
`jaxloom data prepare`. Also: `prepare` tokens/s with 1 and 2 processes (on the small corpus) and
the loader's tokens/s from a store against what the bench model's training consumes.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = [
    "max_training_steps=4",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "max_sequence_length=128",
    "total_batch_size=8",
    "evaluation_steps=null",
    "save_steps=null",
    "generation_interval=null",
]


def corpus(path: Path, megabytes: int) -> None:
    """Documents of 200–4000 characters drawn from the bundled corpus's words, to `megabytes` MB."""
    import jaxloom.data as jd

    words = " ".join(
        r["text"] for r in jd.JsonlSource(jd.bundled_corpus_path()).read_shard(str(jd.bundled_corpus_path()))
    ).split()
    rng = random.Random(0)
    target, written = megabytes << 20, 0
    with open(path, "w") as fh:
        while written < target:
            start = rng.randrange(len(words) - 800)
            line = json.dumps({"text": " ".join(words[start : start + rng.randrange(40, 700)])}) + "\n"
            fh.write(line)
            written += len(line)


def measured(args: list[str]) -> dict:
    """Peak RSS (GB, the kernel's ru_maxrss of the child) and wall time (s) of `jaxloom ARGS` in a fresh process."""
    code = (
        "import resource, subprocess, sys, json, os, time\n"
        "t = time.perf_counter()\n"
        "p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)\n"
        "if p.returncode: sys.stderr.write(p.stderr.decode()[-3000:]); sys.exit(1)\n"
        "print(json.dumps({'peak_rss_gb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,"
        " 'wall_s': time.perf_counter() - t}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, sys.executable, "-m", "jaxloom.trainer.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    if out.returncode:
        raise RuntimeError(f"jaxloom {args[:2]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def random_access(store_dir: Path, arrow_dir: Path, docs: int = 100_000, reads: int = 10_000) -> dict:
    """Documents per second read at random rows: the token store's memory map against the same documents
    in Arrow (`datasets.save_to_disk` / `load_from_disk`), the other storage considered."""
    import datasets
    import numpy as np

    import jaxloom.data as jd

    store = jd.TokenStore(store_dir)
    rows = []
    for name in store.shard_names:
        for record, _ in store.open_shard(name):
            rows.append(np.asarray(record["input_ids"], np.int32))
            if len(rows) == docs:
                break
        if len(rows) == docs:
            break
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(arrow_dir))
    arrow = datasets.load_from_disk(str(arrow_dir)).with_format("numpy")
    first = store.shard_names[0]
    offsets, tokens, _ = store._arrays(first)
    n = min(len(rows), len(offsets) - 1)
    picks = np.random.default_rng(0).integers(0, n, reads)
    t = time.perf_counter()
    total = 0
    for i in picks:
        total += int(np.asarray(tokens[int(offsets[i]) : int(offsets[i + 1])], np.int32).sum() > 0)
    mm = reads / (time.perf_counter() - t)
    t = time.perf_counter()
    for i in picks:
        total += int(arrow[int(i)]["input_ids"].sum() > 0)
    ar = reads / (time.perf_counter() - t)
    return {"store_docs_per_s": mm, "arrow_docs_per_s": ar, "docs": n}


def main() -> None:
    import jaxloom.data as jd

    sizes = (sys.argv[1] if len(sys.argv) > 1 else os.environ.get("BENCH_DATA_MB", "20,2000")).split(",")
    small, big = int(sizes[0]), int(sizes[1])
    out: dict = {"small_mb": small, "big_mb": big}
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for name, mb in (("small", small), ("big", big)):
            corpus(root / f"{name}.jsonl", mb)
        for name in ("small", "big"):
            run_dir = root / f"run-{name}"
            out[f"stream_{name}"] = measured(
                ["train", f"data.train={root / f'{name}.jsonl'}", f"save_directory={run_dir}", *TINY]
            )
        # prepare: tokens/s with 1 and 2 processes on the small corpus (work units of 4 MB)
        for procs in (1, 2):
            t = time.perf_counter()
            manifest = jd.prepare(
                root / "small.jsonl", root / f"store-small-{procs}", num_proc=procs, unit_bytes=4 << 20, progress=False
            )
            out[f"prepare_tokens_per_s_{procs}proc"] = manifest["tokens"] / (time.perf_counter() - t)
        t = time.perf_counter()
        manifest = jd.prepare(root / "big.jsonl", root / "store-big", num_proc=2, progress=False)
        out["prepare_big_s"] = time.perf_counter() - t
        out["big_tokens"] = manifest["tokens"]
        for name in ("small", "big"):
            store = root / ("store-small-1" if name == "small" else "store-big")
            out[f"store_{name}"] = measured(
                ["train", f"data.train={store}", f"save_directory={root / f'srun-{name}'}", *TINY]
            )
        # loader throughput from a store (one thread, 128-token packed rows)
        loader = jd.DataLoader(
            root / "store-big", jd.load_processor(), jd.DataConfig(max_sequence_length=128, batch_size=8, prefetch=0)
        )
        next(loader)
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < 5:
            n += next(loader)["input_ids"].size
        out["store_loader_tokens_per_s"] = n / (time.perf_counter() - t)
        out["random_access"] = random_access(root / "store-big", root / "arrow")
    for kind in ("stream", "store"):
        out[f"{kind}_rss_ratio"] = out[f"{kind}_big"]["peak_rss_gb"] / out[f"{kind}_small"]["peak_rss_gb"]
        out[f"{kind}_wall_ratio"] = out[f"{kind}_big"]["wall_s"] / out[f"{kind}_small"]["wall_s"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
