"""What every data source is: named shards streamed as `(record, next_cursor)` pairs from a cursor. The
sources (files, HF datasets, iterables: `sources.py`) and token stores (`store.py`) build on this.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

OnError = Literal["raise", "skip"]
Stream = Iterator[tuple[dict[str, Any], int]]


@runtime_checkable
class ShardedDataSource(Protocol):
    """What the loaders read: named shards (`shard_names`), each streamed as records from a cursor
    (`open_shard`). `read_shard` (all records as a list) is kept for small data and old sources."""

    @property
    def shard_names(self) -> Sequence[str]: ...

    def read_shard(self, name: str) -> list[dict[str, Any]]:
        """The records of shard `name`, as dicts."""


def iter_shard(source: Any, name: str, cursor: int = 0) -> Stream:
    """`(record, next_cursor)` pairs of shard `name` of `source` from `cursor`: by `open_shard` when the
    source streams, else from `read_shard` (the cursor is then the record index)."""
    if hasattr(source, "open_shard"):
        return source.open_shard(name, cursor)
    rows = source.read_shard(name)
    return ((r, i + 1) for i, r in enumerate(rows[cursor:], cursor))


def describe(source: Any, name: str, cursor: int) -> str:
    """Where the record at `cursor` of shard `name` is, for error messages (`file:line` where known)."""
    fn = getattr(source, "describe", None)
    return fn(name, cursor) if fn is not None else f"{name} record {cursor}"


class Streamed:
    """`read_shard` for a streaming source: all its records as a list (small data, tests)."""

    def read_shard(self, name: str) -> list[dict]:
        """All records of shard `name` (reads it whole: for small data; loaders stream instead)."""
        return [r for r, _ in self.open_shard(name, 0)]  # type: ignore[attr-defined]

    def open_shard(self, name: str, cursor: int = 0) -> Stream:  # pragma: no cover - overridden
        raise NotImplementedError
