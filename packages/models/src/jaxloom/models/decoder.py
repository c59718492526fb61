"""The decoder every family builds on, in Flax NNX: `CausalLM` (embedding, a stack of `DecoderLayer`s, unrolled or
scanned, the final norm and output layer), `MLP`, the stack's draw (`stack_layers`, `draw_layers`) and the output
types. A family is a `CausalLM` subclass with its config and the factories it changes (`llama.py`, `qwen3.py`, ...)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import Attention
from .configs import LlamaConfig
from .layers import ACTIVATIONS, Embed, Linear, RMSNorm, constrain, rope_frequencies
from .dropout import dropout_active, dropout_layer
from .runtime import RuntimeConfig

REMAT_POLICIES = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class RouterLoad(NamedTuple):
    """What an MoE layer whose router balances through a bias (DeepSeek-V3's aux-loss-free balancing) returns in
    place of an auxiliary loss: `load [E]`, the real tokens each routed expert took in this call (float32)."""

    load: jax.Array


class Routed(NamedTuple):
    """What a routed feed-forward (MoE) returns beside its output: its `aux` (the balance loss, a `RouterLoad`, or
    None) and `experts [B, T, k]` (int32), the experts each token went to (`CausalLMOutput.routes` stacks them)."""

    aux: Any
    experts: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CausalLMOutput:
    """What a causal LM returns: `logits [B, T, V]`, the MoE `aux_loss` (None for dense models), the
    updated KV `cache` when called with one, and, when called with `return_hidden=True`, the final normed
    `hidden [B, T, D]` in place of the logits (None). `expert_load` maps the index of each layer whose router
    balances through a bias (`RouterLoad`) to the tokens its experts took (None: no such layer). `routes [L, B, T, k]`
    (int32): the experts each layer sent each token to (-1 on a dense layer; None for a dense model), what a sampler
    records and a training forward replays (`routing=`: MoE routing replay)."""

    logits: jax.Array | None  # [B, T, V]
    aux_loss: jax.Array | None = None  # MoE load-balancing loss (unscaled), None for dense models
    cache: Any = None  # per layer (k, v) `[B, S, KV, H]`, or stacked `[L, B, S, KV, H]` when scanned
    hidden: jax.Array | None = None  # [B, T, D], what the output projection reads
    expert_load: dict[int, jax.Array] | None = None  # layer index → `[E]` tokens per routed expert
    routes: jax.Array | None = None  # [L, B, T, k] int32: each MoE layer's chosen experts (-1: a dense layer)


# A full-attention layer's "window" when a scanned stack mixes local and global layers (a traced value): longer
# than any sequence, so `position distance < window` always holds.
NO_WINDOW = 2**30


class MLP(nnx.Module):
    """The gated feed-forward `down(act(gate(x)) · up(x))` (SwiGLU; GeGLU with Gemma's tanh GELU)."""

    def __init__(self, config: LlamaConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        d, f, std, bias = config.hidden_size, config.intermediate_size, config.initializer_range, config.mlp_bias
        self.gate_proj = Linear(d, f, ("embed", "mlp"), runtime, use_bias=bias, std=std, rngs=rngs)
        self.up_proj = Linear(d, f, ("embed", "mlp"), runtime, use_bias=bias, std=std, rngs=rngs)
        self.down_proj = Linear(f, d, ("mlp", "embed"), runtime, use_bias=bias, std=std, rngs=rngs)
        self.act, self.runtime = ACTIVATIONS[config.mlp_activation], runtime

    def __call__(self, x, token_mask=None):
        h = self.act(self.gate_proj(x)) * self.up_proj(x)
        h = constrain(h, ("batch", "length", "mlp"), self.runtime)
        return self.down_proj(h), None


class DecoderLayer(nnx.Module):
    """Attention and feed-forward with residuals; where the norms sit is the family's `block_norms`:
    `pre` (Llama: `input_layernorm` before attention, `post_attention_layernorm` before the MLP),
    `sandwich` (Gemma 2/3: those two around attention, `pre_feedforward_layernorm` and
    `post_feedforward_layernorm` around the MLP) or `post` (OLMo 2: `post_attention_layernorm` and
    `post_feedforward_layernorm` on each branch's output only). The names are transformers'."""

    def __init__(
        self, config: LlamaConfig, runtime: RuntimeConfig, mlp_factory, *, rngs: nnx.Rngs, attention_factory=Attention
    ):
        norm = functools.partial(RMSNorm, config.hidden_size, config.rms_norm_eps, runtime, config.norm_style)
        layout = self.layout = config.block_norms
        self.input_layernorm = norm() if layout in ("pre", "sandwich") else None
        self.self_attn = attention_factory(config, runtime, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if layout == "sandwich" else None
        self.post_feedforward_layernorm = norm() if layout in ("sandwich", "post") else None
        self.mlp = mlp_factory(config, runtime, rngs=rngs)
        self.runtime = runtime

    def __call__(
        self,
        x,
        positions,
        segment_ids,
        token_mask,
        cache=None,
        cache_index=None,
        kv_positions=None,
        kv_segment_ids=None,
        *,
        window=None,
        rope=None,
        routing=None,
        rope_positions=None,
        q_horizon=None,
    ):
        """`window` and `rope` (`(inv_freq, scale)`) are this layer's, given by the model (default: the config's);
        `routing [B, T, k]`: the experts an MoE feed-forward sends each token to (-1: its router chooses);
        `rope_positions`: what turns q and k when not `positions` (multimodal RoPE, `Attention`); `q_horizon`: the
        last position each query sees (`Attention`'s; image tokens that see their whole image)."""
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        turn = {k: v for k, v in (("rope_positions", rope_positions), ("q_horizon", q_horizon)) if v is not None}
        decode = (cache, cache_index, kv_positions, kv_segment_ids)
        attn, cache = self.self_attn(h, positions, segment_ids, *decode, window=window, rope=rope, **turn)
        if self.layout != "pre":
            attn = self.post_attention_layernorm(attn)
        x = x + attn
        if self.layout == "post":
            h = x
        else:
            h = (self.post_attention_layernorm if self.layout == "pre" else self.pre_feedforward_layernorm)(x)
        replay = routing is not None and routed(self.mlp)
        out, aux = self.mlp(h, token_mask, routing) if replay else self.mlp(h, token_mask)
        if self.post_feedforward_layernorm is not None:
            out = self.post_feedforward_layernorm(out)
        x = constrain(x + out, ("batch", "length", "embed"), self.runtime)
        return x, aux, cache


class CausalLM(nnx.Module):
    """Decoder-only causal LM. Parameter names follow HF (`model.layers.N.self_attn.q_proj`), so the
    checkpoint adapter in `hf.py` is a rename plus transposes.

    Call with `input_ids [B, T]` and optionally `attention_mask [B, T]` (1 = token, 0 = padding),
    `positions [B, T]` (default: count of real tokens before each one, so left padding works), and
    `segment_ids [B, T]` for packed rows (ids > 0 per document, 0 = padding; attention never crosses
    documents). Returns `CausalLMOutput`.
    """

    config_class: type[LlamaConfig] = LlamaConfig
    mlp_factory: Any = MLP
    attention_factory: Any = Attention  # the self-attention module (DeepSeek-V3: multi-head latent attention)
    # what a sequence classifier made from this class (`classifier.classifier_class`) changes, read by
    # `from_pretrained`: no output layer; weights a causal LM's files lack (drawn new) and have (left unread)
    has_lm_head: ClassVar[bool] = True
    new_weights: ClassVar[tuple[str, ...]] = ()
    checkpoint_extras: ClassVar[tuple[str, ...]] = ()
    # `(prefix, replacement)`: checkpoint names read as others (Qwen2.5-VL's `model.language_model.` as `model.`)
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, config: LlamaConfig, runtime: RuntimeConfig | None = None, *, rngs: nnx.Rngs):
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}")
        runtime = runtime or RuntimeConfig()
        self.config, self.runtime = config, runtime
        self.logit_softcap = config.final_softcap  # read by the fused loss as well
        self.model = nnx.Module()
        self.model.embed_tokens = Embed(
            config.vocab_size, config.hidden_size, runtime, std=config.initializer_range, rngs=rngs
        )
        n = config.num_hidden_layers
        factories = [self.mlp_factory_for(config, i) for i in range(n)]
        uniform = len(set(factories)) == 1
        if not uniform and runtime.scan_layers:
            raise ValueError(
                f"{type(self).__name__}: scan_layers=True, but this model's layers differ in structure (dense and "
                "sparse feed-forward layers: mlp_only_layers / decoder_sparse_step), and a scan runs one layer "
                "shape; expected scan_layers=False or None (auto: unrolled)"
            )
        self.scanned = runtime.scans(n) and uniform
        attention = type(self).attention_factory
        if self.scanned:
            self.model.layers = stack_layers(
                lambda r: DecoderLayer(config, runtime, factories[0], rngs=r, attention_factory=attention), n, rngs
            )
        else:
            layers = (
                draw_layers(
                    lambda r: DecoderLayer(config, runtime, factories[0], rngs=r, attention_factory=attention), n, rngs
                )
                if uniform
                else [DecoderLayer(config, runtime, f, rngs=rngs, attention_factory=attention) for f in factories]
            )
            self.model.layers = nnx.List(layers)
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, runtime, config.norm_style)
        self.lm_head = (
            None
            if config.tie_word_embeddings or not self.has_lm_head
            else Linear(
                config.hidden_size,
                config.vocab_size,
                ("embed", "vocab"),
                runtime,
                std=config.initializer_range,
                rngs=rngs,
            )
        )
        if self.lm_head is not None:
            self.lm_head.fp8 = "none"  # FP8 training leaves the output layer in the compute dtype (torchtitan's too)

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        positions=None,
        segment_ids=None,
        *,
        cache=None,
        cache_index=None,
        kv_positions=None,
        kv_segment_ids=None,
        return_hidden: bool = False,
        routing=None,
        inputs_embeds=None,
        rope_positions=None,
        q_horizon=None,
    ) -> CausalLMOutput:
        """Decoding: pass `cache` (from `init_cache`), the write offset `cache_index`, and the cache's
        `kv_positions` / `kv_segment_ids` `[B, S]` already holding this call's tokens (segment 0 = empty).
        `return_hidden=True` stops before the output projection: the output holds `hidden`, not `logits`
        (for a loss that applies `output_projection()` itself, e.g. `linear_cross_entropy`). `routing [L, B, T, k]`
        (int): MoE routing replay, each layer's experts for each token as a sampler recorded them (`routes`); -1
        where the router chooses (a token never recorded, a dense layer). The chosen experts' weights still come
        from this router's scores, so it keeps its gradient. `inputs_embeds [B, T, D]`: the input vectors in place of
        `embed(input_ids)` (a vision-language model's, image features among the tokens'); `rope_positions` (`[B, T]`,
        or `[B, T, head_dim / 2]`: a position per rotated pair) turn q and k in place of `positions`, which then only
        order the tokens (multimodal RoPE); `q_horizon [B, T]`: the last position each token sees, at or past its
        own (default: its own; Gemma 3's image tokens see their whole image both ways), windows still counted back
        from its position."""
        b, t = input_ids.shape
        segment_ids = default_segments((b, t), attention_mask, segment_ids)
        token_mask = segment_ids != 0
        positions = default_positions((b, t), attention_mask, positions, segment_ids)
        c = self.config
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        x = constrain(x, ("batch", "length", "embed"), self.runtime)
        decode = dict(cache_index=cache_index, kv_positions=kv_positions, kv_segment_ids=kv_segment_ids)
        kinds = c.attention_types()
        tables = {
            kind: rope_frequencies(
                c.head_dim or 0, *c.rope_of(kind), c.max_position_embeddings, seq_len=t, positions=positions
            )
            for kind in dict.fromkeys(kinds)
        }
        tables = {  # a NoPE layer (SmolLM3): zero frequencies, so cos 1 and sin 0 rotate nothing, exactly
            kind: table if c.uses_rope(kind) else (jnp.zeros_like(table[0]), table[1]) for kind, table in tables.items()
        }

        turn = {k: v for k, v in (("rope_positions", rope_positions), ("q_horizon", q_horizon)) if v is not None}

        def run(layer, x, layer_cache, routes, window, rope):
            return layer(
                x,
                positions,
                segment_ids,
                token_mask,
                layer_cache,
                **decode,
                window=window,
                rope=rope,
                routing=routes,
                **turn,
            )

        def with_pattern(kind):  # a layer's static window and its RoPE tables bound (remat takes positional args)
            window, rope = c.window_of(kind), tables[kind]
            return lambda layer, x, layer_cache, routes: run(layer, x, layer_cache, routes, window, rope)

        remat = self.runtime.remat != "none" and cache is None
        loads: dict[int, jax.Array] = {}
        if self.scanned:
            if len(tables) == 1:  # one attention pattern: the window stays static (every backend takes it)
                x, aux_total, new_cache, routes = self._scan(with_pattern(kinds[0]), x, cache, remat, None, routing)
            else:  # local and global layers in one scan: each layer's window and RoPE tables are scanned data
                per_layer = (
                    jnp.asarray([c.window_of(k) or NO_WINDOW for k in kinds], jnp.int32),
                    (
                        jnp.stack([tables[k][0] for k in kinds]),
                        jnp.stack([jnp.asarray(tables[k][1], jnp.float32) for k in kinds]),
                    ),
                )
                x, aux_total, new_cache, routes = self._scan(run, x, cache, remat, per_layer, routing)
            if isinstance(aux_total, RouterLoad):
                loads = dict(enumerate(aux_total.load))
                aux_total = None
        else:
            aux_total, new_cache, chosen = None, [], []
            for i, layer in enumerate(self.model.layers):
                step = with_pattern(kinds[i])
                if remat:
                    step = nnx.remat(step, policy=REMAT_POLICIES[self.runtime.remat], prevent_cse=True)
                x, aux, layer_cache = step(
                    layer, x, None if cache is None else cache[i], None if routing is None else routing[i]
                )
                new_cache.append(layer_cache)
                aux, experts = (aux.aux, aux.experts) if isinstance(aux, Routed) else (aux, None)
                chosen.append(experts)
                if isinstance(aux, RouterLoad):
                    loads[i] = aux.load
                elif aux is not None:
                    aux_total = aux if aux_total is None else aux_total + aux
            routes = stack_routes(chosen)
        x = self.model.norm(x)
        if aux_total is not None:
            aux_total = aux_total / self.config.num_hidden_layers
        new_cache = new_cache if cache is not None else None
        if return_hidden:
            return CausalLMOutput(
                logits=None, aux_loss=aux_total, cache=new_cache, hidden=x, expert_load=loads or None, routes=routes
            )
        logits = self.model.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        if self.logit_softcap is not None:  # Gemma 2: cap · tanh(logits / cap)
            logits = self.logit_softcap * jnp.tanh(logits / self.logit_softcap)
        logits = constrain(logits, ("batch", "length", "vocab"), self.runtime)
        return CausalLMOutput(
            logits=logits, aux_loss=aux_total, cache=new_cache, expert_load=loads or None, routes=routes
        )

    def embed(self, input_ids: jax.Array) -> jax.Array:
        """The input vectors of `input_ids [B, T]`: the embedding rows, times the family's `embedding_multiplier`
        (Gemma: `sqrt(hidden_size)`, rounded to the weights' dtype first, as transformers does)."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier is not None:
            x = x * jnp.asarray(self.config.embedding_multiplier, self.runtime.param_dtype).astype(x.dtype)
        return x

    @property
    def cache_refresh_position(self) -> int | None:
        """For LongRoPE (Phi-3 128k), `original_max_position_embeddings`: past it every key rotates with the long
        factors, so a decoder re-runs the sequence into a fresh KV cache once when it gets there (as
        transformers does); None for every other model."""
        s = self.config.rope_scaling
        return int(s["original_max_position_embeddings"]) if s and s.get("rope_type") == "longrope" else None

    def mlp_factory_for(self, config: LlamaConfig, layer: int) -> Any:
        """The feed-forward module class of decoder layer `layer` under `config` (the class's `mlp_factory`
        for every layer; Qwen3-MoE mixes dense and sparse layers)."""
        del config, layer
        return type(self).mlp_factory

    def output_projection(self) -> tuple[jax.Array, Any, Any]:
        """`(kernel [D, V], dtype, precision)`: the output layer as `logits = hidden @ kernel` computed in
        `dtype` at `precision` (the tied embedding, transposed, when `tie_word_embeddings`). A model whose
        logits are soft-capped (Gemma 2) says so in `logit_softcap`."""
        if self.lm_head is None:
            e = self.model.embed_tokens
            return e.embedding[...].T, e.dtype, e.precision
        return self.lm_head.kernel[...], self.lm_head.dtype, self.lm_head.precision

    def _scan(self, run, x, cache, remat: bool, per_layer, routing=None):
        """The stacked layers as one `lax.scan`: the body is one layer, traced once whatever the depth; each
        step slices that layer's parameters (and cache) off the leading axis. `runtime.unroll` layers run per
        iteration (all of them by default on CPU and GPU: straight-line code, the speed of unrolled layers; 1:
        compiled once whatever the depth). With remat, the body is checkpointed, so the backward keeps only
        each layer's input (and what the policy saves)."""
        graphdef, stacked = nnx.split(self.model.layers)

        def layer_fn(layer_state, x, layer_cache, layer_data, routes):
            if layer_data is None:
                return run(nnx.merge(graphdef, layer_state), x, layer_cache, routes)
            window, rope = layer_data
            return run(nnx.merge(graphdef, layer_state), x, layer_cache, routes, window, rope)

        unroll = self.runtime.unroll(self.config.num_hidden_layers)  # the stack's layout is the same for any
        if remat:  # a rolled loop keeps the recomputation apart; unrolled copies need the barrier, as unrolled layers
            policy = REMAT_POLICIES[self.runtime.remat]
            layer_fn = jax.checkpoint(layer_fn, policy=policy, prevent_cse=unroll > 1)

        def body(x, xs):
            layer_state, layer_cache, layer_data, index, routes = xs
            with dropout_layer(index):  # LoRA dropout (training only): each layer its own mask
                x, aux, layer_cache = layer_fn(layer_state, x, layer_cache, layer_data, routes)
            return x, (aux, layer_cache)

        index = jnp.arange(self.config.num_hidden_layers) if dropout_active() else None
        x, (aux, new_cache) = jax.lax.scan(body, x, (stacked, cache, per_layer, index, routing), unroll=unroll)
        routes = None
        if isinstance(aux, Routed):  # `[L, B, T, k]`: each layer's experts
            aux, routes = aux.aux, aux.experts
        if isinstance(aux, RouterLoad):  # `[L, E]`: each layer's loads
            return x, aux, new_cache, routes
        return x, None if aux is None else jnp.sum(aux), new_cache, routes

    def init_cache(self, batch_size: int, max_length: int, dtype=None) -> Any:
        """Zeroed key/value buffers in the compute dtype: a list of per-layer `(k, v)` `[B, S, KV, H]`, or
        for a scanned stack one `(k, v)` pair stacked `[L, B, S, KV, H]`."""
        keys = (batch_size, max_length, *self.config.kv_cache_dims)
        values = (batch_size, max_length, *self.config.value_cache_dims)
        dtype = dtype or self.runtime.dtype
        if self.scanned:
            layers = self.config.num_hidden_layers
            return jnp.zeros((layers, *keys), dtype), jnp.zeros((layers, *values), dtype)
        return [(jnp.zeros(keys, dtype), jnp.zeros(values, dtype)) for _ in range(self.config.num_hidden_layers)]


def routed(module: nnx.Module) -> bool:
    """Whether a feed-forward module routes tokens to experts (its class sets `ROUTED`): it takes `routing` and
    returns `Routed`."""
    return bool(getattr(type(module), "ROUTED", False))


def stack_routes(chosen: list) -> jax.Array | None:
    """Each layer's `[B, T, k]` experts (None: a dense layer) as `[L, B, T, k]`, -1 on the dense layers; None when
    no layer routes."""
    some = next((r for r in chosen if r is not None), None)
    if some is None:
        return None
    return jnp.stack([jnp.full_like(some, -1) if r is None else r for r in chosen])


def stack_layers(make_layer, n: int, rngs: nnx.Rngs) -> nnx.Module:
    """One layer module whose every variable carries a leading axis of `n` layers (logical name None:
    never sharded), each layer initialised from its own key. `CausalLM` scans over that axis."""
    keys = jax.random.split(rngs.params(), n)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: make_layer(nnx.Rngs(0))))
    states = jax.vmap(lambda key: nnx.state(make_layer(nnx.Rngs(params=key))))(keys)

    def add_layer_axis(v):
        axes = v.get_metadata().get("logical_axes")
        return v.replace(logical_axes=(None, *axes)) if axes is not None else v

    states = jax.tree_util.tree_map(add_layer_axis, states, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, states)


def draw_layers(make_layer, n: int, rngs: nnx.Rngs) -> list[nnx.Module]:
    """`n` layers of one structure drawn from the `params` stream as `n` calls of `make_layer(rngs)` in a row
    draw them (layer i's keys take the stream's counts where layer i-1's ended; under `jit`, as `create_model`
    and the trainer draw, bitwise the same values), but traced twice, not `n` times: layer 0 alone, which shows
    how many keys a layer takes, then layers 1..n-1 as one `lax.map` (one layer's random numbers live at a time).
    An 8-layer model's initial state compiles in half the time (docs/performance.md, "Time to the first step")."""
    stream = rngs.params
    before = stream.count[...]
    first = make_layer(rngs)
    if n <= 2:  # a loop of one layer would compile more than it saves
        return [first, *(make_layer(rngs) for _ in range(n - 1))]
    after = stream.count[...]
    per_layer, key = after - before, stream.key[...]

    def draw(count):
        own = nnx.Rngs(params=key)
        own.params.count[...] = count
        return nnx.state(make_layer(own))

    states = jax.lax.map(draw, after + per_layer * jnp.arange(n - 1, dtype=after.dtype))
    stream.count[...] = after + per_layer * (n - 1)
    graphdef = nnx.graphdef(first)
    return [first, *(nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], states)) for i in range(n - 1))]


def merge_features(embeds: jax.Array, is_image: jax.Array, features: jax.Array) -> jax.Array:
    """`embeds [B, T, D]` with the rows where `is_image [B, T]` replaced by `features` in order: `[n, D]`, the whole
    batch's row by row (transformers' `masked_scatter`), or `[B, n, D]`, each row's own (a training batch's rows,
    each with its image slots; the slots a row leaves unused are never read)."""
    b, t, d = embeds.shape
    if features.ndim == 3:
        index = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, max(features.shape[1] - 1, 0))
        rows = jnp.take_along_axis(features, index[..., None], axis=1).astype(embeds.dtype)
        return jnp.where(is_image[..., None], rows, embeds)
    index = jnp.clip(jnp.cumsum(is_image.reshape(-1)) - 1, 0, max(features.shape[0] - 1, 0))
    rows = features[index].reshape(b, t, d).astype(embeds.dtype)
    return jnp.where(is_image[..., None], rows, embeds)


def default_segments(shape: tuple[int, int], attention_mask=None, segment_ids=None) -> jax.Array:
    """A `[B, T]` call's `segment_ids` as `CausalLM` takes them: given, or `attention_mask` (1 = token), or all ones."""
    if segment_ids is not None:
        return segment_ids
    return jnp.ones(shape, jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)


def default_positions(shape: tuple[int, int], attention_mask=None, positions=None, segment_ids=None) -> jax.Array:
    """A `[B, T]` call's `positions` as `CausalLM` takes them: given, or the count of real tokens before each one
    (so left padding works)."""
    if positions is not None:
        return positions
    token_mask = default_segments(shape, attention_mask, segment_ids) != 0
    return jnp.maximum(jnp.cumsum(token_mask, axis=-1) - 1, 0)
