"""LoRA SFT, jaxloom vs TRL + PEFT on the same job (`nox -s bench`, or alone): → one JSON line.

The 8.4M Llama (bench CPU_MODEL) as a Hugging Face model with the bundled tokenizer, LoRA r=16 on every linear
layer, rows of 256 tokens packed from the bundled corpus, 8 rows a step, float32, AdamW; steady-state tokens/s
after `WARMUP` steps, each trainer in its own process (jaxloom with its user-facing defaults: progress bar,
TensorBoard, metrics rows; TRL with `report_to=[]`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
STEPS, WARMUP, ROWS, LENGTH = 30, 5, 8, 256


def texts() -> list[str]:
    import jaxloom.data as jd

    path = jd.bundled_corpus_path()
    return [r["text"] for r in jd.JsonlSource(path).read_shard(str(path))]


def run_trl(model_dir: str) -> dict:
    import datasets
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    marks: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            marks[state.global_step] = time.perf_counter()

    with tempfile.TemporaryDirectory() as out:
        cfg = SFTConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=ROWS,
            max_length=LENGTH,
            packing=True,
            max_steps=STEPS,
            learning_rate=1e-3,
            logging_steps=10,
            report_to=[],
            save_strategy="no",
            seed=0,
            dataloader_num_workers=0,
        )
        trainer = SFTTrainer(
            model=model_dir,
            args=cfg,
            train_dataset=datasets.Dataset.from_dict({"text": texts()}),
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
            callbacks=[Clock()],
        )
        trainer.train()
    return {"tokens_per_second": (STEPS - WARMUP) * ROWS * LENGTH / (marks[STEPS] - marks[WARMUP])}


def run_jaxloom(model_dir: str) -> dict:
    import jax

    import jaxloom.data as jd
    import jaxloom.models as jm
    from jaxloom.trainer import Trainer, TrainingArguments

    marks: dict[int, float] = {}

    class Clock:
        def on_step_end(self, trainer, step, metrics):
            if step in (WARMUP, STEPS):
                jax.block_until_ready(trainer.state)
                marks[step] = time.perf_counter()

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            use_peft=True,
            lora_r=16,
            lora_alpha=32,
            lora_target_modules="all-linear",
            total_batch_size=ROWS,
            max_sequence_length=LENGTH,
            max_training_steps=STEPS,
            learning_rate=1e-3,
            warmup_steps=0,
            scheduler="linear",
            save_directory=out,
            dtype="float32",
        )
        Trainer(
            args,
            jm.from_pretrained(model_dir),
            dataset_train=[{"text": t} for t in texts()],
            processing_class=jd.load_processor(model_dir),
            hooks=[Clock()],
        ).train()
    return {"tokens_per_second": (STEPS - WARMUP) * ROWS * LENGTH / (marks[STEPS] - marks[WARMUP])}


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if len(sys.argv) > 2:
        print(json.dumps((run_trl if sys.argv[1] == "trl" else run_jaxloom)(sys.argv[2])))
        return
    from grpo_rows import tiny_hf
    from run import CPU_MODEL

    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        tiny_hf(Path(d) / "m", CPU_MODEL)
        for kind in ("jaxloom", "trl"):
            r = subprocess.run([sys.executable, __file__, kind, f"{d}/m"], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(r.stderr[-3000:])
            out[kind] = json.loads(r.stdout.strip().splitlines()[-1])
    out["jaxloom_vs_trl"] = out["jaxloom"]["tokens_per_second"] / out["trl"]["tokens_per_second"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
