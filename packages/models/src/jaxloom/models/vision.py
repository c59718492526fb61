"""Qwen2.5-VL's vision tower in Flax NNX: patches (a 3-D convolution with stride = kernel, which is one matmul over
each flattened patch), 2-D rotary positions, blocks of windowed and full bidirectional attention, and the patch
merger that turns each `spatial_merge_size²` block of patches into one token of the language model's width.

Parameter names are transformers' (`visual.blocks.N.attn.qkv`, `visual.merger.mlp.0`, ...), so `hf.py` reads and
writes them as it does a decoder's. What depends on the images' sizes and not on their pixels — the window order,
the windows and images each patch attends within, each patch's row and column — is `VisionLayout`, made on the host
from `image_grid_thw` (`vision_layout`): the compiled tower takes it as data, so one program serves every image of
the same patch count, and nothing data-dependent is traced (transformers computes the same on the host)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxloom.core.schema import config

from .attention.backends import attend
from .configs import read_sub_config
from .decoder import MLP
from .layers import ACTIVATIONS, Linear, RMSNorm, apply_rope, constrain
from .runtime import RuntimeConfig


@config
class Qwen2_5_VLVisionConfig:
    """Qwen2.5-VL's vision tower, under transformers' names: `depth` blocks of width `hidden_size` with `num_heads`
    heads and a gated MLP of `intermediate_size` (`hidden_act`); patches of `patch_size`² pixels × `temporal_patch_size`
    frames × `in_channels`; each `spatial_merge_size`² block of patches merged into one token of `out_hidden_size`
    (the language model's width); attention within windows of `window_size` pixels, but in the blocks
    `fullatt_block_indexes`, over each whole image; 2-D RoPE of base `rope_theta`. `tokens_per_second` spaces video
    frames (videos are not read yet); `initializer_range`: the normal initialiser's standard deviation."""

    depth: int = 32
    hidden_size: int = 1280
    hidden_act: str = "silu"
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: int = 2
    window_size: int = 112
    out_hidden_size: int = 2048
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    initializer_range: float = 0.02
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                      "spatial_merge_size", "temporal_patch_size", "window_size", "out_hidden_size"):  # fmt: skip
            value = getattr(self, field)
            if value <= 0:
                raise ValueError(f"{name}.{field} = {value!r}; expected a positive integer")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"{name}: hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a whole head width "
                "divisible by 4 (its rotary angles split between rows and columns)"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"{name}.hidden_act = {self.hidden_act!r}; expected one of {sorted(ACTIVATIONS)}")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"{name}: fullatt_block_indexes {bad} are not blocks of a {self.depth}-block tower")
        if self.window_size < self.patch_size * self.spatial_merge_size:
            raise ValueError(
                f"{name}: window_size {self.window_size} is narrower than one merged patch "
                f"({self.patch_size} × {self.spatial_merge_size} pixels)"
            )

    # what `decoder.MLP` reads of a config (the tower's MLP is the decoder's, with biases)
    mlp_bias = True

    @property
    def mlp_activation(self) -> str:
        return self.hidden_act

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dims(self) -> int:
        """The values of one patch in `pixel_values`' rows (`in_channels · temporal_patch_size · patch_size²`)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one language-model token."""
        return self.spatial_merge_size**2

    def tokens_of(self, grid_thw: Any) -> np.ndarray:
        """The language-model tokens each image of `grid_thw [n, 3]` becomes (`t·h·w / merge_unit`)."""
        grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
        return grid.prod(-1) // self.merge_unit

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> Qwen2_5_VLVisionConfig:
        """From `data`, a `vision_config` mapping as transformers 4 or 5 writes it (`rope_parameters`; the Hub's
        `in_chans` and `spatial_patch_size` spellings, which must agree with `in_channels` and `patch_size`)."""

        def adjust(fields: dict[str, Any]) -> dict[str, Any]:
            rope = fields.pop("rope_parameters", None) or {}
            if rope.get("rope_type", "axial") not in ("axial", "default"):
                raise ValueError(f"{cls.__name__}: rope_parameters.rope_type {rope['rope_type']!r}; expected axial")
            if "rope_theta" in rope:
                fields.setdefault("rope_theta", rope["rope_theta"])
            for alias, key in (("in_chans", "in_channels"), ("spatial_patch_size", "patch_size")):
                if alias in fields:
                    value = fields.pop(alias)
                    if fields.setdefault(key, value) != value:
                        raise ValueError(f"{cls.__name__}: {alias} = {value} and {key} = {fields[key]} disagree")
            return fields

        return read_sub_config(cls, data, adjust)

    def to_hf_dict(self) -> dict[str, Any]:
        """As transformers 5 writes `vision_config`."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "rope_theta"}
        out["fullatt_block_indexes"] = list(self.fullatt_block_indexes)
        out["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
        out["model_type"] = "qwen2_5_vl_vision"
        return out


class VisionLayout(NamedTuple):
    """What the tower needs of the images' sizes, as arrays (`vision_layout` makes it on the host): `window_index
    [N/u]`, the order of the merged patches by window; `positions [N, 2]`, each patch's row and column (in the
    processor's order); `window_segments [N]` and `image_segments [N]`, in window order, the window and the
    image frame (1-based) each patch attends within in the windowed and the full blocks."""

    window_index: Any
    positions: Any
    window_segments: Any
    image_segments: Any


def vision_layout(grid_thw: Any, config: Qwen2_5_VLVisionConfig) -> VisionLayout:
    """`VisionLayout` of images whose patch grids are `grid_thw [n, 3]` (the processor's `image_grid_thw`: frames,
    rows, columns) for the tower of `config`, as transformers' `get_vision_position_ids`, `get_vision_window_index` and
    `get_vision_attention_seqlens` compute them. A grid that does not split into merged blocks is one error."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    m, u = config.spatial_merge_size, config.merge_unit
    size = config.window_size // m // config.patch_size  # merged patches along a window's side
    positions, order, windows, frames = [], [], [], []
    offset = window = frame = 0
    for i, (t, h, w) in enumerate(grid.tolist()):
        if min(t, h, w) <= 0 or h % m or w % m:
            raise ValueError(
                f"image_grid_thw[{i}] = {[t, h, w]}; expected positive frames, rows and columns, the rows and columns "
                f"multiples of spatial_merge_size {m}"
            )
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (h // m, m, w // m, m)  # patches listed block by block, as the processor lays them out
        rows, cols = (a.reshape(block).transpose(0, 2, 1, 3).reshape(-1) for a in (rows, cols))
        positions.append(np.tile(np.stack([rows, cols], -1), (t, 1)))
        lh, lw = h // m, w // m
        index = np.full((t, lh + size - lh % size, lw + size - lw % size), -1, np.int64)
        index[:, :lh, :lw] = np.arange(t * lh * lw).reshape(t, lh, lw)
        nh, nw = index.shape[1] // size, index.shape[2] // size
        index = index.reshape(t, nh, size, nw, size).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, size * size)
        for cell in index:
            kept = cell[cell >= 0]
            if kept.size:
                window += 1
                order.append(kept + offset)
                windows.append(np.full(kept.size * u, window, np.int32))
        for _ in range(t):
            frame += 1
            frames.append(np.full(h * w, frame, np.int32))
        offset += t * lh * lw
    return VisionLayout(
        window_index=np.concatenate(order).astype(np.int32),
        positions=np.concatenate(positions).astype(np.int32),
        window_segments=np.concatenate(windows),
        image_segments=np.concatenate(frames),
    )


class PatchProjection(nnx.Module):
    """The patch embedding's `Conv3d(kernel = stride = (temporal_patch_size, patch_size, patch_size))`, no bias:
    with the stride equal to the kernel, each output is one flattened patch times the flattened kernel. `weight`
    keeps the convolution's `[out, C, T, P, P]` layout (the checkpoint's)."""

    def __init__(self, config: Qwen2_5_VLVisionConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        c = config
        shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        init = jax.nn.initializers.normal(c.initializer_range)
        self.weight = nnx.Param(init(rngs.params(), shape, runtime.param_dtype), logical_axes=("embed", *[None] * 4))
        self.dtype = runtime.dtype

    def __call__(self, pixels: jax.Array) -> jax.Array:
        kernel = self.weight[...].reshape(self.weight.shape[0], -1).astype(self.dtype)
        return jnp.dot(pixels.astype(self.dtype), kernel.T)


class VisionAttention(nnx.Module):
    """Bidirectional multi-head attention within segments (a window, or an image), q/k rotated by each patch's row
    (first half of the rotated pairs) and column (second half); `qkv` fused, as the checkpoint stores it."""

    def __init__(self, config: Qwen2_5_VLVisionConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        d, std = config.hidden_size, config.initializer_range
        self.qkv = Linear(d, 3 * d, ("embed", "heads"), runtime, use_bias=True, std=std, rngs=rngs)
        self.proj = Linear(d, d, ("heads", "embed"), runtime, use_bias=True, std=std, rngs=rngs)
        self.heads, self.head_dim, self.runtime = config.num_heads, config.head_dim, runtime

    def __call__(self, x, rope_positions, inv_freq, segments):
        b, n, _ = x.shape
        q, k, v = jnp.moveaxis(self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim), 2, 0)
        q, k = apply_rope(q, rope_positions, inv_freq), apply_rope(k, rope_positions, inv_freq)
        order = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
        out = attend(
            q,
            k,
            v,
            q_segment_ids=segments,
            q_positions=order,
            causal=False,
            implementation=self.runtime.attn_mechanism,
            block_size=self.runtime.attn_block_size,
            max_documents=max(self.runtime.attn_max_documents, 1),
        )
        return self.proj(out.reshape(b, n, -1))


class VisionBlock(nnx.Module):
    """`x + attn(norm1(x))`, then `x + mlp(norm2(x))`; RMSNorms of epsilon 1e-6."""

    def __init__(self, config: Qwen2_5_VLVisionConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(config.hidden_size, 1e-6, runtime)
        self.norm2 = RMSNorm(config.hidden_size, 1e-6, runtime)
        self.attn = VisionAttention(config, runtime, rngs=rngs)
        self.mlp = MLP(config, runtime, rngs=rngs)  # type: ignore[arg-type]  # the fields MLP reads

    def __call__(self, x, rope_positions, inv_freq, segments):
        x = x + self.attn(self.norm1(x), rope_positions, inv_freq, segments)
        return x + self.mlp(self.norm2(x))[0]


class PatchMerger(nnx.Module):
    """Each `spatial_merge_size²` block of normed patches, concatenated, through `Linear → GELU → Linear` to the
    language model's width (`mlp.0`, `mlp.2`: transformers' `nn.Sequential` indices)."""

    def __init__(self, config: Qwen2_5_VLVisionConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        wide, std = config.hidden_size * config.merge_unit, config.initializer_range
        self.ln_q = RMSNorm(config.hidden_size, 1e-6, runtime)
        self.mlp = nnx.List(
            [
                Linear(wide, wide, ("embed", "mlp"), runtime, use_bias=True, std=std, rngs=rngs),
                None,
                Linear(wide, config.out_hidden_size, ("mlp", "embed"), runtime, use_bias=True, std=std, rngs=rngs),
            ]
        )
        self.wide = wide

    def __call__(self, x):
        h = self.ln_q(x).reshape(-1, self.wide)
        return self.mlp[2](jax.nn.gelu(self.mlp[0](h), approximate=False))


class Qwen2_5_VisionTransformer(nnx.Module):
    """The tower: `pixel_values [N, patch_dims]` (the processor's rows, `N` patches over all images) and their
    `VisionLayout` → `[N / merge_unit, out_hidden_size]`, one row per image token, in the images' order."""

    def __init__(self, config: Qwen2_5_VLVisionConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        self.config, self.runtime = config, runtime
        self.patch_embed = nnx.Module()
        self.patch_embed.proj = PatchProjection(config, runtime, rngs=rngs)
        self.blocks = nnx.List([VisionBlock(config, runtime, rngs=rngs) for _ in range(config.depth)])
        self.merger = PatchMerger(config, runtime, rngs=rngs)

    def __call__(self, pixel_values: jax.Array, layout: VisionLayout) -> jax.Array:
        c = self.config
        n, u = pixel_values.shape[0], c.merge_unit
        if n % u:
            raise ValueError(f"pixel_values has {n} patches; expected a multiple of {u} (spatial_merge_size²)")
        order = jnp.asarray(layout.window_index)
        x = self.patch_embed.proj(pixel_values).reshape(n // u, u, -1)[order].reshape(1, n, -1)
        x = constrain(x, ("batch", "length", "embed"), self.runtime)
        rows_cols = jnp.asarray(layout.positions).reshape(n // u, u, 2)[order].reshape(n, 2)
        quarter = c.head_dim // 4  # rows rotate the first quarter of the head's pairs' frequencies, columns the next
        rope_positions = jnp.repeat(rows_cols, quarter, axis=-1)[None]  # [1, N, head_dim / 2]
        inv = 1.0 / (c.rope_theta ** (jnp.arange(0, c.head_dim // 2, 2, dtype=jnp.float32) / (c.head_dim // 2)))
        inv_freq = jnp.concatenate([inv, inv])
        windows, images = jnp.asarray(layout.window_segments)[None], jnp.asarray(layout.image_segments)[None]
        for i, block in enumerate(self.blocks):
            x = block(x, rope_positions, inv_freq, images if i in c.fullatt_block_indexes else windows)
        merged = self.merger(x[0])
        return merged[jnp.argsort(order)]
