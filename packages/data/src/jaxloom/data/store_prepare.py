"""`jaxloom data prepare`: tokenize a corpus once into a token store (`store.py` reads it), in parallel
work units that a killed run continues, the store appearing whole or not at all."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from .sources import as_source, iter_shard
from .store import MANIFEST, UNIT_BYTES, _BATCH, FORMAT, VERSION, _settings, _tokenizer_name, is_store, tokenizer_hash

log = logging.getLogger("jaxloom.data.store")


@dataclasses.dataclass(frozen=True)
class _Unit:
    index: int
    shard: str
    start: int
    end: int | None  # None: to the shard's end


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
            units.append(_Unit(len(units), name, 0, None))
            continue
        cuts = [0]
        with open(name, "rb") as fh:
            for b in range(unit_bytes, size, unit_bytes):
                fh.seek(b - 1)
                fh.readline()  # to the start of the next line
                if fh.tell() > cuts[-1] and fh.tell() < size:
                    cuts.append(fh.tell())
        for lo, hi in zip(cuts, cuts[1:] + [None], strict=True):
            units.append(_Unit(len(units), name, lo, hi))
    return units


def _tokenize_unit(args) -> dict[str, Any]:
    """Tokenize one work unit into `shard-K.*` files in `work` (written under temporary names, then renamed)."""
    source, unit, tokenizer_dir, config, max_len, dtype, work = args
    from .pipeline import _batch_tokenize
    from .processor import load_processor
    from .tokenize import tokenize_record

    tokenizer = load_processor(tokenizer_dir)
    name = f"shard-{unit.index:05d}"
    base = Path(work) / name
    offsets, n_tokens, masked = [0], 0, False
    with open(f"{base}.tokens.tmp", "wb") as tok_fh, open(f"{base}.mask.tmp", "wb") as mask_fh:

        def flush(records: list[dict], where: list[int]) -> None:
            nonlocal n_tokens, masked
            fast = _batch_tokenize(records, tokenizer, config)
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
        for record, after in iter_shard(source, unit.shard, unit.start):
            if unit.end is not None and pos >= unit.end:
                break
            records.append(record)
            where.append(pos)
            pos = after
            if len(records) == _BATCH:
                flush(records, where)
                records, where = [], []
        flush(records, where)
    np.save(f"{base}.offsets.tmp.npy", np.asarray(offsets, np.int64))
    os.replace(f"{base}.tokens.tmp", f"{base}.tokens")
    if masked:
        os.replace(f"{base}.mask.tmp", f"{base}.mask")
    else:
        os.remove(f"{base}.mask.tmp")
    meta = {"name": name, "documents": len(offsets) - 1, "tokens": n_tokens, "masked": masked}
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
    settings = _settings(config, max_sequence_length)
    source = as_source(data)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": {"name": _tokenizer_name(tok), "hash": tokenizer_hash(tok)},
        "settings": settings,
        "dtype": "uint16" if len(tok) <= 1 << 16 else "uint32",
        "sources": [str(s) for s in source.shard_names],
    }
    if is_store(out):
        manifest = json.loads((out / MANIFEST).read_text())
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
    plan = work / "plan.json"
    if plan.is_file() and json.loads(plan.read_text()) != header:
        raise FileExistsError(
            f"{work} holds an unfinished store from other data or settings; expected the same arguments "
            "to continue it (or delete it to start again)"
        )
    plan.write_text(json.dumps(header))
    units = _units(source, unit_bytes)
    done = {
        u.index: json.loads((work / f"shard-{u.index:05d}.done.json").read_text())
        for u in units
        if (work / f"shard-{u.index:05d}.done.json").is_file()
    }
    todo = [u for u in units if u.index not in done]
    if done:
        log.info("continuing %s: %d of %d unit(s) already done", work, len(done), len(units))
    dtype = np.dtype(str(header["dtype"]))
    jobs = [(source, u, tok_dir, config, max_sequence_length, dtype, str(work)) for u in todo]
    started, tokens = time.monotonic(), 0
    from tqdm.auto import tqdm

    bar = tqdm(total=len(units), initial=len(done), unit="unit", desc="prepare", disable=not progress)
    if num_proc > 1 and len(jobs) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(num_proc, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
            results = pool.map(_tokenize_unit, jobs)
            for job, meta in zip(jobs, results, strict=True):
                done[job[1].index] = meta
                tokens += meta["tokens"]
                bar.set_postfix(tokens_per_s=f"{tokens / max(time.monotonic() - started, 1e-9):.3g}")
                bar.update()
    else:
        for job in jobs:
            meta = _tokenize_unit(job)
            done[job[1].index] = meta
            tokens += meta["tokens"]
            bar.set_postfix(tokens_per_s=f"{tokens / max(time.monotonic() - started, 1e-9):.3g}")
            bar.update()
    bar.close()
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
    tmp = work / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, work / MANIFEST)
    os.replace(work, out)  # the store appears whole, or not at all
    log.info("prepared %s: %d documents, %d tokens", out, manifest["documents"], manifest["tokens"])
    return manifest
