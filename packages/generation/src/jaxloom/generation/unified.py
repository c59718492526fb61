"""`generate_unified`: prompts as ids, text or chat messages in; `GenerationResults` out."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .config import GenerationConfig
from .decode import generate


class GenerationResults(NamedTuple):
    """What `generate_unified` returns (a NamedTuple, as EasyDeL's): decoded completions
    (`generation_results`), the left-padded `prompt_ids`/`prompt_mask`, the full `sequences`, right-padded
    `completion_ids`/`completion_mask`, and the decoded prompts without (`decoded_prompts`) and with
    (`completion_prompts`) their completions."""

    generation_results: list[str]  # decoded completions
    prompt_ids: np.ndarray  # [B, P] left-padded
    prompt_mask: np.ndarray  # [B, P]
    sequences: np.ndarray  # [B, P + N]
    completion_ids: np.ndarray  # [B, N] right-padded
    completion_mask: np.ndarray  # [B, N]
    decoded_prompts: list[str]
    completion_prompts: list[str]  # prompt + completion, decoded


def encode_prompts(tokenizer, prompts, *, apply_chat_template: bool = False) -> list[list[int]]:
    """The token ids `generate_unified` decodes after, one list per prompt: `prompts` is a text, a list of
    texts, or chat message lists (a list of `{"role", "content"}` dicts, or a list of those) rendered by
    `tokenizer`'s chat template with `apply_chat_template=True`; plain text gets the tokenizer's BOS.
    Raises ValueError for an empty list or an empty prompt."""
    prompts = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)) else list(prompts)
    if not prompts:
        raise ValueError("the prompt list is empty")
    if apply_chat_template:
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        encoded = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    else:
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        encoded = [bos + tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    if any(len(e) == 0 for e in encoded):
        raise ValueError("a prompt is empty")
    return encoded


def generate_unified(
    model,
    tokenizer=None,
    input_ids=None,
    attention_mask=None,
    prompts=None,
    *,
    apply_chat_template: bool = False,
    generation_config: GenerationConfig | None = None,
    mesh=None,
    **overrides: Any,
) -> GenerationResults:
    """Generate with `model` from `input_ids` (+ `attention_mask`) or from `prompts` (text, or chat
    message lists with `apply_chat_template=True`, through the tokenizer's template), decoding with
    `generation_config` updated by `overrides`, on `mesh` if given."""
    if (input_ids is None) == (prompts is None):
        raise ValueError("give exactly one of input_ids or prompts")
    config = (generation_config or GenerationConfig()).replace(**overrides)
    if tokenizer is not None:
        if config.eos_token_id is None and tokenizer.eos_token_id is not None:
            config = config.replace(eos_token_id=tokenizer.eos_token_id)
        if tokenizer.pad_token_id is not None:
            config = config.replace(pad_token_id=tokenizer.pad_token_id)
    if prompts is not None:
        if tokenizer is None:
            raise ValueError("prompts need a tokenizer")
        encoded = encode_prompts(tokenizer, prompts, apply_chat_template=apply_chat_template)
        width = max(len(e) for e in encoded)
        input_ids = np.full((len(encoded), width), config.pad_token_id, np.int32)
        attention_mask = np.zeros_like(input_ids)
        for i, e in enumerate(encoded):
            input_ids[i, width - len(e) :] = e
            attention_mask[i, width - len(e) :] = 1
    input_ids = np.asarray(input_ids, np.int32)
    if input_ids.ndim != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, length] array, got shape {input_ids.shape}")
    attention_mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask, np.int32)
    out = generate(model, input_ids, attention_mask, config, mesh=mesh)
    comp, cmask = np.asarray(out.completion_ids), np.asarray(out.completion_mask)
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer else (lambda ids: "")
    completions = [decode(c[m > 0]) for c, m in zip(comp, cmask, strict=True)]
    decoded_prompts = [decode(p[m > 0]) for p, m in zip(input_ids, attention_mask, strict=True)]
    return GenerationResults(
        completions,
        input_ids,
        attention_mask,
        np.asarray(out.sequences),
        comp,
        cmask,
        decoded_prompts,
        [a + b for a, b in zip(decoded_prompts, completions, strict=True)],
    )


def generate_aio(
    model,
    input_ids,
    attention_mask=None,
    *,
    generation_config: GenerationConfig | None = None,
    mesh=None,
    **overrides: Any,
):
    """EasyDeL's `generate_aio`: `model` decodes after `input_ids` (+ `attention_mask`) with
    `generation_config` updated by `overrides`, on `mesh` if given; returns `(sequences, completion_ids,
    completion_mask)`."""
    config = (generation_config or GenerationConfig()).replace(**overrides)
    out = generate(model, input_ids, attention_mask, config, mesh=mesh)
    return out.sequences, out.completion_ids, out.completion_mask
