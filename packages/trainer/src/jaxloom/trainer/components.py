"""How the trainer's components are built: one builder each, a function whose keyword parameters name the
collaborators it is built from — other components, or the run's inputs (what the trainer was given, its kind's
`objective()` and `data_spec()`, the run's `RunState`) — and never the trainer. `Parts` is the composition: it
calls each builder with the collaborators its parameters name (a component is built on first use, in the order
the run asks for them; the trainer's constructor builds none) and records what each was built from
(`Parts.wiring()`: the component graph as data, the same graph the builders' signatures show).

A parameter annotated `Later[X]` is given as a function returning the collaborator when called (built then, if it
is a component): for what a component reads only while it runs (the tokenizer, the state); `IfBuilt[X]` returns
the component only if something else built it (None otherwise): for what it reads only when there is one (the
step log's history); named `<component>_if_built`, beside the same component asked for as `Later`.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, get_origin

import jaxloom.state as js
from jaxloom.models import pretrained_source

from . import resume
from .arguments import TrainingArguments
from .batches import Batches, DataSpec
from .benchmarks import Benchmarks
from .callbacks import Callback, Callbacks, RunView, trainer_hooks
from .checkpointing import Checkpointing
from .collaborators import IfBuilt, Later
from .evaluation import Evaluator
from .export import Exporter
from .functions import StepFunctions
from .monitor import StepLog
from .plan import Plan
from .previews import Generation
from .run_directory import RunDirectory, use_endpoint
from .run_state import RunState
from .setup import Setup
from .step import Objective, StepConfig
from .stopping import StopControl

log = logging.getLogger("jaxloom.trainer")
T = TypeVar("T")


CORE_INPUTS: dict[str, str] = {
    "run": "run",  # the RunState: arguments in force, state, step, completed step, where it resumed from
    "arguments": "arguments",
    "given_model": "_model_in",  # the model given (a directory read on first use)
    "given_state": "_state_in",  # the TrainState given, if any
    "finetune": "finetune",
    "dataset_train": "dataset_train",
    "dataset_eval": "dataset_eval",
    "data_collator": "data_collator",
    "mesh": "mesh",
    "data_axes": "data_axes",
    "tokenizer": "tokenizer",
    "is_process_zero": "is_process_zero",
    "run_config": "run_config",
    "objective": "objective",  # the kind's: what the steps minimise
    "data_spec": "data_spec",  # the kind's: what it reads and feeds its step
    "model_state": "model_state",  # the state being trained, restored or created on first use
    "checkpoints": "checkpoints",  # the checkpoint manager, or None while the run has no save_directory
    "tokenizer_slot": "_tokenizer",  # the tokenizer given, or its loading (`TokenizerSlot`)
    "prepare": "prepare",  # the kind's: its own work once the state exists, before step 1
    "width_per_step": "WIDTH_PER_STEP",  # the kind's: rows as wide as each step's data
    "save_checkpoint": "save_checkpoint",
    "evaluate_and_log": "_evaluate_and_log",
    "on_step_start": "on_step_start",  # the trainer's overridable hooks
    "on_step_end": "on_step_end",
    "hooks": "hooks",
    "added_callbacks": "callbacks",  # add_callback's
    "all_callbacks": "all_callbacks",
    "start_training_hook": "start_training_hook",
    "data_metrics": "data_metrics",  # the kind's: metrics of the data read so far
    "runtime": "runtime",
}
"""The run's inputs a builder may name, each read from the trainer's attribute of that name (a trainer kind adds
its own in its `INPUTS`, such as GRPO's reward functions): the one table where the trainer's members become named
collaborators."""


class Parts:
    """A trainer's components by name, each built on first use, once, by its builder called with the collaborators
    its keyword parameters name: components of `builders`, else inputs (`inputs[name]`: the attribute of the owner
    to read).

    `built(name)` says whether a component exists yet (a part that was never needed is never made: closing a run
    closes only what it opened); `forget(*names)` drops components so the next use rebuilds them from the inputs
    (a new starting point); `wiring()` lists the built components in the order they were made, each with the
    components it asked for while it was built — the run's component graph, read from the run itself.
    Safe across threads (setup compiles and loads in the background): a component is built by one thread, once;
    each thread keeps its own chain of components being built."""

    def __init__(self, builders: dict[str, Callable[..., Any]], inputs: Mapping[str, str] | None = None):
        self.builders = builders
        self.inputs = dict(inputs or {})
        self.made: dict[str, Any] = {}
        self.needs: dict[str, list[str]] = {}
        self._lock = threading.RLock()
        self._local = threading.local()

    @classmethod
    def of(cls, trainer_class: type) -> Parts:
        """Empty `Parts` with the builders of `trainer_class`'s components (its `part` attributes; a trainer kind's
        own builder of a name, such as GRPO's `batches`, wins over its base's; `BUILDERS`: components it holds without
        an attribute) and the inputs its classes declare (`INPUTS`)."""
        builders: dict[str, Callable[..., Any]] = {}
        inputs: dict[str, str] = {}
        for klass in reversed(trainer_class.__mro__):
            builders.update(vars(klass).get("BUILDERS", {}))
            builders.update({k: v.builder for k, v in vars(klass).items() if isinstance(v, part)})
            inputs.update(vars(klass).get("INPUTS", {}))
        return cls(builders, inputs)

    def get(self, name: str, owner: Any) -> Any:
        """The component `name` of `owner` (its trainer), built now if it is not yet."""
        building: list[str] = self._local.__dict__.setdefault("chain", [])
        if building and name not in self.needs[building[-1]]:
            self.needs[building[-1]].append(name)
        if name in self.made:  # the common case, every step: no lock
            return self.made[name]
        if name in building:
            raise RuntimeError(f"component {name!r} needs itself: {' -> '.join([*building, name])}")
        with self._lock:
            if name in self.made:  # another thread built it meanwhile
                return self.made[name]
            building.append(name)
            self.needs[name] = []
            try:
                made = self.call(self.builders[name], owner)
            finally:
                building.pop()
            self.made[name] = made
        return made

    def call(self, builder: Callable[..., T], owner: Any) -> T:
        """`builder(**collaborators)`: each of its parameters given the component or input it names (a `Later`
        one as a function returning it, an `IfBuilt` one as a function returning it only if it is built)."""
        given = {}
        for p in inspect.signature(builder).parameters.values():
            how = _marker(p.annotation)
            given[p.name] = self._collaborator(builder, p.name, owner, how)
        return builder(**given)

    def _collaborator(self, builder: Callable[..., Any], name: str, owner: Any, how: str) -> Any:
        if how == "IfBuilt" and name.endswith("_if_built"):  # beside the same component asked for `Later`
            name = name.removesuffix("_if_built")
        if name in self.builders:
            if how == "IfBuilt":
                return lambda: self.made.get(name)
            return (lambda: self.get(name, owner)) if how == "Later" else self.get(name, owner)
        if how == "IfBuilt":
            raise TypeError(f"{builder.__name__}() asks for {name!r} if built, but it is not a component")
        if name not in self.inputs:
            raise TypeError(
                f"{builder.__name__}() names {name!r}, which is neither a component ({sorted(self.builders)}) "
                f"nor an input of the run ({sorted(self.inputs)})"
            )
        attribute = self.inputs[name]
        return (lambda: getattr(owner, attribute)) if how == "Later" else getattr(owner, attribute)

    def built(self, name: str) -> bool:
        """Whether component `name` has been built."""
        return name in self.made

    def forget(self, names: Iterable[str]) -> None:
        """Drop the components `names`: their next use builds them again."""
        for name in names:
            self.made.pop(name, None)
            self.needs.pop(name, None)

    def wiring(self) -> list[tuple[str, str, list[str]]]:
        """`(name, component class, components it was built from)` of every built component, in build order."""
        return [(n, type(p).__name__, list(self.needs.get(n, []))) for n, p in self.made.items()]


def _marker(annotation: Any) -> str:
    """ "Later", "IfBuilt" or "" for a parameter's annotation (a string under `from __future__ import annotations`)."""
    if isinstance(annotation, str):
        return annotation.split("[", 1)[0].strip()
    origin = get_origin(annotation) or annotation
    return origin.__name__ if origin in (Later, IfBuilt) else ""


class part:  # noqa: N801 - used like a property
    """A trainer attribute that is its component `name` from the trainer's `Parts` (built on first use); on the
    class, the builder function (its docstring and return annotation document the component)."""

    def __init__(self, builder: Callable[..., Any]):
        self.builder = builder
        self.name = builder.__name__
        self.__doc__ = builder.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return obj.parts.get(self.name, obj)


# ---- the builders ------------------------------------------------------------------------------------------
def source_model(*, given_model: Any) -> Any:
    """The model this kind trains, as given (a reward model's kind makes a classifier of it)."""
    return given_model


def plan(
    *,
    arguments: TrainingArguments,
    source_model: Any,
    mesh: Any,
    batches: Later[Batches],
    given_state: js.TrainState | None,
    finetune: bool,
    dataset_eval: Any,
) -> Plan:
    """Everything abstract about the run (`Plan.build`): nothing is allocated or compiled. The batches are asked
    only to count the epochs' steps (no `max_training_steps`)."""
    steps = arguments.max_training_steps or batches().steps_for_epochs()
    return Plan.build(
        arguments,
        source_model,
        mesh=mesh,
        total_steps=steps,
        state=given_state,
        finetune=finetune,
        check_eval=dataset_eval is not None,
    )


def batches(
    *,
    arguments: TrainingArguments,
    data_spec: Callable[[], DataSpec],
    data_collator: Any,
    mesh: Any,
    data_axes: Any,
    tokenizer: Later[Any],
    dataset_train: Any,
    dataset_eval: Any,
) -> Batches:
    """The run's loaders and global batches, for this trainer kind's `data_spec()`."""
    return Batches(
        arguments,
        data_spec(),
        collator=data_collator,
        mesh=mesh,
        data_axes=data_axes,
        tokenizer=tokenizer,
        dataset_train=dataset_train,
        dataset_eval=dataset_eval,
    )


def functions(
    *, arguments: TrainingArguments, plan: Plan, batches: Batches, objective: Callable[[], Objective]
) -> StepFunctions:
    """The train and eval steps jitted over the plan's shardings, for this kind's `objective()`."""
    return step_functions(arguments, plan, batches, objective())


def step_functions(
    arguments: TrainingArguments, plan: Plan, batches: Batches, objective: Objective, frozen: Any = None
) -> StepFunctions:
    """The steps of `objective` (`functions`); `frozen`: what the objective reads and never trains
    (distillation's teacher), the steps' first argument."""
    a = arguments
    config = StepConfig(
        z_loss=a.z_loss,
        loss_block_size=a.loss_block_size,
        data_shards=batches.data_shards(),
        aux_loss_coef=getattr(plan.config, "router_aux_loss_coef", 0.0),
        router_bias_update_rate=a.router_bias_update_rate,
        skip_nonfinite=a.nan_policy == "skip",
        dropout=bool(plan.lora is not None and plan.lora.dropout),
        schedule=plan.schedule,
        objective=objective,
    )
    accumulation = a.gradient_accumulation_steps
    return StepFunctions.build(
        plan, batches.spec, config, accumulation=accumulation, donate=a.donate_state, frozen=frozen
    )


def run_identity(*, arguments: TrainingArguments, plan: Plan, tokenizer: Any, dataset_train: Any) -> dict[str, Any]:
    """What this run is (arguments, model config, tokenizer, training data), recorded in every checkpoint."""
    return resume.run_identity(arguments, plan.config, tokenizer, dataset_train)


def run_directory(*, run: RunState) -> RunDirectory:
    """The run's directory (`save_directory`, chosen now when not set and written into the run's arguments):
    lock, run files, a store's staging."""
    if RunDirectory(run.arguments.checkpoint).location is None:  # a new name, the same on every process
        run.arguments = run.arguments.replace(save_directory=resume.fresh_run_directory())
        log.info("save_directory not set: this run writes to %s", run.arguments.save_directory)
    use_endpoint(run.arguments.checkpoint.storage_endpoint_url)  # before anything reads the store
    return RunDirectory(run.arguments.checkpoint)


def checkpointing(
    *,
    run: RunState,
    run_directory: RunDirectory,
    batches: Batches,
    plan: Plan,
    run_identity: Later[dict[str, Any]],
    setup: Later[Setup],
) -> Checkpointing:
    """Checkpoints in the run directory: cadence, saves behind the lease's fence with the batches' data position
    and the run's metadata, restore (the data position handed back to the batches) and resume."""

    def metadata(step: int) -> dict[str, Any]:
        """What each checkpoint records about the run: tokens seen, the arguments, the run's identity, a LoRA
        run's base digest."""
        a = run.arguments
        return {
            "tokens_seen": step * a.training_batch_size * batches.spec.row_width,
            "arguments": js.to_jsonable(a.to_dict()),
            "run": run_identity(),
            **({"lora_base": setup().base_digest()} if plan.lora is not None else {}),
        }

    return Checkpointing(
        run.arguments.checkpoint, run_directory.checkpoints, fence=run_directory.fence, data=batches, metadata=metadata
    )


def step_log(
    *,
    arguments: TrainingArguments,
    plan: Plan,
    batches: Batches,
    mesh: Any,
    is_process_zero: bool,
    functions: StepFunctions,
    run_directory: RunDirectory,
) -> StepLog:
    """The per-step log: progress bar, metrics rows, TensorBoard, W&B."""
    return StepLog(
        arguments,
        config=plan.config,
        row_width=batches.spec.row_width,
        devices=mesh.devices.size,
        is_process_zero=is_process_zero,
        perplexity=functions.config.objective.perplexity,
        directory=run_directory.local,
    )


def evaluator(*, functions: StepFunctions, batches: Batches, arguments: TrainingArguments, mesh: Any) -> Evaluator:
    """Evaluation over the held-out batches with the eval step of this kind's objective."""
    return Evaluator(
        batches, functions.evaluate, functions.config.objective, eval_batches=arguments.eval_batches, mesh=mesh
    )


def generation(
    *,
    arguments: TrainingArguments,
    tokenizer: Later[Any],
    mesh: Any,
    model_state: Later[js.TrainState],
    setup: Later[Setup],
    step_log: IfBuilt[StepLog],
) -> Generation:
    """Generation from the current state: `generate_unified`, `generate_aio`, previews."""
    return Generation(
        arguments,
        tokenizer=tokenizer,
        mesh=mesh,
        current=model_state,
        setup=lambda: setup().initialize_trainer_utils(),
        log=step_log,
    )


def stop_control(*, run: RunState, run_directory: RunDirectory) -> StopControl:
    """When the run stops: signals, the time limit, a non-finite loss, stop requests, a lost lease."""
    a = run.arguments
    where = f" in {run_directory.checkpoints}" if a.save_directory else ""  # the run directory's path (a URI)
    stop = StopControl(a.nan_policy, a.training_time_limit, where=where)
    # a store lease taken over: stop after this step; the final save's fence then raises on every process
    run_directory.on_lost = lambda: stop.request_stop("the run directory's lease was taken by another run")
    return stop


def exporter(
    *,
    run: RunState,
    setup: Later[Setup],
    tokenizer: Later[Any],
    run_directory: Later[RunDirectory],
    run_identity: Later[dict[str, Any]],
    source_model: Later[Any],
    plan: Later[Plan],
    mesh: Any,
    dataset_train: Any,
    dataset_eval: Any,
    step_log: IfBuilt[StepLog],
) -> Exporter:
    """The run's outputs: `save_pretrained` (HF, PEFT, torch) and `save_information` (report.md)."""

    def current():
        if run.state is None:  # a restored state (jaxloom convert) needs no loader, compile or lock
            setup().initialize_trainer_utils()
        return run.state

    def facts() -> dict[str, Any]:
        return dict(
            identity=run_identity(),
            dataset_train=dataset_train,
            dataset_eval=dataset_eval,
            model=source_model(),
            n_params=plan().n_params,
            mesh=mesh,
            arguments=run.arguments,
            resumed_from=run.resumed_from,
            history=_history(step_log)(),
        )

    return Exporter(
        current=current,
        tokenizer=tokenizer,
        files=lambda: setup().tokenizer_slot.files(),
        arguments=lambda: run.arguments,
        directory=lambda: run_directory().folder,
        facts=facts,
        base=lambda: pretrained_source(source_model()),
    )


def _history(step_log: IfBuilt[StepLog]) -> Callable[[], list]:
    """The step log's rows so far (none when it was never built)."""
    return lambda: getattr(step_log(), "history", [])


def run_view(
    *,
    run: RunState,
    checkpoints: Later[Any],
    step_log: IfBuilt[StepLog],
    dataset_eval: Any,
    is_process_zero: bool,
    stop_control: Later[StopControl],
) -> RunView:
    """What callbacks see of the run, and may change (`RunView`): the state, the arguments, the checkpoints, the
    rows logged so far, a stop request. Callbacks get this, never the trainer."""
    return RunView(
        arguments=lambda: run.arguments,
        state=(lambda: run.state, lambda value: setattr(run, "state", value)),
        checkpoints=checkpoints,
        history=_history(step_log),
        evaluates=dataset_eval is not None,
        is_process_zero=is_process_zero,
        request_stop=lambda reason: stop_control().request_stop(reason),
    )


def callbacks(
    *,
    arguments: TrainingArguments,
    checkpointing: Checkpointing,
    save_checkpoint: Callable[[int], None],
    evaluate_and_log: Callable[[int], Any],
    generation: Later[Generation],
    benchmarks: Later[Benchmarks],
    dataset_eval: Any,
    on_step_start: Callable,
    on_step_end: Callable,
    hooks: list,
    added_callbacks: list[Callback],
    run_files: Later[RunFiles],
) -> Callbacks:
    """Every callback of the run in the order they run: checkpoint first (saved before anything that can
    fail runs on the step), evaluation and preview on their cadence, the trainer's own hooks, `hooks`, then
    the callbacks added with `add_callback`."""
    a = arguments
    builtin = [
        Callback(
            lambda run, step: save_checkpoint(step),
            when=checkpointing.should_save,
            name="checkpoint",
            on_step_end=lambda run, step, metrics: checkpointing.after_step(step),
        ),
        Callback(on_save=lambda run, step: run_files().keep(), name="run files"),
    ]
    if a.evaluation_steps and dataset_eval is not None:
        builtin.append(Callback(lambda run, step: evaluate_and_log(step), every=a.evaluation_steps, name="evaluation"))
    if a.generation_interval and a.generation_prompts:
        builtin.append(
            Callback(lambda run, step: generation().preview(step), every=a.generation_interval, name="preview")
        )
    if a.eval_tasks:
        bench = benchmarks()
        bench.check()  # before step 1: lm-eval installed, every task known

        def evaluate_tasks(run: RunView, step: int) -> None:
            if run.checkpoints is not None:  # the step's checkpoint committed before anything that can fail runs
                run.checkpoints.wait_until_finished()
            bench.run(run.state, step)

        builtin.append(
            Callback(
                evaluate_tasks,
                when=bench.due,
                name="lm-eval",
                on_step_start=lambda run, step: bench.before_first_step(run.state, step),
            )
        )
    own = trainer_hooks(on_step_start, on_step_end)
    return Callbacks([*builtin, own, *map(Callback.of, hooks), *added_callbacks])


def benchmarks(
    *,
    arguments: TrainingArguments,
    plan: Plan,
    tokenizer: Later[Any],
    mesh: Any,
    step_log: Later[StepLog],
    run_directory: Later[RunDirectory],
    is_process_zero: bool,
) -> Benchmarks:
    """lm-eval's `eval_tasks` on the state being trained, on the run's mesh and tokenizer, logged as `lm_eval/`."""

    def log_scores(scores: dict[str, float], step: int) -> None:
        steps = step_log()
        steps.log_metrics(scores, steps.pbar, step, mode="lm_eval")

    return Benchmarks(
        arguments,
        last_step=plan.total_steps,
        tokenizer=tokenizer,
        mesh=mesh,
        log=log_scores,
        folder=lambda: run_directory().local if is_process_zero else None,
        history=lambda: step_log().history,
    )


class RunFiles:
    """What rebuilds a run from its directory, kept after each checkpoint (process 0): a run directory removed under
    the run (`rm -rf`) gets back `run_config.json`, the tokenizer copy, `metrics.jsonl` with the whole history — so
    it can still be resumed by directory and converted; it was silently left with checkpoints only."""

    def __init__(self, run_directory: RunDirectory, run_config: Any, tokenizer: Later[Any], step_log: Later[StepLog]):
        self.run_directory, self.run_config, self.tokenizer, self.step_log = (
            run_directory,
            run_config,
            tokenizer,
            step_log,
        )

    def keep(self) -> None:
        """Write back what is missing, then sync the run directory (on a store: what changed since the last save)."""
        if self.run_directory.location is None:
            return
        if self.run_directory.files_missing(self.run_config):
            log.warning("%s lost its run files (removed?): writing them again", self.run_directory.location)
            self.run_directory.write_run_files(self.run_config, self.tokenizer())
        writer = self.step_log().writer
        if writer is not None:
            writer.rewrite_if_gone()
            writer.flush()
        self.run_directory.sync()


class NoRunFiles:
    """A process that does not write the run's files (not process 0)."""

    def keep(self) -> None:
        """Nothing."""


def run_files(
    *,
    is_process_zero: bool,
    run_directory: RunDirectory,
    run_config: Any,
    tokenizer: Later[Any],
    step_log: Later[StepLog],
) -> RunFiles | NoRunFiles:
    """Keeping the run's files after each checkpoint (process 0 only)."""
    if not is_process_zero:
        return NoRunFiles()
    return RunFiles(run_directory, run_config, tokenizer, step_log)


class forward:  # noqa: N801 - used like a decorator-less property
    """A facade member that is a component's method under the same name: `generate_aio = forward("generation")`
    on the trainer gives `trainer.generation.generate_aio`, with that method's signature and docstring (on the
    class, the component class's function, so `help()` and the API docs show them)."""

    def __init__(self, component: str):
        self.component = component
        self.name = ""
        self._static: Any = None  # the component class's static method of this name, once looked up

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if self._static is None:  # looked up once: the loop reaches some of these names every step
            cls = COMPONENT_CLASSES.get(self.component)
            static = cls is not None and isinstance(inspect.getattr_static(cls, self.name, None), staticmethod)
            self._static = getattr(cls, self.name) if static else False
        if self._static is not False:
            return self._static  # nothing of the component is needed: it is not built
        if obj is None:
            built = vars(owner).get(self.component) if owner is not None else None
            builder = getattr(built, "builder", None)
            cls = getattr(builder, "__annotations__", {}).get("return") if builder is not None else None
            cls = COMPONENT_CLASSES.get(self.component, cls)
            return getattr(cls, self.name) if cls is not None else self
        return getattr(getattr(obj, self.component), self.name)


COMPONENT_CLASSES: dict[str, type] = {
    "generation": Generation,
    "batches": Batches,
    "exporter": Exporter,
    "stop_control": StopControl,
    "step_log": StepLog,
    "plan": Plan,
    "setup": Setup,
}
