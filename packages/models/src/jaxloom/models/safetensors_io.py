"""A small safetensors reader/writer on numpy memory maps (bfloat16 included, no torch, no pickle)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

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
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # DeepSeek-V3's published weights (with block scales)
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


class StreamWriter:
    """Write one safetensors file tensor by tensor: the header comes first, from `entries`
    (`(name, shape, dtype)` in the order they will be written), then each `write(name, array)` appends
    that tensor's bytes, so a file larger than memory can be written holding one tensor at a time.
    Used as a context manager; leaving it checks that every entry was written."""

    def __init__(self, path: str | Path, entries: list[tuple[str, tuple, np.dtype]], metadata: dict | None = None):
        header, offset = {}, 0
        self._order = []
        for name, shape, dtype in entries:
            dtype = np.dtype(dtype)
            if dtype not in _NAMES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
            nbytes = int(np.prod(shape)) * dtype.itemsize
            header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, tuple(shape), dtype))
            offset += nbytes
        if metadata:
            header["__metadata__"] = dict(metadata)
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._path, self._next = path, 0
        from jaxloom.core import paths

        self._file = paths.open_write(path)  # a local file or an object-store upload; closed by __exit__
        self._file.write(struct.pack("<Q", len(blob)))
        self._file.write(blob)

    def write(self, name: str, array: np.ndarray, dtype: Any = None, chunk_bytes: int = 4 << 20) -> None:
        """Append `name`'s bytes; it must be the next entry, with that shape and dtype (`array`, cast to
        `dtype` if given). `array` may be a non-contiguous view (a transpose): it is made contiguous and
        cast `chunk_bytes` at a time, so no full copy of the tensor is made."""
        dtype = np.dtype(dtype if dtype is not None else array.dtype)
        want = self._order[self._next] if self._next < len(self._order) else None
        if want is None or want[0] != name or want[1] != array.shape or want[2] != dtype:
            raise ValueError(f"{self._path}: got tensor {name!r} {array.shape} {dtype}, expected {want}")
        if array.ndim == 0 or (array.flags.c_contiguous and array.dtype == dtype):
            self._file.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        else:
            row = max(1, int(np.prod(array.shape[1:])) * max(dtype.itemsize, array.dtype.itemsize))
            step = max(1, chunk_bytes // row)
            for r in range(0, array.shape[0], step):
                part = np.ascontiguousarray(array[r : r + step], dtype=dtype)
                self._file.write(part.reshape(-1).view(np.uint8).data)
        self._next += 1

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, kind, *_: object) -> None:
        self._file.close()
        if kind is None and self._next != len(self._order):
            raise ValueError(f"{self._path}: {len(self._order) - self._next} tensor(s) of the header were not written")
