"""`nox -s bench`: jaxloom against the limit, measured in one run. Prints a table, writes bench-results.json.

Every ratio compares against a reference measured in the same run; training runs alternate
trainer / bare loop (A B A B ...) in fresh processes and report medians.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxloom.core.host import HUGEPAGE_TUNABLE

HERE = Path(__file__).parent
# ~0.29M parameters (mostly the 4096-token embedding and head): the per-step host overhead shows here
SMALL_MODEL = dict(
    vocab_size=4096,
    hidden_size=32,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# ~8.4M parameters: the steady state of a real (small) model
CPU_MODEL = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
)
GPU_MODEL = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=18,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=8192,
)  # ~1B


# Every measured process, the Trainer's and the bare loop's alike, runs as the `jaxloom` program runs itself: glibc's
# malloc asking for huge pages (jaxloom.core.host; XLA's CPU runtime maps a step's temporaries afresh each step).
HOST_ENV = {"GLIBC_TUNABLES": HUGEPAGE_TUNABLE}


def run_process(args: list[str], env: dict | None = None) -> dict:
    environ = {**HOST_ENV, **os.environ, **(env or {})}
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environ, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{args[:2]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def training(reps: int, steps: int, cfg: dict, env: dict | None = None) -> dict:
    runs = {"trainer": [], "bare": []}
    for _ in range(reps):
        for kind in ("trainer", "bare"):
            with tempfile.TemporaryDirectory() as d:
                runs[kind].append(
                    run_process([str(HERE / "train_run.py"), kind, str(steps), json.dumps({**cfg, "out": d})], env)
                )
    med = {
        k: {m: statistics.median(r[m] for r in v) for m in ("tokens_per_second", "first_step_s", "peak_rss_gb")}
        for k, v in runs.items()
    }
    return {
        "trainer": med["trainer"],
        "bare": med["bare"],
        "throughput_ratio": med["trainer"]["tokens_per_second"] / med["bare"]["tokens_per_second"],
        "first_step_ratio": med["trainer"]["first_step_s"] / med["bare"]["first_step_s"],
        "memory_ratio": med["trainer"]["peak_rss_gb"] / med["bare"]["peak_rss_gb"],
        "platform": runs["trainer"][0]["platform"],
        "devices": runs["trainer"][0]["devices"],
    }


def preference(reps: int, steps: int, cfg: dict) -> dict:
    """DPO against SFT on the same model and tokens per step (tools/bench/dpo_run.py), alternating processes."""
    kinds = ("sft", "dpo", "dpo_precomputed")
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(reps):
        for kind in kinds:
            with tempfile.TemporaryDirectory() as d:
                args = [str(HERE / "dpo_run.py"), kind, str(steps), json.dumps({**cfg, "out": d})]
                runs[kind].append(run_process(args, {"JAX_PLATFORMS": "cpu"}))
    med = {
        k: {m: statistics.median(r[m] for r in v) for m in ("tokens_per_second", "peak_rss_gb")}
        for k, v in runs.items()
    }
    sft = med["sft"]
    return {
        **med,
        "dpo_throughput_ratio": med["dpo"]["tokens_per_second"] / sft["tokens_per_second"],
        "precomputed_throughput_ratio": med["dpo_precomputed"]["tokens_per_second"] / sft["tokens_per_second"],
        "dpo_memory_ratio": med["dpo"]["peak_rss_gb"] / sft["peak_rss_gb"],
    }


def import_times() -> dict:
    out = {}
    for name, code in (
        ("import jaxloom", "import jaxloom"),
        ("import jax", "import jax"),
        ("import jaxloom.trainer", "import jaxloom.trainer"),
    ):
        samples = []
        for _ in range(3):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
            samples.append(time.perf_counter() - t)
        out[name] = statistics.median(samples)
    return out


def data_pipeline(training_tokens_per_second: float) -> dict:
    import jaxloom.data as jd

    loader = jd.DataLoader(
        jd.bundled_corpus_path(), jd.load_processor(), jd.DataConfig(max_sequence_length=128, batch_size=8, prefetch=0)
    )
    next(loader)
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < 5:
        n += next(loader)["input_ids"].size
    rate = n / (time.perf_counter() - t)
    return {"tokens_per_second": rate, "ratio_to_training": rate / training_tokens_per_second}


def checkpoints(step_seconds: float, reps: int = 5) -> dict:
    """Save and restore of a 100 MiB state (25 float32 arrays of 4 MiB) through `CheckpointManager` (its
    default, orbax's standard arrays, with digests computed at save and checked on what was read; and
    `array_format="raw"`, each piece checked as read), through orbax alone (no jaxloom), and `numpy.save` /
    `numpy.load` (page cache). Each timed operation starts after `os.sync()`. Medians of `reps`. Stores and
    a 2 GiB state: tools/bench/storage_rows.py."""
    import statistics

    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    import jaxloom.state as js

    params = {
        f"w{i}": jnp.asarray(np.random.default_rng(i).standard_normal((1024, 1024), np.float32)) for i in range(25)
    }
    state = js.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state={}, rng=jax.random.PRNGKey(0))
    target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    mb = sum(x.nbytes for x in params.values()) / 2**20
    times: dict[str, list[float]] = {}

    def timed(name, fn):
        os.sync()  # every timed write starts with no dirty pages: none pays for another's writeback
        t0 = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    with tempfile.TemporaryDirectory() as d:
        m = js.CheckpointManager(d + "/c", async_save=True, save_total_limit=None)
        t0 = time.perf_counter()
        m.save(0, state)  # the first save also opens the manager
        first_block = time.perf_counter() - t0
        m.wait_until_finished()
        sync = js.CheckpointManager(d + "/sync", async_save=False, save_total_limit=None)
        sync.save(0, state)  # opened, like `m`
        raw = js.CheckpointManager(d + "/raw", async_save=False, save_total_limit=None, array_format="raw")
        raw.save(0, state)
        for rep in range(1, reps + 1):

            def save(rep=rep):
                timed("blocked", lambda: m.save(rep, state))
                m.wait_until_finished()

            timed("save", save)
            timed("sync_save", lambda rep=rep: sync.save(rep, state))
            timed("raw_sync_save", lambda rep=rep: raw.save(rep, state))
            timed(
                "raw_restore",
                lambda rep=rep: jax.block_until_ready(
                    js.CheckpointManager(d + "/raw").restore(target, rep).state.params
                ),
            )
            timed(
                "restore",
                lambda rep=rep: jax.block_until_ready(js.CheckpointManager(d + "/c").restore(target, rep).state.params),
            )
            path = f"{d}/orbax{rep}"

            def orbax_save(path=path):
                ck = ocp.StandardCheckpointer()  # async: timed until the write is finished
                ck.save(path, params)
                ck.wait_until_finished()

            timed("orbax_save", orbax_save)
            timed(
                "orbax_restore",
                lambda path=path: jax.block_until_ready(ocp.StandardCheckpointer().restore(path, target.params)),
            )

            def np_save(rep=rep):
                for k, v in params.items():
                    np.save(f"{d}/{k}.{rep}.npy", np.asarray(v))

            def np_load(rep=rep):
                for k in params:
                    np.load(f"{d}/{k}.{rep}.npy")

            timed("np_save", np_save)
            timed("np_load", np_load)
    t = {k: statistics.median(v) for k, v in times.items()}
    return {
        "state_mb": mb,
        "save_mb_s": mb / t["save"],
        "sync_save_mb_s": mb / t["sync_save"],
        "restore_mb_s": mb / t["restore"],
        "raw_sync_save_mb_s": mb / t["raw_sync_save"],
        "raw_restore_mb_s": mb / t["raw_restore"],
        "orbax_save_mb_s": mb / t["orbax_save"],
        "orbax_restore_mb_s": mb / t["orbax_restore"],
        "numpy_save_mb_s": mb / t["np_save"],
        "numpy_load_mb_s": mb / t["np_load"],
        "async_block_s": t["blocked"],
        "first_save_block_s": first_block,
        "async_block_fraction_of_step": t["blocked"] / step_seconds,
    }


def main() -> None:
    for key, value in HOST_ENV.items():  # the rows that start their own processes inherit it too
        os.environ.setdefault(key, value)
    import jax

    gpu = jax.devices()[0].platform == "gpu"
    reps = int(os.environ.get("BENCH_REPS", "3"))
    results = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "device": jax.devices()[0].device_kind}
    small = {"model": SMALL_MODEL, "batch": 8, "seq": 128, "lr": 1e-3, "dtype": "float32", "warmup": 10}
    results["train_small"] = training(reps, 110, small, {"JAX_PLATFORMS": "cpu"})
    # the same with the whole logits (loss_block_size=0): the loop's own overhead, without the fused loss
    results["train_small_whole_logits"] = training(reps, 110, {**small, "loss_block_size": 0}, {"JAX_PLATFORMS": "cpu"})
    cpu_cfg = {"model": CPU_MODEL, "batch": 8, "seq": 256, "lr": 1e-3, "dtype": "float32", "warmup": 5}
    results["train_cpu"] = training(reps, 30, cpu_cfg, {"JAX_PLATFORMS": "cpu"})
    # The same on 8 simulated CPU devices, fully sharded (fsdp=8): sharded state, batch split 8 ways.
    eight = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    results["train_cpu_mesh"] = training(reps, 20, {**cpu_cfg, "mesh": {"fsdp": 8}}, eight)
    if gpu:  # attention kernels and the ~1B Llama, trainer vs bare loop (tools/bench/gpu_rows.py)
        with tempfile.TemporaryDirectory() as d:
            results["gpu"] = run_process([str(HERE / "gpu_rows.py"), f"{d}/gpu.json"])
    dec = {"model": CPU_MODEL, "batch": 4, "prompt": 64, "new": 64, "dtype": "float32"}
    d = run_process([str(HERE / "decode_run.py"), json.dumps(dec)], {"JAX_PLATFORMS": "cpu"})
    d["ratio_to_bare"] = d["cached_tokens_per_second"] / d["bare_tokens_per_second"]
    d["speedup_over_naive"] = d["cached_tokens_per_second"] / d["naive_tokens_per_second"]
    results["decode_cpu"] = d
    # Does cost follow the work? attention memory vs length, MoE FLOPs vs experts, start-up vs depth
    results["scale"] = run_process([str(HERE / "model_scale.py")], {"JAX_PLATFORMS": "cpu"})
    # Expert parallelism on 8 devices: what a Mixtral step moves and holds, ep=8 vs fsdp=8, E=8 and 32
    results["moe_parallel"] = run_process([str(HERE / "moe_parallel.py")], eight)
    # LoRA / QLoRA: state bytes of 1B and 8B plans, the 8B QLoRA step's memory at 4096, LoRA vs full tokens/s
    results["lora"] = run_process([str(HERE / "lora_rows.py")], {"JAX_PLATFORMS": "cpu"})
    # LoRA SFT against TRL + PEFT on the same job (8.4M model, r16 all-linear)
    results["peft"] = run_process([str(HERE / "peft_rows.py")], {"JAX_PLATFORMS": "cpu"})
    # GRPO: rollout tokens/s and the step's split on the 8.4M model; the same tiny job in jaxloom and in TRL
    results["grpo"] = run_process([str(HERE / "grpo_rows.py")], {"JAX_PLATFORMS": "cpu"})
    # Distillation: the 8.4M student's step split (generate / teacher / student); the same job in TRL 1.16
    results["distillation"] = run_process([str(HERE / "distill_rows.py")], {"JAX_PLATFORMS": "cpu"})
    # GRPO rollouts: a step's cost at prompt caps 32, 512 and unset; the generator's tokens/s, half the rows ending
    results["rollouts"] = run_process([str(HERE / "rollout_rows.py")], {"JAX_PLATFORMS": "cpu"})
    # The paged engine (issue 71): a long-tail mix vs a uniform one, 256 requests through 64 slots, a tool turn
    results["engine"] = run_process([str(HERE / "engine_rows.py")], {"JAX_PLATFORMS": "cpu"})
    # User code in rollouts (issue 78): a tool turn's rows concurrently, async reward functions concurrently
    results["usercode"] = run_process([str(HERE / "usercode_rows.py")], {"JAX_PLATFORMS": "cpu"})
    # FP8 training (issue 77's CPU proxy): a ~19M Llama 300 steps with fp8 off, tensor and row, final losses
    results["fp8"] = run_process([str(HERE / "fp8_rows.py")], {"JAX_PLATFORMS": "cpu"})
    # lm-evaluation-harness (issue 76): the same model and local tasks under lm-eval's hf model and jaxloom's
    results["lm_eval"] = run_process([str(HERE / "lm_eval_rows.py")], {"JAX_PLATFORMS": "cpu"})
    # Scanned layers at the speed of unrolled ones: an 18-layer Llama, defaults vs scan_layers=false vs scan_unroll=1
    results["scan"] = run_process([str(HERE / "scan_rows.py")], {"JAX_PLATFORMS": "cpu"})
    # Each model family's training step at about Llama's parameter count, in tokens/s relative to Llama's
    results["families"] = run_process([str(HERE / "family_rows.py")], {"JAX_PLATFORMS": "cpu"})
    # The gang: 2 Ray workers (2 JAX processes) vs 1 process on the same 2-device mesh; driver CPU
    results["ray_gang"] = run_process([str(HERE / "ray_gang.py")], {"XLA_FLAGS": ""})
    # Data at scale: peak RSS and wall of `jaxloom train` on a small and a big JSONL, streamed and from a store
    results["data_scale"] = run_process([str(HERE / "data_scale.py")], {"JAX_PLATFORMS": "cpu"})
    results["dpo"] = preference(reps, 30, {"model": CPU_MODEL, "pairs": 4, "seq": 256, "dtype": "float32", "warmup": 5})
    results["imports_s"] = import_times()
    t = results["train_cpu"]["trainer"]["tokens_per_second"]
    results["data"] = data_pipeline(t)
    results["checkpoint"] = checkpoints(8 * 256 / t)
    Path("bench-results.json").write_text(json.dumps(results, indent=2))
    print(table(results))


def engine_rows(e: dict) -> list[tuple[str, str, str, str]]:
    """The paged engine: tokens/s of a long-tail mix against a uniform one (static decoder and engine), more
    requests than slots, and a tool turn's prefill."""
    if not e:
        return []
    m, s, t = e["mix"], e["slots"], e["tool"]
    return [
        (
            f"decode tokens/s, 64 prompts, long tail (mean {m['engine']['long_tail_mean_length']:.0f}, cap 512) / "
            f"uniform: LLMEngine",
            f"{m['engine']['long_tail_tokens_per_s']:.0f} / {m['engine']['uniform_tokens_per_s']:.0f}",
            f"{m['engine']['ratio']:.2f}",
            ">= 0.8",
        ),
        (
            "the same, static generate (before the engine)",
            f"{m['static']['long_tail_tokens_per_s']:.0f} / {m['static']['uniform_tokens_per_s']:.0f}",
            f"{m['static']['ratio']:.2f}",
            "",
        ),
        ("long-tail tokens/s: LLMEngine / static generate", "", f"{m['engine_over_static_long_tail']:.2f}", ""),
        (
            "long-tail tokens/s: LLMEngine vs transformers' generate_batch (continuous batching), same shape",
            f"{m['engine']['long_tail_tokens_per_s']:.0f} vs {e['peer']['long_tail_tokens_per_s']:.0f}",
            f"{m['engine']['long_tail_tokens_per_s'] / e['peer']['long_tail_tokens_per_s']:.1f}",
            "> 1",
        ),
        (
            "LLMEngine tokens/s: 256 requests through 64 slots / 64 requests",
            f"{s['requests_256_tokens_per_s']:.0f} / {s['requests_64_tokens_per_s']:.0f}",
            f"{s['ratio']:.2f}",
            ">= 0.9",
        ),
        (
            f"tool turn after {t['history_tokens']} tokens of history: tokens prefilled",
            f"{t['prefill_tokens']}",
            "",
            f"= {t['tool_tokens'] + 1}",
        ),
    ]


def fp8_rows(f: dict) -> list[tuple[str, str, str, str]]:
    """FP8 training emulated on the CPU: each mode's final loss against the unquantized run's (issue 77: within 1 %)."""
    if not f:
        return []
    runs = f["runs"]
    return [
        (
            f"FP8 {mode} scales, ~19M Llama {f['steps']} steps: final loss vs fp8 off (emulated by XLA)",
            f"{runs[mode]['final_loss']:.4f} vs {runs['none']['final_loss']:.4f}",
            f"{runs[mode]['relative_to_none']:+.2%}",
            "within 1 %",
        )
        for mode in ("tensor", "row")
    ]


def lm_eval_rows(e: dict) -> list[tuple[str, str, str, str]]:
    """lm-eval's simple_evaluate on the same ~8M Llama and local tasks: jaxloom's model vs lm-eval's hf model."""
    if not e:
        return []
    return [
        (
            f"lm-eval, ~8M Llama, {e['docs']} multiple-choice docs + generation + perplexity: jaxloom vs hf (s)",
            f"{e['jaxloom_s']:.1f} vs {e['hf_s']:.1f} (scores agree: {e['scores_agree']})",
            f"{e['speedup']:.2f}x",
            "the time of both",
        )
    ]


def usercode_rows(u: dict) -> list[tuple[str, str, str, str]]:
    """User code in rollouts: a tool turn's wall time, rows concurrently vs one at a time; two async judges."""
    if not u:
        return []
    rows = []
    for n, t in sorted(u["tools"].items(), key=lambda kv: int(kv[0])):
        rows.append(
            (
                f"tool turn of {n} rows, each call waits {u['tool_wait_s']} s: s, concurrently / one row at a time",
                f"{t['turn_s']:.2f} / {t['one_row_at_a_time_s']:.2f}",
                f"{t['speedup']:.1f}",
                "",
            )
        )
    j = u["judges"]
    rows.append(
        (
            "two async reward functions waiting 1 s each: s, concurrently / one after the other",
            f"{j['concurrent_s']:.2f} / {j['one_after_the_other_s']:.2f}",
            f"{j['speedup']:.1f}",
            "",
        )
    )
    return rows


def grpo_rows(g: dict) -> list[tuple[str, str, str, str]]:
    """GRPO: the 8.4M model's rollout speed and step split; TRL vs jaxloom seconds per step, same tiny job."""
    out = []
    m = g.get("model_8m")
    if m:
        out.append(("GRPO 8.4M: rollout tokens/s (16 × 64 tokens a step)", f"{m['rollout_tokens_per_s']:.0f}", "", ""))
        out.append(
            (
                "GRPO 8.4M: step s = rollout + reward + train",
                f"{m['seconds_per_step']:.2f} = {m['rollout_s']:.2f} + {m['reward_s']:.4f} + {m['train_s']:.2f}",
                "",
                "",
            )
        )
    if "async_vs_sync_8m" in g:
        s, a = g["judge_sync_8m"], g["judge_async_8m"]
        out.append(
            (
                f"GRPO 8.4M, a reward waiting {s['reward_wait_s']:.2f} s (= generation + training): s/step "
                "max_staleness=0 vs 1 (issue 73: <= 0.7)",
                f"{s['seconds_per_step']:.2f} vs {a['seconds_per_step']:.2f}",
                f"{g['async_vs_sync_8m']:.2f}x",
                "",
            )
        )
    t = g.get("multiturn_8m")
    if t:
        out.append(
            (
                "GRPO 8.4M multi-turn (a tool, 16 completions): step s; rollout s = generate + tools; reward s",
                f"{t['seconds_per_step']:.2f}; {t['rollout_s']:.2f} = {t['generate_s']:.2f} + {t['tools_s']:.4f}; "
                f"{t['reward_s']:.4f} ({t['calls_per_completion']:.2f} calls, {t['turns_per_completion']:.2f} tool "
                f"turns, {t['completion_tokens']:.0f} model tokens a completion)",
                "",
                "",
            )
        )
    if "trl" in g:
        out.append(
            (
                "GRPO tiny job s/step: TRL 1.16 vs jaxloom (8 × 16 tokens)",
                f"{g['trl']['seconds_per_step']:.2f} vs {g['jaxloom']['seconds_per_step']:.2f}",
                f"{g['trl_vs_jaxloom_seconds_per_step']:.1f}",
                "> 1",
            )
        )
    if "trl_8m" in g:
        out.append(
            (
                "GRPO 8.4M s/step: TRL 1.16 vs jaxloom (16 × 64 tokens)",
                f"{g['trl_8m']['seconds_per_step']:.2f} vs {g['model_8m']['seconds_per_step']:.2f}",
                f"{g['trl_vs_jaxloom_8m']:.1f}",
                "> 1",
            )
        )
    for n, tokens in (("8m", 64), ("8m_128", 128)):
        if f"paged_{n}" in g:
            out.append(
                (
                    f"GRPO 8.4M s/step, 16 × {tokens} tokens: TRL 1.16 vs jaxloom static vs paged (LLMEngine)",
                    f"{g[f'trl_{n}']['seconds_per_step']:.2f} vs {g[f'model_{n}']['seconds_per_step']:.2f} vs "
                    f"{g[f'paged_{n}']['seconds_per_step']:.2f}",
                    f"{g[f'trl_vs_paged_{n}']:.1f}",
                    ">= 3",
                )
            )
    return out


def distillation_rows(g: dict) -> list[tuple[str, str, str, str]]:
    """Distillation: the 8.4M student's step split (generate / teacher / student) and TRL vs jaxloom per step."""
    out = []
    m = g.get("jaxloom", {})
    if "seconds_per_step" in m:
        split = f"{m['seconds_per_step']:.2f} = {m['generate_s']:.2f} + {m['teacher_s']:.2f} + {m['student_s']:.2f}"
        out.append(("distillation 8.4M ← 30M teacher: step s = generate + teacher + student", split, "", ""))
    if "trl_vs_jaxloom" in g:
        out.append(
            (
                "distillation s/step: TRL 1.16 vs jaxloom (16 × 64 tokens)",
                f"{g['trl']['seconds_per_step']:.2f} vs {m['seconds_per_step']:.2f}",
                f"{g['trl_vs_jaxloom']:.1f}",
                "> 1",
            )
        )
    return out


def lora_rows(g: dict) -> list[tuple[str, str, str, str]]:
    """LoRA optimizer state and QLoRA base vs full fine-tuning's, the 8B QLoRA fit, LoRA tokens/s."""
    out = []
    m = g.get("memory", {})
    for size in ("1b", "8b"):
        if f"{size}_full" in m:
            full, lora, q = m[f"{size}_full"], m[f"{size}_lora_r16"], m[f"{size}_qlora_nf4_r16"]
            out.append(
                (
                    f"{size} optimizer state GB: LoRA r16 vs full",
                    f"{lora['optimizer_gb']:.3f} vs {full['optimizer_gb']:.1f}",
                    f"{m[f'{size}_lora_optimizer_vs_full']:.4f}",
                    "<= 0.02",
                )
            )
            out.append(
                (
                    f"{size} frozen base GB: QLoRA NF4 vs bf16 (embeddings stay bf16)",
                    f"{q['frozen_gb']:.2f} vs {lora['frozen_gb']:.2f}",
                    f"{m[f'{size}_qlora_base_vs_bf16']:.3f}",
                    "",
                )
            )
    f = g.get("fits_8b_qlora_4096")
    if f:
        out.append(("8B QLoRA step at 4096 tokens, XLA memory analysis (GB) vs 80", f"{f['total_gb']:.1f}", "", "fits"))
    s = g.get("speed")
    if s:
        out.append(
            (
                "8.4M model tokens/s: LoRA r16 all-linear vs full",
                f"{s['lora_tokens_per_s']:.0f} vs {s['full_tokens_per_s']:.0f}",
                f"{s['lora_vs_full']:.2f}",
                "",
            )
        )
        out.append(
            (
                "8.4M model tokens/s: LoRA r16 q_proj,v_proj vs full",
                f"{s['lora_qv_tokens_per_s']:.0f} vs {s['full_tokens_per_s']:.0f}",
                f"{s['lora_qv_vs_full']:.2f}",
                "",
            )
        )
    return out


def gpu_rows(g: dict) -> list[tuple[str, str, str, str]]:
    """Attention backends (ms, TFLOP/s, ratio to xla) and the ~1B model's tokens/s and MFU."""
    out = []
    for t in (2048, 8192):
        xla = g.get(f"attention_xla_{t}", {})
        for impl in ("xla", "chunked", "cudnn", "flash"):
            a = g.get(f"attention_{impl}_{t}")
            if a is None:
                continue
            if "error" in a:
                out.append((f"attention {impl} fwd+bwd, T={t}", a["error"][:60], "", ""))
                continue
            ratio = f"{xla['ms'] / a['ms']:.2f}" if "ms" in xla else ""
            out.append(
                (
                    f"attention {impl} fwd+bwd, T={t} (ms, TFLOP/s; speed-up vs xla)",
                    f"{a['ms']:.2f}, {a['tflops']:.0f}",
                    ratio,
                    "",
                )
            )
        tr, ba = g.get(f"train_gpu_{t}_trainer", {}), g.get(f"train_gpu_{t}_bare", {})
        if "tokens_per_second" in tr:
            ratio = f"{tr['tokens_per_second'] / ba['tokens_per_second']:.2f}" if "tokens_per_second" in ba else ""
            out.append(
                (
                    f"~1B Llama T={t}: trainer tokens/s (MFU) vs bare",
                    f"{tr['tokens_per_second']:.0f} ({tr['mfu']:.1%})",
                    ratio,
                    ">= 1",
                )
            )
    d = g.get("train_gpu_2048_trainer_default_batch", {})
    if "tokens_per_second" in d:  # the Trainer's default 8 rows a step (no bare loop fits 16,384 tokens there)
        out.append(
            (
                "~1B Llama T=2048, 8 rows a step: trainer tokens/s (MFU)",
                f"{d['tokens_per_second']:.0f} ({d['mfu']:.1%})",
                "",
                "",
            )
        )
    return out


def data_rows(d: dict, training_tokens_per_second: float) -> list[tuple[str, str, str, str]]:
    size = f"{d['big_mb']} MB vs {d['small_mb']} MB JSONL"
    out = []
    for kind, what in (("stream", "streamed"), ("store", "from a token store")):
        big, small = d[f"{kind}_big"], d[f"{kind}_small"]
        out += [
            (
                f"peak RSS of `jaxloom train`, {what}: {size}",
                f"{big['peak_rss_gb']:.2f} vs {small['peak_rss_gb']:.2f} GB",
                f"{d[f'{kind}_rss_ratio']:.2f}",
                "<= 1.15",
            ),
            (
                f"wall of 4 steps incl. start-up, {what}: {size}",
                f"{big['wall_s']:.1f} vs {small['wall_s']:.1f} s",
                f"{d[f'{kind}_wall_ratio']:.2f}",
                "<= 1.15",
            ),
        ]
    out += [
        ("`data prepare` tokens/s, 1 process", f"{d['prepare_tokens_per_s_1proc']:.0f}", "", ""),
        ("`data prepare` tokens/s, 2 processes", f"{d['prepare_tokens_per_s_2proc']:.0f}", "", ""),
        (
            "loader tokens/s from a store (one thread) vs the 8.4M model's training",
            f"{d['store_loader_tokens_per_s']:.0f} vs {training_tokens_per_second:.0f}",
            f"{d['store_loader_tokens_per_s'] / training_tokens_per_second:.0f}",
            ">= 100",
        ),
        (
            "random document reads/s: token store vs Arrow (load_from_disk)",
            f"{d['random_access']['store_docs_per_s']:.0f} vs {d['random_access']['arrow_docs_per_s']:.0f}",
            f"{d['random_access']['store_docs_per_s'] / d['random_access']['arrow_docs_per_s']:.1f}",
            "",
        ),
    ]
    return out


def scale_rows(s: dict) -> list[tuple[str, str, str, str]]:
    att, moe, depth = s["attention_temporaries_gb"], s["moe_step_flops"], s["first_step_s"]
    ch, xl = att["chunked"], att["xla"]
    return [
        (
            "plan temporaries (GB), T=1k/2k/4k/8k, chunked attention",
            "/".join(f"{v:.3f}" for v in ch.values()),
            f"{ch['8192'] / ch['1024']:.2f}",
            "<= 10 (8k vs 1k)",
        ),
        (
            "plan temporaries (GB), T=1k/2k/4k, xla reference (mask)",
            "/".join(f"{v:.3f}" for v in xl.values()),
            f"{xl['4096'] / xl['1024']:.2f}",
            "(4k vs 1k)",
        ),
        (
            "MoE train-step GFLOPs, E=8 vs E=2 at k=2, token dispatch",
            f"{moe['tiled']['8'] / 1e9:.2f} vs {moe['tiled']['2'] / 1e9:.2f}",
            f"{moe['tiled']['8'] / moe['tiled']['2']:.2f}",
            "<= 1.2",
        ),
        (
            "MoE train-step GFLOPs, E=8 vs E=2, dense reference",
            f"{moe['dense']['8'] / 1e9:.2f} vs {moe['dense']['2'] / 1e9:.2f}",
            f"{moe['dense']['8'] / moe['dense']['2']:.2f}",
            "",
        ),
        (
            "start to end of first step (s), 48 vs 4 layers",
            f"{depth['48']:.2f} vs {depth['4']:.2f}",
            f"{depth['48'] / depth['4']:.2f}",
            "<= 1.5",
        ),
    ]


def moe_parallel_rows(m: dict) -> list[tuple[str, str, str, str]]:
    ep, fsdp = m["ep8"], m["fsdp8"]

    def pair(key: str, fmt: str) -> str:
        return " / ".join(f"{ep[e][key]:{fmt}} vs {fsdp[e][key]:{fmt}}" for e in ("8", "32"))

    return [
        (
            "Mixtral step on 8 devices, MB moved between devices: ep=8 (tokens move) vs fsdp=8, E=8 / E=32",
            pair("collective_mb", ".1f"),
            f"{ep['32']['collective_mb'] / fsdp['32']['collective_mb']:.2f}",
            "< 1",
        ),
        (
            "the same, per-device temporaries MB (dropless: worst-case buffers)",
            pair("temporaries_mb", ".0f"),
            f"{ep['32']['temporaries_mb'] / fsdp['32']['temporaries_mb']:.2f}",
            "",
        ),
        (
            "the same, step s (8 simulated devices on the CPU's cores)",
            pair("step_s", ".2f"),
            f"{ep['32']['step_s'] / fsdp['32']['step_s']:.2f}",
            "",
        ),
    ]


def family_rows(f: dict) -> list[tuple[str, str, str, str]]:
    llama = f["llama"]["tokens_per_second"]
    return [
        (
            f"{name} train step tokens/s ({r['params'] / 1e6:.2f}M params) vs llama "
            f"({f['llama']['params'] / 1e6:.2f}M)",
            f"{r['tokens_per_second']:,.0f} vs {llama:,.0f}",
            f"{r['tokens_per_second'] / llama:.2f}",
            "",
        )
        for name, r in f.items()
        if name != "llama"
    ]


def dpo_rows(p: dict) -> list[tuple[str, str, str, str]]:
    """DPO vs SFT on the same model and tokens per step (8.4M model, 4 pairs = 8 sequences of 256)."""
    sft = p["sft"]
    return [
        (
            "DPO tokens/s with a reference model vs SFT (chosen + rejected tokens)",
            f"{p['dpo']['tokens_per_second']:.0f} vs {sft['tokens_per_second']:.0f}",
            f"{p['dpo_throughput_ratio']:.3f}",
            ">= 0.70",
        ),
        (
            "DPO tokens/s with precomputed reference log-probs vs SFT",
            f"{p['dpo_precomputed']['tokens_per_second']:.0f} vs {sft['tokens_per_second']:.0f}",
            f"{p['precomputed_throughput_ratio']:.3f}",
            ">= 0.95",
        ),
        (
            "DPO peak RSS with a reference model vs SFT (GB)",
            f"{p['dpo']['peak_rss_gb']:.2f} vs {sft['peak_rss_gb']:.2f}",
            f"{p['dpo_memory_ratio']:.2f}",
            "<= 1.5",
        ),
    ]


def table(r: dict) -> str:
    tc, ts, tw = r["train_cpu"], r["train_small"], r["train_small_whole_logits"]
    runs = [("", tc), (", 8 devices", r["train_cpu_mesh"])]
    rows = [
        (
            "train tokens/s, 0.29M model (trainer, defaults on, vs bare)",
            f"{ts['trainer']['tokens_per_second']:.0f} vs {ts['bare']['tokens_per_second']:.0f}",
            f"{ts['throughput_ratio']:.3f}",
            ">= 1.0",
        ),
        (
            "the same, whole logits (loss_block_size=0: the loop's overhead alone)",
            f"{tw['trainer']['tokens_per_second']:.0f} vs {tw['bare']['tokens_per_second']:.0f}",
            f"{tw['throughput_ratio']:.3f}",
            "",
        ),
        (
            "train tokens/s, 8.4M model (trainer, defaults on, vs bare)",
            f"{tc['trainer']['tokens_per_second']:.0f} vs {tc['bare']['tokens_per_second']:.0f}",
            f"{tc['throughput_ratio']:.3f}",
            ">= 0.97",
        ),
        (
            "train tokens/s on 8 CPU devices, fsdp=8 (trainer vs bare)",
            f"{r['train_cpu_mesh']['trainer']['tokens_per_second']:.0f} vs "
            f"{r['train_cpu_mesh']['bare']['tokens_per_second']:.0f}",
            f"{r['train_cpu_mesh']['throughput_ratio']:.3f}",
            ">= 0.97",
        ),
        *[
            (
                f"start to end of first step (s){tag}",
                f"{t['trainer']['first_step_s']:.2f} vs {t['bare']['first_step_s']:.2f}",
                f"{t['first_step_ratio']:.3f}",
                "<= 1.3",
            )
            for tag, t in runs
        ],
        *[
            (
                f"peak host memory (GB){tag}",
                f"{t['trainer']['peak_rss_gb']:.2f} vs {t['bare']['peak_rss_gb']:.2f}",
                f"{t['memory_ratio']:.3f}",
                "<= 1.1",
            )
            for tag, t in runs
        ],
        ("import jaxloom (s)", f"{r['imports_s']['import jaxloom']:.3f}", "", "<= 1.5 s"),
        (
            "import jaxloom.trainer (s) / import jax",
            f"{r['imports_s']['import jaxloom.trainer']:.2f} / {r['imports_s']['import jax']:.2f}",
            "",
            "",
        ),
        (
            "data pipeline tokens/s vs training",
            f"{r['data']['tokens_per_second']:.0f}",
            f"{r['data']['ratio_to_training']:.1f}",
            ">= 10",
        ),
        (
            "checkpoint save MB/s vs numpy.save (async: host copy, then written in the background)",
            f"{r['checkpoint']['save_mb_s']:.0f} vs {r['checkpoint']['numpy_save_mb_s']:.0f}",
            f"{r['checkpoint']['save_mb_s'] / r['checkpoint']['numpy_save_mb_s']:.2f}",
            ">= 0.8",
        ),
        (
            "checkpoint save MB/s vs numpy.save (sync, async_save=false: no host copy)",
            f"{r['checkpoint']['sync_save_mb_s']:.0f} vs {r['checkpoint']['numpy_save_mb_s']:.0f}",
            f"{r['checkpoint']['sync_save_mb_s'] / r['checkpoint']['numpy_save_mb_s']:.2f}",
            ">= 0.8",
        ),
        (
            "checkpoint restore MB/s (orbax format, integrity checked in the same read) vs numpy.load (page cache)",
            f"{r['checkpoint']['restore_mb_s']:.0f} vs {r['checkpoint']['numpy_load_mb_s']:.0f}",
            f"{r['checkpoint']['restore_mb_s'] / r['checkpoint']['numpy_load_mb_s']:.2f}",
            "",
        ),
        (
            "array_format=raw: sync save / restore MB/s (vs numpy.save / numpy.load)",
            f"{r['checkpoint']['raw_sync_save_mb_s']:.0f} / {r['checkpoint']['raw_restore_mb_s']:.0f}",
            f"{r['checkpoint']['raw_sync_save_mb_s'] / r['checkpoint']['numpy_save_mb_s']:.2f} / "
            f"{r['checkpoint']['raw_restore_mb_s'] / r['checkpoint']['numpy_load_mb_s']:.2f}",
            "restore >= 0.5",
        ),
        (
            "orbax alone, same arrays: save / restore MB/s (vs numpy.save / numpy.load)",
            f"{r['checkpoint']['orbax_save_mb_s']:.0f} / {r['checkpoint']['orbax_restore_mb_s']:.0f}",
            f"{r['checkpoint']['orbax_save_mb_s'] / r['checkpoint']['numpy_save_mb_s']:.2f} / "
            f"{r['checkpoint']['orbax_restore_mb_s'] / r['checkpoint']['numpy_load_mb_s']:.2f}",
            "",
        ),
        (
            "async save blocks the loop (fraction of a step)",
            f"{r['checkpoint']['async_block_s'] * 1000:.0f} ms "
            f"(first save {r['checkpoint']['first_save_block_s'] * 1000:.0f} ms)",
            f"{r['checkpoint']['async_block_fraction_of_step']:.2f}",
            "< 0.10",
        ),
    ]
    d = r["decode_cpu"]
    rows.insert(
        7,
        (
            "decode tokens/s: KV cache vs bare decode loop",
            f"{d['cached_tokens_per_second']:.0f} vs {d['bare_tokens_per_second']:.0f}",
            f"{d['ratio_to_bare']:.3f}",
            ">= 0.9",
        ),
    )
    rows.insert(
        8,
        (
            "decode tokens/s: KV cache vs naive recomputation",
            f"{d['cached_tokens_per_second']:.0f} vs {d['naive_tokens_per_second']:.0f}",
            f"{d['speedup_over_naive']:.1f}",
            "",
        ),
    )
    rows.extend(scale_rows(r["scale"]))
    rows.extend(moe_parallel_rows(r["moe_parallel"]))
    rows.extend(family_rows(r["families"]))
    rows.extend(data_rows(r["data_scale"], r["train_cpu"]["trainer"]["tokens_per_second"]))
    rows.extend(dpo_rows(r["dpo"]))
    g = r["ray_gang"]
    rows += [
        (
            "step time (ms), 2-worker Ray gang vs 1 process, same 2-device mesh",
            f"{g['gang_step_s'] * 1000:.0f} vs {g['one_process_step_s'] * 1000:.0f}",
            f"{g['gang_step_s'] / g['one_process_step_s']:.2f}",
            "",
        ),
        (
            "wall (s) incl. start-up, 2-worker gang vs 1 process",
            f"{g['gang_wall_s']:.1f} vs {g['one_process_wall_s']:.1f}",
            f"{g['gang_wall_s'] / g['one_process_wall_s']:.2f}",
            "",
        ),
        ("gang vs 1 process: max |loss difference|", f"{g['max_loss_diff']:.2e}", "", "<= 1e-4"),
        (
            "driver CPU per worker-step (ms), whole launch",
            f"{g['driver_cpu_ms_per_worker_step']:.1f} ({g['driver_cpu_s']:.1f} s)",
            "",
            "",
        ),
    ]
    rows += gpu_rows(r.get("gpu", {}))
    rows += lora_rows(r.get("lora", {}))
    rows += grpo_rows(r.get("grpo", {}))
    rows += distillation_rows(r.get("distillation", {}))
    sc = r.get("scan")
    if sc:
        rows += [
            (
                "18-layer Llama step, Trainer defaults (stacked, scan unrolled) vs scan_layers=false",
                f"{sc['defaults']['tokens_per_second']:.0f} vs {sc['unrolled']['tokens_per_second']:.0f} tok/s",
                f"{sc['defaults_step_vs_unrolled']:.3f}",
                "<= 1.03",
            ),
            (
                "the same with scan_unroll=1 (a rolled scan, compile flat in depth)",
                f"{sc['rolled_scan']['tokens_per_second']:.0f} tok/s",
                f"{sc['rolled_scan_step_vs_unrolled']:.3f}",
                "",
            ),
        ]
    o = r.get("rollouts")
    if o:
        rows += [
            (
                "GRPO step s, 20-token prompts: cap 512 / cap 32 (cost follows the data)",
                f"{o['step_cap_512']['seconds_per_step']:.2f} / {o['step_cap_32']['seconds_per_step']:.2f}",
                f"{o['step_ratio_512_vs_32']:.2f}",
                "<= 1.15",
            ),
            (
                "GRPO step s, 20-token prompts: no cap / cap 32",
                f"{o['step_cap_none']['seconds_per_step']:.2f} / {o['step_cap_32']['seconds_per_step']:.2f}",
                f"{o['step_ratio_unset_vs_32']:.2f}",
                "<= 1.15",
            ),
            (
                "generator tokens/s, 16 prompts x 8, half ending early: now vs prompts padded to 512",
                f"{o['engine_now']['generated_tokens_per_s']:.0f} vs "
                f"{o['engine_before']['generated_tokens_per_s']:.0f}",
                f"{o['engine_speedup']:.1f}",
                ">= 1.5",
            ),
        ]
    rows += engine_rows(r.get("engine") or {})
    rows += usercode_rows(r.get("usercode") or {})
    rows += fp8_rows(r.get("fp8") or {})
    rows += lm_eval_rows(r.get("lm_eval") or {})
    p = r.get("peft")
    if p:
        rows.append(
            (
                "LoRA SFT tokens/s, 8.4M r16 all-linear: jaxloom vs TRL 1.16 + PEFT",
                f"{p['jaxloom']['tokens_per_second']:.0f} vs {p['trl']['tokens_per_second']:.0f}",
                f"{p['jaxloom_vs_trl']:.2f}",
                ">= 1",
            )
        )
    w = max(len(x[0]) for x in rows)
    head = f"{'measure'.ljust(w)} | value | ratio | target\n{'-' * w}-|-------|-------|-------"
    return (
        head
        + "\n"
        + "\n".join(f"{a.ljust(w)} | {b} | {c} | {d}" for a, b, c, d in rows)
        + f"\n({r['device']}, jax {r['jax']}, {r['date']}; medians of interleaved runs)"
    )


if __name__ == "__main__":
    main()
