"""FP8 training's products (`RuntimeConfig.fp8`): the scales and casts against a float64 reference (ml_dtypes' FP8
rounding), the forward product and its gradient as FP8 training defines them, and the linear layers that use it."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxloom.models as jm
from jaxloom.models.fp8_training import E4M3, E5M2, fp8_dot, qdq


def reference_qdq(x, fmt, axis=None):
    """float64: scale = amax / fmt's max (per tensor, or along `axis` kept), cast(x / scale) · scale."""
    x = np.asarray(x, np.float64)
    top = float(ml_dtypes.finfo(fmt).max)
    amax = np.max(np.abs(x), axis=axis, keepdims=axis is not None)
    scale = np.where(amax > 0, amax / top, 1.0)
    return np.clip(x / scale, -top, top).astype(fmt).astype(np.float64) * scale


@pytest.mark.parametrize("mode", ["tensor", "row"])
def test_fp8_products_and_their_gradients_equal_a_float64_reference(mode):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k[0], (3, 5, 32)) * 3.0
    w = jax.random.normal(k[1], (32, 24)) * 0.05
    g = jax.random.normal(k[2], (3, 5, 24))
    axis_x, axis_w, axis_g = (-1, 0, -1) if mode == "row" else (None, None, None)
    xq = reference_qdq(x, ml_dtypes.float8_e4m3fn, axis_x)
    wq = reference_qdq(w, ml_dtypes.float8_e4m3fn, axis_w)
    np.testing.assert_allclose(qdq(x, E4M3, axis_x), xq, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(qdq(w, E4M3, axis_w), wq, rtol=1e-6, atol=1e-7)
    assert not np.allclose(xq, np.asarray(x, np.float64), rtol=1e-3)  # the rounding binds
    y, vjp = jax.vjp(lambda a, b: fp8_dot(a, b, mode), x, w)
    np.testing.assert_allclose(y, xq @ wq, rtol=2e-5, atol=2e-5)
    dx, dw = vjp(g)
    gq = reference_qdq(g, ml_dtypes.float8_e5m2, axis_g)
    np.testing.assert_allclose(dx, gq @ wq.T, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dw, xq.reshape(-1, 32).T @ gq.reshape(-1, 24), rtol=2e-5, atol=2e-4)
    np.testing.assert_allclose(qdq(jnp.zeros((4, 4)), E5M2), 0.0)  # an all-zero tensor: scale 1, no NaN


def test_the_decoders_linear_layers_multiply_in_fp8_and_the_output_layer_does_not():
    config = jm.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    plain = jm.create_model(config, jm.RuntimeConfig(), seed=0)
    fp8 = jm.create_model(config, jm.RuntimeConfig(fp8="tensor"), seed=0)
    assert fp8.lm_head.fp8 == "none" and fp8.model.layers[0].mlp.down_proj.fp8 == "tensor"
    ids = jnp.arange(16)[None] % 64
    a, b = plain(ids).logits, fp8(ids).logits
    assert 0 < float(jnp.abs(a - b).max()) < 0.05 * float(jnp.abs(a).max()) + 1e-3  # close, and not the same
    adapted = jm.apply_lora(fp8, jm.LoRAConfig(r=4, target_modules=["down_proj"]))  # the base's product stays FP8
    layer = adapted.model.layers[0].mlp.down_proj
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 64))
    np.testing.assert_allclose(layer(x), fp8_dot(x, layer.weight(), "tensor"), rtol=1e-6)  # B = 0: the base alone
    with pytest.raises(ValueError):
        jm.RuntimeConfig(fp8="block")
