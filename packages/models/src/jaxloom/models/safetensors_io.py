"""A small safetensors reader/writer on numpy memory maps (bfloat16 included, no torch, no pickle)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def read_header(path: str | Path) -> tuple[dict, int]:
    """`(header, data_start)`; the header maps tensor names to dtype, shape and byte offsets."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}; expected an object)")
    data_size, spans = Path(path).stat().st_size - 8 - n, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ok = (
            isinstance(info, dict)
            and isinstance(info.get("dtype"), str)
            and isinstance(info.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in info["shape"])
            and isinstance(info.get("data_offsets"), list)
            and len(info["data_offsets"]) == 2
            and all(isinstance(o, int) for o in info["data_offsets"])
            and 0 <= info["data_offsets"][0] <= info["data_offsets"][1]
        )
        if not ok:
            raise ValueError(
                f"{path}: corrupt safetensors header entry {name!r}: {str(info)[:200]}; expected "
                "{'dtype': str, 'shape': [non-negative ints], 'data_offsets': [begin, end] with 0 <= begin <= end}"
            )
        spans.append((*info["data_offsets"], name))
    spans.sort()
    for (_, a1, an), (b0, _, bn) in zip(spans, spans[1:], strict=False):
        if b0 < a1:
            raise ValueError(f"{path}: tensors {an!r} and {bn!r} overlap (bytes {b0} < {a1}); the header is corrupt")
    if spans and spans[-1][1] > data_size:
        raise ValueError(
            f"{path}: tensor {spans[-1][2]!r} ends at byte {spans[-1][1]} of {data_size} data bytes; "
            "the file is truncated"
        )
    return header, 8 + n


def load(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a file as a read-only memory map (nothing is read until sliced)."""
    header, start = read_header(path)
    size = Path(path).stat().st_size
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        a, b = info["data_offsets"]
        if start + b > size:
            raise ValueError(
                f"{path}: tensor {name!r} ends at byte {start + b}, past the file's end ({size}); the file is truncated"
            )
        dtype, shape = np.dtype(_DTYPES[info["dtype"]]), tuple(info["shape"])
        if b - a != dtype.itemsize * int(np.prod(shape)):
            raise ValueError(f"{path}: tensor {name!r} has {b - a} bytes for shape {shape} {info['dtype']}")
        out[name] = (
            np.memmap(path, dtype=dtype, mode="r", offset=start + a, shape=shape)
            if shape and b > a
            else np.zeros(shape, dtype)
        )
    return out


def save(tensors: dict[str, np.ndarray], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write tensors (any order; stored sorted by name) with optional string metadata."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} cannot be stored in safetensors")
        header[name] = {
            "dtype": _NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
