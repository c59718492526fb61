"""SmolLM3: the Llama decoder without RoPE on every `no_rope_layer_interval`-th layer (NoPE), optional sliding
windows on those layers, and tied embeddings."""

from __future__ import annotations

from typing import Any, ClassVar

from jaxloom.core.schema import config

from .configs import LlamaConfig, register_config
from .decoder import CausalLM
from .registry import TaskType, register

NOPE = "+nope"
"""Suffix of an attention type whose layer rotates nothing (`full_attention+nope`): its RoPE table is zero."""


@register_config
@config
class SmolLM3Config(LlamaConfig):
    """SmolLM3: `no_rope_layers` (one 0/1 per layer, 1 = RoPE; default: every `no_rope_layer_interval`-th layer has
    none), `use_sliding_window` with `sliding_window` on the layers `layer_types` marks `sliding_attention` (by
    default the NoPE layers, as transformers builds it), `attention_bias` on all four projections, `mlp_bias`.
    A NoPE layer runs in the same scanned stack as the others: its RoPE table is zero (cos 1, sin 0: the identity,
    exactly)."""

    model_type: ClassVar[str] = "smollm3"
    attention_kinds: ClassVar[tuple[str, ...]] = (
        "full_attention",
        "sliding_attention",
        "full_attention" + NOPE,
        "sliding_attention" + NOPE,
    )
    vocab_size: int = 128256
    hidden_size: int = 2048
    intermediate_size: int = 11008
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32768
    rope_theta: float = 2000000.0
    tie_word_embeddings: bool = True
    use_sliding_window: bool = False
    no_rope_layers: tuple[int, ...] | None = None
    no_rope_layer_interval: int = 4
    layer_types: tuple[str, ...] | None = None
    pad_token_id: int | None = 128004
    bos_token_id: int | None = 128000
    eos_token_id: int | list[int] | None = 128001

    def __post_init__(self) -> None:
        if self.no_rope_layer_interval < 1:
            raise ValueError(f"SmolLM3Config.no_rope_layer_interval = {self.no_rope_layer_interval}; expected >= 1")
        if self.no_rope_layers is not None:
            if len(self.no_rope_layers) < self.num_hidden_layers or set(self.no_rope_layers) - {0, 1}:
                raise ValueError(
                    f"SmolLM3Config.no_rope_layers = {list(self.no_rope_layers)}; expected a 0 (NoPE) or 1 (RoPE) for "
                    f"each of the {self.num_hidden_layers} layers"
                )
        odd = sorted(set(self.layer_types or ()) - {"full_attention", "sliding_attention"})
        if odd:
            raise ValueError(f"SmolLM3Config: layer type(s) {odd}; expected full_attention or sliding_attention")
        super().__post_init__()

    def rope_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it rotates q and k (transformers' `no_rope_layers`, built from the interval when
        not given)."""
        if self.no_rope_layers is not None:
            return tuple(bool(x) for x in self.no_rope_layers[: self.num_hidden_layers])
        return tuple((i + 1) % self.no_rope_layer_interval != 0 for i in range(self.num_hidden_layers))

    def attention_types(self) -> tuple[str, ...]:
        rope = self.rope_layers()
        if self.layer_types is not None:
            kinds = tuple(self.layer_types)
        else:  # transformers' default: the NoPE layers slide when a window is set
            slide = self.use_sliding_window and self.sliding_window is not None
            kinds = tuple("sliding_attention" if slide and not r else "full_attention" for r in rope)
        return tuple(k if r else k + NOPE for k, r in zip(kinds, rope, strict=False))

    def window_of(self, kind: str) -> int | None:
        slides = kind.removesuffix(NOPE) == "sliding_attention" and self.use_sliding_window
        return self.sliding_window if slides else None

    def uses_rope(self, kind: str) -> bool:
        return not kind.endswith(NOPE)

    @classmethod
    def family_adjust(cls, data: dict[str, Any]) -> dict[str, Any]:
        """`data` (a `config.json` dict) as transformers reads it: the window kept only with `use_sliding_window`."""
        if not data.get("use_sliding_window", False):
            data["sliding_window"] = None
        return data


@register("smollm3", TaskType.CAUSAL_LM)
class SmolLM3ForCausalLM(CausalLM):
    """SmolLM3 for causal language modelling; built like `LlamaForCausalLM`."""

    config_class = SmolLM3Config
