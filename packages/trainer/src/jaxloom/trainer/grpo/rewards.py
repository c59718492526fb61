"""Reward functions (user code, TRL's form) and group-relative advantages."""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pathlib import Path

from ..usercode import UserCodeError, awaited, defined_at, describe, stuck_frames
from .environments import EnvironmentCallError


class RewardError(UserCodeError):
    """A reward function failed (raised, returned NaN or the wrong number of rewards, passed `reward_timeout`)."""


def load_reward_function(spec: Any, *, mesh: Any = None, data_axes: tuple[str, ...] = ()) -> Callable:
    """A reward function from a callable, a dotted import path (`my_rewards.accuracy`) or the directory of a reward
    model (a transformers `*ForSequenceClassification` of one label, as TRL takes a model there: `RewardModel`,
    sharded over `mesh` with its rows split over `data_axes` when given), checked to take TRL's keywords
    (`prompts`, `completions`, and the dataset's columns through `**kwargs`)."""
    if isinstance(spec, str) and (Path(spec) / "config.json").is_file():
        return RewardModel(spec, mesh=mesh, data_axes=data_axes)
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


def load_tool(spec: Any, what: str = "tools") -> Callable:
    """A tool the model may call (or another piece of user code, `what` naming its setting): a callable, or a dotted
    import path (`my_tools.get_weather`) imported as reward functions are."""
    if isinstance(spec, str):
        module, _, name = spec.rpartition(".")
        try:
            spec = getattr(_import_from_here(module), name) if module else None
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{what}: {spec!r} does not import ({type(e).__name__}: {e})") from None
        if spec is None:
            raise ValueError(f"{what}: expected a dotted import path such as my_module.name")
    if not callable(spec):
        raise TypeError(f"{what}: {spec!r} is not callable")
    return spec


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


class RewardTimeoutError(RewardError):
    """A reward function did not return within `reward_timeout` seconds."""


def within(fn: Callable, seconds: float | None, name: str, **kwargs: Any) -> Any:
    """`fn(**kwargs)` (awaited when `fn` is `async def`, as TRL accepts), cut after `seconds` (None: no limit) with
    `RewardTimeoutError` naming `name` and showing where the function was waiting. The call runs in a daemon thread,
    which Python cannot stop: a function cut off keeps running there, but the run no longer waits for it and the
    process can exit."""
    if seconds is None:
        return awaited(fn(**kwargs))
    import threading

    done, box = threading.Event(), {}

    def run() -> None:
        try:
            box["out"] = awaited(fn(**kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=run, name=f"jaxloom-reward-{name}", daemon=True)
    thread.start()
    if not done.wait(seconds):
        raise RewardTimeoutError(
            f"reward function {name} did not return within reward_timeout = {seconds:g} s (it hangs, or is slower "
            "than expected: raise reward_timeout, or None for no limit)",
            frames=stuck_frames(thread.ident),
        )
    if "error" in box:
        raise box["error"]
    return box["out"]


def is_async(fn: Callable) -> bool:
    """Whether `fn` is an `async def` function (or an object whose `__call__` is): TRL's async reward functions."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)  # noqa: B004


def concurrently(call: Callable[[Any], Any], items: Sequence[Any], background: Sequence[bool]) -> list[Any]:
    """`[call(x) for x in items]`, the items marked in `background` each run in a thread of its own while the others
    run here one after another (I/O-bound user code: async reward functions, judges); the first failure in the
    items' order is raised, after every call has ended."""
    import threading

    results: list[Any] = [None] * len(items)
    errors: dict[int, BaseException] = {}

    def run(i: int) -> None:
        try:
            results[i] = call(items[i])
        except BaseException as e:  # noqa: BLE001 - raised below, in order
            errors[i] = e

    threads = []
    for i, later in enumerate(background):
        if later:
            threads.append(threading.Thread(target=run, args=(i,), name="jaxloom-reward", daemon=True))
            threads[-1].start()
    for i, later in enumerate(background):
        if not later:
            run(i)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[min(errors)]
    return results


def call_reward(
    fn: Callable,
    prompts: list,
    completions: list,
    columns: dict[str, list],
    *,
    timeout: float | None = None,
    where: Sequence[str] | None = None,
    **extra,
) -> np.ndarray:
    """`fn`'s rewards of the completions, checked: one finite number (or None, as TRL allows: no reward) per
    completion, within `timeout` seconds (`reward_timeout`). A raise is retried one completion at a time to name
    the record that fails (`where`: each completion's record; default: its index in the step)."""
    name = reward_name(fn)
    where = list(where) if where is not None else [f"prompt index {i} of this step" for i in range(len(prompts))]
    try:
        out = within(fn, timeout, name, prompts=prompts, completions=completions, **columns, **extra)
    except (RewardTimeoutError, EnvironmentCallError):  # already names what failed
        raise
    except Exception as e:  # noqa: BLE001 - user code: find the failing prompt, then say which
        for i in range(len(prompts)):
            try:
                one = {k: [v[i]] for k, v in columns.items()}
                one_extra = {k: [v[i]] for k, v in extra.items()}
                within(fn, timeout, name, prompts=[prompts[i]], completions=[completions[i]], **one, **one_extra)
            except Exception as again:  # noqa: BLE001
                raise RewardError(f"reward function {name} raised on {where[i]} ({describe(again)})") from again
        raise RewardError(f"reward function {name} raised ({describe(e)})") from e
    try:
        values = np.asarray([np.nan if v is None else float(v) for v in out], np.float64)
    except (TypeError, ValueError):
        raise RewardError(
            f"reward function {name} returned {type(out).__name__}; expected a list of numbers, one per completion",
            frames=defined_at(fn),
        ) from None
    if len(values) != len(prompts):
        raise RewardError(
            f"reward function {name} returned {len(values)} rewards for {len(prompts)} completions; expected one "
            "per completion (None for no reward)",
            frames=defined_at(fn),
        )
    bad = [i for i, (v, raw) in enumerate(zip(values, out, strict=True)) if raw is not None and not math.isfinite(v)]
    if bad:
        raise RewardError(
            f"reward function {name} returned {values[bad[0]]} for completion {bad[0]} ({where[bad[0]]}); expected a "
            "finite number or None",
            frames=defined_at(fn),
        )
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


class RewardModel:
    """A reward model as a reward function, scoring as TRL's `GRPOTrainer` scores with a model: each prompt +
    completion as text (chat: the conversation through the reward model's own chat template), encoded by the
    reward model's tokenizer without special tokens (the template has them), right-padded, and the score read at
    each sequence's last non-pad token (`jaxloom.models.last_token`). `path`: an HF directory of a sequence
    classifier of one label (`RewardTrainer`'s export, or transformers'), its tokenizer beside it; read on first
    use. Rows are padded to a power of two tokens, so the jitted scorer compiles once per width met. With a `mesh`
    (the training mesh: GRPO gives its own), the model is read sharded over it by its partition rules, each
    process reading only its devices' slices, and the rows are split over `data_axes` (padded with empty rows to a
    multiple of their size): the reward model takes a share of each device, as the policy does; without one, it
    runs on the process's default device.

        RewardModel("runs/rm/hf")(prompts, completions)          # a list of floats, one per completion
    """

    def __init__(self, path: str, *, mesh: Any = None, data_axes: tuple[str, ...] = ()):
        self.path = str(path)
        self.__name__ = Path(self.path).resolve().name  # TRL logs a model's reward under its name
        self.mesh, self.data_axes = mesh, tuple(data_axes)
        self._loaded: Any = None

    def _load(self) -> Any:
        if self._loaded is None:
            import jax
            from transformers import AutoTokenizer

            import jaxloom.models as jmod

            model = jmod.from_pretrained(self.path, task=jmod.TaskType.SEQUENCE_CLASSIFICATION, mesh=self.mesh)
            if (model.config.num_labels or 2) != 1:  # transformers' default is 2
                raise ValueError(f"reward_funcs: {self.path} scores {model.config.num_labels} labels; expected 1")
            tokenizer = AutoTokenizer.from_pretrained(self.path)
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            model.config = model.config.replace(pad_token_id=tokenizer.pad_token_id)  # as TRL sets it
            fn = lambda m, ids, mask: m(ids, attention_mask=mask).logits[:, 0]  # noqa: E731
            if self.mesh is None:
                score = jax.jit(fn)
            else:  # the scores whole on every process (each process's rewards cover every row)
                from jax.sharding import NamedSharding, PartitionSpec

                score = jax.jit(fn, out_shardings=NamedSharding(self.mesh, PartitionSpec()))
            self._loaded = (model, tokenizer, score)
        return self._loaded

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        import jax.numpy as jnp

        model, tokenizer, score = self._load()
        if isinstance(prompts[0], list):  # chat: the whole conversation through the reward model's template
            pairs = zip(prompts, completions, strict=True)
            texts = [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in pairs]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        encoded = tokenizer(texts, padding=True, padding_side="right", add_special_tokens=False, return_tensors="np")
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        rows, width = ids.shape[0], 1 << max(0, int(ids.shape[1] - 1).bit_length())
        split = self._row_split()
        pad = ((0, -rows % split), (0, width - ids.shape[1]))  # empty rows to fill the data shards, cut below
        ids = np.pad(ids, pad, constant_values=tokenizer.pad_token_id)
        mask = np.pad(mask, pad)
        if self.mesh is None:
            return [float(x) for x in np.asarray(score(model, jnp.asarray(ids), jnp.asarray(mask)))[:rows]]
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        where = NamedSharding(self.mesh, PartitionSpec(self.data_axes or None))

        def put(x: np.ndarray) -> jax.Array:  # the same host rows on every process, each placing its shards
            return jax.make_array_from_callback(x.shape, where, lambda index: x[index])

        with jax.set_mesh(self.mesh):
            return [float(x) for x in np.asarray(score(model, put(ids), put(mask)))[:rows]]

    def _row_split(self) -> int:
        """How many ways the rows are split: the product of the mesh's `data_axes` (1 without a mesh)."""
        if self.mesh is None or not self.data_axes:
            return 1
        return int(np.prod([self.mesh.shape[a] for a in self.data_axes]))
