"""Step folder names: `<step>`, or `<step>.g<generation>` for a checkpoint written under lease generation 2 or later.

On an object store a run holds its directory by a lease (`StoreLease`); a run paused past its lease is taken over
by a new one, a new generation. The paused run's save in flight never commits (the lease is asked before the
commit), but its array writes already handed to tensorstore land when it continues — and an object store has no
rename to stage them: they are written in the step's final folder. With one name per step they could land in the
new owner's folder of the same step, committed meanwhile, and change what it restores. So every writer names its
steps by its generation: the first (`1`, and every local disk: no lease) writes `<step>`, a run that took the lease
over writes `<step>.g2`, the next `<step>.g3`. Two generations never write the same object; a reader takes each
step's newest committed generation.

`StepNames` is the orbax `NameFormat` that writes and finds these names (`CheckpointManager.step_folder` asks it);
`step_folders` and `parse_step_name` are for the code that lists a checkpoint directory without orbax.
"""

from __future__ import annotations

import re
from typing import Any

_NAME = re.compile(r"^(0|[1-9]\d*)(?:\.g([1-9]\d*))?$")


def step_name(step: int, generation: int | None = None) -> str:
    """The folder name of checkpoint `step` written under lease `generation` (None: no lease, a local disk)."""
    return str(int(step)) if generation is None or generation <= 1 else f"{int(step)}.g{int(generation)}"


def parse_step_name(name: str) -> tuple[int, int] | None:
    """`(step, generation)` of a step folder's name (generation 1 for `<step>`); None for any other name
    (an orbax temporary folder, `<step>.corrupt`, a user's file)."""
    match = _NAME.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 1)


def step_folders(directory: Any, committed: Any = None, step: int | None = None) -> dict[int, Any]:
    """Each step's folder in `directory` (only `step`'s, when given): its newest generation's of those
    `committed(path)` accepts (default: every folder named as a step), oldest step first. `{}` when the
    directory does not exist. One listing, and a `committed` check only until a step's newest committed folder."""
    if not directory.is_dir():
        return {}
    candidates: dict[int, list[tuple[int, Any]]] = {}
    for entry in directory.iterdir():
        parsed = parse_step_name(entry.name)
        if parsed is not None and (step is None or parsed[0] == int(step)):
            candidates.setdefault(parsed[0], []).append((parsed[1], entry))
    out = {}
    for s in sorted(candidates):
        for _, entry in sorted(candidates[s], key=lambda c: c[0], reverse=True):
            if committed is None or committed(entry):
                out[s] = entry
                break
    return out


def newest_generation(directory: Any) -> int:
    """The newest lease generation whose step folders are in `directory` (1 for `<step>` names), 0 for none: what a
    new lease's generation must pass (`StoreLease(after=)`)."""
    if not directory.is_dir():
        return 0
    return max((parsed[1] for e in directory.iterdir() if (parsed := parse_step_name(e.name))), default=0)


class StepNames:
    """orbax's `NameFormat` for jaxloom's step folders: writes `step_name(step, generation)` (`generation`: the
    writer's lease generation, set before each save) and finds each step's newest committed generation.
    `temporary_path_class`: how a step commits there (`stores.temporary_path_class`)."""

    def __init__(self, temporary_path_class: Any = None):
        self.generation: int | None = None
        self.temporary_path_class = temporary_path_class

    def __str__(self) -> str:
        return f"jaxloom StepNames('{self.build_name(1234)}')"

    def build_name(self, step: int) -> str:
        return step_name(step, self.generation)

    def committed(self, path: Any) -> bool:
        """Whether the step folder `path` is committed (orbax's test: not a temporary folder; its marker file on
        an object store)."""
        from orbax.checkpoint.path import step as ocp_step

        return bool(ocp_step.is_path_finalized(path, temporary_path_cls=self.temporary_path_class))

    def find_all(self, base_path: Any) -> Any:
        from etils import epath
        from orbax.checkpoint.path import step as ocp_step

        folders = step_folders(epath.Path(base_path), self.committed)
        return iter([ocp_step.Metadata(step=s, path=p) for s, p in folders.items()])

    def find_step(self, base_path: Any, step: int) -> Any:
        from etils import epath
        from orbax.checkpoint.path import step as ocp_step

        folder = step_folders(epath.Path(base_path), self.committed, step).get(int(step))
        if folder is None:
            raise ValueError(f"no committed folder of step {step} in {base_path}")
        return ocp_step.Metadata(step=int(step), path=folder)
