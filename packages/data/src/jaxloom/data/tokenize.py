"""Records → token ids and loss masks (text, prompt/completion, chat messages)."""

from __future__ import annotations

from typing import Any

import numpy as np


def column_error(record: dict, config) -> ValueError:
    return ValueError(
        f"record has none of the columns {config.text_column!r}, {config.messages_column!r} or "
        f"{config.prompt_column!r}+{config.completion_column!r}; columns present: {sorted(record)}"
    )


def tokenize_record(record: dict[str, Any], tokenizer, config) -> tuple[np.ndarray, np.ndarray]:
    """`(ids, loss_mask)` for one record, by `tokenizer` under `config` (a `DataConfig`: columns, bos/eos);
    `loss_mask[t] = 1` when token t is a training target.
    Text: every token. Prompt/completion: the completion (and eos). Messages: assistant turns.
    Pre-tokenized (`input_ids`, with `loss_mask` or HF-style `labels` where -100 marks no target, or
    neither: every token): used as they are, no BOS/EOS added."""
    if "input_ids" in record:
        return _pretokenized(record, len(tokenizer))
    bos = [tokenizer.bos_token_id] if config.add_bos and tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if config.add_eos and tokenizer.eos_token_id is not None else []
    if config.messages_column in record:
        return _chat(record[config.messages_column], tokenizer)
    if config.prompt_column in record and config.completion_column in record:
        p = tokenizer.encode(record[config.prompt_column], add_special_tokens=False)
        c = tokenizer.encode(record[config.completion_column], add_special_tokens=False)
        ids = bos + p + c + eos
        mask = [0] * (len(bos) + len(p)) + [1] * (len(c) + len(eos))
        return np.asarray(ids, np.int32), np.asarray(mask, np.int32)
    if config.text_column in record:
        text = record[config.text_column]
        if not isinstance(text, str):
            raise ValueError(f"column {config.text_column!r} holds {type(text).__name__}, expected text")
        ids = bos + tokenizer.encode(text, add_special_tokens=False) + eos
        return np.asarray(ids, np.int32), np.ones(len(ids), np.int32)
    raise column_error(record, config)


def _pretokenized(record: dict[str, Any], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(record["input_ids"])
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"input_ids must be a flat list of ints, got {ids.dtype} of shape {ids.shape}")
    ids = ids.astype(np.int32)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(
            f"input_ids hold {int(ids.min())}..{int(ids.max())}; expected ids in [0, {vocab}) of the tokenizer"
        )
    if record.get("loss_mask") is not None:
        mask = np.asarray(record["loss_mask"]).astype(np.int32)
    elif record.get("labels") is not None:
        mask = (np.asarray(record["labels"]) != -100).astype(np.int32)
    else:
        mask = np.ones(len(ids), np.int32)
    if mask.shape != ids.shape:
        raise ValueError(f"loss_mask/labels have {mask.size} values for {ids.size} input_ids; expected one per token")
    return ids, mask


def _chat(messages: list[dict], tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Render the chat template turn by turn; tokens added by an assistant turn are targets."""
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.200}")
    if not any(m["role"] == "assistant" for m in messages):  # it would train on nothing: loss 0, silently
        roles = [m["role"] for m in messages]
        raise ValueError(
            f"messages with roles {roles} have no 'assistant' turn; expected at least one (its tokens are the targets)"
        )
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        text = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        full = tokenizer.encode(text, add_special_tokens=False)
        if full[: len(ids)] != ids:  # template not prefix-stable: fall back to whole-turn diff by length
            full = ids + full[len(ids) :]
        new = full[len(ids) :]
        header = 0
        if m["role"] == "assistant":  # the role header is prompt: what add_generation_prompt would add
            prompt = (
                tokenizer.encode(
                    tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False,
                )
                if i
                else []
            )
            if prompt[: len(ids)] == ids:
                header = min(len(prompt) - len(ids), len(new))
        ids += new
        mask += [0] * header + [1 if m["role"] == "assistant" else 0] * (len(new) - header)
    return np.asarray(ids, np.int32), np.asarray(mask, np.int32)
