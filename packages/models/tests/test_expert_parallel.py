"""Expert parallelism: on a mesh with an `ep` axis each device keeps its own experts and the tokens move
to them, never the experts' weights; the numbers equal one device's dense reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxloom.models as jm
import jaxloom.models.moe as moe
from jaxloom.mesh import MeshConfig, PartitionAxis, gather

D, F, E = 32, 48, 8
CONFIG = jm.MixtralConfig(
    vocab_size=64,
    hidden_size=D,
    intermediate_size=F,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_hidden_layers=2,
    num_local_experts=E,
    num_experts_per_tok=2,
)
IDS = np.random.default_rng(4).integers(0, 64, (8, 16)).astype(np.int32)
BATCH_OVER_EP = PartitionAxis(batch_axis=("fsdp", "dp", "ep"))


def step(model, ids, mesh=None):
    """Logits and the gradient of a loss that touches every output (and the router's aux loss)."""
    graphdef, state = nnx.split(model)

    def loss(state):
        out = nnx.merge(graphdef, state)(ids)
        return jnp.sum(jnp.sin(out.logits)) + out.aux_loss, out.logits

    fn = jax.jit(jax.grad(loss, has_aux=True))
    if mesh is None:
        return fn(state)
    with jax.set_mesh(mesh):
        return fn(state), fn.lower(state).compile().as_text()


@pytest.fixture(scope="module")
def reference():
    grads, logits = step(jm.create_model(CONFIG, jm.RuntimeConfig(moe_implementation="dense"), seed=5), IDS)
    return np.asarray(logits), grads


@pytest.mark.parametrize(
    "axes, partition_axis, impl, scan",
    [
        (dict(ep=8), None, "tiled", False),  # tokens replicated over ep: outputs summed
        (dict(ep=2, fsdp=2, tp=2), None, "tiled", True),  # mlp split over tp too; scanned stack
        (dict(ep=4, fsdp=2), BATCH_OVER_EP, "tiled", False),  # tokens move: all-gather, reduce-scatter
        (dict(ep=2, dp=2, sp=2), PartitionAxis(batch_axis=("ep", "dp")), "ragged", False),
    ],
)
def test_expert_parallel_step_equals_one_device(reference, axes, partition_axis, impl, scan):
    ref_logits, ref_grads = reference
    runtime = jm.RuntimeConfig(
        moe_implementation=impl, scan_layers=scan, **({"partition_axis": partition_axis} if partition_axis else {})
    )
    mesh = MeshConfig.from_axes(**axes).build()
    model = jm.create_model(CONFIG, runtime, seed=5, mesh=mesh)
    (grads, logits), _ = step(model, IDS, mesh)
    if scan:  # a scanned stack draws its weights stacked: its own dense reference
        ref_grads, ref_logits = step(
            jm.create_model(CONFIG, jm.RuntimeConfig(moe_implementation="dense", scan_layers=True), seed=5), IDS
        )
    np.testing.assert_allclose(gather(logits), np.asarray(ref_logits), atol=2e-5)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads), strict=True):
        np.testing.assert_allclose(gather(g), np.asarray(r), atol=1e-4)


def _moved_weights(hlo: str) -> list[str]:
    """Collectives of the compiled program that carry expert weights: an array shaped `[n, D, F]` or
    `[n, F, D]` (the stacked experts, or tiles gathered from them) with more experts than one device's share."""
    moved = []
    for line in hlo.splitlines():
        if not re.search(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(", line):
            continue
        result = line.split("=", 1)[1].split("(", 2)
        for n, a, b in re.findall(r"f32\[(\d+),(\d+),(\d+)\]", " ".join(result[:2])):
            if {int(a), int(b)} == {D, F} and int(n) > E // 4:
                moved.append(f"{n}x{a}x{b}")
    return moved


def test_weights_stay_on_their_devices_and_tokens_move(monkeypatch):
    """ep=4 × dp=2 with the batch split over ep: no collective of the train step carries more than a
    device's 2 experts (weight gradients of its own experts are summed over dp, as in any data
    parallelism); the tokens are all-gathered over ep and the outputs reduce-scattered. Without expert
    parallelism the same step moves tiles of every expert's weights (the check sees it)."""
    mesh = MeshConfig.from_axes(ep=4, dp=2).build()
    runtime = jm.RuntimeConfig(moe_implementation="tiled", partition_axis=BATCH_OVER_EP)
    model = jm.create_model(CONFIG, runtime, seed=5, mesh=mesh)
    (_, _), hlo = step(model, IDS, mesh)
    assert _moved_weights(hlo) == []
    collectives = [
        line.split("=", 1)[1] for line in hlo.splitlines() if "all-gather" in line or "reduce-scatter" in line
    ]
    # the ep group's tokens (4 of the 8 sequences: dp keeps its halves) are gathered, the outputs scattered
    assert any("all-gather" in c and "f32[4,16,32]" in c for c in collectives), collectives
    assert any("reduce-scatter" in c and "f32[1,16,32]" in c for c in collectives), collectives
    monkeypatch.setattr(moe, "expert_parallel_mesh", lambda *a: None)
    (_, _), hlo = step(model, IDS, mesh)
    assert _moved_weights(hlo), "without expert parallelism the experts' weights travel"


def test_a_batch_that_does_not_divide_the_mesh_still_runs():
    """One sequence (generation) on a mesh that splits the batch over fsdp × ep: the dispatch keeps the
    batch whole on the axes it cannot divide over."""
    mesh = MeshConfig.from_axes(ep=4, fsdp=2).build()
    runtime = jm.RuntimeConfig(moe_implementation="tiled", partition_axis=BATCH_OVER_EP)
    model = jm.create_model(CONFIG, runtime, seed=5, mesh=mesh)
    ref = jm.create_model(CONFIG, jm.RuntimeConfig(moe_implementation="dense"), seed=5)
    with jax.set_mesh(mesh):
        logits = jax.jit(lambda m, x: m(x).logits)(model, IDS[:1])
    np.testing.assert_allclose(gather(logits), np.asarray(ref(IDS[:1]).logits), atol=2e-5)


def test_gpt_oss_experts_with_biases_equal_one_device_when_tokens_move_and_the_width_is_split():
    """GPT-OSS's biased experts over ep × fsdp × tp with the batch over ep (tokens all-gathered to the experts,
    outputs reduce-scattered back) and each expert's width over tp: the down projection's bias joins the partial
    sums once (on the first slice of the width), as on one device."""
    config = jm.GptOssConfig(
        vocab_size=64,
        hidden_size=D,
        intermediate_size=F,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        swiglu_limit=0.5,
    )

    def with_biases(model):
        for layer in model.model.layers:
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                v = getattr(layer.mlp.experts, name)
                v[...] = jax.device_put(0.5 * jax.random.normal(jax.random.key(len(name)), v.shape), v[...].sharding)
        return model

    ref_grads, ref_logits = step(
        with_biases(jm.create_model(config, jm.RuntimeConfig(moe_implementation="dense"), seed=5)), IDS
    )
    mesh = MeshConfig.from_axes(ep=2, fsdp=2, tp=2).build()
    runtime = jm.RuntimeConfig(moe_implementation="tiled", partition_axis=BATCH_OVER_EP)
    (grads, logits), _ = step(with_biases(jm.create_model(config, runtime, seed=5, mesh=mesh)), IDS, mesh)
    np.testing.assert_allclose(gather(logits), np.asarray(ref_logits), atol=2e-5)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads), strict=True):
        np.testing.assert_allclose(gather(g), np.asarray(r), atol=1e-4)
