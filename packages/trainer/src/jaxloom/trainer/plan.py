"""The plan of a run: everything abstract about the state it trains, built by one pure function.

`Plan.build(arguments, model, ...)` checks the settings against the model and the mesh, and gives the
optimizer and schedule, the state's shapes and shardings, the batch shardings and how the initial state
is made — without allocating or compiling anything. `plan.initial_state()` makes that state on its
shards; `plan.target()` is the tree a restore fills.

    plan = Plan.build(arguments, model, mesh=mesh, total_steps=100)
    state = plan.initial_state()
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jaxloom.models as jmod
import jaxloom.state as js
from jaxloom.mesh import local_batch_slice

from .optim import make_optimizer

log = logging.getLogger("jaxloom.trainer")


def data_axes(runtime: jmod.RuntimeConfig, mesh) -> tuple[str, ...]:
    """The mesh axes the batch rows are split over, in order: the model's `partition_axis.batch_axis`
    (default fsdp, then dp) as far as the mesh has them. The loaders lay rows out the same way, so
    no batch is resharded inside the step; with `ep` in it, a mixture of experts moves its tokens
    between the expert-parallel devices, which are data-parallel everywhere else."""
    axes = runtime.partition_axis.batch_axis
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return tuple(x for x in axes if x in mesh.shape)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run trains, abstractly: the model's `config` and class (`model_class`), the `runtime`, the
    `mesh`, the optimizer `tx` and `schedule` over `total_steps`, the parameter count `n_params`, the
    state's `abstract` tree and `shardings`, the train and eval batch shardings (`batch_sharding`,
    `eval_sharding`), and `build_fn(*build_inputs)`, which makes the state (from `given`, the state
    the trainer was given, when there is one); `arguments` are the run's; `lora` is an adapter run's
    `LoRAConfig` (None: every parameter trains) and `n_trainable` the parameters the optimizer updates;
    `attention` is the backend the model's attention runs here (what `auto` picked for this platform, dtype and
    length)."""

    config: Any
    model_class: type
    runtime: jmod.RuntimeConfig
    mesh: Any
    total_steps: int
    tx: Any
    schedule: Any
    n_params: int
    build_fn: Callable[..., js.TrainState]
    build_inputs: tuple
    abstract: js.TrainState
    shardings: Any
    batch_sharding: NamedSharding
    eval_sharding: NamedSharding
    given: js.TrainState | None = None
    arguments: Any = None
    lora: Any = None  # the LoRAConfig of an adapter run (jaxloom.models.LoRAConfig), else None
    n_trainable: int = 0
    attention: str = "auto"  # the attention backend the model runs here (what `auto` picked)

    @classmethod
    def build(
        cls,
        arguments: Any,
        model: nnx.Module,
        *,
        mesh,
        total_steps: int,
        state: js.TrainState | None = None,
        finetune: bool = True,
        check_eval: bool = True,
    ) -> Plan:
        """The plan of training `model` (or the given `state`, whose class is kept) with `arguments` on
        `mesh` for `total_steps`; `finetune=False` draws new parameters from the seed. Raises before anything
        runs when the settings cannot work (the evaluation batch size too with `check_eval`)."""
        runtime = arguments.runtime.apply(model.runtime)
        _check_fp8(runtime, mesh)
        config, model_class = model.config, type(model)
        attention = _check_attention(arguments, config, runtime, mesh)
        axes = data_axes(runtime, mesh)
        _check_shapes(arguments, config, mesh, axes, check_eval)
        tx, schedule = make_optimizer(arguments.optim, total_steps)
        abstract_model = jmod.create_model(config, runtime, lazy=True, model_class=model_class)
        lora = _lora_config(arguments, model, state)
        adapt = _adapter(lora, arguments.seed)
        fn, inputs = _state_builder(arguments.seed, tx, model, abstract_model, runtime, state, finetune, adapt)
        abstract = jax.eval_shape(fn, *inputs)
        shaped = abstract_model
        if lora is not None:  # the adapted model's layout: adapters beside each targeted weight, the rest frozen
            shaped = nnx.eval_shape(
                lambda: adapt(jmod.create_model(config, runtime, model_class=model_class))  # traced: no memory
            )
        frozen = jmod.param_shardings(shaped, mesh, variables=jmod.Frozen) if lora is not None else None
        shardings = js.state_shardings(abstract, jmod.param_shardings(shaped, mesh), mesh, frozen)
        spec = axes or None
        return cls(
            config=config,
            model_class=model_class,
            runtime=runtime,
            mesh=mesh,
            total_steps=total_steps,
            tx=tx,
            schedule=schedule,
            n_params=jmod.count_params(model),
            build_fn=fn,
            build_inputs=inputs,
            abstract=abstract,
            shardings=shardings,
            batch_sharding=NamedSharding(mesh, PartitionSpec(None, spec)),
            eval_sharding=NamedSharding(mesh, PartitionSpec(spec)),
            given=state,
            arguments=arguments,
            lora=lora,
            n_trainable=Plan.count_model_parameters(abstract.params),
            attention=attention,
        )

    @property
    def data_axes(self) -> tuple[str, ...]:
        return data_axes(self.runtime, self.mesh)

    @staticmethod
    def count_model_parameters(prm) -> int:
        """How many numbers `prm` holds (a model, an `nnx.State`, a dict of arrays or shape structs)."""
        if isinstance(prm, nnx.Module):
            prm = nnx.state(prm, nnx.Param)
        return int(sum(math.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(prm)))

    def calculate_number_total_flops(self, params, is_training: bool = True) -> float:
        """FLOPs of one optimizer step (`training_batch_size × max_sequence_length` tokens) of a model
        with `params`: `2·N` per token for the weights (N counted from `params`) plus causal attention
        from the config, tripled when `is_training` (forward and backward)."""
        a, c = self.arguments, self.config
        attention = 2 * c.num_hidden_layers * a.max_sequence_length * c.num_attention_heads * c.head_dim
        per_token = 2 * self.count_model_parameters(params) + attention
        return per_token * (3 if is_training else 1) * a.training_batch_size * a.max_sequence_length

    def target(self) -> js.TrainState:
        """The state's shapes, dtypes and shardings: what a restore or a lowering is given."""
        return jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.abstract, self.shardings
        )

    def initial_state(self, after: threading.Event | None = None) -> js.TrainState:
        """The state created on its shards by one jitted program (parameters and optimizer state together; from
        given parameters: copies, never aliases of them). It runs once: on CPU it is compiled without LLVM's
        optimisations (`ONE_SHOT`), which halves the compile of a random-number pipeline per parameter and
        changes no value — the start-up before step 1 is mostly compiling. `after`: an event (the train step
        traced) to wait for before tracing this program, so the two traces do not share Python's lock; the two
        compiles still overlap."""
        if after is not None:
            after.wait()
        if self.given is not None and _matches(self.given, self.abstract):
            return jax.jit(lambda s: s, out_shardings=self.shardings)(self.given)  # its optimizer state too
        fn, inputs = self.build_fn, self.build_inputs
        options = ONE_SHOT if self.mesh.devices.flat[0].platform == "cpu" else None
        compiled = jax.jit(fn, out_shardings=self.shardings).lower(*inputs).compile(compiler_options=options)
        state = compiled(*inputs)
        source = getattr(getattr(self.arguments, "adapter", None), "lora_from", None)
        if source is not None:  # adapters made elsewhere (PEFT): their values, on this run's shards
            model = jmod.load_peft_weights(state.model, source)
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            state = state.replace(params=jax.device_put(params, self.shardings.params))
        return state

    def state_gb_per_device(self) -> dict[str, float]:
        """GiB one device holds of the state: `parameters` (what trains), `optimizer` (its state) and `frozen`
        (a LoRA run's base), from shapes and shardings alone."""
        t = self.target()
        return {
            "parameters": gb_per_device(t.params),
            "optimizer": gb_per_device(t.opt_state),
            "frozen": gb_per_device(t.frozen),
        }

    def complete(self, state: js.TrainState) -> js.TrainState:
        """A restored state with its frozen weights (a LoRA run's base, never checkpointed) built from their
        source, as at the start of the run; other states as they are."""
        if self.lora is None or not jax.tree_util.tree_leaves(self.abstract.frozen):
            return state
        if jax.tree_util.tree_leaves(state.frozen) and isinstance(
            jax.tree_util.tree_leaves(state.frozen)[0], jax.Array
        ):
            return state
        return state.replace(frozen=self.initial_state().frozen)

    def as_own(self, state: js.TrainState, own: Callable[[], js.TrainState]) -> js.TrainState:
        """A state from elsewhere (another trainer, a restore) in this run's tree and shardings: its
        parameters in `own()`'s state."""
        if jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(self.abstract):
            return state
        return own().replace(params=jax.device_put(state.params, self.shardings.params))


SEQ_CLS_SAVED = ("classifier", "score")
"""What a LoRA run on a sequence classifier trains whole beside the adapters: PEFT's `SEQ_CLS` `modules_to_save`."""


def _lora_config(arguments, model, state) -> Any:
    """The run's `LoRAConfig` (None: every parameter trains); a model or state that already has adapters is
    taken as it is (its config)."""
    if jmod.lora_config_of(model) is not None or (state is not None and jmod.lora_config_of(state.model) is not None):
        raise ValueError(
            "the given model already has LoRA adapters; give the base model and set use_peft (or lora_from=ADAPTER_DIR)"
        )
    lora = arguments.adapter.lora_config() if hasattr(arguments, "adapter") else None
    if lora is not None and jmod.is_classifier(model) and not lora.modules_to_save:
        lora = dataclasses.replace(lora, modules_to_save=SEQ_CLS_SAVED)  # the new score trains (PEFT's SEQ_CLS)
    return lora


def _adapter(lora, seed) -> Callable[[nnx.Module], nnx.Module]:
    """`model -> model` with the run's adapters applied (the identity without LoRA, or on a model that has them)."""

    def adapt(model):
        if lora is None or jmod.lora_config_of(model) is not None:
            return model
        return jmod.apply_lora(model, lora, seed=seed)

    return adapt


ONE_SHOT: dict[str, str | bool] = {"xla_backend_optimization_level": "0", "xla_llvm_disable_expensive_passes": True}
"""XLA's CPU compiler options for a program that runs once (the initial state): compiling is all of its cost. (One
code-generation thread compiles it faster alone, 2.3 → 1.7 s for the 0.29M Llama, but beside the train step's compile
it finished last and the first step came later: not used.)"""


def _state_builder(seed, tx, template, abstract_model, runtime, state_in, finetune, adapt=lambda m: m):
    """`(fn, inputs)`: `fn(*inputs)` makes the initial state. From the seed when the model is abstract
    (or `finetune=False`); else from the given parameters, cast to `param_dtype` and put into the
    model rebuilt with this run's runtime; `adapt` adds a LoRA run's adapters."""
    config, cls = template.config, type(template)
    # The given state's class (EasyDeL's `state_class`, a `TrainState` subclass) is kept for the run.
    state_cls = type(state_in) if isinstance(state_in, js.TrainState) else js.TrainState
    leaves = jax.tree_util.tree_leaves(nnx.state(template, nnx.Param))
    if not finetune or (leaves and isinstance(leaves[0], jax.ShapeDtypeStruct)):
        return (
            lambda: state_cls.create(
                adapt(jmod.create_model(config, runtime, seed=seed, model_class=cls)), tx, seed=seed
            )
        ), ()
    _, params, rest = nnx.split(template, nnx.Param, ...)
    graphdef, target, _ = nnx.split(abstract_model, nnx.Param, ...)
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(target):
        raise ValueError(
            "the arguments change the layout of the given model's parameters (scan_layers "
            f"{template.runtime.scan_layers} -> {runtime.scan_layers}); create the model with "
            "the layout you want, or leave scan_layers unset"
        )
    cast = jax.tree_util.tree_map(lambda p, t: p.astype(t.dtype) if p.dtype != t.dtype else p, params, target)
    return (lambda p: state_cls.create(adapt(nnx.merge(graphdef, p, rest)), tx, seed=seed)), (cast,)


def _check_shapes(arguments, config, mesh, axes, check_eval: bool) -> None:
    """Before anything runs: rows fit the model's positions, and both batch sizes divide over the
    data axes (the evaluation batch is checked now, not at the first evaluation, after training)."""
    a = arguments
    if a.max_sequence_length > config.max_position_embeddings:
        raise ValueError(
            f"max_sequence_length = {a.max_sequence_length}; expected at most the model's "
            f"max_position_embeddings ({config.max_position_embeddings}): positions past it were never "
            "trained and exported models refuse them. Shorten the rows or raise model.max_position_embeddings"
        )
    local_batch_slice(mesh, a.total_batch_size, axes)
    if not check_eval:
        return
    try:
        local_batch_slice(mesh, a.eval_batch_size, axes)
    except ValueError as e:
        raise ValueError(f"evaluation_batch_size = {a.eval_batch_size}: {e}") from None


def _check_attention(arguments, config, runtime, mesh) -> str:
    """The attention backend this run's model runs (what `auto` picks here), checked to run on this mesh's
    platform at this length before anything compiles; cuDNN before Hopper cannot keep packed documents apart."""
    a = arguments
    platform = mesh.devices.flat[0].platform
    chosen = jmod.choose_implementation(
        runtime.attn_mechanism,
        q_len=a.max_sequence_length,
        kv_len=a.max_sequence_length,
        cached=False,
        window=config.sliding_window,
        platform=platform,
        softcap=config.attention_softcap,
        sinks=config.attention_sinks,
        dtype=runtime.dtype,
        head_dim=getattr(config, "qk_head_dim", None) or config.head_dim,  # DeepSeek's MLA: keys wider than values
        value_head_dim=getattr(config, "v_head_dim", None) or config.head_dim,
    )
    if chosen == "cudnn" and a.packing and not jmod.cudnn_packs(jmod.cuda_capability(platform)):
        raise ValueError(
            "attn_mechanism='cudnn' cannot keep packed documents apart on this GPU (cuDNN's packed layout "
            "needs Hopper or later): set packing=false, or use attn_mechanism='flash' or 'auto'"
        )
    return chosen


def _matches(state: js.TrainState, abstract: js.TrainState) -> bool:
    """Whether a given state fits this run's state exactly (same tree, shapes and dtypes): then its
    optimizer state and step are kept; otherwise only its parameters are."""
    try:
        pairs = zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(abstract), strict=True)
        same = jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(abstract)
        return same and all(
            isinstance(x, jax.Array | np.ndarray) and x.shape == y.shape and x.dtype == y.dtype for x, y in pairs
        )
    except (ValueError, AttributeError):
        return False


def gb_per_device(tree) -> float:
    """GiB one device holds of the arrays of `tree` (concrete or abstract, by their shardings; unsharded: whole)."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize
    return total / 2**30


def _check_fp8(runtime: Any, mesh: Any) -> None:
    """FP8 training runs where the devices multiply in FP8 (NVIDIA compute capability 8.9 and newer) or on a CPU,
    where XLA emulates it (the same numbers, no speed); any other device is refused with one line."""
    if getattr(runtime, "fp8", "none") == "none":
        return
    device = mesh.devices.flat[0]
    if device.platform == "cpu":
        log.info(
            "fp8=%s on a CPU: FP8 products emulated by XLA (the same numbers as a GPU's, no speed-up)", runtime.fp8
        )
        return
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None or tuple(int(p) for p in str(capability).split(".")) < (8, 9):
        raise ValueError(
            f"fp8 = {runtime.fp8!r} on {device.device_kind} ({device.platform}, compute capability {capability}): FP8 "
            "products need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); expected fp8=none"
        )
