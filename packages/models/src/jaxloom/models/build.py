"""Creating models: abstract (no memory), on one device, or directly sharded on a mesh; sizes and FLOPs."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from .configs import LlamaConfig
from .registry import TaskType, get_model_class
from .runtime import RuntimeConfig


def is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def variable_specs(state: Any, runtime: RuntimeConfig, mesh=None) -> Any:
    """An `nnx.State` with each Variable's value replaced by its `PartitionSpec` (from `logical_axes`)."""
    pa = runtime.partition_axis

    def spec(v):
        names = v.get_metadata().get("logical_axes", (None,) * len(v.shape))
        return v.replace(value=pa.spec(names, "param", mesh=mesh))

    return jax.tree_util.tree_map(spec, state, is_leaf=is_variable)


def _variable_shardings(state: Any, runtime: RuntimeConfig, mesh) -> Any:
    from jaxloom.mesh import validate_specs

    specs = variable_specs(state, runtime, mesh)
    validate_specs(specs, state, mesh)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)


def param_specs(model: nnx.Module, mesh=None, runtime: RuntimeConfig | None = None) -> dict:
    """`PartitionSpec` of every parameter of `model` (abstract or not), as a plain nested dict shaped like
    `nnx.to_pure_dict(nnx.state(model, nnx.Param))` (and like `TrainState.params`). With `mesh`, axes
    it lacks are dropped; `runtime` (its `PartitionAxis`) defaults to the model's."""
    runtime = runtime or model.runtime
    return nnx.to_pure_dict(variable_specs(nnx.state(model, nnx.Param), runtime, mesh))


def param_shardings(model: nnx.Module, mesh, runtime: RuntimeConfig | None = None, variables: Any = nnx.Param) -> dict:
    """Like `param_specs`, as `NamedSharding`s of `model`'s parameters on `mesh`; checks that every shape
    divides. `runtime` defaults to the model's; `variables` picks other variables (e.g. a LoRA run's
    `Frozen` base)."""
    runtime = runtime or model.runtime
    return nnx.to_pure_dict(_variable_shardings(nnx.state(model, variables), runtime, mesh))


def create_model(
    config: LlamaConfig,
    runtime: RuntimeConfig | None = None,
    *,
    seed: int = 0,
    mesh=None,
    lazy: bool = False,
    model_class: type | None = None,
    task: TaskType = TaskType.CAUSAL_LM,
):
    """A model for `config`. `lazy=True`: abstract (ShapeDtypeStructs, no memory). With `mesh`: every
    parameter is created directly on its shard (never whole on one device). Same values for the same seed
    whatever the mesh (one compiled program draws them all, with or without a mesh). `runtime`: dtypes,
    attention and remat (default `RuntimeConfig()`); `model_class` overrides the class the registry picks for
    `config.model_type` and `task`."""
    runtime = runtime or RuntimeConfig()
    cls = model_class or get_model_class(config.model_type, task)

    def make():
        return cls(config, runtime, rngs=nnx.Rngs(seed))

    if lazy:
        return nnx.eval_shape(make)
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    # one compiled program draws every parameter (op by op, each shape would compile on its own: slower, and
    # never in the persistent cache); the same program with or without a mesh, so the same values
    shardings = None if mesh is None else _variable_shardings(abstract, runtime, mesh)
    state = jax.jit(lambda: nnx.state(make()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def count_params(model_or_state: Any) -> int:
    """Number of parameters (`nnx.Param` only) of `model_or_state`: a model, abstract or not, or a state."""
    state = nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module) else model_or_state
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(state)))


def flops_per_token(config: LlamaConfig, seq_len: int, *, training: bool = True) -> float:
    """Model FLOPs per token of `config` at sequence length `seq_len` (PaLM appendix B):
    `2·N_active + 2·L·T·H_q·d_head` for a forward pass with
    causal attention counted whole, tripled for training (forward + backward). Embedding lookups
    are excluded, the output projection included."""
    d, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    attn = config.attention_matmul_params
    mlp = 0
    for layer in range(layers):
        if hasattr(config, "expert_intermediate_size") and getattr(config, "is_sparse", lambda _: True)(layer):
            mlp += 3 * d * config.expert_intermediate_size * config.num_experts_per_tok + d * config.num_experts
            mlp += 3 * d * getattr(config, "shared_expert_intermediate_size", 0)  # DeepSeek's always-on experts
        else:
            mlp += 3 * d * f
    matmul_params = layers * attn + mlp + d * config.vocab_size
    forward = 2 * matmul_params + 2 * layers * seq_len * config.num_attention_heads * config.attention_score_dims
    return float(3 * forward if training else forward)
