"""Shared by the state tests and their subprocess workers: a tiny Llama train state on a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxloom.models as jm
import jaxloom.state as js
from jaxloom.mesh import MeshConfig

CONFIG = jm.LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
RUNTIME = jm.RuntimeConfig()
TX = optax.adamw(1e-2)


def build(config=CONFIG, tx=TX):
    return js.TrainState.create(jm.create_model(config, RUNTIME, seed=0), tx)


def shardings(mesh, config=CONFIG, tx=TX):
    abstract = jax.eval_shape(lambda: build(config, tx))
    return abstract, js.state_shardings(
        abstract, jm.param_shardings(jm.create_model(config, RUNTIME, lazy=True), mesh), mesh
    )


def make_state(mesh, config=CONFIG, tx=TX):
    _, shard = shardings(mesh, config, tx)
    return jax.jit(lambda: build(config, tx), out_shardings=shard)()


def target(mesh, config=CONFIG, tx=TX):
    abstract, shard = shardings(mesh, config, tx)
    return jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shard)


def train_steps(state, n, seed=0):
    """n deterministic Adam steps on random tokens."""
    rng = np.random.default_rng(seed)

    @jax.jit
    def step(state, ids):
        def loss(params):
            logits = jm.LlamaForCausalLM.__call__(
                __import__("flax").nnx.merge(state.graphdef, params, state.model_state or {}), ids
            ).logits
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

        grads = jax.grad(loss)(state.params)
        return state.apply_gradients(grads)

    for _ in range(n):
        state = step(state, jnp.asarray(rng.integers(0, 64, (8, 8)), jnp.int32))
    return state


def mesh_of(**axes):
    return MeshConfig.from_axes(**axes).build(jax.devices()[: int(np.prod(list(axes.values())))])
