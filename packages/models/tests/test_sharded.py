"""Sharded forward passes equal one device; every remat policy gives the same gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxloom.models as jm
from jaxloom.mesh import MeshConfig, gather

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA = jm.LlamaConfig(**TINY)
MIXTRAL = jm.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)


def inputs(b=8, t=16):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 96, (b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[::2, t // 2 :] = 0  # some padded rows
    return ids, mask


def run(model, ids, mask, mesh=None):
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, mask):
        out = nnx.merge(graphdef, state)(ids, attention_mask=mask)
        return out.logits, out.aux_loss

    if mesh is None:
        return forward(state, ids, mask)
    with jax.set_mesh(mesh):
        return forward(state, ids, mask)


@pytest.mark.parametrize(
    "config, axes",
    [
        (LLAMA, dict(fsdp=4, tp=2)),
        (LLAMA, dict(dp=2, fsdp=2, tp=2)),
        (MIXTRAL, dict(ep=2, fsdp=2, tp=2)),
        (MIXTRAL, dict(ep=4, tp=2)),
    ],
)
def test_sharded_forward_equals_one_device(config, axes):
    ids, mask = inputs()
    ref_logits, ref_aux = run(jm.create_model(config, seed=3), ids, mask)
    mesh = MeshConfig.from_axes(**axes).build()
    model = jm.create_model(config, seed=3, mesh=mesh)
    if isinstance(config, jm.MixtralConfig):
        assert model.model.layers[0].mlp.w_up[...].sharding.spec[0] == "ep"
    else:
        assert model.model.layers[0].mlp.up_proj.kernel[...].sharding.spec == P("fsdp", "tp")
    logits, aux = run(model, ids, mask, mesh)
    np.testing.assert_allclose(gather(logits), np.asarray(ref_logits), rtol=2e-5, atol=2e-5)
    if ref_aux is not None:
        np.testing.assert_allclose(float(gather(aux)), float(ref_aux), rtol=1e-5)


def test_from_pretrained_places_weights_on_their_shards(tmp_path):
    model = jm.create_model(LLAMA, seed=1)
    jm.save_hf_model(model, tmp_path)
    mesh = MeshConfig.from_axes(fsdp=4, tp=2).build()
    sharded = jm.from_pretrained(tmp_path, mesh=mesh)
    kernel = sharded.model.layers[1].self_attn.q_proj.kernel[...]
    assert kernel.sharding.spec == P("fsdp", "tp") and len(kernel.addressable_shards) == 8
    assert kernel.addressable_shards[0].data.shape == (16, 32)
    np.testing.assert_array_equal(gather(kernel), np.asarray(model.model.layers[1].self_attn.q_proj.kernel[...]))


@pytest.mark.parametrize("config", [LLAMA, MIXTRAL], ids=["llama", "mixtral"])
def test_every_remat_policy_gives_the_same_grads(config):
    ids, mask = inputs(4, 8)
    grads = {}
    for policy in ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"):
        model = jm.create_model(config, jm.RuntimeConfig(remat=policy), seed=0)
        graphdef, params = nnx.split(model, nnx.Param)

        @jax.jit
        def loss_and_grad(params, graphdef=graphdef):
            def loss(p):
                out = nnx.merge(graphdef, p)(ids, attention_mask=mask)
                ce = optax.softmax_cross_entropy_with_integer_labels(out.logits[:, :-1], ids[:, 1:])
                total = jnp.sum(ce * mask[:, 1:]) / mask[:, 1:].sum()
                return total + (0.01 * out.aux_loss if out.aux_loss is not None else 0.0)

            return jax.value_and_grad(loss)(params)

        value, g = loss_and_grad(params)
        assert np.isfinite(float(value))
        grads[policy] = jax.tree_util.tree_leaves(g)
    for policy, leaves in grads.items():
        for a, b in zip(leaves, grads["none"], strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7, err_msg=policy)
