"""The fused output projection and cross entropy equals the unfused one: values, gradients, dtypes, shardings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jaxloom.models as jm
from jaxloom.models.losses import block_count, linear_cross_entropy

B, T, D, V = 4, 16, 8, 50


def inputs(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    hidden = jax.random.normal(k[0], (B, T, D))
    kernel = jax.random.normal(k[1], (D, V))
    targets = jax.random.randint(k[2], (B, T), 0, V)
    weight = (jax.random.uniform(k[3], (B, T)) > 0.3).astype(jnp.float32)
    return hidden, kernel, targets, weight


def unfused(hidden, kernel, targets, weight, z_loss=0.0, dtype=jnp.float32):
    logits = jnp.dot(hidden.astype(dtype), kernel.astype(dtype)).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, -1)
    target = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    loss = jnp.sum(weight * (lse - target + z_loss * lse**2))
    return loss, jnp.sum(weight * (target >= logits.max(-1)))


@pytest.mark.parametrize("blocks", [1, 2, 3, 4, T])  # 3 does not divide T: padded
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_values_and_gradients_equal_the_unfused_loss(blocks, z_loss):
    hidden, kernel, targets, weight = inputs()

    def fused(h, k):
        return linear_cross_entropy(h, k, targets, weight, blocks=blocks, z_loss=z_loss)

    (loss, correct), grads = jax.value_and_grad(fused, argnums=(0, 1), has_aux=True)(hidden, kernel)
    (ref_loss, ref_correct), ref = jax.value_and_grad(
        lambda h, k: unfused(h, k, targets, weight, z_loss), argnums=(0, 1), has_aux=True
    )(hidden, kernel)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert float(correct) == float(ref_correct)
    for g, r in zip(grads, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    # undifferentiated (an eval step): the plain blockwise forward, the same numbers
    np.testing.assert_allclose(jax.jit(fused)(hidden, kernel)[0], ref_loss, rtol=1e-6)
    # the cotangent scales the gradients (the step divides the summed loss by the token count)
    half = jax.grad(lambda h, k: fused(h, k)[0] / 2, argnums=1)(hidden, kernel)
    np.testing.assert_allclose(half, ref[1] / 2, rtol=1e-5, atol=1e-5)


def test_bfloat16_logits_as_the_model_computes_them():
    hidden, kernel, targets, weight = inputs(1)
    loss, grads = jax.value_and_grad(
        lambda h, k: linear_cross_entropy(h, k, targets, weight, blocks=4, dtype=jnp.bfloat16)[0], argnums=(0, 1)
    )(hidden.astype(jnp.bfloat16), kernel)
    ref, ref_grads = jax.value_and_grad(
        lambda h, k: unfused(h, k, targets, weight, dtype=jnp.bfloat16)[0], argnums=(0, 1)
    )(hidden.astype(jnp.bfloat16), kernel)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32  # each input's own dtype
    np.testing.assert_allclose(grads[1], ref_grads[1], rtol=2e-2, atol=2e-2)


def test_the_kernel_is_cast_once_not_in_every_block():
    """bf16 logits over a float32 kernel: the train step converts the `[D, V]` kernel once for all 4 blocks (an
    H100 profile showed it converted in every block, 0.13 ms each at 2048 × 32000), outside the blocks' loop."""
    hidden, kernel, targets, weight = inputs(1)

    def kernel_casts(jaxpr, inside=False):  # (converts of the kernel outside a loop, inside one)
        out, ins = 0, 0
        for e in jaxpr.eqns:
            if e.primitive.name == "convert_element_type" and e.outvars[0].aval.shape == (D, V):
                out, ins = (out, ins + 1) if inside else (out + 1, ins)
            for sub in jaxprs_in_params(e.params):
                o, i = kernel_casts(getattr(sub, "jaxpr", sub), inside or e.primitive.name in ("scan", "while"))
                out, ins = out + o, ins + i
        return out, ins

    loss = jax.value_and_grad(
        lambda h, k: linear_cross_entropy(h, k, targets, weight, blocks=4, dtype=jnp.bfloat16)[0], argnums=(0, 1)
    )
    outside, inside = kernel_casts(jax.make_jaxpr(loss)(hidden.astype(jnp.bfloat16), kernel).jaxpr)
    assert outside >= 1 and inside == 0, (outside, inside)


def test_sharded_batch_and_vocabulary_give_the_same_numbers():
    """Rows over `fsdp`, the vocabulary over `tp` (8 devices): a block keeps the batch split."""
    hidden, kernel, targets, weight = inputs(2)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    placed = (
        jax.device_put(hidden, rows),
        jax.device_put(kernel, NamedSharding(mesh, PartitionSpec(None, "tp"))),
        jax.device_put(targets, rows),
        jax.device_put(weight, rows),
    )

    @jax.jit
    def step(h, k, t, w):
        return jax.value_and_grad(lambda h, k: linear_cross_entropy(h, k, t, w, blocks=4)[0], argnums=(0, 1))(h, k)

    loss, grads = step(*placed)
    ref, ref_grads = jax.value_and_grad(lambda h, k: unfused(h, k, targets, weight)[0], argnums=(0, 1))(hidden, kernel)
    np.testing.assert_allclose(loss, ref, rtol=1e-6)
    np.testing.assert_allclose(grads[1], ref_grads[1], rtol=1e-5, atol=1e-5)
    assert grads[0].sharding.spec[0] == "fsdp"  # the hidden's gradient stays split by rows


def test_the_whole_logits_are_never_held():
    """The compiled gradient of 16 blocks needs a fraction of the unfused one's temporary memory."""
    b, t, d, v = 2, 256, 16, 4096
    hidden, kernel = jnp.ones((b, t, d)), jnp.ones((d, v)) * 0.01
    targets, weight = jnp.zeros((b, t), jnp.int32), jnp.ones((b, t))

    def temp(fn):
        grad = jax.jit(jax.grad(lambda h, k: fn(h, k)[0], argnums=(0, 1)))
        return grad.lower(hidden, kernel).compile().memory_analysis().temp_size_in_bytes

    whole = temp(lambda h, k: unfused(h, k, targets, weight))
    fused = temp(lambda h, k: linear_cross_entropy(h, k, targets, weight, blocks=16))
    logits_bytes = b * t * v * 4
    assert whole >= logits_bytes and fused < logits_bytes / 4, (whole, fused)


def test_block_count_and_bad_blocks():
    assert block_count(rows_per_shard=8, length=128, block_size=512) == 2  # 8 rows x 64 positions
    assert block_count(8, 128, 1024) == 1
    assert block_count(8, 128, 0) == 1  # 0: whole logits
    assert block_count(64, 128, 16) == 128  # at worst one position per row
    assert block_count(8, 127, 512) == 2  # a prime length: two blocks of 64 positions, one padded
    hidden, kernel, targets, weight = inputs()
    for bad in (0, T + 1):
        with pytest.raises(ValueError, match=f"blocks = {bad}; expected 1 to the sequence length 16"):
            linear_cross_entropy(hidden, kernel, targets, weight, blocks=bad)


@pytest.mark.parametrize("tied", [False, True])
def test_model_hidden_and_output_projection_give_its_logits(tied):
    config = jm.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    model = jm.create_model(config)
    ids = jnp.arange(12).reshape(2, 6) % 64
    out = model(ids)
    hidden = model(ids, return_hidden=True)
    assert hidden.logits is None
    kernel, dtype, precision = model.output_projection()
    assert kernel.shape == (16, 64)
    logits = jnp.dot(hidden.hidden.astype(dtype), kernel.astype(dtype), precision=precision)
    np.testing.assert_allclose(logits, out.logits, rtol=1e-6, atol=1e-6)


def test_cross_entropy_gradient_is_zero_with_the_loss_gradient_and_free_undifferentiated():
    """A loss of per-row log-probs (`linear_log_probs`, no gradient) gets its gradient from
    `cross_entropy_gradient` with d loss / d logp in the weights; evaluated alone it computes nothing."""
    hidden, kernel, targets, weight = inputs(3)
    per_row = jnp.arange(1.0, B + 1.0)[:, None]  # a different derivative for each row

    def via_gradient(h, k):
        logp, _ = jm.linear_log_probs(h, k, targets, weight, blocks=4)
        value = jnp.sum(jnp.arange(1.0, B + 1.0) * logp)  # d value / d logp_row = row + 1
        return value - jm.cross_entropy_gradient(h, k, targets, weight * per_row, blocks=4)

    def reference(h, k):
        logits = h @ k
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        return jnp.sum(jnp.arange(1.0, B + 1.0) * jnp.sum(weight * logp, -1))

    value, grads = jax.value_and_grad(via_gradient, argnums=(0, 1))(hidden, kernel)
    ref_value, ref_grads = jax.value_and_grad(reference, argnums=(0, 1))(hidden, kernel)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    alone = jax.jit(lambda h, k: jm.cross_entropy_gradient(h, k, targets, weight, blocks=4))
    assert float(alone(hidden, kernel)) == 0.0
    assert " dot(" not in alone.lower(hidden, kernel).compile().as_text()  # no pass over the output layer


@pytest.mark.parametrize("blocks", [1, 3])
def test_soft_capped_logits_values_gradients_and_log_probs(blocks):
    """Gemma 2's output cap `c · tanh(z / c)` inside the fused loss: the same loss and gradients as capping the
    logits before an unfused loss, and the same per-row log-probs; a cap that binds (c = 2 on logits of ~3)."""
    hidden, kernel, targets, weight = inputs(2)
    cap = 2.0

    def capped(h, k):
        logits = cap * jnp.tanh(jnp.dot(h, k) / cap)
        lse = jax.nn.logsumexp(logits, -1)
        target = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
        return jnp.sum(weight * (lse - target)), (logits, lse, target)

    (loss, grads) = jax.value_and_grad(
        lambda h, k: linear_cross_entropy(h, k, targets, weight, blocks=blocks, softcap=cap)[0], argnums=(0, 1)
    )(hidden, kernel)
    (ref, (_, lse, target)), ref_grads = jax.value_and_grad(capped, argnums=(0, 1), has_aux=True)(hidden, kernel)
    np.testing.assert_allclose(loss, ref, rtol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    uncapped = linear_cross_entropy(hidden, kernel, targets, weight, blocks=blocks)[0]
    assert abs(float(uncapped) - float(ref)) > 0.1 * abs(float(ref))  # the cap binds
    logps, _ = jm.linear_log_probs(hidden, kernel, targets, weight, blocks=blocks, softcap=cap)
    np.testing.assert_allclose(logps, jnp.sum(weight * (target - lse), -1), rtol=1e-5)
    d = jax.grad(
        lambda h: jm.cross_entropy_gradient(h, kernel, targets, weight, blocks=blocks, softcap=cap), argnums=0
    )(hidden)
    np.testing.assert_allclose(d, ref_grads[0], rtol=1e-5, atol=1e-5)


def test_linear_log_probs_entropy_sums_the_entropies_of_the_weighted_positions():
    """`linear_log_probs(..., entropy=True)`: a third per-row sum, Σ weight · H(softmax(z)), in blocks as whole."""
    hidden, kernel, targets, weight = inputs(5)
    logits = hidden @ kernel
    logp_all = jax.nn.log_softmax(logits)
    expected = jnp.sum(weight * -jnp.sum(jnp.exp(logp_all) * logp_all, -1), -1)
    for blocks in (1, 4):
        logp, mean_logit, entropy = jm.linear_log_probs(hidden, kernel, targets, weight, blocks=blocks, entropy=True)
        np.testing.assert_allclose(entropy, expected, rtol=1e-5)
        plain = jm.linear_log_probs(hidden, kernel, targets, weight, blocks=blocks)
        assert len(plain) == 2
        np.testing.assert_allclose(logp, plain[0], rtol=1e-6)
        np.testing.assert_allclose(mean_logit, plain[1], rtol=1e-6)


def jsd_reference(zs, zt, weight, beta, temperature):
    """TRL 1.16's generalized JSD and the student's entropy, in float64 numpy, from the logits."""
    zs, zt = np.asarray(zs, np.float64) / temperature, np.asarray(zt, np.float64) / temperature
    ls = zs - np.log(np.exp(zs - zs.max(-1, keepdims=True)).sum(-1, keepdims=True)) - zs.max(-1, keepdims=True)
    lt = zt - np.log(np.exp(zt - zt.max(-1, keepdims=True)).sum(-1, keepdims=True)) - zt.max(-1, keepdims=True)
    ps, pt = np.exp(ls), np.exp(lt)
    if beta == 0:
        div = (pt * (lt - ls)).sum(-1)
    elif beta == 1:
        div = (ps * (ls - lt)).sum(-1)
    else:
        m = (1 - beta) * ps + beta * pt
        div = beta * (pt * (lt - np.log(m))).sum(-1) + (1 - beta) * (ps * (ls - np.log(m))).sum(-1)
    w = np.asarray(weight, np.float64)
    return (w * div).sum(), (w * -(ps * ls).sum(-1)).sum()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.3])
@pytest.mark.parametrize("blocks", [1, 3])  # 3 does not divide T: padded
def test_generalized_jsd_equals_a_numpy_reference_and_its_gradient(beta, blocks):
    """`linear_generalized_jsd` (TRL 1.16's divergence: 0 forward KL, 0.5 JSD, 1 reverse KL) equals a float64 numpy
    computation from the two models' logits, at a temperature, with a teacher of another width; its gradient
    (student only) equals autodiff of a plain jnp computation of the same divergence."""
    hidden, kernel, _, weight = inputs(1)
    k = jax.random.split(jax.random.PRNGKey(7), 2)
    t_hidden, t_kernel = jax.random.normal(k[0], (B, T, 12)), jax.random.normal(k[1], (12, V))
    temperature = 0.7
    loss, entropy = jm.linear_generalized_jsd(
        hidden, kernel, t_hidden, t_kernel, weight, beta=beta, temperature=temperature, blocks=blocks
    )
    zs = np.asarray(hidden, np.float64) @ np.asarray(kernel, np.float64)
    zt = np.asarray(t_hidden, np.float64) @ np.asarray(t_kernel, np.float64)
    ref_loss, ref_entropy = jsd_reference(zs, zt, weight, beta, temperature)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=2e-5)
    np.testing.assert_allclose(float(entropy), ref_entropy, rtol=2e-5)

    def plain(h, kern):
        ls = jax.nn.log_softmax(h @ kern / temperature, -1)
        lt = jax.nn.log_softmax(t_hidden @ t_kernel / temperature, -1)
        ps, pt = jnp.exp(ls), jnp.exp(lt)
        if beta == 0:
            div = jnp.sum(pt * (lt - ls), -1)
        elif beta == 1:
            div = jnp.sum(ps * (ls - lt), -1)
        else:
            lm = jnp.log((1 - beta) * ps + beta * pt)
            div = beta * jnp.sum(pt * (lt - lm), -1) + (1 - beta) * jnp.sum(ps * (ls - lm), -1)
        return jnp.sum(weight * div)

    def fused(h, kern, th, tk):
        return jm.linear_generalized_jsd(h, kern, th, tk, weight, beta=beta, temperature=temperature, blocks=blocks)[0]

    got = jax.grad(fused, argnums=(0, 1, 2, 3))(hidden, kernel, t_hidden, t_kernel)
    want = jax.grad(plain, argnums=(0, 1))(hidden, kernel)
    for g, w in zip(got[:2], want, strict=True):  # float32 rounding of near-cancelling terms: atol at 1e-3 of the max
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3 * float(jnp.abs(w).max()))
    assert not np.any(got[2]) and not np.any(got[3])  # the teacher is a constant


def test_generalized_jsd_holds_neither_models_logits_and_refuses_bad_settings():
    """Blocks keep the compiled gradient's temporaries under one model's `[B, T, V]` logits; a beta outside [0, 1]
    and vocabularies that differ are refused by name."""
    b, t, d, v = 2, 256, 16, 4096
    hidden, kernel, weight = jnp.ones((b, t, d)), jnp.ones((d, v)) * 0.01, jnp.ones((b, t))
    grad = jax.jit(
        jax.grad(lambda h, k: jm.linear_generalized_jsd(h, k, h, k * 2, weight, beta=0.5, blocks=16)[0], argnums=(0, 1))
    )
    temp = grad.lower(hidden, kernel).compile().memory_analysis().temp_size_in_bytes
    assert temp < b * t * v * 4 / 2, temp
    with pytest.raises(ValueError, match="beta = 1.5"):
        jm.linear_generalized_jsd(hidden, kernel, hidden, kernel, weight, beta=1.5)
    with pytest.raises(ValueError, match="the same vocabulary"):
        jm.linear_generalized_jsd(hidden, kernel, hidden, kernel[:, :10], weight, beta=0.5)
