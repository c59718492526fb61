"""The data of a run: this process's training and evaluation loaders, and how their rows become the
global on-device batches the steps take.

A trainer kind says what its rows are with a `DataSpec` (row width, loader settings, the batch's arrays,
and `extend(local, batch, training)` for arrays it adds, such as a reference model's log-probs): the
public extension point. `Batches` does the rest, for any kind:

    batches = Batches(arguments, DataSpec.tokens(arguments), mesh=mesh, data_axes=("fsdp",),
                      tokenizer=lambda: tok, dataset_train=train, dataset_eval=evaluation)
    loader = batches.train_loader()           # started at a restored position with state=...
    batch = batches.global_batch(next(loader))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import jaxloom.data as jd

from .step import STOP_KEY


def per_token(shape: tuple[int, ...], row_width: int, width: int) -> tuple[int, ...]:
    """An extra's trailing `shape` for rows of `width` tokens: a per-token extra (`(row_width, ...)`: GRPO's
    log-probs, an MoE sampler's experts per token) follows the row's width; any other keeps its shape."""
    return (width, *shape[1:]) if shape[:1] == (row_width,) else shape


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What a trainer kind reads and feeds its step: `row_width` token columns per batch row, the
    `jaxloom.data.DataConfig` fields of its loaders (`settings`), extra arrays of the step's batch
    (`extra`: `{key: (trailing shape per row, dtype)}`, made by `extend` or read per row by the loaders, as a
    preference record's `margin`), and `extend(local, batch,
    training) -> batch`, called on every global batch (`local`: this process's rows as numpy arrays;
    `training`: a train batch `[A, B, ...]` rather than an evaluation one `[B, ...]`); the arrays it adds are laid
    out like the token arrays (`batch["input_ids"].sharding`: rows over the data axes). `processor`: a callable
    giving transformers' processor that reads the rows' images (a vision-language model's: `with_images`), which
    the loaders take in place of the tokenizer."""

    row_width: int
    settings: dict[str, Any]
    extra: dict[str, tuple[tuple[int, ...], Any]] = dataclasses.field(default_factory=dict)
    extend: Callable[[dict, dict, bool], dict] | None = None
    processor: Callable[[], Any] | None = None

    TOKEN_KEYS = ("input_ids", "segment_ids", "positions", "loss_mask")

    @classmethod
    def tokens(cls, arguments: Any, **changes: Any) -> DataSpec:
        """Next-token rows of `max_sequence_length` tokens, with the arguments' packing, truncation and
        shuffling; `changes` replace spec fields or (as `settings=`) add loader settings."""
        a = arguments
        settings = dict(
            max_sequence_length=a.max_sequence_length,
            packing=a.packing,
            truncation_mode=a.truncation_mode,
            shuffle=a.shuffle_train_dataset,
            completion_only_loss=a.completion_only_loss,
            assistant_only_loss=a.assistant_only_loss,
            shuffle_buffer_size=a.shuffle_buffer_size,
            seed=a.seed,
            bad_records="skip" if a.skip_bad_records else "raise",
        )
        settings.update(changes.pop("settings", {}))
        return cls(row_width=changes.pop("row_width", a.max_sequence_length), settings=settings, **changes)

    def with_images(self, model: Any, images: int, processor: Callable[[], Any]) -> DataSpec:
        """The same spec for `model`, a vision-language model (it has an `image_shape`): each row one record and
        up to `images` images, read by `processor()` (transformers'); the step's batch gains `pixel_values` and
        `token_type_ids` (`step.MODEL_INPUTS`)."""
        if self.settings.get("packing"):
            raise ValueError(
                f"packing = true: {type(model).__name__}'s rows hold images, which are not packed (TRL packs none "
                "either); set packing = false"
            )
        shape = tuple(model.image_shape)
        settings = {**self.settings, "max_images": images, "image_shape": shape}
        extra = {
            **self.extra,
            "pixel_values": ((images, *shape), np.float32),
            "token_type_ids": ((self.row_width,), np.int32),
        }
        return dataclasses.replace(self, settings=settings, extra=extra, processor=processor)

    def with_width(self, width: int) -> DataSpec:
        """The same spec for rows of `width` tokens (per-token extras, whose trailing shape is the row's
        width, follow): for a kind whose rows are as wide as each step's data (GRPO's bucketed rollouts)."""
        extra = {k: (per_token(shape, self.row_width, width), dt) for k, (shape, dt) in self.extra.items()}
        return dataclasses.replace(self, row_width=width, extra=extra)

    def batch_spec(self, accumulation: int, rows: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        """`{key: (shape, dtype)}` of a train batch of `rows` global rows per micro-batch, accumulation
        axis first: what the step is compiled for."""
        spec: dict[str, tuple[tuple[int, ...], Any]] = {
            k: ((accumulation, rows, self.row_width), np.int32) for k in self.TOKEN_KEYS
        }
        spec.update({k: ((accumulation, rows, *shape), dtype) for k, (shape, dtype) in self.extra.items()})
        return spec


class Batches:
    """Loaders over the mesh's data-parallel shards (one stream per shard, so the data depends on the
    data-parallel size only, not on how many processes share it) and global batches from their rows.
    `tokenizer` is a callable giving the tokenizer (it may load on first use); `collator(batch)` edits
    this process's training rows before they go to the device."""

    def __init__(
        self,
        arguments: Any,
        spec: DataSpec,
        *,
        mesh,
        data_axes: tuple[str, ...],
        tokenizer: Callable[[], Any],
        dataset_train: Any,
        dataset_eval: Any = None,
        collator: Callable | None = None,
    ):
        self.arguments, self.spec, self.mesh, self.data_axes = arguments, spec, mesh, data_axes
        self.tokenizer, self.collator = tokenizer, collator
        self.dataset_train, self.dataset_eval = dataset_train, dataset_eval
        axes = data_axes or None
        self.sharding = NamedSharding(mesh, PartitionSpec(None, axes))
        self.eval_sharding = NamedSharding(mesh, PartitionSpec(axes))
        self.train: jd.MeshLoader | None = None
        self.resume_state: Any = None  # the data position a restored checkpoint handed over

    # ---- loaders ----------------------------------------------------------------------------------
    def loader(self, data, *, global_rows=None, state=None, **overrides) -> jd.MeshLoader:
        """This process's rows of global batches of `data` (default: `total_batch_size` rows, the
        arguments' accumulation), `overrides` replacing `DataConfig` fields."""
        a = self.arguments
        accum = overrides.pop("accumulation", a.gradient_accumulation_steps)
        cfg = jd.DataConfig(**{**self.spec.settings, **overrides})
        return jd.MeshLoader(
            data,
            self.tokenizer() if self.spec.processor is None else self.spec.processor(),
            cfg,
            self.mesh,
            global_rows or a.total_batch_size,
            accumulation=accum,
            state=state,
            data_axes=self.data_axes,
        )

    # ---- checkpoint state (`checkpointing.Stateful`) -------------------------------------------------------
    def checkpoint_state(self) -> Any:
        """The training loader's global data position, saved with each checkpoint."""
        return self.train.global_state_dict() if self.train is not None else None

    def load_checkpoint_state(self, state: Any) -> None:
        """Continue from `state` (a restored checkpoint's data position): the training loader starts there."""
        self.resume_state = state

    def train_loader(self, state: Any = None) -> jd.MeshLoader:
        """The training loader (made once), from the data position `state` (default: the one a restored
        checkpoint handed over), started: its first batches are made while the step compiles."""
        state = self.resume_state if state is None else state
        if self.train is None:
            self.train = self.loader(self.dataset_train, state=state)
            self.train.start()
        return self.train

    def eval_loader(self) -> jd.MeshLoader | None:
        """A new pass over `dataset_eval` (not started), or None without evaluation data."""
        if self.dataset_eval is None:
            return None
        return self.loader(
            self.dataset_eval,
            global_rows=self.arguments.eval_batch_size,
            accumulation=1,
            num_epochs=1,
            shuffle=False,
            prefetch=0,
        )

    def steps_for_epochs(self) -> int:
        """Optimizer steps in `num_train_epochs` passes, counted by running the loader over one epoch."""
        loader = self.loader(self.dataset_train, num_epochs=1, shuffle=False, prefetch=0)
        batches = sum(1 for _ in loader)
        if batches == 0:
            raise ValueError("dataset_train is empty")
        return max(1, batches * self.arguments.num_train_epochs)

    def close(self) -> None:
        if self.train is not None:
            self.train.close()

    # ---- checks before step 1 ---------------------------------------------------------------------
    def check_vocab(self, vocab_size: int) -> None:
        """Every token id the tokenizer can produce has a row in the model's embedding (a larger id
        would be clamped by the gather: a silently wrong model, NaN soon after)."""
        n = len(self.tokenizer())
        if n > vocab_size:
            raise ValueError(
                f"the tokenizer has {n} tokens but the model's vocab_size is {vocab_size}; expected "
                f"vocab_size >= {n}: a pretrained model's tokenizer is its own (data.tokenizer=MODEL_DIR, the default "
                "with model.from_pretrained); a new model's vocabulary is set with model.vocab_size"
            )

    def check_train_data(self) -> None:
        """Small local training files are read whole now (`jaxloom.data.first_bad_record`): a record that
        would stop the run at step N stops it before step 1, naming its file and line and the way past it
        (`skip_bad_records=true`, which skips and counts such records instead)."""
        if self.arguments.skip_bad_records:
            return
        bad = jd.first_bad_record(self.dataset_train, jd.DataConfig(**self.spec.settings))
        if bad is not None:
            raise ValueError(bad)

    def check_eval_data(self) -> None:
        """The first evaluation batch is read and tokenized now: a bad evaluation file fails before the
        first step, not at the first evaluation after training steps that would then be lost."""
        loader = self.eval_loader()
        if loader is None:
            return
        try:
            first = next(iter(loader), None)
        except (ValueError, TypeError, KeyError, OSError) as e:
            e.add_note("jaxloom: while reading the first batch of the evaluation data (dataset_eval), before training")
            raise
        if first is None:
            raise ValueError(
                f"dataset_eval gives no batch of evaluation_batch_size = {self.arguments.eval_batch_size} rows; "
                "expected at least one (add evaluation records, lower the batch size, or drop dataset_eval)"
            )

    # ---- global batches ---------------------------------------------------------------------------
    def data_shards(self) -> int:
        """How many ways the batch rows are split over the mesh (the data-parallel size)."""
        a = self.arguments
        rows = a.total_batch_size
        shape = (a.gradient_accumulation_steps, rows, self.spec.row_width)
        return max(1, rows // self.sharding.shard_shape(shape)[1])

    def tokens(self, local: dict[str, np.ndarray], *, stop_code: int | None = None) -> dict[str, jax.Array]:
        """This process's training rows (collated) as one global batch `[A, B, row]` of the token arrays;
        with several processes, `stop_code` rides with the rows (see `BaseTrainer.request_stop`)."""
        a = self.arguments
        if self.collator is not None:
            local = _collated(self.collator, local)
        accum = a.gradient_accumulation_steps
        if jax.process_count() > 1 and stop_code is not None:
            local = {**local, STOP_KEY: np.full((len(next(iter(local.values()))), 1), stop_code, np.int32)}
        return {
            k: jax.make_array_from_process_local_data(
                self.sharding, v.reshape(accum, -1, *v.shape[1:]), (accum, a.total_batch_size, *v.shape[1:])
            )
            for k, v in local.items()
        }

    def eval_tokens(self, local: dict[str, np.ndarray], rows: int) -> dict[str, jax.Array]:
        """This process's rows of an evaluation batch as one global batch of `rows` rows."""
        return {
            k: jax.make_array_from_process_local_data(self.eval_sharding, v, (rows, *v.shape[1:]))
            for k, v in local.items()
        }

    def global_batch(self, local: dict[str, np.ndarray], *, stop_code: int | None = None) -> dict[str, jax.Array]:
        """The train step's batch: the token arrays, then what the trainer kind adds (`DataSpec.extend`)."""
        batch = self.tokens(local, stop_code=stop_code)
        return self.spec.extend(local, batch, True) if self.spec.extend else batch

    def eval_batch(self, local: dict[str, np.ndarray], rows: int | None = None) -> dict[str, jax.Array]:
        """The eval step's batch of `rows` rows (default `evaluation_batch_size`), with the kind's arrays."""
        batch = self.eval_tokens(local, rows or self.arguments.eval_batch_size)
        return self.spec.extend(local, batch, False) if self.spec.extend else batch

    # ---- metrics ----------------------------------------------------------------------------------
    def mixture_shares(self) -> dict[str, float]:
        """With a data mixture: each part's share of the tokens read so far (this process's streams)."""
        loaders = getattr(self.train, "loaders", None) or []
        if not loaders or getattr(loaders[0], "mixture", None) is None:
            return {}
        tokens = np.sum([loader.state_dict()["tokens"] for loader in loaders], axis=0)
        total = float(tokens.sum())
        return {f"data_share_part{i}": float(t) / total for i, t in enumerate(tokens)} if total else {}

    def truncated_records(self) -> tuple[int, int]:
        """`(records, tokens)`: this process's training records longer than a row so far, and the tokens cut off
        them (`jaxloom.data.DataLoader.truncated`)."""
        loaders = getattr(self.train, "loaders", None) or []
        counts = [getattr(loader, "truncated", (0, 0)) for loader in loaders]
        return int(sum(c[0] for c in counts)), int(sum(c[1] for c in counts))

    def skipped_records(self) -> int:
        """Records skipped as unusable so far by this process's training streams (`bad_records="skip"`)."""
        loaders = getattr(self.train, "loaders", None) or []
        return int(sum(loader.skipped for loader in loaders))


def _collated(collator, local: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = collator(dict(local))
    bad = {
        k: (np.shape(out.get(k)), np.asarray(v).dtype)
        for k, v in local.items()
        if k not in out or np.shape(out[k]) != v.shape
    }
    if bad or set(out) != set(local):
        raise ValueError(
            f"data_collator must return the batch's keys {sorted(local)} with their shapes "
            f"{ {k: v.shape for k, v in local.items()} }; got {sorted(out)} "
            f"{ {k: np.shape(v) for k, v in out.items()} }"
        )
    return {k: np.asarray(out[k], local[k].dtype) for k in local}
