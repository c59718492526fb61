"""What a run hands on: a state as a Hugging Face directory or an orbax checkpoint (`export`), and the
run's Markdown report (`report`). Pure functions of what they are given.

    export(state, "out/hf", tokenizer=tok, to_hf=True, max_shard_size="2GB")
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jaxloom.state as js

from .previews import hf_generation_fields
from .report import write_report
from .resume import data_identity


def export_options(
    easystate_to_huggingface_model_kwargs: dict | None, torch_save_pretrained_kwargs: dict | None
) -> dict[str, Any]:
    """EasyDeL's export keyword dictionaries as `export()`'s options: `dtype` (cast the weights) and
    `max_shard_size` (bytes, or "500MB"-style); anything else is an error naming it."""
    convert = dict(easystate_to_huggingface_model_kwargs or {})
    save_kw = dict(torch_save_pretrained_kwargs or {})
    unknown = sorted(set(convert) - {"dtype"}) + sorted(set(save_kw) - {"max_shard_size"})
    if unknown:
        raise ValueError(
            f"save_pretrained: unsupported export option(s) {unknown}; supported: "
            "easystate_to_huggingface_model_kwargs={'dtype'}, "
            "torch_save_pretrained_kwargs={'max_shard_size'}"
        )
    out: dict[str, Any] = {"dtype": convert.get("dtype")}
    if "max_shard_size" in save_kw:
        out["max_shard_bytes"] = shard_bytes(save_kw["max_shard_size"])
    return out


def export(
    state: js.TrainState, directory: str | os.PathLike, *, tokenizer: Any, to_hf: bool, arguments: Any = None, **options
):
    """Write `state` to `directory`: an HF directory (`to_hf`: safetensors, config, tokenizer, generation
    config with the template's end-of-turn token as EOS) or an orbax checkpoint of the whole state, which
    records the training `arguments` in its metadata (as EasyDeL's checkpoint keeps its arguments)."""
    metadata = None if to_hf or arguments is None else {"arguments": js.to_jsonable(arguments.to_dict())}
    return js.save_pretrained(
        state,
        os.fspath(directory),
        to_hf=to_hf,
        tokenizer=tokenizer,
        generation_config=hf_generation_fields(state.model.config, tokenizer),
        metadata=metadata,
        **options,
    )


def report(path: Path, *, dataset_train: Any, dataset_eval: Any, identity: dict[str, Any], **fields: Any) -> Path:
    """The Markdown report at `path`, written atomically; `fields` as `write_report` takes them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"training": describe_data(identity["train_data"], dataset_train)}
    if dataset_eval is not None:
        data["evaluation"] = describe_data(data_identity(dataset_eval), dataset_eval)
    tmp = path.with_name(f".{path.name}.tmp")
    write_report(tmp, data=data, **fields)
    os.replace(tmp, path)
    return path


def describe_data(identity: Any, data: Any) -> str:
    """A line naming the data: its files, a count of in-memory records, or its type."""
    if isinstance(identity, str):
        return identity
    if isinstance(identity, list):
        return identity[0] + (f" (+{len(identity) - 1} more)" if len(identity) > 1 else "")
    if isinstance(identity, dict) and "records" in identity:
        return f"{identity['records']:,} records in memory"
    return type(data).__name__


def shard_bytes(size: int | str) -> int:
    """`max_shard_size` as bytes: an int, or text such as '500MB', '2GB', '1.5GiB'."""
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    text = str(size).strip().upper()
    for unit, scale in units.items():
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * scale)
    raise ValueError(f"max_shard_size {size!r}; expected bytes or e.g. '500MB', '2GB'")
