"""`GRPOTrainer`: online RL with verifiable rewards (GRPO, DAPO, Dr. GRPO) on the core of `BaseTrainer`.

What it adds to the core is a rollout stage and an objective:

- `Rollouts` (the trainer's `batches` component): for each step, the step's prompts (a seeded permutation of
  the prompt records, indexed by the step: resuming needs no loader state), each completed
  `num_generations` times by the policy's current weights through `jaxloom.generation` (KV cache, jitted once
  per shape, on the training mesh, no copy of the weights), scored by the reward functions, turned into
  group-relative advantages, and laid out as one batch of rows `[prompt | completion]` with the old and
  reference per-token log-probs. The sampling key is `fold_in(state.rng, rollout)`: a resumed run samples
  what the uninterrupted one did.
- `grpo_loss` (the objective): the clipped policy-gradient loss per completion token, plus `beta` times the
  k3 estimate of the KL to the reference, averaged as `loss_type` says (TRL's `grpo`, `bnpo`, `dr_grpo`,
  `dapo`).

An external rollout engine (vLLM on GPU, say) plugs in as another `generate(prompt_ids, prompt_mask, key)`
callable: `Rollouts.engine`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jaxloom.data as jd
import jaxloom.state as js

from .grpo_config import GRPOConfig
from .batches import Batches, DataSpec
from .step import STOP_KEY, Objective, StepConfig
from .trainer import BaseTrainer

log = logging.getLogger("jaxloom.trainer")
ADV, OLD, REF, SAMPLED = "advantages", "old_logps", "ref_logps", "sampling_logps"
PROMPT_BUCKET = 16
"""The narrowest prompt bucket: a step's prompts are padded to their longest, rounded up to a power of two >= this."""
COMPLETION_BUCKET = 16
"""The narrowest completion bucket (likewise; at most `max_completion_length`)."""


def row_buckets(longest_prompt: int, longest_completion: int, max_completion_length: int) -> tuple[int, int]:
    """`(prompt width, completion width)` of a step's rows: the step's longest prompt and longest completion, each
    rounded up to a power of two (at least `PROMPT_BUCKET` / `COMPLETION_BUCKET` tokens; a completion at most
    `max_completion_length`). Cost follows the data, not the caps, and compiles stay few: the generator
    compiles once per prompt bucket, the train step once per (prompt, completion) bucket pair a run meets —
    prompts of 10 to 40 tokens and completions up to 256 make at most 3 × 5."""
    from jaxloom.generation.decode import bucket

    return bucket(longest_prompt, PROMPT_BUCKET), min(max_completion_length, bucket(longest_completion, COMPLETION_BUCKET))


# ---- the objective: a pure function, jitted inside the core's step ----------------------------------------------
def token_logps(model, batch, temperature: float, *, block_size: int = 0, data_shards: int = 1):
    """Per-token log-probabilities `[B, L-1]` of each row's next tokens under `model` (logits divided by
    `temperature`, as TRL does), and the entropies of those distributions. With `block_size > 0` (the
    trainer's `loss_block_size`) and a jaxloom causal LM, the output layer runs in blocks of positions
    (`jaxloom.models.linear_token_log_probs`): no `[B, L, V]` logits in the step or the rollout."""
    from .step import forward_for_loss

    ids = batch["input_ids"]
    weight = jnp.ones((ids.shape[0], ids.shape[1] - 1), jnp.float32)
    out, head = forward_for_loss(
        model,
        ids,
        weight,
        positions=batch["positions"],
        segment_ids=batch["segment_ids"],
        block_size=block_size,
        data_shards=data_shards,
    )
    if head is not None:
        from jaxloom.models import linear_token_log_probs

        logp, entropy = linear_token_log_probs(
            head.hidden, head.kernel, head.targets, temperature=temperature, **head.settings()
        )
        return logp[:, :-1], entropy[:, :-1]
    logits = out.logits[:, :-1].astype(jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, ids[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def per_token_loss(logp, old, ref, advantages, *, beta, epsilon_low, epsilon_high):
    """TRL's token loss: `-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta k3(ref, logp)`, `r =
    exp(logp - old)`; also the k3 KL and which tokens the clip bound (low with A < 0, high with A > 0)."""
    ratio = jnp.exp(logp - old)
    a = advantages[:, None]
    clipped = jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -jnp.minimum(ratio * a, clipped * a)
    kl = jnp.exp(ref - logp) - (ref - logp) - 1
    if beta:
        loss = loss + beta * kl
    bound = ((ratio < 1 - epsilon_low) & (a < 0)) | ((ratio > 1 + epsilon_high) & (a > 0))
    return loss, kl, bound


def aggregate(loss, mask, loss_type: str, max_completion_length: int):
    """`(summed loss, units)` of token losses `[B, T]` under `mask`: the step divides the sum over its
    micro-batches by the units once. grpo: each completion's mean, averaged over completions; bnpo and dapo:
    the mean over every completion token; dr_grpo: the sum over tokens / (completions × max length)."""
    tokens = jnp.sum(mask, axis=-1)
    if loss_type == "grpo":
        return jnp.sum(jnp.sum(loss * mask, -1) / jnp.maximum(tokens, 1.0)), jnp.float32(loss.shape[0])
    if loss_type == "dr_grpo":
        return jnp.sum(loss * mask) / max_completion_length, jnp.float32(loss.shape[0])
    return jnp.sum(loss * mask), jnp.sum(tokens)


def grpo_loss(state, params, batch, cfg: StepConfig, *, rl, iterations: int):
    """The GRPO objective of one micro-batch of rollout rows: `(summed loss, sums)`; `sums["units"]`
    normalises it (see `aggregate`), the rest are TRL's metrics' sums, and with the sampler's log-probs in the
    batch (`SAMPLED`) how far the training forward's log-probs of the same tokens are from them."""
    model = state.replace(params=params).model
    logp, entropy = token_logps(
        model, batch, rl.temperature, block_size=cfg.loss_block_size, data_shards=cfg.data_shards
    )
    mask = batch["loss_mask"][:, 1:].astype(jnp.float32)
    old = batch[OLD][:, 1:] if iterations > 1 else jax.lax.stop_gradient(logp)
    ref = batch[REF][:, 1:] if rl.beta else jax.lax.stop_gradient(logp)
    high = rl.epsilon if rl.epsilon_high is None else rl.epsilon_high
    loss, kl, bound = per_token_loss(
        logp, old, ref, batch[ADV], beta=rl.beta, epsilon_low=rl.epsilon, epsilon_high=high
    )
    total, units = aggregate(loss, mask, rl.loss_type, rl.max_completion_length)
    sums = {
        "units": units,
        "completion_tokens": jnp.sum(mask),
        "kl_sum": jnp.sum(jax.lax.stop_gradient(kl) * mask),
        "clipped": jnp.sum(bound * mask),
        "entropy_sum": jnp.sum(jax.lax.stop_gradient(entropy) * mask),
    }
    if SAMPLED in batch:
        diff = jnp.abs(jax.lax.stop_gradient(logp) - batch[SAMPLED][:, 1:]) * mask
        sums["logprob_diff_sum"] = jnp.sum(diff)
        sums["logprob_diff_max"] = jnp.max(diff)  # one micro-batch a step (GRPO): the step's maximum
    return total, sums


def grpo_metrics(sums):
    """TRL's step metrics: `kl`, `clip_ratio` (tokens whose ratio the clip bound), `entropy`; and, with the
    sampler's log-probs, `sampling/logprob_diff/mean` and `/max`: |trainer − sampler| log-prob of the completion
    tokens (0 up to float32 rounding when both run the same model in float32; in bf16 the difference an
    importance-sampling correction would undo)."""
    n = jnp.maximum(sums["completion_tokens"], 1.0)
    out = {"kl": sums["kl_sum"] / n, "clip_ratio": sums["clipped"] / n, "entropy": sums["entropy_sum"] / n}
    if "logprob_diff_sum" in sums:
        out["sampling/logprob_diff/mean"] = sums["logprob_diff_sum"] / n
        out["sampling/logprob_diff/max"] = sums["logprob_diff_max"]
    return out


# ---- reward functions: user code -----------------------------------------------------------------------------
class RewardError(RuntimeError):
    """A reward function failed (raised, returned NaN or the wrong number of rewards)."""


def load_reward_function(spec: Any) -> Callable:
    """A reward function from a callable or a dotted import path (`my_rewards.accuracy`), checked to take
    TRL's keywords (`prompts`, `completions`, and the dataset's columns through `**kwargs`)."""
    if isinstance(spec, str):
        module, _, name = spec.rpartition(".")
        if not module:
            raise ValueError(f"reward_funcs: {spec!r}; expected a dotted import path such as my_rewards.accuracy")
        try:
            fn = getattr(_import_from_here(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward_funcs: {spec!r} does not import ({type(e).__name__}: {e})") from None
    else:
        fn = spec
    if not callable(fn):
        raise TypeError(f"reward_funcs: {spec!r} is not callable")
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [k for k in ("prompts", "completions") if k not in params and not var_kw]
    if missing or not var_kw:
        raise TypeError(
            f"reward function {reward_name(fn)}{inspect.signature(fn)}: expected TRL's form "
            "(prompts, completions, **kwargs) -> list[float] (dataset columns arrive as keyword arguments)"
        )
    return fn


def _import_from_here(module: str) -> Any:
    """`module`, found as `python -m` finds it: the working directory comes first (the `jaxloom` command's and a
    Ray worker's `sys.path` do not hold it, and a user's reward module sits beside their data)."""
    import os
    import sys

    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(module)


def reward_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def call_reward(fn: Callable, prompts: list, completions: list, columns: dict[str, list], **extra) -> np.ndarray:
    """`fn`'s rewards of the completions, checked: one finite number (or None, as TRL allows: no reward) per
    completion. A raise is retried one completion at a time to name the prompt that fails."""
    name = reward_name(fn)
    try:
        out = fn(prompts=prompts, completions=completions, **columns, **extra)
    except Exception as e:  # noqa: BLE001 - user code: find the failing prompt, then say which
        for i in range(len(prompts)):
            try:
                fn(prompts=[prompts[i]], completions=[completions[i]], **{k: [v[i]] for k, v in columns.items()})
            except Exception:  # noqa: BLE001
                raise RewardError(
                    f"reward function {name} raised on prompt index {i} of this step ({type(e).__name__}: {e})"
                ) from e
        raise RewardError(f"reward function {name} raised ({type(e).__name__}: {e})") from e
    try:
        values = np.asarray([np.nan if v is None else float(v) for v in out], np.float64)
    except (TypeError, ValueError) as e:
        raise RewardError(f"reward function {name} returned {type(out).__name__}; expected a list of numbers") from e
    if len(values) != len(prompts):
        raise RewardError(f"reward function {name} returned {len(values)} rewards for {len(prompts)} completions")
    bad = [i for i, (v, raw) in enumerate(zip(values, out, strict=True)) if raw is not None and not math.isfinite(v)]
    if bad:
        raise RewardError(f"reward function {name} returned {values[bad[0]]} for completion {bad[0]}; expected finite")
    return values


def advantages(rewards: np.ndarray, group: int, scale: str) -> tuple[np.ndarray, np.ndarray]:
    """Group-relative advantages of the summed `rewards [B]` (groups of `group` consecutive completions):
    reward minus its group's mean, divided by the group's std (`scale="group"`, unbiased as torch's), the
    batch's (`"batch"`), or not (`"none"`), + 1e-4 as TRL. Also each group's std."""
    grouped = rewards.reshape(-1, group)
    mean = grouped.mean(axis=1, keepdims=True)
    std = grouped.std(axis=1, ddof=1, keepdims=True)
    adv = grouped - mean
    if scale == "group":
        adv = adv / (std + 1e-4)
    elif scale == "batch":
        adv = adv / (rewards.std(ddof=1) + 1e-4)
    return adv.reshape(-1), std.reshape(-1)


# ---- the rollout stage --------------------------------------------------------------------------------------
def read_records(data: Any) -> list[dict]:
    """Every record of `data` (records, an HF dataset, a path): prompt datasets are read whole."""
    if isinstance(data, list | tuple) and (not data or isinstance(data[0], dict)):
        return list(data)
    source = jd.as_source(data)
    names = source.shard_names() if callable(source.shard_names) else source.shard_names
    return [dict(r) for name in names for r in source.read_shard(name)]


class PromptOrder:
    """The prompts of each rollout: a permutation of the records per epoch (seeded), read in order. Its
    position is the rollout index, derived from the step, so a checkpoint needs no loader state."""

    def __init__(self, records: list[dict], per_rollout: int, seed: int, shuffle: bool):
        self.records, self.per_rollout, self.seed, self.shuffle = records, per_rollout, seed, shuffle
        self.rollout = 0

    def indices(self, rollout: int) -> list[int]:
        """The record indices of rollout `rollout`'s prompts."""
        n, out = len(self.records), []
        for flat in range(rollout * self.per_rollout, (rollout + 1) * self.per_rollout):
            epoch, i = divmod(flat, n)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            out.append(int(order[i]))
        return out

    def prompts(self, rollout: int) -> list[dict]:
        return [self.records[i] for i in self.indices(rollout)]

    # what the core asks of a training loader
    def __next__(self) -> int:
        return self.rollout

    def __iter__(self):
        return self

    def global_state_dict(self) -> dict[str, Any]:
        return {"kind": "rollouts", "prompts_per_rollout": self.per_rollout}

    def close(self) -> None:
        pass


class Rollouts(Batches):
    """The batches of a GRPO run: rollouts of the policy (see the module docstring). `engine(prompt_ids,
    prompt_mask, key) -> (completion_ids, completion_mask)` may replace the in-process generation."""

    def __init__(self, trainer: Any, spec: DataSpec, engine: Callable | None = None):
        super().__init__(
            trainer.arguments,
            spec,
            mesh=trainer.mesh,
            data_axes=trainer.data_axes,
            tokenizer=lambda: trainer.tokenizer,
            dataset_train=trainer.dataset_train,
        )
        self.trainer, self.engine = trainer, engine
        self.records: list[dict] | None = None
        self.encoded: list[np.ndarray] | None = None  # each prompt's token ids, made once
        self.cached: tuple[int, dict] | None = None  # the last rollout's batch (num_iterations > 1 reuses it)
        self.metrics: list[tuple[int, dict[str, float]]] = []  # (step trained on it, metrics)

    # ---- what the core asks of the batches ----------------------------------------------------------------
    def prompt_records(self) -> list[dict]:
        """The prompt records, read once and checked: each has a `prompt` (text or chat messages)."""
        if self.records is None:
            records = read_records(self.dataset_train)
            if not records:
                raise ValueError("dataset_train has no records; expected prompt records ({'prompt': ...})")
            for i, r in enumerate(records[:1000]):
                if "prompt" not in r:
                    raise ValueError(
                        f"dataset_train record {i} has no 'prompt' column (it has {sorted(r)}); GRPO reads a "
                        "prompt (text, or a list of chat messages) per record, other columns go to the rewards"
                    )
            self.records = records
        return self.records

    def prompt_ids(self) -> list[np.ndarray]:
        """Every prompt's token ids (text as the tokenizer encodes it, chat through its template with the
        generation prompt), encoded once for the run; not yet cut to `max_prompt_length`."""
        if self.encoded is None:
            records = self.prompt_records()
            chat = isinstance(records[0]["prompt"], list)
            encoded = jd_encode(self.trainer.tokenizer, [r["prompt"] for r in records], chat)
            self.encoded = [np.asarray(ids, np.int32) for ids in encoded]
        return self.encoded

    def longest_prompt(self) -> int:
        """The widest prompt a step can hold: `max_prompt_length`, or (None) the longest prompt of the data."""
        cap = self.arguments.rl.max_prompt_length
        longest = max(len(ids) for ids in self.prompt_ids())
        return longest if cap is None else min(cap, longest)

    def widest_row(self) -> int:
        """The widest row a step of this run can have (its prompt bucket + `max_completion_length`): what
        `jaxloom plan` budgets memory for."""
        rl = self.arguments.rl
        prompt, _ = row_buckets(self.longest_prompt(), 1, rl.max_completion_length)
        return prompt + rl.max_completion_length

    def per_rollout(self) -> int:
        return self.arguments.total_batch_size // self.arguments.rl.num_generations

    def train_loader(self, state: Any = None) -> PromptOrder:  # type: ignore[override]
        if self.train is None:
            a = self.arguments
            self.train = PromptOrder(self.prompt_records(), self.per_rollout(), a.seed, a.shuffle_train_dataset)  # type: ignore[assignment]
        return self.train  # type: ignore[return-value]

    def steps_for_epochs(self) -> int:
        a = self.arguments
        rollouts = len(self.prompt_records()) // self.per_rollout()
        if rollouts == 0:
            raise ValueError(
                f"dataset_train has {len(self.prompt_records())} prompts; a step needs {self.per_rollout()} "
                "(total_batch_size / num_generations)"
            )
        return rollouts * a.rl.num_iterations * a.num_train_epochs

    def check_train_data(self) -> None:
        """Prompt records are read whole and checked (`prompt_records`), not as next-token text."""
        self.prompt_records()

    def check_eval_data(self) -> None:
        if self.dataset_eval is not None:
            raise ValueError("GRPO has no evaluation pass here: drop dataset_eval (data.eval)")

    def global_batch(self, local: Any, *, stop_code: int | None = None) -> dict[str, jax.Array]:  # type: ignore[override]
        """The batch of step `current_step + 1`: a new rollout, or the last one again within `num_iterations`."""
        t, a = self.trainer, self.arguments
        step = t.current_step
        rollout = step // a.rl.num_iterations
        if self.cached is None or self.cached[0] != rollout:
            if step % a.rl.num_iterations:
                log.warning(
                    "resumed inside a rollout's num_iterations (step %d): it is rolled out again with the "
                    "current weights",
                    step,
                )
            self.cached = (rollout, self.rollout(rollout))
        batch = dict(self.cached[1])
        if jax.process_count() > 1 and stop_code is not None:
            rows = a.total_batch_size
            batch[STOP_KEY] = self._put(np.full((1, rows, 1), stop_code, np.int32))
        return batch

    # ---- one rollout ---------------------------------------------------------------------------------------
    def rollout(self, index: int) -> dict[str, jax.Array]:
        """Generate, score and lay out rollout `index` (its prompts, `num_generations` completions each)."""
        t, a = self.trainer, self.arguments
        rl, tok = a.rl, t.tokenizer
        started = time.perf_counter()
        order = self.train_loader()
        records = order.prompts(index)
        group = rl.num_generations
        chat = isinstance(records[0]["prompt"], list)
        encoded = [self.prompt_ids()[i] for i in order.indices(index)]
        cap, kept, truncated = rl.max_prompt_length, [], 0
        for ids in encoded:
            truncated += cap is not None and len(ids) > cap
            kept.append(ids if cap is None else ids[-cap:])  # the prompt's end is kept: it leads into the completion
        width, _ = row_buckets(max(map(len, kept)), 1, rl.max_completion_length)
        unique = np.full((len(kept), width), tok.pad_token_id or 0, np.int32)
        unique_mask = np.zeros((len(kept), width), np.int32)
        for i, ids in enumerate(kept):
            unique[i, width - len(ids) :], unique_mask[i, width - len(ids) :] = ids, 1
        prompt, prompt_mask = np.repeat(unique, group, axis=0), np.repeat(unique_mask, group, axis=0)
        b = len(kept) * group
        key = jax.random.fold_in(t.state.rng, index)
        if self.engine is not None:  # an external engine: the prompt rows as they are trained on, no log-probs
            completion, completion_mask = self.engine(prompt, prompt_mask, key)
            sampled = None
        else:  # one prefill per prompt, shared by its group
            completion, completion_mask, sampled = self.generate(unique, unique_mask, key)
        _, cwidth = row_buckets(width, int(np.max(completion_mask.sum(axis=1), initial=1)), completion.shape[1])
        completion, completion_mask = completion[:, :cwidth], completion_mask[:, :cwidth]
        generated = time.perf_counter()
        texts = [
            tok.decode(c[m > 0], skip_special_tokens=True) for c, m in zip(completion, completion_mask, strict=True)
        ]
        prompts = [r["prompt"] for r in records for _ in range(group)]
        completions: list[Any] = [[{"role": "assistant", "content": x}] for x in texts] if chat else texts
        columns = {k: [r[k] for r in records for _ in range(group)] for k in records[0] if k != "prompt"}
        funcs, weights = t.reward_functions, t.reward_weights
        rewards = np.stack(
            [
                call_reward(
                    f,
                    prompts,
                    completions,
                    columns,
                    completion_ids=[list(c[m > 0]) for c, m in zip(completion, completion_mask, strict=True)],
                )
                for f in funcs
            ],
            axis=1,
        )
        scored = time.perf_counter()
        total = np.nansum(rewards * np.asarray(weights)[None], axis=1)
        adv, std = advantages(total, group, rl.scale_rewards)
        eos = set(t.stop_ids)
        ended = np.asarray(
            [any(int(x) in eos for x in c[m > 0]) for c, m in zip(completion, completion_mask, strict=True)]
        )
        loss_mask = completion_mask.copy()
        if rl.mask_truncated_completions:
            loss_mask[~ended] = 0
        ids = np.concatenate([prompt, completion], axis=1)
        seg = np.concatenate([prompt_mask, completion_mask], axis=1)
        rows = {
            "input_ids": ids,
            "segment_ids": seg,
            "positions": np.maximum(np.cumsum(seg, axis=1) - 1, 0).astype(np.int32),
            "loss_mask": np.concatenate([np.zeros_like(prompt_mask), loss_mask], axis=1),
        }
        batch = {k: self._put(v[None]) for k, v in rows.items()}
        batch[ADV] = self._put(adv.astype(np.float32)[None])
        zeros = np.zeros((1, b, ids.shape[1]), np.float32)
        batch[OLD] = t.logps_of(batch, reference=False) if rl.num_iterations > 1 else self._put(zeros)
        batch[REF] = t.logps_of(batch, reference=True) if rl.beta else self._put(zeros)
        if SAMPLED in self.spec.extra:  # the sampler's log-prob of each completion token, at the token's column
            at_tokens = np.zeros((b, ids.shape[1]), np.float32)
            if sampled is not None:
                at_tokens[:, width:] = np.where(completion_mask > 0, sampled[:, :cwidth], 0.0)
            batch[SAMPLED] = self._put(at_tokens[None])
        lengths = completion_mask.sum(axis=1)
        metrics = {
            "reward": float(np.mean(total)),
            "reward_std": float(np.mean(std)),
            **{f"rewards/{reward_name(f)}/mean": float(np.nanmean(rewards[:, j])) for j, f in enumerate(funcs)},
            "completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": float(np.mean(~ended)),
            "prompts/truncated": float(truncated),
            "rows/width": float(ids.shape[1]),
            "time/rollout_s": generated - started,
            "time/reward_s": scored - generated,
        }
        self.metrics.append((t.current_step + 1, metrics))
        return batch

    def generate(
        self, prompt: np.ndarray, mask: np.ndarray, key: jax.Array
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """In-process generation with the policy's current weights, on the training mesh: `num_generations`
        completions of each prompt row (one prefill per prompt, its KV cache shared by the group), as
        `(completion_ids, completion_mask, completion_logps)` with rows `i * num_generations + j`."""
        import jaxloom.generation as jg

        t, rl = self.trainer, self.arguments.rl
        config = jg.GenerationConfig(
            max_new_tokens=rl.max_completion_length,
            do_sample=rl.temperature > 0,
            temperature=rl.temperature or 1.0,
            top_k=rl.top_k or None,
            top_p=rl.top_p if rl.top_p < 1 else None,
            eos_token_id=tuple(t.stop_ids),
            pad_token_id=t.tokenizer.pad_token_id or 0,
        )
        out = jg.generate(
            t.state.model, prompt, mask, config, mesh=t.mesh, rng=key, num_return_sequences=rl.num_generations
        )
        return np.asarray(out.completion_ids), np.asarray(out.completion_mask), np.asarray(out.completion_logps)

    def _put(self, x: np.ndarray) -> jax.Array:
        """A global `[1, B, ...]` host array (the same on every process) on the batch's sharding."""
        spec = PartitionSpec(None, *self.sharding.spec[1:2])
        sharding = NamedSharding(self.mesh, spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    def take_metrics(self, step: int | None = None) -> dict[str, float]:
        """The metrics of the rollouts of steps up to `step` (default: all) not yet taken, averaged (TRL logs
        them averaged over the logging steps); a rollout made for a later step waits for its own row."""
        due = [m for s, m in self.metrics if step is None or s <= step]
        self.metrics = [(s, m) for s, m in self.metrics if not (step is None or s <= step)]
        if not due:
            return {}
        return {k: float(np.mean([m[k] for m in due if k in m])) for k in due[-1]}


def jd_encode(tokenizer: Any, prompts: Sequence[Any], chat: bool) -> list[list[int]]:
    """Token ids of each prompt: text as the tokenizer encodes it, chat messages through its template with
    the generation prompt (TRL's conversational form)."""
    from jaxloom.generation import encode_prompts

    return encode_prompts(tokenizer, list(prompts), apply_chat_template=chat)


# ---- the trainer -------------------------------------------------------------------------------------------------
class GRPOTrainer(BaseTrainer):
    """Online RL with reward functions (TRL's `GRPOTrainer` names): `reward_funcs` are callables
    `(prompts, completions, **columns) -> list[float]` or dotted import paths (also `arguments.reward_funcs`),
    weighted by `reward_weights`; `dataset_train` holds prompt records (`prompt`: text or chat messages; other
    columns reach the rewards). Arguments otherwise as `BaseTrainer`'s; `arguments` is a `GRPOConfig`;
    `rollout_engine(prompt_ids, prompt_mask, key) -> (completion_ids, completion_mask)` replaces the
    in-process generation (the seam for an external engine)."""

    MATCH_BOS = True

    def __init__(
        self,
        arguments: GRPOConfig | None = None,
        model_state: js.TrainState | None = None,
        model: nnx.Module | None = None,
        dataset_train: Any = None,
        dataset_eval: Any = None,
        data_collator: Any = None,
        finetune: bool = True,
        processing_class: Any = None,
        *,
        reward_funcs: Any = None,
        rollout_engine: Callable | None = None,
        mesh=None,
        hooks: list | None = None,
        **deprecated_kwargs: Any,
    ):
        arguments = arguments if arguments is not None else GRPOConfig()
        if not isinstance(arguments, GRPOConfig):
            raise TypeError(f"GRPOTrainer takes a GRPOConfig, got {type(arguments).__name__}")
        if data_collator is not None:
            raise ValueError("GRPOTrainer builds its rows from rollouts: data_collator is not used; drop it")
        super().__init__(
            arguments,
            model_state,
            model,
            dataset_train,
            dataset_eval,
            None,
            finetune,
            processing_class,
            mesh=mesh,
            hooks=hooks,
            **deprecated_kwargs,
        )
        given = reward_funcs if reward_funcs is not None else arguments.rl.reward_funcs
        given = [given] if callable(given) or isinstance(given, str) else list(given or [])
        if not given:
            raise ValueError("GRPO needs reward_funcs: callables or dotted paths (reward_funcs=my_rewards.accuracy)")
        for f in given:  # callables are checked now; paths are imported when the run trains (see reward_functions)
            if not isinstance(f, str):
                load_reward_function(f)
        self._reward_specs = given
        weights = arguments.rl.reward_weights
        if weights is not None and len(weights) != len(given):
            raise ValueError(f"reward_weights has {len(weights)} weights for {len(given)} reward functions")
        self.reward_weights = list(weights) if weights is not None else [1.0] * len(given)
        self.rollout_engine = rollout_engine
        self._reference: js.TrainState | None = None

    batches = functools.cached_property(lambda self: Rollouts(self, self.data_spec(), self.rollout_engine))  # type: ignore[assignment]

    @functools.cached_property
    def reward_functions(self) -> list[Callable]:
        """The reward functions, dotted paths imported (user code runs): only when the run trains, at setup
        before step 1 — never by a command that only reads a run (`convert`, `generate`, `eval`, `plan`), so a
        run directory from elsewhere cannot make those import anything."""
        return [load_reward_function(f) for f in self._reward_specs]

    def objective(self) -> Objective:
        """The GRPO loss of `loss_type`; TRL's metrics (`kl`, `clip_ratio`, `entropy`)."""
        rl = self.arguments.rl
        loss = functools.partial(grpo_loss, rl=rl, iterations=rl.num_iterations)
        return Objective(loss=loss, metrics=grpo_metrics, weight="units", perplexity=False)

    def data_spec(self) -> DataSpec:
        """Rows `[prompt | completion]`, with the advantage per row and the old, reference and (in-process
        generation) sampler log-probs per token. `row_width` is `max_sequence_length`, the widest row the caps
        allow; each step's rows are as wide as its data (`row_buckets`), its step compiled per width."""
        a = self.arguments
        width = a.max_sequence_length
        extra = {ADV: ((), np.float32), OLD: ((width,), np.float32), REF: ((width,), np.float32)}
        if self.rollout_engine is None:
            extra[SAMPLED] = ((width,), np.float32)
        return DataSpec(row_width=width, settings={}, extra=extra)

    def configure_functions(self):
        """The train step compiled once per row width a step brings (`functions.WidthSteps`), when first met:
        nothing compiles before the first rollout says how wide its rows are."""
        from .functions import WidthSteps
        from .outputs import TrainerConfigureFunctionOutput

        fns = self.functions
        self._train_fn = WidthSteps(fns, self.arguments.total_batch_size)
        return TrainerConfigureFunctionOutput(fns.train, fns.evaluate, self.mesh, self.checkpoints)

    def lower_train_step(self):
        """The train step lowered for the widest row this run can make (`Rollouts.widest_row`): what `jaxloom
        plan` budgets memory for."""
        return self.functions.lower(self.arguments.total_batch_size, self.batches.widest_row())  # type: ignore[attr-defined]

    def compiled_train_step(self):
        """The train step compiled for the widest row this run can make (see `lower_train_step`)."""
        return self.lower_train_step().compile()

    def data_metrics(self, step: int | None = None) -> dict[str, float]:
        """The rollouts' metrics under TRL's names, for the log row of `step`: `reward`, `reward_std`,
        `rewards/<func>/mean`, `completions/mean_length`, `completions/clipped_ratio`, `prompts/truncated`,
        `time/rollout_s`, `time/reward_s` (averaged over the steps since the last row)."""
        return self.batches.take_metrics(step)  # type: ignore[attr-defined]

    @functools.cached_property
    def stop_ids(self) -> tuple[int, ...]:
        """Where a completion ends: the tokenizer's EOS and, for chat prompts, the template's end of turn."""
        from jaxloom.generation import end_of_turn_ids

        tok = self.tokenizer
        ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        if self.batches.prompt_records() and isinstance(self.batches.prompt_records()[0]["prompt"], list):  # type: ignore[attr-defined]
            ids |= set(end_of_turn_ids(tok))
        return tuple(sorted(ids))

    def configure_model(self):
        """The policy, then (with `beta > 0`) the reference: the base with the adapters off under LoRA (no copy),
        `ref_model`, or the initial policy (rebuilt from its source on every start, never checkpointed)."""
        out = super().configure_model()
        a = self.arguments
        self.batches.prompt_records()  # type: ignore[attr-defined]  # the data is checked before step 1
        self.reward_functions  # noqa: B018 - imported and checked before step 1
        positions = self.plan.config.max_position_embeddings
        prompt = self.batches.longest_prompt()  # type: ignore[attr-defined]
        if prompt + a.rl.max_completion_length > positions:
            ids = self.batches.prompt_ids()  # type: ignore[attr-defined]
            which = max(range(len(ids)), key=lambda i: len(ids[i]))
            said = (
                f"max_prompt_length = {a.rl.max_prompt_length}"
                if a.rl.max_prompt_length is not None and a.rl.max_prompt_length < len(ids[which])
                else f"the longest prompt (record {which}) is {prompt} tokens"
            )
            raise ValueError(
                f"{said}, + max_completion_length = {a.rl.max_completion_length} is {prompt + a.rl.max_completion_length}"
                f"; expected at most the model's max_position_embeddings ({positions}): lower max_completion_length, "
                f"or set max_prompt_length to cut prompts (their start is dropped, and counted)"
            )
        if a.rl.beta and self._reference is None and self.plan.lora is None:
            from .dpo import Reference

            ref = Reference(self, a.rl.ref_model)
            self._reference = ref._build()
        return out

    @functools.cached_property
    def _logps_fn(self):
        temperature = self.arguments.rl.temperature
        fused = dict(block_size=self.arguments.loss_block_size, data_shards=self.data_shards())

        def fn(state, batch, adapters_off):
            if adapters_off:
                state = state.replace(params=jax.tree_util.tree_map(jnp.zeros_like, state.params))
            rows = {k: batch[k][0] for k in ("input_ids", "positions", "segment_ids")}
            logp, _ = token_logps(state.model, rows, temperature, **fused)
            return jnp.pad(logp, ((0, 0), (1, 0)))[None]  # aligned with the row's tokens: column 0 predicts nothing

        return jax.jit(fn, static_argnums=2)

    def logps_of(self, batch: dict[str, jax.Array], *, reference: bool) -> jax.Array:
        """Per-token log-probs `[1, B, L]` of the rollout rows of `batch`: the policy's now (the old log-probs
        of `num_iterations`), or with `reference` the reference's."""
        with jax.set_mesh(self.mesh):
            if not reference:
                return self._logps_fn(self.state, batch, False)
            if self._reference is None:  # LoRA: the base is the policy with its adapters off
                return self._logps_fn(self.state, batch, True)
            return self._logps_fn(self._reference, batch, False)
