"""How the trainer's components are built: one builder each, from the run's inputs (what the trainer was given,
and its kind's `objective()` and `data_spec()`) and the components it names. `Parts` holds them: a component is
built on first use (the trainer's constructor does no work), in the order the run asks for them, and says what it
was built from (`Parts.wiring()`: the component graph as data).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import jaxloom.state as js
from jaxloom.models import pretrained_source

from .batches import Batches
from .benchmarks import Benchmarks
from .callbacks import Callback, Callbacks, RunView, trainer_hooks
from .checkpointing import Checkpointing
from .evaluation import Evaluator
from .export import Exporter
from .functions import StepFunctions
from .monitor import StepLog
from .plan import Plan
from . import resume
from .previews import Generation
from .run_directory import RunDirectory, use_endpoint
from .step import StepConfig
from .stopping import StopControl


log = logging.getLogger("jaxloom.trainer")


class Parts:
    """A trainer's components by name, each built on first use by its builder (`builders[name](trainer)`), once.

    `built(name)` says whether a component exists yet (a part that was never needed is never made: closing a run
    closes only what it opened); `forget(*names)` drops components so the next use rebuilds them from the inputs
    (a new starting point); `wiring()` lists the built components in the order they were made, each with the
    components it asked for while it was built — the run's component graph, read from the run itself.
    Safe across threads (setup compiles and loads in the background): a component is built by one thread, once;
    each thread keeps its own chain of components being built."""

    def __init__(self, builders: dict[str, Callable[[Any], Any]]):
        self.builders = builders
        self.made: dict[str, Any] = {}
        self.needs: dict[str, list[str]] = {}
        self._lock = threading.RLock()
        self._local = threading.local()

    @classmethod
    def of(cls, trainer_class: type) -> Parts:
        """Empty `Parts` with the builders of `trainer_class`'s components (its `part` attributes; a trainer kind's
        own builder of a name, such as GRPO's `batches`, wins over its base's)."""
        builders = {}
        for klass in reversed(trainer_class.__mro__):
            builders.update({k: v.builder for k, v in vars(klass).items() if isinstance(v, part)})
        return cls(builders)

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
                made = self.builders[name](owner)
            finally:
                building.pop()
            self.made[name] = made
        return made

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


class part:  # noqa: N801 - used like a property
    """A trainer attribute that is its component `name` from the trainer's `Parts` (built on first use); on the
    class, the builder function (its docstring and return annotation document the component)."""

    def __init__(self, builder: Callable[[Any], Any]):
        self.builder = builder
        self.name = builder.__name__
        self.__doc__ = builder.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return obj.parts.get(self.name, obj)


def plan(trainer: Any) -> Plan:
    """Everything abstract about the run (`Plan.build`): nothing is allocated or compiled."""
    a = trainer.arguments
    steps = a.max_training_steps or trainer.batches.steps_for_epochs()
    return Plan.build(
        a,
        trainer._model_in,
        mesh=trainer.mesh,
        total_steps=steps,
        state=trainer._state_in,
        finetune=trainer.finetune,
        check_eval=trainer.dataset_eval is not None,
    )


def data_inputs(trainer: Any) -> dict[str, Any]:
    """What every batches component is built from: the mesh and its batch axes, the tokenizer (loaded on first
    use) and the training and evaluation data (for `Batches` and the kinds' own, such as GRPO's `Rollouts`)."""
    return dict(
        mesh=trainer.mesh,
        data_axes=trainer.data_axes,
        tokenizer=lambda: trainer.tokenizer,
        dataset_train=trainer.dataset_train,
        dataset_eval=trainer.dataset_eval,
    )


def batches(trainer: Any) -> Batches:
    """The run's loaders and global batches, for this trainer kind's `data_spec()`."""
    return Batches(trainer.arguments, trainer.data_spec(), collator=trainer.data_collator, **data_inputs(trainer))


def functions(trainer: Any, frozen: Any = None) -> StepFunctions:
    """The train and eval steps jitted over the plan's shardings, for this kind's `objective()`; `frozen`: what
    the objective reads and never trains (distillation's teacher), the steps' first argument."""
    a, plan = trainer.arguments, trainer.plan
    config = StepConfig(
        z_loss=a.z_loss,
        loss_block_size=a.loss_block_size,
        data_shards=trainer.batches.data_shards(),
        aux_loss_coef=getattr(plan.config, "router_aux_loss_coef", 0.0),
        router_bias_update_rate=a.router_bias_update_rate,
        skip_nonfinite=a.nan_policy == "skip",
        dropout=bool(plan.lora is not None and plan.lora.dropout),
        schedule=plan.schedule,
        objective=trainer.objective(),
    )
    accumulation = a.gradient_accumulation_steps
    spec = trainer.batches.spec
    return StepFunctions.build(plan, spec, config, accumulation=accumulation, donate=a.donate_state, frozen=frozen)


def run_identity(trainer: Any) -> dict[str, Any]:
    """What this run is (arguments, model config, tokenizer, training data), recorded in every checkpoint."""
    return resume.run_identity(trainer.arguments, trainer.config, trainer.tokenizer, trainer.dataset_train)


def run_directory(trainer: Any) -> RunDirectory:
    """The run's directory (`save_directory`, chosen now when not set): lock, run files, a store's staging."""
    if RunDirectory(trainer.arguments.checkpoint).location is None:  # a new name, the same on every process
        trainer.arguments = trainer.arguments.replace(save_directory=resume.fresh_run_directory())
        log.info("save_directory not set: this run writes to %s", trainer.arguments.save_directory)
    use_endpoint(trainer.arguments.checkpoint.storage_endpoint_url)  # before anything reads the store
    return RunDirectory(trainer.arguments.checkpoint)


def checkpointing(trainer: Any) -> Checkpointing:
    """Checkpoints in the run directory: cadence, saves behind the lease's fence with the batches' data position
    and the run's metadata, restore (the data position handed back to the batches) and resume."""
    run = trainer.run_directory

    def metadata(step: int) -> dict[str, Any]:
        """What each checkpoint records about the run: tokens seen, the arguments, the run's identity, a LoRA
        run's base digest."""
        a = trainer.arguments
        return {
            "tokens_seen": step * a.training_batch_size * trainer.row_width,
            "arguments": js.to_jsonable(a.to_dict()),
            "run": trainer.run_identity,
            **({"lora_base": trainer._base_digest} if trainer.plan.lora is not None else {}),
        }

    return Checkpointing(
        trainer.arguments.checkpoint, run.checkpoints, fence=run.fence, data=trainer.batches, metadata=metadata
    )


def step_log(trainer: Any) -> StepLog:
    """The per-step log: progress bar, metrics rows, TensorBoard, W&B."""
    return StepLog(
        trainer.arguments,
        config=trainer.config,
        row_width=trainer.row_width,
        devices=trainer.mesh.devices.size,
        is_process_zero=trainer.is_process_zero,
        perplexity=trainer.step_config.objective.perplexity,
        directory=trainer.run_directory.local,
    )


def evaluator(trainer: Any) -> Evaluator:
    """Evaluation over the held-out batches with the eval step of this kind's objective."""
    fns = trainer.functions
    return Evaluator(
        trainer.batches,
        fns.evaluate,
        fns.config.objective,
        eval_batches=trainer.arguments.eval_batches,
        mesh=trainer.mesh,
    )


def generation(trainer: Any) -> Generation:
    """Generation from the current state: `generate_unified`, `generate_aio`, previews."""
    return Generation(
        trainer.arguments,
        tokenizer=lambda: trainer.tokenizer,
        mesh=trainer.mesh,
        current=lambda: trainer.model_state,
        setup=trainer.initialize_trainer_utils,
        log=lambda: trainer.step_log if trainer.parts.built("step_log") else None,
    )


def stop_control(trainer: Any) -> StopControl:
    """When the run stops: signals, the time limit, a non-finite loss, stop requests, a lost lease."""
    a = trainer.arguments
    where = f" in {trainer.run_directory.checkpoints}" if a.save_directory else ""  # the run directory's path (a URI)
    stop = StopControl(a.nan_policy, a.training_time_limit, where=where)
    # a store lease taken over: stop after this step; the final save's fence then raises on every process
    trainer.run_directory.on_lost = lambda: stop.request_stop("the run directory's lease was taken by another run")
    return stop


def exporter(trainer: Any) -> Exporter:
    """The run's outputs: `save_pretrained` (HF, PEFT, torch) and `save_information` (report.md)."""

    def current():
        if trainer.state is None:  # a restored state (jaxloom convert) needs no loader, compile or lock
            trainer.initialize_trainer_utils()
        return trainer.state

    def facts() -> dict[str, Any]:
        return dict(
            identity=trainer.run_identity,
            dataset_train=trainer.dataset_train,
            dataset_eval=trainer.dataset_eval,
            model=trainer._model_in,
            n_params=trainer.n_params,
            mesh=trainer.mesh,
            arguments=trainer.arguments,
            resumed_from=trainer.resumed_from,
            history=trainer.step_log.history if trainer.parts.built("step_log") else [],
        )

    return Exporter(
        current=current,
        tokenizer=lambda: trainer.tokenizer,
        arguments=lambda: trainer.arguments,
        directory=lambda: trainer.run_directory.local,
        facts=facts,
        base=lambda: pretrained_source(trainer._model_in),
    )


def run_view(trainer: Any) -> RunView:
    """What callbacks see of the run, and may change (`RunView`): the state, the arguments, the checkpoints, the
    rows logged so far, a stop request. Callbacks get this, never the trainer."""
    return RunView(
        arguments=lambda: trainer.arguments,
        state=(lambda: trainer.state, lambda value: setattr(trainer, "state", value)),
        checkpoints=lambda: trainer.checkpoints,
        history=lambda: trainer.step_log.history if trainer.parts.built("step_log") else [],
        evaluates=trainer.dataset_eval is not None,
        is_process_zero=trainer.is_process_zero,
        request_stop=lambda reason: trainer.stop_control.request_stop(reason),
    )


def callbacks(trainer: Any) -> Callbacks:
    """Every callback of `trainer` in the order they run: checkpoint first (saved before anything that can
    fail runs on the step), evaluation and preview on their cadence, the trainer's own hooks, `hooks`, then
    the callbacks added with `add_callback`."""
    a = trainer.arguments
    save, evaluate, preview = trainer.save_checkpoint, trainer._evaluate_and_log, trainer.preview
    builtin = [
        Callback(
            lambda run, step: save(step),
            when=trainer.checkpointing.should_save,
            name="checkpoint",
            on_step_end=lambda run, step, metrics: trainer.checkpointing.after_step(step),
        ),
        Callback(on_save=lambda run, step: _run_files_kept(trainer), name="run files"),
    ]
    if a.evaluation_steps and trainer.dataset_eval is not None:
        builtin.append(Callback(lambda run, step: evaluate(step), every=a.evaluation_steps, name="evaluation"))
    if a.generation_interval and a.generation_prompts:
        builtin.append(Callback(lambda run, step: preview(step), every=a.generation_interval, name="preview"))
    if a.eval_tasks:
        bench = benchmarks(trainer)
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
    own = trainer_hooks(trainer.on_step_start, trainer.on_step_end)
    return Callbacks([*builtin, own, *map(Callback.of, trainer.hooks), *trainer.callbacks])


def benchmarks(trainer: Any) -> Benchmarks:
    """lm-eval's `eval_tasks` on the state being trained, on the run's mesh and tokenizer, logged as `lm_eval/`."""
    return Benchmarks(
        trainer.arguments,
        last_step=trainer.plan.total_steps,
        tokenizer=lambda: trainer.tokenizer,
        mesh=trainer.mesh,
        log=lambda scores, step: trainer.log_metrics(scores, trainer.pbar, step, mode="lm_eval"),
        folder=lambda: trainer.run_directory.local if trainer.is_process_zero else None,
        history=lambda: trainer.step_log.history if trainer.parts.built("step_log") else [],
    )


def _run_files_kept(trainer: Any) -> None:
    """After each checkpoint (process 0): a run directory removed under the run (`rm -rf`) gets back what
    rebuilds it — `run_config.json`, the tokenizer copy, `metrics.jsonl` with the whole history — so it can still
    be resumed by directory and converted; it was silently left with checkpoints only."""
    if not trainer.is_process_zero or trainer.run_directory.location is None:
        return
    if trainer.run_directory.files_missing(trainer.run_config):
        log.warning("%s lost its run files (removed?): writing them again", trainer.run_directory.location)
        trainer.run_directory.write_run_files(trainer.run_config, trainer.tokenizer)
    if trainer.step_log.writer is not None:
        trainer.step_log.writer.rewrite_if_gone()
        trainer.step_log.writer.flush()
    trainer.run_directory.sync()  # a run directory on a store: what changed since the last checkpoint


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
}
