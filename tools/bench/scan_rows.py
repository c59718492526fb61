"""Scanned vs unrolled layers (issue 49; `nox -s bench`, or alone): `python tools/bench/scan_rows.py [REPS]` → JSON.

An 18-layer Llama (hidden 256; 18 > 16, so the Trainer scans it by default) trained by the Trainer with its
defaults, in interleaved processes (defaults, `scan_layers=false`, `scan_unroll=1`, then again): steady-state
tokens/s and first-step seconds (compile included) of each, and the ratios to the unrolled run. The defaults keep
the layers stacked (the checkpoint layout of every deep model) and unroll the scan on CPU and GPU.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from run import run_process  # noqa: E402

MODEL = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=18,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
)
STEPS, WARMUP = 30, 12
VARIANTS = {"defaults": {}, "unrolled": {"scan_layers": False}, "rolled_scan": {"scan_unroll": 1}}


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    runs: dict[str, list[dict]] = {k: [] for k in VARIANTS}
    for _ in range(reps):
        for name, arguments in VARIANTS.items():
            with tempfile.TemporaryDirectory() as d:
                # the steady state from step 12 to 30. Single runs move 10-15 % on a 2-core machine (either form);
                # with huge pages (run.py's HOST_ENV) six pairs gave a median ratio of 1.013 (docs/performance.md)
                cfg = {"model": MODEL, "batch": 8, "seq": 256, "lr": 1e-3, "dtype": "float32", "warmup": WARMUP}
                cfg |= {"out": d, "arguments": arguments}
                runs[name].append(
                    run_process(
                        [str(HERE / "train_run.py"), "trainer", str(STEPS), json.dumps(cfg)], {"JAX_PLATFORMS": "cpu"}
                    )
                )
    out = {
        k: {
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in v),
            "first_step_s": statistics.median(r["first_step_s"] for r in v),
        }
        for k, v in runs.items()
    }
    unrolled = out["unrolled"]["tokens_per_second"]
    out["defaults_step_vs_unrolled"] = unrolled / out["defaults"]["tokens_per_second"]  # > 1: defaults slower
    out["rolled_scan_step_vs_unrolled"] = unrolled / out["rolled_scan"]["tokens_per_second"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
