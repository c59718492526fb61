"""Generation from a run's model: EasyDeL's `generate_unified` / `generate_aio` /
`create_generate_function` on the run's mesh and tokenizer, and the previews a run logs on its cadence.

    gen = Generation(arguments, tokenizer=lambda: tok, mesh=mesh, current=lambda: state)
    gen.generate_unified(prompts=["Once upon a time"], max_new_tokens=16)
    gen.preview(step=100)          # generation_prompts with the current state, logged as samples of step 100
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import jaxloom.generation as jg


class Generation:
    """Decoding with the KV cache (`jaxloom.generation`) on `mesh` (sharded prompts) with the run's
    tokenizer (`tokenizer()`, which may load on first use). `current()` gives the state to generate with
    by default and `setup()` readies it (the trainer's `model_state` and `initialize_trainer_utils`); `log()`
    the `StepLog` previews are written to. `last = (step, samples)` of the newest preview."""

    def __init__(
        self,
        arguments: Any,
        *,
        tokenizer: Callable[[], Any],
        mesh,
        current: Callable[[], Any] | None = None,
        setup: Callable[[], Any] | None = None,
        log: Callable[[], Any] | None = None,
    ):
        self.arguments, self.tokenizer, self.mesh = arguments, tokenizer, mesh
        self.current, self.setup, self.log = current, setup, log
        self.last: tuple[int | None, list[str]] = (None, [])

    def config(self, generation_config=None, overrides: dict | None = None) -> jg.GenerationConfig:
        """A `GenerationConfig` from ours, a transformers one or None, with `overrides` applied and the
        tokenizer's EOS where none is set."""
        return generation_config_of(generation_config, self.tokenizer()).replace(**(overrides or {}))

    def _model(self, state, use_esurge=None):
        if use_esurge:
            raise ValueError(
                "use_esurge=True: jaxloom has no eSurge engine; it decodes with a KV cache (leave use_esurge unset)"
            )
        if state is None:
            if self.setup is not None:
                self.setup()
            state = self.current() if self.current is not None else None
        if state is None:
            raise ValueError("no state to generate with: give state=...")
        return state.model

    def generate_unified(
        self,
        input_ids=None,
        attention_mask=None,
        prompts=None,
        *,
        state=None,
        use_esurge: bool | None = None,
        apply_chat_template: bool = False,
        generation_config=None,
        shard_inputs: bool | None = None,
        config_overrides: dict | None = None,
        all_gather: bool = False,
        **generate_kwargs,
    ) -> jg.GenerationResults:
        """Generate from `input_ids` (+ `attention_mask`) or text `prompts` (chat messages with
        `apply_chat_template`) with `state`'s model (default: the trained one); `generation_config` (a
        `jaxloom.generation.GenerationConfig` or a transformers one) updated by `config_overrides` and
        `generate_kwargs`. `shard_inputs` (default True) spreads the batch over the mesh. Results are on
        the host of every process, so `all_gather` changes nothing. `use_esurge=True` is an error: there
        is no eSurge engine here."""
        del all_gather  # always gathered: the results are numpy arrays on every process
        return jg.generate_unified(
            self._model(state, use_esurge),
            self.tokenizer(),
            input_ids,
            attention_mask,
            prompts,
            apply_chat_template=apply_chat_template,
            generation_config=self.config(generation_config, {**(config_overrides or {}), **generate_kwargs}),
            mesh=self.mesh if shard_inputs is not False else None,
        )

    def generate_aio(
        self,
        input_ids,
        attention_mask=None,
        *,
        state=None,
        generation_config=None,
        shard_inputs: bool | None = None,
        config_overrides: dict | None = None,
        return_metadata: bool = False,
        all_gather: bool = False,
        **generate_kwargs,
    ):
        """`(sequences, completion_ids, completion_mask)` decoded after `input_ids` (+ `attention_mask`)
        with `state`'s model; `generation_config`, `shard_inputs`, `config_overrides`, `all_gather` and
        `generate_kwargs` as in `generate_unified`. With `return_metadata`, also a dict with the
        `generation_config` used and the `prompt_length`."""
        del all_gather
        config = self.config(generation_config, {**(config_overrides or {}), **generate_kwargs})
        mesh = self.mesh if shard_inputs is not False else None
        out = jg.generate_aio(self._model(state), input_ids, attention_mask, generation_config=config, mesh=mesh)
        if return_metadata:
            return out, {"generation_config": config, "prompt_length": int(np.shape(input_ids)[-1])}
        return out

    def create_generate_function(
        self,
        generation_config=None,
        *,
        shard_inputs: bool = True,
        config_overrides: dict | None = None,
        **generate_kwargs,
    ):
        """`fn(state, input_ids, attention_mask) -> (sequences, completion_ids, completion_mask)` decoding
        with `generation_config` updated by `config_overrides` and `generate_kwargs`; with `shard_inputs`
        the prompts are spread over this mesh's batch axes."""
        return jg.create_generate_function(
            generation_config_of(generation_config, self.tokenizer()),
            shard_inputs=shard_inputs,
            config_overrides={**(config_overrides or {}), **generate_kwargs},
            mesh=self.mesh,
        )

    def maybe_generate(self, state: Any, step: int, metrics: dict | None = None) -> list[str] | None:
        """A preview from `generation_prompts` with `state` when one is due at `step` (every
        `generation_interval`); returns the samples, or None when none was due. `metrics` is unused."""
        a = self.arguments
        if not (a.generation_interval and a.generation_prompts and step % a.generation_interval == 0):
            return None
        return self.preview(step, state)

    def preview(self, step: int, state: Any = None) -> list[str]:
        """Generate from `generation_prompts` with `state` (default: the current one) and log the samples
        under `step` (also the sampling seed). Every process runs the (sharded) decode; process 0 writes."""
        a = self.arguments
        state = state if state is not None else self.current()  # type: ignore[misc]
        prompts = [p for p in a.generation_prompts for _ in range(a.generation_num_samples)]
        res = self.generate_unified(
            prompts=prompts,
            state=state,
            max_new_tokens=a.generation_max_new_tokens,
            seed=step,
            do_sample=a.generation_temperature > 0,
            temperature=a.generation_temperature,
        )
        log = self.log() if self.log is not None else None
        if log is not None:
            log.samples(step, res.decoded_prompts, res.generation_results)
        self.last = (step, res.completion_prompts)
        return res.completion_prompts

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
