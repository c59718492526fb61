"""Distillation bench rows (`nox -s bench`, or alone): `python tools/bench/distill_rows.py [jaxloom|trl ...]` → JSON.

The 8.4M Llama (bench CPU_MODEL) as the student and a teacher twice as wide (hidden 512, 8 layers: ~30M), random HF
models with the bundled 4,096-token tokenizer, on-policy distillation of 16 completions of 64 tokens a step
(`beta=0.5`), seconds per step after the first two (compiles / warm-up), each run in its own process:

1. jaxloom's `DistillationTrainer`, the step split into generation (`time/rollout_s`), the teacher (its forward
   over the step's rows alone, jitted and timed apart) and the student (the rest: its forward, backward and the
   divergence in blocks, the update).
2. TRL 1.16's `DistillationTrainer` on the same models and prompts (torch on the CPU).
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
ROWS, COMPLETION = 16, 64
TEACHER = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4
)


def prompts() -> list[dict]:
    return [{"prompt": f"say {w} and then {v}:"} for w in WORDS for v in WORDS]


def run_jaxloom(student: str, teacher: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxloom.data as jd
    import jaxloom.models as jm
    from jaxloom.trainer import DistillationConfig, DistillationTrainer

    marks: list[float] = []

    class Clock:
        def on_step_end(self, trainer, step, metrics):
            jax.block_until_ready(trainer.state)
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = DistillationConfig(
            teacher_model_name_or_path=teacher,
            beta=0.5,
            total_batch_size=ROWS,
            max_prompt_length=16,
            max_completion_length=COMPLETION,
            max_training_steps=STEPS,
            learning_rate=1e-4,
            warmup_steps=0,
            logging_steps=1,
            save_directory=out,
            seed=0,
            save_total_limit=1,  # defaults otherwise: progress bar, TensorBoard, a checkpoint at the end
        )
        trainer = DistillationTrainer(
            args,
            model=jm.from_pretrained(student),
            dataset_train=prompts(),
            processing_class=jd.load_processor(student),
            hooks=[Clock()],
        )
        start = time.perf_counter()
        trainer.train()
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        width = int(statistics.median(r["train/rows/width"] for r in rows if "train/rows/width" in r))
        ids = jnp.asarray(np.random.default_rng(0).integers(0, 4096, (ROWS, width)), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (ROWS, width))
        seg = jnp.ones((ROWS, width), jnp.int32)

        @jax.jit
        def teacher_forward(state, ids):
            return state.model(ids, positions=pos, segment_ids=seg, return_hidden=True).hidden

        jax.block_until_ready(teacher_forward(trainer.teacher, ids))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(teacher_forward(trainer.teacher, ids))
            times.append(time.perf_counter() - t0)
    steps = [b - a for a, b in zip([start, *marks[:-1]], marks, strict=True)]
    step = statistics.median(steps[2:])
    rollout = statistics.median(r["train/time/rollout_s"] for r in rows if "train/time/rollout_s" in r)
    teacher_s = statistics.median(times)
    return {
        "seconds_per_step": step,
        "first_step_s": steps[0],
        "generate_s": rollout,
        "teacher_s": teacher_s,
        "student_s": step - rollout - teacher_s,
        "row_width": width,
    }


def run_trl(student: str, teacher: str) -> dict:
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        cfg = DistillationConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            per_device_train_batch_size=ROWS,
            max_completion_length=COMPLETION,
            beta=0.5,
            max_steps=STEPS,
            learning_rate=1e-4,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            seed=0,
        )
        trainer = DistillationTrainer(
            model=student,
            teacher_model=teacher,
            args=cfg,
            train_dataset=datasets.Dataset.from_list(prompts()),
            processing_class=AutoTokenizer.from_pretrained(student, padding_side="left"),
            callbacks=[Clock()],
        )
        start = time.perf_counter()
        trainer.train()
    steps = [b - a for a, b in zip([start, *marks[:-1]], marks, strict=True)]
    return {"seconds_per_step": statistics.median(steps[2:]), "first_step_s": steps[0]}


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what != "all":  # one job: KIND STUDENT_DIR TEACHER_DIR
        print(json.dumps((run_trl if what == "trl" else run_jaxloom)(sys.argv[2], sys.argv[3])))
        return
    from grpo_rows import tiny_hf
    from run import CPU_MODEL

    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        tiny_hf(Path(d) / "student", CPU_MODEL)
        tiny_hf(Path(d) / "teacher", TEACHER)
        for name in ("jaxloom", "trl"):
            r = subprocess.run(
                [sys.executable, __file__, name, f"{d}/student", f"{d}/teacher"], capture_output=True, text=True
            )
            out[name] = (
                json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-2000:]}
            )
    if "seconds_per_step" in out["jaxloom"] and "seconds_per_step" in out["trl"]:
        out["trl_vs_jaxloom"] = out["trl"]["seconds_per_step"] / out["jaxloom"]["seconds_per_step"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
