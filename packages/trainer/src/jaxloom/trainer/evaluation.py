"""Evaluation: the objective's loss and metrics of a state over up to `eval_batches` batches of the
evaluation data, and the last result (so the end of a run does not evaluate the same step twice).

    evaluator = Evaluator(batches, eval_fn, objective, eval_batches=8, mesh=mesh)
    metrics = evaluator.run(state)              # {"loss", "perplexity", "accuracy", ..., "evaluation_time"}
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .batches import Batches
from .step import Objective


class Evaluator:
    """Runs `eval_fn(state, batch) -> sums` over `batches.eval_loader()` and turns the sums into the
    `objective`'s metrics. `last = (step, metrics)` of the newest evaluation logged during training."""

    def __init__(self, batches: Batches, eval_fn: Callable, objective: Objective, *, eval_batches: int, mesh):
        self.batches, self.eval_fn, self.objective = batches, eval_fn, objective
        self.eval_batches, self.mesh = eval_batches, mesh
        self.last: tuple[int | None, dict[str, float]] = (None, {})
        self.started: float | None = None  # set by the trainer's start_evaluation_hook

    def run(self, state: Any, metric_calculator: Callable | None = None, started: float | None = None) -> dict:
        """Loss (and perplexity when the objective has one), the objective's metrics, `metric_calculator(state,
        batch) -> dict` averaged over the batches, and `evaluation_time` since `started` (default: now)."""
        t0 = time.monotonic() if started is None else started
        total: dict[str, float] = {}
        custom: dict[str, list[float]] = {}
        extremes = dict(self.objective.extremes)  # added on the host in Python, as the step adds on the device
        ops: dict[str, Callable[[float, float], float]] = {"min": min, "max": max}
        combine: defaultdict[str, Callable[[float, float], float]] = defaultdict(lambda: operator.add)
        combine.update({k: ops[v] for k, v in extremes.items()})
        with jax.set_mesh(self.mesh):
            loader = self.batches.eval_loader()
            if loader is None:
                raise ValueError("no dataset_eval was given")
            for i, local in enumerate(loader):
                if i >= self.eval_batches:
                    break
                batch = self.batches.eval_batch(local)
                out = jax.device_get(self.eval_fn(state, batch))
                total = {k: float(v) if k not in total else combine[k](total[k], float(v)) for k, v in out.items()}
                for k, v in (metric_calculator(state, batch) if metric_calculator else {}).items():
                    custom.setdefault(k, []).append(float(v))
        objective = self.objective
        if not total.get(objective.weight):
            raise ValueError(f"dataset_eval gave no {objective.weight} to evaluate")
        loss = total["loss_sum"] / total[objective.weight]
        sums = {k: np.float64(v) for k, v in total.items() if k != "loss_sum"}
        metrics = {k: float(v) for k, v in objective.metrics(sums).items() if k not in (objective.weight, "tokens")}
        return {
            "loss": loss,
            **({"perplexity": math.exp(min(loss, 50))} if objective.perplexity else {}),
            **metrics,
            **{k: float(np.mean(v)) for k, v in custom.items()},
            "evaluation_time": time.monotonic() - t0,
        }
