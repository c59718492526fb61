"""`DataLoader`: a deterministic, resumable stream of fixed-shape batches for one process.

Order: per epoch, the process's shards are visited in a seeded order; each shard is streamed in
blocks of `shuffle_buffer_size` records, and each block is visited in a seeded order. Memory holds one
block, whatever the dataset's size. The position is `{"epoch", "shard_pos", "block_cursor",
"block_record", "row_pos", "token_offset"}` — a small JSON object (`block_cursor` is the source's own
cursor where the block starts: a byte offset, a row). Restoring it opens the shard at that cursor and
reads one block again: nothing before the block is read (except from sources that cannot seek).
Batches are numpy dicts: `input_ids`, `segment_ids` (0 = padding; one id per document within a packed
row), `positions`, `loss_mask`, each `[batch_size, max_sequence_length]`. A `Mixture` of several
datasets fills each row from one of them, by weight.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from jaxloom.core.schema import NonNegativeInt, PositiveInt, config

from .sources import JsonlSource, ShardedDataSource, as_source, describe, iter_shard
from .tokenize import (
    SKIP_HINT,
    check_record,
    tokenize_image_pair,
    tokenize_image_record,
    tokenize_labelled,
    tokenize_pair,
    tokenize_record,
)

log = logging.getLogger(__name__)


@config
class DataConfig:
    """How records become batches.

    Arguments, grouped:

    - `max_sequence_length`, `batch_size`: row length, and rows per batch of this process.
    - `packing`: concatenate documents into full rows (segment ids keep them apart) instead of one
      padded row per document.
    - `truncation_mode`, `padding_side`: for unpacked rows.
    - `long_records`: unpacked records longer than a row are truncated ('truncate') or an error ('raise').
    - `pairs`: each row holds one preference record (`prompt`, `chosen`, `rejected`; see `tokenize_pair`):
      its chosen sequence in the first `max_sequence_length` columns and its rejected one in the next, each
      right-padded, so a row is `2 × max_sequence_length` wide and the two stay together on one data shard.
    - `margin_column` (with `pairs`): a number per preference record (TRL's `margin`: how far its chosen should
      score above its rejected), read into `margin [rows, 1]` float32 beside the tokens; a record without it has
      0, one whose value is not a finite number is a bad record. None: not read.
    - `label_column`: each unpacked row holds one unpaired preference record (TRL's `KTOTrainer` data: `prompt`,
      `completion`, and this boolean column, true for a desirable completion; see `tokenize_labelled`), its label
      read into `label [rows, 1]` float32 (1.0 or 0.0) beside the tokens. None: ordinary records.
    - `max_images`, `image_shape`, `images_column`: rows of a vision-language model (the loader given a transformers
      processor in place of the tokenizer): each unpacked row holds one record of TRL's image data (`messages` or
      `text`, its images in `images_column` or `image`; see `tokenize_image_record`; with `pairs`, a preference
      record whose prompt shows them, `tokenize_image_pair`) and up to `max_images` images,
      their pixels in `pixel_values [rows, max_images, *image_shape]` float32 (unused slots zero) and the
      processor's `token_type_ids [rows, length]` beside the tokens. A record with more images, or longer than a row
      (its image tokens are never cut), is a bad record. 0: no images read.
    - `bad_records`: a record that cannot be tokenized is an error naming its file and line ('raise'), or
      is skipped and counted (`DataLoader.skipped`) ('skip').
    - `text_column`, `messages_column`, `prompt_column`, `completion_column`: the record fields read for plain
      text, chat messages, and prompt/completion pairs; `chosen_column`, `rejected_column`: a preference
      record's completions (with `pairs`).
    - `completion_only_loss`: prompt/completion records train on the completion only (False: every token);
      `assistant_only_loss`: chat records train on the assistant turns only (False: every token) — TRL's names.
    - `add_bos`, `add_eos`: put the tokenizer's bos/eos tokens around every document.
    - `shuffle`, `seed`: shuffle shards and records each epoch, deterministically from `seed`.
    - `shuffle_buffer_size`: records read ahead from a shard (and shuffled together, when `shuffle`);
      memory holds this many records and their tokens, whatever the dataset's size.
    - `num_epochs`: stop after this many passes (None: endless; the trainer counts steps).
    - `prefetch`: batches prepared ahead in a background thread (0: none).
    """

    max_sequence_length: PositiveInt = 512
    batch_size: PositiveInt = 8
    packing: bool = True
    truncation_mode: Literal["keep_end", "keep_start"] = "keep_end"
    padding_side: Literal["left", "right"] = "right"
    long_records: Literal["truncate", "raise"] = "truncate"
    text_column: str = "text"
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    pairs: bool = False
    margin_column: str | None = None
    label_column: str | None = None
    max_images: NonNegativeInt = 0
    image_shape: tuple[int, ...] | None = None
    images_column: str = "images"
    bad_records: Literal["raise", "skip"] = "raise"
    completion_only_loss: bool = True
    assistant_only_loss: bool = True
    add_bos: bool = True
    add_eos: bool = True
    shuffle: bool = True
    seed: NonNegativeInt = 0
    shuffle_buffer_size: PositiveInt = 8192
    num_epochs: PositiveInt | None = None
    prefetch: NonNegativeInt = 2


START = {"epoch": 0, "shard_pos": 0, "block_cursor": 0, "block_record": 0, "row_pos": 0, "token_offset": 0}


class DataLoader:
    """A deterministic, resumable stream of fixed-shape batches (see the module docstring).
    `data`: anything `as_source` reads; `tokenizer`: a `transformers` tokenizer with a pad token;
    `config`: a `DataConfig`; `data_rank`/`data_ranks`: this stream's share;
    `state`: a position from `state_dict()` to continue from."""

    def __init__(
        self,
        data: Any,
        tokenizer,
        config: DataConfig,
        *,
        data_rank: int = 0,
        data_ranks: int = 1,
        state: dict | None = None,
    ):
        if not 0 <= data_rank < data_ranks:
            raise ValueError(f"data_rank {data_rank} must be in [0, {data_ranks})")
        self.tokenizer, self.config = tokenizer, config
        self.rank, self.ranks = data_rank, data_ranks
        self.processor = tokenizer if hasattr(tokenizer, "image_processor") else None  # a vision-language model's
        if self.processor is not None:
            self.tokenizer = tokenizer = tokenizer.tokenizer
        if config.max_images:
            if self.processor is None:
                raise ValueError(
                    f"max_images = {config.max_images}: images are read through transformers' processor "
                    "(jaxloom.data.load_model_processor); expected one in place of the tokenizer"
                )
            if config.packing or config.label_column:
                raise ValueError(
                    f"max_images = {config.max_images} needs packing=False (TRL does not pack images either) and "
                    "ordinary or preference records: each row holds one record and its images"
                )
            if not config.image_shape:
                raise ValueError("max_images given without image_shape (the processor's pixels per image)")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; load it with jaxloom.data.load_processor")
        self.mixture = data if isinstance(data, Mixture) else None
        parts = self.mixture.parts if self.mixture is not None else [data]
        if config.pairs and config.packing:
            raise ValueError("pairs=True needs packing=False: each row holds one preference pair, padded")
        if config.label_column and (config.packing or config.pairs):
            raise ValueError(
                f"label_column = {config.label_column!r} needs packing=False and pairs=False: each row holds one "
                "unpaired preference record, padded"
            )
        sources = [as_source(d) for d in parts]
        for source in sources:  # a malformed line is skipped (with a warning naming it) as a bad record is
            if config.bad_records == "skip" and getattr(source, "on_error", None) == "raise":
                source.on_error = "skip"
        self.streams = [_Stream(source, self) for source in sources]
        self._state = self._check_state(state) if state is not None else self._start_state()
        self._resumed = state is not None  # the first batch checks that the saved position still exists
        self._skipped_returned = (0, 0, 0)  # skipped, truncated records, tokens cut (see `truncated`)
        self._said_long = False  # the first record longer than a row is said in the log
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()

    @property
    def source(self) -> ShardedDataSource:
        """The source read (the first part's, for a mixture)."""
        return self.streams[0].source

    @property
    def shards(self) -> list[str]:
        """This rank's shards of the (first) source."""
        return self.streams[0].shards

    def _start_state(self) -> dict:
        if self.mixture is None:
            return dict(START)
        return {"components": [dict(START) for _ in self.streams], "tokens": [0] * len(self.streams)}

    @classmethod
    def for_mesh(cls, data, tokenizer, config: DataConfig, mesh, global_batch_size: int, **kw) -> DataLoader:
        """The loader of `data` for this process's rows of a global batch of `global_batch_size` on
        `mesh` (`config.batch_size` is replaced), its rows split over `data_axes` (default `DATA_AXES`);
        `tokenizer` as for `DataLoader`."""
        from jaxloom.mesh import DATA_AXES, local_batch_slice

        axes = kw.pop("data_axes", None)
        rows = local_batch_slice(mesh, global_batch_size, DATA_AXES if axes is None else tuple(axes))
        n = rows.stop - rows.start
        config = dataclasses.replace(config, batch_size=n)
        return cls(data, tokenizer, config, data_rank=rows.start // n, data_ranks=global_batch_size // n, **kw)

    def _check_state(self, state: dict) -> dict:
        if self.mixture is not None:
            ok = (
                isinstance(state, dict)
                and set(state) == {"components", "tokens"}
                and len(state["components"]) == len(state["tokens"]) == len(self.streams)
                and all(isinstance(t, int) and t >= 0 for t in state["tokens"])
            )
            if not ok:
                raise ValueError(
                    f"data iterator state {state!r:.300}; expected a mixture's position: "
                    f"{{'components': [{len(self.streams)} positions], 'tokens': [{len(self.streams)} ints]}}"
                )
            return {"components": [self._check_one(c) for c in state["components"]], "tokens": list(state["tokens"])}
        return self._check_one(state)

    @staticmethod
    def _check_one(state: dict) -> dict:
        if set(state) == set(START) - {"block_cursor", "block_record"}:
            raise ValueError(
                f"data position {state!r} was saved by jaxloom-data < 0.6, which read whole shards in another order; "
                "the streaming loader cannot continue it exactly (resume with jaxloom-data 0.5, or start a new run)"
            )
        if set(state) != set(START) or not all(isinstance(v, int) and v >= 0 for v in state.values()):
            raise ValueError(f"data iterator state {state!r}; expected non-negative ints for {sorted(START)}")
        return dict(state)

    # ---- state ------------------------------------------------------------------------------------
    @property
    def skipped(self) -> int:
        """Bad records skipped (`bad_records='skip'`) to make the batches returned so far (not those made
        ahead by the prefetch thread)."""
        return self._skipped_returned[0]

    @property
    def truncated(self) -> tuple[int, int]:
        """`(records, tokens)`: records longer than `max_sequence_length` in the batches returned so far, and the
        tokens cut off them. Unpacked rows keep `truncation_mode`'s end of such a record and drop the rest;
        packed rows split it over rows (no token dropped, but its later rows do not see its start)."""
        return self._skipped_returned[1], self._skipped_returned[2]

    def _skipped_now(self) -> tuple[int, int, int]:
        streams = self.streams
        return (
            sum(s.skipped for s in streams),
            sum(s.truncated for s in streams),
            sum(s.truncated_tokens for s in streams),
        )

    def state_dict(self) -> dict[str, int]:
        """The position after the last batch returned by `next()`: restoring it continues exactly there."""
        return json.loads(json.dumps(self._state))

    # ---- iteration --------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def start(self) -> DataLoader:
        """Start making batches in the background now (otherwise at the first `next()`)."""
        if self.config.prefetch > 0 and self._queue is None:
            self._queue = queue.Queue(maxsize=self.config.prefetch)
            threading.Thread(target=self._worker, args=(dict(self._state),), daemon=True).start()
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.config.prefetch <= 0:
            batch, self._state = self._produce(self._state)
            self._skipped_returned = self._skipped_now()
            return batch
        self.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._queue = None
            raise item
        batch, self._state, self._skipped_returned = item
        return batch

    def close(self) -> None:
        """Stop the prefetch thread."""
        self._stop.set()

    def _worker(self, state: dict) -> None:
        q = self._queue
        try:
            while not self._stop.is_set():
                batch, state = self._produce(state)
                q.put((batch, dict(state), self._skipped_now()))
        except BaseException as e:  # noqa: BLE001 — handed to the consumer
            q.put(e)

    # ---- batch making (pure function of the state) ---------------------------------------------------
    def _produce(self, state: dict) -> tuple[dict[str, np.ndarray], dict]:
        c = self.config
        b, length = c.batch_size, c.max_sequence_length * (2 if c.pairs else 1)
        out = {k: np.zeros((b, length), np.int32) for k in ("input_ids", "segment_ids", "positions", "loss_mask")}
        out["input_ids"][:] = self.tokenizer.pad_token_id
        if c.pairs and c.margin_column:
            out["margin"] = np.zeros((b, 1), np.float32)
        if c.label_column:
            out["label"] = np.zeros((b, 1), np.float32)
        if c.max_images:
            out["pixel_values"] = np.zeros((b, c.max_images, *(c.image_shape or ())), np.float32)
            out["token_type_ids"] = np.zeros((b, length), np.int32)
        mixed = self.mixture is not None
        states = state["components"] if mixed else [state]
        cursors = [_Cursor(stream, st) for stream, st in zip(self.streams, states, strict=True)]
        tokens = list(state["tokens"]) if mixed else [0]
        if self._resumed:
            for cursor in cursors:
                cursor.check_position()
            self._resumed = False
        try:
            for r in range(b):
                k = self.mixture.pick(tokens) if mixed else 0  # type: ignore[union-attr]
                if c.pairs:
                    self._pair_row(cursors[k], out, r)
                elif c.packing:
                    self._pack_row(cursors[k], out, r)
                else:
                    self._pad_row(cursors[k], out, r)
                tokens[k] += int(np.count_nonzero(out["segment_ids"][r]))
        except StopIteration:  # the last epoch ended: a final, partly padded batch, then the end
            if not out["segment_ids"].any():
                raise
        if mixed:
            return out, {"components": [cur.state for cur in cursors], "tokens": tokens}
        return out, cursors[0].state

    def _pack_row(self, cursor, out, r) -> None:
        length, filled, segment = self.config.max_sequence_length, 0, 0
        while filled < length:
            ids, mask, offset = cursor.current()
            if offset == 0 and len(ids) > length:  # a record longer than a row: split, its later rows without its start
                self._long_record(cursor, len(ids), 0)
            take = min(length - filled, len(ids) - offset)
            segment += 1
            sl = slice(filled, filled + take)
            out["input_ids"][r, sl] = ids[offset : offset + take]
            out["loss_mask"][r, sl] = mask[offset : offset + take]
            out["segment_ids"][r, sl] = segment
            out["positions"][r, sl] = np.arange(offset, offset + take)
            filled += take
            cursor.consume(take)

    def _pair_row(self, cursor, out, r) -> None:
        length = self.config.max_sequence_length
        ids, mask, _ = cursor.current()
        split = cursor.split
        for half, part in enumerate((slice(0, split), slice(split, len(ids)))):
            n = part.stop - part.start
            sl = slice(half * length, half * length + n)
            out["input_ids"][r, sl], out["loss_mask"][r, sl] = ids[part], mask[part]
            out["segment_ids"][r, sl], out["positions"][r, sl] = 1, np.arange(n)
            if "token_type_ids" in out:
                out["token_type_ids"][r, sl] = cursor.token_types[part]
        if "pixel_values" in out:
            out["pixel_values"][r, : len(cursor.pixels)] = cursor.pixels
        if "margin" in out:
            out["margin"][r, 0] = cursor.margin
        cursor.consume(len(ids) - cursor.state["token_offset"])

    def _long_record(self, cursor, n: int, cut: int) -> None:
        """Count a record of `n` tokens longer than a row (`cut` of them dropped); said once per loader."""
        stream = cursor.loader
        stream.truncated += 1
        stream.truncated_tokens += cut
        if not self._said_long:
            self._said_long = True
            c = self.config
            end = "last" if c.truncation_mode == "keep_end" else "first"
            what = (
                f"its {end} {n - cut} tokens are kept (truncation_mode {c.truncation_mode}), {cut} dropped"
                if cut
                else "it is split over rows, the later ones without its start"
            )
            log.log(  # cut: a warning; split over packed rows (pretraining's usual case): said, quietly
                logging.WARNING if cut else logging.INFO,
                "a record of %d tokens (%s) is longer than max_sequence_length %d: %s. Such records are counted "
                "(train/truncated_records, train/truncated_tokens, and the report); raise max_sequence_length (up "
                "to the model's max_position_embeddings) to keep them whole",
                n,
                cursor.where(),
                c.max_sequence_length,
                what,
            )

    def _pad_row(self, cursor, out, r) -> None:
        c, length = self.config, self.config.max_sequence_length
        ids, mask, _ = cursor.current()
        if len(ids) > length and c.max_images:
            raise ValueError(
                f"a record of {len(ids)} tokens with {len(cursor.pixels)} image(s) is longer than max_sequence_length "
                f"{length} (record {cursor.where()}): its image tokens are never cut; raise max_sequence_length or "
                "shorten the record"
            )
        if len(ids) > length:
            if c.long_records == "raise":
                raise ValueError(
                    f"a record of {len(ids)} tokens is longer than max_sequence_length {length} "
                    f"(record {cursor.where()}); set long_records='truncate' or raise the limit"
                )
            self._long_record(cursor, len(ids), len(ids) - length)
            keep = slice(len(ids) - length, None) if c.truncation_mode == "keep_end" else slice(0, length)
            ids, mask = ids[keep], mask[keep]
        n = len(ids)
        sl = slice(length - n, length) if c.padding_side == "left" else slice(0, n)
        out["input_ids"][r, sl], out["loss_mask"][r, sl] = ids, mask
        out["segment_ids"][r, sl], out["positions"][r, sl] = 1, np.arange(n)
        if "label" in out:
            out["label"][r, 0] = cursor.label
        if "pixel_values" in out:
            out["token_type_ids"][r, sl] = cursor.token_types
            out["pixel_values"][r, : len(cursor.pixels)] = cursor.pixels
        cursor.consume(len(cursor.current()[0]) - cursor.state["token_offset"])


def batch_tokenize(rows: list[dict], tokenizer, config: DataConfig) -> list[np.ndarray] | None:
    """Plain-text `rows` are tokenized in one batched call (in the prefetch thread), so training-time data
    work is slicing; None when some row is not plain text (those go record by record)."""
    column = config.text_column
    if (
        config.pairs
        or config.label_column
        or config.max_images
        or not rows
        or not all(
            set(r) & {column}
            and not (set(r) & {config.messages_column, config.prompt_column, "input_ids"})
            and isinstance(r[column], str)
            for r in rows
        )
    ):
        return None
    bos = [tokenizer.bos_token_id] if config.add_bos and tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if config.add_eos and tokenizer.eos_token_id is not None else []
    try:
        encoded = tokenizer([r[column] for r in rows], add_special_tokens=False)["input_ids"]
    except (TypeError, ValueError):  # a record it cannot take (a lone surrogate): record by record, named
        return None
    return [np.asarray(bos + ids + eos, np.int32) for ids in encoded]


PRECHECK_BYTES = 32 * 2**20
"""`first_bad_record` reads local JSONL data of at most this many bytes whole (about a second of JSON parsing)."""


def first_bad_record(data: Any, config: DataConfig, max_bytes: int = PRECHECK_BYTES) -> str | None:
    """The first record, in file order, that would stop a run reading `data` under `config` (a malformed line,
    a missing column, a column that holds no text) as `file:line: what is wrong; the way past it`, or None.
    Read only where it costs little: local JSONL files of at most `max_bytes` in all (a mixture's parts
    added up); other data (larger, on a store, Parquet, datasets, token stores, preference pairs) is checked
    as it streams, where the same error names the same line."""
    parts = data.parts if isinstance(data, Mixture) else [data]
    try:
        sources = [as_source(d) for d in parts]
    except (ValueError, TypeError, OSError):
        return None  # refused where the loader opens it, with its own message
    files = [f for s in sources if isinstance(s, JsonlSource) for f in s.shard_names]
    if config.pairs or config.label_column or not files or any(not isinstance(s, JsonlSource) for s in sources):
        return None
    if any("://" in f for f in files) or sum(os.path.getsize(f) for f in files) > max_bytes:
        return None
    for source in sources:
        for name in source.shard_names:
            start = 0
            try:
                for record, end in source.open_shard(name, 0):
                    try:
                        check_record(record, config)
                    except ValueError as e:
                        return f"{source.describe(name, start)}: {e}; {SKIP_HINT}"
                    start = end
            except ValueError as e:  # a malformed line: its message names it, with the way past it
                return str(e)
    return None


class Mixture:
    """Several datasets read as one, each contributing `weight` of the training tokens.

    `parts`: `[(data, weight), ...]` or `[{"path": data, "weight": w}, ...]`, each `data` anything
    `as_source` reads. Each row is filled from one part: the one whose share of the tokens so far is
    furthest below its weight, so the realised shares follow the weights within one row at any step,
    deterministically, and a resume continues exactly (the position holds each part's position and
    token count). Token counts per part are in the loader's position (`state_dict()["tokens"]`).
    """

    def __init__(self, parts: Sequence[Any]):
        items = [
            (p.get("path", p.get("data")), p.get("weight", 1.0)) if isinstance(p, dict) else tuple(p) for p in parts
        ]
        if not items:
            raise ValueError("a data mixture needs at least one part; expected [{path, weight}, ...]")
        for i, (data, weight) in enumerate(items):
            if data is None:
                raise ValueError(f"mixture part {i} has no path; expected {{'path': ..., 'weight': ...}}")
            if (
                not isinstance(weight, int | float)
                or isinstance(weight, bool)
                or not weight >= 0
                or weight == float("inf")
            ):
                raise ValueError(f"mixture part {i} ({data}) has weight {weight!r}; expected a finite number >= 0")
        total = sum(w for _, w in items)
        if total <= 0:
            raise ValueError(f"mixture weights {[w for _, w in items]} sum to {total}; expected a positive sum")
        self.parts = [d for d, _ in items]
        self.weights = np.asarray([w / total for _, w in items], np.float64)

    def pick(self, tokens: Sequence[int]) -> int:
        """The part the next row comes from, given the tokens each part has given so far."""
        t = np.asarray(tokens, np.float64)
        live = self.weights > 0
        deficit = np.where(live, self.weights * (t.sum() + 1) - t, -np.inf)
        return int(np.argmax(deficit))


class _Stream:
    """One source as this rank reads it: its shards (whole shards per rank, or every `ranks`-th record of
    each), and what is kept across batches: the current block and the open stream of its shard."""

    def __init__(self, source: ShardedDataSource, loader: DataLoader):
        self.source, self.tokenizer, self.config = source, loader.tokenizer, loader.config
        self.processor = loader.processor
        self.rank, self.ranks = loader.rank, loader.ranks
        check = getattr(source, "check", None)  # a token store: made with this tokenizer and BOS/EOS?
        if check is not None:
            check(loader.tokenizer, loader.config)
        shards = list(source.shard_names)
        if not shards:
            raise ValueError("the dataset has no shards")
        if len(shards) % self.ranks == 0:  # whole shards per rank
            self.shards, self.row_stride = shards[self.rank :: self.ranks], 1
        else:  # every rank reads every shard and keeps every ranks-th record
            self.shards, self.row_stride = shards, self.ranks
        self._block_memo: _Block | None = None
        self._stream_memo: tuple = (None, None)
        self.skipped = 0  # bad records skipped (bad_records='skip')
        self.truncated = 0  # records longer than a row: cut (unpacked) or split over rows (packed)
        self.truncated_tokens = 0  # tokens of those records cut off (unpacked rows)


TOKENIZE_CHUNK = 256  # plain-text records tokenized per call, in visiting order, when first needed


class _Block:
    """Up to `shuffle_buffer_size` records of one shard read from a cursor, in a seeded order. Plain text
    is tokenized `TOKENIZE_CHUNK` records at a time in visiting order, when first needed: the first
    batch waits for one chunk, not for the whole block, and no tokenizer output for the whole block
    is ever held at once."""

    def __init__(self, key, records, starts, order, end, next_record, last):
        self.key, self.records, self.starts, self.order = key, records, starts, order
        self.end, self.next_record, self.last = end, next_record, last
        self.tokens: dict[int, np.ndarray] = {}  # record index → ids (plain text, tokenized in chunks)
        self.plain: dict[int, bool] = {}  # chunk → whether it was plain text (tokenized together)

    def plain_ids(self, row_pos: int, tokenizer, config) -> np.ndarray | None:
        """The ids of the record visited at `row_pos` when its chunk is plain text, else None."""
        chunk = row_pos // TOKENIZE_CHUNK
        if chunk not in self.plain:
            positions = range(chunk * TOKENIZE_CHUNK, min(len(self.order), (chunk + 1) * TOKENIZE_CHUNK))
            indices = [int(self.order[p]) for p in positions]
            ids = batch_tokenize([self.records[i] for i in indices], tokenizer, config)
            self.plain[chunk] = ids is not None
            if ids is not None:
                self.tokens.update(zip(indices, ids, strict=True))
            for done in [c for c in self.plain if c < chunk]:  # visited: free their tokens
                for p in range(done * TOKENIZE_CHUNK, min(len(self.order), (done + 1) * TOKENIZE_CHUNK)):
                    self.tokens.pop(int(self.order[p]), None)
        return self.tokens.get(int(self.order[row_pos])) if self.plain[chunk] else None


class _Cursor:
    """Walks records from a state. The current block (records, order, tokens) and the open stream of its
    shard are kept on the loader across batches: each record is read and tokenized once, and a shard is
    opened once per pass (a resume opens it at the saved cursor)."""

    def __init__(self, loader: _Stream, state: dict):
        self.loader, self.state = loader, dict(state)
        self._block: _Block | None = loader._block_memo
        self._tokens_key = None
        self.split = 0  # pairs: where the rejected sequence starts in the current record's ids
        self.margin = 0.0  # pairs with a margin column: the current record's margin
        self.label = 0.0  # unpaired preference records: the current record's label
        self.token_types = np.zeros(0, np.int32)  # a vision-language model's rows: the record's token types
        self.pixels = np.zeros(0, np.float32)  # and its images' pixels

    def check_position(self) -> None:
        """A restored position must still exist: a dataset that shrank since it was saved would otherwise
        be skipped past silently (into the next shard or epoch), and the run would not be the one resumed."""
        s, shards = self.state, self.loader.shards
        if s["shard_pos"] >= len(shards):
            raise ValueError(
                f"the dataset changed since this data position was saved: it has {len(shards)} shard(s) for data "
                f"rank {self.loader.rank}, the position is in shard {s['shard_pos'] + 1}; expected the data the run "
                "was started with (resume with that data, or start a new run)"
            )
        block = self._load_block()
        if s["row_pos"] > len(block.records):
            raise ValueError(
                f"the dataset changed since this data position was saved: shard {block.key[2]} has "
                f"{len(block.records)} record(s) for data rank {self.loader.rank} from cursor {s['block_cursor']}, "
                f"the position is after record {s['row_pos']}; "
                "expected the data the run was started with (resume with that data, or start a new run)"
            )

    def _order(self, epoch: int) -> list[str]:
        shards = list(self.loader.shards)
        if self.loader.config.shuffle:
            rng = np.random.default_rng([self.loader.config.seed, epoch, 0x5A])
            shards = [shards[i] for i in rng.permutation(len(shards))]
        return shards

    def _load_block(self) -> _Block:
        s, loader = self.state, self.loader
        name = self._order(s["epoch"])[s["shard_pos"]]
        key = (s["epoch"], s["shard_pos"], name, s["block_cursor"])
        if self._block is not None and self._block.key == key:
            return self._block
        c, stride, rank = loader.config, loader.row_stride, loader.rank
        stream_key, stream = loader._stream_memo
        if stream_key != key:
            stream = iter_shard(loader.source, name, s["block_cursor"])
        records, starts, pos, index, last = [], [], s["block_cursor"], s["block_record"], True
        for record, after in stream:
            if index % stride == rank % stride:
                records.append(record)
                starts.append(pos)
            index, pos = index + 1, after
            if len(records) == c.shuffle_buffer_size:
                last = False
                break
        order = np.arange(len(records))
        if c.shuffle:
            idx = loader.shards.index(name)
            seed = [c.seed, s["epoch"], idx + 1] + ([s["block_record"]] if s["block_record"] else [])
            order = np.random.default_rng(seed).permutation(len(records))
        self._block = _Block(key, records, starts, order, pos, index, last)
        next_key = (s["epoch"], s["shard_pos"], name, pos)
        loader._stream_memo = (next_key, stream) if not last else (None, None)
        loader._block_memo = self._block
        return self._block

    def _advance(self, block: _Block) -> None:
        """Past the end of `block`: the next block of the shard, or the next shard (and epoch)."""
        s = self.state
        if not block.last and block.records:
            s.update(block_cursor=block.end, block_record=block.next_record, row_pos=0, token_offset=0)
            return
        s.update(shard_pos=s["shard_pos"] + 1, block_cursor=0, block_record=0, row_pos=0, token_offset=0)
        if s["shard_pos"] >= len(self.loader.shards):
            s.update(shard_pos=0, epoch=s["epoch"] + 1)

    def current(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The record at the position (its ids, mask, and the tokens of it already used); records with no
        tokens (and skipped bad ones) are stepped over."""
        while True:
            found = self._current_once()
            if found is not None:
                return found
            self.state.update(row_pos=self.state["row_pos"] + 1, token_offset=0)

    def _current_once(self) -> tuple[np.ndarray, np.ndarray, int] | None:
        epochs = self.loader.config.num_epochs
        seen_empty = 0
        while True:
            if epochs is not None and self.state["epoch"] >= epochs:
                raise StopIteration
            block = self._load_block()
            if self.state["row_pos"] < len(block.records):
                break
            seen_empty = seen_empty + 1 if not block.records and self.state["block_cursor"] == 0 else 0
            if seen_empty > len(self.loader.shards):
                names = [str(n) for n in self.loader.shards]
                raise ValueError(
                    f"the dataset is empty: no records in its {len(names)} shard(s) "
                    f"({', '.join(names[:3])}{' …' if len(names) > 3 else ''}) "
                    f"for data rank {self.loader.rank} of {self.loader.ranks}"
                )
            self._advance(block)
        key = (block.key, self.state["row_pos"])
        if key != self._tokens_key:
            index = int(block.order[self.state["row_pos"]])
            plain = block.plain_ids(self.state["row_pos"], self.loader.tokenizer, self.loader.config)
            if plain is not None:
                self._ids = plain
                self._mask = np.ones(len(self._ids), np.int32)
            else:
                try:
                    self._ids, self._mask = self._tokenize(block.records[index])
                except (ValueError, TypeError) as e:
                    if self.loader.config.bad_records == "raise":
                        raise ValueError(f"{self.where()}: {e}; {SKIP_HINT}") from None
                    log.debug("skipped bad record %s: %s", self.where(), e)
                    self.loader.skipped += 1
                    self._ids, self._mask = np.zeros(0, np.int32), np.zeros(0, np.int32)  # skipped below
            self._tokens_key = key
        if len(self._ids) == 0:
            return None
        return self._ids, self._mask, self.state["token_offset"]

    def _tokenize(self, record: dict) -> tuple[np.ndarray, np.ndarray]:
        tokenizer, config = self.loader.tokenizer, self.loader.config
        if config.max_images:
            if not isinstance(record, dict):
                raise ValueError(f"a record must be an object, got {type(record).__name__}")
            if config.pairs:
                ci, cm, ri, rm, ct, rt, self.pixels = tokenize_image_pair(record, self.loader.processor, config)
                self.split, self.margin = len(ci), _margin(record, config.margin_column)
                ids, mask, self.token_types = (
                    np.concatenate([ci, ri]),
                    np.concatenate([cm, rm]),
                    np.concatenate([ct, rt]),
                )
            else:
                ids, mask, self.token_types, self.pixels = tokenize_image_record(record, self.loader.processor, config)
            if len(self.pixels) and tuple(self.pixels.shape[1:]) != tuple(config.image_shape or ()):
                raise ValueError(
                    f"the processor made images of shape {list(self.pixels.shape[1:])}; the model reads "
                    f"{list(config.image_shape or ())} (its image processor's size and the model's disagree)"
                )
            return ids, mask
        if config.label_column:
            ids, mask, self.label = tokenize_labelled(record, tokenizer, config)
            return ids, mask
        if not config.pairs:
            return tokenize_record(record, tokenizer, config)
        if not isinstance(record, dict):
            raise ValueError(f"a preference record must be an object, got {type(record).__name__}")
        chosen, chosen_mask, rejected, rejected_mask = tokenize_pair(record, tokenizer, config)
        self.split, self.margin = len(chosen), _margin(record, config.margin_column)
        return np.concatenate([chosen, rejected]), np.concatenate([chosen_mask, rejected_mask])

    def consume(self, n: int) -> None:
        self.state["token_offset"] += n
        if self.state["token_offset"] >= len(self._ids):
            self.state.update(row_pos=self.state["row_pos"] + 1, token_offset=0)

    def where(self) -> str:
        """Where the current record comes from: `file:line` for JSONL and text, else `shard record N`."""
        block = self._load_block()
        index = int(block.order[self.state["row_pos"]])
        return describe(self.loader.source, block.key[2], block.starts[index])


def _margin(record: dict, column: str | None) -> float:
    """A preference record's `column` as a finite float (0 when the record has none, or no column is read)."""
    if column is None or record.get(column) is None:
        return 0.0
    value = record[column]
    try:
        margin = float(value)
    except (TypeError, ValueError):
        margin = math.nan
    if isinstance(value, bool) or not math.isfinite(margin):
        raise ValueError(f"{column} = {value!r}; expected a finite number (how far chosen should score above rejected)")
    return margin
