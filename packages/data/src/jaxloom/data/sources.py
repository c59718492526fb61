"""`ShardedDataSource`: a list of shards, each opened on its own and read as records (dicts).

A shard must be readable from its start; `read_shard` returns all its records so the loader can
visit them in a seeded order and resume at any position without reading what came before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

log = logging.getLogger(__name__)
OnError = Literal["raise", "skip"]


@runtime_checkable
class ShardedDataSource(Protocol):
    """What the loaders read: named shards (`shard_names`), each a list of records (`read_shard`)."""

    @property
    def shard_names(self) -> Sequence[str]: ...

    def read_shard(self, name: str) -> list[dict[str, Any]]:
        """The records of shard `name`, as dicts."""


def _paths(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    items = [paths] if isinstance(paths, str | Path) else list(paths)
    out = []
    for p in map(Path, items):
        matches = sorted(p.parent.glob(p.name)) if any(c in p.name for c in "*?[") else [p]
        if not matches:
            raise FileNotFoundError(f"no file matches {p}")
        for m in matches:
            if not m.is_file():
                raise FileNotFoundError(f"dataset file {m} does not exist")
        out.extend(matches)
    if not out:
        raise ValueError("no dataset files given")
    return out


class JsonlSource:
    """One shard per `.jsonl` file in `paths` (a path, a glob or a list). A malformed line is an error
    naming file and line, or is skipped with a warning (`on_error="skip"`)."""

    def __init__(self, paths, on_error: OnError = "raise"):
        self.files = _paths(paths)
        self.on_error = on_error
        self._lines: dict[str, Any] = {}  # shard → line number of each record (for error messages)

    @property
    def shard_names(self) -> list[str]:
        return [str(f) for f in self.files]

    def read_shard(self, name: str) -> list[dict]:
        """The records of file `name`; a malformed line is an error naming file:line (or skipped)."""
        rows, lines = [], []
        with open(name, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{name}:{n}: not valid UTF-8 ({e}); expected UTF-8 text") from None
                try:
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
                except ValueError as e:
                    msg = f"{name}:{n}: malformed JSONL line ({e})"
                    if self.on_error == "raise":
                        raise ValueError(msg) from None
                    log.warning("%s; skipped", msg)
                    continue
                rows.append(row)
                lines.append(n)
        self._lines = {name: np.asarray(lines, np.int64)}
        return rows

    def line_of(self, name: str, index: int) -> int | None:
        """The line of file `name` that record `index` (of the last `read_shard(name)`) came from."""
        lines = self._lines.get(name)
        return int(lines[index]) if lines is not None and 0 <= index < len(lines) else None


class TextSource:
    """Plain text files in `paths`: one record `{"text": ...}` per non-empty line, or per file
    (`per_file=True`)."""

    def __init__(self, paths, per_file: bool = False):
        self.files, self.per_file = _paths(paths), per_file

    @property
    def shard_names(self) -> list[str]:
        return [str(f) for f in self.files]

    def read_shard(self, name: str) -> list[dict]:
        """The non-empty lines (or the whole file with `per_file`) of `name` as `{'text': ...}`."""
        text = Path(name).read_text(encoding="utf-8")
        if self.per_file:
            return [{"text": text}] if text.strip() else []
        return [{"text": line} for line in text.splitlines() if line.strip()]


class ParquetSource:
    """One shard per Parquet file in `paths` (a path, a glob or a list), read with pyarrow."""

    def __init__(self, paths):
        self.files = _paths(paths)

    @property
    def shard_names(self) -> list[str]:
        return [str(f) for f in self.files]

    def read_shard(self, name: str) -> list[dict]:
        """The rows of file `name` as dicts."""
        import pyarrow.parquet as pq

        return pq.read_table(name).to_pylist()


class HFDatasetSource:
    """`dataset`, a `datasets.Dataset`, split into `num_shards` contiguous shards, or an `IterableDataset`
    (its own shards when it has several, else one)."""

    def __init__(self, dataset, num_shards: int = 8):
        self.dataset = dataset
        self.iterable = not hasattr(dataset, "__len__")
        self.num_shards = max(1, getattr(dataset, "num_shards", 1)) if self.iterable else num_shards

    @property
    def shard_names(self) -> list[str]:
        return [str(i) for i in range(self.num_shards)]

    def read_shard(self, name: str) -> list[dict]:
        """The records of shard `name`."""
        i = int(name)
        if self.iterable:
            ds = self.dataset.shard(num_shards=self.num_shards, index=i) if self.num_shards > 1 else self.dataset
            return [dict(r) for r in ds]
        n = len(self.dataset)
        lo, hi = n * i // self.num_shards, n * (i + 1) // self.num_shards
        return [dict(r) for r in self.dataset.select(range(lo, hi))]


class IterableSource:
    """`records` from Python: a list, or a callable returning an iterable, split contiguously into
    `num_shards` shards."""

    def __init__(self, records: Iterable[dict] | Callable[[], Iterable[dict]], num_shards: int = 1):
        self.records = records
        self.num_shards = num_shards

    @property
    def shard_names(self) -> list[str]:
        return [str(i) for i in range(self.num_shards)]

    def read_shard(self, name: str) -> list[dict]:
        """The records of shard `name`."""
        rows = list(self.records() if callable(self.records) else self.records)
        i = int(name)
        return rows[len(rows) * i // self.num_shards : len(rows) * (i + 1) // self.num_shards]


def as_source(data: Any, **kwargs: Any) -> ShardedDataSource:
    """A source for `data`, whatever it is: a source, an HF dataset, a path (by suffix), or records;
    `kwargs` go to the source's constructor."""
    if isinstance(data, ShardedDataSource):
        return data
    if hasattr(data, "features") or type(data).__name__ in ("Dataset", "IterableDataset"):
        return HFDatasetSource(data, **kwargs)
    if isinstance(data, str | Path) or (isinstance(data, list | tuple) and data and isinstance(data[0], str | Path)):
        first = Path(data if isinstance(data, str | Path) else data[0])
        if first.suffix == ".jsonl":
            return JsonlSource(data, **kwargs)
        if first.suffix == ".parquet":
            return ParquetSource(data)
        if first.suffix in (".txt", ".md", ".text"):
            return TextSource(data, **kwargs)
        raise ValueError(f"cannot tell the format of {first}; expected .jsonl, .parquet or .txt")
    if isinstance(data, list | tuple) or callable(data):
        return IterableSource(data, **kwargs)
    raise TypeError(f"cannot read a dataset from {type(data).__name__}")
