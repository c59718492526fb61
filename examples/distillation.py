"""On-policy distillation: a teacher trained on the bundled corpus, then a smaller student distilled from it.

The student completes prompts itself (the first words of the corpus' lines) and is trained to match the teacher's
next-token distributions on its own completions (TRL's generalized JSD; `beta=0.5`). The same run from the command
line, with a teacher directory of your own:
`jaxloom train trainer=distillation teacher_model_name_or_path=TEACHER model.from_pretrained=STUDENT
data.train=prompts.jsonl`.

    python examples/distillation.py --out runs/distill                      # a few minutes on CPU
    python examples/distillation.py --out /tmp/distill --steps 4 --tiny     # seconds (what the test runs)
"""

from __future__ import annotations

import argparse

import jaxloom.data as jd
import jaxloom.models as jm
from jaxloom.trainer import DistillationConfig, DistillationTrainer, Trainer, TrainingArguments


def llama(vocab: int, width: int, layers: int) -> jm.LlamaConfig:
    return jm.LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Train a teacher, then distill it into a smaller student.")
    p.add_argument("--out", default="runs/distill")
    p.add_argument("--steps", type=int, default=60, help="distillation steps")
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args(argv)

    tokenizer = jd.load_processor()
    corpus = jd.JsonlSource(jd.bundled_corpus_path()).read_shard(str(jd.bundled_corpus_path()))
    teacher_steps = 20 if a.tiny else 300
    teacher_run = Trainer(
        TrainingArguments(
            max_sequence_length=64,
            total_batch_size=16,
            max_training_steps=teacher_steps,
            learning_rate=3e-3,
            save_directory=f"{a.out}/teacher",
            progress_bar=False,
        ),
        model=jm.create_model(llama(len(tokenizer), 48 if a.tiny else 128, 2 if a.tiny else 4), seed=0),
        dataset_train=corpus,
        processing_class=tokenizer,
    ).train()
    print(f"teacher: {teacher_steps} steps of next-token training, loss {teacher_run.metrics['loss']:.3f}")

    prompts = [{"prompt": " ".join(r["text"].split()[:6])} for r in corpus[:256]]
    student = DistillationTrainer(
        DistillationConfig(
            max_prompt_length=16,
            max_completion_length=16,
            beta=0.5,
            total_batch_size=16,
            max_training_steps=a.steps,
            learning_rate=3e-3,
            logging_steps=1,
            save_directory=f"{a.out}/student",
            progress_bar=False,
        ),
        model=jm.create_model(llama(len(tokenizer), 32 if a.tiny else 64, 2), seed=1),
        dataset_train=prompts,
        processing_class=tokenizer,
        teacher_model=teacher_run.state.model,
    )
    out = student.train()
    print(f"student: {a.steps} steps of distillation, last loss {out.metrics['loss']:.4f}")
    return out.metrics


if __name__ == "__main__":
    main()
