"""SigLIP's vision tower in Flax NNX (Gemma 3's, PaliGemma's): square images cut into patches (a `Conv2d` with stride =
kernel: one matmul over each flattened patch), a learned position per patch, pre-norm encoder layers of
bidirectional attention and a tanh-GELU MLP, a final LayerNorm. Parameter names are transformers' (`embeddings.
patch_embedding`, `encoder.layers.N.self_attn.q_proj`, `post_layernorm`), so `hf.py`'s name rules read and write them.
The pooling head (`vision_use_head`) is not built: the vision-language models that use this tower read its patches."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxloom.core.schema import config

from .attention.backends import attend
from .configs import read_sub_config
from .layers import ACTIVATIONS, Embed, Linear, constrain
from .runtime import RuntimeConfig


@config
class SiglipVisionConfig:
    """transformers' `SiglipVisionConfig` fields: `num_hidden_layers` layers of width `hidden_size`,
    `num_attention_heads` heads, an MLP of `intermediate_size` (`hidden_act`), square `image_size` images of
    `num_channels` cut into `patch_size` patches, LayerNorms of `layer_norm_eps`; `initializer_range`: the normal
    initialiser's deviation."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{name}: hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"{name}: image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"{name}.hidden_act = {self.hidden_act!r}; expected one of {sorted(ACTIVATIONS)}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> SiglipVisionConfig:
        """From `data`, a `vision_config` mapping as transformers writes it; `vision_use_head` true (a pooled image
        vector), dropout and an unknown key are refused by name."""

        def adjust(fields: dict[str, Any]) -> dict[str, Any]:
            if fields.pop("vision_use_head", False):
                raise ValueError(
                    f"{cls.__name__}: vision_use_head = true (the pooling head) is not built; expected false"
                )
            if fields.pop("attention_dropout", 0.0):
                raise ValueError(f"{cls.__name__}: attention_dropout is not implemented; expected 0")
            return fields

        return read_sub_config(cls, data, adjust)

    def to_hf_dict(self) -> dict[str, Any]:
        """As transformers writes it."""
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__}, "vision_use_head": False}


class LayerNorm(nnx.Module):
    """`(x - mean) / sqrt(var + eps) · weight + bias` over the last axis, computed in float32 (torch's LayerNorm)."""

    def __init__(self, dim: int, eps: float, runtime: RuntimeConfig):
        self.weight = nnx.Param(jnp.ones((dim,), runtime.param_dtype), logical_axes=("norm",))
        self.bias = nnx.Param(jnp.zeros((dim,), runtime.param_dtype), logical_axes=("norm",))
        self.eps, self.dtype = eps, runtime.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        return (h * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.dtype)


class PatchEmbedding(nnx.Module):
    """`Conv2d(kernel = stride = patch_size)` with a bias; `weight` in the convolution's `[out, C, P, P]` layout."""

    def __init__(self, config: SiglipVisionConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        c = config
        shape = (c.hidden_size, c.num_channels, c.patch_size, c.patch_size)
        init = jax.nn.initializers.normal(c.initializer_range)
        self.weight = nnx.Param(init(rngs.params(), shape, runtime.param_dtype), logical_axes=("embed", *[None] * 3))
        self.bias = nnx.Param(jnp.zeros((c.hidden_size,), runtime.param_dtype), logical_axes=("embed",))
        self.patch, self.dtype = c.patch_size, runtime.dtype

    def __call__(self, pixels: jax.Array) -> jax.Array:
        """`pixels [B, C, H, W]` → `[B, (H/P)·(W/P), D]`, patches in row-major order."""
        b, ch, h, w = pixels.shape
        p = self.patch
        patches = pixels.reshape(b, ch, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5).reshape(b, -1, ch * p * p)
        kernel = self.weight[...].reshape(self.weight.shape[0], -1).astype(self.dtype)
        return jnp.dot(patches.astype(self.dtype), kernel.T) + self.bias[...].astype(self.dtype)


class SiglipAttention(nnx.Module):
    """Bidirectional multi-head attention over an image's patches, biases on all four projections."""

    def __init__(self, config: SiglipVisionConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        d, std = config.hidden_size, config.initializer_range
        for name, axes in (("q_proj", ("embed", "heads")), ("k_proj", ("embed", "heads")),
                           ("v_proj", ("embed", "heads")), ("out_proj", ("heads", "embed"))):  # fmt: skip
            setattr(self, name, Linear(d, d, axes, runtime, use_bias=True, std=std, rngs=rngs))
        self.heads, self.runtime = config.num_attention_heads, runtime

    def __call__(self, x: jax.Array) -> jax.Array:
        b, n, d = x.shape
        q, k, v = (getattr(self, f"{t}_proj")(x).reshape(b, n, self.heads, -1) for t in "qkv")
        ones = jnp.ones((b, n), jnp.int32)
        out = attend(
            q,
            k,
            v,
            q_segment_ids=ones,
            q_positions=jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)),
            causal=False,
            implementation=self.runtime.attn_mechanism,
            block_size=self.runtime.attn_block_size,
        )
        return self.out_proj(out.reshape(b, n, d))


class SiglipMLP(nnx.Module):
    """`fc2(act(fc1(x)))`."""

    def __init__(self, config: SiglipVisionConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        d, f, std = config.hidden_size, config.intermediate_size, config.initializer_range
        self.fc1 = Linear(d, f, ("embed", "mlp"), runtime, use_bias=True, std=std, rngs=rngs)
        self.fc2 = Linear(f, d, ("mlp", "embed"), runtime, use_bias=True, std=std, rngs=rngs)
        self.act, self.runtime = ACTIVATIONS[config.hidden_act], runtime

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(constrain(self.act(self.fc1(x)), ("batch", "length", "mlp"), self.runtime))


class SiglipEncoderLayer(nnx.Module):
    """`x + attn(layer_norm1(x))`, then `x + mlp(layer_norm2(x))`."""

    def __init__(self, config: SiglipVisionConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        self.layer_norm1 = LayerNorm(config.hidden_size, config.layer_norm_eps, runtime)
        self.self_attn = SiglipAttention(config, runtime, rngs=rngs)
        self.layer_norm2 = LayerNorm(config.hidden_size, config.layer_norm_eps, runtime)
        self.mlp = SiglipMLP(config, runtime, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipVisionTransformer(nnx.Module):
    """`pixel_values [B, C, H, W]` (the image processor's, `image_size` square) → `[B, num_patches, hidden_size]`, the
    last hidden state after `post_layernorm` (transformers' `SiglipVisionModel(...).last_hidden_state`)."""

    def __init__(self, config: SiglipVisionConfig, runtime: RuntimeConfig | None = None, *, rngs: nnx.Rngs):
        runtime = runtime or RuntimeConfig()
        self.config, self.runtime = config, runtime
        self.embeddings = nnx.Module()
        self.embeddings.patch_embedding = PatchEmbedding(config, runtime, rngs=rngs)
        self.embeddings.position_embedding = Embed(
            config.num_patches, config.hidden_size, runtime, std=config.initializer_range, rngs=rngs
        )
        self.encoder = nnx.Module()
        self.encoder.layers = nnx.List(
            [SiglipEncoderLayer(config, runtime, rngs=rngs) for _ in range(config.num_hidden_layers)]
        )
        self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, runtime)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        c = self.config
        if pixel_values.ndim != 4 or pixel_values.shape[1:] != (c.num_channels, c.image_size, c.image_size):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}; expected [images, {c.num_channels}, "
                f"{c.image_size}, {c.image_size}] (the image processor's, at the tower's image_size)"
            )
        x = self.embeddings.patch_embedding(pixel_values)
        x = x + self.embeddings.position_embedding.embedding[...].astype(x.dtype)[None]
        x = constrain(x, ("batch", "length", "embed"), self.runtime)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


__all__ = ["SiglipVisionConfig", "SiglipVisionTransformer"]
