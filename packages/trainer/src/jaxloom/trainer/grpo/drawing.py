"""A GRPO rollout made (`Drawer`): the prompt rows of a step's records, their completions drawn by the sampler (or
an external engine, or TRL's `rollout_func`), with tool turns and environments (`draw`, the part that holds the
device), then scored and laid out as host rows (`finish`, host work only). `Drawn` is what lies between the two:
an asynchronous run (`max_staleness >= 1`) scores it on a thread while the device trains."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..usercode import UserCodeError, describe
from .environments import EnvironmentCallError, environment_rows, raise_naming_the_record
from .tools import tool_turns

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

    return bucket(longest_prompt, PROMPT_BUCKET), min(
        max_completion_length, bucket(longest_completion, COMPLETION_BUCKET)
    )


@dataclasses.dataclass
class Drawn:
    """A rollout drawn and not yet scored (`Rollouts.draw`): each row's prompt (text or messages), the columns the
    rewards read, where each row's record is (named in errors), the prompt rows (`prompt`, `prompt_mask`, `width`
    columns; `kept`: each row's prompt tokens; `truncated`: prompts cut) and the completions (`completion`,
    `completion_mask`, the sampler's log-probs `sampled`, `keep`: 1 on the model's own tokens, or None), the tool
    exchange (`turns`), an MoE sampler's experts per token of `[prompt | completion]` (`routes`, or None), a
    `rollout_func`'s own fields for the rewards (`fields`, or None), with partial rollouts the policy version that
    drew each completion token (`versions`, -1 on padding; None otherwise) and the seconds drawing took."""

    prompts: list[Any]
    columns: dict[str, list]
    where: list[str] = dataclasses.field(default_factory=list)
    chat: bool = False
    row_ids: list[np.ndarray] = dataclasses.field(default_factory=list)
    kept: list[np.ndarray] = dataclasses.field(default_factory=list)
    prompt: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), np.int32))
    prompt_mask: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), np.int32))
    width: int = 0
    truncated: int = 0
    completion: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), np.int32))
    completion_mask: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), np.int32))
    sampled: np.ndarray | None = None
    keep: np.ndarray | None = None
    turns: Any = None
    routes: np.ndarray | None = None
    fields: dict[str, list] | None = None
    versions: np.ndarray | None = None
    seconds: float = 0.0
    pixels: list[np.ndarray] | None = None  # a vision-language policy's rows: each row's prompt images

    def completed(self, completion, completion_mask, sampled, keep, routes=None, versions=None) -> None:
        """The completions (and `routes`, `[rows, prompt + completion columns, layers, k]`; `versions`, per completion
        token), cut to their bucket (the longest completion's, at most their width)."""
        _, width = row_buckets(self.width, int(np.max(completion_mask.sum(axis=1), initial=1)), completion.shape[1])
        self.completion = np.asarray(completion)[:, :width]
        self.completion_mask = np.asarray(completion_mask)[:, :width]
        self.sampled = None if sampled is None else np.asarray(sampled)[:, :width]
        self.keep = None if keep is None else np.asarray(keep)[:, :width]
        self.routes = None if routes is None else np.asarray(routes)[:, : self.width + width]
        self.versions = None if versions is None else np.asarray(versions)[:, :width]


@dataclasses.dataclass(frozen=True)
class ImagePrompts:
    """A vision-language policy's prompt images: `pixels(records, where)` each prompt record's `[n, C, S, S]`, the
    model's `image_token()` (whose positions the rows' `token_type_ids` mark), and the image `slots` of a row."""

    pixels: Callable[[list[dict], Sequence[str]], list[np.ndarray]]
    image_token: Callable[[], int]
    slots: int


def one_at_a_time(method: Callable) -> Callable:
    """`method` run under its object's `lock`."""

    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return locked


class Drawer:
    """Rollouts made as the sampling settings `rl` say, from the `policy`'s environments, tools and custom rollout,
    through the `sampler` (or `engine(prompt_ids, prompt_mask, key) -> (completion_ids, completion_mask)`),
    completions ending at `stop_ids()`, decoded with `tokenizer()`, scored by `score(prompts, completions, columns,
    completion, completion_mask, where=)` (the batches component's: GRPO's rewards, RLOO's, none for
    distillation); `images`: a vision-language policy's prompt images (`ImagePrompts`; its prompts shown their
    images in the one prefill of each group; None: text prompts)."""

    def __init__(
        self,
        rl: Any,
        tokenizer: Callable[[], Any],
        policy: Any,
        sampler: Any,
        engine: Callable | None,
        stop_ids: Callable[[], tuple[int, ...]],
        score: Callable[..., tuple[dict[str, np.ndarray], dict[str, float]]],
        images: ImagePrompts | None = None,
    ):
        self.rl, self.tokenizer, self.policy, self.sampler = rl, tokenizer, policy, sampler
        self.engine, self.stop_ids, self.score, self.images = engine, stop_ids, score, images
        self.lock = threading.Lock()  # one rollout at a time on the sampler (a drawing thread, an evaluation)

    def prompt_rows(self, records: list[dict], encoded: list[np.ndarray], where: Sequence[str] | None) -> Drawn:
        """The prompt side of a rollout (host only, deterministic): each record `num_generations` times, its
        prompt, its columns for the rewards and the prompt rows left-padded to their bucket (`max_prompt_length`
        keeps each prompt's end); no completion yet."""
        group = self.rl.num_generations
        where = list(where) if where is not None else [f"prompt {i} of this step" for i in range(len(records))]
        row_records = [r for r in records for _ in range(group)]
        prompts = [prompt_of(r) for r in row_records]
        drawn = Drawn(prompts, {k: [r.get(k) for r in row_records] for k in records[0] if k != "prompt"})
        drawn.where, drawn.chat = [w for w in where for _ in range(group)], isinstance(prompts[0], list)
        drawn.row_ids = [ids for ids in encoded for _ in range(group)]
        return drawn

    def lay_prompts(self, drawn: Drawn, kept: list[np.ndarray], truncated: int) -> None:
        """`drawn`'s prompt rows: `kept` (each row's prompt tokens) left-padded to their bucket."""
        tok = self.tokenizer()
        width, _ = row_buckets(max(map(len, kept)), 1, self.rl.max_completion_length)
        drawn.prompt = np.full((len(kept), width), tok.pad_token_id or 0, np.int32)
        drawn.prompt_mask = np.zeros((len(kept), width), np.int32)
        for i, ids in enumerate(kept):
            drawn.prompt[i, width - len(ids) :], drawn.prompt_mask[i, width - len(ids) :] = ids, 1
        drawn.kept, drawn.width, drawn.truncated = kept, width, truncated

    def environment_rows(
        self, drawn: Drawn, records: list[dict], slot: int | None
    ) -> tuple[Any, list[dict[str, Callable]] | None]:
        """With TRL's environments, `drawn`'s rows each take an instance (from pool `slot`), reset with its record
        (its text appended to the row's prompt; the instances are the rewards' `environments` column). Returns the
        `ToolSet` that parses the rows' calls (the run's tools without environments) and each row's tools (None)."""
        envs = self.policy.environments()
        if envs is None:
            return self.policy.tools(), None
        drawn.prompts, drawn.row_ids, tools, row_tools, drawn.columns["environments"] = environment_rows(
            envs, records, self.rl.num_generations, drawn.prompts, drawn.row_ids, drawn.where, slot
        )
        return tools, row_tools

    def cut_prompts(self, drawn: Drawn) -> None:
        """`drawn`'s prompt rows from its rows' prompt tokens, each cut to `max_prompt_length` (its end kept: it
        leads into the reply; the prompts cut counted)."""
        cap, group, row_ids = self.rl.max_prompt_length, self.rl.num_generations, drawn.row_ids
        if drawn.pixels is not None and cap is not None:  # an image's tokens are never cut
            for ids, where in zip(row_ids[::group], drawn.where[::group], strict=True):
                if len(ids) > cap:
                    raise ValueError(
                        f"{where}: its prompt shows images in {len(ids)} tokens, more than max_prompt_length {cap}; "
                        "image tokens are never cut: raise max_prompt_length (or None)"
                    )
        kept = [ids if cap is None else ids[-cap:] for ids in row_ids]
        self.lay_prompts(drawn, kept, sum(cap is not None and len(ids) > cap for ids in row_ids[::group]))

    @one_at_a_time
    def draw(
        self,
        records: list[dict],
        encoded: list[np.ndarray],
        key: jax.Array,
        where: Sequence[str] | None = None,
        *,
        model: Any = None,
        budget: int | None = None,
        version: int = 0,
        slot: int | None = None,
    ) -> Drawn:
        """A rollout's completions, not yet scored (the part that holds the device): with environments each row's
        instance is reset first (its text appended to the prompt); a `rollout_func` replaces the generation; with
        tools the exchange continues (`tool_turns`). `budget` (partial rollouts, in-process sampling): at most that
        many tokens per completion, each tagged with the policy `version` (`extend` continues them). `slot`: the
        pool of environment instances the rollout takes (one per rollout in flight, asynchronous GRPO)."""
        rl, tok = self.rl, self.tokenizer()
        started = time.perf_counter()
        group = rl.num_generations
        drawn = self.prompt_rows(records, encoded, where)
        if self.images is not None:
            drawn.pixels = [p for p in self.images.pixels(records, drawn.where[::group]) for _ in range(group)]
        tools, row_tools = self.environment_rows(drawn, records, slot)
        custom = self.policy.rollout()
        keep, routes = None, None
        if custom is not None:  # TRL's rollout_func: the user's own generation, its extra fields to the rewards
            prompts = copy.deepcopy(drawn.prompts)
            out = _rollout_rows(call_rollout(custom, prompts), len(prompts), rl.max_completion_length)
            drawn.row_ids = [np.asarray(ids, np.int32) for ids in out.pop("prompt_ids")]
            self.lay_prompts(drawn, drawn.row_ids, 0)
        else:
            self.cut_prompts(drawn)
        prompt, prompt_mask = drawn.prompt, drawn.prompt_mask
        if custom is not None:
            completion, completion_mask, sampled, keep = _custom_completions(out, tok, rl.max_completion_length)
            if rl.max_staleness:  # drawn ahead: a checkpoint saves the fields with the rollout
                check_saveable(out)
            drawn.columns.update(out)  # what is left: the fields for the reward functions
            drawn.fields = out
        elif self.engine is not None:  # an external engine: the prompt rows as they are trained on, no log-probs
            completion, completion_mask = self.engine(prompt, prompt_mask, key)
            sampled = None
        elif drawn.pixels is not None:  # images: one prefill per prompt and its images, shared by its group
            pixels = np.concatenate([p for p in drawn.pixels[::group] if len(p)] or [np.zeros((0,), np.float32)])
            completion, completion_mask, sampled = self.sampler.generate(
                prompt[::group], prompt_mask[::group], key, model=model, max_new_tokens=budget,
                pixel_values=pixels if len(pixels) else None,
            )  # fmt: skip
        elif _grouped(prompt, prompt_mask, group):  # one prefill per prompt, shared by its group
            self.sampler.keep_pages = tools is not None  # the paged engine then keeps each row's pages for tool turns
            completion, completion_mask, sampled = self.sampler.generate(
                prompt[::group], prompt_mask[::group], key, model=model, max_new_tokens=budget
            )
            routes = self.sampler.routes
        else:  # an environment's observation made a group's prompts differ: a prefill per row
            self.sampler.keep_pages = tools is not None
            completion, completion_mask, sampled = self.sampler.generate(
                prompt, prompt_mask, key, group=1, model=model, max_new_tokens=budget
            )
            routes = self.sampler.routes
        if tools is not None and sampled is not None:  # TRL's tool loop (in-process generation only)
            buckets = (PROMPT_BUCKET, COMPLETION_BUCKET)
            drawn.turns = tool_turns(
                self.sampler, drawn.kept, completion, completion_mask, sampled, key, buckets, tools, row_tools, model
            )
            completion, completion_mask, sampled = _padded(drawn.turns, rl.max_completion_length, tok.pad_token_id or 0)
            keep = _padded_keep(drawn.turns, completion_mask.shape[1])
            routes = None  # the turns' tokens were decoded apart: no replay
        self.sampler.done()  # the rollout's paged engine and its kept pages are done with
        versions = None if budget is None else np.where(completion_mask > 0, version, -1).astype(np.int32)
        drawn.completed(completion, completion_mask, sampled, keep, routes, versions)
        drawn.seconds = time.perf_counter() - started
        return drawn

    def running(self, drawn: Drawn) -> np.ndarray:
        """Which rows of a partial rollout still run: no stop token yet and fewer than `max_completion_length`
        tokens (`[rows]` bool; none without `versions`, a rollout drawn whole)."""
        if drawn.versions is None:
            return np.zeros(len(drawn.completion), bool)
        stops = np.asarray(self.stop_ids(), np.int32)
        on = drawn.completion_mask > 0
        ended = (np.isin(drawn.completion, stops) & on).any(axis=1)
        return ~ended & (on.sum(axis=1) < self.rl.max_completion_length)

    @one_at_a_time
    def extend(self, drawn: Drawn, key: jax.Array, version: int, *, finish: bool, model: Any = None) -> Drawn:
        """Partial rollouts: `drawn`'s running completions continued by the policy `version` (`model`; default the
        current weights) — each row's `[prompt | completion so far]` prefilled by those weights, at most
        `partial_rollout_tokens` new tokens (`finish`: to the end: a stop token or `max_completion_length`), tagged
        with `version`, their log-probs the sampler's. The same `drawn` when nothing runs."""
        rl, tok = self.rl, self.tokenizer()
        rows = np.flatnonzero(self.running(drawn))
        if not len(rows):
            return drawn
        started, cap, pad = time.perf_counter(), rl.max_completion_length, tok.pad_token_id or 0
        lengths = (drawn.completion_mask > 0).sum(axis=1)
        histories = [np.concatenate([drawn.kept[r], drawn.completion[r, : lengths[r]]]) for r in rows]
        width, _ = row_buckets(max(map(len, histories)), 1, cap)
        prompt, mask = np.full((len(rows), width), pad, np.int32), np.zeros((len(rows), width), np.int32)
        for i, ids in enumerate(histories):
            prompt[i, width - len(ids) :], mask[i, width - len(ids) :] = ids, 1
        # the most a running row may still draw: few values (a running row holds whole parts), so few compiles
        steps = cap - int(lengths[rows].min()) if finish else rl.partial_rollout_tokens
        new, new_mask, new_logps = self.sampler.generate(prompt, mask, key, group=1, max_new_tokens=steps, model=model)
        self.sampler.done()
        completion = np.full((len(drawn.completion), cap), pad, np.int32)
        completion_mask, versions = np.zeros_like(completion), np.full_like(completion, -1)
        sampled = np.zeros(completion.shape, np.float32)
        have = drawn.completion.shape[1]
        completion[:, :have], completion_mask[:, :have] = drawn.completion, drawn.completion_mask
        versions[:, :have] = drawn.versions
        if drawn.sampled is not None:
            sampled[:, :have] = drawn.sampled
        for i, r in enumerate(rows):
            n = min(int(new_mask[i].sum()), cap - int(lengths[r]))
            at = slice(int(lengths[r]), int(lengths[r]) + n)
            completion[r, at], completion_mask[r, at], sampled[r, at] = new[i, :n], 1, new_logps[i, :n]
            versions[r, at] = version
        out = dataclasses.replace(drawn)
        out.completed(completion, completion_mask, sampled, drawn.keep, None, versions)
        out.seconds = drawn.seconds + time.perf_counter() - started
        return out

    def finish(self, drawn: Drawn) -> tuple[dict[str, np.ndarray], dict[str, float], np.ndarray | None]:
        """A drawn rollout scored (host only: the completions' text, the rewards): `(rows, metrics, sampler
        log-probs)`, rows `i * num_generations + j` as host arrays (`input_ids`, `segment_ids`, `positions`,
        `loss_mask`, the advantage per row under `ADV`, and `width`: the prompt columns) — what an asynchronous run
        (`max_staleness >= 1`) does on a thread while the device trains."""
        rl, tok = self.rl, self.tokenizer()
        completion, completion_mask, keep = drawn.completion, drawn.completion_mask, drawn.keep
        prompt, prompt_mask = drawn.prompt, drawn.prompt_mask
        texts = [
            tok.decode(c[m > 0], skip_special_tokens=True) for c, m in zip(completion, completion_mask, strict=True)
        ]
        completions: list[Any] = [[{"role": "assistant", "content": x}] for x in texts] if drawn.chat else texts
        if drawn.turns is not None:  # the turns as messages: assistant (with its tool calls), tool, assistant, ...
            completions = drawn.turns.messages
        try:
            scored, score_metrics = self.score(
                drawn.prompts, completions, drawn.columns, completion, completion_mask, where=drawn.where
            )
        except EnvironmentCallError as e:
            raise_naming_the_record(e, drawn.where)
        eos = set(self.stop_ids())
        ended = np.asarray(
            [any(int(x) in eos for x in c[m > 0]) for c, m in zip(completion, completion_mask, strict=True)]
        )
        loss_mask = completion_mask.copy()
        if keep is not None:  # tool and environment tokens are read, never trained on (nor in the KL or the entropy)
            loss_mask = loss_mask * keep
        if rl.mask_truncated_completions:
            loss_mask[~ended] = 0
        ids = np.concatenate([prompt, completion], axis=1)
        seg = np.concatenate([prompt_mask, completion_mask], axis=1)
        rows = {
            "input_ids": ids,
            "segment_ids": seg,
            "positions": np.maximum(np.cumsum(seg, axis=1) - 1, 0).astype(np.int32),
            "loss_mask": np.concatenate([np.zeros_like(prompt_mask), loss_mask], axis=1),
            **scored,
            "width": np.asarray(drawn.width),
        }
        if drawn.routes is not None:  # an MoE sampler's experts per token (`routing_replay`)
            rows["routes"] = drawn.routes
        if drawn.pixels is not None:  # each row's prompt images in its slots, its image tokens' types
            assert self.images is not None
            rows.update(image_rows(drawn.pixels, ids, self.images.image_token(), self.images.slots))
        lengths = (completion_mask if keep is None else completion_mask * keep).sum(axis=1)  # the model's tokens (TRL)
        metrics = {
            **score_metrics,
            "completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": float(np.mean(~ended)),
            "prompts/truncated": float(drawn.truncated),
            "rows/width": float(ids.shape[1]),
            "time/rollout_s": drawn.seconds,
        }
        if drawn.turns is not None:
            metrics.update(drawn.turns.metrics())
        sampled = drawn.sampled
        return rows, metrics, (None if sampled is None else np.where(completion_mask > 0, sampled, 0.0))


def image_rows(pixels: list[np.ndarray], ids: np.ndarray, image_token: int, slots: int) -> dict[str, np.ndarray]:
    """A rollout's rows' images as the train step reads them: `pixel_values [B, slots, C, S, S]` (each row's
    prompt images in its first slots) and `token_type_ids [B, L]` (1 on `image_token`, as the processor marks
    them). A prompt with more images than `slots` is one error."""
    shape = next((p.shape[1:] for p in pixels if len(p)), None)
    out = np.zeros((len(pixels), slots, *(shape or (0,))), np.float32)
    for i, p in enumerate(pixels):
        if len(p) > slots:
            raise ValueError(f"a prompt shows {len(p)} images; a row holds at most {slots} (max_images_per_row)")
        out[i, : len(p)] = p
    return {"pixel_values": out, "token_type_ids": (ids == image_token).astype(np.int32)}


def check_saveable(fields: dict[str, list]) -> None:
    """A `rollout_func`'s fields of a rollout drawn ahead (`max_staleness >= 1`) are saved with a checkpoint as JSON:
    each value must come back from JSON as it is (strings, numbers, booleans, None, lists, dicts with string keys),
    or a resumed run would score other values; else one error naming the field, its row and what it holds."""
    for name, values in fields.items():
        for row, value in enumerate(values):
            try:
                same = _same_json(json.loads(json.dumps(value)), value) and _json_types(value)
            except (TypeError, ValueError):
                same = False
            if not same:
                raise ValueError(
                    f"rollout_func's field {name!r} row {row} holds {type(value).__name__} {value!r:.80}, which a "
                    "checkpoint cannot save as it is; with max_staleness >= 1 a drawn rollout's fields are saved as "
                    "JSON: return strings, numbers, booleans, None, lists or dicts with string keys (or set "
                    "max_staleness = 0)"
                )


def _same_json(back: Any, value: Any) -> bool:
    """Whether `back` (`value` through JSON) is `value`: equal, NaN as NaN (JSON keeps it; `NaN != NaN`)."""
    if isinstance(value, float) and isinstance(back, float) and value != value:
        return back != back
    if isinstance(value, list) and isinstance(back, list):
        return len(back) == len(value) and all(map(_same_json, back, value))
    if isinstance(value, dict) and isinstance(back, dict):
        return back.keys() == value.keys() and all(_same_json(back[k], value[k]) for k in value)
    return bool(back == value)


def _json_types(value: Any) -> bool:
    """Whether `value` is made of JSON's own types only (a tuple would come back a list)."""
    if isinstance(value, list):
        return all(map(_json_types, value))
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_types(v) for k, v in value.items())
    return value is None or isinstance(value, str | bool | int | float)


def _padded(turns: Any, width: int, pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tool exchange's rows as `(completion_ids, completion_mask, sampled log-probs)`, `[rows, width]`."""
    rows = len(turns.ids)
    ids, mask, logps = np.full((rows, width), pad, np.int32), np.zeros((rows, width), np.int32), np.zeros((rows, width))
    for i in range(rows):
        n = len(turns.ids[i])
        ids[i, :n], mask[i, :n], logps[i, :n] = turns.ids[i], 1, turns.logps[i]
    return ids, mask, logps.astype(np.float32)


def _padded_keep(turns: Any, width: int) -> np.ndarray:
    """Which completion tokens the model wrote (1) rather than a tool turn (0), `[rows, width]`."""
    keep = np.zeros((len(turns.keep), width), np.int32)
    for i, k in enumerate(turns.keep):
        keep[i, : len(k)] = k[:width]
    return keep


EMPTY_PROMPT = [{"role": "user", "content": ""}]
"""The prompt of a record without one, when an environment owns the data (its `reset` returns the prompt; TRL's)."""


def prompt_of(record: dict) -> Any:
    """A record's prompt (text or chat messages); an environment's record may have none (`EMPTY_PROMPT`)."""
    return record.get("prompt", EMPTY_PROMPT)


def _grouped(prompt: np.ndarray, mask: np.ndarray, group: int) -> bool:
    """Whether every row of each group of `group` rows holds its group's first prompt (then one prefill serves it)."""
    first = np.repeat(np.arange(0, len(prompt), group), group)
    return bool((prompt == prompt[first]).all() and (mask == mask[first]).all())


ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")


class RolloutFuncError(UserCodeError):
    """A `rollout_func` raised: the run stops, naming it."""


def call_rollout(custom: Callable, prompts: list) -> Any:
    """`custom(prompts)` (TRL's `rollout_func`, bound to its trainer); a raise stops the run naming the function,
    with the user's frames."""
    try:
        return custom(prompts)
    except Exception as e:  # noqa: BLE001 - user code: name it
        name = getattr(custom, "__name__", None) or getattr(getattr(custom, "func", None), "__name__", "rollout_func")
        raise RolloutFuncError(
            f"rollout_func {name} raised on this step's {len(prompts)} prompts ({describe(e)})"
        ) from e


def _rollout_rows(out: Any, rows: int, max_completion_length: int) -> dict[str, list]:
    """The output of a `rollout_func` checked (TRL's contract: `prompt_ids`, `completion_ids` and `logprobs`, one list
    per row — each prompt `num_generations` times — and optionally `env_mask`; other fields go to the reward
    functions, one value per row); a completion longer than `max_completion_length` is cut to it, counted as clipped."""
    if not isinstance(out, dict):
        raise ValueError(f"rollout_func returned {type(out).__name__}; expected a dict with {list(ROLLOUT_KEYS)}")
    missing = [k for k in ROLLOUT_KEYS if k not in out]
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict (one list per row)")
    checked = {}
    for k, v in out.items():
        v = list(v) if not isinstance(v, str) else v
        if not isinstance(v, list) or len(v) != rows:
            n = len(v) if isinstance(v, list) else type(v).__name__
            raise ValueError(
                f"rollout_func's {k!r} has {n} entries for {rows} rows; expected one per row (each prompt "
                "num_generations times, rows i * num_generations + j)"
            )
        checked[k] = v
    for k in ("logprobs", "env_mask"):
        given = checked.get(k, checked["completion_ids"])
        for i, (ids, values) in enumerate(zip(checked["completion_ids"], given, strict=True)):
            if len(values) != len(ids):
                raise ValueError(
                    f"rollout_func's {k!r} row {i} has {len(values)} values for {len(ids)} completion tokens; "
                    "expected one per token"
                )
    for k in ("completion_ids", "logprobs", "env_mask"):
        if k in checked:
            checked[k] = [list(v)[:max_completion_length] for v in checked[k]]
    return checked


def _custom_completions(
    out: dict[str, list], tok: Any, cap: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """A `rollout_func`'s completions (`_rollout_rows`, its fields popped from `out`) as `(completion_ids, mask,
    sampled log-probs, keep)`, `keep` from its `env_mask` (TRL's: 1 on the model's tokens), or None."""
    completion, mask, sampled = _padded_rows(out.pop("completion_ids"), out.pop("logprobs"), tok, cap)
    env_mask = out.pop("env_mask", None)
    keep = None if env_mask is None else (_padded_rows(env_mask, env_mask, tok, cap)[2] > 0).astype(np.int32)
    return completion, mask, sampled, keep


def _padded_rows(ids: list, values: list, tok: Any, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ragged completion rows (`ids`, and `values` per token) right-padded to `width`: `(ids, mask, values)`."""
    out = np.full((len(ids), width), tok.pad_token_id or 0, np.int32)
    mask, vals = np.zeros((len(ids), width), np.int32), np.zeros((len(ids), width), np.float32)
    for i, (row, v) in enumerate(zip(ids, values, strict=True)):
        out[i, : len(row)], mask[i, : len(row)], vals[i, : len(v)] = row, 1, v
    return out, mask, vals
