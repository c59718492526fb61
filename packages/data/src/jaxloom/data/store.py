"""Token stores: a corpus tokenized once (`prepare`), read by the loader as memory-mapped arrays.

Layout of a store directory (all written by `prepare`; `manifest.json` last):

    manifest.json              format, tokenizer (name and hash), settings, shards, token counts
    shard-00000.tokens         the documents' token ids back to back (uint16 or uint32, little endian)
    shard-00000.offsets.npy    int64 [documents + 1]: document d is tokens[offsets[d]:offsets[d+1]]
    shard-00000.mask           uint8 loss mask per token (only for shards where some token is not a target)

Why raw memory-mapped arrays (docs/data.md has the measurements): a document is two reads of an
offsets array and one slice of a token array, with no decoding and nothing resident but the pages
touched; Arrow (`datasets.load_from_disk`) and ArrayRecord add a per-record decode and a dependency
for no gain when every record is a flat integer array. Packed or unpacked training reads the same
store: documents are kept whole (or split into rows of at most `max_sequence_length` tokens), and the
loader packs or pads them as the run's `DataConfig` says.

`prepare` splits its input into work units (line-aligned byte ranges of large JSONL/text files, or
whole shards), tokenizes them in `num_proc` processes, and writes each unit's shard atomically under
`OUT.partial/`; a rerun after a kill keeps finished units, and the store appears at `OUT` by one
rename when every unit is done. The result depends only on the input and the settings, never on
`num_proc` or on where a previous attempt stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .sources import Stream, _Streamed, as_source, iter_shard

log = logging.getLogger(__name__)
FORMAT = "jaxloom-token-store"
VERSION = 1
MANIFEST = "manifest.json"
UNIT_BYTES = 64 << 20  # a large JSONL/text file is split into work units (and store shards) of this many bytes
_BATCH = 1024  # records tokenized per call


def is_store(path: str | os.PathLike) -> bool:
    """Whether `path` is a token store directory (it has a manifest)."""
    return (Path(path) / MANIFEST).is_file()


def tokenizer_hash(tokenizer) -> str:
    """A hash of what makes `tokenizer` produce its ids: its vocabulary and rules, and its special ids.
    Not its post-processor, padding or truncation: stores encode without the tokenizer's special-token
    template (BOS/EOS are placed by `DataConfig`), so a copy that only adds BOS hashes the same."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        for key in ("post_processor", "padding", "truncation"):
            spec.pop(key, None)
        h.update(json.dumps(spec, sort_keys=True).encode())
    else:  # a slow tokenizer: its vocabulary
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)]
    h.update(json.dumps(special).encode())
    return h.hexdigest()[:16]


def _tokenizer_name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def _settings(config, max_sequence_length: int | None) -> dict[str, Any]:
    keys = ("add_bos", "add_eos", "text_column", "messages_column", "prompt_column", "completion_column")
    return {**{k: getattr(config, k) for k in keys}, "max_sequence_length": max_sequence_length}


class TokenStore(_Streamed):
    """A token store (see the module docstring) as a data source: one shard per store shard, a record
    per document (`{"input_ids", "loss_mask"}`, views into memory-mapped files), the cursor a document
    index, so a resume seeks. `paths`: a store directory (or a one-item list of it)."""

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike]):
        items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
        if len(items) != 1:
            raise ValueError(f"a token store is one directory, got {len(items)} paths; mix stores with a data mixture")
        self.root = Path(items[0])
        path = self.root / MANIFEST
        try:
            self.manifest = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable token store manifest ({e})") from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise ValueError(
                f"{path}: format {self.manifest.get('format')!r} version {self.manifest.get('version')!r}; "
                f"expected {FORMAT!r} version {VERSION} (made by `jaxloom data prepare`)"
            )
        self.dtype = np.dtype(self.manifest["dtype"])
        self._shards = {s["name"]: s for s in self.manifest["shards"]}
        self._open: dict[str, tuple] = {}

    @property
    def shard_names(self) -> list[str]:
        return list(self._shards)

    def check(self, tokenizer, config) -> None:
        """Raise if the store was made with another tokenizer than `tokenizer`, or other BOS/EOS settings
        than `config`'s (the run's `DataConfig`)."""
        made = self.manifest["tokenizer"]
        run = tokenizer_hash(tokenizer)
        if made["hash"] != run:
            raise ValueError(
                f"token store {self.root} was made with tokenizer {made['name']!r} (hash {made['hash']}), the run "
                f"uses {_tokenizer_name(tokenizer)!r} (hash {run}); expected the same tokenizer "
                "(prepare the store again with the run's tokenizer)"
            )
        for key in ("add_bos", "add_eos"):
            if self.manifest["settings"][key] != getattr(config, key):
                raise ValueError(
                    f"token store {self.root} was made with {key}={self.manifest['settings'][key]}, the run has "
                    f"{key}={getattr(config, key)}; expected the same (prepare again, or change the run's setting)"
                )

    def _arrays(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if name not in self._open:
            meta = self._shards[name]
            base = self.root / name
            try:
                offsets = np.load(f"{base}.offsets.npy", mmap_mode="r")
                tokens = np.memmap(f"{base}.tokens", dtype=self.dtype, mode="r") if meta["tokens"] else np.zeros(0)
                mask = np.memmap(f"{base}.mask", dtype=np.uint8, mode="r") if meta["masked"] else None
            except (OSError, ValueError) as e:
                raise ValueError(f"token store {self.root}: shard {name} cannot be read ({e})") from None
            if (
                len(offsets) != meta["documents"] + 1
                or len(tokens) != meta["tokens"]
                or (mask is not None and len(mask) != meta["tokens"])
            ):
                raise ValueError(
                    f"token store {self.root}: shard {name} is truncated or changed: {len(offsets) - 1} documents "
                    f"and {len(tokens)} tokens on disk, the manifest says {meta['documents']} and {meta['tokens']}"
                )
            self._open[name] = (offsets, tokens, mask)
        return self._open[name]

    def open_shard(self, name: str, cursor: int = 0) -> Stream:
        """`({"input_ids", "loss_mask"}, document after it)` from document `cursor` of shard `name`."""
        offsets, tokens, mask = self._arrays(name)
        if cursor > len(offsets) - 1:
            raise ValueError(
                f"token store {self.root}: the position is document {cursor} of shard {name}, which has "
                f"{len(offsets) - 1}; expected the store the run was started with"
            )
        for d in range(cursor, len(offsets) - 1):
            lo, hi = int(offsets[d]), int(offsets[d + 1])
            yield {"input_ids": tokens[lo:hi], "loss_mask": None if mask is None else mask[lo:hi]}, d + 1

    def describe(self, name: str, cursor: int) -> str:
        """Where document `cursor` of shard `name` is: `STORE shard NAME document D`."""
        return f"{self.root} shard {name} document {cursor}"


# ---- prepare ---------------------------------------------------------------------------------------


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
