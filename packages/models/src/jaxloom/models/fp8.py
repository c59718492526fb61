"""Block-scaled FP8 checkpoints (DeepSeek-V3, R1, Kimi K2 as published: `quantization_config: {quant_method: fp8,
weight_block_size: [128, 128]}`): each `NAME.weight` stored as float8 e4m3 beside `NAME.weight_scale_inv`, one
float32 scale per block of the weight; read here as `weight · scale` of its block, lazily, so a process dequantizes
only the slices its shards hold (transformers' `FineGrainedFP8Config(dequantize=True)` computes the same)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

SCALE_SUFFIX = "_scale_inv"


class LazyFp8:
    """One FP8 weight `[N, K]` with its block scales, dequantized on indexing (float32). `.T` is a lazy transpose
    (the loader reads linear layers' weights transposed)."""

    def __init__(self, weight: Any, scale: Any, block: tuple[int, int], transposed: bool = False):
        self.weight, self.scale, self.block, self.transposed = weight, scale, block, transposed
        n, k = weight.shape
        self.shape = (k, n) if transposed else (n, k)
        self.ndim = 2

    @property
    def T(self) -> LazyFp8:  # noqa: N802 (numpy's name)
        return LazyFp8(self.weight, self.scale, self.block, not self.transposed)

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        idx = () if idx and idx[0] is Ellipsis else idx
        idx = (*idx, *(slice(None),) * (2 - len(idx)))
        rows, cols = idx[::-1] if self.transposed else idx
        n, k = self.weight.shape
        r, c = np.arange(n)[rows], np.arange(k)[cols]
        part = np.asarray(self.weight[rows][:, cols]).astype(np.float32)
        scale = np.asarray(self.scale, np.float32)[(r // self.block[0])[:, None], (c // self.block[1])[None, :]]
        out = part * scale
        return out.T if self.transposed else out

    def __array__(self, dtype=None, copy=None):
        out = self[...]
        return out if dtype is None else out.astype(dtype)


def fp8_tensors(tensors: dict[str, Any], quantization: Mapping[str, Any] | None) -> dict[str, Any]:
    """`tensors` with each FP8 `NAME` that has a `NAME_scale_inv` replaced by its lazily dequantized values, when
    `quantization` (the config's `quantization_config`) says fp8; unchanged otherwise."""
    if not isinstance(quantization, Mapping) or quantization.get("quant_method") != "fp8":
        return tensors
    block = quantization.get("weight_block_size") or (128, 128)
    if len(block) != 2:
        raise ValueError(f"quantization_config weight_block_size = {block!r}; expected two numbers, e.g. [128, 128]")
    out = dict(tensors)
    for name in [k for k in tensors if k.endswith(SCALE_SUFFIX)]:
        base = name.removesuffix(SCALE_SUFFIX)
        if base in tensors and np.dtype(tensors[base].dtype).itemsize == 1 and tensors[base].ndim == 2:
            out[base] = LazyFp8(tensors[base], out.pop(name), (int(block[0]), int(block[1])))
    return out
