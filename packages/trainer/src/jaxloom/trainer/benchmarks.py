"""lm-evaluation-harness during training: `Benchmarks`, the run's `eval_tasks` on the state being trained.

A callback on its own cadence (`eval_tasks_steps`, and the run's last step) runs lm-eval's tasks through
`jaxloom.trainer.harness_core.LoadedLM` on the run's mesh and tokenizer, logs the scores as `lm_eval/<task>/<metric>`
(metrics.jsonl, TensorBoard, the console; report.md's benchmark table) and writes lm-eval's results JSON in
`<run>/lm_eval/step_<N>/`. The checkpoint of a step is saved before its evaluation runs (the checkpoint callback
comes first): a run killed during an evaluation resumes from that step and runs the evaluation again before its
next step, since the killed one recorded nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("jaxloom.trainer")


class Benchmarks:
    """`arguments`' `eval_tasks` (lm-eval names; `eval_tasks_limit`, `eval_tasks_num_fewshot`,
    `eval_tasks_include_path`) every `eval_tasks_steps` steps and at `last_step`; `tokenizer` and `mesh` are the
    run's; `log(scores, step)` records the scores; `folder()` is the run directory (None: results are logged, no
    file is written). Nothing is imported or read until `check()` (before step 1)."""

    def __init__(
        self,
        arguments: Any,
        *,
        last_step: int,
        tokenizer: Callable[[], Any],
        mesh: Any,
        log: Callable[[dict[str, float], int], None],
        folder: Callable[[], Path | None],
        history: Callable[[], list[dict[str, Any]]],
    ):
        self.tasks = list(arguments.eval_tasks or [])
        self.every, self.last_step = arguments.eval_tasks_steps, int(last_step)
        self.limit, self.num_fewshot = arguments.eval_tasks_limit, arguments.eval_tasks_num_fewshot
        include = arguments.eval_tasks_include_path
        self.include_path = None if include is None else str(Path(include).resolve())
        self._tokenizer, self.mesh, self._log, self._folder, self._history = tokenizer, mesh, log, folder, history
        self.last: tuple[int | None, dict[str, float]] = (None, {})
        self._lm: Any = None  # one lm-eval model for the run: its scoring programs compile once, not per evaluation
        self._resumed_checked = False

    def check(self) -> None:
        """Before step 1: lm-eval is installed, knows every task (lm-eval's own names, or the YAMLs of
        `eval_tasks_include_path`) and has its documents; else one error naming what to install, the unknown tasks
        or the data it cannot reach."""
        try:
            from . import harness_core
        except ImportError as e:
            raise ValueError(f"eval_tasks = {self.tasks}: {e}") from None
        harness_core.check_task_data(self.tasks, self.include_path)

    def due(self, step: int) -> bool:
        """Whether the tasks run after `step`: every `eval_tasks_steps` steps, and at the run's last step."""
        return step == self.last_step or bool(self.every and step % self.every == 0)

    def recorded(self, step: int) -> bool:
        """Whether the scores of `step` are in the run's history (metrics.jsonl)."""
        return any(r.get("step") == step and any(k.startswith("lm_eval/") for k in r) for r in self._history())

    def before_first_step(self, state: Any, step: int) -> None:
        """A resumed run (at `step`, its checkpoint) whose evaluation of that step was due but not recorded (the
        run was killed during it) runs it now, before training on."""
        if self._resumed_checked:
            return
        self._resumed_checked = True
        done = step - 1
        if done > 0 and self.due(done) and _everywhere(not self.recorded(done)):
            log.warning("the evaluation of step %d (eval_tasks) was not recorded: running it again", done)
            self.run(state, done)

    def run(self, state: Any, step: int) -> dict[str, float]:
        """lm-eval's tasks on `state`'s model: scores logged at `step`, lm-eval's results JSON in
        `<run>/lm_eval/step_<step>/` (written whole or not at all)."""
        from . import harness_core as harness

        if self._lm is None:
            self._lm = harness.LoadedLM(model=state.model, tokenizer=self._tokenizer(), mesh=self.mesh)
        else:
            self._lm.set_model(state.model)
        lm = self._lm
        folder = self._folder()
        results = harness.evaluate_tasks(
            lm,
            self.tasks,
            num_fewshot=self.num_fewshot,
            limit=self.limit,
            include_path=self.include_path,
            output_folder=None if folder is None else Path(folder) / "lm_eval" / f"step_{step}",
            step=step,
        )
        scores = harness.scores(results)
        self._log(scores, step)
        self.last = (step, scores)
        return scores


def _everywhere(decision: bool) -> bool:
    """Process 0's `decision` on every process (only process 0 holds the run's history), so that all of them run
    the evaluation's collectives or none does."""
    import jax

    if jax.process_count() == 1:
        return decision
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(decision)))
