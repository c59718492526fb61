"""Scanned decoder stacks and token-dispatching MoE: same numbers as the unrolled / dense references,
compile cost flat in depth, FLOPs that follow k rather than the expert count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxloom.models as jm
from jaxloom.models.moe import grouped_matmul, tile_rows

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def logits_and_grads(model, ids):
    """The logits and the gradient of a loss touching every output (and the aux loss), as one compiled program
    (run eagerly, every operation of the forward and backward passes compiled on its own: several times slower)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state):
        def loss(state):
            out = nnx.merge(graphdef, state)(ids)
            return jnp.sum(jnp.sin(out.logits)) + (0.0 if out.aux_loss is None else out.aux_loss), out.logits

        grads, logits = jax.grad(loss, has_aux=True)(state)
        return logits, grads

    logits, grads = run(state)
    return np.asarray(logits), grads


def test_scan_is_automatic_above_sixteen_layers_and_stacks_parameters():
    assert jm.SCAN_ABOVE_LAYERS == 16
    assert not jm.create_model(jm.LlamaConfig(**SMALL, num_hidden_layers=16), lazy=True).scanned
    deep = jm.create_model(jm.LlamaConfig(**SMALL, num_hidden_layers=17), lazy=True)
    assert deep.scanned
    assert deep.model.layers.self_attn.q_proj.kernel.get_value().shape == (17, 32, 32)
    assert deep.model.layers.self_attn.q_proj.kernel.get_metadata()["logical_axes"] == (None, "embed", "heads")
    assert not jm.create_model(
        jm.LlamaConfig(**SMALL, num_hidden_layers=6), jm.RuntimeConfig(scan_layers=False), lazy=True
    ).scanned


@pytest.mark.parametrize("config_class", [jm.LlamaConfig, jm.MixtralConfig])
def test_unrolled_layers_are_drawn_in_two_traces_with_the_sequential_draws_values(monkeypatch, config_class):
    """`draw_layers` traces layer 0 and one `lax.map` of the rest (an 8-layer init compiles in half the time) and
    draws what n layers built one after another from the shared stream draw: bitwise under jit, and eagerly
    within the rounding that separates a compiled program from the same operations run one by one."""
    from jaxloom.models import decoder

    config = config_class(**SMALL, num_hidden_layers=5)
    built, draw_layers = [], decoder.draw_layers

    def build():
        return jm.get_model_class(config.model_type)(config, jm.RuntimeConfig(scan_layers=False), rngs=nnx.Rngs(3))

    def counting(make_layer, n, rngs):
        return draw_layers(lambda r: built.append(1) or make_layer(r), n, rngs)

    monkeypatch.setattr(decoder, "draw_layers", counting)
    drawn, drawn_jit = build(), nnx.jit(build)()
    assert len(built) == 4  # two traces each, not five
    monkeypatch.setattr(decoder, "draw_layers", lambda make_layer, n, rngs: [make_layer(rngs) for _ in range(n)])
    one_by_one, one_by_one_jit = build(), nnx.jit(build)()
    for a, b, atol in [(drawn_jit, one_by_one_jit, 0.0), (drawn, one_by_one, 1e-8)]:  # eagerly: op by op vs compiled
        pairs = zip(jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param)), strict=True)
        assert all(np.allclose(x, y, rtol=0, atol=atol) for x, y in pairs)
    q = [layer.self_attn.q_proj.kernel[...] for layer in drawn.model.layers]
    assert not any(np.array_equal(q[i], q[i + 1]) for i in range(4))  # every layer its own keys


@pytest.mark.parametrize("remat", ["none", "dots_saveable"])
def test_scanned_equals_unrolled_with_the_same_weights(tmp_path, remat):
    config = jm.MixtralConfig(**SMALL, num_hidden_layers=3, num_local_experts=4)
    unrolled = jm.create_model(config, jm.RuntimeConfig(scan_layers=False), seed=3)
    jm.save_hf_model(unrolled, tmp_path)
    scanned = jm.from_pretrained(tmp_path, jm.RuntimeConfig(scan_layers=True, remat=remat))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 10)))
    ref_logits, ref_grads = logits_and_grads(unrolled, ids)
    logits, grads = logits_and_grads(scanned, ids)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
    # HF export of the stack unstacks it: same tensors as the unrolled model's
    a, b = jm.to_hf_state_dict(unrolled), jm.to_hf_state_dict(scanned)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    ref = nnx.to_pure_dict(ref_grads)["model"]["layers"]
    got = nnx.to_pure_dict(grads)["model"]["layers"]
    for i in range(3):
        np.testing.assert_allclose(
            np.asarray(got["self_attn"]["q_proj"]["kernel"][i]),
            np.asarray(ref[i]["self_attn"]["q_proj"]["kernel"]),
            atol=1e-5,
        )
        np.testing.assert_allclose(np.asarray(got["mlp"]["w_up"][i]), np.asarray(ref[i]["mlp"]["w_up"]), atol=1e-5)


def test_scanned_model_shards_on_a_mesh():
    config = jm.LlamaConfig(**SMALL, num_hidden_layers=5)
    model = jm.create_model(config, jm.RuntimeConfig(scan_layers=True), seed=0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tp"))
    sharded = jm.create_model(config, jm.RuntimeConfig(scan_layers=True), seed=0, mesh=mesh)
    assert sharded.model.layers.mlp.up_proj.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tp")
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (4, 8)))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda m, x: m(x).logits)(sharded, ids)
    np.testing.assert_allclose(np.asarray(out), np.asarray(model(ids).logits), atol=1e-5)


def _compiled_size(layers):
    model = jm.create_model(
        jm.LlamaConfig(**SMALL, num_hidden_layers=layers), jm.RuntimeConfig(scan_layers=True, scan_unroll=1), lazy=True
    )
    graphdef, state = nnx.split(model)
    ids = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    text = jax.jit(jax.grad(lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x).logits))).lower(state, ids).as_text()
    return len(text)


def test_program_size_is_flat_in_depth():
    """With `scan_unroll=1` the lowered train program of a 48-layer stack is about the size of an 8-layer one (one
    body): compile time flat in depth, TPU's default."""
    assert _compiled_size(48) < 1.1 * _compiled_size(8)


def test_a_scanned_stack_runs_as_straight_line_code_by_default_on_cpu_and_gpu():
    """Issue 49: the layers stay stacked (one checkpoint layout) but the default `scan_unroll` unrolls the scan on
    CPU and GPU, where a rolled scan cost 19 % (CPU, 18 layers) and 25 % (H100) of a step: the compiled train
    program has no loop over the layers, and its numbers equal the rolled scan's."""
    config = jm.LlamaConfig(**SMALL, num_hidden_layers=4)
    assert jm.RuntimeConfig().unroll(4, "cpu") == 4 and jm.RuntimeConfig().unroll(4, "gpu") == 4
    assert jm.RuntimeConfig().unroll(4, "tpu") == 1 and jm.RuntimeConfig(scan_unroll=2).unroll(4, "cpu") == 2
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 10)))
    programs, results = {}, {}
    for unroll in (None, 1):
        model = jm.create_model(config, jm.RuntimeConfig(scan_layers=True, scan_unroll=unroll), seed=5)
        graphdef, state = nnx.split(model)
        fn = jax.jit(jax.value_and_grad(lambda s, x, g=graphdef: jnp.sum(jnp.sin(nnx.merge(g, s)(x).logits))))
        programs[unroll] = fn.lower(state, ids).compile().as_text()
        results[unroll] = fn(state, ids)

    def loops(text: str) -> list[str]:  # a scatter may compile to a loop of its own (XLA's older CPU emitters)
        return [line for line in text.splitlines() if " while(" in line and "scatter" not in line]

    assert not loops(programs[None]) and loops(programs[1])
    np.testing.assert_allclose(results[None][0], results[1][0], rtol=1e-6)
    # the gradients (|g| ~ 1e-2) summed in another order: float noise up to a few 1e-6
    for a, b in zip(jax.tree_util.tree_leaves(results[None][1]), jax.tree_util.tree_leaves(results[1][1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["tiled", "ragged"])
def test_token_dispatch_equals_dense_reference(impl):
    config = jm.MixtralConfig(**SMALL, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 64, (3, 16)))
    ref_logits, ref_grads = logits_and_grads(
        jm.create_model(config, jm.RuntimeConfig(moe_implementation="dense"), seed=5), ids
    )
    logits, grads = logits_and_grads(jm.create_model(config, jm.RuntimeConfig(moe_implementation=impl), seed=5), ids)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-4)


def test_grouped_matmul_handles_empty_and_uneven_groups():
    rng = np.random.default_rng(0)
    sizes = np.array([0, 5, 0, 17, 1, 0], np.int32)
    x = jnp.asarray(rng.normal(size=(sizes.sum(), 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 6, 3)), jnp.float32)
    group = np.repeat(np.arange(6), sizes)
    expected = np.einsum("md,mdf->mf", np.asarray(x), np.asarray(w)[group])
    for tile in (None, 4, 8):
        got = grouped_matmul(x, w, jnp.asarray(sizes), implementation="tiled", tile=tile)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
    assert tile_rows(8192, 8) == 128 and tile_rows(64, 8) == 8


@pytest.mark.parametrize("skip_unused", [False, True])
def test_grouped_matmul_rows_after_the_groups_give_zeros(skip_unused):
    """Groups covering fewer rows than the buffer (an expert-parallel device's share): the rows after
    them give zeros and no gradient; with `skip_unused` the tiles after the groups are not computed,
    and the values and gradients are the same."""
    rng = np.random.default_rng(1)
    sizes = jnp.asarray([30, 0, 90], jnp.int32)
    x = jnp.asarray(rng.normal(size=(512, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 32, 48)) / 6, jnp.float32)
    group = np.repeat(np.arange(3), np.asarray(sizes))
    expected = np.zeros((512, 48), np.float32)
    expected[:120] = np.einsum("md,mdf->mf", np.asarray(x)[:120], np.asarray(w)[group])
    for impl in ("tiled", "ragged"):

        def f(x, w, impl=impl):
            return grouped_matmul(x, w, sizes, implementation=impl, tile=8, skip_unused=skip_unused)

        np.testing.assert_allclose(np.asarray(f(x, w)), expected, rtol=1e-5, atol=1e-5)
        gx, gw = jax.grad(lambda x, w, f=f: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1))(x, w)
        assert not np.any(np.asarray(gx)[120:]) and np.all(np.any(np.asarray(gx)[:120], axis=1))
        ref = jax.grad(lambda w: jnp.sum(jnp.sin(jnp.einsum("md,mdf->mf", x[:120], w[group]))))(w)
        np.testing.assert_allclose(np.asarray(gw), np.asarray(ref), rtol=1e-4, atol=1e-4)
    if skip_unused:  # the chunks after the groups are skipped by a conditional in the program
        program = jax.jit(lambda x, w: grouped_matmul(x, w, sizes, implementation="tiled", tile=8, skip_unused=True))
        assert "conditional" in program.lower(x, w).compile().as_text()


def _step_flops(experts, impl):
    config = jm.MixtralConfig(**SMALL, num_hidden_layers=1, num_local_experts=experts, num_experts_per_tok=2)
    graphdef, state = nnx.split(jm.create_model(config, jm.RuntimeConfig(moe_implementation=impl), lazy=True))
    ids = jax.ShapeDtypeStruct((8, 128), jnp.int32)
    fn = jax.jit(jax.grad(lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x).logits)))
    return fn.lower(state, ids).compile().cost_analysis()["flops"]


def test_dispatch_flops_follow_k_not_the_expert_count():
    """XLA's cost analysis of forward + backward: E=2 → E=8 at k=2 costs the tiled dispatch ≤ 1.2×,
    the dense reference about 4× in its expert matmuls."""
    assert _step_flops(8, "tiled") <= 1.2 * _step_flops(2, "tiled")
    assert _step_flops(8, "dense") >= 2.0 * _step_flops(2, "dense")


def test_bfloat16_compute_with_float32_master_parameters():
    """`dtype=bfloat16`: the matmuls of the lowered program run in bf16, parameters and their gradients
    stay float32 (`param_dtype`), attention logits and softmax in float32."""
    import re

    runtime = jm.RuntimeConfig(dtype="bfloat16", scan_layers=True)
    model = jm.create_model(jm.LlamaConfig(**SMALL, num_hidden_layers=5), runtime, seed=0)
    assert {x.dtype for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))} == {jnp.dtype("float32")}
    graphdef, state = nnx.split(model)
    ids = jnp.ones((2, 16), jnp.int32)

    def loss(s):
        logits = nnx.merge(graphdef, s)(ids).logits
        assert logits.dtype == jnp.bfloat16
        return jnp.mean(logits.astype(jnp.float32))

    text = jax.jit(jax.grad(loss)).lower(state).as_text()
    dots = re.findall(r"stablehlo.dot_general.*?-> tensor<[^>]*x(\w+)>", text)
    assert dots.count("bf16") >= 7 and "f32" in dots, dots  # projections in bf16; attention logits in f32
    grads = jax.jit(jax.grad(loss))(state)
    assert {x.dtype for x in jax.tree_util.tree_leaves(grads)} == {jnp.dtype("float32")}
