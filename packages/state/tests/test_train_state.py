"""TrainState subclasses (EasyDeL's `state_class`) are pytrees with the fields they add, and shard."""

import dataclasses

import jax
import jax.numpy as jnp
import optax

import jaxloom.models as jm
from jaxloom.mesh import MeshConfig
from jaxloom.state import TrainState, state_shardings


def _model():
    cfg = jm.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return jm.create_model(cfg)


@dataclasses.dataclass(frozen=True)
class NotedState(TrainState):
    note: jax.Array | None = None


def test_a_subclass_with_a_field_of_its_own_goes_through_jit_and_shards():
    state = NotedState.create(_model(), optax.adam(1e-3)).replace(note=jnp.arange(3.0))
    base = TrainState.create(_model(), optax.adam(1e-3))
    assert len(jax.tree_util.tree_leaves(state)) == len(jax.tree_util.tree_leaves(base)) + 1
    out = jax.jit(lambda s: s.replace(note=s.note * 2))(state)
    assert type(out) is NotedState and out.note.tolist() == [0.0, 2.0, 4.0] and out.tx is state.tx
    mesh = MeshConfig.from_axes(fsdp=2).build(jax.devices()[:2])
    params = jax.tree_util.tree_map(
        lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), state.params
    )
    shardings = state_shardings(jax.eval_shape(lambda: state), params, mesh)
    assert type(shardings) is NotedState and shardings.note.spec == jax.sharding.PartitionSpec()
