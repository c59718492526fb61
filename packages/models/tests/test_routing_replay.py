"""MoE routing replay (`CausalLM(routing=...)`, the field's R3): every MoE family reports the experts each layer sent
each token to (`routes`), and a forward given recorded experts sends the tokens there — its router still weighing
them (so it keeps its gradient) — wherever they were recorded (-1: the router chooses)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxloom.models as jm

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, max_position_embeddings=64)
FAMILIES = {
    "mixtral-scanned": (
        jm.MixtralConfig(**TINY, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4), True
    ),
    "qwen3_moe-mixed": (
        jm.Qwen3MoeConfig(
            **TINY, num_hidden_layers=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, mlp_only_layers=(0,),
        ),
        False,
    ),
    "deepseek_v3": (
        jm.DeepseekV3Config(
            **TINY, num_hidden_layers=2, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=8,
            n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        ),
        False,
    ),
    "gpt_oss": (
        jm.GptOssConfig(
            **TINY, num_hidden_layers=2, num_key_value_heads=2, head_dim=8, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=4,
        ),
        False,
    ),
}  # fmt: skip


def nudged(model, scale):
    """`model` with every floating weight moved by `scale` times standard normal noise (another policy version)."""
    graphdef, state = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(state))))
    return nnx.merge(
        graphdef,
        jax.tree.map(
            lambda x: (
                x + scale * jax.random.normal(next(keys), x.shape, x.dtype)
                if jnp.issubdtype(x.dtype, jnp.floating)
                else x
            ),
            state,
        ),
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_replayed_forward_sends_each_recorded_token_to_the_recorded_experts(family):
    config, scan = FAMILIES[family]
    model = jm.create_model(config, jm.RuntimeConfig(scan_layers=scan), seed=0)
    ids = jax.random.randint(jax.random.key(1), (3, 10), 1, 64)
    mask = jnp.ones((3, 10), jnp.int32).at[0, :3].set(0)

    @jax.jit
    def forward(state, routing=None):
        return nnx.merge(*state)(ids, attention_mask=mask, routing=routing)

    base = forward(nnx.split(model))
    routes = np.asarray(base.routes)  # [L, B, T, k]
    layers, k = config.num_hidden_layers, config.num_experts_per_tok
    assert routes.shape == (layers, 3, 10, k)
    sparse = (routes >= 0).all(axis=(1, 2, 3))
    assert sparse.any() and ((routes == -1) | (routes >= 0)).all()
    if family in ("qwen3_moe-mixed", "deepseek_v3"):  # a dense first layer routes nothing
        assert not sparse[0] and (routes[0] == -1).all()
    # replaying its own choice changes nothing, bit for bit
    same = forward(nnx.split(model), jnp.asarray(routes))
    np.testing.assert_array_equal(np.asarray(same.logits), np.asarray(base.logits))
    # another version of the weights chooses other experts on some tokens; replayed, it takes the recorded ones
    other = nudged(model, 0.05)
    free = forward(nnx.split(other))
    own = np.sort(np.asarray(free.routes), -1)
    differ = (own != np.sort(routes, -1)).any(-1)[sparse]
    assert 0 < differ.mean() < 1, differ.mean()
    recorded = routes.copy()
    recorded[:, 1, 7:] = -1  # row 1's last tokens unrecorded: the router chooses there
    replayed = forward(nnx.split(other), jnp.asarray(recorded))
    used = np.sort(np.asarray(replayed.routes), -1)
    np.testing.assert_array_equal(used[:, 1, 7:], own[:, 1, 7:])
    keep = np.ones((3, 10), bool)
    keep[1, 7:] = False
    np.testing.assert_array_equal(used[sparse][:, keep], np.sort(routes, -1)[sparse][:, keep])
    assert not np.allclose(np.asarray(replayed.logits), np.asarray(free.logits))


def test_a_replayed_router_keeps_its_gradient_and_its_weights_come_from_its_scores():
    """The replayed experts are weighted by the router's own probabilities of them: the router's kernel gets a
    gradient, and with the dense reference (every expert on every token) the replayed forward equals the token
    dispatch's."""
    config, _ = FAMILIES["mixtral-scanned"]
    ids = jax.random.randint(jax.random.key(2), (2, 8), 1, 64)
    outs = {}
    for impl in ("tiled", "dense"):
        model = jm.create_model(config, jm.RuntimeConfig(scan_layers=True, moe_implementation=impl), seed=0)
        routing = jnp.asarray(np.asarray(nudged(model, 0.05)(ids).routes))
        graphdef, state = nnx.split(model)

        @jax.jit
        def loss(state, routing=routing, graphdef=graphdef):
            out = nnx.merge(graphdef, state)(ids, routing=routing)
            return jnp.sum(jnp.sin(out.logits)), out.logits

        grads, logits = jax.grad(loss, has_aux=True)(state)
        outs[impl] = np.asarray(logits)
        gate = np.asarray(grads["model"]["layers"]["mlp"]["gate"]["kernel"][...])
        assert np.abs(gate).max() > 0
    np.testing.assert_allclose(outs["tiled"], outs["dense"], rtol=2e-5, atol=2e-5)
