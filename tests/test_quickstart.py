"""The quickstart's walk-through (docs/quickstart.md, section 4) runs as written: each command of its tested
block, in order, in a fresh directory, as a user types it (a new process each), with `$MODEL` a tiny Qwen2
directory with its own ChatML tokenizer and tiny sizes appended. A command that rots in the docs fails here."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- walkthrough:"
TINY = ["max_sequence_length=64", "total_batch_size=4", "progress_bar=false", "logging_steps=1", "save_steps=2"]


def walkthrough() -> list[str]:
    text = (ROOT / "docs" / "quickstart.md").read_text()
    block = text[text.index(MARK) :].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def chatml_model(directory: Path) -> None:
    """A tiny Qwen2 (random weights) with the bundled tokenizer in Qwen2.5's chat format, saved like a Hub model."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chat_styles", ROOT / "packages/data/tests/chat_styles.py")
    styles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(styles)
    tok = styles.chat_tokenizer("chatml", directory)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)


def data(directory: Path) -> None:
    questions = [
        ("What is two plus two?", "Four.", "Five."),
        ("Name a colour.", "Red.", "Seven."),
        ("Say hi.", "Hi!", "No."),
    ]
    with open(directory / "sft.jsonl", "w") as f:
        for q, a, _ in questions * 4:
            f.write(
                json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
            )
    with open(directory / "pairs.jsonl", "w") as f:
        for q, good, bad in questions * 4:
            user = [{"role": "user", "content": q}]
            f.write(
                json.dumps(
                    {
                        "prompt": user,
                        "chosen": [{"role": "assistant", "content": good}],
                        "rejected": [{"role": "assistant", "content": bad}],
                    }
                )
                + "\n"
            )


def test_the_quickstart_walkthrough_runs_command_by_command(tmp_path):
    commands = walkthrough()
    assert (
        commands[0].startswith("MODEL=") and any("--ray" in c for c in commands) and any("dpo" in c for c in commands)
    )
    chatml_model(tmp_path / "qwen")
    data(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = os.environ.get("JAXLOOM_TEST_XLA_FLAGS", "")  # the tests' compile settings only
    env.update(JAX_PLATFORMS="cpu", MODEL=str(tmp_path / "qwen"), RAY_ADDRESS="")
    jaxloom = str(Path(sys.executable).with_name("jaxloom"))
    outputs = []
    for line in commands[1:]:
        argv = shlex.split(os.path.expandvars(line.replace("$MODEL", env["MODEL"])))
        assert argv[0] == "jaxloom", line
        argv = [re.sub(r"^max_training_steps=\d+$", "max_training_steps=2", a) for a in argv[1:]]
        if argv[0] == "train":  # tiny sizes, before --ray's own settings
            cut = argv.index("--ray") if "--ray" in argv else len(argv)
            argv = [*argv[:cut], *TINY, *argv[cut:]]
        proc = subprocess.run([jaxloom, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        outputs.append((line, proc))
    runs = tmp_path / "runs"
    sft = json.loads((runs / "sft" / "run_config.json").read_text())
    assert sft["data"]["tokenizer"] == str(tmp_path / "qwen") and sft["learning_rate"] == 2e-5  # its own, TRL's
    assert json.loads((runs / "dpo" / "run_config.json").read_text())["learning_rate"] == 1e-6
    hf = transformers.AutoModelForCausalLM.from_pretrained(runs / "sft-hf")  # what convert wrote loads
    assert hf.config.model_type == "qwen2"
    generation = json.loads((runs / "sft-hf" / "generation_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(runs / "sft-hf")
    assert tok.convert_tokens_to_ids("<|im_end|>") in (
        generation["eos_token_id"] if isinstance(generation["eos_token_id"], list) else [generation["eos_token_id"]]
    )
    ray = json.loads(outputs[-1][1].stdout[outputs[-1][1].stdout.index("{") :])
    assert ray["step"] == 2 and ray["attempts"] == 1 and (runs / "sft-ray" / "report.md").is_file()
