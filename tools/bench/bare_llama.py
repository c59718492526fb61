"""A minimal hand-written Llama and its training loop, the reference the trainer is measured against.

Nothing from jaxloom: parameters are a dict, the model is a few functions, the loop is one jitted step
over pre-tokenized arrays (what a user writes in an afternoon). The math is Llama's, as in
jaxloom.models and transformers: RMSNorm, RoPE (rotate-half), grouped-query causal attention within
packed segments, SwiGLU MLP, untied head; AdamW with global-norm clipping; masked next-token loss.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import optax


def init(key, vocab, d, layers, heads, kv_heads, ffn, std=0.02):
    """Parameters as a dict of arrays (float32)."""
    hd = d // heads
    keys = iter(jax.random.split(key, 2 + 7 * layers))

    def w(*shape):
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    blocks = [
        {
            "attn_norm": jnp.ones(d),
            "wq": w(d, heads * hd),
            "wk": w(d, kv_heads * hd),
            "wv": w(d, kv_heads * hd),
            "wo": w(heads * hd, d),
            "mlp_norm": jnp.ones(d),
            "w_gate": w(d, ffn),
            "w_up": w(d, ffn),
            "w_down": w(ffn, d),
        }
        for _ in range(layers)
    ]
    return {"embed": w(vocab, d), "blocks": blocks, "norm": jnp.ones(d), "head": w(d, vocab)}


def rms_norm(x, scale, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope(x, pos, theta=10000.0):
    """x [B, T, H, hd], pos [B, T]: rotate the two halves of each head."""
    half = x.shape[-1] // 2
    freqs = pos[..., None].astype(jnp.float32) / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    cos, sin = jnp.cos(freqs)[:, :, None, :], jnp.sin(freqs)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(p, x, pos, mask, heads, kv_heads):
    b, t, d = x.shape
    hd = d // heads
    q = rope((x @ p["wq"]).reshape(b, t, heads, hd), pos)
    k = rope((x @ p["wk"]).reshape(b, t, kv_heads, hd), pos)
    v = (x @ p["wv"]).reshape(b, t, kv_heads, hd)
    q = q.reshape(b, t, kv_heads, heads // kv_heads, hd)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k) / jnp.sqrt(hd)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(scores.dtype).min)
    out = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(b, t, heads * hd) @ p["wo"]


def forward(params, ids, seg, pos, heads, kv_heads):
    """Logits [B, T, V]; tokens attend to earlier tokens of their own segment."""
    t = ids.shape[1]
    mask = (seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((t, t), bool))[None]
    x = params["embed"][ids]
    for p in params["blocks"]:
        x = x + attention(p, rms_norm(x, p["attn_norm"]), pos, mask, heads, kv_heads)
        h = rms_norm(x, p["mlp_norm"])
        x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
    return rms_norm(x, params["norm"]) @ params["head"]


def make_step(tx, heads, kv_heads, donate, dtype=jnp.float32):
    """One jitted training step `(params, opt_state, batch) -> (params, opt_state, loss)`; the forward
    pass computes in `dtype` over float32 parameters (mixed precision, as the trainer's `dtype`)."""

    def loss_fn(params, batch):
        ids, seg = batch["input_ids"], batch["segment_ids"]
        compute = jax.tree_util.tree_map(lambda p: p.astype(dtype), params)
        logits = forward(compute, ids, seg, batch["positions"], heads, kv_heads)[:, :-1]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids[:, 1:])
        valid = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0) & (batch["loss_mask"][:, 1:] > 0)).astype(jnp.float32)
        return (ce * valid).sum() / jnp.maximum(valid.sum(), 1.0)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def train(params, batches, lr, heads, kv_heads, donate, log_every=10, on_step=None, dtype=jnp.float32):
    """The loop: no per-step sync; the losses are read every `log_every` steps, as a user prints them."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, b1=0.9, b2=0.95))
    opt_state = tx.init(params)
    step = make_step(tx, heads, kv_heads, donate, dtype)
    losses = []
    for i, batch in enumerate(batches, 1):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(loss)
        if i % log_every == 0:
            print(f"step {i}: loss {float(jnp.mean(jnp.stack(losses))):.4f}", file=sys.stderr, flush=True)
            losses = []
        if on_step:
            on_step(i, params)
    return params
