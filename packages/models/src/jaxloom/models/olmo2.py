"""OLMo 2: the Llama decoder with norms on each branch's output and q/k RMSNorm over the whole projection."""

from __future__ import annotations

from typing import ClassVar

from jaxloom.core.schema import config

from .configs import LlamaConfig, register_config
from .decoder import CausalLM
from .registry import TaskType, register


@register_config
@config
class Olmo2Config(LlamaConfig):
    """OLMo 2: no norm before attention or the MLP; `post_attention_layernorm` and `post_feedforward_layernorm`
    norm each branch's output before the residual add; `q_norm` / `k_norm` norm the whole q and k projections
    (not per head) before RoPE; norms multiply in float32, then cast. Fields are `LlamaConfig`'s (OLMo 2's
    defaults)."""

    model_type: ClassVar[str] = "olmo2"
    norm_style: ClassVar[str] = "olmo"
    block_norms: ClassVar[str] = "post"
    qk_norm: ClassVar[str | None] = "projection"

    vocab_size: int = 50304
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 50279


@register("olmo2", TaskType.CAUSAL_LM)
class Olmo2ForCausalLM(CausalLM):
    """OLMo 2 for causal language modelling; built like `LlamaForCausalLM`."""

    config_class = Olmo2Config
