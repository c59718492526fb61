"""lm-evaluation-harness on jaxloom vs lm-eval's `hf` model (issue 76), the same model and tasks: `nox -s bench`, or
alone: `python tools/bench/lm_eval_rows.py [--docs N]`.

A ~8M-parameter Llama made with transformers (float32, 256 positions) and three local tasks (no network): multiple
choice over `--docs` questions (4 choices: loglikelihood), generation to a stop sequence (a quarter as many), and
rolling perplexity over texts longer than the model's positions. Each backend runs in its own process; prints one
JSON line: each backend's seconds in `simple_evaluate` (model loading apart), the ratio, and whether every score
agrees (1e-4).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = "apple river stone cloud green seven light music table north quiet window paper salt horse bread".split()


def make(root: Path, docs: int) -> None:
    import numpy as np
    import torch
    import transformers

    import jaxloom.data as jd

    tok = jd.load_processor()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rng = np.random.default_rng(0)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.integers(lo, hi)))

    rows = {
        "mc": [
            {"q": words(5, 30), "choices": [words(1, 6) for _ in range(4)], "a": int(rng.integers(4))}
            for _ in range(docs)
        ],  # fmt: skip
        "gen": [{"q": words(5, 30), "a": str(rng.choice(WORDS))} for _ in range(max(1, docs // 4))],
        "text": [{"text": words(100, 400)} for _ in range(max(1, docs // 12))],
    }
    tasks = root / "tasks"
    tasks.mkdir()
    for name, got in rows.items():
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in got))
    head = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (tasks / "b_mc.yaml").write_text(
        "task: b_mc\n" + head.format(tasks / "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{q}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{a}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (tasks / "b_gen.yaml").write_text(
        "task: b_gen\n" + head.format(tasks / "gen.jsonl") + "output_type: generate_until\n"
        'doc_to_text: "Q: {{q}}\\nA:"\ndoc_to_target: "{{a}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 32\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    (tasks / "b_text.yaml").write_text(
        "task: b_text\n" + head.format(tasks / "text.jsonl") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: bits_per_byte\n'
    )


def measure(root: Path, backend: str) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    if backend == "jaxloom":
        import jaxloom.trainer.harness as harness

        lm = harness.JaxloomLM(pretrained=str(root / "model"), batch_size=16)
        lm.model  # noqa: B018 - loaded before the clock starts, as hf's is in its constructor
    else:
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=str(root / "model"), dtype="float32", device="cpu", batch_size=16)
    manager = TaskManager(include_path=str(root / "tasks"), include_defaults=False)
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=["b_mc", "b_gen", "b_text"], task_manager=manager)
    seconds = time.perf_counter() - start
    scores = {f"{t}/{k}": v for t, r in out["results"].items() for k, v in r.items() if isinstance(v, float)}
    split = {k: round(v, 2) for k, v in getattr(lm, "timings", {}).items()}
    return {"seconds": seconds, "scores": scores, "split": split}


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--one":
        print(json.dumps(measure(Path(argv[1]), argv[2])))
        return 0
    docs = int(argv[argv.index("--docs") + 1]) if "--docs" in argv else 96
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make(root, docs)
        runs = {}
        for backend in ("hf", "jaxloom"):
            proc = subprocess.run(
                [sys.executable, __file__, "--one", str(root), backend], capture_output=True, text=True, timeout=1800
            )
            if proc.returncode:
                raise RuntimeError(proc.stderr[-3000:])
            runs[backend] = json.loads(proc.stdout.strip().splitlines()[-1])
    a, b = runs["hf"]["scores"], runs["jaxloom"]["scores"]
    agree = a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])) for k in a)
    print(json.dumps({
        "docs": docs,
        "hf_s": round(runs["hf"]["seconds"], 2),
        "jaxloom_s": round(runs["jaxloom"]["seconds"], 2),
        "speedup": round(runs["hf"]["seconds"] / runs["jaxloom"]["seconds"], 3),
        "jaxloom_split_s": runs["jaxloom"]["split"],
        "scores_agree": agree,
        "scores": b,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
