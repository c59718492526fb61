"""`jaxloom data prepare`: tokenize a corpus once into a token store (`store.py` reads it), in parallel
work units that a killed run continues, the store appearing whole or not at all."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from .sources import as_source, iter_shard
from .store import (
    TOKENIZE_BATCH,
    FORMAT,
    MANIFEST,
    UNIT_BYTES,
    VERSION,
    store_settings,
    tokenizer_name,
    is_store,
    offsets_digest,
    tokenizer_hash,
)

log = logging.getLogger("jaxloom.data.store")


@dataclasses.dataclass(frozen=True)
class _Unit:
    index: int
    shard: str
    start: int
    end: int | None  # None: to the shard's end
    bytes_cursor: bool = False  # the shard's cursor is a byte offset (line files), not a record index


def _units(source, unit_bytes: int) -> list[_Unit]:
    """Work units: line-aligned byte ranges of each line-oriented file, whole shards otherwise."""
    units: list[_Unit] = []
    for name in source.shard_names:
        lines = (
            hasattr(source, "describe")
            and isinstance(getattr(source, "files", None), list)
            and not getattr(source, "per_file", False)
        )
        size = os.path.getsize(name) if lines else 0
        if not lines or size <= unit_bytes:
            units.append(_Unit(len(units), name, 0, None, bool(lines)))
            continue
        cuts = [0]
        with open(name, "rb") as fh:
            for b in range(unit_bytes, size, unit_bytes):
                fh.seek(b - 1)
                fh.readline()  # to the start of the next line
                if fh.tell() > cuts[-1] and fh.tell() < size:
                    cuts.append(fh.tell())
        for lo, hi in zip(cuts, cuts[1:] + [None], strict=True):
            units.append(_Unit(len(units), name, lo, hi, True))
    return units


def _unit_bytes(unit: _Unit) -> int:
    """How many bytes of its file `unit` covers (0 when its shard is not a local file)."""
    try:
        end = unit.end if unit.end is not None else os.path.getsize(unit.shard)
    except OSError:
        return 0
    return max(end - unit.start, 0)


PROGRESS_EVERY_S = 10.0  # without a terminal, `prepare` logs a progress line this often


class _Progress:
    """What `jaxloom data prepare` shows while it works: bytes read of the total, rate, documents, tokens and the
    time left. On a terminal a bar; otherwise (a log, a CI job) a line every `every` seconds, so a long prepare
    is never silent."""

    def __init__(self, total: int, done: int, units: int, *, bar: bool, every: float | None = None):
        from tqdm.auto import tqdm

        self.total, self.done = total, done
        self.every = PROGRESS_EVERY_S if every is None else every
        self.documents = self.tokens = 0
        self.started = self.last = time.monotonic()
        self.first = done
        self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc="prepare", disable=not bar)
        self.quiet_bar = not bar
        if self.quiet_bar:
            log.info("preparing %d unit(s), %s", units, _size(total))

    def update(self, nbytes: int, documents: int = 0, tokens: int = 0) -> None:
        self.done += nbytes
        self.documents += documents
        self.tokens += tokens
        self.bar.update(nbytes)
        now = time.monotonic()
        if self.quiet_bar and now - self.last >= self.every:
            self.last = now
            log.info("prepare: %s", self.line(now))

    def line(self, now: float) -> str:
        rate = (self.done - self.first) / max(now - self.started, 1e-9)
        left = max(self.total - self.done, 0) / rate if rate > 0 else float("inf")
        share = f" ({100 * self.done / self.total:.0f} %)" if self.total else ""
        eta = f", ETA {left:.0f} s" if left != float("inf") else ""
        return (
            f"{_size(self.done)} of {_size(self.total)}{share}, {_size(rate)}/s, {self.documents:,} documents, "
            f"{self.tokens:,} tokens{eta}"
        )

    def close(self) -> None:
        self.bar.close()
        if self.quiet_bar:
            log.info("prepare: %s", self.line(time.monotonic()))


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


def _tokenize_unit(args, report=None) -> dict[str, Any]:
    """Tokenize one work unit into `shard-K.*` files in `work` (written under temporary names, then renamed).
    `report(bytes, documents, tokens)`, when given, is told of the progress after each batch of records."""
    source, unit, tokenizer_dir, config, max_len, dtype, work = args
    from .pipeline import batch_tokenize
    from .processor import load_processor
    from .tokenize import tokenize_record

    tokenizer = load_processor(tokenizer_dir)
    name = f"shard-{unit.index:05d}"
    base = Path(work) / name
    offsets, n_tokens, masked = [0], 0, False
    with open(f"{base}.tokens.tmp", "wb") as tok_fh, open(f"{base}.mask.tmp", "wb") as mask_fh:

        def flush(records: list[dict], where: list[int]) -> None:
            nonlocal n_tokens, masked
            fast = batch_tokenize(records, tokenizer, config)
            for i, record in enumerate(records):
                if fast is not None:
                    ids, mask = fast[i], None
                else:
                    try:
                        ids, mask = tokenize_record(record, tokenizer, config)
                    except (ValueError, TypeError) as e:
                        from .sources import describe

                        raise ValueError(f"{describe(source, unit.shard, where[i])}: {e}") from None
                    mask = None if mask is None or bool(np.all(mask)) else mask
                for lo in range(0, max(len(ids), 1), max_len or max(len(ids), 1)):
                    piece = slice(lo, lo + max_len) if max_len else slice(None)
                    part = np.asarray(ids[piece])
                    if not len(part):
                        continue
                    tok_fh.write(part.astype(dtype).tobytes())
                    m = np.ones(len(part), np.uint8) if mask is None else np.asarray(mask[piece], np.uint8)
                    masked = masked or mask is not None
                    mask_fh.write(m.tobytes())
                    n_tokens += len(part)
                    offsets.append(n_tokens)

        records, where, pos = [], [], unit.start
        told = [unit.start, 0, 0]  # bytes, documents, tokens already reported

        def tell(last: bool = False) -> None:
            if report is None:
                return
            if unit.bytes_cursor:
                read = pos
            else:  # a record index: the file's bytes are counted when the unit is done
                read = unit.start + _unit_bytes(unit) if last else told[0]
            report(max(read - told[0], 0), len(offsets) - 1 - told[1], n_tokens - told[2])
            told[:] = [read, len(offsets) - 1, n_tokens]

        for record, after in iter_shard(source, unit.shard, unit.start):
            if unit.end is not None and pos >= unit.end:
                break
            records.append(record)
            where.append(pos)
            pos = after
            if len(records) == TOKENIZE_BATCH:
                flush(records, where)
                records, where = [], []
                tell()
        flush(records, where)
        tell(last=True)
    np.save(f"{base}.offsets.tmp.npy", np.asarray(offsets, np.int64))
    os.replace(f"{base}.tokens.tmp", f"{base}.tokens")
    if masked:
        os.replace(f"{base}.mask.tmp", f"{base}.mask")
    else:
        os.remove(f"{base}.mask.tmp")
    meta = {"name": name, "documents": len(offsets) - 1, "tokens": n_tokens, "masked": masked}
    meta["offsets_digest"] = offsets_digest(np.asarray(offsets, np.int64))
    os.replace(f"{base}.offsets.tmp.npy", f"{base}.offsets.npy")
    tmp = Path(f"{base}.done.json.tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, f"{base}.done.json")  # the unit counts as finished only once this exists
    return meta


def prepare(
    data: Any,
    out: str | os.PathLike,
    tokenizer: str | os.PathLike | None = None,
    *,
    config=None,
    num_proc: int = 1,
    max_sequence_length: int | None = None,
    unit_bytes: int = UNIT_BYTES,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize `data` (anything `as_source` reads) once into a token store at `out`; returns its manifest.

    `tokenizer`: a tokenizer directory (default: the bundled one); `config`: a `DataConfig` for the
    columns and BOS/EOS; `num_proc`: processes; `max_sequence_length`: split longer documents into rows
    of at most this many tokens (None: keep documents whole); `unit_bytes`: large line files are split
    into work units (and store shards) of about this size; `progress`: show a progress bar. A killed
    run continues where it stopped when called again with the same arguments; an existing finished
    store is returned as it is.
    """
    from .pipeline import DataConfig
    from .processor import bundled_tokenizer_path, load_processor

    config = config or DataConfig()
    out = Path(out)
    tok_dir = str(tokenizer or bundled_tokenizer_path())
    tok = load_processor(tok_dir)
    settings = store_settings(config, max_sequence_length)
    source = as_source(data)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": {"name": tokenizer_name(tok), "hash": tokenizer_hash(tok)},
        "settings": settings,
        "dtype": "uint16" if len(tok) <= 1 << 16 else "uint32",
        "sources": [str(s) for s in source.shard_names],
        "source_files": _file_identities(source.shard_names),
    }
    if is_store(out):
        manifest = json.loads((out / MANIFEST).read_text())
        if manifest.get("source_files") is None:  # a store from data 0.9: its files were not recorded
            header = {k: v for k, v in header.items() if k != "source_files"}
        if {k: manifest.get(k) for k in header} != header:
            raise FileExistsError(
                f"{out} is a token store made from other data or settings; expected a new directory "
                "(delete it, or prepare into another OUT)"
            )
        log.info("%s is already prepared (%d tokens)", out, manifest["tokens"])
        return manifest
    if out.exists():
        raise FileExistsError(f"{out} exists and is not a token store; expected a new directory for the store")
    work = out.with_name(out.name + ".partial")
    work.mkdir(parents=True, exist_ok=True)
    with _writer_lock(work):
        return _prepare_into(
            work, out, header, source, tok_dir, config, num_proc, max_sequence_length, unit_bytes, progress
        )


def _file_identities(names) -> dict[str, list[int]] | None:
    """`{file: [size, mtime_ns]}` of each local source file: a source edited after a prepare began (or after
    the store was made) is then seen, never silently kept. None when a source is not a local file."""
    out = {}
    for name in names:
        try:
            st = os.stat(name)
        except OSError:
            return None
        out[str(name)] = [st.st_size, st.st_mtime_ns]
    return out


@contextlib.contextmanager
def _writer_lock(work: Path):
    """One `prepare` writes a store at a time: `work/prepare.lock` holds the writer's pid. A lock whose
    process is gone (killed) is taken over; a live one is an error naming it."""
    lock = work / "prepare.lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and pid != os.getpid() and _alive(pid):
                raise FileExistsError(
                    f"{work} is being written by another `jaxloom data prepare` (pid {pid}); expected one writer "
                    "per store (wait for it, or stop it)"
                ) from None
            lock.unlink(missing_ok=True)  # its writer is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        break
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prepare_into(work, out, header, source, tok_dir, config, num_proc, max_sequence_length, unit_bytes, progress):
    plan = work / "plan.json"
    if plan.is_file() and json.loads(plan.read_text()) != header:
        before = json.loads(plan.read_text())
        changed = [
            f
            for f, ident in (header.get("source_files") or {}).items()
            if (before.get("source_files") or {}).get(f) not in (None, ident)
        ]
        if changed:
            raise FileExistsError(
                f"{work} holds an unfinished store of {changed[0]}, which has changed since (size or time); "
                "continuing would mix its old and new tokens: delete the unfinished store to start again"
            )
        raise FileExistsError(
            f"{work} holds an unfinished store from other data or settings; expected the same arguments "
            "to continue it (or delete it to start again)"
        )
    plan.write_text(json.dumps(header))
    units = _units(source, unit_bytes)
    dtype = np.dtype(str(header["dtype"]))
    done = {
        u.index: json.loads((work / f"shard-{u.index:05d}.done.json").read_text())
        for u in units
        if (work / f"shard-{u.index:05d}.done.json").is_file()
    }
    todo = [u for u in units if u.index not in done]
    if done:
        log.info("continuing %s: %d of %d unit(s) already done", work, len(done), len(units))
    jobs = [(source, u, tok_dir, config, max_sequence_length, dtype, str(work)) for u in todo]
    sizes = {u.index: _unit_bytes(u) for u in units}
    shown = _Progress(sum(sizes.values()), sum(sizes[i] for i in done), len(units), bar=progress)
    if num_proc > 1 and len(jobs) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(num_proc, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
            results = pool.map(_tokenize_unit, jobs)
            for job, meta in zip(jobs, results, strict=True):  # whole units, as the processes finish them
                done[job[1].index] = meta
                shown.update(sizes[job[1].index], meta["documents"], meta["tokens"])
    else:
        for job in jobs:
            done[job[1].index] = _tokenize_unit(job, report=shown.update)
    shown.close()
    shards = [done[u.index] for u in units]
    manifest = {
        **header,
        "shards": shards,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
    }
    for u in units:
        (work / f"shard-{u.index:05d}.done.json").unlink()
    plan.unlink()
    (work / "prepare.lock").unlink(missing_ok=True)  # the store is complete: it moves without its lock
    tmp = work / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, work / MANIFEST)
    os.replace(work, out)  # the store appears whole, or not at all
    log.info("prepared %s: %d documents, %d tokens", out, manifest["documents"], manifest["tokens"])
    return manifest
