"""Rollout bench rows (issue 50; `nox -s bench`, or alone): `python tools/bench/rollout_rows.py [step|engine]` → JSON.

1. `step CAP`: a GRPO step of the Trainer with ~20-token prompts, 8 completions of 32 tokens each (16 rows a step),
   a 4-layer Llama (hidden 256, the bundled 4,096-token tokenizer), `max_prompt_length=CAP` (`none`: unset, TRL
   1.16's behaviour), defaults otherwise: seconds per step after the first two (compiles). Cost must follow the
   data, not the cap: `all` prints the ratios of CAP 512 and unset to CAP 32.
2. `engine`: the in-process generator alone, 16 prompts × 8 completions of at most 64 tokens (128 rows), the stop
   set 2.2 % of the vocabulary so that about half the completions end before 32 tokens (a random model's
   next token is near uniform): generated tokens per second after a warm-up call, for the prompts laid out as
   GRPO laid them out before issue 50 (left-padded to `max_prompt_length=512`, each repeated 8 times) and as
   it lays them out now (the batch's longest prompt rounded up to a bucket, one prefill per prompt shared by
   its 8 completions); `bucketed` is the bucketed width without the shared prefill (what each change gives).

Run `all` on one code version; each measurement runs in its own process.
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

LAYERS4 = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
WORDS = ["red", "blue", "green", "cat", "dog", "tree", "sun", "moon"]


def prompt_records(n: int = 64) -> list[dict]:
    """Prompts of about 20 tokens of the bundled tokenizer."""
    return [
        {"prompt": f"Name a word that rhymes with {w}, then say {WORDS[(i + 3) % 8]} twice, and stop: "}
        for i, w in enumerate(WORDS * (n // 8))
    ]


def rhymes(prompts, completions, **kwargs):
    return [c.count("e") / max(len(c), 1) for c in completions]


def run_step(cap: str, steps: int = 6) -> dict:
    import jax

    import jaxloom.data as jd
    import jaxloom.models as jm
    from jaxloom.trainer import GRPOConfig, GRPOTrainer

    marks: list[float] = []

    class Clock:
        def on_step_end(self, trainer, step, metrics):
            jax.block_until_ready(trainer.state)
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        settings = dict(
            num_generations=8,
            total_batch_size=16,
            max_completion_length=32,
            max_training_steps=steps,
            learning_rate=1e-4,
            warmup_steps=0,
            logging_steps=1,
            save_directory=out,
            save_total_limit=1,
            seed=0,
        )
        if cap != "none":
            settings["max_prompt_length"] = int(cap)
        tok = jd.load_processor()
        model = jm.create_model(jm.LlamaConfig(**LAYERS4), jm.RuntimeConfig(), seed=0)
        trainer = GRPOTrainer(
            GRPOConfig(**settings),
            model=model,
            dataset_train=prompt_records(),
            processing_class=tok,
            reward_funcs=rhymes,
            hooks=[Clock()],
        )
        start = time.perf_counter()
        trainer.train()
    times = [b - a for a, b in zip([start, *marks[:-1]], marks, strict=True)]
    return {"cap": cap, "seconds_per_step": statistics.median(times[2:]), "first_steps_s": times[:2]}


def run_engine(layout: str, reps: int = 3) -> dict:
    import jax
    import numpy as np

    import jaxloom.data as jd
    import jaxloom.generation as jg
    import jaxloom.models as jm

    tok = jd.load_processor()
    model = jm.create_model(jm.LlamaConfig(**LAYERS4), jm.RuntimeConfig(), seed=0)
    encoded = [tok.encode(r["prompt"], add_special_tokens=False) for r in prompt_records(16)]
    group, n = 8, 64
    stop = tuple(range(100, 100 + 90))  # 2.2 % of 4,096: P(no stop in 32 tokens) = 0.978^32 ≈ 0.5
    config = jg.GenerationConfig(max_new_tokens=n, do_sample=True, temperature=1.0, eos_token_id=stop, pad_token_id=0)
    shared = layout == "now"
    width = 512 if layout == "before" else jg.decode.bucket(max(map(len, encoded)))
    ids = np.zeros((len(encoded), width), np.int32)
    mask = np.zeros_like(ids)
    for i, e in enumerate(encoded):
        ids[i, width - len(e) :], mask[i, width - len(e) :] = e, 1
    kwargs = {}
    if shared:
        assert "num_return_sequences" in inspect.signature(jg.generate).parameters
        kwargs["num_return_sequences"] = group
    else:
        ids, mask = np.repeat(ids, group, axis=0), np.repeat(mask, group, axis=0)
    times, tokens, ended = [], [], []
    for r in range(reps + 1):
        start = time.perf_counter()
        out = jg.generate(model, ids, mask, config, rng=jax.random.PRNGKey(r), **kwargs)
        m = np.asarray(out.completion_mask)
        if r:
            times.append(time.perf_counter() - start)
            tokens.append(int(m.sum()))
            ended.append(float((m.sum(1) < 32).mean()))
    return {
        "layout": layout,
        "prompt_width": width,
        "generated_tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times, strict=True)),
        "seconds": statistics.median(times),
        "ended_before_32": statistics.mean(ended),
    }


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what == "step":
        print(json.dumps(run_step(sys.argv[2])))
    elif what == "engine":
        print(json.dumps(run_engine(sys.argv[2])))
    else:
        out: dict = {}
        jobs = {f"step_cap_{c}": ["step", c] for c in ("32", "512", "none")}
        jobs |= {f"engine_{k}": ["engine", k] for k in ("before", "bucketed", "now")}
        for name, job in jobs.items():
            r = subprocess.run([sys.executable, __file__, *job], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"{name}: {r.stderr[-3000:]}")
            out[name] = json.loads(r.stdout.strip().splitlines()[-1])
        base = out["step_cap_32"]["seconds_per_step"]
        out["step_ratio_512_vs_32"] = out["step_cap_512"]["seconds_per_step"] / base
        out["step_ratio_unset_vs_32"] = out["step_cap_none"]["seconds_per_step"] / base
        out["engine_speedup"] = (
            out["engine_now"]["generated_tokens_per_s"] / out["engine_before"]["generated_tokens_per_s"]
        )
        print(json.dumps(out))


if __name__ == "__main__":
    main()
