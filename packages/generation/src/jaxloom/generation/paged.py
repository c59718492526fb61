"""The device side of the paged KV cache: a pool of fixed-size pages per cache leaf, and the two jitted calls
that read and write it — `extend` (run new tokens of some sequences over their cached pages: a prompt's
prefill, a tool's answer, a preempted sequence's recomputation) and `decode` (a chunk of decode steps for
every slot).

A model's own dense cache (`init_cache(B, S)`, whatever its layout: per-layer `(k, v)`, a scanned stack,
DeepSeek-V3's latent cache) is the unit: the pool of a leaf is that leaf with its batch axis made the page
axis and its sequence axis the offset in a page, kept as `[pages, page_size, *rest]`. A call gathers each
sequence's pages into an ordinary dense cache `[B, pages * page_size + T, ...]` (the `T` columns at the end
for the tokens this call feeds, written by the model at one `cache_index` for every row), runs the model's
own cached forward — masks from `kv_positions` / `kv_segment_ids`, so windows, sinks and soft-caps act as
in `generate` — and scatters the `T` new columns back into the pages of their positions. What a call reads
follows the longest sequence in it (pages rounded up to a power of two), never the cap.

Page 0 is never handed out: writes that belong to no sequence (padding rows, positions past a sequence's
last) land there."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .decode import last_logits
from .sampling import sample_rows

TRASH_PAGE = 0
"""The page that absorbs writes belonging to no sequence."""


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Where each leaf of `model.init_cache(B, S)` keeps its batch and sequence axes, and its shape and dtype
    without them: what a pool of pages of that leaf is."""

    treedef: Any
    axes: tuple[tuple[int, int], ...]  # (batch axis, sequence axis) per leaf
    rest: tuple[tuple[int, ...], ...]  # the other dimensions, in order
    dtypes: tuple[Any, ...]

    @classmethod
    def of(cls, model: nnx.Module) -> CacheLayout:
        shapes = [jax.eval_shape(lambda b=b, s=s: model.init_cache(b, s)) for b, s in ((1, 8), (2, 8), (1, 9))]
        leaves = [jax.tree_util.tree_leaves(x) for x in shapes]
        axes, rest = [], []
        for one, two, longer in zip(*leaves, strict=True):
            a = next(i for i, (x, y) in enumerate(zip(one.shape, two.shape, strict=True)) if x != y)
            s = next(i for i, (x, y) in enumerate(zip(one.shape, longer.shape, strict=True)) if x != y)
            axes.append((a, s))
            rest.append(tuple(d for i, d in enumerate(one.shape) if i not in (a, s)))
        dtypes = tuple(x.dtype for x in leaves[0])
        return cls(jax.tree_util.tree_structure(shapes[0]), tuple(axes), tuple(rest), dtypes)

    def page_bytes(self, page_size: int) -> int:
        """The bytes one page of `page_size` positions takes, over every leaf."""
        sizes = zip(self.rest, self.dtypes, strict=True)
        return sum(page_size * int(np.prod(r)) * np.dtype(d).itemsize for r, d in sizes)

    def pools(self, num_pages: int, page_size: int) -> list[jax.Array]:
        """Zeroed pools, one per leaf: `[num_pages, page_size, *rest]`."""
        return [jnp.zeros((num_pages, page_size, *r), d) for r, d in zip(self.rest, self.dtypes, strict=True)]

    def dense(self, pools: list[jax.Array], table: jax.Array, extra: int) -> Any:
        """The model's cache for rows whose pages are `table [B, P]`: each leaf `[B, P * page + extra, ...]` in the
        model's layout (the last `extra` columns zero, for this call's tokens)."""
        out = []
        for pool, (a, s) in zip(pools, self.axes, strict=True):
            b, p = table.shape
            x = pool[table].reshape(b, p * pool.shape[1], *pool.shape[2:])
            x = jnp.concatenate([x, jnp.zeros((b, extra, *pool.shape[2:]), pool.dtype)], axis=1)
            out.append(jnp.moveaxis(x, (0, 1), (a, s)))
        return jax.tree_util.tree_unflatten(self.treedef, out)

    def write(self, pools: list[jax.Array], cache: Any, start: int, pages: jax.Array, offsets: jax.Array):
        """`pools` with the columns `start:` of the model's `cache` (`[B, T, ...]` after moving axes) written at
        `pages, offsets [B, T]`."""
        out = []
        for pool, leaf, (a, s) in zip(pools, jax.tree_util.tree_leaves(cache), self.axes, strict=True):
            new = jnp.moveaxis(leaf, (a, s), (0, 1))[:, start:]
            out.append(pool.at[pages, offsets].set(new.astype(pool.dtype)))
        return out


def _targets(table: jax.Array, positions: jax.Array, valid: jax.Array, page_size: int):
    """The `(pages, offsets)` `[B, T]` of `positions [B, T]` under `table [B, Pmax]`; invalid ones go to the
    trash page."""
    index = jnp.clip(positions // page_size, 0, table.shape[1] - 1)
    pages = jnp.take_along_axis(table, index, axis=1)
    return jnp.where(valid, pages, TRASH_PAGE), jnp.where(valid, positions % page_size, 0)


def _step_keys(keys: jax.Array, positions: jax.Array) -> jax.Array:
    """Each row's key for the token at `positions [B]`: `fold_in(sequence key, position)` — a sample depends on
    the sequence and the position only, never on the slot or the step it was drawn in."""
    return jax.vmap(jax.random.fold_in)(keys, positions)


def _extend(graphdef, layout, page_size, read_pages, state, pools, table, lens, tokens, count, keys, params, *, record):
    """Run `tokens [B, T]` (left-padded, `count [B]` real ones) after each row's `lens [B]` cached positions
    (pages `table [B, Pmax]`, of which the first `read_pages` are read); write their keys and values into the
    pages and sample each row's next token (key: its sequence's `keys [B, 2]`, folded with the token's
    position) and settings `params`. Returns `(next [B], logp [B], logits [B, V], pools, routes)`: a group's
    members sample their own tokens from the one prompt row's logits; `routes [L, B, T, k]`, an MoE model's experts
    of each token run (None for a dense model, or unless `record`: then no buffer is made)."""
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    g = read_pages * page_size
    cache = layout.dense(pools, table[:, :read_pages], t)
    col = jnp.arange(g)[None, :]
    fed = jnp.arange(t)[None, :] >= (t - count)[:, None]
    positions = jnp.maximum(lens[:, None] + jnp.arange(t)[None, :] - (t - count)[:, None], 0)
    kv_seg = jnp.concatenate([(col < lens[:, None]), fed], axis=1).astype(jnp.int32)
    kv_pos = jnp.concatenate([jnp.broadcast_to(col, (b, g)), positions], axis=1)
    logits, out = last_logits(
        model,
        tokens,
        positions=positions,
        segment_ids=fed.astype(jnp.int32),
        cache=cache,
        cache_index=g,
        kv_positions=kv_pos,
        kv_segment_ids=kv_seg,
    )
    pages, offsets = _targets(table, positions, fed, page_size)
    pools = layout.write(pools, out.cache, g, pages, offsets)
    where = lens + count
    token, logp = sample_rows(logits, _step_keys(keys, where), *params)
    return token, logp, logits, pools, out.routes if record else None


def _decode(
    graphdef, layout, page_size, read_pages, steps, state, pools, table, lens, token, keys, limit, params, *, record
):
    """`steps` decode steps for every slot: feed `token [B]` at position `lens [B]` (its pages `table [B, Pmax]`,
    the first `read_pages` read), sample the next, feed it, ... Writes positions `lens ... lens + steps - 1`
    below `limit [B]` into the pages; each row samples with its `params`. Returns `(tokens [B, steps],
    logps [B, steps], pools, routes)`, `routes [B, steps, L, k]` an MoE model's experts of each token fed (None
    for a dense model, or unless `record`)."""
    model = nnx.merge(graphdef, state)
    b = token.shape[0]
    g = read_pages * page_size
    cache = layout.dense(pools, table[:, :read_pages], steps)
    col = jnp.arange(g)[None, :]
    kv_seg = jnp.concatenate([(col < lens[:, None]).astype(jnp.int32), jnp.zeros((b, steps), jnp.int32)], 1)
    kv_pos = jnp.concatenate([jnp.broadcast_to(col, (b, g)), jnp.zeros((b, steps), jnp.int32)], 1)
    ones = jnp.ones((b, 1), jnp.int32)

    def body(carry, i):
        cache, kv_seg, kv_pos, token = carry
        pos = lens + i
        kv_seg = jax.lax.dynamic_update_slice(kv_seg, ones, (0, g + i))
        kv_pos = jax.lax.dynamic_update_slice(kv_pos, pos[:, None], (0, g + i))
        out = model(
            token[:, None],
            positions=pos[:, None],
            segment_ids=ones,
            cache=cache,
            cache_index=g + i,
            kv_positions=kv_pos,
            kv_segment_ids=kv_seg,
        )
        logits = out.logits[:, -1].astype(jnp.float32)
        new, logp = sample_rows(logits, _step_keys(keys, pos + 1), *params)
        routes = out.routes[:, :, 0] if record and out.routes is not None else None
        return (out.cache, kv_seg, kv_pos, new), (new, logp, routes)

    (cache, *_), (tokens, logps, routes) = jax.lax.scan(body, (cache, kv_seg, kv_pos, token), jnp.arange(steps))
    positions = lens[:, None] + jnp.arange(steps)[None, :]
    pages, offsets = _targets(table, positions, positions < limit[:, None], page_size)
    routes = None if routes is None else jnp.transpose(routes, (2, 0, 1, 3))  # [B, steps, L, k]
    return tokens.T, logps.T, layout.write(pools, cache, g, pages, offsets), routes


def _copy_pages(pools, src, dst):
    """`pools` with pages `dst [N]` made copies of pages `src [N]` (a group's partial prompt page, given to each
    completion before it writes there)."""
    return [pool.at[dst].set(pool[src]) for pool in pools]


def _sample_members(logits, rows, keys, positions, params):
    """A token for each of `rows [N]` of `logits [U, V]` (a group's members share their prompt's logits), each
    with its own sequence key at `positions [N]`."""
    chosen = logits[rows]
    return sample_rows(chosen, _step_keys(keys, positions), *params)


@functools.lru_cache(maxsize=256)
def compiled(
    kind: str, graphdef, layout: CacheLayout, page_size: int, read_pages: int, steps: int, record: bool = False
):
    """The jitted call of `kind` (`extend`, `decode`) for one model structure and page geometry (each row's
    sampling settings are data: `params = (temperature, top_k, top_p)`, `[B]` each); `record`: an MoE model's
    experts per token are returned (else none: no buffer); the pools are donated (updated in place)."""
    if kind == "extend":
        fn = functools.partial(_extend, graphdef, layout, page_size, read_pages, record=record)
    else:
        fn = functools.partial(_decode, graphdef, layout, page_size, read_pages, steps, record=record)
    return jax.jit(fn, donate_argnums=(1,))


copy_pages = jax.jit(_copy_pages, donate_argnums=(0,))


sample_members = jax.jit(_sample_members)
