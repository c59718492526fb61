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

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .streams import Stream, Streamed

log = logging.getLogger(__name__)
FORMAT = "jaxloom-token-store"
VERSION = 1
MANIFEST = "manifest.json"
UNIT_BYTES = 64 << 20  # a large JSONL/text file is split into work units (and store shards) of this many bytes
TOKENIZE_BATCH = 1024  # records tokenized per call


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


def offsets_digest(offsets: np.ndarray) -> str:
    """A digest of a shard's document offsets (int64): recorded by `prepare`, checked when the store is read, so a
    moved document boundary (which leaves the offsets a valid index) is seen. Offsets are 8 bytes per document:
    hashing them costs little; the tokens are checked by their range instead (hashing them would read them all)."""
    return hashlib.sha256(np.ascontiguousarray(offsets, dtype="<i8").tobytes()).hexdigest()[:16]


def tokenizer_name(tokenizer) -> str:
    """How a store's manifest names `tokenizer`: its `name_or_path`, else its class name."""
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def store_settings(config, max_sequence_length: int | None) -> dict[str, Any]:
    """The data settings a prepared store was tokenized under (`config`'s columns and special tokens, and
    `max_sequence_length`), recorded in its manifest and compared when a run reads it."""
    keys = ("add_bos", "add_eos", "text_column", "messages_column", "prompt_column", "completion_column")
    return {**{k: getattr(config, k) for k in keys}, "max_sequence_length": max_sequence_length}


class TokenStore(Streamed):
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
        try:
            self.dtype = np.dtype(self.manifest["dtype"])
            self._shards = {s["name"]: s for s in self.manifest["shards"]}
            for shard in self._shards.values():
                for key in ("documents", "tokens"):
                    if not isinstance(shard[key], int) or isinstance(shard[key], bool) or shard[key] < 0:
                        raise ValueError(f"shard {shard['name']} {key} = {shard[key]!r}")
                if "/" in shard["name"] or shard["name"].startswith("."):
                    raise ValueError(f"shard name {shard['name']!r}")
                bool(shard["masked"])
            made, settings = self.manifest["tokenizer"], self.manifest["settings"]
            for value in (made["hash"], made["name"]):
                if not isinstance(value, str):
                    raise ValueError(f"tokenizer {value!r}")
            for key in ("add_bos", "add_eos"):
                if not isinstance(settings[key], bool):
                    raise ValueError(f"settings {key} = {settings[key]!r}")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{path}: a malformed token store manifest ({type(e).__name__}: {e}); expected one written by "
                "`jaxloom data prepare` (prepare the store again)"
            ) from None
        self.vocab: int | None = None  # set by `check`: every id read is checked against it
        self._open: dict[str, tuple] = {}

    @property
    def shard_names(self) -> list[str]:
        return list(self._shards)

    def check(self, tokenizer, config) -> None:
        """Raise if the store was made with another tokenizer than `tokenizer`, or other BOS/EOS settings
        than `config`'s (the run's `DataConfig`)."""
        made = self.manifest["tokenizer"]
        run = tokenizer_hash(tokenizer)
        self.vocab = len(tokenizer)
        if made["hash"] != run:
            raise ValueError(
                f"token store {self.root} was made with tokenizer {made['name']!r} (hash {made['hash']}), the run "
                f"uses {tokenizer_name(tokenizer)!r} (hash {run}); expected the same tokenizer "
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
            steps = np.diff(np.asarray(offsets))
            if offsets.ndim != 1 or int(offsets[0]) != 0 or int(offsets[-1]) != len(tokens) or (steps < 0).any():
                bad = int(np.argmax(steps < 0)) if (steps < 0).any() else None
                raise ValueError(
                    f"token store {self.root}: shard {name}'s offsets are not a valid index of its "
                    f"{len(tokens)} tokens (first {int(offsets[0])}, last {int(offsets[-1])}"
                    + (f", out of order at document {bad}" if bad is not None else "")
                    + "); the store is damaged: prepare it again"
                )
            if "offsets_digest" in meta and offsets_digest(np.asarray(offsets)) != meta["offsets_digest"]:
                raise ValueError(
                    f"token store {self.root}: shard {name}'s offsets differ from what prepare wrote (digest "
                    f"{offsets_digest(np.asarray(offsets))}, the manifest says {meta['offsets_digest']}); the store is "
                    "damaged: prepare it again"
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
            ids = tokens[lo:hi]
            if self.vocab is not None and len(ids) and int(ids.max()) >= self.vocab:
                raise ValueError(
                    f"token store {self.root} shard {name} document {d}: token id {int(ids.max())} is not below the "
                    f"tokenizer's {self.vocab}; the store is damaged or from another tokenizer: prepare it again"
                )
            yield {"input_ids": ids, "loss_mask": None if mask is None else mask[lo:hi]}, d + 1

    def describe(self, name: str, cursor: int) -> str:
        """Where document `cursor` of shard `name` is: `STORE shard NAME document D`."""
        return f"{self.root} shard {name} document {cursor}"
