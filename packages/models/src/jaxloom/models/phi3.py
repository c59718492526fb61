"""Phi-3: the Llama decoder with fused `qkv_proj` / `gate_up_proj` in its checkpoints and LongRoPE scaling."""

from __future__ import annotations

from typing import Any, ClassVar

from jaxloom.core.schema import config

from .configs import LlamaConfig, register_config
from .decoder import CausalLM
from .registry import TaskType, register


@register_config
@config
class Phi3Config(LlamaConfig):
    """Phi-3 (mini, medium, 3.5-mini; 4k and 128k). Its checkpoints hold q, k and v as one `qkv_proj` and the
    MLP's gate and up as one `gate_up_proj`: split on load, fused again on export. The 128k variants' LongRoPE
    (`rope_scaling` type `longrope`, also spelled `su` or `yarn` in Phi-3 configs, as transformers reads them)
    rotates with `short_factor` until a position passes `original_max_position_embeddings`, then with
    `long_factor`, and scales the rotation by `sqrt(1 + ln(factor) / ln(original))`."""

    model_type: ClassVar[str] = "phi3"
    fused_projections: ClassVar[bool] = True

    vocab_size: int = 32064
    hidden_size: int = 3072
    intermediate_size: int = 8192
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 32000
    pad_token_id: int | None = 32000

    @classmethod
    def family_adjust(cls, data: dict[str, Any]) -> dict[str, Any]:
        """`data` (a `config.json` dict) as transformers reads a Phi-3's: `su` / `yarn` RoPE is LongRoPE; the
        `original_max_position_embeddings` kept beside the scaling is copied into it; `partial_rotary_factor`
        other than 1 is refused."""
        partial = data.pop("partial_rotary_factor", 1.0)
        if partial not in (None, 1, 1.0):
            raise ValueError(
                f"{cls.__name__}: partial_rotary_factor = {partial!r}: rotating part of each head is not "
                "implemented; expected 1.0"
            )
        scaling = data.get("rope_scaling")
        if scaling:
            scaling = dict(scaling)
            if scaling.get("rope_type", scaling.get("type")) in ("su", "yarn"):
                scaling.pop("type", None)
                scaling["rope_type"] = "longrope"
            if scaling.get("rope_type", scaling.get("type")) == "longrope":
                scaling.setdefault(
                    "original_max_position_embeddings",
                    data.get("original_max_position_embeddings", cls.original_max_position_embeddings),
                )
            scaling.pop("partial_rotary_factor", None)
            data["rope_scaling"] = scaling
        return data


@register("phi3", TaskType.CAUSAL_LM)
class Phi3ForCausalLM(CausalLM):
    """Phi-3 for causal language modelling; built like `LlamaForCausalLM` (q, k, v and gate, up kept apart:
    each shards on its own axis)."""

    config_class = Phi3Config
