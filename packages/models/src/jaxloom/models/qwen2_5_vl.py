"""Qwen2.5-VL: the Qwen2 decoder with multimodal RoPE (M-RoPE: each rotated pair turns with a token's frame, row or
column, by `mrope_section`), reading images through its vision tower (`vision.py`). Called with the processor's
outputs under transformers' names (`input_ids`, `attention_mask`, `pixel_values`, `image_grid_thw`); text-only rows
run as Qwen2 does. Read from and written to transformers' directories (`Qwen2_5_VLForConditionalGeneration`)."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxloom.core.schema import config

from .configs import Qwen2Config, lift_text_config, register_config
from .decoder import CausalLM, CausalLMOutput, merge_features
from .registry import TaskType, register
from .vision import Qwen2_5_VisionTransformer, Qwen2_5_VLVisionConfig, VisionLayout, vision_layout

# keys of a Hub config.json (flat, transformers 4) that transformers 5 reads and never uses
_UNUSED_KEYS = frozenset({"vision_token_id"})


@register_config
@config
class Qwen2_5_VLConfig(Qwen2Config):
    """Qwen2.5-VL. The language model's fields are `Qwen2Config`'s (transformers' `text_config`, or the top level of
    a Hub config.json), with transformers' defaults; `mrope_section` splits each head's rotated pairs between a
    token's frame, row and column (sum: `head_dim / 2`); `vision_config` is the tower's; `image_token_id` marks
    where the image features go (one token per merged patch), `vision_start_token_id` / `vision_end_token_id` the
    tokens around an image; `video_token_id` is kept for export (videos are not read yet)."""

    model_type: ClassVar[str] = "qwen2_5_vl"
    ignored_keys: ClassVar[frozenset[str]] = _UNUSED_KEYS

    vocab_size: int = 152064
    hidden_size: int = 8192
    intermediate_size: int = 29568
    num_hidden_layers: int = 80
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1_000_000.0
    max_window_layers: int = 80
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151645
    mrope_section: tuple[int, ...] = (16, 24, 24)
    vision_config: Qwen2_5_VLVisionConfig = Qwen2_5_VLVisionConfig()
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != (self.head_dim or 0) // 2:
            raise ValueError(
                f"{name}.mrope_section = {list(self.mrope_section)}; expected three sections (frame, row, column) "
                f"summing to head_dim / 2 = {(self.head_dim or 0) // 2}"
            )
        if self.vision_config.out_hidden_size != self.hidden_size:
            raise ValueError(
                f"{name}: vision_config.out_hidden_size {self.vision_config.out_hidden_size} differs from hidden_size "
                f"{self.hidden_size}; the merged image features must be the language model's width"
            )
        for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if not 0 <= getattr(self, key) < self.vocab_size:
                raise ValueError(f"{name}.{key} = {getattr(self, key)}; expected a token of the {self.vocab_size}")

    @classmethod
    def from_hf_dict(cls, data):
        """`data` in transformers 5's layout (`text_config`, `vision_config`, `rope_parameters` holding
        `mrope_section`) or the Hub's (the text fields at the top, `rope_scaling: {"type": "mrope", ...}`)."""
        data = lift_text_config(cls, data)
        section = None
        for key in ("rope_parameters", "rope_scaling"):
            rope = data.get(key)
            if isinstance(rope, dict) and "mrope_section" in rope:
                rope = dict(rope)
                section = rope.pop("mrope_section")
                if rope.get("rope_type", rope.get("type")) == "mrope":  # transformers reads it as the default RoPE
                    rope.pop("type", None)
                    rope["rope_type"] = "default"
                data[key] = rope
        if section is not None:
            data.setdefault("mrope_section", tuple(section))
        vision = data.get("vision_config")
        if isinstance(vision, dict):
            data["vision_config"] = Qwen2_5_VLVisionConfig.from_hf_dict(vision)
        return super().from_hf_dict(data)

    @classmethod
    def family_adjust(cls, data: dict[str, Any]) -> dict[str, Any]:
        """`data` (a `config.json` dict) by Qwen2's rules, without its refusal of `use_mrope` (this family's RoPE is
        multimodal)."""
        data.pop("use_mrope", None)
        return super().family_adjust(data)

    def to_hf_dict(self) -> dict[str, Any]:
        """As transformers 5 writes it: the language model's fields in `text_config`, the tower's in
        `vision_config`, the image tokens at the top."""
        text = super().to_hf_dict()
        top = {k: text.pop(k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                         "vision_end_token_id", "tie_word_embeddings")}  # fmt: skip
        text.pop("vision_config")
        text["rope_parameters"]["mrope_section"] = list(text.pop("mrope_section"))
        text["model_type"] = "qwen2_5_vl_text"
        return {
            **top,
            "model_type": self.model_type,
            "text_config": text,
            "vision_config": self.vision_config.to_hf_dict(),
        }


def rope_index(
    input_ids: Any, image_grid_thw: Any, attention_mask: Any, config: Qwen2_5_VLConfig
) -> tuple[np.ndarray, np.ndarray]:
    """`(position_ids [3, B, T], deltas [B])` of `input_ids [B, T]` showing the images of `image_grid_thw` under
    `config` (Qwen2.5-VL's), as transformers' `get_rope_index` gives them for text and images: a
    text token one past the position before it on all three axes; an image's tokens at the image's start plus
    (frame, row, column) of their merged patch; the text after it from the start plus its longer side. Padding
    (`attention_mask` 0) is skipped and left at 0. `deltas`: the last position + 1 minus the row's real tokens, what a
    decoder adds to the positions of the tokens it appends. On the host (numpy); images are taken in order, row by
    row. Too few or too many image tokens for `image_grid_thw` is one error naming the row."""
    ids = np.asarray(input_ids)
    b, t = ids.shape
    mask = np.ones((b, t), bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    grid = np.zeros((0, 3), np.int64) if image_grid_thw is None else np.asarray(image_grid_thw, np.int64).reshape(-1, 3)
    m, tokens = config.vision_config.spatial_merge_size, config.vision_config.tokens_of(grid)
    out, deltas, image = np.zeros((3, b, t), np.int64), np.zeros(b, np.int64), 0
    for row in range(b):
        real = ids[row][mask[row]]
        is_image = real == config.image_token_id
        pos, at, parts = 0, 0, []
        while at < real.size:
            if not is_image[at]:
                end = at
                while end < real.size and not is_image[end]:
                    end += 1
                parts.append(np.broadcast_to(np.arange(pos, pos + end - at), (3, end - at)))
                pos, at = pos + end - at, end
                continue
            if image >= len(grid):
                raise ValueError(
                    f"row {row} of input_ids has image tokens (image_token_id {config.image_token_id}) past the "
                    f"{len(grid)} image(s) of image_grid_thw; expected one image per run of image tokens"
                )
            n = int(tokens[image])
            if at + n > real.size or not is_image[at : at + n].all():
                have = int(np.argmin(np.append(is_image[at:], False)))
                raise ValueError(
                    f"row {row} of input_ids: image {image} (image_grid_thw {grid[image].tolist()}) needs {n} image "
                    f"tokens, the row has a run of {have}; expected the processor's input_ids for these images"
                )
            frames, rows, cols = int(grid[image][0]), int(grid[image][1]) // m, int(grid[image][2]) // m
            f, r, c = np.meshgrid(np.arange(frames), np.arange(rows), np.arange(cols), indexing="ij")
            parts.append(np.stack([f.reshape(-1), r.reshape(-1), c.reshape(-1)]) + pos)
            pos, at, image = pos + max(rows, cols), at + n, image + 1
        if parts:
            positions = np.concatenate(parts, axis=1)
            out[:, row, mask[row]] = positions
            deltas[row] = positions.max() + 1 - real.size
    if image != len(grid):
        raise ValueError(
            f"image_grid_thw has {len(grid)} image(s), input_ids' image tokens (image_token_id "
            f"{config.image_token_id}) place {image}; expected one run of image tokens per image"
        )
    return out, deltas


def _concrete(x: Any, name: str) -> np.ndarray:
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        raise ValueError(
            f"{name} is traced (the model is called under jit): the image layout is made on the host; pass "
            "vision_layout= (vision.vision_layout) and rope_positions= (qwen2_5_vl.rope_index) computed outside"
        ) from None


@register("qwen2_5_vl", TaskType.CAUSAL_LM)
class Qwen2_5_VLForConditionalGeneration(CausalLM):
    """Qwen2.5-VL: `visual` (the tower) beside the Qwen2 decoder (`model`, `lm_head`), the names of the Hub's
    checkpoints (transformers 5 writes them too; its in-memory names `model.language_model.*` / `model.visual.*`
    are read as well)."""

    config_class = Qwen2_5_VLConfig
    lora_exclude: ClassVar[str] = r".*visual.*"  # LoRA's default targets: the language model only (the tower optional)
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.language_model.", "model."),
        ("model.visual.", "visual."),
    )
    # what PEFT names adapters by: the modules as transformers' model holds them
    peft_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.", "model.language_model."),
        ("visual.", "model.visual."),
    )

    def __init__(self, config: Qwen2_5_VLConfig, runtime=None, *, rngs):
        super().__init__(config, runtime, rngs=rngs)
        self.visual = Qwen2_5_VisionTransformer(config.vision_config, self.runtime, rngs=rngs)

    def __call__(  # type: ignore[override]
        self,
        input_ids,
        attention_mask=None,
        positions=None,
        segment_ids=None,
        *,
        pixel_values=None,
        image_grid_thw=None,
        rope_positions=None,
        vision_layout: VisionLayout | None = None,
        mm_token_type_ids=None,
        pixel_values_videos=None,
        video_grid_thw=None,
        return_hidden: bool = False,
        **kwargs: Any,
    ) -> CausalLMOutput:
        """As `CausalLM`, and: `pixel_values [N, patch_dims]` with `image_grid_thw [n, 3]` (the processor's), the
        image features put where `input_ids` hold `image_token_id`; `rope_positions [3, B, T]` (transformers'
        `position_ids` of this model; default: `rope_index` of the inputs when there are images, else the tokens'
        positions); `vision_layout` (default: `vision_layout(image_grid_thw)`). Under `jit`, pass `vision_layout`
        and `rope_positions` made on the host. `mm_token_type_ids` is accepted (the processor gives it) and not
        needed: the image tokens are found by id. `return_hidden` as `CausalLM` (named here, so the trainer's fused
        loss and the decoders see that this model can stop before its output layer)."""
        del mm_token_type_ids
        if pixel_values_videos is not None or video_grid_thw is not None:
            raise ValueError(
                "pixel_values_videos / video_grid_thw: Qwen2.5-VL's videos are not read yet; expected images "
                "(pixel_values, image_grid_thw) or text"
            )
        c: Qwen2_5_VLConfig = self.config  # type: ignore[assignment]  # this class is built from one
        if rope_positions is None and image_grid_thw is not None:  # first: it names the row whose tokens disagree
            rope_positions, _ = rope_index(
                _concrete(input_ids, "input_ids"),
                _concrete(image_grid_thw, "image_grid_thw"),
                None if attention_mask is None else _concrete(attention_mask, "attention_mask"),
                c,
            )
        if pixel_values is not None:
            if image_grid_thw is None and vision_layout is None:
                raise ValueError("pixel_values without image_grid_thw; expected the processor's image_grid_thw too")
            if vision_layout is None:
                grid = _concrete(image_grid_thw, "image_grid_thw")
                patches = int(grid.reshape(-1, 3).prod(-1).sum())
                if patches != pixel_values.shape[0]:
                    raise ValueError(
                        f"pixel_values has {pixel_values.shape[0]} patches, image_grid_thw {grid.tolist()} gives "
                        f"{patches}; expected the processor's outputs for the same images"
                    )
                vision_layout = vision_layout_of(grid, c)
            features = self.visual(pixel_values, vision_layout)
            is_image = input_ids == c.image_token_id
            if not isinstance(is_image, jax.core.Tracer):
                count = int(np.asarray(is_image).sum())
                if count != features.shape[0]:
                    raise ValueError(
                        f"input_ids hold {count} image tokens (image_token_id {c.image_token_id}), the images give "
                        f"{features.shape[0]} features; expected one image token per merged patch"
                    )
            kwargs["inputs_embeds"] = merge_features(self.embed(input_ids), is_image, features)
        if rope_positions is not None:
            rope_positions = self.pair_positions(jnp.asarray(rope_positions))
        return super().__call__(
            input_ids,
            attention_mask,
            positions,
            segment_ids,
            rope_positions=rope_positions,
            return_hidden=return_hidden,
            **kwargs,
        )

    def image_inputs(self, input_ids: Any, attention_mask: Any, pixel_values: Any, image_grid_thw: Any = None):
        """What a decoder passes with prompts `input_ids [B, P]` (`attention_mask`, 0 on padding) showing the images of
        `pixel_values` and `image_grid_thw` (the processor's), made on the host: `(prefill, deltas)` — `prefill` the
        arguments of the prompt's call (`pixel_values`, `vision_layout`, `rope_positions [3, B, P]`), `deltas [B]` what
        each row's decoded tokens add to their positions on all three axes (transformers' `rope_deltas`: each new
        token at the last position + 1). The counts are checked as `__call__` checks them."""
        if image_grid_thw is None:
            raise ValueError("pixel_values without image_grid_thw; expected the image processor's image_grid_thw too")
        grid = _concrete(image_grid_thw, "image_grid_thw").reshape(-1, 3)
        patches = int(grid.prod(-1).sum())
        if patches != np.shape(pixel_values)[0]:
            raise ValueError(
                f"pixel_values has {np.shape(pixel_values)[0]} patches, image_grid_thw {grid.tolist()} gives "
                f"{patches}; expected the processor's outputs for the same images"
            )
        rope, deltas = rope_index(input_ids, grid, attention_mask, self.config)  # type: ignore[arg-type]
        layout = vision_layout_of(grid, self.config)  # type: ignore[arg-type]
        prefill = {
            "pixel_values": jnp.asarray(pixel_values),
            "vision_layout": VisionLayout(*(jnp.asarray(a) for a in layout)),
            "rope_positions": jnp.asarray(rope, jnp.int32),
        }
        return prefill, jnp.asarray(deltas, jnp.int32)

    def pair_positions(self, rope_positions: jax.Array) -> jax.Array:
        """`rope_positions [3, B, T]` (frame, row, column) as `[B, T, head_dim / 2]`: each rotated pair's position, by
        `mrope_section` (the first pairs the frame's, then the row's, then the column's). `[B, T]`, one position on
        all three axes (a decoded token's), is returned as it is: plain RoPE at those positions."""
        if rope_positions.ndim == 2:
            return rope_positions
        axis = np.repeat(np.arange(3), self.config.mrope_section)
        return jnp.moveaxis(rope_positions[axis], 0, -1)


def vision_layout_of(grid_thw: Any, config: Qwen2_5_VLConfig) -> VisionLayout:
    """`vision.vision_layout` of a Qwen2.5-VL config's tower."""
    return vision_layout(grid_thw, config.vision_config)


__all__ = [
    "Qwen2_5_VLConfig",
    "Qwen2_5_VLForConditionalGeneration",
    "merge_features",
    "rope_index",
    "vision_layout_of",
]
