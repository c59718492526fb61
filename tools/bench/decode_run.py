"""Decode speed: jaxloom.generation vs a bare jitted decode loop vs naive recomputation. One JSON line."""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxloom.generation as jg
import jaxloom.models as jm


def main():
    cfg = json.loads(sys.argv[1])
    config = jm.LlamaConfig(**cfg["model"])
    model = jm.create_model(config, jm.RuntimeConfig(dtype=cfg["dtype"]), seed=0)
    b, p, n = cfg["batch"], cfg["prompt"], cfg["new"]
    ids = np.random.default_rng(0).integers(1, config.vocab_size, (b, p)).astype(np.int32)
    mask = np.ones_like(ids)
    gcfg = jg.GenerationConfig(max_new_tokens=n)
    graphdef, state = nnx.split(model)

    @jax.jit
    def bare(state, ids):  # prefill, then a fixed-length greedy loop over the same cache API
        m = nnx.merge(graphdef, state)
        total = p + n
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        kv_seg = jnp.zeros((b, total), jnp.int32).at[:, :p].set(1)
        kv_pos = jnp.zeros((b, total), jnp.int32).at[:, :p].set(pos)
        out = m(
            ids,
            positions=pos,
            segment_ids=jnp.ones((b, p), jnp.int32),
            cache=m.init_cache(b, total),
            cache_index=0,
            kv_positions=kv_pos,
            kv_segment_ids=kv_seg,
        )
        tok = jnp.argmax(out.logits[:, -1], -1).astype(jnp.int32)

        def body(i, c):
            cache, tok, kv_seg, kv_pos, acc = c
            at = p + i - 1
            kv_seg = jax.lax.dynamic_update_slice(kv_seg, jnp.ones((b, 1), jnp.int32), (0, at))
            kv_pos = jax.lax.dynamic_update_slice(kv_pos, jnp.full((b, 1), at, jnp.int32), (0, at))
            o = m(
                tok[:, None],
                positions=jnp.full((b, 1), at, jnp.int32),
                segment_ids=jnp.ones((b, 1), jnp.int32),
                cache=cache,
                cache_index=at,
                kv_positions=kv_pos,
                kv_segment_ids=kv_seg,
            )
            tok = jnp.argmax(o.logits[:, -1], -1).astype(jnp.int32)
            return o.cache, tok, kv_seg, kv_pos, acc + tok

        return jax.lax.fori_loop(1, n, body, (out.cache, tok, kv_seg, kv_pos, tok))[-1]

    def timed(fn, reps=5):
        jax.block_until_ready(fn())
        samples = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            samples.append(time.perf_counter() - t)
        return b * n / float(np.median(samples))

    ours = lambda: jg.generate(model, ids, mask, gcfg).completion_ids  # noqa: E731
    bare_fn = lambda: bare(state, ids)  # noqa: E731
    a1, b1, a2, b2 = timed(ours), timed(bare_fn), timed(ours), timed(bare_fn)  # interleaved

    @jax.jit
    def full(state, buf, seg, i):  # naive: the whole forward over a fixed [B, P+N] buffer for every token
        logits = nnx.merge(graphdef, state)(buf, segment_ids=seg).logits
        return jnp.argmax(jax.lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False), -1).astype(jnp.int32)

    def naive_run(steps):
        buf = jnp.zeros((b, p + n), jnp.int32).at[:, :p].set(ids)
        seg = jnp.zeros((b, p + n), jnp.int32).at[:, :p].set(1)
        for i in range(steps):
            tok = full(state, buf, seg, p + i - 1)
            buf, seg = buf.at[:, p + i].set(tok), seg.at[:, p + i].set(1)
        return buf

    jax.block_until_ready(naive_run(2))
    naive_n = min(n, 16)
    t = time.perf_counter()
    jax.block_until_ready(naive_run(naive_n))
    naive = b * naive_n / (time.perf_counter() - t)
    print(
        json.dumps(
            {
                "cached_tokens_per_second": float(np.median([a1, a2])),
                "bare_tokens_per_second": float(np.median([b1, b2])),
                "naive_tokens_per_second": naive,
            }
        )
    )


if __name__ == "__main__":
    main()
