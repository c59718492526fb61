"""GPU rows of `nox -s bench`, runnable alone: `python tools/bench/gpu_rows.py [OUT_JSON] [PART ...]`.

One call of a lent device measures it all (≈ 7 minutes on an H200, compiles and installs included):

1. `correctness_rows`: cuDNN's packed attention against the float32 `xla` reference on the GPU, values and
   gradients, packed documents with padding, with a window, and with more documents than `max_documents`
   (that call runs `flash`): relative errors.
2. `attention_rows`: forward + backward, bf16, causal, 16 query heads over 8 key/value heads of 128, 16,384
   tokens, at sequence 2048 and 8192, one document a row and packed documents: milliseconds and TFLOP/s of
   useful work (each document's causal half).
3. `optimizer_rows`: clip + AdamW over the ~1B model's float32 parameters alone (a step's fixed cost).
4. `training_rows`: the ~1B Llama (bench GPU_MODEL) trained with jaxloom's Trainer (user-facing defaults on,
   attention as `auto` picks) against the hand-written loop (bare_llama.py), bf16 compute over float32
   parameters, 8,192 tokens a step (BENCH_GPU_TOKENS), at sequence 2048 and 8192: tokens/s, their ratio and
   MFU: model FLOPs per token 6·N + 6·L·T·d (N the matmul parameters, the head included, the embedding
   lookup not; causal attention counted as half of the square, as MaxText does), over the dense bf16 peak of
   the chip (H100/H200 SXM: 989 TFLOP/s). Rows with `attn_mechanism=flash` show what cuDNN moved.
   `train_gpu_2048_trainer_default_batch`: the Trainer's default 8 rows a step (16,384 tokens). Variants
   beside the defaults (loss blocks, Triton's GEMMs off, unstacked layers) and
   `train_gpu_2048_trainer_fp8_tensor` / `_fp8_row`: FP8 training (`fp8=tensor|row`, issue 77; its MFU is counted
   on the bf16 peak, so FP8's gain shows as MFU above the bf16 row's).
   `train_gpu_2048_trainer_profile`, whose `profile` entry says where three steps' device time went
   (profile_summary.py); with `BENCH_GPU_DUMP=DIR` that row also writes its train step's optimised HLO there
   (to read what a kernel of the profile computes).

Each measurement is caught on its own: an out-of-memory or refused backend is a row saying so. Written
incrementally to OUT_JSON (default gpu-results.json) so a run cut short keeps what it measured.

On a device machine (docs/performance.md, "Measuring on a GPU"): the image lacks pydantic and the parts;
carry them as wheels (`.whl`) and install with `--target`.
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
# tokens a training step: 8192 fits the ~1B model unrematerialised on an 80 GB GPU for the trainer
TOKENS = int(os.environ.get("BENCH_GPU_TOKENS", "8192"))


def _save(results, out):
    Path(out).write_text(json.dumps(results, indent=2))


def _packed(b, t, mean, rng):
    """Segment ids `[b, t]` of documents of random lengths around `mean` (the last one cut at the row's end),
    the last 3 % of each row padding, and each document's length."""
    import numpy as np

    seg, lengths = np.zeros((b, t), np.int32), []
    for r in range(b):
        at, doc, end = 0, 1, t - t // 32
        while at < end:
            n = min(int(rng.integers(mean // 2, mean * 3 // 2)), end - at)
            seg[r, at : at + n], at, doc = doc, at + n, doc + 1
            lengths.append(n)
    return seg, lengths


def _timed(f, *args, reps=10):
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _attention_grad(impl, seg, **kw):
    import jax
    import jax.numpy as jnp

    from jaxloom.models.attention import attend

    pos = _positions(seg)
    real = (seg != 0)[:, :, None, None]

    def loss(q, k, v, do):
        o = attend(q, k, v, q_segment_ids=seg, q_positions=pos, implementation=impl, **kw)
        return jnp.sum(jnp.where(real, o.astype(jnp.float32) * do.astype(jnp.float32), 0.0))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _positions(seg):
    import jax.numpy as jnp
    import numpy as np

    seg = np.asarray(seg)
    pos = np.zeros_like(seg)
    for r in range(seg.shape[0]):
        starts = np.r_[0, np.flatnonzero(np.diff(seg[r])) + 1]
        for s, e in zip(starts, np.r_[starts[1:], seg.shape[1]], strict=True):
            pos[r, s:e] = np.arange(e - s)
    return jnp.asarray(pos)


def _qkvd(b, t, dtype, seed=0):
    import jax

    key = jax.random.split(jax.random.PRNGKey(seed), 4)
    shapes = ((b, t, 16, 128), (b, t, 8, 128), (b, t, 8, 128), (b, t, 16, 128))
    return [jax.random.normal(k, s, dtype) for k, s in zip(key, shapes, strict=True)]


def correctness_rows(results, out):
    """cuDNN (packed) against the float32 reference on this GPU: ‖a − ref‖ / ‖ref‖ of the output and each
    gradient over real tokens (bf16 operands land between 1e-3 and 1e-2)."""
    import jax.numpy as jnp
    import numpy as np

    packed, _ = _packed(2, 2048, 400, np.random.default_rng(1))
    single = np.zeros((2, 2048), np.int32)
    single[0, :1900], single[1] = 1, 2  # one document a row, right padding: per-row lengths
    args = _qkvd(2, 2048, jnp.bfloat16, seed=1)
    ref32 = [x.astype(jnp.float32) for x in args]
    cases = (
        ("packed", packed, {}),
        ("window_256", packed, {"window": 256}),
        ("overflow_2", packed, {"max_documents": 2}),
        ("single", single, {}),
        ("single_window_256", single, {"window": 256}),
    )
    for name, seg, kw in cases:
        row = f"correct_cudnn_{name}"
        seg = jnp.asarray(seg)
        try:
            window = kw.get("window")
            (_, got) = _attention_grad("cudnn", seg, **kw)(*args)
            (_, ref) = _attention_grad("xla", seg, window=window)(*ref32)
            real = np.asarray(seg != 0)[:, :, None, None]
            errs = {}
            for label, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
                g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
                if label == "dq":
                    g, r = g * real, r * real
                errs[label] = float(np.linalg.norm(g - r) / np.linalg.norm(r))
                errs[f"{label}_finite"] = bool(np.isfinite(g).all())
            results[row] = {**errs, "ok": all(v < 2e-2 for k, v in errs.items() if not k.endswith("finite"))}
        except Exception as e:  # noqa: BLE001
            results[row] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(row, results[row], flush=True)
        _save(results, out)


def attention_rows(results, out):
    import jax.numpy as jnp
    import numpy as np

    for t in (2048, 8192):
        b = 16384 // t
        args = _qkvd(b, t, jnp.bfloat16)
        one = jnp.ones((b, t), jnp.int32)
        packed, lengths = _packed(b, t, t // 4, np.random.default_rng(0))
        cases = (
            ("one", one, [t] * b, ({}, "cudnn"), ({}, "flash")),
            (
                "packed",
                jnp.asarray(packed),
                lengths,
                ({}, "cudnn"),
                ({"max_documents": 2}, "cudnn"),  # every row overflows: the flash kernel behind the switch
                ({}, "flash"),
            ),
        )
        for label, seg, docs, *variants in cases:
            useful = 3.5 * 4 * 16 * 128 * sum(n * n for n in docs) / 2  # fwd 2 matmuls, bwd 2.5x; causal half
            for kw, impl in variants:
                name = f"attention_{impl}_{label}_{t}" + (f"_m{kw['max_documents']}" if kw else "")
                try:
                    ms = _timed(_attention_grad(impl, seg, **kw), *args)
                    results[name] = {"ms": ms, "useful_tflops": useful / (ms / 1e3) / 1e12}
                except Exception as e:  # noqa: BLE001 - a refused backend or OOM is a row
                    results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(name, results[name], flush=True)
                _save(results, out)


def optimizer_rows(results, out):
    """The train step's fixed cost: global-norm clip + AdamW over the ~1B model's float32 parameters."""
    import jax
    import jax.numpy as jnp
    import optax

    from run import GPU_MODEL

    m = GPU_MODEL
    d, f, v, layers = m["hidden_size"], m["intermediate_size"], m["vocab_size"], m["num_hidden_layers"]
    kvd = m["num_key_value_heads"] * d // m["num_attention_heads"]
    shapes = {"embed": (v, d), "head": (d, v), "q": (layers, d, d), "kv": (layers, d, 2 * kvd), "o": (layers, d, d)}
    shapes |= {"up": (layers, d, 2 * f), "down": (layers, f, d), "norms": (layers, 2, d)}
    params = {k: jnp.zeros(s, jnp.float32) + 0.01 for k, s in shapes.items()}
    grads = {k: jax.random.normal(jax.random.PRNGKey(i), s, jnp.float32) for i, (k, s) in enumerate(shapes.items())}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, b2=0.95, weight_decay=0.1))
    state = tx.init(params)

    @jax.jit
    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    try:
        n = sum(x.size for x in params.values())
        ms = _timed(update, params, state, grads)
        # bytes: read params, grads, m, v; write params, m, v (float32), plus the clip's read of the grads
        results["optimizer_adamw_f32"] = {"ms": ms, "params": n, "min_bytes_gb": n * 4 * 8 / 1e9}
    except Exception as e:  # noqa: BLE001
        results["optimizer_adamw_f32"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print("optimizer_adamw_f32", results["optimizer_adamw_f32"], flush=True)
    _save(results, out)


# (row, sequence, kind, arguments, tokens a step, extra): the defaults first, then what each measures against;
# extra: "env" for the process (XLA flags), "profile" [first, last] steps traced and summarised (profile_summary.py)
NO_TRITON_GEMM = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}
DEFAULT_BATCH = None  # the Trainer's default total_batch_size (8 rows) at the row's sequence length
TRAINING = (
    ("train_gpu_2048_trainer_default_batch", 2048, "trainer", {}, DEFAULT_BATCH, {}),
    ("train_gpu_2048_trainer", 2048, "trainer", {}, TOKENS, {}),
    ("train_gpu_8192_trainer", 8192, "trainer", {}, TOKENS, {}),
    ("train_gpu_2048_trainer_profile", 2048, "trainer", {}, TOKENS, {"profile": [10, 12]}),
    ("train_gpu_2048_trainer_loss_block_8192", 2048, "trainer", {"loss_block_size": 8192}, TOKENS, {}),
    ("train_gpu_2048_trainer_no_triton_gemm", 2048, "trainer", {}, TOKENS, {"env": NO_TRITON_GEMM}),
    ("train_gpu_2048_trainer_unstacked", 2048, "trainer", {"scan_layers": False}, TOKENS, {}),
    ("train_gpu_2048_bare", 2048, "bare", {}, TOKENS, {}),
    ("train_gpu_2048_trainer_flash", 2048, "trainer", {"attn_mechanism": "flash"}, TOKENS, {}),
    # FP8 training (issue 77): the same ~1B step with the decoder's products in FP8, per-tensor and per-row scales
    ("train_gpu_2048_trainer_fp8_tensor", 2048, "trainer", {"fp8": "tensor"}, TOKENS, {}),
    ("train_gpu_2048_trainer_fp8_row", 2048, "trainer", {"fp8": "row"}, TOKENS, {}),
    ("train_gpu_8192_bare", 8192, "bare", {}, TOKENS, {}),
)


def training_rows(results, out):
    import tempfile

    from run import GPU_MODEL, run_process

    m = GPU_MODEL
    d, layers, vocab, ffn = m["hidden_size"], m["num_hidden_layers"], m["vocab_size"], m["intermediate_size"]
    hd = d // m["num_attention_heads"]
    kvd = m["num_key_value_heads"] * hd
    per_layer = d * (d + 2 * kvd) + d * d + 3 * d * ffn
    n_params = layers * per_layer + d * vocab  # the head; the embedding lookup is no matmul
    results["params"] = n_params
    only = os.environ.get("BENCH_GPU_ROWS")
    for name, seq, kind, arguments, tokens, extra in TRAINING:
        if only and name not in only.split(","):
            continue
        if tokens is DEFAULT_BATCH:
            from jaxloom.trainer import TrainingArguments

            tokens = TrainingArguments().total_batch_size * seq
        cfg = {"model": m, "batch": tokens // seq, "seq": seq, "lr": 1e-4, "dtype": "bfloat16", "warmup": 4}
        cfg["arguments"] = arguments
        env = dict(extra.get("env", {}))
        if "profile" in extra:
            cfg["profile"] = extra["profile"]
            if os.environ.get("BENCH_GPU_DUMP"):  # the train step's optimised HLO, for reading what a kernel is
                flags = f"--xla_dump_to={os.environ['BENCH_GPU_DUMP']} --xla_dump_hlo_module_re=.*step.*"
                env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
        flops_per_token = 6 * n_params + 6 * layers * seq * d
        try:
            with tempfile.TemporaryDirectory() as tmp:
                r = run_process(
                    [str(HERE / "train_run.py"), kind, "14", json.dumps({**cfg, "out": tmp})],
                    {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", **env},
                )
            r["mfu"] = r["tokens_per_second"] * flops_per_token / PEAK_BF16
            r["tokens_a_step"] = tokens
            results[name] = r
        except Exception as e:  # noqa: BLE001
            results[name] = {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
        print(name, results[name], flush=True)
        _save(results, out)
    for seq in (2048, 8192):
        tr, ba = results.get(f"train_gpu_{seq}_trainer", {}), results.get(f"train_gpu_{seq}_bare", {})
        if "tokens_per_second" in tr and "tokens_per_second" in ba:
            results[f"train_gpu_{seq}_ratio"] = tr["tokens_per_second"] / ba["tokens_per_second"]
    _save(results, out)


def main() -> None:
    # this process measures in place without taking 75 % of the GPU, so the training processes it starts
    # get XLA's default pool (run_process passes PREALLOCATE back to them)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    out = sys.argv[1] if len(sys.argv) > 1 else "gpu-results.json"
    results = json.loads(Path(out).read_text()) if Path(out).exists() else {}  # parts run in turn add to it
    results |= {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "device": jax.devices()[0].device_kind}
    parts = [
        p
        for p in (correctness_rows, attention_rows, optimizer_rows, training_rows)
        if len(sys.argv) < 3 or p.__name__ in sys.argv[2:]
    ]
    for part in parts:
        try:
            part(results, out)
        except Exception:  # noqa: BLE001
            results[f"{part.__name__}_error"] = traceback.format_exc()[-2000:]
            _save(results, out)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
