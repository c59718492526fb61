"""`DataLoader`: a deterministic, resumable stream of fixed-shape batches for one process.

Order: per epoch, the process's shards are visited in a seeded order and each shard's records in a
seeded order. The position is `{"epoch", "shard_pos", "row_pos", "token_offset"}` — a small JSON
object. Restoring it recomputes one permutation and re-tokenizes at most one record: nothing before
the position is read again. Batches are numpy dicts: `input_ids`, `segment_ids` (0 = padding; one id
per document within a packed row), `positions`, `loss_mask`, each `[batch_size, max_sequence_length]`.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Any, Literal

import numpy as np

from jaxloom.mesh.schema import NonNegativeInt, PositiveInt, config

from .sources import ShardedDataSource, as_source
from .tokenize import tokenize_record

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
    - `text_column`, `messages_column`, `prompt_column`, `completion_column`: the record fields read for plain
      text, chat messages, and prompt/completion pairs.
    - `add_bos`, `add_eos`: put the tokenizer's bos/eos tokens around every document.
    - `shuffle`, `seed`: shuffle shards and records each epoch, deterministically from `seed`.
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
    add_bos: bool = True
    add_eos: bool = True
    shuffle: bool = True
    seed: NonNegativeInt = 0
    num_epochs: PositiveInt | None = None
    prefetch: NonNegativeInt = 2


START = {"epoch": 0, "shard_pos": 0, "row_pos": 0, "token_offset": 0}


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
        self.source: ShardedDataSource = as_source(data)
        self.tokenizer, self.config = tokenizer, config
        self.rank, self.ranks = data_rank, data_ranks
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; load it with jaxloom.data.load_processor")
        shards = list(self.source.shard_names)
        if not shards:
            raise ValueError("the dataset has no shards")
        if len(shards) % data_ranks == 0:  # whole shards per rank
            self.shards, self.row_stride = shards[data_rank::data_ranks], 1
        else:  # every rank reads every shard and keeps every data_ranks-th record
            self.shards, self.row_stride = shards, data_ranks
        self._state = dict(START if state is None else self._check_state(state))
        self._resumed = state is not None  # the first batch checks that the saved position still exists
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._shard_memo: tuple = (None, None, None, None, None)

    @classmethod
    def for_mesh(cls, data, tokenizer, config: DataConfig, mesh, global_batch_size: int, **kw) -> DataLoader:
        """The loader of `data` for this process's rows of a global batch of `global_batch_size` on
        `mesh` (`config.batch_size` is replaced); `tokenizer` as for `DataLoader`."""
        from jaxloom.mesh import local_batch_slice

        rows = local_batch_slice(mesh, global_batch_size)
        n = rows.stop - rows.start
        config = dataclasses.replace(config, batch_size=n)
        return cls(data, tokenizer, config, data_rank=rows.start // n, data_ranks=global_batch_size // n, **kw)

    @staticmethod
    def _check_state(state: dict) -> dict:
        if set(state) != set(START) or not all(isinstance(v, int) and v >= 0 for v in state.values()):
            raise ValueError(f"data iterator state {state!r}; expected non-negative ints for {sorted(START)}")
        return state

    # ---- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """The position after the last batch returned by `next()`: restoring it continues exactly there."""
        return dict(self._state)

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
            return batch
        self.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._queue = None
            raise item
        batch, self._state = item
        return batch

    def close(self) -> None:
        """Stop the prefetch thread."""
        self._stop.set()

    def _worker(self, state: dict) -> None:
        q = self._queue
        try:
            while not self._stop.is_set():
                batch, state = self._produce(state)
                q.put((batch, dict(state)))
        except BaseException as e:  # noqa: BLE001 — handed to the consumer
            q.put(e)

    # ---- batch making (pure function of the state) ---------------------------------------------------
    def _produce(self, state: dict) -> tuple[dict[str, np.ndarray], dict]:
        c = self.config
        b, length = c.batch_size, c.max_sequence_length
        out = {k: np.zeros((b, length), np.int32) for k in ("input_ids", "segment_ids", "positions", "loss_mask")}
        out["input_ids"][:] = self.tokenizer.pad_token_id
        cursor = _Cursor(self, state)
        if self._resumed:
            cursor.check_position()
            self._resumed = False
        try:
            for r in range(b):
                if c.packing:
                    self._pack_row(cursor, out, r)
                else:
                    self._pad_row(cursor, out, r)
        except StopIteration:  # the last epoch ended: a final, partly padded batch, then the end
            if not out["segment_ids"].any():
                raise
        return out, cursor.state

    def _pack_row(self, cursor, out, r) -> None:
        length, filled, segment = self.config.max_sequence_length, 0, 0
        while filled < length:
            ids, mask, offset = cursor.current()
            take = min(length - filled, len(ids) - offset)
            segment += 1
            sl = slice(filled, filled + take)
            out["input_ids"][r, sl] = ids[offset : offset + take]
            out["loss_mask"][r, sl] = mask[offset : offset + take]
            out["segment_ids"][r, sl] = segment
            out["positions"][r, sl] = np.arange(offset, offset + take)
            filled += take
            cursor.consume(take)

    def _pad_row(self, cursor, out, r) -> None:
        c, length = self.config, self.config.max_sequence_length
        ids, mask, _ = cursor.current()
        if len(ids) > length:
            if c.long_records == "raise":
                raise ValueError(
                    f"a record of {len(ids)} tokens is longer than max_sequence_length {length} "
                    f"(record {cursor.where()}); set long_records='truncate' or raise the limit"
                )
            keep = slice(len(ids) - length, None) if c.truncation_mode == "keep_end" else slice(0, length)
            ids, mask = ids[keep], mask[keep]
        n = len(ids)
        sl = slice(length - n, length) if c.padding_side == "left" else slice(0, n)
        out["input_ids"][r, sl], out["loss_mask"][r, sl] = ids, mask
        out["segment_ids"][r, sl], out["positions"][r, sl] = 1, np.arange(n)
        cursor.consume(len(cursor.current()[0]) - cursor.state["token_offset"])


def _batch_tokenize(rows: list[dict], tokenizer, config: DataConfig) -> list[np.ndarray] | None:
    """Plain-text shards are tokenized in one batched call when loaded (in the prefetch thread), so
    training-time data work is slicing. Other record kinds go record by record."""
    column = config.text_column
    if not rows or not all(
        set(r) & {column}
        and not (set(r) & {config.messages_column, config.prompt_column})
        and isinstance(r[column], str)
        for r in rows
    ):
        return None
    bos = [tokenizer.bos_token_id] if config.add_bos and tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if config.add_eos and tokenizer.eos_token_id is not None else []
    encoded = tokenizer([r[column] for r in rows], add_special_tokens=False)["input_ids"]
    return [np.asarray(bos + ids + eos, np.int32) for ids in encoded]


class _Cursor:
    """Walks records from a state; caches the current shard's records and order and the current record's tokens."""

    def __init__(self, loader: DataLoader, state: dict):
        self.loader, self.state = loader, dict(state)
        # The current shard (records, order, tokens) is kept on the loader across batches: reading and
        # tokenizing a shard happens once per shard, not once per batch.
        self._shard_key, self._rows, self._perm, self._name, self._tokens = loader._shard_memo
        self._tokens_key = None

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
        rows = self._load_shard()
        if s["row_pos"] > len(rows):
            raise ValueError(
                f"the dataset changed since this data position was saved: shard {self._name} has {len(rows)} "
                f"record(s) for data rank {self.loader.rank}, the position is after record {s['row_pos']}; "
                "expected the data the run was started with (resume with that data, or start a new run)"
            )

    def _order(self, epoch: int) -> list[str]:
        shards = list(self.loader.shards)
        if self.loader.config.shuffle:
            rng = np.random.default_rng([self.loader.config.seed, epoch, 0x5A])
            shards = [shards[i] for i in rng.permutation(len(shards))]
        return shards

    def _load_shard(self):
        key = (self.state["epoch"], self.state["shard_pos"])
        if key != self._shard_key:
            name = self._order(self.state["epoch"])[self.state["shard_pos"]]
            rows = (
                self.loader.source.read_shard(name)[self.loader.rank :: self.loader.row_stride]
                if self.loader.row_stride > 1
                else self.loader.source.read_shard(name)
            )
            order = np.arange(len(rows))
            if self.loader.config.shuffle:
                idx = self.loader.shards.index(name)
                rng = np.random.default_rng([self.loader.config.seed, self.state["epoch"], idx + 1])
                order = rng.permutation(len(rows))
            self._rows, self._perm, self._name, self._shard_key = rows, order, name, key
            self._tokens = _batch_tokenize(rows, self.loader.tokenizer, self.loader.config)
            self.loader._shard_memo = (key, rows, order, name, self._tokens)
        return self._rows

    def current(self) -> tuple[np.ndarray, np.ndarray, int]:
        epochs = self.loader.config.num_epochs
        if epochs is not None and self.state["epoch"] >= epochs:
            raise StopIteration
        seen_empty = 0
        while True:
            rows = self._load_shard()
            if self.state["row_pos"] < len(rows):
                break
            self.state.update(row_pos=0, token_offset=0, shard_pos=self.state["shard_pos"] + 1)
            seen_empty = seen_empty + 1 if not rows else 0
            if self.state["shard_pos"] >= len(self.loader.shards):
                self.state.update(shard_pos=0, epoch=self.state["epoch"] + 1)
                if epochs is not None and self.state["epoch"] >= epochs:
                    raise StopIteration
            if seen_empty > len(self.loader.shards):
                raise ValueError(
                    f"the dataset is empty: no records in its {len(self.loader.shards)} shard(s) "
                    f"for data rank {self.loader.rank} of {self.loader.ranks}"
                )
        key = (self._shard_key, self.state["row_pos"])
        if key != self._tokens_key:
            index = int(self._perm[self.state["row_pos"]])
            if self._tokens is not None:
                self._ids = self._tokens[index]
                self._mask = np.ones(len(self._ids), np.int32)
            else:
                try:
                    self._ids, self._mask = tokenize_record(rows[index], self.loader.tokenizer, self.loader.config)
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{self.where()}: {e}") from None
            self._tokens_key = key
        if len(self._ids) == 0:
            self.state.update(row_pos=self.state["row_pos"] + 1, token_offset=0)
            return self.current()
        return self._ids, self._mask, self.state["token_offset"]

    def consume(self, n: int) -> None:
        self.state["token_offset"] += n
        if self.state["token_offset"] >= len(self._ids):
            self.state.update(row_pos=self.state["row_pos"] + 1, token_offset=0)

    def where(self) -> str:
        """Where the current record comes from: `file:line` for JSONL, else `shard record N`."""
        index = int(self._perm[self.state["row_pos"]])
        if self.loader.row_stride > 1:
            index = self.loader.rank + index * self.loader.row_stride
        line = getattr(self.loader.source, "line_of", lambda *_: None)(self._name, index)
        return f"{self._name}:{line}" if line is not None else f"{self._name} record {index}"
