"""TensorBoard event files, written directly: scalars, text and histograms.

The format is TFRecord framing (length, masked CRC-32C of the length, the bytes, masked CRC-32C of
the bytes) around `Event` protocol buffers, encoded here by hand for the few fields TensorBoard
reads. Writing them ourselves avoids importing a TensorBoard writer library, which imports PyTorch
whenever it is installed (seconds of start-up and a few hundred MB of memory).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from pathlib import Path

import numpy as np


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`, as TFRecord framing uses."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ---- protocol-buffer encoding (only what events need) ---------------------------------------------
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64s as ten-byte two's complement, as protobuf does
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes(number: int, value: bytes | str) -> bytes:
    value = value.encode() if isinstance(value, str) else value
    return _field(number, 2, _varint(len(value)) + value)


def _event(step: int, *, summary_value: bytes | None = None, file_version: str | None = None) -> bytes:
    out = _field(1, 1, struct.pack("<d", time.time())) + _field(2, 0, _varint(step))
    if file_version is not None:
        out += _bytes(3, file_version)
    if summary_value is not None:
        out += _bytes(5, _bytes(1, summary_value))  # Event.summary = Summary{value: [summary_value]}
    return out


class EventWriter:
    """One `events.out.tfevents.*` file in `directory`; `add_scalar`, `add_text`, `add_histogram`, `add_hparams`.
    Each record is flushed to the file as it is added, so TensorBoard sees a running job's metrics.

    Args:
        directory: the folder TensorBoard is pointed at (created if missing)."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = directory / name
        self._file = open(self.path, "wb")
        self._write(_event(0, file_version="brain.Event:2"))

    def _write(self, event: bytes) -> None:
        header = struct.pack("<Q", len(event))
        self._file.write(header + struct.pack("<I", _masked(header)) + event + struct.pack("<I", _masked(event)))
        self._file.flush()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """Scalar `value` under `tag` at `step`."""
        self._write(_event(step, summary_value=_bytes(1, tag) + _field(2, 5, struct.pack("<f", float(value)))))

    def add_text(self, tag: str, text: str, step: int) -> None:
        """Markdown `text` under `tag` at `step` (TensorBoard's text plugin)."""
        metadata = _bytes(1, _bytes(1, "text"))  # SummaryMetadata.plugin_data.plugin_name
        shape = _bytes(2, _bytes(2, _field(1, 0, _varint(1))))  # TensorShapeProto{dim: [{size: 1}]}
        tensor = _field(1, 0, _varint(7)) + shape + _bytes(8, text)  # DT_STRING, string_val
        self._write(_event(step, summary_value=_bytes(1, tag) + _bytes(9, metadata) + _bytes(8, tensor)))

    def add_histogram(self, tag: str, values, step: int, bins: int = 30) -> None:
        """Histogram of `values` (any array) under `tag` at `step`, in `bins` equal-width buckets."""
        v = np.asarray(values, np.float64).ravel()
        if v.size == 0:
            return
        counts, edges = np.histogram(v, bins=bins)
        histo = b"".join(
            _field(i, 1, struct.pack("<d", x))
            for i, x in enumerate((v.min(), v.max(), v.size, v.sum(), float(v @ v)), start=1)
        )
        histo += _bytes(6, np.asarray(edges[1:], "<f8").tobytes()) + _bytes(7, counts.astype("<f8").tobytes())
        self._write(_event(step, summary_value=_bytes(1, tag) + _bytes(5, histo)))

    def add_hparams(self, hparams: dict, metric_tags: list[str]) -> None:
        """The run's hyperparameters for TensorBoard's HParams tab: an experiment naming them and the
        metrics to compare (`metric_tags`), and this session's values. Numbers, booleans and text as
        themselves; other values (lists, None) as their JSON text."""

        def kind_and_value(v) -> tuple[int, bytes]:  # api.proto DataType; google.protobuf.Value
            if isinstance(v, bool):
                return 2, _field(4, 0, _varint(int(v)))
            if isinstance(v, int | float):
                return 3, _field(2, 1, struct.pack("<d", float(v)))
            return 1, _bytes(3, v if isinstance(v, str) else json.dumps(v, default=str))

        encoded = {str(k): kind_and_value(v) for k, v in hparams.items()}
        infos = b"".join(_bytes(4, _bytes(1, k) + _field(4, 0, _varint(t))) for k, (t, _) in encoded.items())
        metrics = b"".join(_bytes(5, _bytes(1, _bytes(2, tag))) for tag in metric_tags)  # MetricInfo{name{tag}}
        session = b"".join(_bytes(1, _bytes(1, k) + _bytes(2, v)) for k, (_, v) in encoded.items())  # map entries
        # HParamsPluginData{experiment = 2 | session_start_info = 3}
        for tag, data in (
            ("_hparams_/experiment", _bytes(2, infos + metrics)),
            ("_hparams_/session_start_info", _bytes(3, session)),
        ):
            metadata = _bytes(1, _bytes(1, "hparams") + _bytes(2, data))  # SummaryMetadata.plugin_data
            self._write(_event(0, summary_value=_bytes(1, tag) + _bytes(9, metadata)))

    def close(self) -> None:
        """Flush and close the file."""
        if not self._file.closed:
            self._file.close()
