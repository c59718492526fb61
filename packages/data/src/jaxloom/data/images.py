"""Images for models that see: read (a file, a `datasets` image, a PIL image; a URL refused offline), turned into
patches by transformers' own image processor, and their placeholder tokens expanded as transformers' processors do.

No image preprocessing is written here: resizing, normalising and patching are the image processor's
(`AutoImageProcessor`, which without torchvision is the PIL backend). What the processor class would also do — put
`image_token * (t·h·w / merge²)` where each image's one placeholder stands — is `expand_image_tokens`, done on token
ids so it composes with any tokenizer and chat template (Qwen2.5-VL's full processor needs torchvision for its video
half)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def open_image(value: Any, where: str) -> Any:
    """`value` as an RGB `PIL.Image`: a PIL image, a `datasets` image (`{"bytes", "path"}`), or a file path. `where`
    names it in the one error a bad value gets (a missing file, a URL — jaxloom reads no network —, bytes PIL
    cannot read, another type)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    check_image(value, where)  # a URL, a missing file, a type it does not read: refused before anything is opened
    if isinstance(value, dict) and value.get("bytes") is not None:
        try:
            return Image.open(io.BytesIO(value["bytes"])).convert("RGB")
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"{where}: its image bytes are not an image PIL reads ({e})") from None
    text = str(value["path"] if isinstance(value, dict) else value)
    try:
        with Image.open(Path(text).expanduser()) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{where}: {text} is not an image PIL reads ({e})") from None


def check_image(value: Any, where: str) -> None:
    """What `open_image` refuses of `value` without opening anything (a URL, a missing file, a type it does not
    read): one error naming `where`. Cheap enough to run over every record of a small file before a run starts."""
    if isinstance(value, dict) and value.get("bytes") is not None:
        return
    path = value.get("path") if isinstance(value, dict) else value
    if isinstance(path, str | Path):
        text = str(path)
        if text.startswith(("http://", "https://", "ftp://")):
            raise ValueError(
                f"{where}: image {text!r} is a URL; jaxloom reads images from files (it fetches nothing): download "
                "it and give its path"
            )
        if not Path(text).expanduser().is_file():
            raise ValueError(f"{where}: image file {text} does not exist")
        return
    if type(value).__module__.startswith("PIL."):
        return
    raise ValueError(
        f"{where}: an image of type {type(value).__name__}; expected a file path, a PIL image or a datasets image"
    )


def load_model_processor(path: str | Path) -> Any:
    """transformers' processor of model directory `path` (`AutoProcessor`: the tokenizer, the image processor and
    the image placeholders' expansion, as TRL trains vision-language models with it), the tokenizer given the
    processor's chat template where it has none. One error naming the directory when it has no processor files or
    transformers cannot build one here (Qwen2.5-VL's needs torchvision for its video half)."""
    from transformers import AutoProcessor

    path = Path(path)
    if not any((path / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")):
        raise ValueError(
            f"{path}: no processor_config.json or preprocessor_config.json, so no image processor; expected the "
            "model's files with them (as transformers' processor.save_pretrained writes them)"
        )
    try:
        processor = AutoProcessor.from_pretrained(str(path))
    except (ImportError, OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: transformers cannot build this model's processor here ({e})") from None
    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        raise ValueError(
            f"{path}: AutoProcessor gives a {type(processor).__name__}, not a processor with an image processor and "
            "a tokenizer; expected a vision-language model's files"
        )
    if getattr(processor.tokenizer, "chat_template", None) is None and getattr(processor, "chat_template", None):
        processor.tokenizer.chat_template = processor.chat_template
    return processor


def load_image_processor(path: str | Path) -> Any:
    """transformers' image processor of model directory `path` (its `preprocessor_config.json`); one error naming
    the directory when it has none."""
    from transformers import AutoImageProcessor

    if not (Path(path) / "preprocessor_config.json").is_file():
        raise ValueError(
            f"{path}: no preprocessor_config.json, so no image processor; expected the model's files with it (as "
            "transformers' processor.save_pretrained writes them)"
        )
    return AutoImageProcessor.from_pretrained(str(path))


def process_images(processor: Any, images: Sequence[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    """`(pixel_values [N, patch_dims] float32, image_grid_thw [n, 3] int64)` of `images` (each read by
    `open_image`) through `processor`; an image the processor rejects is one error naming `where`."""
    opened = [open_image(image, f"{where} image {i}") for i, image in enumerate(images)]
    try:
        out = processor(images=opened, return_tensors="np")
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: the image processor rejected an image ({e})") from None
    return np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"], np.int64).reshape(-1, 3)


def expand_image_tokens(
    ids: Sequence[int], grids: Any, image_token_id: int, merge_size: int, where: str = "the prompt"
) -> list[int]:
    """`ids` with each `image_token_id` (one placeholder per image, in order) repeated `t·h·w / merge_size ** 2`
    times for its image's grid in `grids [n, 3]` (the processor's `image_grid_thw`; `merge_size`: its spatial merge),
    as transformers' Qwen2-VL and Qwen2.5-VL processors expand `<|image_pad|>`. As many placeholders as images, or one
    error naming `where` and both counts."""
    grid = np.asarray(grids, np.int64).reshape(-1, 3)
    at = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(at) != len(grid):
        raise ValueError(
            f"{where} has {len(at)} image placeholder(s) (token {image_token_id}) for {len(grid)} image(s); expected "
            "one per image"
        )
    counts = grid.prod(-1) // (merge_size * merge_size)
    out: list[int] = []
    last = 0
    for i, n in zip(at, counts, strict=True):
        out += list(ids[last:i]) + [image_token_id] * int(n)
        last = i + 1
    return out + list(ids[last:])


def image_prompt(
    tokenizer: Any, text: str, images: int, *, chat: bool, tokens: tuple[int, int, int], system: str | None = None
) -> list[int]:
    """The ids of a prompt `text` with `images` images before it, each one placeholder (`tokens`: the model's
    `(vision_start, image, vision_end)` ids) to be expanded by `expand_image_tokens`: through the tokenizer's chat
    template as a user turn of image blocks then the text (TRL's `{"type": "image"}` content), or, without `chat`,
    `<vision_start><image><vision_end>` per image then the text. `system`: a system turn before it (with `chat`)."""
    start, image, end = (tokenizer.convert_ids_to_tokens(t) for t in tokens)
    if chat:
        content = [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": text}]
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(f"{start}{image}{end}" * images + text))


__all__ = ["check_image", "expand_image_tokens", "image_prompt", "load_image_processor", "load_model_processor",
           "open_image", "process_images"]  # fmt: skip
