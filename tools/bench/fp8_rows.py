"""FP8 training, the CPU proxy of issue 77's FP8 row (`nox -s bench`, or alone): `python tools/bench/fp8_rows.py`.

A ~19M Llama trained 300 steps on the bench's text, the same seed and data, with `fp8` off, `tensor` and `row`
(XLA emulates the FP8 products on a CPU: the numbers a GPU gives, none of its speed). Prints one JSON line: each
run's final loss (the mean of its last two logged losses, steps 290 and 300), the relative difference to the
unquantized run (issue 77: within 1 %), and the seconds a step (the emulation's cost, not a GPU prediction).
`--steps N` for a shorter run.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
MODEL = dict(
    vocab_size=4096,
    hidden_size=384,
    intermediate_size=1152,
    num_hidden_layers=8,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
)  # ~19M parameters


def one(mode: str, steps: int, out: Path) -> dict:
    cfg = {
        "batch": 4,
        "seq": 64,
        "model": MODEL,
        "dtype": "float32",
        "lr": 1e-3,
        "warmup": 10,
        "out": str(out),
        "arguments": {} if mode == "none" else {"fp8": mode},
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / "train_run.py"), "trainer", str(steps), json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    timing = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loss = [r["train/loss"] for r in rows if "train/loss" in r]
    return {"final_loss": statistics.mean(loss[-2:]), "first_loss": loss[0], "steps_logged": len(loss),
            "seconds_per_step": cfg["batch"] * cfg["seq"] / timing["tokens_per_second"]}  # fmt: skip


def main(argv: list[str]) -> int:
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 300
    with tempfile.TemporaryDirectory() as tmp:
        runs = {mode: one(mode, steps, Path(tmp) / mode) for mode in ("none", "tensor", "row")}
    base = runs["none"]["final_loss"]
    for mode in ("tensor", "row"):
        runs[mode]["relative_to_none"] = runs[mode]["final_loss"] / base - 1
    print(json.dumps({"steps": steps, "parameters_m": 19, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
