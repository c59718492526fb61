"""DeepSeek-V3 (and the models built on its architecture: DeepSeek-R1, Kimi K2, ...): multi-head latent attention
and a mixture of routed and shared experts with an aux-loss-free router, as transformers computes them.

- MLA: queries through a low-rank bottleneck (`q_a_proj` → `q_a_layernorm` → `q_b_proj`; or one `q_proj` when
  `q_lora_rank` is None); keys and values from one compressed latent (`kv_a_proj_with_mqa` → `kv_a_layernorm` →
  `kv_b_proj`) of `kv_lora_rank`, beside a decoupled RoPE part (`qk_rope_head_dim`) shared by every head; each head's
  key is `[nope (qk_nope_head_dim) | rope]`, its value `v_head_dim` wide. `rope_interleave` pairs the rotated
  dimensions as DeepSeek lays them out. With YaRN, the softmax scale gains `mscale(factor, mscale_all_dim)²`.
- MoE from layer `first_k_dense_replace` on: sigmoid scores; the top `num_experts_per_tok` of the scores plus the
  router's `e_score_correction_bias` (the aux-loss-free balance), among the `topk_group` best of `n_group` expert
  groups (a group's score: its two best); the chosen scores (without the bias), renormalised with
  `norm_topk_prob`, times `routed_scaling_factor`; `n_shared_experts` always-on experts added. The routed experts
  run Mixtral's token dispatch (grouped matmuls, expert parallelism); layers before are dense MLPs. The layers
  differ in structure, so the stack runs unrolled.

The correction bias is loaded, used and exported; it gets no gradient, and no weight decay (its name holds
`bias`), so training keeps it as loaded (the paper's update rule that moves it by each expert's load is not
applied). The KV cache holds each head's expanded key and value (the value padded to the key's width), not the
compressed latent: decoding from the latent needs the weight-absorbed attention, which is not written yet. The
published multi-token-prediction layers (`model.layers.{num_hidden_layers}.*`) are skipped on load, and the
published FP8 weights (`quantization_config: fp8`, 128 × 128 block scales) are dequantized as they are read
(`jaxloom.models.fp8`); a model is exported in its parameters' dtype, unquantized."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxloom.core.schema import config

from .attention import attend, self_attention
from .configs import LlamaConfig, check_top_k, register_config
from .layers import ACTIVATIONS, Linear, RMSNorm, apply_rope
from .decoder import MLP, CausalLM, Routed, RouterLoad
from .expert_adapters import ExpertLoRA
from .moe import SparseMoE, gated, replay_routes, run_experts, stacked_weights
from .registry import TaskType, register
from .runtime import RuntimeConfig

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with their default epsilon


@register_config
@config
class DeepseekV3Config(LlamaConfig):
    """DeepSeek-V3 (transformers' `DeepseekV3Config` names; `n_routed_experts` may be given as `num_local_experts`).

    - Attention (MLA): `q_lora_rank` (the queries' bottleneck; None: one `q_proj`), `kv_lora_rank` (the keys' and
      values' latent), `qk_nope_head_dim` and `qk_rope_head_dim` (each key's un-rotated and rotated parts; `head_dim`
      is the rotated part's width, as transformers sets it), `v_head_dim`, `rope_interleave` (DeepSeek's pairing of
      the rotated dimensions).
    - Experts: `n_routed_experts` of width `moe_intermediate_size`, `num_experts_per_tok` chosen per token among the
      `topk_group` best of `n_group` groups, weights renormalised with `norm_topk_prob` and scaled by
      `routed_scaling_factor`; `n_shared_experts` always on; the first `first_k_dense_replace` layers dense MLPs of
      width `intermediate_size`."""

    model_type: ClassVar[str] = "deepseek_v3"
    # the published files hold the multi-token-prediction layers after the last decoder layer: skipped on load
    checkpoint_extra_layers: ClassVar[bool] = True
    ignored_keys: ClassVar[frozenset[str]] = frozenset(
        {
            "aux_loss_alpha",
            "ep_size",
            "moe_layer_freq",
            "seq_aux",
            "num_nextn_predict_layers",
            "num_mtp_layers",
            "auto_map",
        }
    )

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1

    def __post_init__(self) -> None:
        widths = ("moe_intermediate_size", "n_routed_experts", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")
        for name in (*widths, "v_head_dim", "n_group", "topk_group", "q_lora_rank"):
            value = getattr(self, name)
            if not (value is None and name == "q_lora_rank") and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} = {value!r}; expected a positive integer")
        if self.n_shared_experts < 0 or self.first_k_dense_replace < 0 or not self.routed_scaling_factor > 0:
            raise ValueError(
                f"n_shared_experts = {self.n_shared_experts}, first_k_dense_replace = {self.first_k_dense_replace}, "
                f"routed_scaling_factor = {self.routed_scaling_factor}; expected >= 0, >= 0 and > 0"
            )
        object.__setattr__(self, "head_dim", self.qk_rope_head_dim)
        super().__post_init__()
        check_top_k(self, "n_routed_experts")
        if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                f"n_group = {self.n_group}, topk_group = {self.topk_group} for {self.n_routed_experts} experts; "
                "expected groups that divide the experts and 1 <= topk_group <= n_group"
            )
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError(
                f"num_experts_per_tok = {self.num_experts_per_tok} is more than the {self.topk_group} chosen groups "
                f"of {self.n_routed_experts // self.n_group} experts hold"
            )

    @property
    def qk_head_dim(self) -> int:
        """Each head's key width: the un-rotated part and the RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def num_local_experts(self) -> int:
        return self.n_routed_experts

    @property
    def expert_intermediate_size(self) -> int:
        """Each routed expert's feed-forward width."""
        return self.moe_intermediate_size

    @property
    def shared_expert_intermediate_size(self) -> int:
        """The always-on experts' width (one MLP of `n_shared_experts` experts' width)."""
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def expert_names(self) -> tuple[str, str, tuple[str, str, str]]:
        """Where the published files keep the experts: `(mlp module, experts module, (gate, down, up) names)`."""
        return "mlp", "experts", ("gate_proj", "down_proj", "up_proj")

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a mixture of experts."""
        return layer >= self.first_k_dense_replace

    @property
    def attention_scale(self) -> float:
        """`1/sqrt(qk_head_dim)`, times YaRN's `mscale(factor, mscale_all_dim)²` (transformers' `yarn_apply_mscale`)."""
        scale = self.qk_head_dim**-0.5
        s = self.rope_scaling
        if s and s.get("rope_type", s.get("type")) not in (None, "default") and s.get("mscale_all_dim"):
            factor = float(s["factor"])
            m = 1.0 if factor <= 1 else 0.1 * float(s["mscale_all_dim"]) * math.log(factor) + 1.0
            scale *= m * m
        return scale

    @property
    def kv_cache_dims(self) -> tuple[int, int]:
        return 1, self.kv_lora_rank + self.qk_rope_head_dim  # the compressed latent and the rotated key part

    @property
    def value_cache_dims(self) -> tuple[int, int]:
        return 1, 0  # the latent serves as the values too

    @property
    def attention_matmul_params(self) -> int:
        d, n = self.hidden_size, self.num_attention_heads
        q = d * n * self.qk_head_dim if self.q_lora_rank is None else (d + n * self.qk_head_dim) * self.q_lora_rank
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv += self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + n * self.v_head_dim * d

    @property
    def attention_score_dims(self) -> int:
        return self.qk_head_dim + self.v_head_dim

    @classmethod
    def from_hf_dict(cls, data: Mapping[str, Any]):
        """As `LlamaConfig.from_hf_dict` reads `data` (a `config.json` dict), with the published files' own keys:
        `scoring_func` must be sigmoid and `topk_method` noaux_tc (DeepSeek-V3's router); a `quantization_config`
        of fp8 (the published files) is accepted, its weights dequantized on load; `num_local_experts` is
        `n_routed_experts`."""
        data = dict(data)
        checks = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
        for key, expected in checks.items():
            value = data.pop(key, expected)
            if value != expected:
                raise ValueError(f"{key} = {value!r}; expected {expected!r} (DeepSeek-V3's router)")
        quant = data.pop("quantization_config", None)
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        if quant is not None and method != "fp8":
            raise ValueError(
                f"quantization_config quant_method = {method!r}; expected fp8 (the published block-scaled weights, "
                "dequantized on load) or none"
            )
        if "num_local_experts" in data:
            data.setdefault("n_routed_experts", data.pop("num_local_experts"))
        derived = {"qk_head_dim": None, "head_dim": None}  # written by transformers, derived from the widths
        for key in derived:
            derived[key] = data.pop(key, None)
        out = super().from_hf_dict(data)
        for key, value in derived.items():
            if value is not None and value != getattr(out, key):
                raise ValueError(
                    f"{key} = {value}; expected {getattr(out, key)} (qk_nope_head_dim {out.qk_nope_head_dim}, "
                    f"qk_rope_head_dim {out.qk_rope_head_dim})"
                )
        return out


def _deinterleave(x: jax.Array) -> jax.Array:
    """DeepSeek's rotated pairs `(x0, x1), (x2, x3), ...` as halves `(x0, x2, ... | x1, x3, ...)`: rotating those
    with the rotate-half convention is transformers' interleaved rotation (keys and queries alike)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class MultiHeadLatentAttention(nnx.Module):
    """MLA with transformers' module names. Without a cache (training, scoring) keys and values are expanded per
    head from the latent, then `attend` (any backend: the value is padded to the key's width and the output cut
    back). With one (generation) the cache holds the compressed latent and attention runs over it with the
    projections absorbed into the query and the output (`_over_latent`)."""

    def __init__(self, config: DeepseekV3Config, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        c, d, n = config, config.hidden_size, config.num_attention_heads
        std, bias = config.initializer_range, config.attention_bias

        def linear(din, dout, axes, use_bias=False):
            return Linear(din, dout, axes, runtime, use_bias=use_bias, std=std, rngs=rngs)

        if c.q_lora_rank is None:
            self.q_proj = linear(d, n * c.qk_head_dim, ("embed", "heads"))
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = linear(d, c.q_lora_rank, ("embed", None), bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, runtime)
            self.q_b_proj = linear(c.q_lora_rank, n * c.qk_head_dim, (None, "heads"))
        self.kv_a_proj_with_mqa = linear(d, c.kv_lora_rank + c.qk_rope_head_dim, ("embed", None), bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS, runtime)
        self.kv_b_proj = linear(c.kv_lora_rank, n * (c.qk_nope_head_dim + c.v_head_dim), (None, "heads"))
        self.o_proj = linear(n * c.v_head_dim, d, ("heads", "embed"), bias)
        self.config, self.runtime = config, runtime

    def __call__(
        self,
        x,
        positions,
        segment_ids,
        cache=None,
        cache_index=None,
        kv_positions=None,
        kv_segment_ids=None,
        *,
        window=None,
        rope=None,
    ):
        """As `Attention.__call__`: `rope` is `(inv_freq, scale)` of the RoPE part; `window` the layer's (None)."""
        b, t, _ = x.shape
        c, rt = self.config, self.runtime
        n, nope, rot, vd = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(b, t, n, nope + rot)
        q_nope, q_rot = q[..., :nope], q[..., nope:]
        latent = self.kv_a_proj_with_mqa(x)
        kv, k_rot = self.kv_a_layernorm(latent[..., : c.kv_lora_rank]), latent[..., c.kv_lora_rank :]
        k_rot = k_rot.reshape(b, t, 1, rot)
        if c.rope_interleave:
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        inv_freq, scale = rope
        q_rot, k_rot = apply_rope(q_rot, positions, inv_freq, scale), apply_rope(k_rot, positions, inv_freq, scale)
        if cache is not None:  # decoding: the cache holds the compressed latent, attention runs over it
            return self._over_latent(
                q_nope,
                q_rot,
                kv,
                k_rot,
                cache,
                positions=positions,
                segment_ids=segment_ids,
                cache_index=cache_index,
                kv_positions=kv_positions,
                kv_segment_ids=kv_segment_ids,
                window=window,
            )
        kv = self.kv_b_proj(kv).reshape(b, t, n, nope + vd)
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rot, (b, t, n, rot))], axis=-1)
        v = kv[..., nope:]
        if vd < nope + rot:  # one width for keys and values: the value padded with zeros, the output cut back
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, nope + rot - vd)))
        q = jnp.concatenate([q_nope, q_rot], axis=-1)
        out, _ = self_attention(
            q, k, v, rt, positions=positions, segment_ids=segment_ids, window=window, scale=c.attention_scale
        )
        return self.o_proj(out[..., :vd].reshape(b, t, n * vd)), None

    def _over_latent(self, q_nope, q_rot, latent, k_rot, cache, *, window, **where):
        """Attention over the compressed cache (DeepSeek-V2's weight absorption): each cache slot holds the normed
        latent `[r]` and the rotated key part `[rot]` (`kv_cache_dims`: one head of `r + rot`, the value slot
        empty), `kv_lora_rank + qk_rope_head_dim` numbers a token where the expanded heads take
        `heads · (qk_head_dim + v_head_dim)`. The key projection moves onto the query
        (`q_nope · W_uk` against the latent) and the value projection after the softmax (the attended latent
        times `W_uv`): the same scores and outputs as expanding every cached token. `where`: `positions`,
        `segment_ids`, `cache_index`, `kv_positions`, `kv_segment_ids` as `__call__` takes them."""
        c, rt = self.config, self.runtime
        b, t, n, nope = q_nope.shape
        r, vd = c.kv_lora_rank, c.v_head_dim
        w = _kernel(self.kv_b_proj, rt.dtype).reshape(r, n, nope + vd)
        q = jnp.concatenate([jnp.einsum("btnd,rnd->btnr", q_nope, w[..., :nope]), q_rot.astype(rt.dtype)], axis=-1)
        entry = jnp.concatenate([latent[:, :, None, :], k_rot], axis=-1)
        keys = jax.lax.dynamic_update_slice(cache[0], entry.astype(cache[0].dtype), (0, where["cache_index"], 0, 0))
        k = keys.astype(q.dtype)
        v = k.at[..., r:].set(0)  # the values are the latent itself
        out = attend(
            q,
            k,
            v,
            q_segment_ids=where["segment_ids"],
            q_positions=where["positions"],
            kv_segment_ids=where["kv_segment_ids"],
            kv_positions=where["kv_positions"],
            causal=True,
            window=window,
            implementation=rt.attn_mechanism,
            cached=True,
            block_size=rt.attn_block_size,
            scale=c.attention_scale,
        )
        heads = jnp.einsum("btnr,rnv->btnv", out[..., :r], w[..., nope:])
        return self.o_proj(heads.reshape(b, t, n * vd)), (keys, cache[1])


def _kernel(layer, dtype) -> jax.Array:
    """`[in, out]`: a `Linear`'s kernel, or a LoRA layer's merged one (its adapters included), in `dtype`."""
    merged = getattr(layer, "merged", None)
    return merged(dtype) if merged is not None else layer.kernel[...].astype(dtype)


class Router(nnx.Module):
    """`gate`: the router's weights (`kernel [D, E]`, transformers' `gate.weight` transposed) and
    `e_score_correction_bias [E]`, added to the scores only to choose the experts."""

    def __init__(self, config: DeepseekV3Config, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        e, d = config.n_routed_experts, config.hidden_size
        init = jax.nn.initializers.normal(config.initializer_range)
        self.kernel = nnx.Param(init(rngs.params(), (d, e), runtime.param_dtype), logical_axes=("embed", None))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((e,), runtime.param_dtype), logical_axes=(None,))

    def __call__(self, x, config: DeepseekV3Config, replay=None):
        """`(top_w [B, T, k], top_i [B, T, k])` in float32, as `DeepseekV3TopkRouter` computes them; `replay`: the
        experts to take where recorded (`replay_routes`), weighted by this router's scores."""
        scores = jax.nn.sigmoid(x.astype(jnp.float32) @ self.kernel[...].astype(jnp.float32))  # [B, T, E]
        choice = scores + jax.lax.stop_gradient(self.e_score_correction_bias[...].astype(jnp.float32))
        e, g = config.n_routed_experts, config.n_group
        grouped = choice.reshape(*choice.shape[:-1], g, e // g)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [B, T, G]: a group's two best
        _, best_groups = jax.lax.top_k(group_scores, config.topk_group)
        keep = jax.nn.one_hot(best_groups, g, dtype=jnp.bool_).any(-2)  # [B, T, G]
        choice = jnp.where(jnp.repeat(keep, e // g, axis=-1), choice, -jnp.inf)
        _, top_i = jax.lax.top_k(choice, config.num_experts_per_tok)
        if replay is not None:
            top_i = replay_routes(top_i, replay)
        top_w = jnp.take_along_axis(scores, top_i, axis=-1)
        if config.norm_topk_prob:
            top_w = top_w / (top_w.sum(-1, keepdims=True) + 1e-20)
        return top_w * config.routed_scaling_factor, top_i


class DeepseekMoE(nnx.Module):
    """Routed experts (`w_gate`, `w_up [E, D, F]`, `w_down [E, F, D]`; per-expert tensors `experts.{e}.*` in the files)
    chosen by `gate` (`Router`), plus the always-on `shared_experts` (an MLP of `n_shared_experts` experts' width).
    No auxiliary loss: the router balances through its bias, so the layer returns its `RouterLoad` (the trainer's
    `router_bias_update_rate` moves the bias after each step, `update_router_bias`). LoRA on the routed experts as
    Mixtral's (`SparseMoE`)."""

    EXPERT_WEIGHTS: ClassVar[dict[str, tuple[str, ...]]] = SparseMoE.EXPERT_WEIGHTS
    HF_EXPERTS: ClassVar[str] = SparseMoE.HF_EXPERTS
    ROUTED: ClassVar[bool] = True  # takes `routing` (replay) and returns `Routed`

    def __init__(self, config: DeepseekV3Config, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        e, d, f = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        init = jax.nn.initializers.normal(config.initializer_range)
        self.gate = Router(config, runtime, rngs=rngs)

        def param(shape, axes):
            return nnx.Param(init(rngs.params(), shape, runtime.param_dtype), logical_axes=axes)

        self.w_gate = param((e, d, f), ("expert", "embed", "mlp"))
        self.w_up = param((e, d, f), ("expert", "embed", "mlp"))
        self.w_down = param((e, f, d), ("expert", "mlp", "embed"))
        self.gate_up_lora: ExpertLoRA | None = nnx.data(None)
        self.down_lora: ExpertLoRA | None = nnx.data(None)
        shared = config.replace(intermediate_size=config.shared_expert_intermediate_size)
        self.shared_experts = MLP(shared, runtime, rngs=rngs)
        self.act, self.e, self.config, self.runtime = ACTIVATIONS[config.mlp_activation], e, config, runtime

    def __call__(self, x, token_mask=None, routing=None):
        dtype = self.runtime.dtype
        top_w, top_i = self.gate(x, self.config, routing)
        weights = stacked_weights(self, dtype, self.runtime)
        routed = run_experts(x.astype(dtype), top_i, top_w, weights, glu=gated(self.act), runtime=self.runtime)
        shared, _ = self.shared_experts(x)
        return routed + shared, Routed(RouterLoad(expert_load(top_i, self.e, token_mask)), top_i)


def expert_load(top_i: jax.Array, experts: int, token_mask=None) -> jax.Array:
    """`[E]` float32 (E = `experts`): how many of the (real, where `token_mask [B, T]` is given) tokens chose each
    expert in `top_i [B, T, k]`."""
    weight = jnp.ones(top_i.shape, jnp.float32)
    if token_mask is not None:
        weight = weight * token_mask[..., None].astype(jnp.float32)
    return jnp.zeros((experts,), jnp.float32).at[top_i.reshape(-1)].add(weight.reshape(-1))  # no [B, T, k, E]


def update_router_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's aux-loss-free balancing step: `bias [E]` (a router's `e_score_correction_bias`) with each
    expert's entry moved by `rate` — up when the expert took fewer tokens than the mean of `load [E]`, down when
    more, unchanged when equal (`[L, E]` and `[L, E]`: each row its own layer's)."""
    return bias + (rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)).astype(bias.dtype)


@register("deepseek_v3", TaskType.CAUSAL_LM)
class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 for causal language modelling: multi-head latent attention in every layer, dense MLPs in the
    first `first_k_dense_replace` layers and `DeepseekMoE` after (the stack unrolled: its layers differ)."""

    config_class = DeepseekV3Config
    attention_factory = MultiHeadLatentAttention

    def mlp_factory_for(self, config: DeepseekV3Config, layer: int) -> Any:  # type: ignore[override]
        return DeepseekMoE if config.is_sparse(layer) else MLP


__all__ = [
    "DeepseekMoE",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "MultiHeadLatentAttention",
    "Router",
    "expert_load",
    "update_router_bias",
]
