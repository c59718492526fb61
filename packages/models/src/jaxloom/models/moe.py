"""The mixture of experts every MoE family builds on: `SparseMoE` (a top-k router over stacked experts), routing,
the balance loss, token dispatch (grouped matmuls, expert parallelism). Mixtral is the decoder with it as the
feed-forward (`mixtral.py`); Qwen3-MoE, DeepSeek-V3 and GPT-OSS use its parts."""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from .configs import MixtralConfig
from .decoder import Routed
from .layers import ACTIVATIONS, Linear, matmul_precision, constrain
from .expert_adapters import ExpertLoRA, expert_weights
from .runtime import RuntimeConfig


def resolve_moe_implementation(requested: str, platform: str | None = None) -> str:
    """`auto` → `ragged` on GPU/TPU (grouped GEMM kernels), `tiled` elsewhere: XLA's CPU backend lowers
    `ragged_dot` to a dense product over every expert (measured: 4× the FLOPs from E=2 to E=8)."""
    if requested != "auto":
        return requested
    return "ragged" if (platform or jax.default_backend()) in ("gpu", "cuda", "rocm", "tpu") else "tiled"


def tile_rows(rows: int, groups: int, largest: int = 128) -> int:
    """Rows per tile of the `tiled` grouped matmul: a power of two, at most `largest`, and small enough
    that the padding of one partial tile per group (`groups · tile`) stays under a quarter of `rows`."""
    tile = 8
    while tile < largest and groups * tile * 2 * 4 <= rows:
        tile *= 2
    return tile


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    implementation: str,
    tile: int | None = None,
    skip_unused: bool = False,
) -> jax.Array:
    """`x [M, D]` whose rows are sorted by group, `w [E, D, F]`, `group_sizes [E]` → `[M, F]`, row i
    multiplied by the weights of its group. The groups may cover fewer than M rows: the rows after them
    give zeros.

    `implementation` `ragged`: `lax.ragged_dot`. `tiled`: each group's rows are placed into `tile`-row tiles (a group
    starts a new tile), every tile gathers its one expert's weights and the tiles run as one batched
    matmul: `(M + E·tile)·D·F` multiply-adds instead of `E·M·D·F`, static shapes, any platform.
    `tile` defaults to `tile_rows(M, E)`. With `skip_unused` (tiled), the tiles run in chunks under
    `lax.cond` and the chunks after the groups' rows are skipped at run time: the cost follows the rows
    the groups hold, not M (an expert-parallel device's buffer is sized for the worst case, all of its
    group's tokens routed to its experts, and holds about `1/ep` of that).
    """
    if implementation == "ragged":
        return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype)
    m, d = x.shape
    e, f = w.shape[0], w.shape[-1]
    tile = tile or tile_rows(m, e)
    tiles = -(-m // tile) + e  # enough: sum over groups of ceil(size / tile) < m / tile + e
    padded = -(-group_sizes // tile) * tile  # each group's rows rounded up to tiles
    padded_end = jnp.cumsum(padded)
    ends = jnp.cumsum(group_sizes)
    start = ends - group_sizes  # first sorted row of each group
    rows = jnp.arange(m)
    group_of_row = jnp.searchsorted(ends, rows, side="right")  # e: after every group
    g = jnp.minimum(group_of_row, e - 1)
    dest = jnp.where(group_of_row < e, (padded_end - padded)[g] + rows - start[g], tiles * tile)
    x_tiles = jnp.zeros((tiles * tile, d), x.dtype).at[dest].set(x, mode="drop").reshape(tiles, tile, d)
    tile_group = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(tiles) * tile, side="right"), e - 1)
    if not skip_unused:
        y = jnp.einsum("tmd,tdf->tmf", x_tiles, w[tile_group])
    else:
        chunk = max(1, 512 // tile)  # tiles per chunk: about 512 rows
        chunks = -(-tiles // chunk)
        extra = chunks * chunk - tiles
        x_tiles = jnp.pad(x_tiles, ((0, extra), (0, 0), (0, 0))).reshape(chunks, chunk, tile, d)
        tile_group = jnp.pad(tile_group, (0, extra), constant_values=e - 1).reshape(chunks, chunk)
        used = padded_end[-1] // tile  # tiles holding the groups' rows come first

        def run(_, c):
            xc, gc, first = c
            yc = jax.lax.cond(
                first < used,
                lambda: jnp.einsum("tmd,tdf->tmf", xc, w[gc]),
                # zeros typed like the product (under shard_map: varying over the same mesh axes)
                lambda: jnp.broadcast_to(
                    jnp.where(True, 0, xc[0, 0, 0] * w[0, 0, 0]).astype(y_dtype), (chunk, tile, f)
                ),
            )
            return None, yc

        y_dtype = jnp.result_type(x.dtype, w.dtype)
        _, y = jax.lax.scan(run, None, (x_tiles, tile_group, jnp.arange(chunks) * chunk))
    return y.reshape(-1, f).at[dest].get(mode="fill", fill_value=0)


class SparseMoE(nnx.Module):
    """Top-k routing (softmax, top-k, weights renormalised when `config.normalize_top_k`) over `E` experts stored
    stacked `[E, ...]` and sharded on the `expert` logical axis (→ `ep`).

    Dropless token dispatch: the `N·k` (token, expert) pairs are sorted by expert, each expert's rows
    go through its weights in one grouped matmul (`grouped_matmul`), and the results are scattered
    back and combined with the router weights, so FLOPs follow `k`, not `E`. `moe_implementation=
    "dense"` runs every expert on every token instead (exact, `E/k` times the FLOPs): the reference
    the tests compare against.

    Expert parallelism: on a mesh whose expert axis (`ep`) has more than one device, the dispatch runs
    under `shard_map` (`expert_parallel_dispatch`): every device keeps only its `E/ep` experts'
    weights and the tokens move to them, never the weights to the tokens.

    LoRA on the experts (`target_parameters`): `gate_up_lora` / `down_lora` (`ExpertLoRA`, None without) adapt
    transformers' `mlp.experts.gate_up_proj` (`w_gate` then `w_up`) and `mlp.experts.down_proj` (`w_down`).
    """

    EXPERT_WEIGHTS: ClassVar[dict[str, tuple[str, ...]]] = {
        "gate_up_proj": ("w_gate", "w_up"),  # transformers concatenates their outputs: gate, then up
        "down_proj": ("w_down",),
    }
    HF_EXPERTS: ClassVar[str] = "experts"  # transformers' module of the stacked weights, under this one's name
    ROUTED: ClassVar[bool] = True  # takes `routing` (replay) and returns `Routed`

    def __init__(self, config: MixtralConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        e, d, f = config.num_experts, config.hidden_size, config.expert_intermediate_size
        std = config.initializer_range
        init = jax.nn.initializers.normal(std)
        self.gate = Linear(d, e, ("embed", None), runtime, std=std, rngs=rngs)

        def param(shape, axes):
            return nnx.Param(init(rngs.params(), shape, runtime.param_dtype), logical_axes=axes)

        self.w_gate = param((e, d, f), ("expert", "embed", "mlp"))
        self.w_up = param((e, d, f), ("expert", "embed", "mlp"))
        self.w_down = param((e, f, d), ("expert", "mlp", "embed"))
        self.gate_up_lora: ExpertLoRA | None = nnx.data(None)
        self.down_lora: ExpertLoRA | None = nnx.data(None)
        self.k, self.e, self.normalize = config.num_experts_per_tok, e, config.normalize_top_k
        self.act, self.runtime = ACTIVATIONS[config.mlp_activation], runtime

    def __call__(self, x, token_mask=None, routing=None):
        dtype = self.runtime.dtype
        probs, top_w, top_i, chosen = route(self.gate(x), self.k, self.e, normalize=self.normalize, replay=routing)
        weights = stacked_weights(self, dtype, self.runtime)
        out = run_experts(x.astype(dtype), top_i, top_w, weights, glu=gated(self.act), runtime=self.runtime)
        return out, Routed(balance_loss(probs, chosen, token_mask, self.k, self.e), top_i)


def stacked_weights(moe: nnx.Module, dtype, runtime: RuntimeConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(w_gate, w_up, w_down)` of an MoE module with Mixtral's layout in `dtype`, its experts' adapters added."""
    precision = matmul_precision(runtime)
    w_gate, w_up = expert_weights(moe, "gate_up_proj", dtype, precision)
    (w_down,) = expert_weights(moe, "down_proj", dtype, precision)
    return w_gate, w_up, w_down


def run_experts(x, top_i, top_w, weights, *, glu, runtime: RuntimeConfig, biases=None):
    """The routed experts' output for `x [B, T, D]` (in its dtype) by `runtime.moe_implementation`: `dense`, the
    reference, runs every expert on every token (exact, `E/k` times the FLOPs); otherwise the token dispatch
    (`dispatch_tokens`), under `shard_map` when the mesh splits the experts (`expert_parallel_dispatch`).
    `weights` are `(w_gate [E, D, F], w_up, w_down [E, F, D])`, `biases` `(b_gate [E, F], b_up, b_down [E, D])`
    or None, `glu(gate, up)` the expert's middle."""
    impl = resolve_moe_implementation(runtime.moe_implementation)
    experts = weights[0].shape[0]
    if impl != "dense":
        kw = dict(glu=glu, biases=biases, implementation=impl)
        if expert_parallel_mesh(runtime, experts) is None:
            return dispatch_tokens(x, top_i, top_w, *weights, **kw)
        return expert_parallel_dispatch(x, top_i, top_w, *weights, **kw, runtime=runtime)
    w_gate, w_up, w_down = weights
    gate, up = jnp.einsum("btd,edf->btef", x, w_gate), jnp.einsum("btd,edf->btef", x, w_up)
    if biases is not None:
        gate, up = gate + biases[0], up + biases[1]
    h = constrain(glu(gate, up), ("batch", "length", "expert", "mlp"), runtime)
    per_expert = jnp.einsum("btef,efd->bted", h, w_down)
    if biases is not None:
        per_expert = per_expert + biases[2]
    chosen = jax.nn.one_hot(top_i, experts, dtype=top_w.dtype)
    return jnp.einsum("bted,bte->btd", per_expert, jnp.einsum("btk,btke->bte", top_w, chosen).astype(x.dtype))


def route(logits: jax.Array, k: int, experts: int, *, normalize: bool, replay=None):
    """Top-`k` routing from router `logits [B, T, E]`: `(probs [B, T, E]` (softmax, float32), `top_w [B, T, k]`
    (the chosen experts' probabilities, renormalised to sum to one with `normalize`), `top_i [B, T, k]`,
    `chosen [B, T, k, E]` (one-hot)). `replay [B, T, k]`: the experts to take where it is >= 0 (`replay_routes`)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, k)
    if replay is not None:
        top_i = replay_routes(top_i, replay)
        top_w = jnp.take_along_axis(probs, top_i, axis=-1)
    if normalize:  # Mixtral and GPT-OSS always; Qwen3-MoE with norm_topk_prob
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return probs, top_w, top_i, jax.nn.one_hot(top_i, experts, dtype=jnp.float32)


def replay_routes(top_i: jax.Array, replay: jax.Array) -> jax.Array:
    """MoE routing replay: the recorded experts `replay [B, T, k]` in place of the router's own `top_i` on every
    token recorded (-1: not recorded, the router's choice stays)."""
    recorded = jnp.all(replay >= 0, axis=-1, keepdims=True)
    return jnp.where(recorded, replay.astype(top_i.dtype), top_i)


def balance_loss(probs: jax.Array, chosen: jax.Array, token_mask, k: int, experts: int) -> jax.Array:
    """Switch-style load balancing over the real tokens: `E · Σ_e (share of routed slots to e) · (mean router
    probability of e)`."""
    mask = jnp.ones(probs.shape[:2], jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
    n = jnp.maximum(mask.sum(), 1.0)
    routed = jnp.einsum("btke,bt->e", chosen, mask) / (n * k)
    mean_prob = jnp.einsum("bte,bt->e", probs, mask) / n
    return experts * jnp.sum(routed * mean_prob)


def _expert_rows(x, top_i, experts: int, first_expert):
    """The (token, expert) pairs of `x [B, T, D]` routed by `top_i [B, T, k]`, sorted by expert for
    the experts `first_expert .. first_expert + experts - 1`; pairs for other experts come last.

    Returns `(rows [N·k, D], order, sizes [experts], local [N·k])`: `rows` in expert order, the sort
    `order`, each expert's row count (the pairs routed elsewhere are in no group), and which pairs (in
    their original order) are routed here."""
    b, t, d = x.shape
    k = top_i.shape[-1]
    expert = top_i.reshape(-1) - first_expert  # [N·k]
    local = (expert >= 0) & (expert < experts)
    key = jnp.where(local, expert, experts)
    order = jnp.argsort(key, stable=True)
    rows = x.reshape(b * t, d)[order // k]
    sizes = jnp.bincount(key, length=experts + 1)[:experts].astype(jnp.int32)
    return rows, order, sizes, local


def gated(act):
    """The gated feed-forward's middle, `act(gate) · up` (SwiGLU, GeGLU), as `glu(gate, up)`."""
    return lambda gate, up: act(gate) * up


def dispatch_tokens(
    x,
    top_i,
    top_w,
    w_gate,
    w_up,
    w_down,
    *,
    act=None,
    glu=None,
    biases=None,
    implementation: str,
    first_expert=0,
    some_experts=False,
    down_bias_here=True,
):
    """Route `x [B, T, D]` to the experts `top_i [B, T, k]` chose: sort the (token, expert) pairs by
    expert, run each expert's gated MLP `glu(x @ w_gate + b_gate, x @ w_up + b_up) @ w_down + b_down` on its
    rows (`grouped_matmul` with `implementation`; `w_gate`, `w_up [E, D, F]`, `w_down [E, F, D]`; `glu` defaults
    to `act(gate) · up`; `biases` `(b_gate [E, F], b_up [E, F], b_down [E, D])` or None), scatter back and
    combine with the router weights `top_w [B, T, k]`. With `some_experts`, the weights hold experts
    `first_expert .. first_expert + E - 1` only; pairs routed to other experts contribute zero and cost
    nothing. `down_bias_here=False` leaves `b_down` out (a device holding a slice of `F` whose partial sums
    another device's bias joins)."""
    b, t, d = x.shape
    k, experts = top_i.shape[-1], w_gate.shape[0]
    glu = glu or gated(act)
    rows, order, sizes, local = _expert_rows(x, top_i, experts, first_expert)
    matmul = functools.partial(grouped_matmul, implementation=implementation, skip_unused=some_experts)
    gate, up = matmul(rows, w_gate, sizes), matmul(rows, w_up, sizes)
    if biases is not None:  # each sorted row's expert (rows routed elsewhere: any; they are dropped below)
        row_expert = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows.shape[0]), side="right")
        row_expert = jnp.minimum(row_expert, experts - 1)
        b_gate, b_up, b_down = biases
        gate, up = gate + b_gate[row_expert].astype(gate.dtype), up + b_up[row_expert].astype(up.dtype)
    y = matmul(glu(gate, up), w_down, sizes)  # [N·k, D]
    if biases is not None:  # `down_bias_here` may be traced (which slice of F this device holds)
        y = y + (b_down[row_expert] * down_bias_here).astype(y.dtype)
    y = jnp.zeros_like(y).at[order].set(y)
    if some_experts:  # pairs routed to other devices' experts: no group ran them
        y = jnp.where(local[:, None], y, 0)
    y = y.reshape(b, t, k, d)
    return jnp.einsum("btkd,btk->btd", y, top_w.astype(y.dtype))


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def expert_parallel_mesh(runtime: RuntimeConfig, experts: int):
    """The current mesh (`jax.set_mesh`) when its expert axes hold more than one device and split the
    `experts` evenly, else None (the experts' weights are then gathered where they are used)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    size = math.prod(mesh.shape[a] for a in _axes(runtime.partition_axis.spec(("expert",), "param", mesh=mesh)[0]))
    return mesh if size > 1 and experts % size == 0 else None


def _dividing(spec: P, shape: tuple[int, ...], mesh) -> P:
    """`spec` without the mesh axes that would split a dim unevenly (kept in order while they divide)."""
    out = []
    for entry, n in zip(spec, shape, strict=False):
        keep, size = [], 1
        for a in _axes(entry):
            if n % (size * mesh.shape[a]):
                break
            keep.append(a)
            size *= mesh.shape[a]
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return P(*out)


def expert_parallel_dispatch(
    x, top_i, top_w, w_gate, w_up, w_down, *, act=None, glu=None, biases=None, implementation: str, runtime
):
    """`dispatch_tokens(x, top_i, top_w, w_gate, w_up, w_down, act=, glu=, biases=, implementation=)` with the experts
    split over the current mesh's expert axes (`ep`, as `runtime.partition_axis` maps them), under
    `shard_map`.

    Each device holds `E/ep` experts' weights (their `mlp` dim stays split over `tp`; `fsdp` is
    gathered, as for any layer) and is never sent the others. Tokens move instead: when the batch is
    split over `ep` too (`PartitionAxis(batch_axis=(..., "ep"))`, each expert-parallel device a data
    shard elsewhere) the ep group's tokens are all-gathered, each device runs the pairs routed to its
    experts, and the outputs are reduce-scattered back to the tokens' owners; when the batch is
    replicated over `ep` (the default rules), the tokens are there already and the outputs are summed.
    Dropless, static shapes: the all-gather moves `N·D` per device, where a padded dropless all-to-all
    would move `k·N·D`."""
    mesh = jax.sharding.get_abstract_mesh()
    pa = runtime.partition_axis
    x_spec = _dividing(pa.spec(("batch", "length", None), "activation", mesh=mesh), x.shape, mesh)
    ep = _axes(pa.spec(("expert",), "param", mesh=mesh)[0])
    token_axes = {a for entry in x_spec for a in _axes(entry)}
    mlp = tuple(a for a in _axes(pa.spec(("mlp",), "param", mesh=mesh)[0]) if a not in ep and a not in token_axes)
    moving = tuple(a for a in ep if a in token_axes)  # tokens differ across these expert-parallel devices
    mlp_entry = None if not mlp else mlp[0] if len(mlp) == 1 else mlp
    ep_entry = ep[0] if len(ep) == 1 else ep
    w_in, w_out = P(ep_entry, None, mlp_entry), P(ep_entry, mlp_entry, None)

    summed = tuple(a for a in (*ep, *mlp) if a not in moving)  # partial sums: other experts, mlp slices
    bias_specs = () if biases is None else (P(ep_entry, mlp_entry), P(ep_entry, mlp_entry), P(ep_entry, None))

    def local(x, top_i, top_w, w_gate, w_up, w_down, *local_biases):
        if moving:  # the ep group's tokens, in its devices' order
            x, top_i, top_w = (jax.lax.all_gather(a, moving, axis=0, tiled=True) for a in (x, top_i, top_w))
        if summed:
            # Said explicitly: the tokens are the same on these devices, what each computes from them is
            # not. (Left implicit, jax 0.10 transposes the gather of the rows by expert without summing
            # the tokens' gradient over these devices: measured wrong.)
            x, top_w = (jax.lax.pcast(a, summed, to="varying") for a in (x, top_w))
        index = 0
        for a in ep:  # this device's position along the expert axes (row-major, as the spec splits E)
            index = index * jax.lax.axis_size(a) + jax.lax.axis_index(a)
        first_slice = True  # the down projection's bias joins the partial sums once: on the first slice of F
        for a in mlp:
            first_slice = first_slice & (jax.lax.axis_index(a) == 0)
        out = dispatch_tokens(
            x,
            top_i,
            top_w,
            w_gate,
            w_up,
            w_down,
            act=act,
            glu=glu,
            biases=local_biases or None,
            implementation=implementation,
            first_expert=index * w_gate.shape[0],
            some_experts=True,
            down_bias_here=first_slice,
        )
        if summed:
            out = jax.lax.psum(out, summed)
        if moving:
            out = jax.lax.psum_scatter(out, moving, scatter_dimension=0, tiled=True)
        return out

    return jax.shard_map(
        local,
        in_specs=(x_spec, x_spec, x_spec, w_in, w_in, w_out, *bias_specs),
        out_specs=x_spec,
    )(x, top_i, top_w, w_gate, w_up, w_down, *(biases or ()))
