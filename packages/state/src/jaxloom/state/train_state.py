"""`TrainState`: step, params, optimizer state and RNG as one pytree; the model's structure and the
optimizer ride along as static data, so the whole state goes through `jax.jit` with donation."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a training step reads and writes, as one pytree: `step`, `params` (the model's
    `nnx.Param` values as a nested dict), the optimizer's `opt_state`, the step's `rng`, the model's other
    variables (`model_state`), its frozen weights (`frozen`: a LoRA run's base, `jaxloom.models.Frozen`
    variables, None otherwise; rebuilt from their source on every start, never checkpointed), and,
    static, the model's `graphdef` and the optax transformation `tx`.
    Build it with `TrainState.create`; `state.model` rebuilds the `nnx` model."""

    step: jax.Array | Any  # int32 scalar (or its shape, as a restore target)
    params: Any  # nested dict of arrays (the model's nnx.Param values)
    opt_state: Any  # optax state over `params`
    rng: jax.Array | Any  # PRNG key for dropout-like randomness inside the step
    model_state: Any = None  # non-parameter variables of the model (usually empty)
    frozen: Any = None  # weights read and never trained (a LoRA run's base); never in a checkpoint
    graphdef: Any = None  # static: the model's structure (nnx.GraphDef)
    tx: Any = None  # static: the optax GradientTransformation

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A subclass (EasyDeL's `state_class`) is a pytree too, with the fields its dataclass declares:
        # found when flattened, so a subclass may add fields with its own `@dataclasses.dataclass`.
        super().__init_subclass__(**kwargs)
        _register_state_class(cls)

    @classmethod
    def create(cls, model: nnx.Module, tx: optax.GradientTransformation, *, seed: int = 0) -> TrainState:
        """From `model` (abstract or concrete) and the optimizer `tx`; the state's RNG key comes from
        `seed`. No sharding: that is the trainer's job; jit this under out_shardings (see
        `state_shardings`) to create it sharded."""
        from jaxloom.models.lora import Frozen

        graphdef, params, frozen, rest = nnx.split(model, nnx.Param, Frozen, ...)  # type: ignore[misc]
        params = nnx.to_pure_dict(params)
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=jax.random.PRNGKey(seed),
            model_state=nnx.to_pure_dict(rest),
            frozen=nnx.to_pure_dict(frozen) or None,
            graphdef=graphdef,
            tx=tx,
        )

    @property
    def model(self) -> nnx.Module:
        """The model with these parameters (cheap: no copy)."""
        if self.frozen:
            return nnx.merge(self.graphdef, self.params, self.frozen, self.model_state or {})
        return nnx.merge(self.graphdef, self.params, self.model_state or {})

    def apply_gradients(self, grads: Any, **changes: Any) -> TrainState:
        """One optimizer update with `grads`; `step` + 1; `changes` replace other fields."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **changes)

    def replace(self, **changes: Any) -> TrainState:
        """A copy with `changes` applied."""
        return dataclasses.replace(self, **changes)


_META_FIELDS = ("graphdef", "tx")


def _register_state_class(cls: type) -> None:
    """A subclass's pytree registration. Its data fields are read once, at its first flatten (its own
    `@dataclasses.dataclass` has run by then), not on every step."""
    names: tuple[str, ...] = ()

    def flatten(state):
        nonlocal names
        if not names:
            names = tuple(f.name for f in dataclasses.fields(state) if f.name not in _META_FIELDS)
        children = [(jax.tree_util.GetAttrKey(n), getattr(state, n)) for n in names]
        return children, tuple(getattr(state, m) for m in _META_FIELDS)

    def unflatten(meta, children):
        obj = object.__new__(cls)
        for name, value in (*zip(names, children, strict=True), *zip(_META_FIELDS, meta, strict=True)):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten, unflatten)


# TrainState itself on JAX's dataclass fast path (flattened in C++ at every step's dispatch).
jax.tree_util.register_dataclass(
    TrainState,
    data_fields=["step", "params", "opt_state", "rng", "model_state", "frozen"],
    meta_fields=list(_META_FIELDS),
)


def convert_model_to_state(
    model: nnx.Module, tx: optax.GradientTransformation | None = None, *, seed: int = 0
) -> TrainState:
    """EasyDeL's `convert_model_to_state`: a state of `model` without sharding, with optimizer `tx`
    (default: identity) and RNG `seed`."""
    return TrainState.create(model, tx or optax.identity(), seed=seed)


def state_shardings(state: TrainState, param_shardings: Any, mesh, frozen_shardings: Any = None) -> TrainState:
    """Shardings for a whole (abstract) state on `mesh`: params as `param_shardings` gives them (a dict
    tree like `state.params`), the optimizer's per-parameter leaves (Adam moments, ...) like their
    parameter, the frozen weights as `frozen_shardings` (default: replicated), the rest (and any field a
    subclass adds) replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    opt = optax.tree_map_params(
        state.tx, lambda _, s: s, state.opt_state, param_shardings, transform_non_params=lambda _: replicated
    )
    # Fields a `TrainState` subclass adds are replicated.
    base = {f.name for f in dataclasses.fields(TrainState)}
    extra = {
        f.name: jax.tree_util.tree_map(lambda _: replicated, getattr(state, f.name))
        for f in dataclasses.fields(state)
        if f.name not in base
    }
    return state.replace(
        **extra,
        step=replicated,
        params=param_shardings,
        opt_state=opt,
        rng=replicated,
        model_state=jax.tree_util.tree_map(lambda _: replicated, state.model_state),
        frozen=frozen_shardings
        if frozen_shardings is not None
        else jax.tree_util.tree_map(lambda _: replicated, state.frozen),
    )


def abstract_state(state_fn, *args, **kwargs) -> TrainState:
    """`jax.eval_shape` of `state_fn(*args, **kwargs)`, a state-building function: the state's shapes
    and dtypes, no memory."""
    return jax.eval_shape(state_fn, *args, **kwargs)
