"""A tiny Llama and small runs shared by the trainer tests."""

import jax
import numpy as np

import jaxloom.data as jd
import jaxloom.models as jm
from jaxloom.mesh import MeshConfig, gather, named_leaves
from jaxloom.trainer import Trainer, TrainingArguments

TOK = jd.load_processor()
CORPUS = jd.JsonlSource(jd.bundled_corpus_path()).read_shard(str(jd.bundled_corpus_path()))
TRAIN, EVAL = CORPUS[:-20], CORPUS[-20:]
# `jaxloom` command overrides for a tiny, fast run of the demo config.
CLI_TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
    "max_sequence_length=32",
    "total_batch_size=8",
    "progress_bar=false",
]


def tiny(hidden=32, layers=2, kind=jm.LlamaConfig, **kw):
    return kind(
        vocab_size=len(TOK),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        **kw,
    )


def quiet(tmp) -> dict:
    """What every small test run shares: a metrics row each step, no progress bar or TensorBoard file, seed 0,
    writing to `tmp` (None: no save directory)."""
    return dict(
        logging_steps=1,
        save_directory=None if tmp is None else str(tmp),
        progress_bar=False,
        use_tensorboard=False,
        plot_loss=False,  # loss.png: matplotlib's 1-2 s at each run's end (the tests that read it turn it on)
        seed=0,
    )


def args(tmp, **kw):
    """Small-run arguments writing to `tmp` (None: no save directory)."""
    base = dict(learning_rate=3e-3, warmup_steps=2, total_batch_size=8, max_sequence_length=32, max_training_steps=6)
    return TrainingArguments(**{**base, **quiet(tmp), **kw})


def mesh(n=1, **axes):
    return MeshConfig.from_axes(**(axes or {"fsdp": n})).build(jax.devices()[:n])


def trainer(tmp, config=None, mesh_=None, train=TRAIN, evaluation=EVAL, hooks=None, **kw):
    model = jm.create_model(config or tiny(), lazy=True)
    return Trainer(
        args(tmp, **kw),
        model,
        dataset_train=train,
        dataset_eval=evaluation,
        processing_class=TOK,
        mesh=mesh_ or mesh(1),
        hooks=hooks,
    )


def params_of(state) -> dict[str, np.ndarray]:
    return {k: gather(v) for k, v in named_leaves(state.params)}


def losses(out_dir) -> list[float]:
    import json
    from pathlib import Path

    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def models_tests(name: str):
    """A jaxloom-models test module's names (`test_qwen2_5_vl`, `test_gemma3_vl`: their shrunk Hub configs, processor
    files and prompts, one place), loaded by path."""
    import pathlib
    import runpy
    import types

    path = pathlib.Path(__file__).parents[2] / "models" / "tests" / f"{name}.py"
    return types.SimpleNamespace(**runpy.run_path(str(path)))
