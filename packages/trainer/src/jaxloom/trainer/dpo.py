"""`DPOTrainer`: preference training (DPO, IPO, hinge) on the core of `BaseTrainer`.

The trainer supplies only what differs from next-token training: its rows (one preference pair per row,
chosen and rejected side by side: `jaxloom.data.DataConfig(pairs=True)`), its objective (the preference
loss of the policy's and the reference's sequence log-probabilities, TRL's metrics) and its extra state
(the frozen reference model, which computes `ref_logps` for each batch before the step). The loop,
checkpoints and exact resume, evaluation, metrics, async saves, HF export, `plan` and callbacks are the
core's. The reference is rebuilt from its source on every start, so checkpoints hold only the policy.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxloom.models as jmod
import jaxloom.state as js

from .dpo_config import DPOConfig
from .batches import DataSpec
from .pairs import pairs_as_rows
from . import reference
from .reference import build_reference
from .step import MODEL_INPUTS, Objective, StepConfig, forward_for_loss
from .trainer import BaseTrainer

log = logging.getLogger("jaxloom.trainer")
REF_KEY = "ref_logps"
"""Batch key of the reference model's `[rows, 2]` sequence log-probabilities (chosen, rejected)."""


# ---- the objective: pure functions, jitted inside the core's step ----------------------------------------
def sequence_logps(logits, ids, mask):
    """Per row: the summed log-probability of the tokens where `mask` is 1 (each predicted from the tokens
    before it), the summed vocabulary-mean logit at the positions predicting them (TRL's `logits/*`
    metrics), and how many there are."""
    logits = logits[:, :-1].astype(jnp.float32)
    target = jnp.take_along_axis(logits, ids[:, 1:, None], axis=-1)[..., 0]
    weight = (mask[:, 1:] > 0).astype(jnp.float32)
    logp = target - jax.nn.logsumexp(logits, axis=-1)
    return jnp.sum(logp * weight, -1), jnp.sum(jnp.mean(logits, -1) * weight, -1), jnp.sum(weight, -1)


def forward_logps(model, batch, fuse: tuple[int, int] = (0, 1)):
    """`(logps [B, 2], logit sums [B, 2], target counts [B, 2])` of `model` on a batch of pair rows, the
    model's output, and the `FusedHead` when `fuse = (loss_block_size, data_shards)` fuses the output
    layer (see `step.forward_for_loss`), else None. Fused, the log-probs are computed in blocks without the
    logits and carry no gradient: `dpo_loss` gives the gradient through `cross_entropy_gradient`."""
    ids = pairs_as_rows(batch["input_ids"])
    mask = pairs_as_rows(batch["loss_mask"])
    weight = (mask[:, 1:] > 0).astype(jnp.float32)
    block_size, data_shards = fuse
    inputs = {}
    if "token_type_ids" in batch:  # a vision-language model's pairs: each pair's image shown to both sequences
        inputs["token_type_ids"] = pairs_as_rows(batch["token_type_ids"])
    if "pixel_values" in batch:
        inputs["pixel_values"] = jnp.repeat(batch["pixel_values"], 2, axis=0)
    out, head = forward_for_loss(
        model,
        ids,
        weight,
        positions=pairs_as_rows(batch["positions"]),
        segment_ids=pairs_as_rows(batch["segment_ids"]),
        block_size=block_size,
        data_shards=data_shards,
        inputs=inputs,
    )
    if head is None:
        parts = sequence_logps(out.logits, ids, mask)
    else:
        logps, logit_sums = jmod.linear_log_probs(
            head.hidden, head.kernel, head.targets, head.weight, **head.settings()
        )
        parts = (logps, logit_sums, weight.sum(-1))
    return tuple(p.reshape(-1, 2) for p in parts), out, head


def preference_loss(delta, chosen_ratio, rejected_ratio, chosen_n, rejected_n, *, beta, loss_type, label_smoothing):
    """Per-pair loss, as TRL 1.16 defines it: `sigmoid` −log σ(β·Δ) (with `label_smoothing` ε: conservative
    DPO, (1−ε)·that + ε·(−log σ(−β·Δ))), `hinge` relu(1 − β·Δ), `ipo` ((chosen − rejected log-ratio, each
    averaged over its completion tokens) − 1/(2β))². Δ = chosen log-ratio − rejected log-ratio."""
    if loss_type == "sigmoid":
        return (
            -jax.nn.log_sigmoid(beta * delta) * (1 - label_smoothing)
            - jax.nn.log_sigmoid(-beta * delta) * label_smoothing
        )
    if loss_type == "hinge":
        return jax.nn.relu(1 - beta * delta)
    if loss_type == "ipo":
        avg = chosen_ratio / jnp.maximum(chosen_n, 1.0) - rejected_ratio / jnp.maximum(rejected_n, 1.0)
        return jnp.square(avg - 1 / (2 * beta))
    raise ValueError(f"loss_type {loss_type!r}; expected sigmoid, ipo or hinge")


def dpo_loss(state: js.TrainState, params, batch, cfg: StepConfig, *, beta, loss_type, label_smoothing):
    """The preference loss summed over the micro-batch's pairs, and TRL's statistics summed (`pairs` counts
    the pairs with completion tokens: padding rows at the end of the data count for nothing).

    With the fused output layer (`cfg.loss_block_size`), the log-probs come without logits or gradient,
    and the gradient from `cross_entropy_gradient` (zero, computing nothing unless differentiated) over the
    same tokens, each sequence weighted by d loss / d logp."""
    model = state.replace(params=params).model
    (logps, logit_sums, counts), out, head = forward_logps(model, batch, (cfg.loss_block_size, cfg.data_shards))
    ref = jax.lax.stop_gradient(batch[REF_KEY].astype(jnp.float32))
    # completion tokens as TRL counts them for IPO (the unshifted mask)
    completion = jnp.sum(batch["loss_mask"].reshape(-1, 2, batch["loss_mask"].shape[-1] // 2) > 0, -1)
    valid = (counts[:, 0] > 0).astype(jnp.float32)
    n = valid.sum()

    def pair_loss(logps):
        ratio_c, ratio_r = logps[:, 0] - ref[:, 0], logps[:, 1] - ref[:, 1]
        per_pair = preference_loss(
            ratio_c - ratio_r,
            ratio_c,
            ratio_r,
            completion[:, 0].astype(jnp.float32),
            completion[:, 1].astype(jnp.float32),
            beta=beta,
            loss_type=loss_type,
            label_smoothing=label_smoothing,
        )
        return jnp.sum(per_pair * valid), (ratio_c, ratio_r)

    if head is None:
        loss_sum, (ratio_c, ratio_r) = pair_loss(logps)
    else:
        (loss_sum, (ratio_c, ratio_r)), d_logps = jax.value_and_grad(pair_loss, has_aux=True)(logps)
        d_rows = jax.lax.stop_gradient(d_logps).reshape(-1, 1)  # [2B, 1], rows (chosen, rejected, ...)
        # d loss = Σ_rows d·d(logp) = −Σ_rows d·d(Σ_t ce): zero added, the loss's gradient carried
        loss_sum = loss_sum - jmod.cross_entropy_gradient(
            head.hidden, head.kernel, head.targets, head.weight * d_rows, **head.settings()
        )
    chosen, rejected = logps[:, 0], logps[:, 1]
    if out.aux_loss is not None and cfg.aux_loss_coef:
        loss_sum = loss_sum + cfg.aux_loss_coef * out.aux_loss * n
    reward_c, reward_r = jax.lax.stop_gradient(beta * ratio_c), jax.lax.stop_gradient(beta * ratio_r)
    sums = {
        "pairs": n,
        "rewards/chosen": jnp.sum(reward_c * valid),
        "rewards/rejected": jnp.sum(reward_r * valid),
        "rewards/accuracies": jnp.sum((reward_c > reward_r) * valid),
        "rewards/margins": jnp.sum((reward_c - reward_r) * valid),
        "logps/chosen": jnp.sum(jax.lax.stop_gradient(chosen) * valid),
        "logps/rejected": jnp.sum(jax.lax.stop_gradient(rejected) * valid),
        "logits_sum/chosen": jnp.sum(jax.lax.stop_gradient(logit_sums[:, 0]) * valid),
        "logits_sum/rejected": jnp.sum(jax.lax.stop_gradient(logit_sums[:, 1]) * valid),
        "targets/chosen": jnp.sum(counts[:, 0] * valid),
        "targets/rejected": jnp.sum(counts[:, 1] * valid),
        "tokens": jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32),
    }
    return loss_sum, sums


def dpo_metrics(sums):
    """TRL's metric names from the summed statistics: `rewards/*` and `logps/*` are per-pair means,
    `logits/*` means over completion tokens."""
    pairs = jnp.maximum(sums["pairs"], 1.0)
    out = {k: sums[k] / pairs for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")}
    out.update({k: sums[k] / pairs for k in ("logps/chosen", "logps/rejected")})
    for side in ("chosen", "rejected"):
        out[f"logits/{side}"] = sums[f"logits_sum/{side}"] / jnp.maximum(sums[f"targets/{side}"], 1.0)
    out["tokens"] = sums["tokens"]
    return out


def reference_logps(ref: js.TrainState, batch, after=None, fuse: tuple[int, int] = (0, 1), adapters_off: bool = False):
    """The frozen reference's `[..., B, 2]` sequence log-probabilities on pair rows `[..., B, 2L]` (a
    leading accumulation axis is mapped over, one micro-batch at a time). `after` is not read: passing the
    policy's step makes this program wait for the train step in flight, so programs with collectives run
    in one order on every process (two in flight at once can deadlock a multi-process CPU run).
    `adapters_off`: `ref` is a LoRA policy, whose base is the reference: its adapters are zeroed here
    (`x A 0` adds exactly nothing), so the base is read where it lies, never copied."""
    if adapters_off:
        ref = reference.adapters_off(ref)
    keys = ("input_ids", "positions", "segment_ids", "loss_mask", *MODEL_INPUTS)  # a VLM's images too
    rows = {k: batch[k] for k in keys if k in batch}
    if rows["input_ids"].ndim == 3:
        return jax.lax.map(lambda mb: forward_logps(ref.model, mb, fuse)[0][0], rows)
    return forward_logps(ref.model, rows, fuse)[0][0]


# ---- the reference: the extra frozen state of this trainer kind --------------------------------------------
class Reference:
    """The frozen reference of preference training and its `[rows, 2]` sequence log-probs for each batch
    (`extend`): computed by the reference on the mesh, or read from log-probs precomputed in one pass before
    training (`precompute_ref_log_probs`; then no reference is held: `state` is None). `source`: an `nnx`
    model, an HF directory, a jaxloom run directory, or None (the starting policy, rebuilt from the plan).
    `logps`: the kind's two log-probs per row, `(ref, batch, after, fuse=, adapters_off=) -> [..., B, 2]`
    (default `reference_logps`, a pair's chosen and rejected; KTO's: the completion and the mismatched one).
    Its collaborators — the policy's state (`policy()`), the run's plan, its batches component and the folder of
    the run's files (`folder()`) — are named by `collaborators()` (a dict of those four, read once the policy
    exists) or given to `ready()`; an evaluation of a restored run readies it at its first batch."""

    def __init__(self, source: Any, logps: Any = None, collaborators: Any = None):
        self.source = source
        self.logps = logps or reference_logps  # (ref, batch, after, fuse=, adapters_off=) -> [..., B, 2]
        self.collaborators = collaborators
        self.state: js.TrainState | None = None
        self.cache: dict[bytes, np.ndarray] | None = None
        self.adapters_off = False  # a LoRA policy's base is the reference: `state` is the policy's own
        self.policy: Any = None
        self.plan: Any = None
        self.batches: Any = None
        self.folder: Any = None

    def ready(self, **given: Any) -> None:
        """Build the reference (once), after the policy: one program at a time on every process. The collaborators
        (`given`, else `collaborators()`): `policy()` the policy's current `TrainState`, `plan` the run's `Plan`,
        `batches` its `Batches`, `folder()` the local folder of the run's files (precomputed log-probs are kept
        there)."""
        if self.state is not None or self.cache is not None or self.adapters_off:
            return
        named = given or self.collaborators()
        policy, plan, batches = named["policy"], named["plan"], named["batches"]
        self.policy, self.plan, self.batches, self.folder = policy, plan, batches, named["folder"]
        jax.block_until_ready(policy())  # one program at a time on every process (see reference_logps)
        self.adapters_off = plan.lora is not None and self.source is None
        # with LoRA, the base (the policy with its adapters off) is the reference: no second copy (TRL's way)
        self.state = None if self.adapters_off else jax.block_until_ready(self._build())
        fuse = (batches.arguments.loss_block_size, batches.data_shards())
        fn = functools.partial(self.logps, fuse=fuse, adapters_off=self.adapters_off)
        self._train_fn = jax.jit(fn, out_shardings=batches.sharding, keep_unused=True)
        self._eval_fn = jax.jit(fn, out_shardings=batches.eval_sharding, keep_unused=True)
        if batches.arguments.precompute_ref_log_probs:
            self._precompute()

    def extend(self, local: dict[str, np.ndarray], batch: dict[str, jax.Array], training: bool) -> dict:
        """`batch` with the reference's log-probs of its pairs (`REF_KEY`)."""
        if self.batches is None:  # a restored run's evaluation (`jaxloom eval`): readied at its first batch
            self.ready()
        data = self.batches
        a = data.arguments
        if self.cache is not None:
            values = self._cached_logps(local)
            if training:
                accum = a.gradient_accumulation_steps
                shape = (accum, a.total_batch_size, 2)
                batch[REF_KEY] = jax.make_array_from_process_local_data(
                    data.sharding, values.reshape(accum, -1, 2), shape
                )
            else:
                rows = batch["input_ids"].shape[0]
                batch[REF_KEY] = jax.make_array_from_process_local_data(data.eval_sharding, values, (rows, 2))
        elif training:
            policy = self.policy()
            batch[REF_KEY] = self._train_fn(policy if self.adapters_off else self.state, batch, policy.step)
        else:
            batch[REF_KEY] = self._eval_fn(self.policy() if self.adapters_off else self.state, batch)
        return batch

    def _build(self) -> js.TrainState:
        """The reference as a `TrainState` with no optimizer, sharded like the policy (`build_reference`)."""
        return build_reference(self.plan, self.batches.mesh, self.batches.arguments.runtime, self.source)

    # ---- precomputed reference log-probs ----------------------------------------------------------------
    def cache_file(self) -> Path:
        """Where this process's precomputed log-probs are kept: `save_directory/ref_logps/`, named by the
        reference's parameters (their digests), the data and the data settings, so that a resume (or
        another run of the same reference on the same data in this directory) reads them instead of
        recomputing, and any change makes a new file."""
        from jaxloom.mesh import named_leaves
        from jaxloom.state import integrity

        from .resume import data_identity

        data = self.batches
        if self.adapters_off:  # the reference is the base: its identity is the base's
            from .setup import base_digest

            ref: Any = {"lora_base": base_digest(self.policy())}
        else:
            ref = integrity.digests(dict(named_leaves(self.state.params)))  # type: ignore[union-attr]
        key = {
            "reference": ref,
            "train": data_identity(data.dataset_train),
            "eval": data_identity(data.dataset_eval),
            "settings": dict(data.spec.settings),
            "batches": [data.arguments.total_batch_size, data.arguments.eval_batch_size],
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return self.folder() / "ref_logps" / f"{digest}.process_{jax.process_index()}.npz"

    def _precompute(self) -> None:
        """One pass over the training (and evaluation) data computes the reference's log-probs of every pair
        (this process's rows), keyed by a hash of the pair's tokens, and keeps them in a file; then the
        reference is released for training. A file made earlier for the same reference and data is read."""
        data = self.batches
        path = self.cache_file()
        cache: dict[bytes, np.ndarray] = {}
        if path.is_file():
            with np.load(path) as saved:
                cache = {bytes(k): v for k, v in zip(saved["keys"], saved["values"], strict=True)}
            log.info("reference log-probs of %d pairs read from %s; no reference is held", len(cache), path)
            self.cache, self.state = cache, None
            return
        loaders = [data.loader(data.dataset_train, num_epochs=1, shuffle=False, prefetch=0)]
        evaluation = data.eval_loader()
        if evaluation is not None:
            loaders.append(evaluation)
        with jax.set_mesh(data.mesh):
            for loader in loaders:
                training = loader is loaders[0]
                if training:
                    batch_of = data.tokens
                else:
                    batch_of = functools.partial(data.eval_tokens, rows=loader.per_shard * loader.dp)
                fn = self._train_fn if training else self._eval_fn
                for local in loader:
                    ref = self.policy() if self.adapters_off else self.state
                    values = _local_rows(fn(ref, batch_of(local)), data.mesh, data.data_axes)
                    for key, value in zip(_row_keys(local), values.reshape(-1, 2), strict=True):
                        cache[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:  # written whole, then renamed: a killed run never leaves half a file
            keys = np.frombuffer(b"".join(cache), np.uint8).reshape(len(cache), -1) if cache else np.zeros((0, 16))
            np.savez(f, keys=keys, values=np.asarray(list(cache.values()), np.float32).reshape(-1, 2))
        os.replace(tmp, path)
        log.info("precomputed reference log-probs of %d pairs (%s); the reference is released", len(cache), path)
        self.cache, self.state = cache, None

    def _cached_logps(self, local: dict[str, np.ndarray]) -> np.ndarray:
        keys = _row_keys(local)
        out = np.zeros((len(keys), 2), np.float32)
        for i, key in enumerate(keys):
            if key in self.cache:  # type: ignore[operator]
                out[i] = self.cache[key]  # type: ignore[index]
            elif local["loss_mask"][i].any():
                folder = self.folder() / "ref_logps"
                raise KeyError(
                    f"a pair has no precomputed reference log-probs in {folder}: the data "
                    "changed since they were computed; remove that folder to compute them again"
                )
        return out


# ---- the trainer -------------------------------------------------------------------------------------------
class DPOTrainer(BaseTrainer):
    """Direct preference optimisation of `model` against a frozen reference, as TRL's `DPOTrainer`
    computes it, on jaxloom's core (one jitted step, exact resume, the same outputs and commands).

    - `arguments`: a `DPOConfig` (`beta`, `loss_type`, `label_smoothing`, `max_length`, ...).
    - `dataset_train`, `dataset_eval`: preference records — `prompt` (optional), `chosen`, `rejected`, as
      text or chat messages — from anything `jaxloom.data.as_source` reads (JSONL, Parquet, HF datasets).
    - `ref_model`: the reference: an `nnx` model, an HF directory or a jaxloom run directory (default:
      `arguments.ref_model`, else the starting policy, frozen). It holds no optimizer state, is sharded
      like the policy and cast to its parameter dtype.
    - the rest as `BaseTrainer`.

    `total_batch_size` counts pairs; each step reads `2 × total_batch_size` sequences of `max_length`.
    What it gives the core: `objective()` (the preference loss), `data_spec()` (pair rows and the
    reference's log-probs) and the `reference` (built with the policy in `configure_model()`).
    """

    # Pairs are tokenized with the tokenizer's own special-token policy, as TRL does: it is kept as given
    # (not set to add BOS the way next-token training's documents get it).
    MATCH_BOS = False

    arguments_class = DPOConfig

    def take_inputs(self, *, ref_model: Any = None) -> None:
        """`ref_model` (default: `arguments.ref_model`): see the class."""
        self.reference = Reference(
            ref_model if ref_model is not None else self.arguments.ref_model, collaborators=self.reference_collaborators
        )

    def reference_collaborators(self) -> dict[str, Any]:
        """What the reference reads once the policy exists (see `Reference`)."""
        return {
            "policy": lambda: self.state,
            "plan": self.plan,
            "batches": self.batches,
            "folder": lambda: self.run_directory.local,
        }

    @property
    def ref_state(self) -> js.TrainState | None:
        """The reference's state (None before `configure_model()`, once log-probs are precomputed, and with LoRA,
        whose reference is the policy's own base with the adapters off)."""
        return self.reference.state

    # ---- what this trainer gives the core --------------------------------------------------------------
    def objective(self) -> Objective:
        """The preference loss of `loss_type` with `beta` and `label_smoothing`; TRL's metrics."""
        a = self.arguments
        loss = functools.partial(dpo_loss, beta=a.beta, loss_type=a.loss_type, label_smoothing=a.label_smoothing)
        return Objective(loss=loss, metrics=dpo_metrics, weight="pairs", perplexity=False)

    def data_spec(self) -> DataSpec:
        """Pairs, one per row (chosen and rejected side by side: `2 × max_length` tokens), unpacked; bad
        records skipped and counted when `skip_bad_records`; the reference's log-probs `[rows, 2]` added
        to every batch. For a vision-language model, TRL's image pairs (`DataSpec.with_images`)."""
        a = self.arguments
        spec = DataSpec.tokens(
            a,
            row_width=2 * a.max_sequence_length,
            settings={"packing": False, "pairs": True},
            extra={REF_KEY: ((2,), np.float32)},
            extend=self.reference.extend,
        )
        return self.with_images(spec)  # TRL's image pairs: the prompt shows the images to both completions

    def prepare(self) -> None:
        """Once the policy exists (built or restored by the core): the frozen reference, before step 1."""
        self.reference.ready()


def _row_keys(local: dict[str, np.ndarray]) -> list[bytes]:
    """One 16-byte key per pair row: a hash of its tokens and completion mask (the same pair, the same key)."""
    ids, mask = local["input_ids"], local["loss_mask"]
    return [
        hashlib.blake2b(ids[i].tobytes() + mask[i].astype(np.int8).tobytes(), digest_size=16).digest()
        for i in range(len(ids))
    ]


def _local_rows(values: jax.Array, mesh, data_axes: tuple[str, ...]) -> np.ndarray:
    """This process's rows of a `[A, B, 2]` global array (every process gathers the small array, then
    keeps its rows)."""
    from jaxloom.mesh import local_batch_slice

    if jax.process_count() == 1:
        return np.asarray(values)
    from jax.experimental import multihost_utils

    full = np.asarray(multihost_utils.process_allgather(values, tiled=True))
    return full[..., local_batch_slice(mesh, full.shape[-2], data_axes), :]
