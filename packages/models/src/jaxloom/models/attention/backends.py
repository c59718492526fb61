"""Attention's backends — from structure, not a mask: `attend(q, k, v, segment ids, positions, ...)`.

Who may see whom is described by segment ids (document ids; 0 = padding, sees nothing and is never
seen), positions (causality and windows) and a window length. Only the `xla` reference builds the
`[B, T, S]` boolean mask from them; every other backend derives masking per block:

- `xla`: einsum + softmax in float32 over a materialised mask; O(T·S) memory; everywhere (reference).
- `chunked`: blockwise online softmax over key blocks, flash-style backward that recomputes blocks;
  O(T·block) memory; everywhere (pure JAX).
- `cudnn`: cuDNN's fused attention (JAX's `fused_attention_stablehlo`); O(T); NVIDIA GPUs. On Hopper and
  later, packed rows through its ragged layout: segment ids become per-row document offsets and lengths
  (`document_table`; up to `max_documents` a row, more run `flash`); before Hopper, one document per row.
- `flash`: Pallas flash attention with segment ids (JAX's own Triton kernel on GPU, its TPU kernel on
  TPU); O(T); GPU, TPU.

`auto` picks by platform and shape (cuDNN on NVIDIA GPUs where it can run, bf16/fp16); an explicitly
requested backend that cannot run raises `AttentionUnavailableError` instead of silently running another.
Attention sinks (GPT-OSS: a learned logit per head that joins every query's softmax and attends to nothing)
run on `xla` and `chunked`.

Why JAX's own Pallas kernels for `flash` (and not tokamax): they ship inside `jax`, so no extra
dependency or version pin; the GPU kernel takes segment ids (packed documents) and its backward is a
Pallas kernel too; it runs in Pallas' interpret mode on CPU, which is how the tests check it
against `xla` on a machine without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


IMPLEMENTATIONS = ("xla", "chunked", "cudnn", "flash")
# `auto` uses the reference below this many query x key pairs per row (its mask is small and XLA's
# fused einsums are fastest there); above, `chunked` keeps memory linear in the length on CPU.
_AUTO_XLA_MAX_PAIRS = 1024 * 1024
_NEG = -1e30  # finite "minus infinity" for masked logits: exp underflows to 0, no inf - inf NaNs


class AttentionUnavailableError(ValueError):
    """An explicitly requested attention backend cannot run here (platform, window, or cache use)."""


def make_attention_mask(
    segment_ids: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    sliding_window: int | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = True,
) -> jax.Array:
    """Boolean `[B, T, S]`: query t may see key s iff same segment (segment 0 = padding, sees nothing),
    s is not after t (with `causal`), and (with a window) t - s < window. Positions order tokens inside
    a segment. Only the `xla` backend materialises this; the others compute it per block.

    Arguments, grouped:

    - `segment_ids`: `[B, T]` document ids of the queries (and of the keys, unless `kv_segment_ids`).
    - `q_positions`, `k_positions`: `[B, T]` and `[B, S]` positions of queries and keys.
    - `sliding_window`: the window in tokens, or None.
    - `kv_segment_ids`: `[B, S]` document ids of the keys when they differ from the queries' (KV cache).
    - `causal`: whether a query sees only keys at or before its position.
    """
    kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
    return _block_mask(segment_ids, q_positions, kv_seg, k_positions, causal, sliding_window)


def _block_mask(q_seg, q_pos, k_seg, k_pos, causal, window, q_horizon=None):
    """`[B, T, S]`: same segment (not padding), the key at or before the query's `q_horizon` (default: its position;
    with `causal`), and within `window` of the query's position."""
    mask = (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg[:, None, :] != 0)
    if causal:
        mask &= k_pos[:, None, :] <= (q_pos if q_horizon is None else q_horizon)[:, :, None]
    if window is not None:
        mask &= (q_pos[:, :, None] - k_pos[:, None, :]) < window
    return mask


def choose_implementation(
    requested: str,
    *,
    q_len: int,
    kv_len: int,
    cached: bool,
    window,
    platform: str | None = None,
    softcap: float | None = None,
    sinks: bool = False,
    dtype=None,
    head_dim: int | None = None,
    value_head_dim: int | None = None,
    capability: tuple[int, int] | None | str = "detect",
    horizon: bool = False,
) -> str:
    """The backend `attend` runs for `requested` (`auto` or one of `IMPLEMENTATIONS`) on `platform`
    (default: JAX's default backend) for `q_len` queries against `kv_len` keys, with a sliding `window`
    (None: none; an int; or a traced per-layer value, as in a scanned stack of Gemma's local and global
    layers), a logit `softcap` (Gemma 2) and attention `sinks` (GPT-OSS). `cached` calls (decoding with a KV
    cache) have queries and keys of different lengths, which only `xla` and `chunked` take. `dtype` (the
    computation's), `head_dim` / `value_head_dim` and the GPU's compute `capability` (default: this process's
    GPU, `cuda_capability`) decide whether cuDNN can run; `horizon`: queries that see past their position (`attend`'s
    `q_horizon`), which only `xla` and `chunked` take: `auto` on an NVIDIA GPU picks it (packed documents
    kept apart, 1.7–1.9× the Pallas kernel's speed on an H100) when it can, `flash` otherwise. Raises
    `AttentionUnavailableError` when an explicit choice cannot run, naming what to pick instead."""
    platform = platform or jax.default_backend()
    small = q_len * kv_len <= _AUTO_XLA_MAX_PAIRS
    if requested == "auto":
        if cached or platform == "cpu" or softcap is not None or sinks or horizon:
            return "xla" if small else "chunked"
        if platform in ("gpu", "cuda") and (window is None or isinstance(window, int)):
            capability = cuda_capability(platform) if capability == "detect" else capability
            if _cudnn_takes(capability, dtype, head_dim, value_head_dim):
                return "cudnn"
        if window is not None:
            return "xla" if small else "chunked"
        return "flash" if platform in ("gpu", "cuda", "rocm", "tpu") else ("xla" if small else "chunked")
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {requested!r}; expected 'auto' or one of {IMPLEMENTATIONS}")
    if requested in ("xla", "chunked"):
        return requested
    if cached:  # KV-cache decoding: T != S, which the fused kernels here do not take
        return "xla" if small else "chunked"
    if horizon:
        raise AttentionUnavailableError(
            f"attn_mechanism={requested!r} attends causally by token order and cannot let a block of tokens see each "
            "other both ways (Gemma 3's image tokens); use 'chunked' (blockwise, linear memory) or 'xla'."
        )
    if sinks:
        raise AttentionUnavailableError(
            f"attn_mechanism={requested!r} has no attention sinks (this model's heads have them, GPT-OSS); use "
            "'chunked' (blockwise, linear memory) or 'xla'."
        )
    if softcap is not None:
        raise AttentionUnavailableError(
            f"attn_mechanism={requested!r} has no attention logit soft-capping (this model caps at {softcap}, "
            "Gemma 2); use 'chunked' (blockwise, linear memory) or 'xla'."
        )
    if window is not None and not isinstance(window, int):
        raise AttentionUnavailableError(
            f"attn_mechanism={requested!r} needs one window for the whole layer stack, and this model's layers "
            "differ (local and global layers scanned together); use 'chunked' or 'xla', or scan_layers=False."
        )
    if requested == "cudnn" and platform not in ("gpu", "cuda"):
        raise AttentionUnavailableError(
            f"attn_mechanism='cudnn' needs an NVIDIA GPU; JAX's backend is {platform!r}. "
            "Use 'auto', 'chunked' or 'xla'."
        )
    if requested == "cudnn" and dtype is not None and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        raise AttentionUnavailableError(
            f"attn_mechanism='cudnn' computes in bfloat16 or float16; this run computes in {jnp.dtype(dtype).name}. "
            "Set dtype=bfloat16, or use 'auto' or 'flash'."
        )
    if requested == "flash":
        if platform not in ("gpu", "cuda", "rocm", "tpu"):
            raise AttentionUnavailableError(
                f"attn_mechanism='flash' needs a GPU or TPU; JAX's backend is "
                f"{platform!r}. Use 'auto' or 'chunked' (blockwise, linear memory)."
            )
        if window is not None:  # neither JAX's GPU nor its TPU Pallas kernel takes a window
            raise AttentionUnavailableError(
                f"attn_mechanism='flash' has no sliding window (this model's is "
                f"{window}); use 'chunked'{' or cudnn' if platform != 'tpu' else ''}."
            )
    return requested


def _cudnn_takes(capability, dtype, head_dim, value_head_dim) -> bool:
    """Whether `auto` may run cuDNN's packed attention: Hopper or later, bfloat16/float16, heads of a multiple
    of 8 up to 256, and values as wide as keys (MLA's narrower values need a newer cuDNN than JAX requires)."""
    if not cudnn_packs(capability) or dtype is None or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return False
    if head_dim is None or head_dim % 8 or head_dim > 256:
        return False
    return value_head_dim is None or value_head_dim == head_dim


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_segment_ids: jax.Array,
    q_positions: jax.Array,
    kv_segment_ids: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    causal: bool = True,
    window: int | None = None,
    implementation: str = "auto",
    cached: bool = False,
    block_size: int = 512,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    max_documents: int = 32,
    q_horizon: jax.Array | None = None,
) -> jax.Array:
    """Attention of `q [B, T, N, H]` over `k, v [B, S, K, H]` (grouped-query: N = K·G), in `q`'s dtype.

    Arguments, grouped:

    - `q_segment_ids`, `q_positions`: `[B, T]` document ids (0 = padding) and positions of the queries;
      `kv_segment_ids`, `kv_positions`: `[B, S]` the same for the keys (default: the queries', S = T).
    - `causal`: a query sees keys at or before its position; `window`: and fewer than `window` back.
    - `implementation`: `auto`, `xla`, `chunked`, `cudnn` or `flash` (see the module docstring);
      `cached`: this is a KV-cache call (keys are the cache), which the fused kernels do not take.
    - `block_size`: keys per block for `chunked`; `scale`: logit scale (default `1/sqrt(H)`);
      `softcap`: logits become `softcap · tanh(logits / softcap)` after scaling (Gemma 2), or None.
    - `sinks`: `[N]` a logit per query head that joins each query's softmax over its keys and attends to nothing
      (GPT-OSS's attention sinks: a query may give its keys less than all of its attention), or None.
    - `max_documents`: documents a row that `cudnn`'s packed layout keeps apart (its softmax statistics are
      `B·M·N·T` floats); a row with more runs `flash` for that call, with the same result.
    - `q_horizon`: `[B, T]` the last key position each query sees (with `causal`; default: its own position), the
      window still counted back from its position: a block of tokens that see each other both ways inside a causal
      sequence (Gemma 3's image tokens: each sees to its image's end). Only `xla` and `chunked` take it.
    """
    kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
    kv_positions = q_positions if kv_positions is None else kv_positions
    scale = float(q.shape[-1]) ** -0.5 if scale is None else float(scale)
    softcap = None if softcap is None else float(softcap)
    impl = choose_implementation(
        implementation,
        q_len=q.shape[1],
        kv_len=k.shape[1],
        cached=cached,
        window=window,
        softcap=softcap,
        sinks=sinks is not None,
        dtype=q.dtype,
        head_dim=q.shape[-1],
        value_head_dim=v.shape[-1],
        horizon=q_horizon is not None,
    )
    if impl == "xla":
        mask = _block_mask(q_segment_ids, q_positions, kv_segment_ids, kv_positions, causal, window, q_horizon)
        return _xla_attention(q, k, v, mask, scale, softcap, sinks)
    if impl == "chunked":
        return _chunked(
            q,
            k,
            v,
            q_segment_ids,
            q_positions,
            q_positions if q_horizon is None else q_horizon,
            kv_segment_ids,
            kv_positions,
            None if sinks is None else sinks.astype(jnp.float32),
            window,
            causal,
            min(block_size, k.shape[1]),
            scale,
            softcap,
        )
    if impl == "cudnn":
        return _cudnn(q, k, v, q_segment_ids, q_positions, causal, window, scale, max_documents, block_size)
    return _flash(q, k, v, q_segment_ids, causal, window, scale)


# ---- xla: the reference ------------------------------------------------------------------------------


def _cap(s, softcap):
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _sink_logits(sinks, kh: int) -> jax.Array:
    """`sinks [N]` as `[1, K, G, 1]` float32, beside logits `[B, K, G, T, ...]` (query head n = k·G + g)."""
    return sinks.astype(jnp.float32).reshape(1, kh, -1, 1)


def _xla_attention(q, k, v, mask, scale, softcap=None, sinks=None):
    """`q [B,T,N,H]`, `k, v [B,S,K,H]`, `mask [B,T,S]`; logits and softmax in float32; `sinks [N]` join each
    query's softmax (their share of it is dropped)."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    if t == 1:
        return _one_query_attention(q, k, v, mask, scale, softcap, sinks)
    qg = q.reshape(b, t, kh, n // kh, h)
    logits = _cap(jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale, softcap)
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    else:
        sink = _sink_logits(sinks, kh)  # [1, K, G, 1]
        top = jax.lax.stop_gradient(jnp.maximum(logits.max(-1), sink))  # [B, K, G, T]
        e = jnp.exp(logits - top[..., None])
        probs = (e / (e.sum(-1) + jnp.exp(sink - top))[..., None]).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, n, h).astype(q.dtype)


def _one_query_attention(q, k, v, mask, scale, softcap=None, sinks=None):
    """`_xla_attention` for one query per row (a decode step): products and sums over the keys in the cache's own
    `[B, S, K, H]` layout, so each step reads the keys and values once (a batched matmul would first transpose
    the whole cache to `[B, K, S, H]`: on CPU that copy was most of a long cache's decode step)."""
    b, _, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, 1, kh, n // kh, h).astype(jnp.float32)  # [B, 1, K, G, H] beside keys [B, S, K, 1, H]
    logits = _cap(jnp.sum(qg * k[:, :, :, None, :].astype(jnp.float32), -1) * scale, softcap)  # [B, S, K, G]
    logits = jnp.where(mask[:, 0, :, None, None], logits, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(logits, axis=1)
    else:
        sink = sinks.astype(jnp.float32).reshape(1, kh, -1)  # [1, K, G]
        top = jax.lax.stop_gradient(jnp.maximum(logits.max(1), sink))  # [B, K, G]
        e = jnp.exp(logits - top[:, None])
        probs = e / (e.sum(1) + jnp.exp(sink - top))[:, None]
    out = jnp.sum(probs.astype(v.dtype)[..., None] * v[:, :, :, None, :], 1, dtype=jnp.float32)  # [B, K, G, Hv]
    return out.reshape(b, 1, n, v.shape[-1]).astype(q.dtype)


# ---- chunked: blockwise online softmax, linear memory ----------------------------------------------------


def _key_blocks(k, v, k_seg, k_pos, block):
    """Pad the key axis to a multiple of `block` (padding keys get segment 0: never seen) and put the
    block index first, for `lax.scan`."""
    b, s, kh, h = k.shape
    pad = -s % block
    if pad:
        k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k, v))
        k_seg, k_pos = (jnp.pad(x, ((0, 0), (0, pad))) for x in (k_seg, k_pos))
    nb = (s + pad) // block

    def split(x):
        return jnp.moveaxis(x.reshape(b, nb, block, *x.shape[2:]), 1, 0)

    return split(k), split(v), split(k_seg), split(k_pos)


def _chunked_forward(q, k, v, q_seg, q_pos, q_hor, k_seg, k_pos, sinks, window, causal, block, scale, softcap):
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    qg = q.reshape(b, t, kh, g, h)

    def body(carry, blk):
        m, norm, acc = carry  # running max [B,K,G,T], normaliser [B,K,G,T], output [B,T,K,G,H] (float32)
        kb, vb, sb, pb = blk
        s = _cap(jnp.einsum("btkgh,bskh->bkgts", qg, kb, preferred_element_type=jnp.float32) * scale, softcap)
        mask = _block_mask(q_seg, q_pos, sb, pb, causal, window, q_hor)[:, None, None]
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        norm = norm * corr + p.sum(-1)
        pv = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
        acc = acc * jnp.moveaxis(corr, -1, 1)[..., None] + pv
        return (m_new, norm, acc), None

    if sinks is None:
        m0, norm0 = jnp.full((b, kh, g, t), _NEG, jnp.float32), jnp.zeros((b, kh, g, t), jnp.float32)
    else:  # the sink is the first "key": it sets the running max and adds exp(0) to the normaliser, nothing to acc
        m0 = jnp.broadcast_to(_sink_logits(sinks, kh), (b, kh, g, t))
        norm0 = jnp.ones((b, kh, g, t), jnp.float32)
    init = (m0, norm0, jnp.zeros((b, t, kh, g, h), jnp.float32))
    (m, norm, acc), _ = jax.lax.scan(body, init, _key_blocks(k, v, k_seg, k_pos, block))
    safe = jnp.where(norm > 0, norm, 1.0)  # a query that sees nothing (padding) gets 0, not NaN
    out = (acc / jnp.moveaxis(safe, -1, 1)[..., None]).reshape(b, t, n, h).astype(q.dtype)
    lse = jnp.where(norm > 0, m + jnp.log(safe), 0.0)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12, 13))
def _chunked(q, k, v, q_seg, q_pos, q_hor, k_seg, k_pos, sinks, window, causal, block, scale, softcap):
    """Blockwise attention; `q_hor` each query's causal horizon (`attend`'s `q_horizon`, or its position)."""
    args = (q, k, v, q_seg, q_pos, q_hor, k_seg, k_pos, sinks, window, causal, block, scale, softcap)
    return _chunked_forward(*args)[0]


def _chunked_fwd(q, k, v, q_seg, q_pos, q_hor, k_seg, k_pos, sinks, window, causal, block, scale, softcap):
    out, lse = _chunked_forward(
        q, k, v, q_seg, q_pos, q_hor, k_seg, k_pos, sinks, window, causal, block, scale, softcap
    )
    return out, (q, k, v, q_seg, q_pos, q_hor, k_seg, k_pos, sinks, window, out, lse)  # O(T) residuals


def _chunked_bwd(causal, block, scale, softcap, res, d_out):
    """Flash-attention backward: per key block, recompute the probabilities from the saved log-sum-exp,
    accumulate dq over blocks and emit that block's dk, dv. A sink's gradient: its probability `exp(sink - lse)`
    times (0 - delta), its value being zero, summed over the queries of its head."""
    q, k, v, q_seg, q_pos, q_hor, k_seg, k_pos, sinks, window, out, lse = res
    b, t, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    qg = q.reshape(b, t, kh, g, h)
    dog = d_out.reshape(b, t, kh, g, h)
    delta = jnp.einsum("btkgh,btkgh->bkgt", dog.astype(jnp.float32), out.reshape(b, t, kh, g, h).astype(jnp.float32))

    def body(dq, blk):
        kb, vb, sb, pb = blk
        s = jnp.einsum("btkgh,bskh->bkgts", qg, kb, preferred_element_type=jnp.float32) * scale
        capped = _cap(s, softcap)
        mask = _block_mask(q_seg, q_pos, sb, pb, causal, window, q_hor)[:, None, None]
        p = jnp.where(mask, jnp.exp(capped - lse[..., None]), 0.0)
        dv = jnp.einsum("bkgts,btkgh->bskh", p.astype(dog.dtype), dog, preferred_element_type=jnp.float32)
        dp = jnp.einsum("btkgh,bskh->bkgts", dog, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[..., None]) * scale
        if softcap is not None:  # d(c·tanh(s/c))/ds = 1 - tanh²
            ds = ds * (1.0 - jnp.square(capped / softcap))
        dq = dq + jnp.einsum("bkgts,bskh->btkgh", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
        dk = jnp.einsum("bkgts,btkgh->bskh", ds.astype(qg.dtype), qg, preferred_element_type=jnp.float32)
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(body, jnp.zeros((b, t, kh, g, h), jnp.float32), _key_blocks(k, v, k_seg, k_pos, block))

    def unblock(x, like):
        return jnp.moveaxis(x, 0, 1).reshape(b, -1, kh, h)[:, :s_len].astype(like.dtype)

    d_sinks = None
    if sinks is not None:
        p_sink = jnp.exp(_sink_logits(sinks, kh) - lse)  # [B, K, G, T]
        d_sinks = -jnp.sum(p_sink * delta, axis=(0, 3)).reshape(n).astype(sinks.dtype)
    dq = dq.reshape(b, t, n, h).astype(q.dtype)
    return (dq, unblock(dk, k), unblock(dv, v), None, None, None, None, None, d_sinks, None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ---- fused kernels (GPU / TPU) ------------------------------------------------------------------------


def cuda_capability(platform: str | None = None) -> tuple[int, int] | None:
    """The compute capability of this process's first NVIDIA GPU (`(9, 0)` on an H100), or None when JAX's
    backend (`platform`, default JAX's) is no CUDA GPU (CPU, TPU, ROCm)."""
    if (platform or jax.default_backend()) not in ("gpu", "cuda"):
        return None
    try:
        device = jax.devices("gpu")[0]
        if "cuda" not in str(getattr(device.client, "platform_version", "")).lower():
            return None
        major, minor = str(device.compute_capability).split(".")[:2]
        return int(major), int(minor)
    except (RuntimeError, ValueError, AttributeError, IndexError):  # no GPU in this process
        return None


def cudnn_packs(capability: tuple[int, int] | None) -> bool:
    """Whether cuDNN's fused attention keeps packed documents apart on a GPU of this compute capability:
    its packed (THD, ragged offsets) layout needs Hopper (9.0) or later and JAX's interface to it."""
    if capability is None or capability < (9, 0):
        return False
    try:
        from jax._src.cudnn import fused_attention_stablehlo  # noqa: F401 - JAX's own, not yet public
    except ImportError:
        return False
    return True


def document_table(seg: jax.Array, max_documents: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row of `seg [B, T]` (document ids, 0 = padding): `offsets [B, M + 1]` (where each document starts,
    then -1), `lengths [B, M]` (its tokens, then -1) for `M = max_documents`, and `fits [B]` (whether the row
    has at most M documents). A document is a run of equal nonzero ids (the packer gives each its own id)."""
    b, t = seg.shape
    before = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)))
    starts = (seg != 0) & (seg != before)
    index = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # the document each token belongs to
    count = index[:, -1] + 1
    rows = jnp.arange(b)[:, None]
    tokens = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    at = jnp.where(starts, index, max_documents + 1)  # out of range: dropped
    offsets = jnp.full((b, max_documents + 1), -1, jnp.int32).at[rows, at].set(tokens, mode="drop")
    inside = jnp.where(seg != 0, index, max_documents)
    lengths = jnp.zeros((b, max_documents), jnp.int32).at[rows, inside].add(1, mode="drop")
    lengths = jnp.where(jnp.arange(max_documents) < count[:, None], lengths, -1)
    return offsets, lengths, count <= max_documents


def _cudnn(q, k, v, seg, pos, causal, window, scale, max_documents: int = 32, block: int = 512):
    """cuDNN's fused attention. On Hopper and later, packed rows through its ragged (THD) layout: each row's
    documents, up to `max_documents` of them, are attended to apart (a row with more runs the `flash`
    kernel, or `chunked` where `flash` cannot run: the same result); padding tokens give zeros and get
    zero gradients. Before Hopper, per-row lengths only: rows must hold one right-padded document each
    (the trainer refuses `packing` there)."""
    if not cudnn_packs(cuda_capability()):
        lengths = jnp.sum(seg != 0, axis=-1).astype(jnp.int32)
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            scale=scale,
            is_causal=causal,
            query_seq_lengths=lengths,
            key_value_seq_lengths=lengths,
            local_window_size=None if window is None else (window - 1, 0),
            implementation="cudnn",
        )
        return out.astype(q.dtype)
    from jax._src.cudnn import fused_attention_stablehlo as fused

    tables = packed_tables(max_documents)
    offsets, lengths, _ = document_table(seg, tables[-1])
    valid = (seg != 0)[:, :, None, None]
    # padding tokens belong to no document: cuDNN leaves their rows unwritten, so they are zeroed here, and the
    # selects' gradients give their q/k/v zeros whatever the kernel wrote
    q, k, v = (jnp.where(valid, x, jnp.zeros((), x.dtype)) for x in (q, k, v))
    mask = fused.MaskType.PADDING_CAUSAL if causal else fused.MaskType.PADDING

    def single(q, k, v):  # one document from each row's first token: per-row lengths, no packed layout
        out = fused.dot_product_attention(
            q,
            k,
            v,
            q_seqlen=jnp.maximum(lengths[:, 0], 0),
            kv_seqlen=jnp.maximum(lengths[:, 0], 0),
            scale=scale,
            mask_type=mask,
            qkv_layout="BTNH",
            sliding_window_length=window,
        )
        return jnp.where(valid, out, jnp.zeros((), out.dtype)).astype(q.dtype)

    def packed(m):
        def run(q, k, v):
            out = fused.dot_product_attention(
                q,
                k,
                v,
                q_seqlen=lengths[:, :m],
                kv_seqlen=lengths[:, :m],
                q_offsets=offsets[:, : m + 1],
                kv_offsets=offsets[:, : m + 1],
                scale=scale,
                mask_type=mask,
                qkv_layout="BTNH",
                sliding_window_length=window,
            )
            return jnp.where(valid, out, jnp.zeros((), out.dtype)).astype(q.dtype)

        return run

    def overflow(q, k, v):
        t = q.shape[1]
        if window is None and t % min(128, t) == 0:
            return _flash(q, k, v, seg, causal, window, scale)
        return _chunked(q, k, v, seg, pos, pos, seg, pos, None, window, causal, min(block, t), scale, None)

    branches = [single, *(packed(m) for m in tables), overflow]
    return jax.lax.switch(cudnn_branch(offsets, tables), branches, q, k, v)


def packed_tables(max_documents: int) -> tuple[int, ...]:
    """The document-table sizes `cudnn` compiles for `max_documents` (the largest): 4 and 16 below it, then it.
    cuDNN's packed kernel costs grow with rows × table size × length (an H200, 16 heads, 16,384 tokens of
    documents of ~T/4 at T = 2048: 1.68 ms with a table of 8, 2.00 with 32, 5.12 with 128), so each step
    runs the smallest table its rows fit."""
    top = max(2, max_documents)
    return tuple(sorted({m for m in (4, 16) if m < top} | {top}))


def cudnn_branch(offsets: jax.Array, tables: tuple[int, ...]) -> jax.Array:
    """Which of `_cudnn`'s programs a step runs, from the largest `document_table`'s `offsets`: 0 when each row
    holds at most one document starting at its first token (per-row lengths), `i + 1` for the smallest
    `tables[i]` every row fits, `len(tables) + 1` when some row holds more (the `flash` kernel)."""
    count = jnp.max(jnp.sum(offsets[:, :-1] >= 0, axis=1))
    first = jnp.all(offsets[:, 0] <= 0)  # each row's document (if any) starts at token 0
    index = jnp.sum(count > jnp.asarray(tables)) + 1
    overflow = offsets[:, -1] >= 0  # a document beyond the largest table
    index = jnp.where(jnp.any(overflow), len(tables) + 1, index)
    return jnp.where((count <= 1) & first, 0, index).astype(jnp.int32)


def _flash(q, k, v, seg, causal, window, scale, *, interpret: bool = False, block: int = 128):
    """Pallas flash attention with segment ids (no mask in memory). Causality is by index, which equals
    causality by position inside a document (positions count up within each one). GQA: keys and
    values are repeated to the query heads (the kernels take equal head counts)."""
    n, kh = q.shape[2], k.shape[2]
    if n != kh:
        k, v = (jnp.repeat(x, n // kh, axis=2) for x in (k, v))
    if not interpret and jax.default_backend() == "tpu":
        from jax.experimental.pallas.ops.tpu import flash_attention as tpu

        ids = tpu.SegmentIds(q=seg, kv=seg)
        out = tpu.flash_attention(
            *(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), segment_ids=ids, causal=causal, sm_scale=scale
        )
        return jnp.swapaxes(out, 1, 2).astype(q.dtype)
    from jax.experimental.pallas.ops.gpu import attention as gpu

    t = q.shape[1]
    bq = min(block, t)
    if t % bq:
        raise AttentionUnavailableError(
            f"attn_mechanism='flash': sequence length {t} is not a multiple of the "
            f"kernel's block of {bq}; pad max_sequence_length to a multiple of {bq}"
        )
    sizes = gpu.BlockSizes(block_q=bq, block_k=bq, block_q_dkv=bq, block_kv_dkv=bq, block_q_dq=bq, block_kv_dq=bq)
    out = gpu.mha(q, k, v, seg, sm_scale=scale, causal=causal, block_sizes=sizes, interpret=interpret)
    return out.astype(q.dtype)
