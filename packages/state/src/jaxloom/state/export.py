"""`save_pretrained`: a train state out as a Hugging Face model directory (or our own checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .train_state import TrainState


def save_pretrained(
    state: TrainState,
    path: str | Path,
    *,
    to_hf: bool = True,
    tokenizer: Any = None,
    dtype: Any = None,
    max_shard_bytes: int = 5 * 2**30,
    generation_config: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    merge_adapters: bool = False,
    base_model: str | None = None,
) -> Path | str:
    """`to_hf=True`: `config.json` + safetensors (sharded with an index past `max_shard_bytes`) and the
    tokenizer if given — a directory `transformers.AutoModelForCausalLM.from_pretrained` loads. It is
    written beside `path` and renamed into place: a crash or a full disk leaves the previous export intact,
    and no stale shard or index of it remains.
    Streaming: tensors are gathered, cast and written one at a time (a stacked layer's slice, not the
    stack), so host memory grows by about the largest tensor; only process 0 writes.
    `path` may be an object-store URI (`gs://bucket/model`; see jaxloom.core.paths).
    `to_hf=False`: an orbax checkpoint of the whole state at `path/<step>`. `dtype` casts floating
    weights on the way out (e.g. `"bfloat16"`). `generation_config`: fields of `generation_config.json`
    over the model config's special-token ids (e.g. `eos_token_id` as a list with a chat template's
    end-of-turn token, so `transformers`' `generate` stops where the model was trained to stop).
    `metadata` (JSON data, e.g. the training arguments) is recorded with an orbax checkpoint (`to_hf=False`).
    A LoRA state (`jaxloom.models.apply_lora`) is written, with `to_hf`, as a PEFT adapter directory
    (`adapter_config.json`, `adapter_model.safetensors`, the tokenizer; `base_model` recorded as
    `base_model_name_or_path`), or with `merge_adapters` as the merged full model transformers loads alone."""
    import jax

    from jaxloom.core import paths

    uri = paths.is_uri(str(path))
    path = str(path) if uri else Path(path)  # type: ignore[assignment]
    if not to_hf:
        from .checkpoint import CheckpointManager

        manager = CheckpointManager(str(path), async_save=False)
        manager.save(int(jax.device_get(state.step)), state, metadata=metadata)
        manager.close()
        return path
    from jaxloom.models.hf import atomic_directory, write_hf_export
    from jaxloom.models.lora import lora_config_of, merge_lora
    from jaxloom.models.peft import save_peft_adapter

    model = state.model
    if lora_config_of(model) is not None:
        if not merge_adapters:
            return save_peft_adapter(model, path, base=base_model, tokenizer=tokenizer)
        model = merge_lora(model)
    if jax.process_index() != 0:  # its part of each gather; process 0 writes
        write_hf_export(model, None, dtype=dtype, max_shard_bytes=max_shard_bytes)
        return path
    with atomic_directory(path) as tmp:  # an interrupted export leaves the previous one intact
        write_hf_export(model, tmp, dtype=dtype, max_shard_bytes=max_shard_bytes, generation=generation_config)
        if tokenizer is not None and uri:  # tokenizers write local files: written here, then uploaded
            import tempfile

            with tempfile.TemporaryDirectory() as local:
                tokenizer.save_pretrained(local)
                paths.upload_tree(local, tmp)
        elif tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return path
