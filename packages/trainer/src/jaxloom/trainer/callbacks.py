"""Work done after a step on its own cadence: checkpoints, evaluation, previews, and users' own."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Callback:
    """`fn(trainer, step)` run after `step` when it is due: every `every` steps, and/or whenever
    `when(step)` is true (asked exactly once per step, so `when` may be a collective such as a
    time-based checkpoint decision). Callbacks see the state of their own step: the loop settles it
    before the first due callback runs. They run in the order they were added; the trainer adds the
    checkpoint first, so a step is saved before anything that can fail runs on it. `name` labels it
    in errors and listings."""

    fn: Callable[[Any, int], Any]
    every: int | None = None
    when: Callable[[int], bool] | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every <= 0
        ):
            raise ValueError(f"callback {self.name or self.fn!r}: every={self.every!r}; expected a positive integer")
        if self.every is None and self.when is None:
            raise ValueError(f"callback {self.name or self.fn!r}: give every=N steps and/or when=fn(step)")

    def due(self, step: int) -> bool:
        """Whether the callback runs after `step` (`when` is asked even if `every` already says yes)."""
        by_time = bool(self.when(step)) if self.when is not None else False
        return bool(self.every and step % self.every == 0) or by_time
