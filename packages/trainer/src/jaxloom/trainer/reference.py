"""The frozen reference model of preference training (DPO) and online RL (GRPO): built once, sharded like the
policy, never checkpointed, and the one way to read a LoRA policy's base ("adapters off").

    ref = build_reference(plan, mesh, runtime, source)    # source: None (the starting policy), a model, a directory
    base = adapters_off(lora_state)                        # the base of a LoRA policy, read where it lies
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jaxloom.models as jmod
import jaxloom.state as js

from .runs import load_model


def adapters_off(state: js.TrainState) -> js.TrainState:
    """A LoRA policy's state with its adapters zeroed: the base model (`x A 0` adds exactly nothing), read where
    its frozen weights lie, never copied. The reference of DPO and GRPO under LoRA (TRL's way)."""
    return state.replace(params=jax.tree_util.tree_map(jnp.zeros_like, state.params))


def build_reference(
    plan: Any, mesh: Any, runtime: Any, source: Any, name: str = "ref_model", quantize: str | None = None
) -> js.TrainState:
    """The reference as a `TrainState` with no optimizer (`optax.identity`), sharded like the policy on `mesh`.
    `source`: None (the starting policy, rebuilt from `plan`'s source: the same on every resume), an `nnx` model,
    an HF directory or a jaxloom run directory; `runtime` (the arguments' `RuntimeConfig` changes, `.apply(r)`)
    sets its compute settings; `name` is the setting that gave `source`, for errors (distillation's teacher:
    `teacher_model_name_or_path`). `quantize` ("nf4", "int8"): its linear layers stored as QLoRA stores a base
    (`jaxloom.models.quantize_frozen`), the whole state replicated over `mesh`."""
    frozen = optax.identity()
    if source is None:
        fn, inputs = plan.build_fn, plan.build_inputs
        abstract = jax.eval_shape(lambda *i: _frozen(fn(*i), frozen), *inputs)
        shardings = js.state_shardings(abstract, plan.shardings.params, mesh)
        return jax.jit(lambda *i: _frozen(fn(*i), frozen), out_shardings=shardings)(*inputs)
    model = source if isinstance(source, nnx.Module) else load_model(str(source), name=name)
    if model.config.vocab_size != plan.config.vocab_size:
        raise ValueError(
            f"{name} has vocab_size {model.config.vocab_size}, the policy {plan.config.vocab_size}; expected "
            "the same vocabulary (it scores the policy's tokens)"
        )
    if quantize:
        model = jmod.quantize_frozen(nnx.clone(model) if model is source else model, quantize)  # not the caller's
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
        state = js.TrainState(
            step=jnp.zeros((), jnp.int32),
            params=nnx.to_pure_dict(params),
            opt_state=frozen.init(nnx.to_pure_dict(params)),
            rng=jax.random.PRNGKey(0),
            model_state=nnx.to_pure_dict(rest),
            graphdef=graphdef,
            tx=frozen,
        )
        return jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    abstract_model = jmod.create_model(model.config, runtime.apply(model.runtime), lazy=True, model_class=type(model))
    graphdef, target, _ = nnx.split(abstract_model, nnx.Param, ...)  # type: ignore[misc]
    _, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    params = jax.tree_util.tree_map(lambda p, t: p.astype(t.dtype), nnx.to_pure_dict(params), nnx.to_pure_dict(target))
    state = js.TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=frozen.init(params),
        rng=jax.random.PRNGKey(0),
        model_state=nnx.to_pure_dict(rest),
        graphdef=graphdef,
        tx=frozen,
    )
    shardings = js.state_shardings(jax.eval_shape(lambda: state), jmod.param_shardings(abstract_model, mesh), mesh)
    return jax.device_put(state, shardings)


def _frozen(state: js.TrainState, tx) -> js.TrainState:
    return js.TrainState(
        step=state.step,
        params=state.params,
        opt_state=tx.init(state.params),
        rng=state.rng,
        model_state=state.model_state,
        graphdef=state.graphdef,
        tx=tx,
    )
