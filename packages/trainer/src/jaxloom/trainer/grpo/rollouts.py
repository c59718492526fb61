"""The rollout stage of GRPO (`Rollouts`, the trainer's batches component): the step's prompts from a cursor saved
with the state, completed by the policy's current weights in process (one prefill per prompt, rows compacted as
they end, log-probs recorded), scored, and laid out as rows as wide as the step's data."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import jaxloom.data as jd
from jaxloom.mesh import MeshConfig

from ..batches import Batches, DataSpec
from ..step import MODEL_INPUTS, STOP_KEY
from .loss import ADV, OLD, REF, ROUTES, SAMPLED
from .rewards import advantages, call_reward, concurrently, is_async, reward_name
from .drawing import Drawer, Drawn, ImagePrompts, prompt_of, row_buckets
from .ahead import RolloutDraws
from .pipeline import Pipeline
from .sampler import Sampler

log = logging.getLogger("jaxloom.trainer")


def read_records(data: Any) -> list[dict]:
    """Every record of `data` (records, an HF dataset, a path): prompt datasets are read whole."""
    if isinstance(data, list | tuple) and (not data or isinstance(data[0], dict)):
        return list(data)
    source = jd.as_source(data)
    names = source.shard_names() if callable(source.shard_names) else source.shard_names
    return [dict(r) for name in names for r in source.read_shard(name)]


class PromptOrder:
    """The prompts of each rollout: a permutation of the records per epoch (seeded), read in order by a cursor.
    `position` counts the optimizer steps served (a rollout serves `iterations` steps; `next()` gives the next
    step's rollout index); it is saved with every checkpoint (`global_state_dict`) and restored with the state
    (`state=`), checked against the records and settings it was saved with, as a text loader's position is."""

    KEYS = ("records", "prompts_per_rollout", "iterations", "seed", "shuffle")

    def __init__(
        self,
        records: list[dict],
        per_rollout: int,
        seed: int,
        shuffle: bool,
        iterations: int = 1,
        state: dict[str, Any] | None = None,
    ):
        self.records, self.per_rollout, self.seed, self.shuffle = records, per_rollout, seed, shuffle
        self.iterations, self.position = iterations, 0
        if state is not None:
            self.load(state)

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

    def load(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; an error naming what changed when the prompts or their order did."""
        if state.get("kind") != "rollouts":
            raise ValueError(
                f"the data position {state!r} is not a GRPO prompt position; expected the same trainer kind"
            )
        now = self.global_state_dict()
        changed = [f"{k}: {state[k]!r} → {now[k]!r}" for k in self.KEYS if k in state and state[k] != now[k]]
        if changed:
            raise ValueError(
                "the prompts or their order changed since this position was saved ("
                + "; ".join(changed)
                + "); expected the data and settings the run was started with (resume with them, or start a new run)"
            )
        self.position = int(state.get("position", 0))

    # what the core asks of a training loader
    def __next__(self) -> int:
        rollout = self.position // self.iterations
        self.position += 1
        return rollout

    def __iter__(self):
        return self

    def global_state_dict(self) -> dict[str, Any]:
        return {
            "kind": "rollouts",
            "position": self.position,
            "records": len(self.records),
            "prompts_per_rollout": self.per_rollout,
            "iterations": self.iterations,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a rollout asks of the run it serves, each a callable read when a rollout is made: the state being
    trained (`state()`: its model samples, its `rng` seeds the rollout), the step being trained (`step()`), the
    per-token log-probs of rollout rows (`logps(batch, reference)`: the policy's now, or the reference's) and the
    reward functions with their weights (`rewards()`: imported when first asked, at setup), the tools the model
    may call (`tools()`: a `ToolSet`, or None), the environments of its rows (`environments()`: `Environments`, or
    None) and a custom rollout (`rollout()`: TRL's `rollout_func` as `prompts -> dict`, or None)."""

    state: Callable[[], Any]
    step: Callable[[], int]
    logps: Callable[..., jax.Array]
    rewards: Callable[[], tuple[list[Callable], list[float]]]
    tools: Callable[[], Any] = lambda: None  # the run's `ToolSet` (tools.py), None without tools
    environments: Callable[[], Any] = lambda: None  # the run's `Environments` (environments.py), or None
    rollout: Callable[[], Any] = lambda: None  # `rollout_func` bound to its trainer: prompts -> rows, or None


class Rollouts(Batches):
    """The batches of a GRPO run: rollouts of the policy (see the module docstring), and its evaluation pass
    (`evaluate`: the rewards of completions to held-out prompts). Built from the run's arguments, the prompts
    (`dataset_train`, `dataset_eval`), the mesh, the tokenizer and the `Policy` it samples; `engine(prompt_ids,
    prompt_mask, key) -> (completion_ids, completion_mask)` may replace the in-process generation."""

    def __init__(
        self,
        arguments: Any,
        spec: DataSpec,
        *,
        mesh: Any,
        data_axes: tuple[str, ...],
        tokenizer: Callable[[], Any],
        dataset_train: Any,
        policy: Policy,
        dataset_eval: Any = None,
        engine: Callable | None = None,
        settings: Any = None,
    ):
        super().__init__(
            arguments,
            spec,
            mesh=mesh,
            data_axes=data_axes,
            tokenizer=tokenizer,
            dataset_train=dataset_train,
            dataset_eval=dataset_eval,
        )
        self.policy, self.engine = policy, engine
        self.rl = settings if settings is not None else arguments.rl  # the sampling settings (GRPO's `rl` group)
        self.records: list[dict] | None = None
        self.encoded: list[np.ndarray] | None = None  # each prompt's token ids, made once
        self.cached: tuple[int, dict] | None = None  # the last rollout's batch (num_iterations > 1 reuses it)
        self.metrics: list[tuple[int, dict[str, float]]] = []  # (step trained on it, metrics)
        self._stop_ids: tuple[int, ...] | None = None
        layout = MeshConfig(arguments.sharding_axis_dims, arguments.sharding_axis_names)  # a sampling mesh's
        self.sampler = Sampler(self.rl, lambda: policy.state().model, tokenizer, self.stop_ids, mesh, layout)
        images = None
        if spec.processor is not None:  # a vision-language policy (`DataSpec.with_images`)
            images = ImagePrompts(
                self.prompt_images,
                lambda: policy.state().model.config.image_token_index,
                spec.extra["pixel_values"][0][0],
            )
        self.drawer = Drawer(self.rl, tokenizer, policy, self.sampler, engine, self.stop_ids, self.score, images)
        self._eval: tuple[list[dict], list[np.ndarray]] | None = None
        self.draws = RolloutDraws(  # how each rollout is drawn, and drawn ahead (max_staleness >= 1)
            self.rl,
            arguments.total_batch_size,
            self.drawer,
            self.sampler,
            policy,
            self.rollout_prompts,
            last=lambda: self.arguments.max_training_steps or self.steps_for_epochs(),
        )

    # ---- what the core asks of the batches ----------------------------------------------------------------
    def prompt_records(self) -> list[dict]:
        """The prompt records, read once and checked: each has a `prompt` (text or chat messages), and images only
        for a policy that reads them."""
        if self.records is None:
            records = _prompt_records(self.dataset_train, "dataset_train", self.policy.environments() is not None)
            if self.spec.processor is None:  # a policy that reads no images: a record's images would be dropped
                for i, record in enumerate(records):
                    try:
                        jd.refuse_images(record)
                    except ValueError as e:
                        raise ValueError(f"dataset_train record {i}: {e}") from None
            self.records = records
        return self.records

    def stop_ids(self) -> tuple[int, ...]:
        """Where a completion ends: the tokenizer's EOS and, for chat prompts, the template's end of turn."""
        if self._stop_ids is None:
            from jaxloom.generation import end_of_turn_ids

            tok = self.tokenizer()
            ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
            if isinstance(prompt_of(self.prompt_records()[0]), list):
                ids |= set(end_of_turn_ids(tok))
            self._stop_ids = tuple(sorted(ids))
        return self._stop_ids

    def prompt_ids(self) -> list[np.ndarray]:
        """Every prompt's token ids (text as the tokenizer encodes it, chat through its template with the
        generation prompt), encoded once for the run; not yet cut to `max_prompt_length`."""
        if self.encoded is None:
            records = self.prompt_records()
            self.encoded = [np.asarray(ids, np.int32) for ids in self.encode(records, "dataset_train")]
        return self.encoded

    def encode(self, records: list[dict], source: str) -> list[list[int]]:
        """Token ids of the records' prompts: text as the tokenizer encodes it, chat through its template with the
        generation prompt — and, with tools or environments, the schemas of the tools of each record rendered by
        the template (chat prompts only, as TRL's). `source` names the records in an error."""
        prompts = [prompt_of(r) for r in records]
        chat = isinstance(prompts[0], list)
        tools, envs = self.policy.tools(), self.policy.environments()
        if self.spec.processor is not None:  # a vision-language policy: its prompts as its processor shows them
            return [list(self.shown(r, f"{source} record {i}")["input_ids"][0]) for i, r in enumerate(records)]
        if tools is None and envs is None:
            return jd_encode(self.tokenizer(), prompts, chat)
        if not chat:
            raise ValueError(
                f"tools and environments need chat prompts (a list of messages per record), as TRL's; {source}'s "
                "prompts are text"
            )
        if envs is None:
            return [tools.encode(p) for p in prompts]
        names = envs.names(records, source)
        return [envs.toolset(n).encode(p) for n, p in zip(names, prompts, strict=True)]

    def shown(self, record: dict, where: str) -> Any:
        """`record`'s prompt and images (TRL's `images` / `image`) through the policy's processor
        (`jaxloom.data.shown_prompt`); an error names `where`."""
        processor = self.spec.processor
        assert processor is not None  # only a vision-language policy's rollouts show images
        try:
            return jd.shown_prompt(prompt_of(record), jd.record_images(record, "images"), processor())[1]
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def prompt_images(self, records: list[dict], where: Sequence[str]) -> list[np.ndarray]:
        """Each prompt record's pixels `[n, C, S, S]` (made again for each rollout: a run holds no dataset's pixels)."""
        return [jd.shown_pixels(self.shown(r, w)) for r, w in zip(records, where, strict=True)]

    def longest_prompt(self) -> int:
        """The widest prompt a step can hold: `max_prompt_length`, or (None) the longest prompt of the data."""
        cap = self.rl.max_prompt_length
        longest = max(len(ids) for ids in self.prompt_ids())
        return longest if cap is None else min(cap, longest)

    def widest_row(self) -> int:
        """The widest row a step of this run can have (its prompt bucket + `max_completion_length`): what
        `jaxloom plan` budgets memory for."""
        rl = self.rl
        prompt, _ = row_buckets(self.longest_prompt(), 1, rl.max_completion_length)
        return prompt + rl.max_completion_length

    def per_rollout(self) -> int:
        """Prompts a rollout samples: `total_batch_size / num_generations`."""
        return self.arguments.total_batch_size // self.rl.num_generations

    def train_loader(self, state: Any = None) -> PromptOrder:  # type: ignore[override]
        """The prompt cursor (made once), at the restored position `state` when resuming (a checkpoint written
        before the cursor was saved resumes at its step)."""
        state = self.resume_state if state is None else state
        if self.train is None:
            a = self.arguments
            if state is not None and "position" not in state:
                state = {**state, "position": int(jax.device_get(self.policy.state().step))}
            self.train = PromptOrder(  # type: ignore[assignment]
                self.prompt_records(),
                self.per_rollout(),
                a.seed,
                a.shuffle_train_dataset,
                iterations=self.rl.num_iterations,
                state=state,
            )
        return self.train  # type: ignore[return-value]

    def steps_for_epochs(self) -> int:
        a = self.arguments
        rollouts = len(self.prompt_records()) // self.per_rollout()
        if rollouts == 0:
            raise ValueError(
                f"dataset_train has {len(self.prompt_records())} prompts; a step needs {self.per_rollout()} "
                "(total_batch_size / num_generations)"
            )
        return rollouts * self.rl.num_iterations * a.num_train_epochs

    def check_train_data(self) -> None:
        """Prompt records are read whole and checked (`prompt_records`), not as next-token text."""
        self.prompt_records()

    def check_eval_data(self) -> None:
        """Held-out prompt records (`dataset_eval`) are read whole and checked, as the training prompts are."""
        self.eval_prompts()

    def eval_prompts(self) -> tuple[list[dict], list[np.ndarray]] | None:
        """The held-out prompt records and their token ids (read, checked and encoded once), or None."""
        if self.dataset_eval is None:
            return None
        if self._eval is None:
            records = _prompt_records(self.dataset_eval, "dataset_eval", self.policy.environments() is not None)
            ids = self.encode(records, "dataset_eval")
            self._eval = (records, [np.asarray(i, np.int32) for i in ids])
        return self._eval

    def evaluate(self, batches: int, model: Any = None) -> dict[str, float]:
        """The evaluation pass (TRL's, for GRPO): `num_generations` completions of each held-out prompt sampled
        from `model` (default the current policy's) as in training, scored by the reward functions; up to `batches`
        groups of `total_batch_size / num_generations` prompts, in order (not shuffled), each seeded by its index.
        Returns the rollouts' metrics averaged over the prompts (`reward`, `reward_std`, `rewards/<func>/mean`,
        `completions/mean_length`, `completions/clipped_ratio`, `prompts/truncated`)."""
        records, ids = self.eval_prompts() or ([], [])
        if not records:
            raise ValueError("no dataset_eval was given")
        per, out = self.per_rollout(), []
        for i in range(min(batches, -(-len(records) // per))):
            chosen = list(range(i * per, min((i + 1) * per, len(records))))
            key = jax.random.fold_in(jax.random.PRNGKey(self.arguments.seed), 1_000_003 + i)
            where = [f"dataset_eval record {j}" for j in chosen]
            drawn = self.drawer.draw([records[j] for j in chosen], [ids[j] for j in chosen], key, where, model=model)
            _, metrics, _ = self.drawer.finish(drawn)
            out.append((len(chosen), metrics))
        weight = sum(n for n, _ in out)
        keep = [k for k in out[0][1] if not k.startswith(("time/", "rows/", "prompts/"))]
        means = {k: float(sum(n * m[k] for n, m in out) / weight) for k in keep}
        return {**means, "prompts/truncated": float(sum(m["prompts/truncated"] for _, m in out))}  # a count

    def global_batch(self, local: Any, *, stop_code: int | None = None) -> dict[str, jax.Array]:  # type: ignore[override]
        """The batch of rollout `local` (the cursor's `next()`): a new rollout, or the last one again within
        `num_iterations`."""
        a = self.arguments
        rollout = int(local)
        if self.cached is None or self.cached[0] != rollout:
            step = self.train.position - 1 if self.train is not None else 0  # the step this batch trains
            if step % self.rl.num_iterations:
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
        """Generate, score and lay out rollout `index` (its prompts, `num_generations` completions each); with
        `max_staleness >= 1` drawn ahead and scored on a thread (`pipeline`)."""
        pipeline = self.pipeline()
        if pipeline is not None:
            rows, metrics, sampled = pipeline.take(index)
        else:
            rows, metrics, sampled = self.drawer.finish(self.draws.draw(index))  # type: ignore[arg-type]
        self.metrics.append((self.policy.step() + 1, metrics))
        return self.layout(rows, sampled)

    def rollout_prompts(self, index: int) -> tuple[list[dict], list[np.ndarray], list[str]]:
        """Rollout `index`'s prompt records, their token ids and where each record is (named in errors)."""
        indices = self.train_loader().indices(index)
        records = [self.prompt_records()[i] for i in indices]
        return records, [self.prompt_ids()[i] for i in indices], [f"dataset_train record {i}" for i in indices]

    def redraw(self, index: int, saved: dict[str, Any]) -> Drawn:
        """Rollout `index` as a checkpoint saved it drawn (`RolloutDraws.redraw`)."""
        return self.draws.redraw(index, saved)

    def pipeline(self) -> Pipeline | None:
        """The asynchronous rollouts (`max_staleness >= 1`), made when first asked (from the saved drawn rollouts
        when resuming); None when synchronous."""
        return self.draws.pipeline(self.resume_state)

    def checkpoint_state(self) -> Any:
        """The prompt cursor's position and, asynchronous, the rollouts drawn and not yet trained."""
        state = super().checkpoint_state()
        pipeline = self.draws.made
        if state is not None and pipeline is not None:
            state = {**state, "pipeline": pipeline.state()}
        return state

    def close(self) -> None:
        self.draws.close()
        super().close()

    def score(
        self,
        prompts: list[Any],
        completions: list[Any],
        columns: dict[str, list],
        completion: np.ndarray,
        completion_mask: np.ndarray,
        where: Sequence[str] | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """GRPO's scoring of a rollout's completions (rows `i * num_generations + j`; `where`: each row's record,
        named in an error): the reward functions called on them, their weighted sum and its advantage per row
        (`ADV`); TRL's metrics (`reward`, `reward_std`, `rewards/<func>/mean`) and `time/reward_s`. A kind that
        scores otherwise (distillation: not at all) overrides it: `(rows' extra columns, metrics)`."""
        return group_rewards(
            self.policy, self.rl, prompts, completions, columns, completion, completion_mask, where=where
        )

    def layout(self, rows: dict[str, np.ndarray], sampled: np.ndarray | None) -> dict[str, jax.Array]:
        """A rollout's host rows (`Drawer.finish`) as the train step's global batch `[1, B, ...]`: the tokens, the
        scores of each row (the advantages; RLOO's rewards), the old and reference log-probs (computed now when
        `num_iterations > 1` / `beta > 0`), the sampler's log-probs at their tokens' columns and, for an MoE policy, the
        experts the sampler sent each token to (`ROUTES`)."""
        rl, width = self.rl, int(rows["width"])
        batch = {k: self._put(rows[k][None]) for k in ("input_ids", "segment_ids", "positions", "loss_mask")}
        for key, (shape, _) in self.spec.extra.items():  # one value per row: the advantage (RLOO: the reward)
            if shape == () and key in rows:
                batch[key] = self._put(rows[key][None])
        for key in MODEL_INPUTS:  # a vision-language policy's images, and its image tokens' types
            if key in rows:
                batch[key] = self._put(rows[key][None])
        b, length = rows["input_ids"].shape
        zeros = np.zeros((1, b, length), np.float32)
        if ROUTES in self.spec.extra:  # an MoE sampler's experts per token; -1 where none were recorded (the
            # old and reference log-probs replay them too)
            layers, k = self.spec.extra[ROUTES][0][1:]
            routes = rows.get("routes")
            if routes is None or routes.shape != (b, length, layers, k):
                routes = np.full((b, length, layers, k), -1, np.int16)
            batch[ROUTES] = self._put(routes[None])
        batch[OLD] = self.policy.logps(batch, reference=False) if rl.num_iterations > 1 else self._put(zeros)
        batch[REF] = self.policy.logps(batch, reference=True) if rl.beta else self._put(zeros)
        if SAMPLED in self.spec.extra:  # the sampler's log-prob of each completion token, at the token's column
            at_tokens = np.zeros((b, length), np.float32)
            if sampled is not None:
                at_tokens[:, width:] = sampled
            batch[SAMPLED] = self._put(at_tokens[None])
        return batch

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


def _prompt_records(data: Any, name: str, environments: bool = False) -> list[dict]:
    """Every record of `data` (read whole), checked: each has a `prompt` (text or chat messages) — or, when
    `environments` own the data, may have none (its environment's `reset` gives it)."""
    records = read_records(data)
    if not records:
        raise ValueError(f"{name} has no records; expected prompt records ({{'prompt': ...}})")
    for i, r in enumerate(records[:1000]):
        if "prompt" not in r and not environments:
            raise ValueError(
                f"{name} record {i} has no 'prompt' column (it has {sorted(r)}); GRPO reads a "
                "prompt (text, or a list of chat messages) per record, other columns go to the rewards"
            )
    return records


def jd_encode(tokenizer: Any, prompts: Sequence[Any], chat: bool) -> list[list[int]]:
    """Token ids of each prompt: text as the tokenizer encodes it, chat messages through its template with
    the generation prompt (TRL's conversational form)."""
    from jaxloom.generation import encode_prompts

    return encode_prompts(tokenizer, list(prompts), apply_chat_template=chat)


def group_rewards(
    policy: Policy,
    rl: Any,
    prompts: list[Any],
    completions: list[Any],
    columns: dict[str, list],
    completion: np.ndarray,
    completion_mask: np.ndarray,
    where: Sequence[str] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """GRPO's scoring (`Rollouts.score`): `policy`'s reward functions called on the completions (`async def` ones
    concurrently, beside the others, as TRL gathers them), their weighted sum and its group-relative advantage per
    row (`ADV`, groups of `rl.num_generations`), and TRL's metrics. A failure is raised in the functions' order."""
    group, started = rl.num_generations, time.perf_counter()
    funcs, weights = policy.rewards()
    ids = [list(c[m > 0]) for c, m in zip(completion, completion_mask, strict=True)]

    def call(f: Callable) -> np.ndarray:
        return call_reward(f, prompts, completions, columns, timeout=rl.reward_timeout, where=where, completion_ids=ids)

    results = concurrently(call, funcs, [is_async(f) for f in funcs])
    rewards = np.stack(results, axis=1)
    total = np.nansum(rewards * np.asarray(weights)[None], axis=1)
    adv, std = advantages(total, group, rl.scale_rewards)
    metrics = {
        "reward": float(np.mean(total)),
        "reward_std": float(np.mean(std)),
        **{f"rewards/{reward_name(f)}/mean": float(np.nanmean(rewards[:, j])) for j, f in enumerate(funcs)},
        "time/reward_s": time.perf_counter() - started,
    }
    return {ADV: adv.astype(np.float32)}, metrics
