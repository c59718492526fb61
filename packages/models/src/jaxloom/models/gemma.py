"""Gemma 2 and Gemma 3 (text): the decoder with sandwich norms, `(1 + w)` RMSNorm, GeGLU, scaled embeddings,
local and global layers, and (Gemma 2) soft-capped logits."""

from __future__ import annotations

from typing import Any, ClassVar

from jaxloom.core.schema import config

from .configs import LlamaConfig, register_config
from .decoder import CausalLM
from .registry import TaskType, register


@register_config
@config
class Gemma2Config(LlamaConfig):
    """Gemma 2. Beyond `LlamaConfig`'s fields (Gemma's defaults): `hidden_activation` (the GeGLU's GELU;
    Gemma's `hidden_act` key is ignored, as transformers ignores it), `query_pre_attn_scalar` (attention logits
    scaled by its inverse square root), `attn_logit_softcapping` / `final_logit_softcapping` (`cap · tanh(x /
    cap)` on attention and output logits; None: off), `sliding_window` and `layer_types` (default: local
    and global layers alternating, the first local). Embeddings are multiplied by `sqrt(hidden_size)`; norms
    are `(1 + w)` RMSNorms before and after attention and the MLP."""

    model_type: ClassVar[str] = "gemma2"
    norm_style: ClassVar[str] = "gemma"
    block_norms: ClassVar[str] = "sandwich"

    vocab_size: int = 256000
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    hidden_act: str = "gelu_pytorch_tanh"  # in Gemma's config.json, never read (transformers reads the next)
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    query_pre_attn_scalar: int = 256
    sliding_window: int | None = 4096
    layer_types: tuple[str, ...] | None = None
    final_logit_softcapping: float | None = 30.0
    attn_logit_softcapping: float | None = 50.0
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu", "silu", "relu"):
            raise ValueError(
                f"{type(self).__name__}.hidden_activation = {self.hidden_activation!r}; expected gelu_pytorch_tanh, "
                "gelu, silu or relu"
            )
        for name in ("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{type(self).__name__}.{name} = {value!r}; expected a positive number or null")

    def attention_types(self) -> tuple[str, ...]:
        if self.layer_types is not None:
            return tuple(self.layer_types)
        return tuple(
            "sliding_attention" if (i + 1) % self.pattern else "full_attention" for i in range(self.num_hidden_layers)
        )

    @property
    def pattern(self) -> int:
        """Every `pattern`-th layer is global, the others local (without `layer_types`)."""
        return 2

    @property
    def mlp_activation(self) -> str:
        return self.hidden_activation

    @property
    def embedding_multiplier(self) -> float:
        return self.hidden_size**0.5

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def attention_softcap(self) -> float | None:
        return self.attn_logit_softcapping

    @property
    def final_softcap(self) -> float | None:
        return self.final_logit_softcapping

    @classmethod
    def family_adjust(cls, data: dict[str, Any]) -> dict[str, Any]:
        """`data` (a `config.json` dict) with bidirectional attention (EmbeddingGemma) refused: jaxloom's causal
        LMs attend causally."""
        if data.pop("use_bidirectional_attention", None):
            raise ValueError(
                f"{cls.__name__}: use_bidirectional_attention = true (an encoder); jaxloom's causal LMs attend "
                "causally; expected false"
            )
        return data


@register_config
@config
class Gemma3TextConfig(Gemma2Config):
    """Gemma 3 (text; `model_type` `gemma3_text`): Gemma 2 with per-head q/k `(1 + w)` RMSNorm, no soft-caps by
    default, five local layers to one global (`sliding_window_pattern`, or `layer_types`), and separate RoPE:
    local layers rotate with base `rope_local_base_freq` (no scaling), global ones with `rope_theta` and
    `rope_scaling`. transformers 5's `rope_parameters` keyed by layer type is read and written."""

    model_type: ClassVar[str] = "gemma3_text"
    qk_norm: ClassVar[str | None] = "head"

    vocab_size: int = 262208
    max_position_embeddings: int = 131072
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    sliding_window_pattern: int = 6
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    @property
    def pattern(self) -> int:
        return self.sliding_window_pattern

    def rope_of(self, kind: str) -> tuple[float, Any]:
        if kind == "sliding_attention":
            return self.rope_local_base_freq, None
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_hf_dict(cls, data):
        """`data` in transformers 4's layout (`rope_theta`, `rope_local_base_freq`, `rope_scaling`) or 5's
        (`rope_parameters` keyed by `full_attention` / `sliding_attention`)."""
        data = dict(data)
        if "_sliding_window_pattern" in data:  # how transformers 5 writes it
            pattern = data.pop("_sliding_window_pattern")
            if data.setdefault("sliding_window_pattern", pattern) != pattern:
                raise ValueError(
                    f"{cls.__name__}: sliding_window_pattern = {data['sliding_window_pattern']} and "
                    f"_sliding_window_pattern = {pattern} disagree; expected one pattern"
                )
        rope = data.get("rope_parameters")
        if isinstance(rope, dict) and {"full_attention", "sliding_attention"} & set(rope):
            data.pop("rope_parameters")
            full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
            if "rope_theta" in full:
                data.setdefault("rope_theta", full.pop("rope_theta"))
            if full.get("rope_type", "default") != "default":
                data.setdefault("rope_scaling", full)
            if "rope_theta" in local:
                data.setdefault("rope_local_base_freq", local.pop("rope_theta"))
            if local.get("rope_type", "default") != "default":
                raise ValueError(
                    f"{cls.__name__}: rope_parameters.sliding_attention has rope_type {local['rope_type']!r}; "
                    "Gemma 3's local layers rotate without scaling (expected default)"
                )
        return super().from_hf_dict(data)

    def to_hf_dict(self) -> dict[str, Any]:
        out = super().to_hf_dict()
        full = dict(out["rope_parameters"])
        out["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_local_base_freq},
        }
        return out


@register("gemma2", TaskType.CAUSAL_LM)
class Gemma2ForCausalLM(CausalLM):
    """Gemma 2 for causal language modelling; built like `LlamaForCausalLM`."""

    config_class = Gemma2Config


@register("gemma3_text", TaskType.CAUSAL_LM)
class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 (text) for causal language modelling; built like `LlamaForCausalLM`."""

    config_class = Gemma3TextConfig
