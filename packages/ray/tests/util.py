"""Shared bits of the Ray tests: a tiny base model directory, tiny arguments, the bundled corpus."""

import json
from pathlib import Path

import jaxloom.data as jd
from jaxloom.trainer import TrainingArguments

TOK = jd.load_processor()
CORPUS = jd.JsonlSource(jd.bundled_corpus_path()).read_shard(str(jd.bundled_corpus_path()))
TRAIN, EVAL = CORPUS[:-20], CORPUS[-20:]
SCALING = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}
FIXED = {"dtype": "float32", "param_dtype": "float32", "max_position_embeddings": 64}


def base_model_dir(root: Path, **config) -> Path:
    """A Hugging Face-style directory: config.json of a 2-layer Llama and the bundled tokenizer."""
    path = Path(root) / "base"
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model_type": "llama",
        "vocab_size": len(TOK),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
        **config,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    TOK.save_pretrained(path)
    return path


def args(save_directory, **kw) -> TrainingArguments:
    base = dict(
        learning_rate=3e-3,
        warmup_steps=1,
        total_batch_size=8,
        max_sequence_length=32,
        max_training_steps=4,
        logging_steps=1,
        save_directory=str(save_directory),
        progress_bar=False,
        use_tensorboard=False,
        seed=0,
        sharding_axis_dims=(1, -1, 1, 1, 1),
    )
    return TrainingArguments(**{**base, **kw})


TINY_OVERRIDES = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.max_position_embeddings=64",
    "total_batch_size=4",
    "max_sequence_length=32",
    "logging_steps=1",
    "evaluation_steps=null",
    "generation_interval=null",
    "generation_prompts=[]",
    "progress_bar=false",
    "use_tensorboard=false",
    "plot_loss=false",
    "warmup_steps=1",
    "eval_batches=2",
]
