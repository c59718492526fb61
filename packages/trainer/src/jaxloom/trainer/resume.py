"""What a resumed run may change and what it may not. Every checkpoint records the run's identity (its
arguments, model config, tokenizer and training data, each as JSON); resuming compares it with the new
run's before anything is restored. Changes that cannot continue the run (the model, tokenizer, training
data, optimizer, batch) are one error listing each difference; the others (steps, schedule end,
cadences, logging, runtime) are applied and printed."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

# Arguments a run can change when it resumes; every other one is part of what the run is.
CHANGEABLE = frozenset(
    {
        # how long, and the schedule's end (it follows max_training_steps)
        "max_training_steps",
        "num_train_epochs",
        "end_learning_rate",
        "training_time_limit",
        # cadences and evaluation
        "logging_steps",
        "evaluation_steps",
        "eval_batches",
        "evaluation_batch_size",
        "nan_policy",
        # checkpointing (save_directory is the run itself)
        "save_directory",
        "checkpoint_directory",
        "save_steps",
        "save_minutes",
        "save_total_limit",
        "resume_if_possible",
        "overwrite_output_dir",
        "async_checkpointing",
        "checkpoint_format",  # each format restores whatever this says; new steps are written in this one
        "storage_endpoint_url",
        "storage_retry_seconds",
        "storage_lease_seconds",
        # how it computes and where: the restore reshards
        "dtype",
        "attn_mechanism",
        "attn_block_size",
        "attn_max_documents",
        "remat",
        "scan_unroll",  # the stacked layout is the same for any unroll
        "moe_implementation",
        "loss_block_size",
        "sharding_axis_dims",
        "sharding_axis_names",
        "sharding_dcn_axis_dims",
        "donate_state",
        "compilation_cache_dir",
        # logging and previews
        "use_tensorboard",
        "use_wandb",
        "wandb_project",
        "progress_bar",
        "plot_loss",
        "log_weight_distribution",
        "peak_flops_per_device",
        "profile_steps",
        "generation_interval",
        "generation_prompts",
        "generation_max_new_tokens",
        "generation_num_samples",
        "generation_temperature",
    }
)
# Written by the model config for bookkeeping, not part of the architecture.
_MODEL_BOOKKEEPING = frozenset({"transformers_version", "torch_dtype", "dtype", "architectures", "_name_or_path"})


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def tokenizer_identity(tokenizer: Any) -> dict[str, Any] | None:
    """Size, special-token ids and a SHA-256 of the vocabulary: equal for the same tokenizer however it
    was loaded (fast or slow, from the Hub or a copy)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a processor without a vocabulary: not compared
        return None
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
    return {
        "size": len(tokenizer),
        "vocab_sha256": digest,
        **{f"{k}_token_id": getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad")},
    }


def data_identity(data: Any) -> Any:
    """Paths as given; an HF dataset by its fingerprint; in-memory records by count and SHA-256; a custom
    source by its shard names; None (not compared) for what cannot be told without reading it."""
    if data is None:
        return None
    if isinstance(data, str | os.PathLike):
        return os.fspath(data)
    if isinstance(data, list | tuple) and data and all(isinstance(x, str | os.PathLike) for x in data):
        return [os.fspath(x) for x in data]
    parts, weights = getattr(data, "parts", None), getattr(data, "weights", None)
    if isinstance(parts, list) and weights is not None:  # a jaxloom.data.Mixture
        return {"mixture": [[data_identity(p), float(w)] for p, w in zip(parts, weights, strict=True)]}
    fingerprint = getattr(data, "_fingerprint", None)
    if isinstance(fingerprint, str):
        return {"dataset_fingerprint": fingerprint}
    if isinstance(data, list | tuple):
        digest = hashlib.sha256()
        for record in data:
            digest.update(json.dumps(record, sort_keys=True, default=str).encode())
        return {"records": len(data), "sha256": digest.hexdigest()[:16]}
    names = getattr(data, "shard_names", None)
    if isinstance(names, list | tuple):
        return {"source": type(data).__name__, "shards": [str(n) for n in names]}
    return None


def run_identity(arguments: Any, config: Any, tokenizer: Any, dataset_train: Any) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (JSON)."""
    model = {k: v for k, v in config.to_hf_dict().items() if k not in _MODEL_BOOKKEEPING}
    return _jsonable(
        {
            "arguments": arguments.to_dict(),
            "model": model,
            "tokenizer": tokenizer_identity(tokenizer),
            "train_data": data_identity(dataset_train),
        }
    )


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def compare(recorded: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """`(cannot_change, changed)`: lines `name: old → new` for the differences between a checkpoint's
    identity and the new run's. What the checkpoint did not record (older versions) is not compared."""
    fixed: list[str] = []
    changed: list[str] = []
    old_args, new_args = recorded.get("arguments") or {}, current.get("arguments") or {}
    for name, new in new_args.items():
        if name in old_args and old_args[name] != new:
            line = f"{name}: {_short(old_args[name])} → {_short(new)}"
            (changed if name in CHANGEABLE else fixed).append(line)
    old_model, new_model = recorded.get("model") or {}, current.get("model") or {}
    for name in sorted(set(old_model) | set(new_model)):
        if old_model and old_model.get(name) != new_model.get(name):
            fixed.append(f"model.{name}: {_short(old_model.get(name))} → {_short(new_model.get(name))}")
    for key, label in (("tokenizer", "tokenizer"), ("train_data", "training data")):
        old, new = recorded.get(key), current.get(key)
        if old is not None and new is not None and old != new:
            fixed.append(f"{label}: {_short(old)} → {_short(new)}")
    return fixed, changed


def check_resume(directory: str | Path, step: int, recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Raise ValueError when the run in `directory` (checkpoint `step`, whose identity is `recorded`)
    cannot continue as `current`; else return the changes that will apply (lines to print)."""
    fixed, changed = compare(recorded, current)
    if fixed:
        lines = "\n".join(f"  {line}" for line in fixed)
        raise ValueError(
            f"save_directory {directory} holds a run (checkpoint {step}) with settings this run cannot continue "
            f"with:\n{lines}\nTo train with the new settings, choose a new save_directory, or replace that run "
            "with overwrite_output_dir=true; to continue it, use its settings."
        )
    return changed


def fresh_run_directory(root: str = "jaxloom-runs") -> str:
    """A new run directory name, `ROOT/run-<date>-<time>-<random>`, the same on every process of a
    multi-process run (process 0's, broadcast)."""
    name = f"{root}/run-{datetime.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
    import jax

    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        raw = name.encode()
        buf = np.zeros(256, np.uint8)
        buf[: len(raw)] = np.frombuffer(raw, np.uint8)
        name = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).rstrip(b"\0").decode()
    return name
