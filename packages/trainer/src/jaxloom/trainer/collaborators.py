"""How a builder asks for a collaborator it reads only later (`Parts` gives it as a function, see `components`)."""

from __future__ import annotations

from typing import Protocol, TypeVar

__all__ = ["IfBuilt", "Later"]
T_co = TypeVar("T_co", covariant=True)


class Later(Protocol[T_co]):
    """A collaborator given as a function that returns it when called (a component is built then, on first call)."""

    def __call__(self) -> T_co: ...


class IfBuilt(Protocol[T_co]):
    """A component given as a function that returns it if it has been built, else None (never built for this)."""

    def __call__(self) -> T_co | None: ...
