"""`ShardedDataSource`: a list of shards, each read as a stream of records (dicts) from a cursor.

A shard is never read whole. `open_shard(name, cursor)` streams `(record, next_cursor)` pairs from
`cursor`: a small integer the source defines (a byte offset for JSONL and text, a row for Parquet
and HF datasets, a record count for iterables). Passing a `next_cursor` back continues right after
that record, so a loader resumes by seeking, not by replaying — except where the format cannot seek
(an HF `IterableDataset`, a Python generator): there it skips forward and says so once.

A source written for an older jaxloom with only `read_shard(name) -> list` still works (its cursor
is the record index), but is read whole; see `iter_shard`.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from jaxloom.core import paths as _pathlayer

from .streams import OnError, ShardedDataSource, Stream, Streamed, describe, iter_shard  # noqa: F401
from .tokenize import SKIP_HINT

log = logging.getLogger(__name__)
_CHUNK = 1 << 20  # bytes read per call when streaming lines
_ROWS = 1024  # rows per slice for columnar sources


def _paths(paths: str | Path | Sequence[str | Path]) -> list[Any]:
    """The files `paths` names (a path, a glob or a list of them): `Path`s, and object-store URIs
    (`gs://bucket/x/*.jsonl`) as strings, listed through `jaxloom.core.paths`."""
    items = [paths] if isinstance(paths, str | Path) else list(paths)
    out: list[Any] = []
    for item in items:
        if _pathlayer.is_uri(str(item)):
            out.extend(_uri_files(str(item)))
            continue
        p = Path(item)
        pattern = any(c in p.name for c in "*?[") and not p.is_file()  # `data[1].jsonl` that exists is a file
        matches = sorted(p.parent.glob(p.name)) if pattern else [p]
        if not matches:
            raise FileNotFoundError(f"no file matches {p}")
        for m in matches:
            if m.is_dir():
                raise FileNotFoundError(
                    f"dataset path {m} is a directory, not a data file; expected a .jsonl/.parquet/.txt file, a glob "
                    "of them (quoted), a token store or a saved HF dataset"
                )
            if not m.is_file():
                raise FileNotFoundError(f"dataset file {m} does not exist")
        out.extend(matches)
    if not out:
        raise ValueError("no dataset files given")
    return out


def _uri_files(uri: str) -> list[str]:
    fs, path = _pathlayer._fs(uri)
    scheme = uri.split("://", 1)[0]
    if any(c in path for c in "*?["):
        found = sorted(fs.glob(path))
        if not found:
            raise FileNotFoundError(f"no file matches {uri}")
        return [f"{scheme}://{f}" for f in found]
    if not fs.isfile(path):
        raise FileNotFoundError(f"dataset file {uri} does not exist")
    return [uri]


def _lines(name: str, offset: int) -> Iterator[tuple[bytes, int]]:
    """`(line, offset_after)` for the lines of file `name` from byte `offset`, which must start a line."""
    with _pathlayer.open_binary(name) as fh:
        if offset:
            fh.seek(offset - 1)
            if fh.read(1) != b"\n":
                raise ValueError(
                    f"the dataset changed since this data position was saved: byte {offset} of {name} does not "
                    "start a line; expected the file the run was started with (resume with it, or start a new run)"
                )
        pos = offset
        for raw in fh:
            pos += len(raw)
            yield raw, pos


def _line_number(name: str, offset: int) -> int:
    """1-based number of the line starting at byte `offset` of `name` (reads the bytes before it)."""
    count, left = 1, offset
    with _pathlayer.open_binary(name) as fh:
        while left > 0:
            chunk = fh.read(min(_CHUNK, left))
            if not chunk:
                break
            count += chunk.count(b"\n")
            left -= len(chunk)
    return count


class _LineFiles(Streamed):
    """Files read line by line; the cursor is a byte offset."""

    files: list[Path]

    @property
    def shard_names(self) -> list[str]:
        return [str(f) for f in self.files]

    def describe(self, name: str, cursor: int) -> str:
        """`file:line` of the first non-blank line from byte `cursor` (where the record after `cursor` is)."""
        line = _line_number(name, cursor)
        with _pathlayer.open_binary(name) as fh:
            fh.seek(cursor)
            for raw in fh:
                if raw.strip():
                    break
                line += 1
        return f"{name}:{line}"

    def _decode(self, name: str, raw: bytes, start: int) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.describe(name, start)}: not valid UTF-8 ({e}); expected UTF-8 text") from None


class JsonlSource(_LineFiles):
    """One shard per `.jsonl` file in `paths` (a path, a glob or a list), streamed line by line. A
    malformed line is an error naming file and line, or is skipped with a warning (`on_error="skip"`)."""

    def __init__(self, paths, on_error: OnError = "raise"):
        self.files = _paths(paths)
        self.on_error = on_error

    def open_shard(self, name: str, cursor: int = 0) -> Stream:
        """`(record, byte offset after it)` from byte `cursor` of file `name`."""
        start = cursor
        for raw, end in _lines(name, cursor):
            if raw.strip():
                line = self._decode(name, raw, start)
                try:
                    try:
                        row = json.loads(line)
                    except RecursionError:
                        raise ValueError("nested deeper than Python's JSON reader goes") from None
                    if not isinstance(row, dict):
                        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
                except ValueError as e:
                    msg = f"{self.describe(name, start)}: malformed JSONL line ({e})"
                    if self.on_error == "raise":
                        raise ValueError(f"{msg}; {SKIP_HINT}") from None
                    log.warning("%s; skipped", msg)
                else:
                    yield row, end
            start = end


class TextSource(_LineFiles):
    """Plain text files in `paths`: one record `{"text": ...}` per non-empty line (streamed), or per file
    (`per_file=True`)."""

    def __init__(self, paths, per_file: bool = False):
        self.files, self.per_file = _paths(paths), per_file

    def open_shard(self, name: str, cursor: int = 0) -> Stream:
        """`(record, byte offset after it)` from byte `cursor` of file `name`."""
        if self.per_file:
            if cursor == 0:
                with _pathlayer.open_binary(name) as fh:
                    text = fh.read().decode("utf-8")
                if text.strip():
                    yield {"text": text}, 1
            return
        start = cursor
        for raw, end in _lines(name, cursor):
            line = self._decode(name, raw, start).rstrip("\r\n")
            if line.strip():
                yield {"text": line}, end
            start = end


class ParquetSource(Streamed):
    """One shard per Parquet file in `paths` (a path, a glob or a list), streamed by row group with
    pyarrow; the cursor is the row, and a resume opens the row group that holds it."""

    def __init__(self, paths):
        self.files = _paths(paths)

    @property
    def shard_names(self) -> list[str]:
        return [str(f) for f in self.files]

    def open_shard(self, name: str, cursor: int = 0) -> Stream:
        """`(record, row after it)` from row `cursor` of file `name`."""
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(_pathlayer.open_binary(name) if _pathlayer.is_uri(name) else name)
        except Exception as e:  # noqa: BLE001 - pyarrow's errors name neither the file nor the fix
            raise ValueError(
                f"{name}: not a readable Parquet file ({type(e).__name__}: {e}); expected a complete .parquet file "
                "(a truncated copy?)"
            ) from None
        meta, first, group = pf.metadata, 0, 0
        while group < meta.num_row_groups and first + meta.row_group(group).num_rows <= cursor:
            first += meta.row_group(group).num_rows
            group += 1
        if group == meta.num_row_groups:
            if cursor > first:
                raise ValueError(
                    f"the dataset changed since this data position was saved: {name} has {first} rows, the "
                    f"position is row {cursor}; expected the file the run was started with"
                )
            return
        row = first
        for batch in pf.iter_batches(batch_size=_ROWS, row_groups=range(group, meta.num_row_groups)):
            for record in batch.to_pylist():
                row += 1
                if row > cursor:
                    yield record, row


class HFDatasetSource(Streamed):
    """`dataset`, a `datasets.Dataset`, split into `num_shards` contiguous shards read in slices (the
    cursor is the row), or an `IterableDataset` (its own shards when it has several, else one;
    `streaming=True` datasets too), consumed in order: it cannot seek, so a resume skips forward."""

    def __init__(self, dataset, num_shards: int = 8):
        self.dataset = dataset
        self.iterable = not hasattr(dataset, "__len__")
        self.num_shards = max(1, getattr(dataset, "num_shards", 1)) if self.iterable else num_shards
        self._warned = False

    @property
    def shard_names(self) -> list[str]:
        return [str(i) for i in range(self.num_shards)]

    def open_shard(self, name: str, cursor: int = 0) -> Stream:
        """`(record, records read after it)` from `cursor` of shard `name`."""
        i = int(name)
        if self.iterable:
            ds = self.dataset.shard(num_shards=self.num_shards, index=i) if self.num_shards > 1 else self.dataset
            yield from _skip_forward(self, ds, cursor, f"HF IterableDataset shard {i}")
            return
        n = len(self.dataset)
        lo, hi = n * i // self.num_shards, n * (i + 1) // self.num_shards
        for start in range(lo + cursor, hi, _ROWS):
            cols = self.dataset[start : min(hi, start + _ROWS)]
            keys = list(cols)
            for j in range(len(cols[keys[0]]) if keys else 0):
                yield {k: cols[k][j] for k in keys}, start + j + 1 - lo


def _skip_forward(source: Any, records: Iterable[dict], cursor: int, what: str) -> Stream:
    if cursor and not source._warned:
        source._warned = True
        log.warning("%s cannot seek: resuming skips forward over %d record(s) (read, not trained on)", what, cursor)
    for n, record in enumerate(itertools.islice(records, cursor, None), cursor + 1):
        yield dict(record), n


class IterableSource(Streamed):
    """`records` from Python: a list (split contiguously into `num_shards` shards), or a callable
    returning an iterable (streamed when `num_shards` is 1; a resume skips forward)."""

    def __init__(self, records: Iterable[dict] | Callable[[], Iterable[dict]], num_shards: int = 1):
        self.records = records
        self.num_shards = num_shards
        self._warned = False

    @property
    def shard_names(self) -> list[str]:
        return [str(i) for i in range(self.num_shards)]

    def open_shard(self, name: str, cursor: int = 0) -> Stream:
        """`(record, index after it)` from `cursor` of shard `name`."""
        if callable(self.records) and self.num_shards == 1:
            yield from _skip_forward(self, self.records(), cursor, "a Python iterable")
            return
        rows = self.records() if callable(self.records) else self.records
        rows = rows if isinstance(rows, list | tuple) else list(rows)
        i = int(name)
        lo, hi = len(rows) * i // self.num_shards, len(rows) * (i + 1) // self.num_shards
        for j in range(lo + cursor, hi):
            yield rows[j], j + 1 - lo


def as_source(data: Any, **kwargs: Any) -> ShardedDataSource:
    """A source for `data`, whatever it is: a source, an HF dataset, a path (by suffix), or records;
    `kwargs` go to the source's constructor."""
    if isinstance(data, ShardedDataSource) or hasattr(data, "open_shard"):
        return data
    if hasattr(data, "features") or type(data).__name__ in ("Dataset", "IterableDataset"):
        return HFDatasetSource(data, **kwargs)
    if isinstance(data, str | os.PathLike) or (
        isinstance(data, list | tuple) and data and isinstance(data[0], str | os.PathLike)
    ):
        given = data if isinstance(data, str | os.PathLike) else data[0]
        first = Path(given)
        from .store import TokenStore, is_store

        if _pathlayer.is_uri(str(given)):  # an object store: files read through jaxloom.core.paths
            suffix = Path(str(given).split("://", 1)[1]).suffix
            kinds = {".jsonl": JsonlSource, ".parquet": ParquetSource, ".txt": TextSource, ".md": TextSource}
            if suffix not in kinds:
                raise ValueError(
                    f"cannot read {given} from an object store; expected .jsonl, .parquet or .txt files there "
                    "(token stores are memory-mapped: copy one to a local or mounted disk)"
                )
            return kinds[suffix](data) if suffix == ".parquet" else kinds[suffix](data, **kwargs)
        if is_store(first):
            return TokenStore(data, **kwargs)
        if first.is_dir() and (first / "dataset_info.json").is_file():  # datasets.save_to_disk
            import datasets

            return HFDatasetSource(datasets.load_from_disk(str(first)), **kwargs)
        if first.suffix == ".jsonl":
            return JsonlSource(data, **kwargs)
        if first.suffix == ".parquet":
            return ParquetSource(data)
        if first.suffix in (".txt", ".md", ".text"):
            return TextSource(data, **kwargs)
        raise ValueError(
            f"cannot tell the format of {first}; expected .jsonl, .parquet, .txt, a saved HF dataset directory or "
            "a token store (a directory made by `jaxloom data prepare`)"
        )
    if isinstance(data, list | tuple) or callable(data):
        return IterableSource(data, **kwargs)
    raise TypeError(f"cannot read a dataset from {type(data).__name__}")
