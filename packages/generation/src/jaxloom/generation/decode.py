"""Prefill + KV-cache decoding inside one jitted function, and a naive reference."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import GenerationConfig
from .sampling import next_token


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Generated:
    """What `generate` returns: `sequences [B, P + N]` (the left-padded prompt, then the completion),
    `completion_ids [B, N]` right-padded after EOS, `completion_mask` (1 for generated tokens), and
    `completion_logps [B, N]`: each generated token's log-probability under the distribution it was sampled
    from before top-k/top-p filtering (float32 logits divided by the temperature; 0 after the end) — what a
    trainer's forward pass computes for the same tokens (GRPO compares the two every step). With `record_routes`
    and an MoE model, `routes [B, P + N, L, k]`: the experts each layer sent each token of `sequences` to while
    decoding (-1 where none ran: padding, a dense layer, the last token, fed to no step) — what a trainer's
    forward replays (MoE routing replay, `CausalLM(routing=...)`)."""

    sequences: jax.Array  # [B, P + N]: the (left-padded) prompt then the completion
    completion_ids: jax.Array  # [B, N], right-padded with pad_token_id after EOS
    completion_mask: jax.Array  # [B, N], 1 for generated tokens (EOS included)
    completion_logps: jax.Array | None = None  # [B, N], float32
    routes: jax.Array | None = None  # [B, P + N, L, k] int16: an MoE model's experts per token (`record_routes`)


def bucket(n: int, minimum: int = 16) -> int:
    """Prompt lengths are padded up to a power of two so each bucket compiles once."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def token_logp(logits: jax.Array, token: jax.Array, config: GenerationConfig) -> jax.Array:
    """`log p(token)` `[B]` under `logits [B, V]` read in float32 and divided by the sampling temperature (1 when
    greedy), before any top-k/top-p filtering: the quantity a trainer's forward pass gives for the token."""
    temperature = config.temperature if (config.do_sample and config.temperature > 0) else 1.0
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def last_logits(model, input_ids, **kwargs):
    """`(logits of the last position [B, V], output)`: a jaxloom causal LM stops before its output layer and
    projects the last position only (a prompt's `[B, P, V]` logits are never made); other models compute all."""
    if hasattr(model, "output_projection") and "return_hidden" in inspect.signature(model.__call__).parameters:
        out = model(input_ids, return_hidden=True, **kwargs)
        kernel, dtype, precision = model.output_projection()  # as the model's output layer computes them
        logits = jnp.dot(out.hidden[:, -1].astype(dtype), kernel.astype(dtype), precision=precision)
        cap = getattr(model, "logit_softcap", None)
        if cap is not None:  # Gemma 2: cap · tanh(logits / cap), in the logits' dtype
            logits = cap * jnp.tanh(logits / cap)
        return logits.astype(jnp.float32), out
    out = model(input_ids, **kwargs)
    return out.logits[:, -1], out


def prefill(model, input_ids, attention_mask, total: int, rng, config: GenerationConfig):
    """Run the prompts `[B, P]` into a fresh cache of `total` slots; returns the first new token and the
    decoding state `(cache, last_position, kv_segment_ids, kv_positions)`."""
    logits, decoding, _ = prefill_logits(model, input_ids, attention_mask, total)
    return next_token(logits, rng, config), decoding


def prefill_logits(model, input_ids, attention_mask, total: int, extras: dict[str, Any] | None = None):
    """Run the prompts `[B, P]` into a fresh cache of `total` slots: the last position's logits `[B, V]`, the
    decoding state `(cache, last_position, kv_segment_ids, kv_positions)` and an MoE model's `routes [L, B, P, k]`
    (None for a dense one). `extras`: more arguments of the prompt's call (a vision-language model's images:
    `model.image_inputs`)."""
    b, p = input_ids.shape
    mask = attention_mask.astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
    kv_seg = jnp.zeros((b, total), jnp.int32).at[:, :p].set(mask)
    kv_pos = jnp.zeros((b, total), jnp.int32).at[:, :p].set(positions)
    logits, out = last_logits(
        model,
        input_ids,
        positions=positions,
        segment_ids=mask,
        cache=model.init_cache(b, total),
        cache_index=0,
        kv_positions=kv_pos,
        kv_segment_ids=kv_seg,
        **(extras or {}),
    )
    return logits, (out.cache, positions[:, -1], kv_seg, kv_pos), out.routes


def repeat_rows(model, decoding, logits, group: int, total: int):
    """The prefill of `U` prompts made the prefill of `U * group` rows (row `u * group + j` is prompt `u`'s `j`-th
    completion): the KV cache, positions and last logits repeated along their batch axis, so a group's
    completions share one prefill. The cache's batch axis is found from `model.init_cache`'s shapes."""
    if group == 1:
        return decoding, logits
    cache, pos, kv_seg, kv_pos = decoding
    axes = _batch_axes(model, total)
    cache = jax.tree_util.tree_map(lambda c, ax: jnp.repeat(c, group, axis=ax), cache, axes)
    rep = functools.partial(jnp.repeat, repeats=group, axis=0)
    return (cache, rep(pos), rep(kv_seg), rep(kv_pos)), rep(logits)


def decode_one(model, token, decoding, at, rng, config: GenerationConfig):
    """Feed `token [B]` at cache slot `at`; returns the next token and the updated decoding state."""
    logits, decoding, _ = decode_logits(model, token, decoding, at)
    return next_token(logits, rng, config), decoding


def decode_logits(model, token, decoding, at, rope_delta=None):
    """Feed `token [B]` at cache slot `at`; returns the next position's logits `[B, V]`, the decoding state and an
    MoE model's experts for the token, `[L, B, k]` (None for a dense one). `rope_delta [B]`: what each row's RoPE
    position adds to its token position (a prompt with images under M-RoPE: `model.image_inputs`' deltas)."""
    cache, pos, kv_seg, kv_pos = decoding
    b = token.shape[0]
    pos = pos + 1
    kv_seg = jax.lax.dynamic_update_slice(kv_seg, jnp.ones((b, 1), jnp.int32), (0, at))
    kv_pos = jax.lax.dynamic_update_slice(kv_pos, pos[:, None], (0, at))
    turn = {} if rope_delta is None else {"rope_positions": (pos + rope_delta)[:, None]}
    out = model(
        token[:, None],
        positions=pos[:, None],
        segment_ids=jnp.ones((b, 1), jnp.int32),
        cache=cache,
        cache_index=at,
        kv_positions=kv_pos,
        kv_segment_ids=kv_seg,
        **turn,
    )
    routes = None if out.routes is None else out.routes[:, :, -1]
    return out.logits[:, -1], (out.cache, pos, kv_seg, kv_pos), routes


def refill(model, tokens, token, decoding, at, rng, config: GenerationConfig):
    """Like `decode_one`, but the whole sequence so far (`tokens [B, S]`, the token fed now at slot `at`) is run
    again into a fresh cache: what transformers does once when a LongRoPE model (Phi-3 128k) passes its original
    length, so that every key is rotated with the long factors from there on."""
    logits, decoding, _ = refill_logits(model, tokens, token, decoding, at)
    return next_token(logits, rng, config), decoding


def refill_logits(model, tokens, token, decoding, at):
    """`refill`'s logits `[B, V]` at slot `at` and the new decoding state."""
    cache, pos, kv_seg, kv_pos = decoding
    b = token.shape[0]
    pos = pos + 1
    kv_seg = jax.lax.dynamic_update_slice(kv_seg, jnp.ones((b, 1), jnp.int32), (0, at))
    kv_pos = jax.lax.dynamic_update_slice(kv_pos, pos[:, None], (0, at))
    out = model(
        tokens,
        positions=kv_pos,
        segment_ids=kv_seg,
        cache=jax.tree_util.tree_map(jnp.zeros_like, cache),
        cache_index=0,
        kv_positions=kv_pos,
        kv_segment_ids=kv_seg,
    )
    logits = jax.lax.dynamic_slice_in_dim(out.logits, at, 1, axis=1)[:, 0]
    routes = None if out.routes is None else jax.lax.dynamic_slice_in_dim(out.routes, at, 1, axis=2)[:, :, 0]
    return logits, (out.cache, pos, kv_seg, kv_pos), routes


COMPACT_ROWS = 32
"""Batches of at least this many rows are compacted as their rows end (`_decode`); smaller ones decode whole."""


def _batch_axes(model, total: int):
    """The batch axis of each leaf of `model.init_cache(B, total)` (found from the shapes of B = 1 and 2)."""
    one = jax.eval_shape(lambda: model.init_cache(1, total))
    two = jax.eval_shape(lambda: model.init_cache(2, total))
    return jax.tree_util.tree_map(
        lambda a, b: next(i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y), one, two
    )


def _take_rows(rows: jax.Array, x: jax.Array, axis: int) -> jax.Array:
    return jnp.take(x, rows, axis=axis)


def _decode(
    graphdef,
    state,
    input_ids,
    attention_mask,
    rng,
    extras=None,
    deltas=None,
    *,
    config: GenerationConfig,
    group: int = 1,
    record: bool = False,
):
    """Prefill (once per prompt, shared by its `group` rows), then decode until every row has ended or
    `max_new_tokens`. Finished rows stop costing: a batch of `COMPACT_ROWS` or more rows decodes in phases, each
    half as wide as the one before, the next starting once at most half of the rows are still going (the
    going rows, and the cache they read, gathered into the narrower batch; outputs written back by row). Each row
    samples with its own key (`fold_in(step key, row)`), so which rows share a phase changes no sample. With
    `record` (and an MoE model), each fed token's experts are kept (`Generated.routes`). `extras` and `deltas [U]`:
    a prompt's images (`model.image_inputs`), the prefill's arguments and each prompt's RoPE offset."""
    model = nnx.merge(graphdef, state)
    u, p = input_ids.shape
    b = u * group
    n = config.max_new_tokens
    rng, sub = jax.random.split(rng)
    logits, decoding, prompt_routes = prefill_logits(model, input_ids, attention_mask, p + n, extras)
    deltas = None if deltas is None else jnp.repeat(deltas, group)  # by row id: compaction keeps `rows`
    decoding, logits = repeat_rows(model, decoding, logits, group, p + n)
    routes = None
    if record and prompt_routes is not None:  # [L, B, P + N, k]: the prompt's now, each completion token's when fed
        prompt_routes = jnp.where(attention_mask[None, :, :, None] > 0, prompt_routes, -1)
        prompt_routes = jnp.repeat(prompt_routes, group, axis=1).astype(jnp.int16)
        layers, _, _, k = prompt_routes.shape
        routes = jnp.concatenate([prompt_routes, jnp.full((layers, b, n, k), -1, jnp.int16)], axis=2)
    input_ids = jnp.repeat(input_ids, group, axis=0)
    rows = jnp.arange(b, dtype=jnp.int32)

    def sample(logits, key, rows):
        return next_token(logits, key, config, rows)

    token = sample(logits, sub, rows)
    eos = jnp.asarray(config.eos_ids or (-1,), jnp.int32)
    done = jnp.isin(token, eos)
    completion = jnp.full((b, n), config.pad_token_id, jnp.int32).at[:, 0].set(token)
    comp_mask = jnp.zeros((b, n), jnp.int32).at[:, 0].set(1)
    logps = jnp.zeros((b, n), jnp.float32).at[:, 0].set(token_logp(logits, token, config))
    refresh = getattr(model, "cache_refresh_position", None)

    def step(token, decoding, at, rows, completion):
        if refresh is None:
            return decode_logits(model, token, decoding, at, None if deltas is None else deltas[rows])
        crossing = jnp.max(decoding[1]) + 1 == refresh  # the longest row's next position is the first past it
        sequence = jnp.concatenate([input_ids[rows], completion[rows]], 1)
        return jax.lax.cond(
            crossing,
            lambda: refill_logits(model, sequence, token, decoding, at),
            lambda: decode_logits(model, token, decoding, at),
        )

    def body(carry):
        i, decoding, token, rows, done, completion, comp_mask, logps, routes, rng = carry
        rng, sub = jax.random.split(rng)
        logits, decoding, fed = step(token, decoding, p + i - 1, rows, completion)
        if routes is not None:  # the token fed now: completion token i - 1 (-1 once its row has ended)
            fed = jnp.where(done[None, :, None], -1, fed).astype(routes.dtype)
            routes = routes.at[:, rows, p + i - 1].set(fed)
        new = jnp.where(done, config.pad_token_id, sample(logits, sub, rows))
        logp = jnp.where(done, 0.0, token_logp(logits, new, config))
        completion = completion.at[rows, i].set(new)
        comp_mask = comp_mask.at[rows, i].set((~done).astype(jnp.int32))
        logps = logps.at[rows, i].set(logp)
        return i + 1, decoding, new, rows, done | jnp.isin(new, eos), completion, comp_mask, logps, routes, rng

    axes = _batch_axes(model, p + n)
    carry = (jnp.int32(1), decoding, token, rows, done, completion, comp_mask, logps, routes, rng)
    width = b
    while True:  # phases, unrolled at trace time: b, b/2, b/4, ... rows
        narrower = width // 2 if width >= COMPACT_ROWS and width % 2 == 0 else 0

        def cond(carry, narrower=narrower):
            i, *_, done = carry[:5]
            going = (i < n) & ~jnp.all(done)
            return going & (jnp.sum(~done) > narrower) if narrower else going

        carry = jax.lax.while_loop(cond, body, carry)
        if not narrower:
            break
        i, decoding, token, rows, done, *outputs = carry
        keep = jnp.argsort(done, stable=True)[:narrower]  # the rows still going first
        cache, pos, kv_seg, kv_pos = decoding
        cache = jax.tree_util.tree_map(functools.partial(_take_rows, keep), cache, axes)
        decoding = (cache, pos[keep], kv_seg[keep], kv_pos[keep])
        carry = (i, decoding, token[keep], rows[keep], done[keep], *outputs)
        width = narrower
    _, _, _, _, _, completion, comp_mask, logps, routes, _ = carry
    routes = None if routes is None else jnp.transpose(routes, (1, 2, 0, 3))  # [B, P + N, L, k]
    return Generated(jnp.concatenate([input_ids, completion], axis=1), completion, comp_mask, logps, routes)


@functools.lru_cache(maxsize=64)
def _compiled(graphdef, config: GenerationConfig, group: int = 1, record: bool = False):
    return jax.jit(functools.partial(_decode, graphdef, config=config, group=group, record=record))


def generate(
    model: nnx.Module,
    input_ids,
    attention_mask=None,
    config: GenerationConfig | None = None,
    *,
    mesh=None,
    rng=None,
    num_return_sequences: int = 1,
    record_routes: bool = False,
    pixel_values=None,
    image_grid_thw=None,
) -> Generated:
    """Decode `config.max_new_tokens` tokens after left-padded prompts `input_ids [B, P]` (with
    `attention_mask`, 0 on padding; default all ones). With `mesh`, the batch is sharded over its data
    axes. One jitted function per (model structure, config, prompt bucket); prompts are padded to the
    bucket. `rng`: the sampling key (default: `PRNGKey(config.seed)`), e.g. one derived from a training
    state, so that a resumed run samples what the uninterrupted one did. `num_return_sequences` (transformers'
    name): each prompt is completed that many times, rows `i * n ... (i + 1) * n - 1` of the outputs being
    prompt `i`'s; the prompt is run once and its KV cache shared by its completions (one prefill per prompt).
    `record_routes`: an MoE model's experts per token are returned too (`Generated.routes`; MoE routing replay).
    `pixel_values` and `image_grid_thw`: the image processor's outputs for the prompts' images, for a model that
    reads images (`image_inputs`: Qwen2.5-VL, which needs the grid; Gemma 3, whose images are one size); the image
    features join the prompt's one prefill (Gemma 3's image tokens seeing each other both ways there), and each
    decoded token turns at its position (Qwen2.5-VL's M-RoPE: the last + 1), as transformers' `generate` does."""
    config = config or GenerationConfig()
    group = int(num_return_sequences)
    if group < 1:
        raise ValueError(f"num_return_sequences = {num_return_sequences}; expected a positive integer")
    ids = np.asarray(input_ids, np.int32)
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, length] array, got shape {ids.shape}")
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, np.int32)
    limit = model.config.max_position_embeddings
    longest = int(mask.sum(-1).max())
    if longest + config.max_new_tokens > limit:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens {config.max_new_tokens} exceeds the model's "
            f"context of {limit} (max_position_embeddings)"
        )
    p = bucket(ids.shape[1])
    pad = p - ids.shape[1]
    ids = np.pad(ids, ((0, 0), (pad, 0)), constant_values=config.pad_token_id)
    mask = np.pad(mask, ((0, 0), (pad, 0)))
    extras = deltas = None
    if pixel_values is not None:
        if not hasattr(model, "image_inputs"):
            raise ValueError(f"pixel_values given, but {type(model).__name__} reads no images; expected a text prompt")
        extras, deltas = model.image_inputs(ids, mask, pixel_values, image_grid_thw)
    graphdef, state = nnx.split(model)
    fn = _compiled(graphdef, config, group, bool(record_routes))
    rng = jax.random.PRNGKey(config.seed) if rng is None else rng
    if mesh is not None:
        with jax.set_mesh(mesh):
            out = fn(state, ids, mask, rng, extras, deltas)
    else:
        out = fn(state, ids, mask, rng, extras, deltas)
    out = jax.tree_util.tree_map(_on_every_process, out)
    routes = None if out.routes is None else out.routes[:, pad:]
    return Generated(out.sequences[:, pad:], out.completion_ids, out.completion_mask, out.completion_logps, routes)


def _on_every_process(x: jax.Array) -> jax.Array | np.ndarray:
    """`x` readable on this process: an array split between processes (each Ray worker or host holds its
    rows) is gathered whole on every process, so callers can read the tokens on any of them."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return x


def create_generate_function(
    generation_config: GenerationConfig | None = None,
    *,
    shard_inputs: bool = True,
    config_overrides: dict[str, Any] | None = None,
    mesh=None,
):
    """EasyDeL's `create_generate_function`: `fn(state_or_model, input_ids, attention_mask)` →
    `(sequences, completion_ids, completion_mask)`, decoding with `generation_config` (updated by
    `config_overrides`). With `shard_inputs`, inputs are placed on `mesh`'s batch axes."""
    config = (generation_config or GenerationConfig()).replace(**(config_overrides or {}))

    def fn(state_or_model, input_ids, attention_mask):
        model = state_or_model.model if hasattr(state_or_model, "graphdef") else state_or_model
        out = generate(model, input_ids, attention_mask, config, mesh=mesh if shard_inputs else None)
        return out.sequences, out.completion_ids, out.completion_mask

    return fn
