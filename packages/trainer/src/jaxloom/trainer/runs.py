"""Configs and run directories as data: the model a config's `model` section describes, and the model of a
run directory's newest checkpoint, with no trainer built.

    model = model_of({"hidden_size": 64, ...}, runtime, vocab_size=4096)
    model = run_model("runs/a", mesh=mesh)          # its newest checkpoint's parameters, on `mesh`
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from flax import nnx

import jaxloom.data as jd
import jaxloom.models as jm
from jaxloom.mesh import MeshConfig

from .arguments import ALIASES, TrainingArguments
from .checkpointing import Checkpointing
from .plan import Plan
from .run_directory import RUN_CONFIG, RunDirectory

log = logging.getLogger("jaxloom.trainer")


def tokenizer_of(data_section: dict[str, Any], run_dir: str | Path | None = None):
    """The tokenizer a config names (`data.tokenizer`: 'bundled', a directory or a Hub id); a run
    directory's own copy (`RUN_DIR/tokenizer`) when there is one."""
    if run_dir is not None and (Path(run_dir) / "tokenizer").is_dir():
        return jd.load_processor(str(Path(run_dir) / "tokenizer"))
    name = data_section.get("tokenizer", "bundled")
    return jd.load_processor(None if name == "bundled" else name)


def own_tokenizer(model_dir: str | Path | None) -> str | None:
    """The tokenizer directory a model directory brings (absolute): an HF model directory holding a tokenizer,
    or a jaxloom run directory's copy (`RUN_DIR/tokenizer`); None when it has none."""
    if model_dir is None:
        return None
    where = Path(model_dir)
    if (where / RUN_CONFIG).is_file():
        where = where / "tokenizer"
    if not any((where / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return str(where.absolute())


def default_tokenizer(model_source: str | None, model: Any):
    """The tokenizer of a run given none: the model's own when it was given as a directory (`model_source`) or read
    from one (`jaxloom.models.pretrained_source`) that holds a tokenizer, as TRL and the command line take it; else the
    bundled one. The log says which."""
    source = own_tokenizer(model_source or jm.pretrained_source(model))
    tokenizer = jd.load_processor(source)
    if source is not None:
        log.info("tokenizer: the model's own, from %s (processing_class=... to use another)", source)
    else:
        log.info("tokenizer: the bundled one, %s tokens (processing_class=... to use another)", f"{len(tokenizer):,}")
    return tokenizer


def load_model(
    path: str | Path, runtime: jm.RuntimeConfig | None = None, *, name: str = "model", overrides: dict | None = None
) -> nnx.Module:
    """The model a directory holds: an HF model directory (config.json + safetensors, read with `runtime`'s layout
    and `overrides` of its config) or a jaxloom run directory (its newest checkpoint's parameters). `name` is the
    setting that gave `path`, for the error when it is neither."""
    where = Path(path)
    if (where / RUN_CONFIG).is_file():
        if overrides:
            raise ValueError(
                f"{name} = {str(path)!r} is a jaxloom run directory: its model is its own; model settings "
                f"{sorted(overrides)} apply only to a Hugging Face model directory"
            )
        return run_model(where)
    if (where / "config.json").is_file():
        return jm.from_pretrained(where, runtime, config_overrides=overrides or None, task=_task_of(where))
    raise FileNotFoundError(
        f"{name} = {str(path)!r}: expected a Hugging Face model directory (with config.json) or a jaxloom run "
        f"directory (with {RUN_CONFIG}){'' if where.exists() else '; it does not exist'}"
    )


def model_of(model_section: dict[str, Any], runtime: jm.RuntimeConfig, *, vocab_size: int) -> nnx.Module:
    """The model a config's `model` section describes: `from_pretrained: DIR` (other keys override its
    config), else a new abstract model of `model_type` (default llama) whose `vocab_size` defaults to the
    tokenizer's (`vocab_size`)."""
    section = dict(model_section)
    pretrained = section.pop("from_pretrained", None)
    if pretrained:
        return load_model(pretrained, runtime, name="model.from_pretrained", overrides=section)
    model_type = section.pop("model_type", "llama")
    if model_type not in jm.CONFIG_CLASSES:
        raise ValueError(f"model_type {model_type!r} is not supported; known: {sorted(jm.CONFIG_CLASSES)}")
    section.setdefault("vocab_size", vocab_size)
    return jm.create_model(jm.CONFIG_CLASSES[model_type].from_hf_dict(section), runtime, lazy=True)


def _task_of(model_dir: Path) -> jm.TaskType:
    """The task an HF model directory's `architectures` name: a `*ForSequenceClassification` (a reward model) is
    read as the classifier it is, anything else as a causal LM."""
    try:
        names = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    except (ValueError, AttributeError):
        names = []  # from_pretrained reports a malformed config.json itself
    if any(str(n).endswith("ForSequenceClassification") for n in names):
        return jm.TaskType.SEQUENCE_CLASSIFICATION
    return jm.TaskType.CAUSAL_LM


def run_model(run_dir: str | Path, *, mesh=None) -> nnx.Module:
    """The model of the newest checkpoint of the run in `run_dir` (parameters only), laid out on `mesh`
    (default: the mesh the run's arguments describe). Reads the run and changes nothing in it."""
    run = Path(run_dir)
    config = json.loads((run / RUN_CONFIG).read_text())
    model_section, data_section = dict(config.pop("model", {}) or {}), dict(config.pop("data", {}) or {})
    config.update(save_directory=str(run), resume_if_possible=True, overwrite_output_dir=False)
    config.update(max_training_steps=1)  # its length is not needed to read its weights
    args = common_arguments(config)
    runtime = args.runtime.apply(jm.RuntimeConfig())
    model = model_of(model_section, runtime, vocab_size=len(tokenizer_of(data_section, run)))
    if mesh is None:
        mesh = MeshConfig(args.sharding_axis_dims, args.sharding_axis_names, args.sharding_dcn_axis_dims).build()
    plan = Plan.build(args, model, mesh=mesh, total_steps=1, check_eval=False)
    checkpoints = Checkpointing(args.checkpoint, RunDirectory(args.checkpoint).checkpoints, read_only=True)
    try:
        return checkpoints.restore(plan.target(), params_only=True).state.model
    finally:
        checkpoints.close()


def common_arguments(config: dict[str, Any]) -> TrainingArguments:
    """The arguments every trainer kind shares, from a run's config (a kind's own keys, such as DPO's `beta`, are
    left out): all that reading a run's model needs — its mesh, runtime and checkpoint settings."""
    known = {f["name"] for f in TrainingArguments.fields()} | set(ALIASES)
    return TrainingArguments(**{k: v for k, v in config.items() if k in known})
