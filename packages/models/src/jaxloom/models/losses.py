"""The output projection and next-token cross entropy fused, in blocks of positions: the `[B, T, V]` logits
are never held whole.

`linear_cross_entropy(hidden, kernel, targets, weight, ...)` equals projecting `hidden [B, T, D]` with
`kernel [D, V]` to logits and summing the weighted softmax cross entropy (plus an optional z-loss), but it
computes the logits one block of positions at a time (`lax.scan`), so its memory is `O(B·T/n·V)` for `n`
blocks instead of `O(B·T·V)` — the largest array of a large-vocabulary step (32k vocabulary × 8k tokens
is 1 GB in float32). Differentiated, each block's gradients are made while its logits are at hand, in the
forward pass (the loss is a sum, so the incoming cotangent only scales them): no logits are recomputed or
kept for the backward pass, and the matrix products are the same three as the unfused path. On a CPU the
blocks also stay in cache: the train step of a small-hidden, 4k-vocabulary model is measurably faster.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def block_count(rows_per_shard: int, length: int, block_size: int) -> int:
    """How many blocks keep each at most `block_size` positions per device (`rows_per_shard` rows times the
    positions of a row in the block; at worst one position per row): `ceil(rows * length / block_size)`,
    at most `length`. `block_size <= 0`: one block."""
    if block_size <= 0:
        return 1
    return max(1, min(length, -(-rows_per_shard * length // block_size)))


def linear_cross_entropy(
    hidden: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    weight: jax.Array,
    *,
    blocks: int = 1,
    z_loss: float = 0.0,
    dtype=None,
    precision=None,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`(loss_sum, correct)` for `hidden [B, T, D]`, `kernel [D, V]`, `targets [B, T]` and `weight [B, T]`:

    - `loss_sum = Σ weight · (logsumexp(z) - z[target] + z_loss · logsumexp(z)²)`, with the logits
      `z = hidden @ kernel` computed in `dtype` (default: the kernel's) at `precision` and read in float32,
      as a model's output layer and the unfused loss compute them;
    - `correct = Σ weight · [z[target] is the largest logit]`, not differentiated.

    The positions are taken in `blocks` blocks of `ceil(T / blocks)`, each block every `blocks`-th position
    of every row (a sharded batch or sequence axis stays sharded within a block); when `blocks` does not
    divide `T`, the rows are padded with positions of weight 0. Gradients flow to `hidden` and `kernel`
    (not to `targets` or `weight`). `softcap`: the logits are `softcap · tanh(z / softcap)`, as a model
    with soft-capped output logits (Gemma 2) computes them."""
    hidden, targets, weight, dtype = _prepare(hidden, kernel, targets, weight, blocks, dtype)
    return _fused(hidden, kernel, targets, weight, blocks, float(z_loss), dtype, precision, _cap_value(softcap))


def cross_entropy_gradient(
    hidden: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    weight: jax.Array,
    *,
    blocks: int = 1,
    dtype=None,
    precision=None,
    softcap: float | None = None,
) -> jax.Array:
    """Zero, whose gradient is that of `linear_cross_entropy(hidden, kernel, targets, weight, blocks=,
    dtype=, precision=, softcap=)[0]`: the way to give a loss of per-sequence log-probs (computed without
    gradient by `linear_log_probs`) its gradient, with the loss's derivative for each row put into `weight`.
    Computes nothing unless differentiated (an evaluation pays no extra pass over the output layer)."""
    hidden, targets, weight, dtype = _prepare(hidden, kernel, targets, weight, blocks, dtype)
    return _gradient_only(hidden, kernel, targets, weight, blocks, 0.0, dtype, precision, _cap_value(softcap))


def linear_log_probs(
    hidden: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    weight: jax.Array,
    *,
    blocks: int = 1,
    dtype=None,
    precision=None,
    softcap: float | None = None,
    entropy: bool = False,
) -> tuple[jax.Array, ...]:
    """Per row, `(Σ_t weight · log p(target), Σ_t weight · mean_v z)` for `hidden [B, T, D]`, `targets` and
    `weight [B, T]`, and the logits `z = hidden @ kernel` computed in `dtype` at `precision` (as in
    `linear_cross_entropy`), in `blocks` blocks of positions: a sequence's log-probability and its summed
    vocabulary-mean logit, without holding the logits. Not differentiated (inputs are taken as constants):
    a loss of these sums gets its gradient from `cross_entropy_gradient` with the loss's per-row derivative
    in the weights (see jaxloom.trainer's DPO). `softcap` as in `linear_cross_entropy`. `entropy`: a third
    sum, `Σ_t weight · H(p_t)`, the entropies of the distributions predicting the targets (KTO's metric)."""
    hidden, kernel = jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(kernel)
    hidden, targets, weight, dtype = _prepare(hidden, kernel, targets, weight, blocks, dtype)
    softcap = _cap_value(softcap)

    def body(_, xs):
        h, tg, w = xs
        logits = _logits(h, kernel, dtype, precision, softcap)[0]
        lse = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.sum(logits * jax.nn.one_hot(tg, logits.shape[-1], dtype=jnp.float32), axis=-1)
        sums = (jnp.sum(w * (target - lse), -1), jnp.sum(w * jnp.mean(logits, -1), -1))
        if entropy:
            logp_all = logits - lse[..., None]
            sums += (jnp.sum(w * -jnp.sum(jnp.exp(logp_all) * logp_all, -1), -1),)
        return None, sums

    _, sums = jax.lax.scan(body, None, (_split(hidden, blocks), _split(targets, blocks), _split(weight, blocks)))
    return tuple(jnp.sum(x, 0) for x in sums)


def linear_token_log_probs(
    hidden: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    *,
    blocks: int = 1,
    temperature: float = 1.0,
    dtype=None,
    precision=None,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`(logp, entropy)`, each `[B, T]`: the log-probability of `targets [B, T]` and the entropy of the
    distribution, under the logits `z = hidden @ kernel` (computed in `dtype` at `precision`, capped by `softcap`
    as in `linear_cross_entropy`, read in float32) divided by `temperature` — position by position, as an RL loss
    reads them (GRPO's per-token ratios), in `blocks` blocks of positions so the `[B, T, V]` logits are never
    held whole. Differentiable: each block is rematerialised in the backward pass (its logits are recomputed
    there, not kept), so memory stays one block's logits."""
    weight = jnp.ones(targets.shape, jnp.float32)
    t = hidden.shape[1]
    hidden, targets, _, dtype = _prepare(hidden, kernel, targets, weight, blocks, dtype)
    softcap = _cap_value(softcap)

    @jax.checkpoint
    def block(h, tg, kernel):
        logits = _logits(h, kernel, dtype, precision, softcap)[0] / temperature
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        onehot = jax.nn.one_hot(tg, logits.shape[-1], dtype=jnp.float32)
        logp = jnp.sum(logp_all * onehot, axis=-1)
        entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return logp, jax.lax.stop_gradient(entropy)

    def body(_, xs):
        h, tg = xs
        return None, block(h, tg, kernel)

    _, (logp, entropy) = jax.lax.scan(body, None, (_split(hidden, blocks), _split(targets, blocks)))
    return _join(logp)[:, :t], _join(entropy)[:, :t]


def linear_token_scores(
    hidden: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    *,
    blocks: int = 1,
    dtype=None,
    precision=None,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`(logp, greedy)`, each `[B, T]`: the log-probability of `targets [B, T]` under the logits `z = hidden @
    kernel` (as in `linear_token_log_probs`, read in float32) and whether the target is the logits' argmax — what
    an evaluation harness asks of a continuation (its log-likelihood, and whether greedy decoding gives it) —
    in `blocks` blocks of positions, never holding the `[B, T, V]` logits whole. `dtype`, `precision` and
    `softcap` as in `linear_cross_entropy` (the model's output layer's). Not differentiated."""
    weight = jnp.ones(targets.shape, jnp.float32)
    t = hidden.shape[1]
    hidden, kernel = jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(kernel)
    hidden, targets, _, dtype = _prepare(hidden, kernel, targets, weight, blocks, dtype)
    softcap = _cap_value(softcap)

    def body(_, xs):
        h, tg = xs
        logits = _logits(h, kernel, dtype, precision, softcap)[0]
        picked = jnp.take_along_axis(logits, tg[..., None], axis=-1)[..., 0]
        logp = picked - jax.nn.logsumexp(logits, axis=-1)
        return None, (logp, jnp.argmax(logits, axis=-1) == tg)

    _, (logp, greedy) = jax.lax.scan(body, None, (_split(hidden, blocks), _split(targets, blocks)))
    return _join(logp)[:, :t], _join(greedy)[:, :t]


def _prepare(hidden, kernel, targets, weight, blocks: int, dtype):
    """Check `blocks`, read `weight` in float32, pad the positions to a multiple of `blocks` (weight 0) and
    default `dtype` to the kernel's."""
    t = hidden.shape[1]
    if not 1 <= blocks <= t:
        raise ValueError(f"blocks = {blocks}; expected 1 to the sequence length {t}")
    weight = weight.astype(jnp.float32)
    pad = -t % blocks
    if pad:
        hidden, targets, weight = (
            jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) for x in (hidden, targets, weight)
        )
    return hidden, targets, weight, jnp.dtype(dtype or kernel.dtype)


def _split(x: jax.Array, blocks: int) -> jax.Array:
    """`[B, T, ...]` → `[blocks, B, T / blocks, ...]`, block `i` holding positions `i, i + blocks, ...`."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // blocks, blocks, *x.shape[2:]), 2, 0)


def _join(x: jax.Array) -> jax.Array:
    """The inverse of `_split`."""
    blocks, b, per = x.shape[:3]
    return jnp.moveaxis(x, 0, 2).reshape(b, per * blocks, *x.shape[3:])


def _cap_value(softcap) -> float | None:
    return None if softcap is None else float(softcap)


def _logits(h, kernel, dtype, precision, softcap):
    """`(logits, d capped / d raw)` of one block, read in float32: `h @ kernel` in `dtype`, soft-capped like the
    model's (`cap · tanh(z / cap)`, computed in `dtype` as the model does) when `softcap` is set (the derivative
    is then `1 - tanh²`; None without a cap)."""
    z = jnp.dot(h.astype(dtype), kernel.astype(dtype), precision=precision)
    if softcap is None:
        return z.astype(jnp.float32), None
    t = jnp.tanh(z / softcap)
    return (softcap * t).astype(jnp.float32), 1.0 - jnp.square(t.astype(jnp.float32))


def _block_stats(h, kernel, targets, weight, z_loss, dtype, precision, softcap=None):
    """One block's logits (float32), its log-sum-exp, the targets' logits and the summed loss and hits."""
    logits, slope = _logits(h, kernel, dtype, precision, softcap)
    top = jnp.max(logits, axis=-1)
    shifted = jnp.exp(logits - top[..., None])
    total = jnp.sum(shifted, axis=-1)
    lse = top + jnp.log(total)
    onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
    target_logit = jnp.sum(logits * onehot, axis=-1)
    loss = jnp.sum(weight * (lse - target_logit + z_loss * jnp.square(lse)))
    correct = jnp.sum(weight * (target_logit >= top))
    return loss, correct, (shifted, total, lse, onehot, slope)


def _backward_products(d_logits, h, k, precision):
    """A block's gradients from `d loss / d logits` (in the kernel's compute dtype): to its hidden states `[B, T, D]`
    and to the output kernel `[D, V]`, both accumulated in float32."""
    d_h = jnp.dot(d_logits, k.T, precision=precision, preferred_element_type=jnp.float32)
    d_k = jnp.einsum(
        "btd,btv->dv", h.astype(d_logits.dtype), d_logits, precision=precision, preferred_element_type=jnp.float32
    )
    return d_h, d_k


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _fused(hidden, kernel, targets, weight, blocks, z_loss, dtype, precision, softcap):
    k = kernel.astype(dtype)  # once, not in every block (no gradient flows through here: `_fused_fwd` makes it)

    def body(_, xs):
        h, tg, w = xs
        loss, correct, _ = _block_stats(h, k, tg, w, z_loss, dtype, precision, softcap)
        return None, (loss, correct)

    _, (loss, correct) = jax.lax.scan(
        body, None, (_split(hidden, blocks), _split(targets, blocks), _split(weight, blocks))
    )
    return jnp.sum(loss), jnp.sum(correct)


def _fused_fwd(hidden, kernel, targets, weight, blocks, z_loss, dtype, precision, softcap):
    k = kernel.astype(dtype)  # once for every block (the gradient to `kernel` is accumulated below, in float32)

    def body(d_kernel, xs):
        h, tg, w = xs
        loss, correct, (shifted, total, lse, onehot, slope) = _block_stats(
            h, k, tg, w, z_loss, dtype, precision, softcap
        )
        # d loss / d logits = weight · (softmax · (1 + 2 z_loss · lse) − onehot)  (· 1 − tanh² when capped)
        scale = (1.0 + 2.0 * z_loss * lse) / total
        d_logits = w[..., None] * (shifted * scale[..., None] - onehot)
        d_logits = (d_logits if slope is None else d_logits * slope).astype(dtype)
        d_h, d_k = _backward_products(d_logits, h, k, precision)
        return d_kernel + d_k, (loss, correct, d_h)

    xs = (_split(hidden, blocks), _split(targets, blocks), _split(weight, blocks))
    d_kernel, (loss, correct, d_h) = jax.lax.scan(body, jnp.zeros(kernel.shape, jnp.float32), xs)
    residuals = (_join(d_h).astype(hidden.dtype), d_kernel.astype(kernel.dtype))
    return (jnp.sum(loss), jnp.sum(correct)), residuals


def _fused_bwd(blocks, z_loss, dtype, precision, softcap, residuals, cotangents):
    d_h, d_kernel = residuals
    g = cotangents[0]  # `correct` is not differentiated
    return (g * d_h).astype(d_h.dtype), (g * d_kernel).astype(d_kernel.dtype), None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _gradient_only(hidden, kernel, targets, weight, blocks, z_loss, dtype, precision, softcap):
    return jnp.zeros((), jnp.float32)


def _gradient_only_fwd(hidden, kernel, targets, weight, blocks, z_loss, dtype, precision, softcap):
    _, residuals = _fused_fwd(hidden, kernel, targets, weight, blocks, z_loss, dtype, precision, softcap)
    return jnp.zeros((), jnp.float32), residuals


def _gradient_only_bwd(blocks, z_loss, dtype, precision, softcap, residuals, g):
    return _fused_bwd(blocks, z_loss, dtype, precision, softcap, residuals, (g, None))


_gradient_only.defvjp(_gradient_only_fwd, _gradient_only_bwd)


def linear_generalized_jsd(
    hidden: jax.Array,
    kernel: jax.Array,
    teacher_hidden: jax.Array,
    teacher_kernel: jax.Array,
    weight: jax.Array,
    *,
    beta: float,
    temperature: float = 1.0,
    blocks: int = 1,
    dtype=None,
    precision=None,
    softcap: float | None = None,
    teacher_dtype=None,
    teacher_softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`(loss_sum, entropy_sum)`: the generalized Jensen-Shannon divergence of on-policy distillation between a
    student's next-token distributions and a teacher's, summed over positions with `weight [B, T]`, and the summed
    entropy of the student's (not differentiated), as TRL 1.16's `DistillationTrainer` computes them.

    The student's logits are `hidden [B, T, D] @ kernel [D, V]`, the teacher's `teacher_hidden [B, T, D_t] @
    teacher_kernel [D_t, V]` (the widths may differ; the vocabulary is shared), each in its dtype (`dtype`,
    `teacher_dtype`; default: the kernel's) at `precision`, soft-capped by its cap (`softcap`, `teacher_softcap`),
    read in float32 and divided by `temperature`. With `p_s`, `p_t` their softmaxes:

    - `beta = 0`: the forward KL, `Σ p_t (log p_t − log p_s)`;
    - `beta = 1`: the reverse KL, `Σ p_s (log p_s − log p_t)`;
    - otherwise, with the mixture `m = (1 − beta) p_s + beta p_t`: `beta KL(p_t ‖ m) + (1 − beta) KL(p_s ‖ m)`
      (0.5: the Jensen-Shannon divergence).

    Both models' logits are computed one block of positions at a time (`blocks`, as `linear_cross_entropy`), so
    neither `[B, T, V]` is ever held; each block's gradient (to `hidden` and `kernel` only: the teacher is a
    constant) is made in the same pass, nothing is recomputed."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta = {beta}; expected a value in [0, 1] (0: forward KL, 0.5: JSD, 1: reverse KL)")
    if temperature <= 0:
        raise ValueError(f"temperature = {temperature}; expected > 0")
    if teacher_hidden.shape[:2] != hidden.shape[:2]:
        raise ValueError(
            f"teacher_hidden has positions {teacher_hidden.shape[:2]}, hidden {hidden.shape[:2]}; expected the same"
        )
    if teacher_kernel.shape[-1] != kernel.shape[-1]:
        raise ValueError(
            f"the teacher's vocabulary is {teacher_kernel.shape[-1]} tokens, the student's {kernel.shape[-1]}; "
            "expected the same vocabulary"
        )
    targets = jnp.zeros(hidden.shape[:2], jnp.int32)
    hidden, _, weight, dtype = _prepare(hidden, kernel, targets, weight, blocks, dtype)
    teacher_hidden, _, _, teacher_dtype = _prepare(
        jax.lax.stop_gradient(teacher_hidden), teacher_kernel, targets, weight, blocks, teacher_dtype
    )
    settings = (
        blocks,
        float(beta),
        float(temperature),
        dtype,
        precision,
        _cap_value(softcap),
        teacher_dtype,
        _cap_value(teacher_softcap),
    )
    return _jsd_fused(hidden, kernel, teacher_hidden, jax.lax.stop_gradient(teacher_kernel), weight, *settings)


def _jsd_block(h, kernel, th, tkernel, w, beta, temperature, dtype, precision, softcap, tdtype, tsoftcap):
    """One block: the summed weighted divergence and student entropy, and `d loss / d raw student logits`."""
    zs, slope = _logits(h, kernel, dtype, precision, softcap)
    zt, _ = _logits(th, tkernel, tdtype, precision, tsoftcap)
    ls = jax.nn.log_softmax(zs / temperature, axis=-1)
    lt = jax.nn.log_softmax(zt / temperature, axis=-1)
    ps, pt = jnp.exp(ls), jnp.exp(lt)
    if beta == 0.0:
        div = jnp.sum(pt * (lt - ls), axis=-1)
        g = ps - pt
    elif beta == 1.0:
        div = jnp.sum(ps * (ls - lt), axis=-1)
        g = ps * (ls - lt - div[..., None])
    else:
        lm = jnp.logaddexp(ls + jnp.log1p(-beta), lt + jnp.log(beta))
        kl_s = jnp.sum(ps * (ls - lm), axis=-1)
        div = beta * jnp.sum(pt * (lt - lm), axis=-1) + (1.0 - beta) * kl_s
        g = (1.0 - beta) * ps * (ls - lm - kl_s[..., None])
    entropy = -jnp.sum(ps * ls, axis=-1)
    d_logits = w[..., None] * g / temperature
    if slope is not None:
        d_logits = d_logits * slope
    return jnp.sum(w * div), jnp.sum(w * entropy), d_logits.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11, 12))
def _jsd_fused(hidden, kernel, th, tkernel, weight, blocks, beta, temperature, dtype, precision, softcap, tdtype, tcap):
    def body(_, xs):
        h, t, w = xs
        settings = (beta, temperature, dtype, precision, softcap, tdtype, tcap)
        loss, entropy, _ = _jsd_block(h, kernel, t, tkernel, w, *settings)
        return None, (loss, entropy)

    _, (loss, entropy) = jax.lax.scan(body, None, (_split(hidden, blocks), _split(th, blocks), _split(weight, blocks)))
    return jnp.sum(loss), jnp.sum(entropy)


def _jsd_fused_fwd(
    hidden, kernel, th, tkernel, weight, blocks, beta, temperature, dtype, precision, softcap, tdtype, tcap
):
    k = kernel.astype(dtype)

    def body(d_kernel, xs):
        h, t, w = xs
        loss, entropy, d_logits = _jsd_block(
            h, kernel, t, tkernel, w, beta, temperature, dtype, precision, softcap, tdtype, tcap
        )
        d_h, d_k = _backward_products(d_logits, h, k, precision)
        return d_kernel + d_k, (loss, entropy, d_h)

    xs = (_split(hidden, blocks), _split(th, blocks), _split(weight, blocks))
    d_kernel, (loss, entropy, d_h) = jax.lax.scan(body, jnp.zeros(kernel.shape, jnp.float32), xs)
    residuals = (_join(d_h).astype(hidden.dtype), d_kernel.astype(kernel.dtype))
    return (jnp.sum(loss), jnp.sum(entropy)), residuals


def _jsd_fused_bwd(blocks, beta, temperature, dtype, precision, softcap, tdtype, tcap, residuals, cotangents):
    d_h, d_kernel = residuals
    g = cotangents[0]  # the entropy is not differentiated
    return (g * d_h).astype(d_h.dtype), (g * d_kernel).astype(d_kernel.dtype), None, None, None


_jsd_fused.defvjp(_jsd_fused_fwd, _jsd_fused_bwd)
