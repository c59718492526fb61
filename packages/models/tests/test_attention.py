"""`attend`: every backend equals the `xla` reference on packed, padded, windowed, grouped-query
batches (values and gradients); explicit backends that cannot run are errors; `chunked` memory is
linear in the length."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxloom.models as jm
from jaxloom.models.attention import AttentionUnavailableError, attend, choose_implementation
from jaxloom.models.attention.backends import _flash


def packed_batch(seed=0, t=40, n=4, kv=2, h=8):
    """Row 0: two packed documents then padding; row 1: left padding then one document."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(2, t, n, h)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, t, kv, h)), jnp.float32) for _ in range(2))
    seg = np.array([[1] * 15 + [2] * (t - 20) + [0] * 5, [0] * 6 + [1] * (t - 6)], np.int32)
    pos = np.zeros_like(seg)
    for b in range(2):
        for s in np.unique(seg[b]):
            idx = np.where(seg[b] == s)[0]
            pos[b, idx] = np.arange(len(idx))
    return q, k, v, jnp.asarray(seg), jnp.asarray(pos)


def run(impl, q, k, v, seg, pos, window=None, **kw):
    fn = (
        (lambda q, k, v: _flash(q, k, v, seg, True, None, q.shape[-1] ** -0.5, interpret=True, block=16))
        if impl == "flash-interpret"
        else (
            lambda q, k, v: attend(
                q, k, v, q_segment_ids=seg, q_positions=pos, window=window, implementation=impl, **kw
            )
        )
    )
    real = np.asarray(seg != 0)[:, :, None, None]
    out = fn(q, k, v)
    grads = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)) * real), argnums=(0, 1, 2))(q, k, v)
    return np.asarray(out) * real, [np.asarray(g) for g in grads]


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block", [8, 13, 64])  # several blocks, a ragged last block, one block
def test_chunked_equals_xla(window, block):
    batch = packed_batch()
    ref_out, ref_grads = run("xla", *batch, window=window)
    out, grads = run("chunked", *batch, window=window, block_size=block)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=5e-6)


@pytest.mark.parametrize("block", [8, 13])
def test_chunked_equals_xla_with_softcap_and_a_traced_window(block):
    """Gemma's pieces in the blockwise backend: soft-capped logits (values and the `1 - tanh²` backward) and a
    window that is a traced value (a scanned stack of local and global layers), against the reference."""
    batch = packed_batch()
    ref_out, ref_grads = run("xla", *batch, window=7, softcap=0.3)
    plain_out, _ = run("xla", *batch, window=7)
    assert np.abs(ref_out - plain_out).max() > 1e-3  # the cap binds at this scale

    q, k, v, seg, pos = batch
    real = np.asarray(seg != 0)[:, :, None, None]

    @jax.jit
    def traced(q, k, v, window):  # the window is an argument of the compiled function: a tracer inside
        def fn(q, k, v):
            return attend(
                q,
                k,
                v,
                q_segment_ids=seg,
                q_positions=pos,
                window=window,
                softcap=0.3,
                implementation="chunked",
                block_size=block,
            )

        loss = lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)) * real)  # noqa: E731
        return fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    out, grads = traced(q, k, v, jnp.int32(7))
    out = np.asarray(out) * real
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=5e-6)


def _sink_reference(q, k, v, seg, pos, sinks, window):
    """GPT-OSS's eager attention in numpy: the sink logit concatenated to each query's logits, softmax over both,
    the sink's column dropped."""
    q, k, v, seg, pos, sinks = (np.asarray(x, np.float64) for x in (q, k, v, seg, pos, sinks))
    b, t, n, h = q.shape
    k, v = (np.repeat(x, n // x.shape[2], axis=2) for x in (k, v))
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
    see = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0) & (pos[:, None, :] <= pos[:, :, None])
    if window is not None:
        see &= (pos[:, :, None] - pos[:, None, :]) < window
    logits = np.where(see[:, None], logits, -np.inf)
    full = np.concatenate([logits, np.broadcast_to(sinks[None, :, None, None], (b, n, t, 1))], axis=-1)
    probs = np.exp(full - full.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True))[..., :-1]
    return np.einsum("bnts,bsnh->btnh", probs, v)


@pytest.mark.parametrize("window", [None, 7])
def test_attention_sinks_equal_gpt_oss_and_chunked_equals_xla_with_their_gradient(window):
    """Sinks (a logit per head in every query's softmax, attending to nothing): `xla` equals GPT-OSS's eager
    attention; `chunked` (the sink as the running max's start) equals `xla` in values and in the gradients of q,
    k, v and the sinks; a query that sees nothing still gets zeros."""
    q, k, v, seg, pos = packed_batch()
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    real = np.asarray(seg != 0)[:, :, None, None]
    ref = _sink_reference(q, k, v, seg, pos, sinks, window)

    def fn(impl, q, k, v, sinks, block=512):
        kw = dict(q_segment_ids=seg, q_positions=pos, window=window, implementation=impl, block_size=block)
        return attend(q, k, v, sinks=sinks, **kw)

    plain = np.asarray(attend(q, k, v, q_segment_ids=seg, q_positions=pos, window=window)) * real
    assert np.abs(plain - ref * real).max() > 1e-2  # the sinks take a share of the attention at this scale
    results = {}
    for impl, block in (("xla", 512), ("chunked", 8), ("chunked", 13)):
        out = np.asarray(fn(impl, q, k, v, sinks, block)) * real
        np.testing.assert_allclose(out, ref * real, atol=2e-6)
        loss = lambda q, k, v, s: jnp.sum(jnp.sin(fn(impl, q, k, v, s, block)) * real)  # noqa: B023, E731
        results[(impl, block)] = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    assert np.abs(np.asarray(results[("xla", 512)][3])).max() > 1e-3  # the sinks learn
    for key in (("chunked", 8), ("chunked", 13)):
        for g, r in zip(results[key], results[("xla", 512)], strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-6)
    np.testing.assert_array_equal(np.asarray(fn("chunked", q, k, v, sinks, 8))[0, -5:], 0.0)  # padding
    with pytest.raises(AttentionUnavailableError, match="no attention sinks"):
        choose_implementation("flash", q_len=128, kv_len=128, cached=False, window=None, platform="gpu", sinks=True)
    auto = dict(cached=False, window=None, platform="gpu", sinks=True)
    assert choose_implementation("auto", q_len=128, kv_len=128, **auto) == "xla"  # never a kernel without sinks
    assert choose_implementation("auto", q_len=4096, kv_len=4096, **auto) == "chunked"


def test_flash_kernel_equals_xla_in_interpret_mode():
    """JAX's Pallas flash kernel (the GPU backend), run by Pallas' interpreter on CPU: same values and
    gradients as the reference on packed documents with padding (GQA heads repeated)."""
    q, k, v, seg, pos = packed_batch(t=32)
    ref_out, ref_grads = run("xla", q, k, v, seg, pos)
    out, grads = run("flash-interpret", q, k, v, seg, pos)
    np.testing.assert_allclose(out, ref_out, atol=2e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=5e-5)


def test_a_query_that_sees_nothing_gets_zeros_not_nan():
    q, k, v, seg, pos = packed_batch()
    out = attend(q, k, v, q_segment_ids=seg, q_positions=pos, implementation="chunked", block_size=8)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out)[0, -5:], 0.0)


def test_explicit_kernels_that_cannot_run_are_errors_never_fallbacks():
    with pytest.raises(AttentionUnavailableError, match="'flash' needs a GPU or TPU; JAX's backend is 'cpu'"):
        choose_implementation("flash", q_len=128, kv_len=128, cached=False, window=None)
    with pytest.raises(AttentionUnavailableError, match="'cudnn' needs an NVIDIA GPU"):
        choose_implementation("cudnn", q_len=128, kv_len=128, cached=False, window=None)
    with pytest.raises(AttentionUnavailableError, match="no sliding window"):
        choose_implementation("flash", q_len=128, kv_len=128, cached=False, window=64, platform="gpu")
    with pytest.raises(AttentionUnavailableError, match="no sliding window"):  # the TPU kernel has none either
        choose_implementation("flash", q_len=128, kv_len=128, cached=False, window=64, platform="tpu")
    for kernel in ("flash", "cudnn"):
        with pytest.raises(AttentionUnavailableError, match="soft-capping .* use 'chunked'"):
            choose_implementation(
                kernel, q_len=128, kv_len=128, cached=False, window=None, platform="gpu", softcap=50.0
            )
        with pytest.raises(AttentionUnavailableError, match="layers differ .* scan_layers=False"):
            choose_implementation(kernel, q_len=128, kv_len=128, cached=False, window=jnp.int32(4), platform="gpu")
    # and through a model: the forward raises instead of running another backend
    model = jm.create_model(
        jm.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2),
        jm.RuntimeConfig(attn_mechanism="flash"),
    )
    with pytest.raises(AttentionUnavailableError):
        model(jnp.ones((1, 8), jnp.int32))


def test_auto_choice_by_platform_and_length():
    assert choose_implementation("auto", q_len=512, kv_len=512, cached=False, window=None, platform="cpu") == "xla"
    assert (
        choose_implementation("auto", q_len=4096, kv_len=4096, cached=False, window=None, platform="cpu") == "chunked"
    )
    assert choose_implementation("auto", q_len=2048, kv_len=2048, cached=False, window=None, platform="gpu") == "flash"
    assert choose_implementation("auto", q_len=2048, kv_len=2048, cached=False, window=512, platform="gpu") == "chunked"
    assert choose_implementation("auto", q_len=2048, kv_len=2048, cached=False, window=None, platform="tpu") == "flash"
    assert choose_implementation("auto", q_len=2048, kv_len=2048, cached=False, window=512, platform="tpu") == "chunked"
    auto_capped = choose_implementation(
        "auto", q_len=2048, kv_len=2048, cached=False, window=None, platform="gpu", softcap=50.0
    )
    assert auto_capped == "chunked"
    # KV-cache calls (T != S) take xla or chunked even when a fused kernel was asked for
    assert choose_implementation("flash", q_len=1, kv_len=4096, cached=True, window=None, platform="gpu") == "xla"
    assert jm.RuntimeConfig(attn_mechanism="vanilla").attn_mechanism == "xla"  # the earlier names still load


def _temp_bytes(impl, t):
    q = jax.ShapeDtypeStruct((1, t, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 4, 16), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(q, k, v, seg, pos):
        return jnp.sum(attend(q, k, v, q_segment_ids=seg, q_positions=pos, implementation=impl, block_size=128))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, ids, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_memory_is_linear_in_length_and_xla_is_not():
    """The compiled forward+backward's temporaries, from XLA's own memory analysis: ×4 tokens costs
    `chunked` about ×4, the materialised-mask reference ~×10 (its T×S terms dominate)."""
    chunked = _temp_bytes("chunked", 2048) / _temp_bytes("chunked", 512)
    xla = _temp_bytes("xla", 2048) / _temp_bytes("xla", 512)
    assert chunked < 5.0, chunked
    assert xla > 8.0, xla  # quadratic terms dominate (the linear ones keep it under 16)


def test_document_table_describes_exactly_what_segment_ids_allow():
    """cuDNN's packed layout sees documents as (offset, length) per row: the table built from segment ids must
    allow exactly the pairs the reference mask allows (same document, causal), padding in no document, a
    row of more documents than the table holds flagged, not silently merged."""
    seg = jnp.asarray(
        [
            [1, 1, 1, 2, 2, 0, 0, 0],  # two documents, right padding
            [0, 0, 3, 3, 3, 3, 4, 4],  # left padding, two documents
            [5, 6, 7, 8, 8, 8, 9, 0],  # five documents: more than the table holds
            [0, 0, 0, 0, 0, 0, 0, 0],  # padding only
        ],
        jnp.int32,
    )
    offsets, lengths, fits = jm.document_table(seg, 3)
    assert offsets.shape == (4, 4) and lengths.shape == (4, 3)
    np.testing.assert_array_equal(np.asarray(fits), [True, True, False, True])
    np.testing.assert_array_equal(np.asarray(offsets[:2]), [[0, 3, -1, -1], [2, 6, -1, -1]])
    np.testing.assert_array_equal(np.asarray(lengths[:2]), [[3, 2, -1], [4, 2, -1]])
    np.testing.assert_array_equal(np.asarray(offsets[3]), [-1] * 4)
    np.testing.assert_array_equal(np.asarray(lengths[3]), [-1] * 3)
    # the pairs the table allows (rows that fit) against the reference mask from segment ids and positions
    pos = jnp.broadcast_to(jnp.arange(8), seg.shape)
    ref = np.asarray(jm.make_attention_mask(seg, pos, pos))
    for b in (0, 1, 3):
        allowed = np.zeros((8, 8), bool)
        for o, n in zip(np.asarray(offsets[b]), np.asarray(lengths[b]), strict=False):
            if n > 0:
                for t in range(o, o + n):
                    allowed[t, o : t + 1] = True
        np.testing.assert_array_equal(allowed, ref[b], err_msg=f"row {b}")


def test_each_step_runs_the_smallest_cudnn_program_its_rows_fit():
    """cuDNN's packed kernel costs grow with the table size, so `cudnn` compiles a few (`packed_tables`) and
    each step picks: rows of one document from token 0 take per-row lengths, then the smallest table every
    row fits, and a row beyond the largest takes the flash kernel."""
    from jaxloom.models.attention import cudnn_branch, packed_tables

    assert packed_tables(32) == (4, 16, 32) and packed_tables(8) == (4, 8) and packed_tables(1) == (2,)
    tables = packed_tables(32)

    pick = jax.jit(lambda seg: cudnn_branch(jm.document_table(seg, tables[-1])[0], tables))  # one compile

    def branch(*rows):
        rows = [*rows, *[[0]] * (3 - len(rows))]  # padding rows (no documents) up to one shape
        return int(pick(jnp.asarray([r + [0] * (40 - len(r)) for r in rows], jnp.int32)))

    one_each, padding = [[1] * 30, [2] * 40], [[0] * 40]
    assert branch(*one_each) == 0 and branch(*one_each, *padding) == 0 and branch(*padding) == 0
    assert branch([0, 0] + [1] * 20) == 1  # one document, not from token 0: the packed layout
    assert branch([1, 2, 3], [4] * 9) == 1  # three documents: the table of 4
    assert branch([1, 2, 3, 4, 5], [6]) == 2  # five: the table of 16
    assert branch(list(range(1, 21))) == 3  # twenty: the table of 32
    assert branch(list(range(1, 34))) == 4  # 33 documents: more than any table, the flash kernel


def test_auto_picks_cudnn_on_hopper_where_it_can_run():
    gpu = dict(q_len=2048, kv_len=2048, cached=False, platform="gpu", head_dim=128)
    hopper = dict(gpu, capability=(9, 0))
    assert choose_implementation("auto", window=None, dtype=jnp.bfloat16, **hopper) == "cudnn"
    assert choose_implementation("auto", window=None, dtype=jnp.float16, **hopper) == "cudnn"
    assert choose_implementation("auto", window=4096, dtype=jnp.bfloat16, **hopper) == "cudnn"  # a fixed window
    # what cuDNN cannot take here: the Pallas kernel (or chunked with a window), never an error
    assert choose_implementation("auto", window=None, dtype=jnp.float32, **hopper) == "flash"
    assert choose_implementation("auto", window=None, dtype=jnp.bfloat16, **dict(gpu, capability=(8, 0))) == "flash"
    assert choose_implementation("auto", window=None, dtype=jnp.bfloat16, **dict(gpu, capability=None)) == "flash"
    assert choose_implementation("auto", window=64, dtype=jnp.bfloat16, **dict(gpu, capability=(8, 6))) == "chunked"
    assert choose_implementation("auto", window=jnp.int32(4), dtype=jnp.bfloat16, **hopper) == "chunked"
    assert choose_implementation("auto", window=None, dtype=jnp.bfloat16, **dict(hopper, head_dim=320)) == "flash"
    mla = dict(hopper, head_dim=192, value_head_dim=128)  # DeepSeek's keys are wider than its values
    assert choose_implementation("auto", window=None, dtype=jnp.bfloat16, **mla) == "flash"
    assert choose_implementation("auto", window=None, dtype=jnp.bfloat16, softcap=30.0, **hopper) == "chunked"
    assert choose_implementation("auto", window=None, dtype=jnp.bfloat16, sinks=True, **hopper) == "chunked"
    # ROCm and TPU keep the Pallas kernel; this process has no GPU, so detection says none
    assert choose_implementation("auto", window=None, dtype=jnp.bfloat16, **dict(hopper, platform="rocm")) == "flash"
    assert jm.cuda_capability("cpu") is None and not jm.cudnn_packs(None) and not jm.cudnn_packs((8, 9))
    with pytest.raises(AttentionUnavailableError, match="bfloat16 or float16; this run computes in float32"):
        choose_implementation("cudnn", window=None, dtype=jnp.float32, **hopper)


@pytest.mark.skipif(not jm.cudnn_packs(jm.cuda_capability()), reason="needs an NVIDIA GPU of Hopper or later")
@pytest.mark.parametrize("window", [None, 7])
def test_cudnn_equals_xla_on_packed_documents(window):
    """On a Hopper GPU: cuDNN's packed layout keeps documents apart as the reference does (values and
    gradients, bf16 tolerances), and a row of more documents than `max_documents` gives the same result."""
    q, k, v, _, _ = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in packed_batch(t=64, h=64))
    seg = np.array([[1] * 9 + [2] * 20 + [3] * 30 + [0] * 5, [0] * 6 + [4] * 58], np.int32)
    pos = np.concatenate([np.arange(9), np.arange(20), np.arange(30), np.zeros(5), np.zeros(6), np.arange(58)])
    seg, pos = jnp.asarray(seg), jnp.asarray(pos.reshape(2, 64), jnp.int32)
    ref_out, ref_grads = run("xla", q, k, v, seg, pos, window=window)
    for docs in (32, 2):  # 2: row 0's three documents overflow the table: that call runs flash or chunked
        out, grads = run("cudnn", q, k, v, seg, pos, window=window, max_documents=docs)
        np.testing.assert_allclose(out.astype(np.float32), ref_out.astype(np.float32), atol=3e-2)
        for g, r in zip(grads, ref_grads, strict=True):
            np.testing.assert_allclose(g.astype(np.float32), r.astype(np.float32), atol=6e-2)
    # one right-padded document a row: per-row lengths
    seg = jnp.asarray([[1] * 50 + [0] * 14, [2] * 64], jnp.int32)
    pos = jnp.asarray(np.stack([np.r_[np.arange(50), np.zeros(14)], np.arange(64)]), jnp.int32)
    ref_out, ref_grads = run("xla", q, k, v, seg, pos, window=window)
    out, grads = run("cudnn", q, k, v, seg, pos, window=window)
    np.testing.assert_allclose(out.astype(np.float32), ref_out.astype(np.float32), atol=3e-2)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g.astype(np.float32), r.astype(np.float32), atol=6e-2)
