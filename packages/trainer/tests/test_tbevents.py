"""TensorBoard event files written by jaxloom, read back with tensorboardX's own protos and CRC."""

import struct
import subprocess
import sys

import numpy as np
import pytest

from jaxloom.trainer.metrics import MetricsWriter
from jaxloom.trainer.tbevents import EventWriter, crc32c

event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
tb_crc = pytest.importorskip("tensorboardX.crc32c")


def read_events(path):
    """Every Event in a TFRecord file, checking both masked CRCs of each record."""

    def masked(data):
        crc = tb_crc.crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    data, events, i = path.read_bytes(), [], 0
    while i < len(data):
        header = data[i : i + 8]
        (n,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[i + 8 : i + 12])[0] == masked(header)
        body = data[i + 12 : i + 12 + n]
        assert struct.unpack("<I", data[i + 12 + n : i + 16 + n])[0] == masked(body)
        events.append(event_pb2.Event.FromString(body))
        i += 16 + n
    return events


def test_crc32c_matches_reference():
    for data in (b"", b"a", b"123456789", bytes(range(256)) * 3):
        assert crc32c(data) == tb_crc.crc32c(data)
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_scalars_text_and_histograms_decode(tmp_path):
    w = EventWriter(tmp_path)
    w.add_scalar("train/loss", 2.5, 7)
    w.add_scalar("train/lr", -1e-3, 2**40)
    w.add_text("samples/0", "**hi** there", 9)
    values = np.random.default_rng(0).normal(size=1000)
    w.add_histogram("weights/w", values, 3)
    w.close()
    first, loss, lr, text, histo = read_events(w.path)
    assert first.file_version == "brain.Event:2"
    assert (loss.step, loss.summary.value[0].tag, loss.summary.value[0].simple_value) == (7, "train/loss", 2.5)
    assert lr.step == 2**40 and lr.summary.value[0].simple_value == pytest.approx(-1e-3)
    t = text.summary.value[0]
    assert t.metadata.plugin_data.plugin_name == "text" and t.tensor.string_val == [b"**hi** there"]
    assert [d.size for d in t.tensor.tensor_shape.dim] == [1]
    h = histo.summary.value[0].histo
    assert (h.min, h.max, h.num) == (values.min(), values.max(), 1000)
    assert h.sum == pytest.approx(values.sum()) and h.sum_squares == pytest.approx((values**2).sum())
    counts, edges = np.histogram(values, bins=30)
    assert list(h.bucket) == counts.tolist() and list(h.bucket_limit) == pytest.approx(edges[1:].tolist())
    assert loss.wall_time > 1.6e9


def test_metrics_writer_logs_to_tensorboard_without_torch(tmp_path):
    code = (
        "import sys; from jaxloom.trainer.metrics import MetricsWriter; "
        f"w = MetricsWriter({str(tmp_path)!r}, progress_bar=False); w.write(1, {{'loss': 3.0}}); "
        "w.write(2, {'loss': 2.0, 'note': 'x'}); w.close(); "
        "print(sorted(m for m in ('torch', 'tensorboardX') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
    (path,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    scalars = [(e.step, v.tag, v.simple_value) for e in read_events(path) for v in e.summary.value]
    assert scalars == [(1, "train/loss", 3.0), (2, "train/loss", 2.0)]  # non-numbers go to the JSONL only


def test_writer_disabled_writes_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "off", tensorboard=False, progress_bar=False)
    w.write(1, {"loss": 1.0})
    w.close()
    assert not (tmp_path / "off" / "tensorboard").exists()
