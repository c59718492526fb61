"""The jitted steps of a run: `train_step` and `eval_step` (pure functions, `step.py`) jitted once with the
plan's explicit shardings and donation, lowered for the run's exact batch, compiled ahead of time.

    fns = StepFunctions.build(plan, spec, step_config, arguments)
    compiled = fns.lower(arguments.total_batch_size).compile()
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .batches import DataSpec
from .plan import Plan
from .step import STOP_KEY, StepConfig, eval_step, train_step

log = logging.getLogger("jaxloom.trainer")


class Compilation:
    """The train step compiling in the background on `pool` (`lower()` then `.compile()`): `result()` waits,
    saying so when the run has to wait for it, and logs how long the compile took (a long compile of a large
    model is never a silent pause)."""

    def __init__(self, pool, lower):
        self.started, self.seconds = time.monotonic(), 0.0

        def run():
            start = time.monotonic()
            executable = lower().compile()
            self.seconds = time.monotonic() - start
            return executable

        self.future = pool.submit(run)

    def result(self):
        """The compiled executable (waits for it)."""
        if not self.future.done():
            log.info("compiling the train step… (%.0f s so far)", time.monotonic() - self.started)
        executable = self.future.result()
        log.info("train step compiled in %.1f s", self.seconds)
        return executable


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """`train(state, batch) -> (state, metrics)` and `evaluate(state, batch) -> sums`, jitted; `config` is
    the steps' static `StepConfig`."""

    plan: Plan
    spec: DataSpec
    config: StepConfig
    accumulation: int
    train: Any
    evaluate: Any

    @classmethod
    def build(cls, plan: Plan, spec: DataSpec, config: StepConfig, *, accumulation: int, donate: bool | None):
        """Jit the steps over `plan`'s shardings; `donate` the state's buffers (None: not on CPU, where XLA
        runs a donated step ~6% slower)."""
        repl = NamedSharding(plan.mesh, PartitionSpec())
        if donate is None:
            donate = plan.mesh.devices.flat[0].platform != "cpu"
        train = jax.jit(
            functools.partial(train_step, cfg=config),
            in_shardings=(plan.shardings, plan.batch_sharding),
            out_shardings=(plan.shardings, repl),
            donate_argnums=0 if donate else (),
        )
        evaluate = jax.jit(
            functools.partial(eval_step, cfg=config),
            in_shardings=(plan.shardings, plan.eval_sharding),
            out_shardings=repl,
        )
        return cls(plan, spec, config, accumulation, train, evaluate)

    def lower(self, rows: int):
        """The train step lowered for batches of `rows` rows per micro-batch (`jax.stages.Lowered`:
        `.as_text()` is the program before XLA's optimisations, `.compile()` the executable)."""
        sharding = self.plan.batch_sharding
        batch = {
            k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            for k, (shape, dtype) in self.spec.batch_spec(self.accumulation, rows).items()
        }
        if jax.process_count() > 1:
            batch[STOP_KEY] = jax.ShapeDtypeStruct((self.accumulation, rows, 1), np.int32, sharding=sharding)
        with jax.set_mesh(self.plan.mesh):
            return self.train.lower(self.plan.target(), batch)
