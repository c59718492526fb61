"""MXFP4, the format of GPT-OSS's published expert weights (`*_blocks`, `*_scales`): read lazily and dequantized
exactly, as transformers does (`from_pretrained` through `mxfp4_tensors`). A weight format, apart from any family."""

from __future__ import annotations

from typing import Any

import numpy as np

# The 16 values of a 4-bit float (e2m1): the low nibble of a byte is the first of its two values.
FP4_VALUES = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """`blocks [..., R, G, 16]` (uint8, two 4-bit values a byte) and `scales [..., R, G]` (uint8 exponents, biased
    by 127) → `[..., G·32, R]`: each group of 32 values times `2**(scale - 127)`, the last two axes swapped as
    transformers lays out `gate_up_proj` / `down_proj` (`[E, in, out]`), in `dtype`. Exact: every product is
    representable."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales).astype(np.int32) - 127
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape} disagree; expected blocks [..., G, 16]"
        )
    values = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales[..., None])
    out = values.reshape(*blocks.shape[:-2], -1)  # [..., R, G·32]
    return np.swapaxes(out, -1, -2).astype(dtype)


class LazyMxfp4:
    """An MXFP4 tensor read on demand: `shape` is the dequantized `[E, in, out]`; indexing dequantizes only the
    experts (and output rows) asked for, so a process reads the slices its shards hold."""

    def __init__(self, blocks: Any, scales: Any):
        self.blocks, self.scales = blocks, scales
        e, rows, groups, width = blocks.shape
        self.shape = (e, groups * width * 2, rows)
        self.ndim = 3

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        idx = () if idx and idx[0] is Ellipsis else idx
        idx = (*idx, *(slice(None),) * (3 - len(idx)))
        experts, inner, rows = idx
        part = dequantize_mxfp4(self.blocks[experts][:, rows], self.scales[experts][:, rows])
        return part[:, inner]

    def __array__(self, dtype=None, copy=None):
        out = self[...]
        return out if dtype is None else out.astype(dtype)


def mxfp4_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """`tensors` with each `NAME_blocks` / `NAME_scales` pair replaced by a lazily dequantized `NAME`."""
    out = dict(tensors)
    for name in [k for k in tensors if k.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        if f"{base}_scales" in tensors:
            out[base] = LazyMxfp4(out.pop(name), out.pop(f"{base}_scales"))
    return out


__all__ = ["FP4_VALUES", "LazyMxfp4", "dequantize_mxfp4", "mxfp4_tensors"]
