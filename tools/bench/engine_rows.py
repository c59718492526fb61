"""Rollout engine rows (issue 71; `nox -s bench`, or alone): `python tools/bench/engine_rows.py [ROW]` → JSON.

A random Llama (vocabulary 128, 4 layers, hidden 256), prompts of 16 tokens, sampling at temperature 1:

1. `mix`: 64 prompts whose completions end at an end id (a random model's next token is near uniform, so
   lengths are about geometric, mean ~ the vocabulary, with a long tail; cap 512) against the same prompts decoded
   to a uniform length (the mix's mean, no end id). Useful tokens per second (tokens up to and including each
   end) for the static decoder (`generate`) and for `LLMEngine` (64 slots); the ratio long-tail / uniform says
   whether the cost follows each sequence (1.0) or the cap and the tail.
2. `slots`: 256 requests through 64 slots against 64 requests at once (the engine), useful tokens/s: with the
   slots kept full, more requests than slots run at the speed of a full batch.
4. `peer`: the long-tail mix through transformers' continuous batching (`generate_batch`) on the same shape.
3. `tool`: a tool turn — a kept completion continued after a 24-token answer — counts its own tokens' prefill
   (1 + 24), not its history's.

Each timing is the best of 3 runs after a warm-up run (compiles); each row runs in its own process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from rollout_rows import LAYERS4

MODEL = {**LAYERS4, "vocab_size": 128}  # rollout_rows' 4-layer Llama, with the issue's 128-token vocabulary
END, CAP, PROMPT = 7, 512, 16


def _setup(n: int, seed: int = 0):
    import numpy as np

    import jaxloom.models as jm

    model = jm.create_model(jm.LlamaConfig(**MODEL), jm.RuntimeConfig(), seed=0)
    rng = np.random.default_rng(seed)
    prompts = rng.integers(8, 128, (n, PROMPT)).astype(np.int32)
    return model, prompts


def _best(fn, reps: int = 3):
    fn()  # warm-up: compiles
    best, out = float("inf"), None
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def _static(model, prompts, new: int, end: int | None):
    import numpy as np

    import jaxloom.generation as jg

    config = jg.GenerationConfig(max_new_tokens=new, do_sample=True, eos_token_id=end, seed=0)

    def run():
        out = jg.generate(model, prompts, None, config)
        return int(np.asarray(out.completion_mask).sum())

    return _best(run)


def _engine(model, prompts, new: int, end: int | None, slots: int = 64):
    import jaxloom.generation as jg

    def run():  # a fresh engine each time (its compiled calls are shared): request ids, so samples, repeat
        engine = jg.LLMEngine(model, jg.GenerationConfig(do_sample=True, seed=0), max_num_seqs=slots)
        outs = engine.generate(prompts.tolist(), max_new_tokens=new, eos_token_id=end)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return _best(run)


def row_mix() -> dict:
    model, prompts = _setup(64)
    out: dict = {}
    for name, fn in (("static", _static), ("engine", _engine)):
        t, tokens = fn(model, prompts, CAP, END)
        mean = tokens / len(prompts)
        out[name] = {"long_tail_tokens_per_s": tokens / t, "long_tail_mean_length": mean}
    uniform = round(out["engine"]["long_tail_mean_length"])
    for name, fn in (("static", _static), ("engine", _engine)):
        t, tokens = fn(model, prompts, uniform, None)
        out[name]["uniform_tokens_per_s"] = tokens / t
        out[name]["ratio"] = out[name]["long_tail_tokens_per_s"] / out[name]["uniform_tokens_per_s"]
    out["uniform_length"] = uniform
    engine, static = out["engine"], out["static"]
    out["engine_over_static_long_tail"] = engine["long_tail_tokens_per_s"] / static["long_tail_tokens_per_s"]
    return out


def row_slots() -> dict:
    model, prompts = _setup(256, seed=1)
    t_many, many = _engine(model, prompts, 128, END)
    t_few, few = _engine(model, prompts[:64], 128, END)
    return {
        "requests_256_tokens_per_s": many / t_many,
        "requests_64_tokens_per_s": few / t_few,
        "ratio": (many / t_many) / (few / t_few),
    }


def row_tool() -> dict:
    import jaxloom.generation as jg

    model, prompts = _setup(1)
    engine = jg.LLMEngine(model, max_num_seqs=4)
    (first,) = engine.generate([prompts[0].tolist()], max_new_tokens=40, keep=True, request_id=0)
    history = PROMPT + len(first.outputs[0].token_ids)
    before = engine.stats["prefill_tokens"]
    engine.extend(0, list(range(20, 44)), max_new_tokens=16)
    while engine.has_unfinished_requests():
        engine.step()
    return {"history_tokens": history, "tool_tokens": 24, "prefill_tokens": engine.stats["prefill_tokens"] - before}


def row_peer() -> dict:
    """The same long-tail mix through transformers' own continuous batching (`generate_batch`, pages of 16, 64
    requests a batch) on the same model shape (random weights, sdpa attention), best of 3 after a warm-up."""
    import numpy as np
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL, attn_implementation="sdpa")).eval()
    prompts = np.random.default_rng(0).integers(8, 128, (64, PROMPT)).tolist()
    config = transformers.GenerationConfig(
        max_new_tokens=CAP, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=END, pad_token_id=0
    )
    batching = transformers.ContinuousBatchingConfig(page_size=16, max_requests_per_batch=64)

    def run():
        with torch.no_grad():
            out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=batching)
        return sum(len(o.generated_tokens) for o in out.values())

    t, tokens = _best(run)
    return {"long_tail_tokens_per_s": tokens / t, "long_tail_mean_length": tokens / len(prompts)}


ROWS = {"mix": row_mix, "slots": row_slots, "tool": row_tool, "peer": row_peer}


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(ROWS[sys.argv[1]]()))
        return
    out = {}
    for name in ROWS:
        done = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, check=True)
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
