"""One schema for every jaxloom config: frozen dataclasses checked by pydantic on construction.

`@config` turns a class into a frozen dataclass whose fields are validated and converted by their types
(pydantic's lax mode: `"1e-5"` is a float, `[1, 2]` a tuple, `3.5` is not an int) before its own
`__post_init__` checks run. Whatever fails becomes one `ValueError` naming the config, the key, the
value and what was expected. The same rules hold in Python, in YAML/JSON files and for `key=value`
overrides, because all of them construct the config.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import pydantic
from pydantic import AfterValidator, BeforeValidator, ConfigDict

T = TypeVar("T")


def explain_validation_error(error: Any, prefix: str = "", known: Sequence[str] = ()) -> ValueError:
    """A pydantic `ValidationError` (`error`) as one `ValueError`: each problem names the key, the value and
    what was expected (`max_training_steps = 3.5; expected a valid integer, ...`), after `prefix` (the
    config's name). `known`: the valid keys, named when a key is unknown."""
    lines: list[str] = []
    problems: dict[tuple[str, str], tuple[list[str], Any, list[str]]] = {}  # one entry per key and value
    for e in error.errors():
        msg = e["msg"].removeprefix("Value error, ")
        loc = [str(x) for x in e["loc"] if not isinstance(x, int)]
        if e["type"] == "unexpected_keyword_argument" and loc:
            close = difflib.get_close_matches(loc[-1], known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(f"unknown key {loc[-1]!r}{hint}; expected some of {sorted(known)}")
            continue
        if msg.startswith("Input should be "):
            msg = "expected " + msg.removeprefix("Input should be ")
        if loc:  # a check's own message may start by naming the key and value again
            msg = msg.removeprefix(f"{loc[-1]} {e['input']!r}; ").removeprefix(f"{loc[-1]} = {e['input']!r}; ")
        else:
            lines.append(msg)
            continue
        # The branches of a union fail on the same key and value: one problem, "expected A or B".
        slot = (loc[0], repr(e["input"]))
        if slot in problems:
            path, _, msgs = problems[slot]
            del path[next((i for i, (a, b) in enumerate(zip(path, loc, strict=False)) if a != b), len(path)) :]
            msgs.append(msg.removeprefix("expected "))
        else:
            problems[slot] = (loc, e["input"], [msg])
            lines.append(slot)  # type: ignore[arg-type]  # filled in below, keeping the order
    lines = [
        f"{'.'.join(problems[x][0])} = {problems[x][1]!r}; {' or '.join(problems[x][2])}" if isinstance(x, tuple) else x
        for x in lines
    ]
    return ValueError(prefix + "; ".join(lines))


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("expected a number, not true/false")
    return v


def _positive(v: Any) -> Any:
    if not v > 0 or not math.isfinite(v):
        raise ValueError(f"expected a positive {'integer' if isinstance(v, int) else 'finite number'}")
    return v


def _non_negative(v: Any) -> Any:
    if not v >= 0 or not math.isfinite(v):
        raise ValueError("expected a non-negative number")
    return v


PositiveInt = Annotated[int, BeforeValidator(_not_bool), AfterValidator(_positive)]
"""An int > 0 (not a bool, not 3.5)."""
NonNegativeInt = Annotated[int, BeforeValidator(_not_bool), AfterValidator(_non_negative)]
"""An int >= 0 (not a bool)."""
PositiveFloat = Annotated[float, BeforeValidator(_not_bool), AfterValidator(_positive)]
"""A finite float > 0."""


def _config(cls: type[T]) -> type[T]:
    """Make `cls` a frozen, validated config dataclass (see the module docstring). `dataclasses.fields`,
    `dataclasses.replace`, hashing and equality work as for any frozen dataclass; `replace` validates
    again."""
    cls = pydantic.dataclasses.dataclass(frozen=True, config=ConfigDict(arbitrary_types_allowed=True, extra="forbid"))(
        cls
    )
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except pydantic.ValidationError as e:
            known = [f.name for f in dataclasses.fields(self)]
            raise explain_validation_error(e, f"{type(self).__name__}: ", known) from None

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


if TYPE_CHECKING:  # type checkers know the standard decorator: fields, `replace` and the constructor's keys
    from dataclasses import dataclass as config
else:
    config = _config


def is_config(obj: Any) -> bool:
    """Whether `obj` (a class or an instance) is a config made by `@config`."""
    return dataclasses.is_dataclass(obj) and hasattr(obj, "__pydantic_validator__")
