"""Llama, Mistral and Qwen2 for causal LM in Flax NNX: the shared decoder (`decoder.py`), configured by family."""

from __future__ import annotations

from .configs import LlamaConfig, MistralConfig, Qwen2Config
from .decoder import CausalLM
from .registry import TaskType, register


@register("llama", TaskType.CAUSAL_LM)
class LlamaForCausalLM(CausalLM):
    """Llama for causal language modelling (`LlamaForCausalLM(config, runtime, rngs=nnx.Rngs(0))`)."""

    config_class = LlamaConfig


@register("mistral", TaskType.CAUSAL_LM)
class MistralForCausalLM(CausalLM):
    """Mistral for causal language modelling; built like `LlamaForCausalLM`."""

    config_class = MistralConfig


@register("qwen2", TaskType.CAUSAL_LM)
class Qwen2ForCausalLM(CausalLM):
    """Qwen2 for causal language modelling; built like `LlamaForCausalLM`."""

    config_class = Qwen2Config
