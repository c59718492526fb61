"""What a run hands on: a state as a Hugging Face directory or an orbax checkpoint (`export`), and the
run's Markdown report (`report`), as pure functions of what they are given; `Exporter` offers them under
EasyDeL's names (`save_pretrained`, `save_information`) for a trainer's state.

    export(state, "out/hf", tokenizer=tok, to_hf=True, max_shard_size="2GB")
"""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Callable
from typing import Any

import jaxloom.state as js
from jaxloom.core import paths

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
    state: js.TrainState,
    directory: str | os.PathLike,
    *,
    tokenizer: Any,
    to_hf: bool,
    arguments: Any = None,
    files: Any = None,
    **options,
):
    """Write `state` to `directory`: an HF directory (`to_hf`: safetensors, config, the tokenizer — or `files`, what
    is saved in its place: a vision-language run's processor —, generation config with the template's end-of-turn
    token as EOS) or an orbax checkpoint of the whole state, which records the training `arguments` in its
    metadata (as EasyDeL's checkpoint keeps its arguments)."""
    metadata = None if to_hf or arguments is None else {"arguments": js.to_jsonable(arguments.to_dict())}
    return js.save_pretrained(
        state,
        os.fspath(directory),
        to_hf=to_hf,
        tokenizer=tokenizer if files is None else files,
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
    if isinstance(identity, dict) and "mixture" in identity:  # each part and its weight
        parts = [f"{describe_data(part, None)} ({weight:.0%})" for part, weight in identity["mixture"]]
        return "a mixture of " + ", ".join(parts)
    if isinstance(identity, dict) and "shards" in identity:
        return describe_data(identity["shards"], data)
    return type(data).__name__ if data is not None else "unnamed data"


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


class Exporter:
    """`save_pretrained` and `save_information` with EasyDeL's signatures. `current()` gives the state to
    write by default (setting the run up if needed), `tokenizer()` the run's tokenizer, `arguments()` the
    training arguments, `directory()` the run's `save_directory`, `facts()` what the report shows
    (`write_report`'s fields, with `identity`, `dataset_train` and `dataset_eval`), and `base()` where the
    run's model came from (a PEFT adapter's `base_model_name_or_path`; None: unknown), `files()` what an HF export
    writes beside the weights (default the tokenizer; a vision-language run's processor)."""

    def __init__(
        self,
        *,
        current: Callable[[], js.TrainState],
        tokenizer: Callable[[], Any],
        arguments: Callable[[], Any],
        directory: Callable[[], Path],
        facts: Callable[[], dict[str, Any]],
        base: Callable[[], str | None] = lambda: None,
        files: Callable[[], Any] | None = None,
    ):
        self.current, self.tokenizer, self.arguments = current, tokenizer, arguments
        self.files = files or tokenizer
        self.directory, self.facts, self.base = directory, facts, base

    def save_pretrained(
        self,
        state: js.TrainState | str | os.PathLike | None = None,
        save_directory: str | os.PathLike | js.TrainState | None = None,
        gather_fns=None,
        to_torch: bool = False,
        easystate_to_huggingface_model_kwargs: dict | None = None,
        torch_save_pretrained_kwargs: dict | None = None,
        *,
        to_hf: bool | None = None,
        merge_adapters: bool = False,
    ) -> Path | str:
        """Write `state` (default: the trainer's) to `save_directory`: with `to_torch` (or `to_hf`) a
        Hugging Face directory `transformers` loads (safetensors, config, tokenizer), else an orbax
        checkpoint of the whole state (with the training arguments in its metadata). The protocol's order
        `save_pretrained(ckpt_path, state)` works too. `easystate_to_huggingface_model_kwargs` takes `dtype`
        (cast the weights on the way out); `torch_save_pretrained_kwargs` takes `max_shard_size` (bytes, or
        "500MB"-style). `gather_fns` must be None: sharded arrays are gathered one at a time by the exporter.
        A LoRA run's state is written as a PEFT adapter directory, or with `merge_adapters` as the merged model."""
        if isinstance(state, str | os.PathLike):
            state, save_directory = save_directory, state  # type: ignore[assignment]
        if save_directory is None:
            raise ValueError("save_pretrained needs a save_directory")
        if gather_fns is not None:
            raise ValueError("gather_fns is not used by jaxloom: the exporter gathers each sharded array itself")
        options = export_options(easystate_to_huggingface_model_kwargs, torch_save_pretrained_kwargs)
        paths.check_writable_target(save_directory, "the export directory")  # before the state is gathered
        state = self.current() if state is None else state
        assert isinstance(state, js.TrainState) and isinstance(save_directory, str | os.PathLike)
        to_hf = bool(to_torch) if to_hf is None else to_hf
        if merge_adapters:
            options["merge_adapters"] = True
        options["base_model"] = self.base()  # a PEFT adapter names its base, so PEFT's loaders find it
        return export(
            state,
            save_directory,
            tokenizer=self.tokenizer(),
            to_hf=to_hf,
            arguments=self.arguments(),
            files=self.files(),
            **options,
        )

    def save_information(
        self,
        output_path: str | Path | None = None,
        *,
        final: dict | None = None,
        stop_reason: str = "not finished",
        samples: list[str] | None = None,
    ) -> Path:
        """A Markdown report of the run at `output_path` (default `save_directory/report.md`): model,
        parameters, mesh, data, steps, tokens seen and wall time over every segment of the run, why it
        stopped (`stop_reason`), `final` metrics, the eval history, the last generated `samples`,
        arguments, and package versions."""
        path = Path(output_path or self.directory() / "report.md")
        return report(path, **self.facts(), final=final or {}, stop_reason=stop_reason, samples=samples or [])
