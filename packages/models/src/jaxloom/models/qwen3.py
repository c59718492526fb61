"""Qwen3 and Qwen3-MoE: the Qwen2 decoder with per-head q/k RMSNorm (and Qwen3-MoE's routed experts)."""

from __future__ import annotations

from typing import Any, ClassVar

from jaxloom.core.schema import config

from .configs import Qwen2Config, check_top_k, register_config
from .decoder import MLP, CausalLM
from .moe import SparseMoE
from .registry import TaskType, register


@register_config
@config
class Qwen3Config(Qwen2Config):
    """Qwen3: q/k RMSNorm over each head (`q_norm`, `k_norm`), an explicit `head_dim` (default 128), and
    `attention_bias` on all four projections (off by default); windows as in Qwen2."""

    model_type: ClassVar[str] = "qwen3"
    qk_norm: ClassVar[str | None] = "head"
    attention_bias: bool = False
    head_dim: int | None = 128
    max_position_embeddings: int = 32768
    vocab_size: int = 151936

    @property
    def o_bias(self) -> bool:
        return self.attention_bias


@register_config
@config
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE: Qwen3 attention, and in every `decoder_sparse_step`-th layer not listed in `mlp_only_layers` a
    mixture of `num_experts` experts of width `moe_intermediate_size`, `num_experts_per_tok` chosen per token by
    the softmax router (their weights renormalised only with `norm_topk_prob`) and a load-balancing loss weighted
    by `router_aux_loss_coef`; the other layers are dense MLPs of width `intermediate_size`. `config.json` may
    name the expert count `num_local_experts` (transformers 5) or `num_experts` (4.x): both are read, and both
    are written."""

    model_type: ClassVar[str] = "qwen3_moe"
    head_dim: int | None = None
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    decoder_sparse_step: int = 1
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_top_k(self, "num_experts")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"Qwen3MoeConfig: decoder_sparse_step = {self.decoder_sparse_step}; expected >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"Qwen3MoeConfig: mlp_only_layers {bad} are not layers of a {self.num_hidden_layers}-layer model"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a mixture of experts (transformers' rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def num_local_experts(self) -> int:
        return self.num_experts

    @property
    def expert_intermediate_size(self) -> int:
        """Each expert's feed-forward width."""
        return self.moe_intermediate_size

    @property
    def normalize_top_k(self) -> bool:
        """The chosen experts' router probabilities are renormalised only with `norm_topk_prob`."""
        return self.norm_topk_prob

    @property
    def expert_names(self) -> tuple[str, str, tuple[str, str, str]]:
        """Where transformers keeps the experts: `(mlp module, experts module, (gate, down, up) names)`."""
        return "mlp", "experts", ("gate_proj", "down_proj", "up_proj")

    @classmethod
    def family_adjust(cls, data: dict[str, Any]) -> dict[str, Any]:
        """`data` (a `config.json` dict) with `num_local_experts` (transformers 5's name) read as `num_experts`;
        then Qwen2's rules."""
        if "num_local_experts" in data:
            local = data.pop("num_local_experts")
            if data.setdefault("num_experts", local) != local:
                raise ValueError(
                    f"Qwen3MoeConfig: num_experts = {data['num_experts']} and num_local_experts = {local} disagree; "
                    "expected one expert count"
                )
        return super().family_adjust(data)

    def to_hf_dict(self) -> dict[str, Any]:
        out = super().to_hf_dict()
        out["num_local_experts"] = self.num_experts
        return out


@register("qwen3", TaskType.CAUSAL_LM)
class Qwen3ForCausalLM(CausalLM):
    """Qwen3 for causal language modelling; built like `LlamaForCausalLM`."""

    config_class = Qwen3Config


@register("qwen3_moe", TaskType.CAUSAL_LM)
class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE for causal language modelling: its sparse layers run Mixtral's token dispatch (with expert
    parallelism), its `mlp_only_layers` a dense MLP; a model mixing both runs its layers unrolled."""

    config_class = Qwen3MoeConfig
    mlp_factory = SparseMoE

    def mlp_factory_for(self, config: Qwen3MoeConfig, layer: int) -> Any:  # type: ignore[override]
        return SparseMoE if config.is_sparse(layer) else MLP
