"""Records → token ids and loss masks (text, prompt/completion, chat messages)."""

from __future__ import annotations

import difflib
import json
import logging
from typing import Any

import numpy as np

from .images import check_image, open_image

log = logging.getLogger(__name__)


SKIP_HINT = (
    "fix that record, or set skip_bad_records=true (DataConfig(bad_records='skip')) to skip such records and count "
    "them; rerunning as it is stops at the same record"
)
"""The way past a bad record, said with every bad-record error of a run."""


def column_error(record: dict, config) -> ValueError:
    return ValueError(
        f"record has none of the columns {config.text_column!r}, {config.messages_column!r} or "
        f"{config.prompt_column!r}+{config.completion_column!r}; columns present: {sorted(record)}"
    )


def tokenize_record(record: dict[str, Any], tokenizer, config) -> tuple[np.ndarray, np.ndarray]:
    """`(ids, loss_mask)` for one record, by `tokenizer` under `config` (a `DataConfig`: columns, bos/eos);
    `loss_mask[t] = 1` when token t is a training target.
    Text: every token. Prompt/completion: the completion (and eos), or every token without
    `config.completion_only_loss`. Messages: assistant turns, or every token without `config.assistant_only_loss`.
    Pre-tokenized (`input_ids`, with `loss_mask` or HF-style `labels` where -100 marks no target, or
    neither: every token): used as they are, no BOS/EOS added."""
    if "input_ids" in record:
        return _pretokenized(record, len(tokenizer))
    check_record(record, config)
    bos = [tokenizer.bos_token_id] if config.add_bos and tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if config.add_eos and tokenizer.eos_token_id is not None else []
    _name_unread_columns(record, config)
    if config.messages_column in record:
        ids_a, mask_a = _chat(record[config.messages_column], tokenizer, **_template_inputs(record))
        return ids_a, mask_a if getattr(config, "assistant_only_loss", True) else np.ones_like(mask_a)
    if config.prompt_column in record and config.completion_column in record:
        p = tokenizer.encode(record[config.prompt_column], add_special_tokens=False)
        c = tokenizer.encode(record[config.completion_column], add_special_tokens=False)
        ids = bos + p + c + eos
        mask = [0] * (len(bos) + len(p)) + [1] * (len(c) + len(eos))
        if not getattr(config, "completion_only_loss", True):
            mask = [1] * len(ids)
        return np.asarray(ids, np.int32), np.asarray(mask, np.int32)
    text = record[config.text_column]
    ids = bos + tokenizer.encode(text, add_special_tokens=False) + eos
    return np.asarray(ids, np.int32), np.ones(len(ids), np.int32)


def record_images(record: dict[str, Any], column: str) -> list[Any]:
    """A record's images as TRL reads them: the list in `column` (`images`), or the one image in `image`; none
    when it has neither."""
    if record.get(column) is not None:
        value = record[column]
        if not isinstance(value, list | tuple):
            raise ValueError(f"column {column!r} holds {type(value).__name__}; expected a list of images")
        return list(value)
    return [] if record.get("image") is None else [record["image"]]


def refuse_images(record: Any, column: str = "images", max_images: int = 0) -> None:
    """One error when `record` holds images (`column`, or `image`) and its rows read none (`max_images` 0: a text
    model, or one whose image rows do not train yet): trained on, its images would be dropped without a word (TRL
    refuses such data for a model that reads no images too)."""
    if max_images or not isinstance(record, dict):
        return
    images = record_images(record, column)
    if images:
        raise ValueError(
            f"column {column!r} holds {len(images)} image(s), and this run's model reads none (a text model, or "
            "one whose image rows do not train yet: Qwen2.5-VL); expected records without images, or a model that "
            "reads them (Gemma 3)"
        )


def multimodal_messages(messages: list[dict], images: int) -> list[dict]:
    """`messages` with their `images` placed as TRL's `prepare_multimodal_messages` places them: a conversation of
    plain-text turns gets `images` `{"type": "image"}` blocks before the first user turn's text (every turn's text
    made a `{"type": "text"}` block); one already in content blocks keeps its image blocks, which must count
    `images`."""
    if all(isinstance(m.get("content"), str) for m in messages):
        out, placed = [], False
        for m in messages:
            blocks = [{"type": "text", "text": m["content"]}]
            if m["role"] == "user" and not placed:
                blocks, placed = [{"type": "image"} for _ in range(images)] + blocks, True
            out.append({**m, "content": blocks})
        if images and not placed:
            raise ValueError(f"{images} image(s) and no user turn to show them in; expected a user turn")
        return out
    blocks = sum(
        1 for m in messages if isinstance(m.get("content"), list) for b in m["content"] if b.get("type") == "image"
    )
    if blocks != images:
        raise ValueError(
            f"messages hold {blocks} image block(s) ({{'type': 'image'}}) for {images} image(s) in the record; "
            "expected one block per image"
        )
    return messages


def tokenize_image_record(
    record: dict[str, Any], processor: Any, config
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(ids, loss_mask, token_type_ids, pixel_values)` of one record of TRL's vision-language data, through
    `processor` (transformers' processor: its chat template, its image processor, its placeholder expansion — as
    TRL's `DataCollatorForVisionLanguageModeling` calls it) under `config` (a `DataConfig`: columns, losses).
    `messages` (image blocks, or plain turns with the images before the first user turn's text) or `text` (holding
    the processor's image placeholders); the images in `images_column` (or `image`). Targets: every token (TRL's
    default), or with `config.assistant_only_loss` the assistant turns' (found as for text conversations, carried
    over the processor's expansion). `token_type_ids` are the processor's (1 on image tokens; zeros for a processor
    without them). An image or count the processor rejects is one error naming the column."""
    if isinstance(record, dict) and "input_ids" in record:
        raise ValueError("a pre-tokenized record (input_ids) has no images to read; expected messages or text")
    check_record(record, config)
    _name_unread_columns(record, config)
    column = config.images_column
    images = [open_image(v, f"column {column!r} image {i}") for i, v in enumerate(record_images(record, column))]
    tokenizer = processor.tokenizer
    kwargs = {"return_tensors": "np", "add_special_tokens": False}
    if images:
        kwargs["images"] = [images]
    if config.messages_column in record:
        messages = multimodal_messages(record[config.messages_column], len(images))
        template = _template_inputs(record)
        text = tokenizer.apply_chat_template(messages, tokenize=False, **template)
    elif config.prompt_column in record or config.completion_column in record:
        raise ValueError(
            "prompt/completion records with images are not read yet; expected messages (TRL's conversational "
            "form) or text"
        )
    else:
        text = record[config.text_column]
    try:
        out = processor(text=[text], **kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the processor rejected the record's text and {len(images)} image(s) ({e})") from None
    ids = np.asarray(out["input_ids"][0], np.int32)
    if config.messages_column in record and getattr(config, "assistant_only_loss", True):
        plain, plain_mask = _chat(messages, tokenizer, **template)
        mask = _carried(plain, plain_mask, ids)
    else:
        mask = np.ones(len(ids), np.int32)
    types = np.asarray(out.get("token_type_ids", np.zeros((1, len(ids))))[0], np.int32)
    pixels = np.asarray(out["pixel_values"], np.float32) if images else np.zeros((0,), np.float32)
    if images and len(pixels) != len(images):
        raise ValueError(
            f"the processor made {len(pixels)} images of the record's {len(images)} (pan-and-scan crops?); "
            "expected one each"
        )
    return ids, mask, types, pixels


def tokenize_image_pair(record: dict[str, Any], processor: Any, config) -> tuple[np.ndarray, ...]:
    """`(chosen_ids, chosen_mask, rejected_ids, rejected_mask, chosen_types, rejected_types, pixel_values)` of one
    preference record of TRL's vision-language data, as TRL's `DataCollatorForVisionPreference` makes them: the
    prompt (`messages`, its images placed as `multimodal_messages` places them, rendered with the generation prompt;
    or text holding the processor's image placeholders) through `processor` with the record's images, then each
    completion's own tokens (a conversation's: its render after the prompt's) without special tokens; masks 1 on the
    completions, `token_type_ids` the processor's on the prompt. Too long for `config.max_sequence_length`: the
    completion's end is cut (`truncation_mode='keep_start'`, TRL's way with images), else one error (image tokens are
    never cut)."""
    cc, rc, pc = config.chosen_column, config.rejected_column, config.prompt_column
    missing = [c for c in (pc, cc, rc) if record.get(c) is None]
    if missing:
        raise ValueError(
            f"preference record with images has no {' or '.join(map(repr, missing))} column; expected {pc!r} (where "
            f"the images are shown), {cc!r} and {rc!r}; columns present: {sorted(record)}"
        )
    tokenizer = processor.tokenizer
    prompt, completions = record[pc], [record[cc], record[rc]]
    prompt_text, shown, prompt = shown_prompt(prompt, record_images(record, config.images_column), processor,
                                              config.images_column)  # fmt: skip
    if isinstance(prompt, list):
        texts = []
        for name, completion in ((cc, completions[0]), (rc, completions[1])):
            if not isinstance(completion, list):
                raise ValueError(f"column {name!r} holds {type(completion).__name__}; expected messages like {pc!r}")
            whole = tokenizer.apply_chat_template(prompt + multimodal_messages(completion, 0), tokenize=False)
            if not whole.startswith(prompt_text):
                raise ValueError(
                    f"the chat template renders the prompt with {name!r} so that it does not start with the prompt "
                    "rendered alone; expected a template whose prompt is a prefix"
                )
            texts.append(whole[len(prompt_text) :])
    else:
        texts = list(completions)
    p = np.asarray(shown["input_ids"][0], np.int32)
    p_types = np.asarray(shown.get("token_type_ids", np.zeros((1, len(p))))[0], np.int32)
    length, out = config.max_sequence_length, []
    for name, text in zip((cc, rc), texts, strict=True):
        c = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)
        if not len(c):
            raise ValueError(f"the {name!r} completion is empty; expected a non-empty completion")
        if len(p) + len(c) > length:
            if config.truncation_mode != "keep_start" or len(p) >= length:
                raise ValueError(
                    f"prompt ({len(p)} tokens, images included) + {name!r} ({len(c)}) is longer than "
                    f"max_sequence_length {length}; image tokens are never cut: raise it, or set truncation_mode="
                    "keep_start to cut the completion's end (TRL's only truncation with images)"
                )
            c = c[: length - len(p)]
        out.append((np.concatenate([p, c]), np.concatenate([np.zeros(len(p), np.int32), np.ones(len(c), np.int32)]),
                    np.concatenate([p_types, np.zeros(len(c), np.int32)])))  # fmt: skip
    (ci, cm, ct), (ri, rm, rt) = out
    return ci, cm, ri, rm, ct, rt, shown_pixels(shown)


def shown_prompt(prompt: Any, images: list[Any], processor: Any, column: str = "images") -> tuple[str, Any, Any]:
    """`(text, processed, prompt)`: a prompt showing `images` (messages — the images placed as `multimodal_messages`
    places them, rendered with the generation prompt — or text holding the processor's placeholders) through
    transformers' `processor` as TRL's vision collators call it (no special tokens added: the template has them);
    `processed` its outputs (`input_ids`, `pixel_values`, `token_type_ids` …), `prompt` as rendered. An image or
    count the processor rejects is one error naming `column`."""
    opened = [open_image(v, f"column {column!r} image {i}") for i, v in enumerate(images)]
    if isinstance(prompt, list):
        prompt = multimodal_messages(prompt, len(opened))
        text = processor.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise ValueError(f"a prompt of type {type(prompt).__name__}; expected text or messages")
    try:
        out = processor(text=[text], images=[opened] if opened else None, return_tensors="np", add_special_tokens=False)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the processor rejected the prompt and its {len(opened)} image(s) ({e})") from None
    return text, out, prompt


def shown_pixels(processed: Any) -> np.ndarray:
    """The `pixel_values [n, C, S, S]` float32 of `processed`, a processor's outputs (`[0]` when it was shown no
    image)."""
    if "pixel_values" not in processed:
        return np.zeros((0,), np.float32)
    return np.asarray(processed["pixel_values"], np.float32)


def _carried(plain: np.ndarray, plain_mask: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """`plain_mask` (over `plain`, a conversation's tokens with one placeholder per image) carried over to `ids` (the
    same with the placeholders expanded): tokens the two share keep their mask, inserted ones (images) get 0."""
    mask = np.zeros(len(ids), np.int32)
    matcher = difflib.SequenceMatcher(None, plain.tolist(), ids.tolist(), autojunk=False)
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op == "equal":
            mask[b0:b1] = plain_mask[a0:a1]
    return mask


CHAT_EXTRAS = ("tools", "chat_template_kwargs")
"""TRL's columns beside `messages`: the tool schemas and the keywords the chat template is rendered with."""
_NAMED: set[tuple[str, ...]] = set()


def _template_inputs(record: dict[str, Any]) -> dict[str, Any]:
    """What the chat template renders beside the messages, as TRL's SFTTrainer passes it: `tools` (a list of
    schemas or functions, or their JSON text) and the record's `chat_template_kwargs`."""
    out: dict[str, Any] = {}
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise ValueError(
                f"column 'tools' holds text that is not JSON ({e}); expected a list of tool schemas"
            ) from None
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError(f"column 'tools' holds {type(tools).__name__}; expected a list of tool schemas (TRL's)")
        out["tools"] = tools
    kwargs = record.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise ValueError(f"column 'chat_template_kwargs' holds {type(kwargs).__name__}; expected an object")
        out.update(kwargs)
    return out


def _check_images(record: dict[str, Any], config) -> None:
    """A record's images, checked without reading them: no more than the row holds, each file there (no URL)."""
    images = record_images(record, config.images_column)
    if len(images) > config.max_images:
        raise ValueError(
            f"column {config.images_column!r} holds {len(images)} images; a row holds at most {config.max_images} "
            "(max_images_per_row)"
        )
    for i, value in enumerate(images):
        check_image(value, f"column {config.images_column!r} image {i}")


def _name_unread_columns(record: dict[str, Any], config) -> None:
    """Columns of `record` that no part of its tokenization reads, named once per set in this process (a log
    warning): a column the user meant to train on is not dropped without a word."""
    read = {config.text_column, config.messages_column, config.prompt_column, config.completion_column, *CHAT_EXTRAS}
    if getattr(config, "max_images", 0):
        read |= {config.images_column, "image"}
    unread = tuple(sorted(k for k in record if k not in read))
    if unread and unread not in _NAMED:
        _NAMED.add(unread)
        log.warning(
            "record columns %s are not read (jaxloom reads %r, or %r with 'tools' and 'chat_template_kwargs', or %r + "
            "%r); rename a column to one of those to train on it",
            list(unread),
            config.text_column,
            config.messages_column,
            config.prompt_column,
            config.completion_column,
        )


def check_record(record: Any, config) -> None:
    """The checks of `tokenize_record` that need no tokenizer (the columns are there and hold text or
    messages): a ValueError saying what is wrong. Cheap enough to run over a whole small file before a run
    starts (`jaxloom.data.first_bad_record`)."""
    if not isinstance(record, dict):
        raise ValueError(f"a record must be an object, got {type(record).__name__}")
    if "input_ids" in record:
        return
    refuse_images(record, getattr(config, "images_column", "images"), getattr(config, "max_images", 0))
    if getattr(config, "max_images", 0):
        _check_images(record, config)
    if config.messages_column in record:
        messages = record[config.messages_column]
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.200}")
        _template_inputs(record)
        return
    if config.prompt_column in record and config.completion_column in record:
        for column in (config.prompt_column, config.completion_column):
            _check_text(record[column], column)
        return
    if config.text_column in record:
        _check_text(record[config.text_column], config.text_column)
        return
    raise column_error(record, config)


def _check_text(value: Any, column: str) -> None:
    """`value` of `column` is text a tokenizer takes: a `str` that is valid Unicode (no lone surrogate, which
    JSON's `\\ud800` escapes can make and which the tokenizers library rejects with a message naming neither)."""
    if not isinstance(value, str):
        raise ValueError(f"column {column!r} holds {type(value).__name__}, expected text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"column {column!r} holds a lone surrogate ({value[e.start]!r}) at character {e.start}; expected valid "
            "Unicode text"
        ) from None


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
    if ids.size and not mask[1:].any():  # the first token is never predicted: no target at all
        raise ValueError(
            f"a pre-tokenized row of {ids.size} tokens has no target token (its loss_mask/labels mark none after the "
            "first); it would train on nothing (a zero-loss step): expected at least one target"
        )
    return ids, mask


def _chat(messages: list[dict], tokenizer, **template: Any) -> tuple[np.ndarray, np.ndarray]:
    """The conversation rendered once by the chat template (the tokens the model reads at inference, as TRL
    tokenizes it); the targets are each assistant turn's characters after its role header (what
    `add_generation_prompt` adds), through the end of the turn (the end-of-turn token: where generation stops).

    A turn's characters come from rendering the conversation up to it: exact for templates that render a prefix
    of the conversation as a prefix of the whole (Llama 3, ChatML, Gemma, Phi-3). Templates that render earlier
    turns differently once a later one follows (Qwen3 drops the empty `<think>` block of every assistant turn
    but the last) are located by the turn's content in the whole render instead, with the template's
    end-of-turn token after it. Tokens are mapped to characters by the tokenizer's offsets. `template`: what the
    chat template renders beside the messages (`tools`, a record's `chat_template_kwargs`)."""
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.200}")
    if not any(m["role"] == "assistant" for m in messages):  # it would train on nothing: loss 0, silently
        roles = [m["role"] for m in messages]
        raise ValueError(
            f"messages with roles {roles} have no 'assistant' turn; expected at least one (its tokens are the targets)"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, **template)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = (
            tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True, **template)
            if i
            else ""
        )
        turn = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False, **template)
        if text.startswith(turn) and turn.startswith(head) and len(head) >= cursor:
            spans.append((len(head), len(turn)))
            cursor = len(turn)
            continue
        content = str(m["content"]).strip()
        at = text.find(content, cursor)
        if not content or at < 0:
            raise ValueError(
                f"the chat template of {type(tokenizer).__name__} renders assistant turn {i} so that its content "
                f"{content[:60]!r} cannot be found in the conversation; expected the content as written"
            )
        stop = at + len(content)
        after = text[stop:]
        gap = len(after) - len(after.lstrip(" \n"))
        marker = next((t for t in _special_tokens(tokenizer) if after[gap:].startswith(t)), None)
        if marker is not None:  # the end-of-turn token right after the content: a target (generation stops there)
            stop += gap + len(marker)
        spans.append((at, stop))
        cursor = stop
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], np.int32)
    mask = np.zeros(len(ids), np.int32)
    for t, (a, b) in enumerate(encoded["offset_mapping"]):
        mask[t] = any(a < e and b > s0 for s0, e in spans) or (a == b and any(s0 <= a < e for s0, e in spans))
    return ids, mask


def _special_tokens(tokenizer) -> list[str]:
    """The tokenizer's special tokens' texts, longest first (`<|im_end|>`, `<end_of_turn>`, `</s>`, ...)."""
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    special |= {
        t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if getattr(t, "special", False)
    }
    return sorted((t for t in special if t), key=len, reverse=True)


# ---- preference pairs -------------------------------------------------------------------------------------
def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _implicit_prompt(chosen, rejected):
    """TRL's `extract_prompt`: without a prompt, the prompt is what chosen and rejected share at the start
    (whole messages for chat; characters, less a trailing space, for text)."""
    n = _common_prefix(chosen, rejected)
    if isinstance(chosen, str) and 0 < n < len(chosen) and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def _ids(tokenizer, value, *, generation_prompt: bool = False) -> list[int]:
    if isinstance(value, list):  # chat messages: the template decides the special tokens
        out = tokenizer.apply_chat_template(
            value, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
        )
        return list(out["input_ids"])
    return list(tokenizer(value)["input_ids"])  # the tokenizer's own special-token policy (BOS or not)


def _check_messages(value, name: str) -> None:
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        raise ValueError(f"{name} must be text or a list of {{'role', 'content'}} messages, got {value!r:.200}")


def tokenize_pair(record: dict[str, Any], tokenizer, config) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(chosen_ids, chosen_mask, rejected_ids, rejected_mask)` of one preference record, tokenized as TRL's
    `DPOTrainer` does, so that losses compare token for token: text completions end with the EOS token
    (appended as text when missing); prompt + completion are tokenized together with the tokenizer's own
    special-token policy (chat: its template, the prompt with the generation prompt) and the prompt is their
    common prefix with the prompt alone; each sequence is cut to `config.max_sequence_length` by
    `config.truncation_mode` ('keep_start': its first tokens, 'keep_end': its last), or, with
    `config.long_records = 'raise'`, a longer one makes the record bad (TRL's `RewardTrainer` drops such pairs:
    skipped and counted with `bad_records='skip'`). Masks are 1 on completion tokens.
    Columns: `config.prompt_column` (optional: absent, the shared start of chosen and
    rejected is the prompt), `config.chosen_column`, `config.rejected_column`.

    A bad record is a ValueError saying what is wrong: a column missing, text mixed with messages, an
    empty completion, or a prompt that leaves no completion token within the length."""
    cc, rc, pc = config.chosen_column, config.rejected_column, config.prompt_column
    refuse_images(record, getattr(config, "images_column", "images"))
    missing = [c for c in (cc, rc) if c not in record or record[c] is None]
    if missing:
        raise ValueError(
            f"preference record has no {' or '.join(map(repr, missing))} column; expected {pc!r} (optional), "
            f"{cc!r} and {rc!r}; columns present: {sorted(record)}"
        )
    chosen, rejected, prompt = record[cc], record[rc], record.get(pc)
    chat = isinstance(chosen, list)
    for name, value in ((cc, chosen), (rc, rejected)) + (((pc, prompt),) if prompt is not None else ()):
        if chat:
            _check_messages(value, name)
        elif not isinstance(value, str):
            raise ValueError(f"column {name!r} holds {type(value).__name__}; expected text like {cc!r} (or messages)")
    if prompt is None:
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected)
    for name, value in ((cc, chosen), (rc, rejected)):
        empty = not value if chat else not value.strip()
        if empty or (chat and not any(str(m["content"]).strip() for m in value)):
            raise ValueError(f"the {name!r} completion is empty; expected a non-empty completion")
    (chosen_ids, chosen_mask), (rejected_ids, rejected_mask) = _sequences(
        prompt, ((cc, chosen), (rc, rejected)), chat, tokenizer, config
    )
    return chosen_ids, chosen_mask, rejected_ids, rejected_mask


def _sequences(prompt, completions, chat: bool, tokenizer, config) -> list[tuple[np.ndarray, np.ndarray]]:
    """`(ids, mask)` of prompt + each `(name, completion)`, as TRL's `DPOTrainer` and `KTOTrainer` tokenize them
    (see `tokenize_pair`): text completions end with EOS, the prompt is the common prefix with the prompt alone,
    each sequence cut to `config.max_sequence_length` by `config.truncation_mode`; masks are 1 on completions."""
    if not chat:
        eos = tokenizer.eos_token or ""
        completions = [(name, c if c.endswith(eos) else c + eos) for name, c in completions]
    p = _ids(tokenizer, prompt, generation_prompt=True) if prompt or not chat else []
    full = [(name, _ids(tokenizer, prompt + c)) for name, c in completions]
    n = min(_common_prefix(p, ids) for _, ids in full)
    length = config.max_sequence_length
    cut = slice(None, length) if config.truncation_mode == "keep_start" else slice(-length, None)
    out = []
    for name, ids in full:
        if config.long_records == "raise" and len(ids) > length:
            raise ValueError(
                f"the {name!r} sequence is {len(ids)} tokens, longer than max_length = {length}; expected pairs "
                "that fit (TRL's RewardTrainer drops longer ones: skip_bad_records=true does that, counting them)"
            )
        mask = np.zeros(len(ids), np.int32)
        mask[n:] = 1
        ids_a, mask = np.asarray(ids, np.int32)[cut], mask[cut]
        if not mask.any():
            raise ValueError(
                f"the prompt is {n} tokens, which leaves no {name!r} token within max_length = {length} "
                f"(truncation_mode={config.truncation_mode!r}); expected a shorter prompt or a larger max_length"
            )
        out.append((ids_a, mask))
    return out


def tokenize_labelled(record: dict[str, Any], tokenizer, config) -> tuple[np.ndarray, np.ndarray, float]:
    """`(ids, mask, label)` of one unpaired preference record (TRL's `KTOTrainer` data): `config.prompt_column`,
    `config.completion_column` (text, or chat messages: the prompt rendered with the generation prompt) and
    `config.label_column`, a boolean (true: a desirable completion) read as 1.0 or 0.0; tokenized by `tokenizer`
    as TRL does (see `tokenize_pair`), the mask 1 on the completion. A bad record is a ValueError saying what is
    wrong: a preference pair (chosen/rejected: one record per completion is expected), a column missing, a label that
    is not a boolean, an empty completion, or a prompt that leaves no completion token within the length."""
    pc, cc, lc = config.prompt_column, config.completion_column, config.label_column
    if not isinstance(record, dict):
        raise ValueError(f"an unpaired preference record must be an object, got {type(record).__name__}")
    refuse_images(record, getattr(config, "images_column", "images"))
    if config.chosen_column in record and config.rejected_column in record:
        raise ValueError(
            f"a preference pair ({config.chosen_column!r}/{config.rejected_column!r}); expected unpaired records "
            f"{pc!r}, {cc!r}, {lc!r} (TRL's unpair_preference_dataset makes them: one record per completion, label "
            "true for chosen, false for rejected), or trainer=dpo for pairs"
        )
    missing = [c for c in (pc, cc, lc) if record.get(c) is None]
    if missing:
        raise ValueError(
            f"unpaired preference record has no {' or '.join(map(repr, missing))} column; expected {pc!r}, {cc!r} and "
            f"{lc!r} (a boolean: true for a desirable completion); columns present: {sorted(record)}"
        )
    prompt, completion, label = record[pc], record[cc], record[lc]
    if not isinstance(label, bool):
        raise ValueError(f"{lc} = {label!r}; expected true (a desirable completion) or false (an undesirable one)")
    chat = isinstance(completion, list)
    for name, value in ((pc, prompt), (cc, completion)):
        if chat:
            _check_messages(value, name)
        elif not isinstance(value, str):
            raise ValueError(f"column {name!r} holds {type(value).__name__}; expected text like {cc!r} (or messages)")
    if (not completion) if chat else not completion.strip():
        raise ValueError(f"the {cc!r} completion is empty; expected a non-empty completion")
    ((ids, mask),) = _sequences(prompt, ((cc, completion),), chat, tokenizer, config)
    return ids, mask, float(label)
