"""Mixtral: the shared decoder (`decoder.py`) with a top-k routed mixture of experts (`moe.py`) as feed-forward."""

from __future__ import annotations

from .configs import MixtralConfig
from .decoder import CausalLM
from .moe import SparseMoE
from .registry import TaskType, register


@register("mixtral", TaskType.CAUSAL_LM)
class MixtralForCausalLM(CausalLM):
    """Mixtral (sparse mixture of experts) for causal language modelling; built like `LlamaForCausalLM`;
    its output carries the router's `aux_loss`."""

    config_class = MixtralConfig
    mlp_factory = SparseMoE
