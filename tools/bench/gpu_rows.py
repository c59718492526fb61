"""GPU rows of `nox -s bench`, runnable alone: `python tools/bench/gpu_rows.py [OUT_JSON]`.

1. Attention kernels, forward + backward, bf16, causal, one document per row: each backend of
   `jaxloom.models.attend` (xla, chunked, cudnn, flash) at sequence 2048 and 8192, 16 query heads over
   8 key/value heads of 128 — milliseconds and achieved TFLOP/s (causal FLOPs: half of the full square).
2. The ~1B Llama (bench GPU_MODEL) trained with jaxloom's Trainer (user-facing defaults on) against
   the hand-written loop (bare_llama.py), bf16 compute over float32 parameters, 8,192 tokens a step (BENCH_GPU_TOKENS),
   at sequence 2048 and 8192: tokens/s, their ratio and MFU (model FLOPs 6·N + 6·L·T·d per token,
   causal attention, over the dense bf16 peak of the chip, H100/H200 SXM: 989 TFLOP/s).

`python gpu_rows.py OUT training_rows` runs one part. Each measurement is caught on its own: an
out-of-memory or refused backend is a row saying so.
Written incrementally to OUT_JSON (default gpu-results.json) so a run cut short keeps what it measured.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
PEAK_BF16 = 989e12
# tokens a training step: 8192 fits the ~1B model unrematerialised on one 141 GB GPU for both loops
# (at 16384 the trainer needed 40 GiB more than XLA's 75 % pool, the bare loop 101 GiB at 2048)
TOKENS = int(os.environ.get("BENCH_GPU_TOKENS", "8192"))


def _save(results, out):
    Path(out).write_text(json.dumps(results, indent=2))


def attention_rows(results, out):
    import jax
    import jax.numpy as jnp

    from jaxloom.models.attention import attend

    n, kv, hd = 16, 8, 128
    for t in (2048, 8192):
        b = 16384 // t
        key = jax.random.split(jax.random.PRNGKey(0), 4)
        q = jax.random.normal(key[0], (b, t, n, hd), jnp.bfloat16)
        k = jax.random.normal(key[1], (b, t, kv, hd), jnp.bfloat16)
        v = jax.random.normal(key[2], (b, t, kv, hd), jnp.bfloat16)
        do = jax.random.normal(key[3], (b, t, n, hd), jnp.bfloat16)
        seg = jnp.ones((b, t), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        flops = 3.5 * 4 * b * n * t * t * hd / 2  # forward 2 matmuls (x2 flops), backward 2.5x, causal half
        ref = None
        for impl in ("xla", "chunked", "cudnn", "flash"):
            name = f"attention_{impl}_{t}"
            try:

                def loss(q, k, v, impl=impl, seg=seg, pos=pos, do=do):
                    o = attend(q, k, v, q_segment_ids=seg, q_positions=pos, implementation=impl)
                    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

                f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
                val, grads = jax.block_until_ready(f(q, k, v))
                times = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(q, k, v))
                    times.append(time.perf_counter() - t0)
                ms = statistics.median(times) * 1e3
                row = {"ms": ms, "tflops": flops / (ms / 1e3) / 1e12}
                if ref is None:
                    ref = grads
                else:
                    row["max_dq_diff_vs_xla"] = float(jnp.max(jnp.abs(grads[0].astype(jnp.float32) - ref[0])))
                results[name] = row
            except Exception as e:  # noqa: BLE001 - a refused backend or OOM is a row
                results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(name, results[name], flush=True)
            _save(results, out)


def training_rows(results, out):
    from run import GPU_MODEL, run_process

    m = GPU_MODEL
    d, layers, vocab, ffn = m["hidden_size"], m["num_hidden_layers"], m["vocab_size"], m["intermediate_size"]
    hd = d // m["num_attention_heads"]
    kvd = m["num_key_value_heads"] * hd
    per_layer = d * (d + 2 * kvd) + d * d + 3 * d * ffn
    n_params = layers * per_layer + d * vocab  # the head; the embedding lookup is no matmul
    for seq in (2048, 8192):
        cfg = {"model": m, "batch": TOKENS // seq, "seq": seq, "lr": 1e-4, "dtype": "bfloat16", "warmup": 4}
        flops_per_token = 6 * n_params + 6 * layers * seq * d
        for kind in os.environ.get("BENCH_GPU_KINDS", "trainer,bare").split(","):
            name = f"train_gpu_{seq}_{kind}"
            try:
                import tempfile

                with tempfile.TemporaryDirectory() as tmp:
                    r = run_process([str(HERE / "train_run.py"), kind, "14", json.dumps({**cfg, "out": tmp})])
                r["mfu"] = r["tokens_per_second"] * flops_per_token / PEAK_BF16
                results[name] = r
            except Exception as e:  # noqa: BLE001
                results[name] = {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
            print(name, results[name], flush=True)
            _save(results, out)
        tr, ba = results.get(f"train_gpu_{seq}_trainer", {}), results.get(f"train_gpu_{seq}_bare", {})
        if "tokens_per_second" in tr and "tokens_per_second" in ba:
            results[f"train_gpu_{seq}_ratio"] = tr["tokens_per_second"] / ba["tokens_per_second"]
    results["params"] = n_params
    _save(results, out)


def main() -> None:
    import jax

    out = sys.argv[1] if len(sys.argv) > 1 else "gpu-results.json"
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
    }
    parts = [p for p in (attention_rows, training_rows) if len(sys.argv) < 3 or p.__name__ in sys.argv[2:]]
    for part in parts:
        try:
            part(results, out)
        except Exception:  # noqa: BLE001
            results[f"{part.__name__}_error"] = traceback.format_exc()[-2000:]
            _save(results, out)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
