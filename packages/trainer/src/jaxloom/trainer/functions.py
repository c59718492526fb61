"""The jitted steps of a run: `train_step` and `eval_step` (pure functions, `step.py`) jitted once with the
plan's explicit shardings and donation, lowered for the run's exact batch, compiled ahead of time.

    fns = StepFunctions.build(plan, spec, step_config, arguments)
    compiled = fns.lower(arguments.total_batch_size).compile()
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
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
    model is never a silent pause). `traced` is set once the step is lowered (or failed to): from then on the
    compile runs in XLA, holding no Python lock, so other Python work (the initial state's own program) no longer
    slows the step's tracing."""

    def __init__(self, pool, lower, *, eval_ratio: float = 0.0, staged_bytes: int = 0):
        self.started, self.seconds = time.monotonic(), 0.0
        self.eval_ratio, self.staged_bytes = eval_ratio, staged_bytes
        self.traced = threading.Event()

        def run():
            start = time.monotonic()
            try:
                lowered = lower()
            finally:
                self.traced.set()
            executable = lowered.compile()
            self.seconds = time.monotonic() - start
            return executable

        self.future = pool.submit(run)

    def result(self):
        """The compiled executable (waits for it), checked to fit the devices' memory (`check_fits`)."""
        if not self.future.done():
            log.info("compiling the train step… (%.0f s so far)", time.monotonic() - self.started)
        executable = self.future.result()
        log.info("train step compiled in %.1f s", self.seconds)
        check_fits(executable, jax.local_devices(), eval_ratio=self.eval_ratio, staged_bytes=self.staged_bytes)
        return executable


def later_memory(arguments: Any, plan: Plan, *, has_eval: bool) -> dict[str, Any]:
    """What a run allocates after its first step, for `check_fits`: `eval_ratio`, an evaluation batch's rows over a
    micro-batch's (0 without evaluation data), and `staged_bytes`, the state's bytes an asynchronous checkpoint copies
    into host memory (on CPU, the devices' own memory)."""
    eval_ratio = arguments.eval_batch_size / arguments.total_batch_size if has_eval else 0.0
    staged = 0
    if arguments.async_checkpointing and all(d.platform == "cpu" for d in jax.local_devices()):
        leaves = jax.tree_util.tree_leaves((plan.abstract.params, plan.abstract.opt_state))
        staged = sum(int(x.size) * x.dtype.itemsize for x in leaves)
    return {"eval_ratio": eval_ratio, "staged_bytes": staged}


class StepTooLargeError(ValueError):
    """The compiled train step needs more memory than the devices (or, on CPU, the host) have."""


def check_fits(executable, devices, *, eval_ratio: float = 0.0, staged_bytes: int = 0) -> None:
    """Refuse, before step 1, a train step whose compiled program needs more memory per device (arguments,
    outputs and temporaries, XLA's own count; the donated buffers XLA does not reuse counted twice) than `devices`
    have: one error with both numbers and what to lower, instead of an out-of-memory traceback at the first step.
    The run's later work is counted with it: an evaluation batch of `eval_ratio` times a micro-batch's rows needs
    the step's temporaries scaled so (its forward pass is a part of the step's), and an asynchronous checkpoint's
    copy of the state (`staged_bytes`, in host memory) is held while the next steps run. CPU devices report no
    limit: they share the host's memory, so the program's need times the local CPU devices, plus the checkpoint's
    copy, is checked against the memory the host has free (`host_memory_available`)."""
    memory = executable.memory_analysis()
    if memory is None:
        return
    temporaries = memory.temp_size_in_bytes * max(1.0, eval_ratio)
    need = int(memory.argument_size_in_bytes + memory.output_size_in_bytes + temporaries - memory.alias_size_in_bytes)
    stats = [d.memory_stats() or {} for d in devices]
    limits = [s["bytes_limit"] for s in stats if s.get("bytes_limit")]
    what = "per device (parameters, optimizer state, batch and temporaries, as XLA compiled it)"
    if limits:
        have, where = min(limits), "a device has"
    elif devices and all(d.platform == "cpu" for d in devices):
        free = host_memory_available()
        if free is None:
            return
        need = need * len(devices) + staged_bytes
        have, where = free, "this host has"
        what = f"on this host ({len(devices)} CPU devices × what XLA compiled for each, and a checkpoint's copy)"
    else:
        return
    if need > have:
        raise StepTooLargeError(
            f"the train step needs {need / 2**30:.2f} GiB {what}"
            + (f", an evaluation batch {eval_ratio:g}× a micro-batch counted" if eval_ratio > 1 else "")
            + f", and {where} {have / 2**30:.2f} GiB free: expected a smaller total_batch_size (with "
            "gradient_accumulation_steps for the same batch) or evaluation_batch_size, a shorter "
            "max_sequence_length, remat (gradient checkpointing) or more fsdp shards (`jaxloom plan` prints the "
            "memory per device). Nothing was trained."
        )


def host_memory_available() -> int | None:
    """Bytes this process may still allocate: the kernel's MemAvailable, or less under a cgroup (container)
    memory limit; None when neither can be read."""
    import re
    from pathlib import Path

    found: list[int] = []
    try:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        if match:
            found.append(int(match.group(1)) * 1024)
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


class WidthSteps:
    """The train step for rows whose width changes from step to step (a kind whose rows follow its data, as
    GRPO's rollouts): called as the compiled step is, `(state, batch) -> (state, metrics)`; the step is
    compiled ahead of time once per row width it meets (each checked to fit the devices, `check_fits`) and
    reused after. `compiled` holds them by width."""

    def __init__(self, functions: StepFunctions, rows: int):
        self.functions, self.rows = functions, rows
        self.compiled: dict[int, Any] = {}

    def for_width(self, width: int):
        """The step compiled for rows of `width` tokens (compiled now if it is the first of that width)."""
        if width not in self.compiled:
            start = time.monotonic()
            executable = self.functions.lower(self.rows, width).compile()
            check_fits(executable, jax.local_devices())
            log.info("train step compiled for rows of %d tokens in %.1f s", width, time.monotonic() - start)
            self.compiled[width] = executable
        return self.compiled[width]

    def __call__(self, state, batch):
        return self.for_width(int(batch["input_ids"].shape[-1]))(state, batch)


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
    frozen: Any = None

    @classmethod
    def build(
        cls,
        plan: Plan,
        spec: DataSpec,
        config: StepConfig,
        *,
        accumulation: int,
        donate: bool | None,
        frozen: Any = None,
    ):
        """Jit the steps over `plan`'s shardings; `donate` the state's buffers (None: not on CPU, where XLA
        runs a donated step ~6% slower). `frozen`: arrays the objective reads and never trains (distillation's
        teacher, as placed on the mesh): the jitted steps take them first, `(frozen, state, batch)`, and give them
        to the objective as `config.frozen`; `train` and `evaluate` are then those steps with `frozen` bound."""
        repl = NamedSharding(plan.mesh, PartitionSpec())
        if donate is None:
            donate = plan.mesh.devices.flat[0].platform != "cpu"
        if frozen is None:
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
        where = jax.tree_util.tree_map(lambda x: x.sharding, frozen)
        train = jax.jit(
            lambda f, state, batch: train_step(state, batch, dataclasses.replace(config, frozen=f)),
            in_shardings=(where, plan.shardings, plan.batch_sharding),
            out_shardings=(plan.shardings, repl),
            donate_argnums=1 if donate else (),
        )
        evaluate = jax.jit(
            lambda f, state, batch: eval_step(state, batch, dataclasses.replace(config, frozen=f)),
            in_shardings=(where, plan.shardings, plan.eval_sharding),
            out_shardings=repl,
        )
        return cls(plan, spec, config, accumulation, _Bound(train, frozen), _Bound(evaluate, frozen), frozen)

    def lower(self, rows: int, width: int | None = None):
        """The train step lowered for batches of `rows` rows per micro-batch (of `width` tokens; default the
        spec's row width) (`jax.stages.Lowered`: `.as_text()` is the program before XLA's optimisations,
        `.compile()` the executable)."""
        sharding = self.plan.batch_sharding
        spec = self.spec if width is None else self.spec.with_width(width)
        batch = {
            k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            for k, (shape, dtype) in spec.batch_spec(self.accumulation, rows).items()
        }
        if jax.process_count() > 1:
            batch[STOP_KEY] = jax.ShapeDtypeStruct((self.accumulation, rows, 1), np.int32, sharding=sharding)
        with jax.set_mesh(self.plan.mesh):
            return self.train.lower(self.plan.target(), batch)


class _Bound:
    """A step jitted as `(frozen, state, batch)` with its `frozen` arrays bound: called, and lowered, as the steps
    without them are, `(state, batch)`; what it compiles is called with `frozen` too (`compiled`)."""

    def __init__(self, jitted, frozen):
        self.jitted, self.frozen = jitted, frozen

    def __call__(self, state, batch):
        return self.jitted(self.frozen, state, batch)

    def lower(self, state, batch):
        return _BoundLowered(self.jitted.lower(self.frozen, state, batch), self.frozen)


class _BoundLowered:
    def __init__(self, lowered, frozen):
        self.lowered, self.frozen = lowered, frozen

    def as_text(self, *args, **kwargs):
        return self.lowered.as_text(*args, **kwargs)

    def compile(self, *args, **kwargs):
        return _BoundCompiled(self.lowered.compile(*args, **kwargs), self.frozen)


class _BoundCompiled:
    """A compiled `(frozen, state, batch)` step called as `(state, batch)`; otherwise the executable
    (`memory_analysis()`, `cost_analysis()`, `as_text()`)."""

    def __init__(self, executable, frozen):
        self.executable, self.frozen = executable, frozen

    def __call__(self, state, batch):
        return self.executable(self.frozen, state, batch)

    def __getattr__(self, name):
        return getattr(self.executable, name)
