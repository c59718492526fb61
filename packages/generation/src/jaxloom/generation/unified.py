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
    `tokenizer`'s chat template with `apply_chat_template=True` (a text is then the user's
    message). Each is encoded as `transformers` does:
    plain text with the tokenizer's own special-token policy (BOS where the tokenizer adds it), a rendered
    chat template as it is (the template writes its special tokens itself).
    Raises ValueError for an empty list or an empty prompt."""
    prompts = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)) else list(prompts)
    if not prompts:
        raise ValueError("the prompt list is empty")
    if apply_chat_template:  # a text is the user's message
        conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
        encoded = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    else:
        encoded = [list(tokenizer(p)["input_ids"]) for p in prompts]
    if any(len(e) == 0 for e in encoded):
        raise ValueError("a prompt is empty")
    return encoded


_TURN_MARK = "JAXLOOM-END-OF-CONTENT"


def end_of_turn_ids(tokenizer) -> tuple[int, ...]:
    """The special token the chat template of `tokenizer` writes right after an assistant message's
    content (`<|eot_id|>`, `<|im_end|>`, `<|end|>`, ...): where a chat reply ends, so generation with the
    template stops there. Empty when the tokenizer has no template or the template ends a turn with
    plain text."""
    if not getattr(tokenizer, "chat_template", None):
        return ()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _TURN_MARK}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses this conversation: nothing to learn from it
        return ()
    if _TURN_MARK not in text:
        return ()
    after = tokenizer.encode(text[text.index(_TURN_MARK) + len(_TURN_MARK) :], add_special_tokens=False)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    for token in after:
        if token in special:
            return (int(token),)
        if tokenizer.decode([token]).strip():  # visible text first: the template ends turns without a token
            return ()
    return ()


def with_stop_ids(config: GenerationConfig, ids) -> GenerationConfig:
    """`config` that also stops at `ids` (kept in order, without repeats)."""
    merged = tuple(dict.fromkeys((*config.eos_ids, *ids)))
    return config if merged == config.eos_ids else config.replace(eos_token_id=merged or None)


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
    `generation_config` updated by `overrides`, on `mesh` if given. With the chat template, generation
    also stops at the template's end-of-turn token (`end_of_turn_ids`)."""
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
        if apply_chat_template:
            config = with_stop_ids(config, end_of_turn_ids(tokenizer))
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
