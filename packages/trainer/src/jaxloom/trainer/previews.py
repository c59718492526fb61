"""Generation from a run's model: EasyDeL's `generate_unified` / `generate_aio` /
`create_generate_function` on the run's mesh and tokenizer, and the previews a run logs on its cadence.

    gen = Generation(arguments, tokenizer=lambda: tok, mesh=mesh)
    gen.unified(model, prompts=["Once upon a time"], max_new_tokens=16)
    gen.preview(model, step=100, log=step_log)   # generation_prompts, logged as samples of step 100
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import jaxloom.generation as jg


class Generation:
    """Decoding with the KV cache (`jaxloom.generation`) on `mesh` (sharded prompts) with the run's
    tokenizer (`tokenizer()`, which may load on first use). `last = (step, samples)` of the newest preview."""

    def __init__(self, arguments: Any, *, tokenizer: Callable[[], Any], mesh):
        self.arguments, self.tokenizer, self.mesh = arguments, tokenizer, mesh
        self.last: tuple[int | None, list[str]] = (None, [])

    def config(self, generation_config=None, overrides: dict | None = None) -> jg.GenerationConfig:
        """A `GenerationConfig` from ours, a transformers one or None, with `overrides` applied and the
        tokenizer's EOS where none is set."""
        return generation_config_of(generation_config, self.tokenizer()).replace(**(overrides or {}))

    def unified(
        self,
        model,
        input_ids=None,
        attention_mask=None,
        prompts=None,
        *,
        apply_chat_template=False,
        generation_config=None,
        shard_inputs: bool | None = None,
        **overrides,
    ) -> jg.GenerationResults:
        """`jaxloom.generation.generate_unified` with the run's tokenizer, on the mesh unless
        `shard_inputs` is False."""
        return jg.generate_unified(
            model,
            self.tokenizer(),
            input_ids,
            attention_mask,
            prompts,
            apply_chat_template=apply_chat_template,
            generation_config=self.config(generation_config, overrides),
            mesh=self.mesh if shard_inputs is not False else None,
        )

    def aio(self, model, input_ids, attention_mask=None, *, generation_config=None, shard_inputs=None, **overrides):
        """`(sequences, completion_ids, completion_mask)` and the config used."""
        config = self.config(generation_config, overrides)
        mesh = self.mesh if shard_inputs is not False else None
        return jg.generate_aio(model, input_ids, attention_mask, generation_config=config, mesh=mesh), config

    def function(self, generation_config=None, *, shard_inputs: bool = True, config_overrides=None, **kwargs):
        """`fn(state, input_ids, attention_mask)` decoding with the config and overrides."""
        return jg.create_generate_function(
            generation_config_of(generation_config, self.tokenizer()),
            shard_inputs=shard_inputs,
            config_overrides={**(config_overrides or {}), **kwargs},
            mesh=self.mesh,
        )

    def check_prompts(self, max_positions: int) -> None:
        """Every preview prompt, with the tokens to generate after it, fits the model's positions: checked
        before training, not at the first preview (which comes after steps that would then be lost)."""
        a = self.arguments
        if not a.generation_prompts:
            return
        try:
            encoded = jg.encode_prompts(self.tokenizer(), list(a.generation_prompts))
        except ValueError as e:
            raise ValueError(f"generation_prompts {list(a.generation_prompts)!r}: {e}") from None
        for i, (prompt, ids) in enumerate(zip(a.generation_prompts, encoded, strict=True)):
            if len(ids) + a.generation_max_new_tokens > max_positions:
                raise ValueError(
                    f"generation_prompts[{i}] = {prompt[:60]!r}{'...' if len(prompt) > 60 else ''} is {len(ids)} "
                    f"tokens, + generation_max_new_tokens = {a.generation_max_new_tokens}; expected at most the "
                    f"model's max_position_embeddings ({max_positions}) in all: shorten the prompt or generate fewer "
                    "tokens"
                )

    def preview(self, model, step: int, log: Any = None) -> list[str]:
        """Generate from `generation_prompts` with `model` (seeded by `step`) and log the samples with `log`
        (a `StepLog`). Every process runs the (sharded) decode; process 0 writes."""
        a = self.arguments
        prompts = [p for p in a.generation_prompts for _ in range(a.generation_num_samples)]
        res = self.unified(
            model,
            prompts=prompts,
            max_new_tokens=a.generation_max_new_tokens,
            seed=step,
            do_sample=a.generation_temperature > 0,
            temperature=a.generation_temperature,
        )
        if log is not None:
            log.samples(step, res.decoded_prompts, res.generation_results)
        self.last = (step, res.completion_prompts)
        return res.completion_prompts


def generation_config_of(config, tokenizer) -> jg.GenerationConfig:
    """A `jaxloom.generation.GenerationConfig` from ours, a transformers `GenerationConfig` or None, with
    the tokenizer's EOS and pad ids where the config has none."""
    if config is None:
        config = jg.GenerationConfig()
    elif not isinstance(config, jg.GenerationConfig):  # transformers' GenerationConfig
        fields = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id")
        given = {k: getattr(config, k) for k in fields if getattr(config, k, None) is not None}
        if isinstance(given.get("eos_token_id"), list | tuple):
            given["eos_token_id"] = tuple(given["eos_token_id"])
        config = jg.GenerationConfig(**given)
    if config.eos_token_id is None and tokenizer.eos_token_id is not None:
        config = config.replace(eos_token_id=tokenizer.eos_token_id)
    return config


def hf_generation_fields(config, tokenizer) -> dict[str, Any]:
    """The special-token ids of an export's `generation_config.json`: the model config's, else the
    tokenizer's; EOS also lists the tokenizer's EOS and its chat template's end-of-turn token, so that
    `transformers`' `generate` stops at the end of a document and of an assistant turn."""
    given = config.eos_token_id
    eos = [*((given,) if isinstance(given, int) else tuple(given or ()))]
    eos += [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    eos += list(jg.end_of_turn_ids(tokenizer))
    eos = list(dict.fromkeys(eos))
    fields = {
        k: getattr(config, k, None) if getattr(config, k, None) is not None else getattr(tokenizer, k, None)
        for k in ("bos_token_id", "pad_token_id")
    }
    return {**fields, "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None}


def prompt_length(input_ids) -> int:
    return int(np.shape(input_ids)[-1])
