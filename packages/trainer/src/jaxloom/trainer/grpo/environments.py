"""Environments in GRPO's rollouts (TRL 1.16's `environment_factory`): objects a completion acts on through their
methods, which are its tools.

    envs = Environments(WordleEnv, tools=[], tokenizer=tok, timeout=10.0)      # or {"wordle": WordleEnv, ...}
    envs.probe()                                     # at setup: one instance each, its tools' schemas, its reward
    names = envs.names(records)                      # each record's environment (its `environment` field)
    instances = envs.draw(names)                     # one instance per rollout row, reused across steps
    instances = envs.draw(names, slot=1)             # asynchronous: each rollout in flight its own instances
    observations = envs.reset(instances, records)    # reset(**record): text appended to the last user message

TRL's contract: a factory (a class, or any callable) makes an instance; `reset(**row)` starts a rollout and may
return text that is appended to the prompt's last user message; every other public method (no leading `_`) is a
tool, with the type hints and Google-style docstring a tool needs; `get_reward()` (optional) scores the finished
rollout from the instance's state, and is then a reward function of weight 1 logged under the class's name. With a
dict of factories each record names its environment in an `environment` field, and only that environment's tools
are rendered in its prompt. Instances are made once and reset for each rollout ("construct once, reset often").
Asynchronous GRPO draws a rollout while the one before is scored: each rollout in flight takes its instances from a
pool of its own (`slot`). An instance's state is not saved with a checkpoint: a resumed run resets the instances of
a rollout drawn ahead and runs the tool calls it made again, in order (`replay_calls`), which rebuilds the state of an
environment whose methods are deterministic — a call that now returns other text is reported.

A fault of a tool method is reported to the model (`ToolSet.run`); a fault of `reset` or `get_reward` stops the run
(`EnvironmentCallError`) naming the class, the method and the record, after the last checkpoint.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from ..usercode import UserCodeError, defined_at

SPECIAL = ("reset", "get_reward")


class EnvironmentCallError(UserCodeError):
    """An environment's `reset` or `get_reward` raised (or returned what the contract does not allow): the run
    stops, naming the class, the method and the record."""


_METHODS: dict[type, tuple[str, ...]] = {}


def tool_methods(cls: type) -> tuple[str, ...]:
    """The tool methods of an environment class: its public functions other than `reset` and `get_reward` (read on
    the class, as TRL does: properties are not evaluated). Read once per class, not per rollout row."""
    if cls not in _METHODS:
        members = inspect.getmembers(cls, predicate=inspect.isfunction)
        _METHODS[cls] = tuple(n for n, _ in members if n not in SPECIAL and n[0] != "_")
    return _METHODS[cls]


class Environments:
    """The environments of a run: `factories` (one callable, or a dict of them by name) made into instances, each
    exposing its tool methods beside `tools` (standalone callables) to `tokenizer`'s chat format with `timeout`
    seconds a tool turn, run on `workers` (`ToolWorkers`, shared; None: one pool per environment) (see the module
    docstring). Nothing is made before `probe`."""

    def __init__(
        self,
        factories: Callable | dict[str, Callable],
        *,
        tools: Sequence[Callable] = (),
        tokenizer: Any,
        timeout: float | None = 60.0,
        workers: Any = None,
    ):
        self.multi = isinstance(factories, dict)
        self.factories: dict[str | None, Callable] = (
            dict(factories) if isinstance(factories, dict) else {None: factories}
        )
        if not self.factories:
            raise ValueError("environment_factory: an empty dict; expected at least one environment factory")
        for name, factory in self.factories.items():
            if not callable(factory):
                raise TypeError(f"environment_factory{_label(name)}: {factory!r} is not callable")
        self.tools, self.tokenizer, self.timeout, self.workers = list(tools), tokenizer, timeout, workers
        self.pool: dict[tuple[str | None, int | None], list[Any]] = {}  # (environment, slot) -> its instances
        self.toolsets: dict[str | None, Any] = {}  # per environment: a ToolSet of the standalone and method tools
        self.scored: list[type] = []  # the classes that own a reward (`get_reward`), in order of first probe

    # ---- set-up ---------------------------------------------------------------------------------------------
    def probe(self) -> None:
        """One instance of each environment made and checked (it has `reset`; its tool methods make schemas):
        the first instance of its pool. Done once, before step 1."""
        if self.toolsets:
            return
        from .tools import ToolSet

        for name in self.factories:
            instance = self._make(name)
            cls = type(instance)
            if not callable(getattr(cls, "reset", None)):
                raise ValueError(
                    f"environment {cls.__name__} has no reset method; expected TRL's contract: reset(**row) -> str | "
                    "None, its public methods the tools, get_reward() -> float optional"
                )
            methods = [getattr(instance, m) for m in tool_methods(cls)]
            self.pool[name, None] = [instance]
            self.toolsets[name] = ToolSet(
                [*self.tools, *methods], self.tokenizer, timeout=self.timeout, workers=self.workers
            )
            if callable(getattr(cls, "get_reward", None)) and cls not in self.scored:
                self.scored.append(cls)

    def _make(self, name: str | None) -> Any:
        """A new instance of environment `name` (its factory called); a raise names the factory."""
        try:
            return self.factories[name]()
        except Exception as e:  # noqa: BLE001 - user code: say which factory
            raise EnvironmentCallError(
                f"environment_factory{_label(name)} raised when called ({type(e).__name__}: {e})"
            ) from e

    def reward_functions(self) -> list[Callable]:
        """A reward function per class that owns its reward (`get_reward`), TRL's: named after the class, called
        with the rollout rows' `environments`, `None` (no reward) for a row of another class."""
        self.probe()
        return [_reward_of(cls) for cls in self.scored]

    # ---- per rollout ----------------------------------------------------------------------------------------
    def names(self, records: Sequence[dict], source: str = "dataset_train") -> list[str | None]:
        """Each record's environment: its `environment` field with a dict of factories (checked: one error naming
        the record, its value and the names there are), else the one environment."""
        if not self.multi:
            return [None] * len(records)
        out = []
        for i, r in enumerate(records):
            name = r.get("environment")
            if name not in self.factories:
                known = sorted(map(str, self.factories))
                raise ValueError(
                    f"{source} record {i}: environment = {name!r}; expected one of {known} (a dict "
                    "environment_factory routes each record by its `environment` field)"
                )
            out.append(name)
        return out

    def toolset(self, name: str | None) -> Any:
        """The `ToolSet` rendered in the prompts of environment `name` (its schemas; the standalone tools and the
        probe instance's methods)."""
        self.probe()
        return self.toolsets[name]

    def draw(self, names: Sequence[str | None], slot: int | None = None) -> list[Any]:
        """One instance per rollout row (`names`: each row's environment), from each environment's pool in order:
        more are made only when a rollout needs more at once than were made so far. `slot`: a pool of its own (a
        rollout in flight beside others, asynchronous GRPO; None: the run's one pool)."""
        self.probe()
        taken: dict[str | None, int] = {}
        out = []
        for name in names:
            pool, i = self.pool.setdefault((name, slot), []), taken.get(name, 0)
            if i == len(pool):
                pool.append(self._make(name))
            taken[name] = i + 1
            out.append(pool[i])
        return out

    def row_tools(self, instance: Any) -> dict[str, Callable]:
        """The tools one rollout row may call: the standalone tools and `instance`'s methods, by name."""
        from .tools import tool_name

        methods = [getattr(instance, m) for m in tool_methods(type(instance))]
        return {tool_name(f): f for f in [*self.tools, *methods]}

    def reset(self, instances: Sequence[Any], records: Sequence[dict], where: Sequence[str]) -> list[str | None]:
        """`reset(**record)` of each row's instance (without the routing `environment` field when there are
        several environments, as TRL): the text each returns (or None). `where` names each row's record in an
        error."""
        out = []
        for instance, record, at in zip(instances, records, where, strict=True):
            kwargs = {k: v for k, v in record.items() if k != "environment"} if self.multi else dict(record)
            try:
                observation = instance.reset(**kwargs)
            except Exception as e:  # noqa: BLE001 - user code: stop, naming class, method and record
                raise EnvironmentCallError(
                    f"environment {type(instance).__name__}.reset raised on {at} ({type(e).__name__}: {e})"
                ) from e
            if observation is not None and not isinstance(observation, str):
                raise EnvironmentCallError(
                    f"environment {type(instance).__name__}.reset returned {type(observation).__name__} on {at}; "
                    "expected a string (appended to the last user message) or None",
                    frames=defined_at(instance.reset),
                )
            out.append(observation)
        return out


def environment_rows(
    envs: Environments,
    records: Sequence[dict],
    group: int,
    prompts: list,
    row_ids: list,
    where: Sequence[str],
    slot: int | None = None,
) -> tuple[list, list, Any, list[dict[str, Callable]], list[Any]]:
    """A rollout's rows (each record `group` times: `prompts`, their token ids `row_ids`, `where` naming each) with
    an environment each: an instance drawn (from pool `slot`) and reset per row, its text appended to the row's
    prompt (re-encoded with its tools' schemas). Returns `(prompts, row_ids, the ToolSet that parses the rows' calls,
    each row's tools, the instances)`."""
    import numpy as np

    names = [n for n in envs.names(records) for _ in range(group)]
    instances = envs.draw(names, slot)
    observations = envs.reset(instances, [r for r in records for _ in range(group)], where)
    prompts = [observed(p, o) for p, o in zip(prompts, observations, strict=True)]
    row_ids = [
        ids if o is None else np.asarray(envs.toolset(n).encode(p), np.int32)
        for ids, o, n, p in zip(row_ids, observations, names, prompts, strict=True)
    ]
    return prompts, row_ids, envs.toolset(names[0]), [envs.row_tools(e) for e in instances], instances


def replay_calls(
    tools: Any, row_tools: Sequence[dict[str, Callable]], made: Sequence[Sequence[list[dict]]], where: Sequence[str]
) -> list[str]:
    """The tool calls a rollout's rows made (`made`: per row, its turns, each the calls with the text they returned,
    `Exchange.made`) run again on the rows' instances (`row_tools`), turn by turn, the rows of a turn together as
    when drawn (`ToolSet.run_turn`): what rebuilds the instances' state after a resume. Returns a line per call that
    returned other text than it did (naming the record, the tool and both texts), none when all agree."""
    differ = []
    for turn in range(max((len(turns) for turns in made), default=0)):
        rows = [r for r, turns in enumerate(made) if turn < len(turns)]
        calls = [[{k: v for k, v in c.items() if k != "content"} for c in made[r][turn]] for r in rows]
        results = tools.run_turn([(c, row_tools[r]) for r, c in zip(rows, calls, strict=True)])
        for r, (messages, _) in zip(rows, results, strict=True):
            for call, message in zip(made[r][turn], messages, strict=True):
                if message["content"] != call["content"]:
                    name = call["function"]["name"]
                    differ.append(
                        f"{where[r]}: {name} returned {message['content']!r:.60} (was {call['content']!r:.60})"
                    )
    return differ


def raise_naming_the_record(error: EnvironmentCallError, where: Sequence[str]) -> None:
    """Raise `error` again with the record of its row named (`where`: each rollout row's record), when it carries
    the row (a `get_reward` fault); else as it is."""
    row = getattr(error, "row", None)
    if row is None:
        raise error
    cause = error.__cause__
    raise EnvironmentCallError(
        f"environment {error.method} raised on {where[row]} ({type(cause).__name__}: {cause})"  # type: ignore[attr-defined]
    ) from cause


def observed(prompt: Any, observation: str | None) -> Any:
    """`prompt` (chat messages) with `observation` appended to its last message's content, the messages copied
    (the record is left as it is), as TRL does."""
    if observation is None:
        return prompt
    return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]


def _reward_of(cls: type) -> Callable:
    def reward(environments: Sequence[Any], **kwargs: Any) -> list[float | None]:
        out: list[float | None] = []
        for row, env in enumerate(environments):
            if type(env) is not cls:  # another environment's row: no reward from this one (TRL's exact-type rule)
                out.append(None)
                continue
            try:
                out.append(env.get_reward())
            except Exception as e:  # noqa: BLE001 - user code: stop, naming class, method and row
                error = EnvironmentCallError(
                    f"environment {cls.__name__}.get_reward raised on completion {row} of this step "
                    f"({type(e).__name__}: {e})"
                )
                error.row, error.method = row, f"{cls.__name__}.get_reward"  # type: ignore[attr-defined]
                raise error from e
        return out

    reward.__name__ = reward.__qualname__ = cls.__name__
    return reward


def _label(name: str | None) -> str:
    return "" if name is None else f"[{name!r}]"
