"""Gemma 2 and Gemma 3: the decoder with sandwich norms, `(1 + w)` RMSNorm, GeGLU, scaled embeddings, local and
global layers, and (Gemma 2) soft-capped logits; Gemma 3's vision-language model (`Gemma3ForConditionalGeneration`):
SigLIP's tower, its patches pooled and projected to the language model's width, and the image tokens of each image
seeing each other both ways inside the causal text."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxloom.core.schema import config

from .configs import LlamaConfig, lift_text_config, register_config
from .decoder import CausalLM, CausalLMOutput, default_positions, merge_features
from .layers import RMSNorm
from .registry import TaskType, register
from .runtime import RuntimeConfig
from .siglip import SiglipVisionConfig, SiglipVisionTransformer


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


@register_config
@config
class Gemma3Config(Gemma3TextConfig):
    """Gemma 3 with images (`model_type` `gemma3`). The language model's fields are `Gemma3TextConfig`'s
    (transformers' `text_config`, read from there or from the top); `vision_config` is SigLIP's tower;
    `mm_tokens_per_image` tokens stand for each image (its patches average-pooled to a square of that many), where
    `input_ids` hold `image_token_index`, between `boi_token_index` and `eoi_token_index`."""

    model_type: ClassVar[str] = "gemma3"
    # the language model under `language_model.` in the files transformers writes (and the Hub's)
    checkpoint_prefixes: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    )

    vision_config: SiglipVisionConfig = SiglipVisionConfig(
        hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=896,
        patch_size=14,
    )  # fmt: skip
    mm_tokens_per_image: int = 256
    boi_token_index: int = 255_999
    eoi_token_index: int = 256_000
    image_token_index: int = 262_144

    def __post_init__(self) -> None:
        super().__post_init__()
        name, v = type(self).__name__, self.vision_config
        side = v.image_size // v.patch_size
        per_side = round(self.mm_tokens_per_image**0.5)
        if per_side * per_side != self.mm_tokens_per_image or side % per_side:
            raise ValueError(
                f"{name}.mm_tokens_per_image = {self.mm_tokens_per_image}; expected a square whose side divides the "
                f"tower's {side} patches a side (image_size {v.image_size} / patch_size {v.patch_size})"
            )
        for key in ("boi_token_index", "eoi_token_index", "image_token_index"):
            if getattr(self, key) < 0:
                raise ValueError(f"{name}.{key} = {getattr(self, key)}; expected a token id")

    @classmethod
    def from_hf_dict(cls, data):
        """`data` in transformers' layout (`text_config`, `vision_config`, the image tokens at the top; the Hub's
        files give `text_config` only where it differs from Gemma 3's defaults) or with the text fields at the top."""
        data = lift_text_config(cls, data)
        for key in ("image_token_id", "boi_token_id", "eoi_token_id"):  # transformers' other spelling of each
            if key in data:
                index = key.replace("_id", "_index")
                if data.setdefault(index, data[key]) != data.pop(key):
                    raise ValueError(f"{cls.__name__}: {key} and {index} disagree; expected one token")
        vision = data.get("vision_config")
        if isinstance(vision, dict):
            data["vision_config"] = SiglipVisionConfig.from_hf_dict(vision)
        return super().from_hf_dict(data)

    def to_hf_dict(self) -> dict[str, Any]:
        """As transformers 5 writes it: the language model's fields in `text_config`, the tower's in
        `vision_config`, the image tokens at the top."""
        text = super().to_hf_dict()
        keys = ("mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index", "tie_word_embeddings")
        top = {k: text.pop(k) for k in keys}
        text.pop("vision_config")
        text["model_type"] = Gemma3TextConfig.model_type
        return {
            **top,
            "model_type": self.model_type,
            "text_config": text,
            "vision_config": {**self.vision_config.to_hf_dict(), "model_type": "siglip_vision_model"},
        }


class Gemma3MultiModalProjector(nnx.Module):
    """The tower's patches `[n, P, Dv]` → `[n, mm_tokens_per_image, D]`: average-pooled over squares of patches,
    `(1 + w)` RMS-normed, projected by `mm_input_projection_weight [Dv, D]` (transformers' names and layout)."""

    def __init__(self, config: Gemma3Config, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        v = config.vision_config
        init = jax.nn.initializers.normal(config.initializer_range)
        self.mm_input_projection_weight = nnx.Param(
            init(rngs.params(), (v.hidden_size, config.hidden_size), runtime.param_dtype), logical_axes=(None, "embed")
        )
        self.mm_soft_emb_norm = RMSNorm(v.hidden_size, v.layer_norm_eps, runtime, "gemma")
        self.side = v.image_size // v.patch_size
        self.per_side = round(config.mm_tokens_per_image**0.5)

    def __call__(self, patches: jax.Array) -> jax.Array:
        n, _, d = patches.shape
        k, t = self.side // self.per_side, self.per_side
        pooled = patches.reshape(n, t, k, t, k, d).mean(axis=(2, 4), dtype=jnp.float32).astype(patches.dtype)
        normed = self.mm_soft_emb_norm(pooled.reshape(n, t * t, d))
        return jnp.dot(normed, self.mm_input_projection_weight[...].astype(normed.dtype)).astype(patches.dtype)


def image_horizon(token_type_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """Each token's causal horizon (`CausalLM`'s `q_horizon`) when `token_type_ids [B, T]` mark image tokens (1), as
    transformers' Gemma 3 masks them: an image token sees to the end of its run of image tokens (its image, both
    ways), any other token to its own position."""
    is_image = token_type_ids == 1
    b, t = is_image.shape
    ends = is_image & ~jnp.pad(is_image[:, 1:], ((0, 0), (0, 1)))
    end = jax.lax.cummin(jnp.where(ends, jnp.arange(t), t - 1), axis=1, reverse=True)
    return jnp.where(is_image, jnp.take_along_axis(positions, end, axis=1), positions)


@register("gemma3", TaskType.CAUSAL_LM)
class Gemma3ForConditionalGeneration(CausalLM):
    """Gemma 3 with images: `vision_tower` (SigLIP) and `multi_modal_projector` beside the Gemma 3 decoder
    (`model`, `lm_head`). Reads transformers 5's files (`language_model.model.*`, `vision_tower.*`), the Hub's
    (`vision_tower.vision_model.*`) and transformers' in-memory names (`model.language_model.*`); writes
    transformers 5's."""

    config_class = Gemma3Config
    lora_exclude: ClassVar[str] = r".*(vision_tower|multi_modal_projector).*"  # LoRA on the language model only
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower."),
        ("vision_tower.vision_model.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("lm_head.", "language_model.lm_head."),
    )
    # what PEFT names adapters by: the modules as transformers' model holds them
    peft_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("language_model.model.", "model.language_model."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )

    def __init__(self, config: Gemma3Config, runtime=None, *, rngs):
        super().__init__(config, runtime, rngs=rngs)
        self.vision_tower = SiglipVisionTransformer(config.vision_config, self.runtime, rngs=rngs)
        self.multi_modal_projector = Gemma3MultiModalProjector(config, self.runtime, rngs=rngs)

    def image_features(self, pixel_values: jax.Array) -> jax.Array:
        """`pixel_values [n, C, S, S]` (the image processor's) → `[n, mm_tokens_per_image, hidden_size]`."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """One image's pixels as the image processor gives them, `(C, S, S)`: what a training row's slots hold."""
        v = self.config.vision_config  # type: ignore[attr-defined]
        return (v.num_channels, v.image_size, v.image_size)

    def __call__(  # type: ignore[override]
        self,
        input_ids,
        attention_mask=None,
        positions=None,
        segment_ids=None,
        *,
        pixel_values=None,
        token_type_ids=None,
        return_hidden: bool = False,
        **kwargs: Any,
    ) -> CausalLMOutput:
        """As `CausalLM`, and: `pixel_values [n, C, S, S]`, each image's features put where `input_ids` hold
        `image_token_index` (`mm_tokens_per_image` of them an image, in order; `[B, K, C, S, S]`: each row's own
        `K` image slots, as a training batch holds them, the unused ones never read); `token_type_ids [B, T]` (the
        processor's: 1 on image tokens) let each image's tokens see each other both ways, as transformers' masks do
        (without them attention is causal, as there). An `image_token_index` past the vocabulary embeds as token 0
        (transformers'). `return_hidden` as `CausalLM` (named, so the fused loss and the decoders see it)."""
        c: Gemma3Config = self.config  # type: ignore[assignment]  # this class is built from one
        ids = input_ids
        if c.image_token_index >= c.vocab_size:
            ids = jnp.where(input_ids == c.image_token_index, 0, input_ids)
        if pixel_values is not None and jnp.ndim(pixel_values) == 5:  # [B, K, C, S, S]: each row's image slots
            b, k = pixel_values.shape[:2]
            features = self.image_features(jnp.reshape(pixel_values, (b * k, *pixel_values.shape[2:])))
            features = features.reshape(b, -1, features.shape[-1])
            kwargs["inputs_embeds"] = merge_features(self.embed(ids), input_ids == c.image_token_index, features)
        elif pixel_values is not None:
            features = self.image_features(jnp.asarray(pixel_values))
            features = features.reshape(-1, features.shape[-1])
            is_image = input_ids == c.image_token_index
            if not isinstance(is_image, jax.core.Tracer):
                count = int(np.asarray(is_image).sum())
                if count != features.shape[0]:
                    raise ValueError(
                        f"input_ids hold {count} image tokens (image_token_index {c.image_token_index}), the "
                        f"{pixel_values.shape[0]} image(s) give {features.shape[0]} features "
                        f"({c.mm_tokens_per_image} each); expected the processor's input_ids for these images"
                    )
            kwargs["inputs_embeds"] = merge_features(self.embed(ids), is_image, features)
        elif ids is not input_ids and kwargs.get("inputs_embeds") is None:
            kwargs["inputs_embeds"] = self.embed(ids)
        if token_type_ids is not None:
            positions = default_positions(input_ids.shape, attention_mask, positions, segment_ids)
            kwargs["q_horizon"] = image_horizon(jnp.asarray(token_type_ids), positions)
        return super().__call__(
            input_ids, attention_mask, positions, segment_ids, return_hidden=return_hidden, **kwargs
        )

    def image_inputs(self, input_ids: Any, attention_mask: Any, pixel_values: Any, image_grid_thw: Any = None):
        """What a decoder passes with prompts `input_ids [B, P]` (`attention_mask`: their padding, which changes
        nothing here) showing the images of `pixel_values`: `(prefill,
        None)` — `prefill` the prompt's call's arguments (`pixel_values`, `token_type_ids` marking the image tokens,
        as the processor marks them); no RoPE offsets (Gemma 3 turns every token at its position). The count of
        image tokens is checked as `__call__` checks it; `image_grid_thw` (Qwen's) is refused."""
        if image_grid_thw is not None:
            raise ValueError("image_grid_thw given, but Gemma 3's images are all one size; expected pixel_values only")
        c: Gemma3Config = self.config  # type: ignore[assignment]
        ids = np.asarray(input_ids)
        count, want = int((ids == c.image_token_index).sum()), np.shape(pixel_values)[0] * c.mm_tokens_per_image
        if count != want:
            raise ValueError(
                f"input_ids hold {count} image tokens (image_token_index {c.image_token_index}), the "
                f"{np.shape(pixel_values)[0]} image(s) need {want}; expected the processor's input_ids for these images"
            )
        types = (ids == c.image_token_index).astype(np.int32)
        return {"pixel_values": jnp.asarray(pixel_values), "token_type_ids": jnp.asarray(types)}, None


@register("gemma2", TaskType.CAUSAL_LM)
class Gemma2ForCausalLM(CausalLM):
    """Gemma 2 for causal language modelling; built like `LlamaForCausalLM`."""

    config_class = Gemma2Config


@register("gemma3_text", TaskType.CAUSAL_LM)
class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 (text) for causal language modelling; built like `LlamaForCausalLM`."""

    config_class = Gemma3TextConfig
