"""Sharded forward passes equal one device; every remat policy gives the same gradients."""

import functools

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


FAMILIES = {
    "qwen3": jm.Qwen3Config(**TINY, head_dim=24),
    "qwen3_moe_mixed": jm.Qwen3MoeConfig(
        **TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(1,)
    ),
    "qwen3_moe": jm.Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma2": jm.Gemma2Config(
        **TINY,
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=20,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=0.5,
    ),
    "gemma3": jm.Gemma3TextConfig(**TINY, head_dim=16, sliding_window=4, sliding_window_pattern=2),
    "phi3": jm.Phi3Config(
        **TINY,
        sliding_window=6,
        rope_scaling=dict(
            rope_type="longrope",
            short_factor=[1.0] * 8,
            long_factor=[3.0] * 8,
            original_max_position_embeddings=8,
        ),
    ),
    "olmo2": jm.Olmo2Config(**TINY),
    # a NoPE layer with a window beside a RoPE layer: per-layer RoPE tables and windows as scanned data
    "smollm3": jm.SmolLM3Config(**TINY, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=4),
    # sinks, alternating windows, biased experts with the clamp binding; experts over ep, their width over tp
    "gpt_oss": jm.GptOssConfig(
        **{**TINY, "intermediate_size": 32},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        swiglu_limit=0.5,
        rope_scaling=None,
    ),
    # MLA (q bottleneck, interleaved RoPE), a dense layer then grouped routing with a shared expert: unrolled
    "deepseek_v3": jm.DeepseekV3Config(
        **{**TINY, "num_key_value_heads": 4},
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
    ),
}
UNSCANNED = {"qwen3_moe_mixed", "deepseek_v3"}  # dense and sparse layers: never one scan


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_steps_on_fsdp_tp_equal_one_device(family):
    """Three SGD steps of each family (scanned where its layers share a structure, so local and global layers
    run as one scan with per-layer windows and RoPE as data; chunked attention with remat) on fsdp × tp
    (× ep for the MoE) give the losses and weights of one device."""
    config = FAMILIES[family]
    runtime = jm.RuntimeConfig(scan_layers=True, attn_mechanism="chunked", attn_block_size=4, remat="dots_saveable")
    if family in UNSCANNED:
        runtime = runtime.replace(scan_layers=None)
    ids, mask = inputs(8, 16)
    tx = optax.sgd(1.0)  # linear in the gradients: Adam would amplify float noise where a gradient is ~0

    def train(mesh):
        model = jm.create_model(config, runtime, seed=5, mesh=mesh)
        graphdef, params = nnx.split(model, nnx.Param)
        opt = tx.init(params)
        placed = jax.tree_util.tree_map(lambda x: x.sharding, (params, opt))
        params, opt = jax.device_put((params, opt), placed)  # committed as the step's outputs are: one compile, not two

        # the next step's inputs keep the first's shardings: one compile per mesh, not one per layout XLA picks
        @functools.partial(jax.jit, out_shardings=(*placed, None))
        def step(params, opt):
            def loss(p):
                out = nnx.merge(graphdef, p)(ids, attention_mask=mask)
                ce = optax.softmax_cross_entropy_with_integer_labels(out.logits[:, :-1], ids[:, 1:])
                total = jnp.sum(ce * mask[:, 1:]) / mask[:, 1:].sum()
                return total + (0.01 * out.aux_loss if out.aux_loss is not None else 0.0)

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt, value

        losses = []
        for _ in range(3):
            params, opt, value = step(params, opt)
            losses.append(float(gather(value)))
        return losses, [np.asarray(gather(x)) for x in jax.tree_util.tree_leaves(params)], model

    ref_losses, ref_params, model = train(None)
    assert model.scanned == (family not in UNSCANNED)
    axes = dict(ep=2, fsdp=2, tp=2) if hasattr(config, "expert_intermediate_size") else dict(fsdp=4, tp=2)
    mesh = MeshConfig.from_axes(**axes).build()
    with jax.set_mesh(mesh):
        losses, params, _ = train(mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert ref_losses[-1] < ref_losses[0]
    for a, b in zip(params, ref_params, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
