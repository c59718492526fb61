"""`RunState`: the run's mutable state, one small object the loop and the session write and the components that
need the live state are given (by name: `run`), instead of each holding the trainer."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["RunState"]


@dataclasses.dataclass
class RunState:
    """What changes while a run runs:

    - `arguments`: the arguments in force (a run given no `save_directory` gets a fresh one written in here when its
      run directory is first needed; everything read after that reads it here);
    - `state`: the `TrainState` being trained (None until it is restored or created);
    - `step`: the step being run (steps are numbered like checkpoints: the updates done after it);
    - `completed`: the newest step known to have run on the device (steps are dispatched ahead: a device's error
      names the first step not known to have run);
    - `resumed_from`: the checkpoint the state was restored from, if any."""

    arguments: Any
    state: Any = None
    step: int = 0
    completed: int = 0
    resumed_from: str | None = None


class run_field:  # noqa: N801 - used like a property
    """A trainer attribute that is field `name` of its `RunState` (`trainer.run`): read and written there."""

    def __init__(self, name: str, doc: str):
        self.name, self.__doc__ = name, doc

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.run, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.run, self.name, value)
