"""`Setup`: a run made ready to train — the state restored or created on its shards, the loaders started at
its data position, the train step compiled — ordered so that the slow parts overlap, once. Built from the
collaborators it names (`Parts`), each component given as a function that builds it when setup reaches it; it
owns what setting up makes: the background pool, the train step (compiling, then compiled), whether it is done.

EasyDeL's names for its steps are its methods' names (`configure_model`, `configure_dataloaders`,
`configure_functions`, `initialize_trainer_utils`, `compile_aot`): the trainer's compatibility surface forwards
them here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

import jaxloom.data as jd
import jaxloom.state as js

from .checkpointing import Checkpointing
from .functions import Compilation, WidthSteps, later_memory
from .outputs import TrainerConfigureDataloaderOutput, TrainerConfigureFunctionOutput, TrainerConfigureModelOutput
from .run_directory import RunDirectory
from .run_state import RunState
from .runs import default_tokenizer

if TYPE_CHECKING:
    from .batches import Batches
    from .collaborators import IfBuilt, Later
    from .functions import StepFunctions
    from .plan import Plan
    from .previews import Generation

__all__ = ["Setup", "TokenizerSlot", "base_digest", "memory_plan", "restored_with_base", "use_compilation_cache"]
log = logging.getLogger("jaxloom.trainer")


class TokenizerSlot:
    """The run's tokenizer: the one given (`processing_class`), else the model's own (a model given as a directory
    holding one) or the bundled one, loaded on first use or in the background (`start`); with `match_bos`, set to
    add BOS by itself exactly when training does (`jaxloom.data.match_bos`), once."""

    def __init__(self, given: Any, source: Callable[[], tuple[str | None, Any]], match_bos: bool):
        self.value, self.source, self.match_bos, self.matched = given, source, match_bos, False
        self.processor: Callable[[], Any] | None = None  # a vision-language run's processor (its tokenizer this one)

    def files(self) -> Any:
        """What the run's directory and its exports keep of it: the processor of a vision-language run (its
        tokenizer, image processor and chat template: what transformers' `AutoProcessor` and `jaxloom generate
        --image` read back), else the tokenizer."""
        return self.processor() if self.processor is not None else self.get()

    def start(self, pool: ThreadPoolExecutor) -> None:
        """Load the default tokenizer on `pool` when none was given (nothing when one is there)."""
        if self.value is None:
            self.value = pool.submit(default_tokenizer, *self.source())

    def get(self) -> Any:
        """The tokenizer (loaded now, or waited for, if it is not yet)."""
        if self.value is None:
            self.value = default_tokenizer(*self.source())
        if isinstance(self.value, Future):  # loaded in the background during setup
            self.value = self.value.result()
        if self.match_bos and not self.matched:
            self.value = jd.match_bos(self.value, jd.DataConfig.add_bos)
            self.matched = True
        return self.value


@dataclasses.dataclass(kw_only=True, eq=False)
class Setup:
    """Setting a run up (see the module docstring). `prepare()` is the trainer kind's own work once the state exists
    (a frozen reference, a teacher, its checks before step 1); `width_per_step`: the kind's rows are as wide as each
    step's data (rollouts), so the train step is compiled per width when first met, not ahead."""

    run: RunState
    plan: Later[Plan]
    batches: Later[Batches]
    functions: Later[StepFunctions]
    checkpointing: Later[Checkpointing]
    checkpointing_if_built: IfBuilt[Checkpointing]
    checkpoints: Later[Any]
    run_directory: Later[RunDirectory]
    run_identity: Later[dict[str, Any]]
    generation: Later[Generation]
    run_config: Later[dict[str, Any] | None]
    tokenizer_slot: TokenizerSlot
    prepare: Callable[[], None]
    width_per_step: bool
    dataset_eval: Any
    is_process_zero: bool
    mesh: Later[Any]
    pool: ThreadPoolExecutor | None = dataclasses.field(default=None, init=False)
    train_fn: Any = dataclasses.field(default=None, init=False)  # a Compilation while it compiles, then compiled
    done: bool = dataclasses.field(default=False, init=False)
    digest: str | None = dataclasses.field(default=None, init=False)  # a LoRA run's base (see `base_digest`)

    # ---- the steps (EasyDeL's names) ----------------------------------------------------------------------
    def configure_model(self) -> TrainerConfigureModelOutput:
        """The state this run trains, on its shards: restored from the newest checkpoint of
        `save_directory` (`resume_if_possible`), else from the given state or model, else new from
        `seed`; then the trainer kind's own (`prepare()`: a reference, a teacher, checks). Also builds the mesh,
        the optimizer and schedule (`optimizer`, `scheduler`)."""
        run, plan = self.run, self.plan()
        if run.state is None:
            run.state = self._restore() if self.resume_step() is not None else self._initial_state()
        self.prepare()
        return TrainerConfigureModelOutput(
            model=run.state.model, state=run.state, tx=plan.tx, scheduler=plan.schedule, config=plan.config
        )

    def configure_dataloaders(self) -> TrainerConfigureDataloaderOutput:
        """This process's training loader, started at the restored data position (so call it after
        `configure_model()` when resuming), and a fresh evaluation loader."""
        plan, data = self.plan(), self.batches()
        if data.train is None:
            data.check_vocab(plan.config.vocab_size)
            self.generation().check_prompts(plan.config.max_position_embeddings)
            data.check_train_data()
            data.check_eval_data()
            data.train_loader()  # at the data position a restored checkpoint handed over (`Checkpointing.restore`)
        evaluation = self.run.arguments.eval_batches if self.dataset_eval is not None else None
        return TrainerConfigureDataloaderOutput(data.train, data.eval_loader(), plan.total_steps, evaluation)

    def configure_functions(self) -> TrainerConfigureFunctionOutput:
        """The train and eval steps jitted with explicit shardings and donation; the train step starts
        compiling for the exact shapes in the background (a kind whose rows are as wide as each step's data:
        compiled once per width when first met, nothing ahead)."""
        fns, a = self.functions(), self.run.arguments
        if self.width_per_step:
            self.train_fn = WidthSteps(fns, a.total_batch_size)
        else:
            later = later_memory(a, self.plan(), has_eval=self.dataset_eval is not None)
            self.train_fn = Compilation(self._pool(), self.lower_train_step, **later)
        return TrainerConfigureFunctionOutput(fns.train, fns.evaluate, self.mesh(), self.checkpoints())

    def initialize_trainer_utils(self) -> None:
        """Run the steps once, ordered so that the slow parts overlap: the tokenizer loads and the
        train step compiles in the background while the state is restored or created; a new run starts
        its loader (tokenizing) before creating the state, a resumed one after restoring its position.
        Process-wide settings (the compilation cache) are applied here, at the start of a run."""
        if self.done:
            return
        directory = self.run_directory()
        built = self.checkpointing_if_built()
        if directory.take(is_process_zero=self.is_process_zero) and built is not None:
            built.manager.reload()  # the lock waited for another run: read its checkpoints again
        if self.run.arguments.compilation_cache_dir:
            use_compilation_cache(self.run.arguments.compilation_cache_dir)
        self.tokenizer_slot.start(self._pool())
        if self.train_fn is None:
            self.configure_functions()
        if self.run.state is None and self.resume_step() is not None:
            self.checkpointing().check_resume(str(directory.location), self.run_identity())
            self.configure_model()
            self.configure_dataloaders()
        else:
            self.configure_dataloaders()
            self.configure_model()
        if self.is_process_zero:  # what rebuilds the run from its directory, once the run is known to be valid
            directory.write_run_files(self.run_config(), self.tokenizer_slot.files())
        self.done = True

    # ---- compiling ------------------------------------------------------------------------------------
    def lower_train_step(self):
        """The train step lowered for the run's exact shapes and shardings (`jax.stages.Lowered`:
        `.as_text()` is the program before XLA's optimisations, `.compile()` the executable); for rows as wide as
        each step's data, for the widest row the run can make (what `jaxloom plan` budgets memory for)."""
        rows = self.run.arguments.total_batch_size
        if self.width_per_step:
            return self.functions().lower(rows, self.batches().widest_row())  # type: ignore[attr-defined]
        return self.functions().lower(rows)

    def compile_aot(self) -> bool:
        """Compile the train step for the run's exact shapes and shardings now, before the first batch
        (the loop uses this executable). Returns True when it compiled it, False when it already was."""
        if self.train_fn is None:
            self.configure_functions()
        if isinstance(self.train_fn, Compilation):
            self.train_fn = self.train_fn.result()
            return True
        return False

    def compiled_train_step(self):
        """The AOT-compiled train step (compiling it if needed): `memory_analysis()`, `cost_analysis()`; for rows
        as wide as each step's data, the step of the widest row."""
        if self.width_per_step:
            return self.lower_train_step().compile()
        self.compile_aot()
        return self.train_fn

    # ---- the state ------------------------------------------------------------------------------------
    def model_state(self) -> js.TrainState:
        """The state being trained: built (restored, or created on its shards) on first use."""
        return self.run.state if self.run.state is not None else self.configure_model().state

    def restore_checkpoint(self, *, params_only: bool = False, step: int | None = None) -> js.TrainState:
        """The newest checkpoint of `save_directory` (or checkpoint `step`) as the run's state, with nothing
        else set up (no loader, no compile): for commands that only read a run (`eval`, `generate`, `convert`).
        `params_only` leaves the optimizer state abstract. FileNotFoundError when there is none (or no `step`:
        the error lists the steps there are)."""
        run = self.run
        if RunDirectory(run.arguments.checkpoint).location is None:
            raise FileNotFoundError("save_directory is not set: there is no run to restore a checkpoint from")
        # a reader never changes the run (it may be training): not the run's own manager, which cleans up
        reader = Checkpointing(run.arguments.checkpoint, self.run_directory().checkpoints, read_only=True)
        try:
            restored = reader.restore(self.plan().target(), params_only=params_only, step=step)
        finally:
            reader.close()
        run.resumed_from = reader.read_from
        run.state = self._with_base(restored, run.resumed_from)
        return run.state

    def base_digest(self) -> str | None:
        """The digest of a LoRA run's frozen base (recorded with each checkpoint), else None."""
        if self.digest is None and self.plan().lora is not None:
            self.digest = base_digest(self.run.state)  # type: ignore[arg-type]
        return self.digest

    def resume_step(self) -> int | None:
        """The step a run resumes from (None: nothing to resume, or no save_directory)."""
        return None if self.checkpoints() is None else self.checkpointing().resume_step()

    def close(self) -> None:
        """Let the background pool go (its work is done or no longer needed)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False)

    def _pool(self) -> ThreadPoolExecutor:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxloom-setup")
        return self.pool

    def _restore(self) -> js.TrainState:
        checkpointing = self.checkpointing()
        restored = checkpointing.restore(self.plan().target())
        self.run.resumed_from = where = checkpointing.read_from
        restored = dataclasses.replace(restored, state=self._with_base(restored, where))
        # a warning: a Python user who configured no logging still sees that the run continued an earlier one
        log.warning("resumed from checkpoint %s (step %d)", where, restored.step)
        log.debug("data position at step %d: %s", restored.step, restored.data_state)
        return restored.state

    def _with_base(self, restored: js.Restored, where: str | None) -> js.TrainState:
        """A restored state completed by the plan (a LoRA run's base; see `restored_with_base`)."""
        state, digest = restored_with_base(self.plan(), restored, str(where))
        if digest is not None:
            self.digest = digest
        return state

    def _initial_state(self) -> js.TrainState:
        checkpoints = self.checkpoints()
        if self.run.arguments.resume_if_possible and checkpoints is not None:
            log.info("resume_if_possible: no complete checkpoint in %s; starting from scratch", checkpoints.directory)
        return self.plan().initial_state(after=getattr(self.train_fn, "traced", None))


def memory_plan(
    *,
    setup: Setup,
    arguments: Any,
    plan: Plan,
    functions: StepFunctions,
    batches: Batches,
    mesh: Any,
) -> dict[str, Any]:
    """`jaxloom plan`: the run's memory per device from the train step compiled for its exact shapes (what train()
    runs), the state's share, an RL kind's sampler KV cache, and whether it fits the device."""
    import jax

    import jaxloom.models as jm

    a = arguments
    compiled = setup.compiled_train_step()  # for the exact shapes; also what train() runs
    mem = compiled.memory_analysis()
    per_device = {}
    if mem is not None:
        per_device = {
            "arguments_gb": mem.argument_size_in_bytes / 2**30,
            "outputs_gb": mem.output_size_in_bytes / 2**30,
            "temporaries_gb": mem.temp_size_in_bytes / 2**30,
            "generated_code_gb": mem.generated_code_size_in_bytes / 2**30,
        }
        aliased = getattr(mem, "alias_size_in_bytes", 0) / 2**30  # outputs written over donated arguments
        per_device["total_gb"] = sum(per_device.values()) - aliased
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    capacity = stats.get("bytes_limit")
    out = {
        "parameters": plan.n_params,
        "flops_per_token": jm.flops_per_token(plan.config, a.max_sequence_length),
        "mesh": dict(mesh.shape),
        "devices": f"{mesh.devices.size} × {device.device_kind}",
        "memory_per_device": per_device,
        "state_gb_per_device": plan.state_gb_per_device(),  # parameters, optimizer state, frozen base
    }
    frozen = getattr(functions, "frozen", None)
    if frozen is not None:  # what the step reads and never trains: distillation's teacher
        from .plan import gb_per_device

        out["state_gb_per_device"]["teacher"] = gb_per_device(frozen.params)
    if plan.lora is not None:
        out["trainable_parameters"] = plan.n_trainable
    sampler = getattr(batches, "sampler", None)
    if sampler is not None:  # an RL kind: its sampler's KV cache, held between train steps beside the state
        rollouts: Any = batches
        most = sampler.kv_cache_bytes(plan.abstract.model, prompts=rollouts.per_rollout(), width=rollouts.widest_row())
        out["rollout_kv_cache_gb"] = most / 2**30
    if capacity and per_device:
        out["fits"] = per_device["total_gb"] * 2**30 <= capacity
        out["device_capacity_gb"] = capacity / 2**30
    return out


def restored_with_base(plan: Any, restored: js.Restored, where: str) -> tuple[js.TrainState, str | None]:
    """`(state, base digest)`: a restored LoRA state with its frozen base built from its source by `plan`
    (checkpoints hold the adapters alone), refused when the checkpoint at `where` was trained on another
    base (its recorded digest differs); other states as they are, with None."""
    state = plan.complete(restored.state)
    if plan.lora is None:
        return state, None
    recorded = (restored.metadata or {}).get("lora_base")
    mine = base_digest(state)
    if recorded is not None and recorded != mine:
        raise ValueError(
            f"checkpoint {where} holds adapters trained on another base model (base digest {recorded}; the base "
            f"given now has {mine}): resume with the base the adapters were trained on (model.from_pretrained), "
            "or start a new run (another save_directory)"
        )
    return state, mine


def base_digest(state: js.TrainState) -> str:
    """A digest of `state`'s frozen weights (a LoRA run's base), the same on any mesh and process count: the
    identity of the base its adapters belong to. Every process calls this together."""
    from jaxloom.mesh import named_leaves
    from jaxloom.state import integrity

    found = integrity.digests(dict(named_leaves(state.frozen)))
    return hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()[:16]


def use_compilation_cache(directory: str | Path) -> None:
    """Keep every program this process compiles from now on in `directory` (JAX's persistent
    compilation cache) and look there before compiling; with several processes JAX writes from one."""
    from jax.experimental.compilation_cache import compilation_cache

    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # small programs too: start-up
    compilation_cache.reset_cache()  # takes effect even if something was compiled before
