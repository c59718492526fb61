"""`compilation_cache_dir`: a second run loads its programs from disk instead of compiling them."""

import json
import subprocess
import sys
from pathlib import Path

RUN = """
import json, sys
import jax
from util import trainer
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
t = trainer(sys.argv[1], evaluation=None, max_training_steps=2, compilation_cache_dir=sys.argv[2])
out = t.train()
t.finish()
print(json.dumps({"hits": len(hits), "loss": out.metrics["loss"]}))
"""


def run(tmp_path, name, cache):
    proc = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path / name), str(cache)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_run_loads_compiled_programs(tmp_path):
    cache = tmp_path / "xla-cache"
    first = run(tmp_path, "a", cache)
    entries = sorted(p.name for p in cache.iterdir())
    assert first["hits"] == 0 and any("train_step" in e for e in entries), entries
    second = run(tmp_path, "b", cache)
    assert second["hits"] >= 1  # at least the train step came from the cache
    assert sorted(p.name for p in cache.iterdir()) == entries  # nothing new had to be compiled
    assert second["loss"] == first["loss"]  # the cached program computes the same thing
