"""GRPO bench rows (`nox -s bench`, or alone): `python tools/bench/grpo_rows.py [jaxloom|trl DIR [TOKENS ROWS]]` → JSON.

1. The same tiny job in jaxloom and in TRL's `GRPOTrainer` (a random 2-layer Llama, hidden 64, the bundled
   4,096-token tokenizer; 8 completions of 16 tokens a step, one prompt; a dense toy reward), seconds per step
   after the first (compile / warm-up) step, each in its own process.
2. The same on the 8.4M Llama (bench CPU_MODEL), 16 completions of 64 tokens a step; for jaxloom also the
   rollout tokens/s and the step's time split into rollout, reward and train (the rest of the step).
3. Asynchronous GRPO on the 8.4M Llama: a reward that waits on the host as long as row 2's generation and training
   take together (a remote judge), synchronous (`max_staleness=0`) and `max_staleness=1`: seconds per step, ratio;
   and `max_staleness=2` with partial rollouts (`partial_rollout_tokens=16` of 64): seconds per step, and how stale
   the trained tokens are (`sample/token_staleness_mean`, versions) beside the rollouts' staleness.
4. A multi-turn rollout on the 8.4M Llama (`examples/tool_calling.py`: a prior of 150 steps on chats that sometimes
   call a tool, then GRPO with its `Server` environment): the step split into generation (both turns), the tool calls,
   the reward (medians; a step's wall time beside them), with the tool calls and turns per completion.
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

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
WORDS = ["red", "blue", "green", "cat", "dog", "tree", "sun", "moon"]
STEPS = 8


def letter_e(prompts, completions, **kwargs):
    return [(c if isinstance(c, str) else c[0]["content"]).count("e") / max(len(c), 1) for c in completions]


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def waiting(seconds: float):
    """`letter_e` after `seconds` on the host (a remote judge's latency)."""

    def judged(prompts, completions, **kwargs):
        time.sleep(seconds)
        return letter_e(prompts, completions)

    judged.__name__ = "letter_e"
    return judged


def tiny_hf(path: Path, sizes: dict | None = None) -> None:
    """A random HF Llama with the bundled tokenizer at `path` (`sizes`: its dimensions; default TINY)."""
    import torch
    import transformers

    import jaxloom.data as jd

    tok = jd.load_processor()
    torch.manual_seed(0)
    sizes = {k: v for k, v in (sizes or TINY).items() if k not in ("vocab_size", "max_position_embeddings")}
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **sizes,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def per_step(times: list[float]) -> float:
    return statistics.median(times[1:])


def run_trl(model_dir: str, completion: int = 16, rows: int = 8) -> dict:
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            marks.append(time.perf_counter())

    data = datasets.Dataset.from_list([{"prompt": f"say {w}:"} for w in WORDS * 8])
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=rows,
            num_generations=8,
            max_completion_length=completion,
            max_steps=STEPS,
            learning_rate=1e-3,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model_dir,
            reward_funcs=letter_e,
            args=cfg,
            train_dataset=data,
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            callbacks=[Clock()],
        )
        start = time.perf_counter()
        trainer.train()
    steps = [b - a for a, b in zip([start, *marks[:-1]], marks, strict=True)]
    return {"seconds_per_step": per_step(steps), "first_step_s": steps[0]}


def run_jaxloom(
    model_dir: str,
    completion: int = 16,
    rows: int = 8,
    engine: str = "static",
    staleness: int = 0,
    wait: float = 0.0,
    partial: int = 0,
) -> dict:
    """jaxloom's GRPO on `model_dir` (`staleness`: `max_staleness`; `wait`: seconds the reward waits on the host,
    as a remote judge would; `partial`: `partial_rollout_tokens`): seconds per step and its split."""
    import jaxloom.data as jd
    import jaxloom.models as jm
    from jaxloom.trainer import GRPOConfig, GRPOTrainer

    marks: list[float] = []

    class Clock:
        def on_step_end(self, trainer, step, metrics):
            import jax

            jax.block_until_ready(trainer.state)
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            num_generations=8,
            total_batch_size=rows,
            max_prompt_length=16,
            max_completion_length=completion,
            max_training_steps=STEPS,
            learning_rate=1e-3,
            warmup_steps=0,
            logging_steps=1,
            save_directory=out,
            seed=0,
            save_total_limit=1,  # defaults otherwise: progress bar, TensorBoard, a checkpoint at the end
            generation_backend=engine,
            max_staleness=staleness,
            partial_rollout_tokens=partial,
        )
        model, tok = jm.from_pretrained(model_dir), jd.load_processor(model_dir)
        trainer = GRPOTrainer(
            args,
            model=model,
            dataset_train=[{"prompt": f"say {w}:"} for w in WORDS * 8],
            processing_class=tok,
            reward_funcs=waiting(float(wait)),
            hooks=[Clock()],
        )
        start = time.perf_counter()
        trainer.train()
        rows_ = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [b - a for a, b in zip([start, *marks[:-1]], marks, strict=True)]
    timed = [r for r in rows_ if "train/time/rollout_s" in r][1:]
    rollout = statistics.median(r["train/time/rollout_s"] for r in timed)
    reward = statistics.median(r["train/time/reward_s"] for r in timed)
    step = per_step(steps)
    gen_tokens = statistics.median(r["train/completions/mean_length"] for r in timed) * rows
    waited = statistics.median(r.get("train/perf/rollout_wait_s", r["train/time/reward_s"]) for r in timed)
    return {
        "seconds_per_step": step,
        "first_step_s": steps[0],
        "rollout_s": rollout,
        "reward_s": reward,
        "wait_s": waited,  # asynchronous: the step's wait for its scores (synchronous: the reward's seconds)
        "train_s": step - rollout - waited,
        "rollout_tokens_per_s": gen_tokens / rollout,
        **{  # asynchronous: versions behind the policy, of the rollouts and of their tokens (partial rollouts)
            name: statistics.median(r[f"train/sample/{key}"] for r in timed)
            for name, key in (("staleness", "staleness_mean"), ("token_staleness", "token_staleness_mean"))
            if all(f"train/sample/{key}" in r for r in timed)
        },
    }


def run_multiturn(steps: int = 8) -> dict:
    """Row 3: `examples/tool_calling.py` on the 8.4M model; medians over the steps after the first."""
    sys.path.insert(0, str(HERE.parents[1] / "examples"))
    import tool_calling
    from run import CPU_MODEL

    sizes = {k: v for k, v in CPU_MODEL.items() if k not in ("vocab_size", "max_position_embeddings")}
    with tempfile.TemporaryDirectory() as d:
        out = tool_calling.main(
            ["--out", d, "--steps", str(steps), "--prior-steps", "150", "--max-completion-length", "64"],
            sizes=sizes,
        )
    history = out["history"]
    rows = history[1:]

    def med(key: str) -> float:
        return statistics.median(r[f"train/{key}"] for r in rows)

    # a step's wall time: between consecutive rows (a row each step), rollout and training included
    walls = [b["train/elapsed_time"] - a["train/elapsed_time"] for a, b in zip(history, history[1:], strict=False)]
    step, rollout, tools, reward = (
        statistics.median(walls),
        med("time/rollout_s"),
        med("time/tools_s"),
        med("time/reward_s"),
    )
    return {  # medians over the steps after the first; the rollout's time is the generations' and the tools'
        "seconds_per_step": step,
        "rollout_s": rollout,
        "generate_s": rollout - tools,
        "tools_s": tools,
        "reward_s": reward,
        "calls_per_completion": med("tools/call_frequency"),
        "turns_per_completion": med("tools/turns"),
        "completion_tokens": med("completions/mean_length"),
    }


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what == "all":  # each in its own process, TRL and jaxloom on the same model
        from run import CPU_MODEL

        out: dict = {}
        with tempfile.TemporaryDirectory() as d:
            tiny_hf(Path(d) / "tiny")
            tiny_hf(Path(d) / "8m", CPU_MODEL)
            jobs = {
                "jaxloom": ["jaxloom", f"{d}/tiny"],
                "trl": ["trl", f"{d}/tiny"],
                "model_8m": ["jaxloom", f"{d}/8m", "64", "16"],
                "trl_8m": ["trl", f"{d}/8m", "64", "16"],
                "paged_8m": ["jaxloom", f"{d}/8m", "64", "16", "paged"],  # rollouts through LLMEngine
                "model_8m_128": ["jaxloom", f"{d}/8m", "128", "16"],
                "paged_8m_128": ["jaxloom", f"{d}/8m", "128", "16", "paged"],
                "trl_8m_128": ["trl", f"{d}/8m", "128", "16"],
            }
            for name, job in jobs.items():
                r = subprocess.run([sys.executable, __file__, *job], capture_output=True, text=True)
                if r.returncode:
                    raise RuntimeError(r.stderr[-3000:])
                out[name] = json.loads(r.stdout.strip().splitlines()[-1])
        out["trl_vs_jaxloom_seconds_per_step"] = out["trl"]["seconds_per_step"] / out["jaxloom"]["seconds_per_step"]
        out["trl_vs_jaxloom_8m"] = out["trl_8m"]["seconds_per_step"] / out["model_8m"]["seconds_per_step"]
        for n in ("8m", "8m_128"):  # TRL's step over jaxloom's, static and paged sampler
            for kind in ("model", "paged"):
                out[f"trl_vs_{kind}_{n}"] = out[f"trl_{n}"]["seconds_per_step"] / out[f"{kind}_{n}"]["seconds_per_step"]
        # asynchronous GRPO: a reward that waits on the host as long as the step's generation and training take
        wait = out["model_8m"]["seconds_per_step"] - out["model_8m"]["reward_s"]
        for name, staleness, partial in (
            ("judge_sync_8m", 0, 0),
            ("judge_async_8m", 1, 0),
            ("judge_partial_8m", 2, 16),
        ):
            job = [sys.executable, __file__, "jaxloom", f"{d}/8m", "64", "16", "static", str(staleness), f"{wait:.3f}"]
            job.append(str(partial))
            r = subprocess.run(job, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(r.stderr[-3000:])
            out[name] = {**json.loads(r.stdout.strip().splitlines()[-1]), "reward_wait_s": wait}
        out["async_vs_sync_8m"] = out["judge_async_8m"]["seconds_per_step"] / out["judge_sync_8m"]["seconds_per_step"]
        out["partial_vs_sync_8m"] = (
            out["judge_partial_8m"]["seconds_per_step"] / out["judge_sync_8m"]["seconds_per_step"]
        )
        r = subprocess.run([sys.executable, __file__, "multiturn"], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(r.stderr[-3000:])
        out["multiturn_8m"] = json.loads(r.stdout.strip().splitlines()[-1])
        print(json.dumps(out))
    elif what == "multiturn":
        print(json.dumps(run_multiturn()))
    else:  # one job: KIND MODEL_DIR [COMPLETION_TOKENS ROWS [ENGINE [MAX_STALENESS REWARD_WAIT_S [PARTIAL]]]]
        sizes: list = [int(x) for x in sys.argv[3:5]]
        if what == "trl":
            print(json.dumps(run_trl(sys.argv[2], *sizes)))
        else:
            more = [int(sys.argv[6]), float(sys.argv[7])] if len(sys.argv) > 7 else []
            more += [int(sys.argv[8])] if len(sys.argv) > 8 else []
            print(json.dumps(run_jaxloom(sys.argv[2], *sizes, *sys.argv[5:6], *more)))


if __name__ == "__main__":
    main()
