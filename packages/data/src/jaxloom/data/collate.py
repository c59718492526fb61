"""Helpers named as in EasyDeL: collate functions, single-sample processing, column names."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np


def extract_column_names(dataset: Any) -> list[str] | None:
    """Column names of a `datasets` dataset (or a list of dicts); a streaming `IterableDataset` whose
    features are unknown until read is asked for its first record (`take(1)`: nothing is consumed, as
    EasyDeL does); None when they cannot be known."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, dict):  # DatasetDict
        names = next(iter(names.values()), None)
    if names is not None:
        return list(names)
    if isinstance(dataset, Sequence) and dataset and isinstance(dataset[0], dict):
        return list(dataset[0])
    if callable(getattr(dataset, "take", None)):  # a streaming datasets.IterableDataset
        first = next(iter(dataset.take(1)), None)
        return list(first) if isinstance(first, dict) else None
    return None


def create_collect_function(
    max_sequence_length: int,
    truncation_mode: Literal["keep_end", "keep_start"] = "keep_end",
    pad_token_id: int = 0,
    padding_side: Literal["left", "right"] = "right",
) -> Callable:
    """A collate function: a list of `{"input_ids": [...], ...}` → numpy arrays of `max_sequence_length`,
    truncated by `truncation_mode` and padded with `pad_token_id` on `padding_side`; `attention_mask`
    marks real tokens."""
    if truncation_mode not in ("keep_end", "keep_start"):
        raise ValueError(f"truncation_mode {truncation_mode!r}; expected 'keep_end' or 'keep_start'")

    def collate(examples: list[dict]) -> dict[str, np.ndarray]:
        out: dict[str, list] = {}
        for ex in examples:
            ids = list(ex["input_ids"])
            keep = (
                slice(max(0, len(ids) - max_sequence_length), None)
                if truncation_mode == "keep_end"
                else slice(0, max_sequence_length)
            )
            for key, value in ex.items():
                value = list(value)[keep]
                pad = [pad_token_id if key == "input_ids" else 0] * (max_sequence_length - len(value))
                out.setdefault(key, []).append(pad + value if padding_side == "left" else value + pad)
            if "attention_mask" not in ex:
                n = len(ids[keep])
                pad = [0] * (max_sequence_length - n)
                out.setdefault("attention_mask", []).append(pad + [1] * n if padding_side == "left" else [1] * n + pad)
        return {k: np.asarray(v, np.int32) for k, v in out.items()}

    return collate


def process_sample_data(
    tokenizer, sample: str | dict, max_length: int, padding_side: str = "left", text_column: str = "text"
) -> dict[str, np.ndarray]:
    """One `sample`, a text (or a record with `text_column`), tokenized by `tokenizer` → `input_ids`,
    `attention_mask` of shape `[max_length]`, padded on `padding_side`."""
    text = sample[text_column] if isinstance(sample, dict) else sample
    enc = tokenizer(
        text,
        max_length=max_length,
        truncation=True,
        padding="max_length",
        padding_side=padding_side,
        return_tensors="np",
    )
    return {k: np.asarray(v).reshape(-1) for k, v in enc.items() if k in ("input_ids", "attention_mask")}


def process_messages_data(
    tokenizer, messages: list[dict], max_length: int, padding_side: str = "left", add_generation_prompt: bool = True
) -> dict[str, np.ndarray]:
    """Chat `messages` → `tokenizer`'s chat template applied (with the assistant header when
    `add_generation_prompt`), tokenized and padded on `padding_side` to `max_length` (flattened)."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side {padding_side!r}; expected 'left' or 'right'")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers versions differ in what tokenize=True returns
        ids = ids["input_ids"]
    ids = (
        list(ids)[-max_length:] if getattr(tokenizer, "truncation_side", "right") == "left" else list(ids)[:max_length]
    )
    pad = [tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0] * (max_length - len(ids))
    mask = [1] * len(ids)
    # Padded on `padding_side` by hand: transformers' chat template path ignores `padding_side`.
    if padding_side == "left":
        ids, mask = pad + ids, [0] * len(pad) + mask
    else:
        ids, mask = ids + pad, mask + [0] * len(pad)
    return {"input_ids": np.asarray(ids, np.int32), "attention_mask": np.asarray(mask, np.int32)}


def to_global(batch: dict[str, np.ndarray], mesh, global_batch_size: int) -> dict:
    """This process's rows of `batch` (from `DataLoader.for_mesh`) → global `jax.Array`s of
    `global_batch_size` rows on the batch axes of `mesh`."""
    import jax
    from jax.sharding import NamedSharding

    from jaxloom.mesh import batch_spec

    sharding = NamedSharding(mesh, batch_spec(mesh))
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (global_batch_size, *v.shape[1:]))
        for k, v in batch.items()
    }
