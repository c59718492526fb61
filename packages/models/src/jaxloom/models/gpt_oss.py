"""GPT-OSS: OpenAI's open-weight mixture of experts (gpt-oss-20b, gpt-oss-120b).

The Llama decoder with four differences, each as transformers computes it:

- attention sinks: a learned logit per query head joins every softmax and attends to nothing (`self_attn.sinks`),
  on alternating sliding-window (`sliding_window`, even layers by default) and full-attention layers;
- biases on q, k, v and o;
- a mixture of `num_local_experts` experts, `num_experts_per_tok` chosen per token by a router with a bias, the
  chosen logits' softmax as their weights; each expert a clamped SwiGLU with biases: `(clip(up, ±limit) + 1) ·
  g · sigmoid(alpha · g)` with `g = min(gate, limit)`, gate and up interleaved along the last axis of one
  `gate_up_proj [E, D, 2F]` as transformers stores them;
- YaRN RoPE by default (factor 32 over 4,096 positions, no truncation).

The published checkpoints store the experts' weights in MXFP4 (`*_blocks`, `*_scales`): `from_pretrained`
dequantizes them on load (`mxfp4.dequantize_mxfp4`, exact in float32 and bfloat16) and a model is exported in its
parameters' dtype, unquantized, with no `quantization_config`. The experts run through Mixtral's token dispatch
(grouped matmuls, expert parallelism)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxloom.core.schema import config

from .configs import LlamaConfig, check_top_k, register_config
from .layers import Linear, matmul_precision
from .decoder import CausalLM, Routed
from .expert_adapters import ExpertLoRA, expert_weights
from .moe import balance_loss, route, run_experts
from .registry import TaskType, register
from .runtime import RuntimeConfig

# transformers' default RoPE for GPT-OSS (its config's rope_parameters when none are given)
YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@register_config
@config
class GptOssConfig(LlamaConfig):
    """GPT-OSS (transformers' `GptOssConfig` names): `num_local_experts` experts of width `intermediate_size`,
    `num_experts_per_tok` per token, `swiglu_alpha` / `swiglu_limit` of the experts' clamped SwiGLU, `layer_types`
    (default: sliding on even layers, full on odd ones) with `sliding_window`, attention sinks on every layer,
    `router_aux_loss_coef` weighting the load-balancing loss in training. `rope_scaling` defaults to YaRN as
    transformers' does (None: plain RoPE)."""

    model_type: ClassVar[str] = "gpt_oss"
    attention_sinks: ClassVar[bool] = True
    # keys of the published config.json that transformers does not read (the quantization is handled on load)
    ignored_keys: ClassVar[frozenset[str]] = frozenset({"experts_per_token", "initial_context_length"})

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 8
    head_dim: int | None = 64
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: dict[str, Any] | None = dataclasses.field(default_factory=lambda: dict(YARN))
    attention_bias: bool = True
    sliding_window: int | None = 128
    layer_types: tuple[str, ...] | None = None
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        check_top_k(self, "num_local_experts")
        if not self.swiglu_limit > 0:
            raise ValueError(f"GptOssConfig.swiglu_limit = {self.swiglu_limit}; expected a positive number")

    def attention_types(self) -> tuple[str, ...]:
        if self.layer_types is not None:
            return tuple(self.layer_types)
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers))

    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    @property
    def expert_intermediate_size(self) -> int:
        """Each expert's feed-forward width."""
        return self.intermediate_size

    @classmethod
    def from_hf_dict(cls, data: Mapping[str, Any]):
        """As `LlamaConfig.from_hf_dict` reads `data` (a `config.json` dict); `rope_parameters` of type default mean
        plain RoPE (absent: YaRN), and a `quantization_config` is accepted for MXFP4 (the published files),
        dequantized on load."""
        data = dict(data)
        quant = data.pop("quantization_config", None)
        method = (quant or {}).get("quant_method") if isinstance(quant, Mapping) else quant
        if quant is not None and method != "mxfp4":
            raise ValueError(
                f"GptOssConfig: quantization_config quant_method = {method!r}; expected mxfp4 (the published "
                "checkpoints' format, dequantized on load) or none"
            )
        rope = data.get("rope_parameters")
        if isinstance(rope, Mapping) and rope.get("rope_type", "default") == "default" and "rope_scaling" not in data:
            data["rope_scaling"] = None
        return super().from_hf_dict(data)


class GptOssExperts(nnx.Module):
    """The experts' weights as transformers stores them: `gate_up_proj [E, D, 2F]` (gate and up interleaved along
    the last axis: gate at even, up at odd columns) with `gate_up_proj_bias [E, 2F]`, `down_proj [E, F, D]` with
    `down_proj_bias [E, D]`; sharded on the `expert` axis (→ `ep`) and the feed-forward width (→ `tp`). LoRA on
    `gate_up_proj` / `down_proj` (`target_parameters`): `gate_up_lora` / `down_lora` (`ExpertLoRA`)."""

    EXPERT_WEIGHTS: ClassVar[dict[str, tuple[str, ...]]] = {
        "gate_up_proj": ("gate_up_proj",),
        "down_proj": ("down_proj",),
    }
    HF_EXPERTS: ClassVar[str] = ""  # this module is transformers' `mlp.experts`

    def __init__(self, config: GptOssConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        e, d, f = config.num_local_experts, config.hidden_size, config.intermediate_size
        init = jax.nn.initializers.normal(config.initializer_range)

        def param(shape, axes, std=True):
            value = init(rngs.params(), shape, runtime.param_dtype) if std else jnp.zeros(shape, runtime.param_dtype)
            return nnx.Param(value, logical_axes=axes)

        self.gate_up_proj = param((e, d, 2 * f), ("expert", "embed", "mlp"))
        self.gate_up_proj_bias = param((e, 2 * f), ("expert", "mlp"), std=False)
        self.down_proj = param((e, f, d), ("expert", "mlp", "embed"))
        self.down_proj_bias = param((e, d), ("expert", None), std=False)
        self.gate_up_lora: ExpertLoRA | None = nnx.data(None)
        self.down_lora: ExpertLoRA | None = nnx.data(None)

    def split(self, dtype, precision=None) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """`(w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D])` and `(b_gate, b_up, b_down)` in `dtype`: the
        interleaved columns apart (a reshape to `[..., F, 2]`: the sharded width stays whole pairs)."""
        e, d, two_f = self.gate_up_proj.shape
        (gate_up,) = expert_weights(self, "gate_up_proj", dtype, precision)
        (down,) = expert_weights(self, "down_proj", dtype, precision)
        gate_up = gate_up.reshape(e, d, two_f // 2, 2)
        bias = self.gate_up_proj_bias[...].astype(dtype).reshape(e, two_f // 2, 2)
        weights = (gate_up[..., 0], gate_up[..., 1], down)
        return weights, (bias[..., 0], bias[..., 1], self.down_proj_bias[...].astype(dtype))


class GptOssMoE(nnx.Module):
    """The router (`router`: a linear layer with a bias) picks `num_experts_per_tok` experts per token; their
    weights are the softmax of the chosen logits (the router's softmax renormalised over the chosen: the same
    numbers); the experts (`experts`) run their clamped SwiGLU through Mixtral's token dispatch (`dense`, the
    reference, runs every expert on every token). Returns `(out, Routed(aux, experts))`, `aux` the Switch
    load-balancing loss; `routing` replays recorded experts (`route`)."""

    def __init__(self, config: GptOssConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        e, d = config.num_local_experts, config.hidden_size
        self.router = Linear(d, e, ("embed", None), runtime, use_bias=True, std=config.initializer_range, rngs=rngs)
        self.experts = GptOssExperts(config, runtime, rngs=rngs)
        self.k, self.e = config.num_experts_per_tok, e
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.runtime = runtime

    ROUTED: ClassVar[bool] = True  # takes `routing` (replay) and returns `Routed`

    def glu(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """GPT-OSS's clamped SwiGLU: `(clip(up, -limit, limit) + 1) · g · sigmoid(alpha · g)`, `g = min(gate,
        limit)`."""
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))

    def __call__(self, x, token_mask=None, routing=None):
        dtype = self.runtime.dtype
        probs, top_w, top_i, chosen = route(self.router(x), self.k, self.e, normalize=True, replay=routing)
        weights, biases = self.experts.split(dtype, matmul_precision(self.runtime))
        out = run_experts(x.astype(dtype), top_i, top_w, weights, glu=self.glu, biases=biases, runtime=self.runtime)
        return out, Routed(balance_loss(probs, chosen, token_mask, self.k, self.e), top_i)


@register("gpt_oss", TaskType.CAUSAL_LM)
class GptOssForCausalLM(CausalLM):
    """GPT-OSS for causal language modelling: Llama's decoder with attention sinks, biased projections and
    `GptOssMoE` as every layer's feed-forward; its output carries the router's `aux_loss`."""

    config_class = GptOssConfig
    mlp_factory = GptOssMoE


__all__ = [
    "GptOssConfig",
    "GptOssExperts",
    "GptOssForCausalLM",
    "GptOssMoE",
]
