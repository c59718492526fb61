"""Where a profiled step's device time goes: `python profile_summary.py TRACE_DIR [STEPS]` → one JSON line.

Reads the newest `*.xplane.pb` under TRACE_DIR (what `profile_steps` / `jax.profiler.start_trace` write) with
JAX's own reader (`jax.profiler.ProfileData`; no TensorBoard needed) and sums the duration of every kernel on
the device's streams (a GPU's `Stream #…` lines; on a CPU, the host's `XLA Ops` lines), by kernel name and by
kind: `matmul` (cuBLAS/CUTLASS/Triton GEMMs), `attention` (cuDNN's fused attention, Pallas/Triton flash),
`copy` (memcpy/memset, copy fusions), `reduce` (reductions: norms, losses, the clip's norm), `elementwise`
(the other fusions) and `other`. Per step when STEPS (how many steps the trace holds) is given.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

KINDS = (
    ("attention", ("cudnn", "fmha", "flash", "sdpa", "attention", "mha")),
    ("matmul", ("gemm", "cublas", "cutlass", "xmma", "nvjet", "matmul", "dot", "sm90_", "sm80_", "wgmma")),
    ("copy", ("memcpy", "memset", "copy", "transpose", "dynamic_update_slice", "dynamic-update-slice")),
    ("reduce", ("reduce", "reduction")),
    ("elementwise", ("fusion", "loop_", "convert", "multiply", "add", "select", "broadcast")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, marks in KINDS:
        if any(m in low for m in marks):
            return kind
    return "other"


def device_lines(data, which: str = "Stream"):
    """The (plane, line) pairs holding the device's kernels (`which="Stream"`: a GPU's streams; `"XLA Ops"`: its
    HLO operations), or on a CPU the threads that run XLA's thunks."""
    gpu = [
        (p, ln) for p in data.planes if p.name.startswith("/device:GPU") for ln in p.lines if ln.name.startswith(which)
    ]
    if gpu or which != "Stream":
        return gpu
    return [(p, ln) for p in data.planes for ln in p.lines if ln.name.startswith("tf_XLAEigen")]


def _sums(lines):
    by_name: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for _, line in lines:
        for ev in line.events:
            if not ev.name.startswith("ThunkExecutor"):  # a CPU's wrapper around its thunks
                by_name[ev.name] += ev.duration_ns
                counts[ev.name] += 1
    return by_name, counts


def summarize(trace_dir: str, steps: int = 1, top: int = 40) -> dict:
    from jax.profiler import ProfileData

    files = sorted(Path(trace_dir).rglob("*.xplane.pb"), key=lambda f: f.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    data = ProfileData.from_file(str(files[-1]))
    lines = device_lines(data)
    by_name, counts = _sums(lines)
    ops, op_counts = _sums(device_lines(data, "XLA Ops"))
    by_kind: collections.Counter = collections.Counter()
    for name, ns in by_name.items():
        by_kind[kind_of(name)] += ns
    total = sum(by_name.values())
    ms = lambda ns: round(ns / 1e6 / steps, 3)  # noqa: E731 - per step, milliseconds
    return {
        "trace": str(files[-1]),
        "lines": sorted({f"{p.name} / {ln.name}" for p, ln in lines}),
        "steps": steps,
        "device_ms_per_step": ms(total),
        "by_kind_ms": {k: ms(v) for k, v in by_kind.most_common()},
        "top": [
            {"name": n[:160], "ms": ms(v), "calls": counts[n] // steps, "kind": kind_of(n)}
            for n, v in by_name.most_common(top)
        ],
        "top_ops": [{"name": n[:160], "ms": ms(v), "calls": op_counts[n] // steps} for n, v in ops.most_common(top)],
    }


if __name__ == "__main__":
    print(json.dumps(summarize(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)))
