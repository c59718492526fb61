"""`LLMEngine`: continuous batching over a paged KV cache, for rollouts, evaluation and `jaxloom generate`.

```python
engine = jg.LLMEngine(model, jg.GenerationConfig(do_sample=True, temperature=0.8), max_num_seqs=64)
outs = engine.generate([[1, 5, 9], [1, 7]], max_new_tokens=128, eos_token_id=2, n=4)
outs[0].outputs[3].token_ids, outs[0].outputs[3].logprobs, outs[0].outputs[3].finish_reason
```

The engine keeps `max_num_seqs` decode slots. Each `step()` admits waiting sequences into free slots (their
new tokens run over their cached pages in one batched `extend`; a group's `n` completions share their prompt's
pages and its one prefill), then runs `decode_chunk` decode steps for every slot in one compiled loop, and
hands back the requests that finished. A sequence that ends frees its slot and pages at the next step, so more
requests than slots run with the slots full. When a growing sequence finds no free page, the youngest running
sequence is preempted (its pages freed; it is admitted again later and recomputes its cache): a sample depends
only on (seed, request, position), so a preempted sequence, like one run alone or in another slot, samples
exactly what it would have.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
from typing import Any

import jax
import numpy as np
from flax import nnx

from . import paged
from .config import GenerationConfig
from .decode import bucket
from .pages import PagePool
from .scheduler import Request, Scheduler, Sequence, size_class


@dataclasses.dataclass
class CompletionOutput:
    """One completion (vLLM's names): its `index` among the request's `n`, its `token_ids` (after the prompt, or
    after the last `extend`), the sampler's log-prob of each (`logprobs`, float32 logits over the temperature,
    before top-k/top-p), its `text` when the engine has a tokenizer, and why it ended: `finish_reason` "stop" (an
    end id or stop string, named in `stop_reason`) or "length" (`max_new_tokens`). With the engine's
    `record_routes` and an MoE model, `routes [len(prompt) + len(token_ids), L, k]` (int16): the experts each layer
    sent each token of the sequence to (-1 where none ran: the last token, never fed) — MoE routing replay."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    stop_reason: int | str | None = None
    text: str | None = None
    routes: np.ndarray | None = None


@dataclasses.dataclass
class RequestOutput:
    """A finished request: its `request_id`, `prompt_token_ids` and `outputs` (its `n` completions)."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class LLMEngine:
    """Continuous batching over a paged KV cache (vLLM's `LLMEngine`, in process and compiled).

    Arguments:

    - `model`: a jaxloom causal LM; `config`: its sampling (`do_sample`, `temperature`, `top_k`, `top_p`, `seed`)
      and the defaults of each request's `max_new_tokens`, `eos_token_id`.
    - `max_num_seqs`: decode slots; `decode_chunk`: decode steps per `step()` (ends are noticed between chunks).
    - `page_size`: positions a page holds; `num_pages`: the pool's pages (one is the trash page), else
      `kv_cache_memory` bytes, else a `gpu_memory_utilization` fraction of the device's free memory (on CPU, where
      no free memory is reported: room for every slot at the model's full context, at most 1 GiB).
    - `tokenizer`: decodes `text` and finds `stop` strings.
    - `mesh`: the mesh `model`'s parameters are sharded on (the pool is replicated over it; calls run under it).
    - `record_routes`: an MoE model's experts per token are kept with each sequence (`CompletionOutput.routes`).

    The constructor reads nothing and allocates nothing: the pool is made at the first `step()`."""

    def __init__(
        self,
        model: nnx.Module,
        config: GenerationConfig | None = None,
        *,
        max_num_seqs: int = 64,
        decode_chunk: int = 16,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        tokenizer: Any = None,
        mesh: Any = None,
        record_routes: bool = False,
    ):
        for name, value in (("max_num_seqs", max_num_seqs), ("decode_chunk", decode_chunk), ("page_size", page_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}; expected a positive integer")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization = {gpu_memory_utilization}; expected a fraction in (0, 1]")
        refresh = getattr(model, "cache_refresh_position", None)
        scaling = (getattr(model.config, "rope_scaling", None) or {}).get("rope_type")
        if refresh is not None or scaling == "dynamic":
            raise ValueError(
                f"rope_scaling {scaling!r}: the rotation depends on the whole batch's length, which a continuously "
                "batched engine does not fix; decode this model with jaxloom.generation.generate"
            )
        self.model, self.config, self.tokenizer, self.mesh = model, config or GenerationConfig(), tokenizer, mesh
        self.max_num_seqs, self.decode_chunk, self.page_size = max_num_seqs, decode_chunk, page_size
        self.record_routes = bool(record_routes)
        self.max_model_len = int(model.config.max_position_embeddings)
        self._num_pages, self._memory, self._utilization = num_pages, kv_cache_memory, gpu_memory_utilization
        self.stats: collections.Counter = collections.Counter()
        self.scheduler = Scheduler(max_num_seqs, decode_chunk, page_size, self.max_model_len, self.stats)
        self._pools: list[jax.Array] | None = None
        self._layout: paged.CacheLayout | None = None
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()

    @property
    def pool(self) -> PagePool | None:
        """The page pool (None until the first `step`)."""
        return self.scheduler.pool

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        *,
        max_new_tokens: int | None = None,
        eos_token_id: int | list[int] | None = None,
        stop: str | list[str] | None = None,
        n: int = 1,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        key: jax.Array | None = None,
        request_id: int | None = None,
        keep: bool = False,
    ) -> int:
        """Queue `n` completions of `prompt_token_ids` of at most `max_new_tokens` each (default the config's);
        returns the request id (`request_id`, default the next free number). `eos_token_id` (default the
        config's) and `stop` strings end a completion (the end id kept, the stop string cut from `text`).
        `temperature` (0: greedy), `top_k` (0: off) and `top_p` (1: off) are this request's (default the config's).
        `seed` (default the request id) with the config's seed picks the sampling keys, or `key` (a PRNG key,
        e.g. folded from a training state: a resumed run samples what the uninterrupted one did) gives them.
        With `keep`, a finished completion keeps its pages for `extend` (call `release` when done with it). A
        request that can never fit (its context or the pool) is refused here, before any work."""
        prompt = [int(t) for t in prompt_token_ids]
        request_id = next(self._ids) if request_id is None else int(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id} is already in the engine")
        max_new = self.config.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if not prompt or max_new < 1 or n < 1:
            raise ValueError(
                f"request {request_id}: prompt of {len(prompt)} tokens, max_new_tokens {max_new}, n {n}; "
                "expected a non-empty prompt and positive max_new_tokens and n"
            )
        eos = self.config.eos_ids if eos_token_id is None else tuple(np.atleast_1d(eos_token_id).tolist())
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if stops and self.tokenizer is None:
            raise ValueError(f"request {request_id}: stop strings {stops} need the engine's tokenizer")
        c = self.config
        sampling = (
            (0.0 if c.greedy else c.temperature) if temperature is None else float(temperature),
            (c.top_k or 0) if top_k is None else int(top_k),
            (c.top_p or 1.0) if top_p is None else float(top_p),
        )
        if not (sampling[0] >= 0 and sampling[1] >= 0 and 0 < sampling[2] <= 1):
            raise ValueError(
                f"request {request_id}: temperature {sampling[0]}, top_k {sampling[1]}, top_p {sampling[2]}; "
                "expected temperature >= 0, top_k >= 0 and top_p in (0, 1]"
            )
        req = Request(request_id, prompt, max_new, frozenset(int(e) for e in eos), stops, keep, sampling)
        self.scheduler.check_fits(req, len(prompt) + max_new, n)
        if key is None:
            key = jax.random.fold_in(jax.random.PRNGKey(self.config.seed), request_id if seed is None else seed)
        base = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
        for i in range(n):
            member = np.asarray(jax.random.fold_in(base, i), np.uint32)
            req.sequences.append(Sequence(req, i, member, list(prompt), len(prompt), len(prompt) + max_new))
        self._requests[request_id] = req
        self.scheduler.waiting.extend(req.sequences)
        return request_id

    def extend(self, request_id: int, token_ids: list[int], *, max_new_tokens: int | None = None, index: int = 0):
        """Continue completion `index` of the kept request `request_id`, once it has finished, after `token_ids`
        (a tool's answer): only the last sampled token and `token_ids` run (the history is in its pages), then
        it decodes up to `max_new_tokens` more (default the request's). Its other completions stay as they are
        (each may be continued too); the request's next `RequestOutput` holds each completion's latest turn."""
        req = self._requests.get(request_id)
        seq = req.sequences[index] if req is not None and req.keep and 0 <= index < len(req.sequences) else None
        if req is None or seq is None or seq.finish_reason is None:
            raise ValueError(
                f"request {request_id}, completion {index}: not a finished completion of a request kept with keep=True"
            )
        max_new = req.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        tokens = [*seq.tokens, *(int(t) for t in token_ids)]
        self.scheduler.check_fits(req, len(tokens) + max_new, 1)
        seq.tokens, seq.start, seq.limit = tokens, len(tokens), len(tokens) + max_new
        seq.finish_reason = seq.stop_reason = seq.text = None
        seq.logprobs = []
        self.scheduler.waiting.append(seq)

    def sequence_tokens(self, request_id: int, index: int = 0) -> list[int]:
        """Every token completion `index` of `request_id` holds: its prompt and all its turns so far."""
        return list(self._requests[request_id].sequences[index].tokens)

    def completion(self, request_id: int, index: int = 0) -> CompletionOutput:
        """Completion `index` of `request_id` as it stands (its latest turn)."""
        return self._completion(self._requests[request_id].sequences[index])

    def release(self, request_id: int) -> None:
        """Free the pages of `request_id`, a finished request kept with `keep=True`."""
        req = self._requests.pop(request_id)
        for s in req.sequences:
            self.pool.release(s.pages)
            s.pages = []

    def progress(self, request_id: int) -> list[list[int]]:
        """The tokens each completion of `request_id` has so far (a server streams them)."""
        return [s.tokens[s.start :] for s in self._requests[request_id].sequences]

    def has_unfinished_requests(self) -> bool:
        """Whether any sequence is waiting or running."""
        return self.scheduler.has_unfinished()

    def generate(self, prompts: list[list[int]], **request) -> list[RequestOutput]:
        """Every prompt completed (`request`: `add_request`'s keywords), in the prompts' order."""
        ids = [self.add_request(p, **request) for p in prompts]
        done: dict[int, RequestOutput] = {}
        while self.has_unfinished_requests():
            done.update((o.request_id, o) for o in self.step())
        return [done[i] for i in ids]

    # -- the loop -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit what fits, run one decode chunk, return the requests that finished."""
        self._start()
        self.scheduler.grow()  # the running first: admission takes what is left
        units = self.scheduler.admit()
        finished = self._run_new_tokens(units) if units else []
        running = self.scheduler.running()
        if not running and not units and self.scheduler.waiting:  # nothing runs, nothing fits: it never will
            head = self.scheduler.waiting[0]
            raise RuntimeError(
                f"request {head.request.request_id} waits for pages that finished requests kept with keep=True "
                f"hold ({self.pool.usable - self.pool.free} of {self.pool.usable}); release them or raise num_pages"
            )
        if running:
            finished += self._decode(running)
        return self._outputs(finished)

    def _start(self) -> None:
        if self._pools is not None:
            return
        self._layout = paged.CacheLayout.of(self.model)
        per_page = self._layout.page_bytes(self.page_size)
        pages = self._num_pages
        if pages is None:
            budget = self._memory
            if budget is None:
                stats = jax.local_devices()[0].memory_stats() or {}
                if "bytes_limit" in stats:
                    budget = int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * self._utilization)
                else:
                    need = self.max_num_seqs * -(-self.max_model_len // self.page_size) * per_page
                    budget = min(need, 1 << 30)
            pages = max(2, budget // per_page + 1)
        self.scheduler.pool = PagePool(int(pages), self.page_size)
        self._pools = self._layout.pools(int(pages), self.page_size)
        if self.mesh is not None:  # beside the sharded parameters, whole on every device
            from jax.sharding import NamedSharding, PartitionSpec

            self._pools = jax.device_put(self._pools, NamedSharding(self.mesh, PartitionSpec()))
        self._graphdef, self._state = nnx.split(self.model)
        for req in self._requests.values():
            for s in req.sequences:
                self.scheduler.check_fits(req, s.limit, len(req.sequences))

    def _run_new_tokens(self, units: list[list[Sequence]]) -> list[Sequence]:
        """One batched `extend` over each unit's first sequence; a group's others copy its partial prompt page
        and sample from its logits."""
        sources = [u[0] for u in units]
        rows = bucket(len(sources), 1)
        width = bucket(max(len(s.tokens) - s.cached for s in sources), 8)
        read = self.scheduler.read_pages([s.cached for s in sources]) if any(s.cached for s in sources) else 0
        table, lens, tokens, count, keys = self._rows(sources, rows, width)
        fn = paged.compiled("extend", self._graphdef, self._layout, self.page_size, read, 0, self.record_routes)
        with self._on_mesh():
            token, logp, logits, self._pools, routes = fn(
                self._state, self._pools, table, lens, tokens, count, keys, self._params(sources, rows)
            )
        if self.record_routes and routes is not None:  # each source's new tokens, right-aligned in its row
            routes = np.transpose(np.asarray(routes), (1, 2, 0, 3))  # [B, T, L, k]
            for r, s in enumerate(sources):
                n = int(count[r])
                self._keep_routes(s, s.cached, routes[r, width - n :])
        self.stats["prefill_tokens"] += int(count.sum())
        self.stats["extend_calls"] += 1
        token, logp = np.asarray(token), np.asarray(logp)
        members, src_rows = [], []
        for r, unit in enumerate(units):
            for s in unit[1:]:
                members.append(s)
                src_rows.append(r)
                if unit[0].routes is not None:  # the prompt ran once, for the group
                    self._keep_routes(s, 0, unit[0].routes[: len(s.tokens)])
        copies = [
            (u[0].pages[len(u[0].tokens) // self.page_size], s.pages[len(s.tokens) // self.page_size])
            for u in units
            for s in u[1:]
            if len(s.tokens) % self.page_size
        ]
        if copies:
            src, dst = (np.asarray(x, np.int32) for x in zip(*copies, strict=True))
            with self._on_mesh():
                self._pools = paged.copy_pages(self._pools, src, dst)
        finished = [s for r, s in enumerate(sources) if self._append(s, [int(token[r])], [float(logp[r])])]
        if members:
            keys = np.stack([s.key for s in members])
            where = np.asarray([len(s.tokens) for s in members], np.int32)
            params = self._params(members, len(members))
            with self._on_mesh():
                mt, ml = paged.sample_members(logits, np.asarray(src_rows, np.int32), keys, where, params)
            mt, ml = np.asarray(mt), np.asarray(ml)
            finished += [s for i, s in enumerate(members) if self._append(s, [int(mt[i])], [float(ml[i])])]
        return finished

    def _rows(self, seqs: list[Sequence], rows: int, width: int):
        """The `extend` inputs of `seqs`, padded to `rows` rows and `width` tokens (left-padded)."""
        table = np.zeros((rows, self.scheduler.max_pages), np.int32)
        lens, count = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        tokens, keys = np.zeros((rows, width), np.int32), np.zeros((rows, 2), np.uint32)
        for r, s in enumerate(seqs):
            new = s.tokens[s.cached :]
            table[r, : len(s.pages)] = s.pages
            lens[r], count[r], keys[r] = s.cached, len(new), s.key
            tokens[r, width - len(new) :] = new
        return table, lens, tokens, count, keys

    def _decode(self, running: list[Sequence]) -> list[Sequence]:
        """One decode chunk for the running sequences, packed into the first rows of a batch as wide as their
        count rounded up to a power of two (a slot is only a place to wait for; its cache lives in pages), so a
        chunk's cost follows the sequences still going; returns the sequences that ended in it."""
        k, n = self.decode_chunk, size_class(len(running))
        table = np.zeros((n, self.scheduler.max_pages), np.int32)
        lens, token, limit = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32)
        keys = np.zeros((n, 2), np.uint32)
        for r, s in enumerate(running):
            table[r, : len(s.pages)] = s.pages
            lens[r], token[r], keys[r] = s.cached, s.tokens[-1], s.key
            limit[r] = min(s.cached + k, s.limit)
        read = self.scheduler.read_pages([s.cached for s in running])
        fn = paged.compiled("decode", self._graphdef, self._layout, self.page_size, read, k, self.record_routes)
        with self._on_mesh():
            tokens, logps, self._pools, routes = fn(
                self._state, self._pools, table, lens, token, keys, limit, self._params(running, n)
            )
        tokens, logps = np.asarray(tokens), np.asarray(logps)
        self.stats["decode_chunks"] += 1
        self.stats["decode_row_steps"] += k * n
        fed = [s.cached for s in running]
        ended = [s for r, s in enumerate(running) if self._append(s, tokens[r].tolist(), logps[r].tolist())]
        if self.record_routes and routes is not None:  # the tokens this chunk ran into the pages: fed .. cached - 1
            routes = np.asarray(routes)
            for r, s in enumerate(running):
                self._keep_routes(s, fed[r], routes[r, : s.cached - fed[r]])
        return ended

    @staticmethod
    def _keep_routes(s: Sequence, at: int, routes: np.ndarray) -> None:
        """Keep `routes [n, L, k]`, the experts of `s`'s tokens at positions `at .. at + n - 1`."""
        if s.routes is None or len(s.routes) < s.limit:
            grown = np.full((s.limit, *routes.shape[1:]), -1, np.int16)
            if s.routes is not None:
                grown[: len(s.routes)] = s.routes
            s.routes = grown
        s.routes[at : at + len(routes)] = routes

    @staticmethod
    def _params(seqs: list[Sequence], rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each row's sampling settings `(temperature, top_k, top_p)`, padded to `rows` (greedy)."""
        temperature, top_k, top_p = np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32)
        for r, s in enumerate(seqs):
            temperature[r], top_k[r], top_p[r] = s.request.sampling
        return temperature, top_k, top_p

    def _on_mesh(self):
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _append(self, s: Sequence, tokens: list[int], logps: list[float]) -> bool:
        """Add sampled tokens to `s` up to where it ends; True when it ended (its slot is then freed)."""
        req = s.request
        for t, lp in zip(tokens, logps, strict=True):
            s.tokens.append(t)
            s.logprobs.append(lp)
            self.stats["generated_tokens"] += 1
            if t in req.eos:
                s.finish_reason, s.stop_reason = "stop", t
            elif len(s.tokens) >= s.limit:
                s.finish_reason = "length"
            elif req.stop and self._stopped(s):
                s.finish_reason = "stop"
            if s.finish_reason:
                break
        s.cached = len(s.tokens) - 1  # every token but the last sampled one has been run into the pages
        if not s.finish_reason:
            return False
        if self.tokenizer is not None and s.text is None:
            s.text = self.tokenizer.decode(s.tokens[s.start :], skip_special_tokens=True)
        self.scheduler.finish(s, req.keep)
        return True

    def _stopped(self, s: Sequence) -> bool:
        text = self.tokenizer.decode(s.tokens[s.start :], skip_special_tokens=True)
        for stop in s.request.stop:
            if stop in text:
                s.text, s.stop_reason = text[: text.index(stop)], stop
                return True
        return False

    def _outputs(self, finished: list[Sequence]) -> list[RequestOutput]:
        out = []
        for req in dict.fromkeys(s.request for s in finished):
            if all(s.finish_reason for s in req.sequences):
                if not req.keep:
                    del self._requests[req.request_id]
                outputs = [self._completion(s) for s in req.sequences]
                out.append(RequestOutput(req.request_id, req.prompt, outputs))
        return out

    @staticmethod
    def _completion(s: Sequence) -> CompletionOutput:
        routes = None if s.routes is None else s.routes[: len(s.tokens)].copy()
        return CompletionOutput(
            s.index, s.tokens[s.start :], s.logprobs, s.finish_reason, s.stop_reason, s.text, routes
        )
