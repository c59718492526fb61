"""The rollouts' in-process sampler: the policy's current weights on the training mesh, through the static
sampler (`jaxloom.generation.generate`: one batch, rows compacted as they end) or the paged engine
(`generation_backend="paged"`: `LLMEngine`, each completion's cost its own), and the KV cache a rollout holds at
most (`jaxloom plan`). Built from the sampling settings and the callables it reads; testable without a trainer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

PAGE_SIZE = 16
"""Positions a page of the paged rollouts' KV cache holds."""


def routes_shape(config: Any) -> tuple[int, int] | None:
    """`(layers, experts per token)` of an MoE model's `config` (what its sampler records per token), None for a dense
    one."""
    k = getattr(config, "num_experts_per_tok", None)
    return None if not k else (int(config.num_hidden_layers), int(k))


def sampling_devices(n: int, held: Any = frozenset()) -> list:
    """The devices `sampling_devices = n` gives the sampler: of each process's own devices, the first `n / processes`
    that `held` (a training mesh's devices) does not hold — every process samples and trains alike. One error when
    `n` does not split evenly over the processes, leaves a process nothing to train on, or finds too few free."""
    processes = jax.process_count()
    if n % processes:
        raise ValueError(
            f"sampling_devices = {n} over {processes} processes: each process gives the sampler as many of its "
            f"devices; expected a multiple of {processes}"
        )
    per = n // processes
    by_process: dict[int, list] = {}
    for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_process.setdefault(d.process_index, []).append(d)
    least = min(len(own) for own in by_process.values())
    if least <= per:
        raise ValueError(
            f"sampling_devices = {n}: {per} devices of each process sample, and a process has {least}; expected "
            "fewer, so every process trains too"
        )
    free = [[d for d in own if d not in held] for own in by_process.values()]
    if min(map(len, free)) < per:
        raise ValueError(
            f"sampling_devices = {n}: a process has {min(map(len, free))} devices outside the training mesh; expected "
            f"{per} (the training mesh takes the rest)"
        )
    return [d for own in free for d in own[:per]]


def moved(x: jax.Array, sharding: Any) -> jax.Array:
    """`x` laid out as `sharding` says on its devices (another device set: the sampler's own). Each of `sharding`'s
    shards is copied device to device from a device of the same process that holds the same part of `x`; when some
    process holds no such part (several processes, the parts cut otherwise), the array goes through the hosts —
    multi-controller JAX copies between device sets of several hosts only on TPU. The choice is made from the global
    layouts, so every process takes the same path (the gather is a collective)."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    shape = x.shape
    held = {}  # (process, part) -> a device of that process holding it
    for device, index in x.sharding.devices_indices_map(shape).items():
        held.setdefault((device.process_index, _part(index, shape)), device)
    wanted = sharding.devices_indices_map(shape)
    if all((d.process_index, _part(i, shape)) in held for d, i in wanted.items()):
        local = {_part(s.index, shape): s.data for s in x.addressable_shards}
        parts = [jax.device_put(local[_part(wanted[d], shape)], d) for d in sharding.addressable_devices]
        return jax.make_array_from_single_device_arrays(shape, sharding, parts)
    from jax.experimental import multihost_utils

    whole = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.make_array_from_callback(shape, sharding, lambda index: whole[index])


def _part(index: tuple, shape: tuple) -> tuple:
    """A shard's index (slices) as a hashable `((start, stop), ...)`."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


class PagedRollout:
    """A rollout through `LLMEngine` (`generation_backend="paged"`): `group` completions of each row of
    `prompt [U, P]` (`mask`: 1 on its tokens) by `model` (its parameters on `mesh`), decoded as `config` says;
    every completion in a slot of its own, the pool sized for this rollout (a prompt and `max_new_tokens` per
    completion), prompt `i`'s completions sampled with `fold_in(key, i)` (a resumed run samples what the
    uninterrupted one did). With `keep`, each completion keeps its pages for the tool turns (`continue_rows`:
    only a turn's own tokens run) until `close`. An MoE model's experts per token are kept (`routes`, laid out as the
    static sampler's)."""

    def __init__(self, model, prompt, mask, key, group: int, config, mesh, *, keep: bool = False):
        import jaxloom.generation as jg

        if jax.process_count() > 1:
            raise ValueError(
                "generation_backend = 'paged' samples on one process; this run has "
                f"{jax.process_count()} processes: set generation_backend='static'"
            )
        self.prompts = [row[m > 0].tolist() for row, m in zip(prompt, mask, strict=True)]
        self.width = prompt.shape[1]
        self.routes: np.ndarray | None = None
        self.config, self.group, self.keep, self.key = config, group, keep, key
        n, page = config.max_new_tokens, PAGE_SIZE
        pages = 1 + group * sum(-(-(len(p) + n) // page) for p in self.prompts)
        slots = len(self.prompts) * group
        routed = routes_shape(model.config) is not None  # an MoE policy: its experts are recorded
        self.engine = jg.LLMEngine(
            model, config, max_num_seqs=slots, page_size=page, num_pages=pages, mesh=mesh, record_routes=routed
        )

    def completions(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(completion_ids, completion_mask, completion_logps)`, rows `i * group + j`; an MoE model's experts in
        `routes` `[rows, prompt width + max_new_tokens, L, k]` (the prompt right-aligned in its width, as the rows)."""
        engine, n = self.engine, self.config.max_new_tokens
        self.ids = [
            engine.add_request(p, n=self.group, key=jax.random.fold_in(self.key, i), max_new_tokens=n, keep=self.keep)
            for i, p in enumerate(self.prompts)
        ]
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step())
        outs = [c for i in self.ids for c in done[i].outputs]
        completion = np.full((len(outs), n), self.config.pad_token_id, np.int32)
        completion_mask = np.zeros((len(outs), n), np.int32)
        logps = np.zeros((len(outs), n), np.float32)
        for r, c in enumerate(outs):
            k = len(c.token_ids)
            completion[r, :k], completion_mask[r, :k], logps[r, :k] = c.token_ids, 1, c.logprobs
            if c.routes is not None:
                if self.routes is None:
                    self.routes = np.full((len(outs), self.width + n, *c.routes.shape[1:]), -1, np.int16)
                p = len(self.prompts[r // self.group])
                self.routes[r, self.width - p : self.width + k] = c.routes[: p + k]
        return completion, completion_mask, logps

    def continue_rows(self, rows: list[int], histories: list[list[int]], max_completion_length: int):
        """The tool turns of `rows`: each row's kept sequence continues after the part of its history it has not
        run (the tool turn; the rest is in its pages), with what is left of its completion budget. Returns each
        row's new `(tokens, log-probs)`."""
        engine = self.engine
        for row, history in zip(rows, histories, strict=True):
            rid, index = self.ids[row // self.group], row % self.group
            held = engine.sequence_tokens(rid, index)
            if history[: len(held)] != held:
                raise RuntimeError(f"row {row}: its history is not what its pages hold")  # a bug, not input
            completion = len(history) - len(self.prompts[row // self.group])
            engine.extend(rid, history[len(held) :], index=index, max_new_tokens=max_completion_length - completion)
        while engine.has_unfinished_requests():
            engine.step()
        out = []
        for row in rows:
            c = engine.completion(self.ids[row // self.group], row % self.group)
            out.append((c.token_ids, c.logprobs))
        return out

    def close(self) -> None:
        """Free every kept page."""
        if self.keep:
            for rid in self.ids:
                self.engine.release(rid)


class Sampler:
    """Completions of the rollouts' prompts as the `rl` settings say (temperature, top-k/top-p,
    `max_completion_length`, `num_generations`, `generation_backend`), from `model()` (the policy's current
    weights) on `mesh`, ending at `stop_ids()`, padded with `tokenizer()`'s pad id. `keep_pages`: the next paged
    generation keeps each row's pages for its tool turns (`paged.continue_rows`) until `done()`."""

    def __init__(
        self,
        rl: Any,
        model: Callable[[], Any],
        tokenizer: Callable[[], Any],
        stop_ids: Callable[[], tuple[int, ...]],
        mesh: Any,
        mesh_config: Any = None,
    ):
        self.rl, self.model, self.tokenizer, self.stop_ids = rl, model, tokenizer, stop_ids
        self.training_mesh, self.mesh_config = mesh, mesh_config
        self.paged: PagedRollout | None = None  # the paged engine of the rollout under way, its rows' pages kept
        self.routes: np.ndarray | None = None  # an MoE policy's experts per token of the last static generation
        self.keep_pages = False
        self._own_mesh: Any = None

    @property
    def mesh(self) -> Any:
        """Where sampling runs: the training mesh, or with `sampling_devices = n` a mesh of its own over the first
        `n / processes` devices of each process the training mesh does not hold (`sampling_devices`; laid out as
        `mesh_config` says, the training mesh's axes)."""
        n = getattr(self.rl, "sampling_devices", 0)
        if not n:
            return self.training_mesh
        if self._own_mesh is None:
            self._own_mesh = self.mesh_config.build(sampling_devices(n, set(self.training_mesh.devices.flat)))
        return self._own_mesh

    def weights(self, model: Any = None) -> Any:
        """The model to sample: `model` (default `model()`), with `sampling_devices` copied device to device onto
        the sampler's own mesh (each array under its own partition spec; the copy is complete when this returns, so
        the next train step may donate the training state)."""
        model = self.model() if model is None else model
        if not getattr(self.rl, "sampling_devices", 0):
            return model
        from flax import nnx
        from jax.sharding import NamedSharding, PartitionSpec

        mesh = self.mesh
        graph, state = nnx.split(model)

        def put(x: Any) -> Any:
            if not isinstance(x, jax.Array):
                return x
            where = x.sharding
            if isinstance(where, NamedSharding) and where.mesh == mesh:
                return x
            spec = where.spec if isinstance(where, NamedSharding) else PartitionSpec()
            return moved(x, NamedSharding(mesh, spec))

        state = jax.block_until_ready(jax.tree.map(put, state))
        return nnx.merge(graph, state)

    def generate(
        self,
        prompt: np.ndarray,
        mask: np.ndarray,
        key: jax.Array,
        *,
        group: int | None = None,
        max_new_tokens: int | None = None,
        model: Any = None,
        pixel_values: Any = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Generation with the policy's current weights, on the training mesh: `num_generations` (or
        `group`) completions of at most `max_completion_length` (or `max_new_tokens`) tokens of each prompt row (one
        prefill per prompt, its KV cache shared by the group), as `(completion_ids, completion_mask,
        completion_logps)` with rows `i * num_generations + j`. `model`: another state's model to sample (an
        evaluation of a given state), default `model()`. The static sampler records an MoE policy's experts per
        token of `[prompt | completion]` in `routes` (`[rows, P + N, layers, k]`, int16; None otherwise): what the
        training forward replays (`routing_replay`) or measures itself against (`routing/disagreement`).
        `pixel_values`: the prompts' images, in order (a vision-language policy's: the static sampler shows them in
        each prompt's one prefill)."""
        import jaxloom.generation as jg

        rl, tok = self.rl, self.tokenizer()
        config = jg.GenerationConfig(
            max_new_tokens=max_new_tokens or rl.max_completion_length,
            do_sample=rl.temperature > 0,
            temperature=rl.temperature or 1.0,
            top_k=rl.top_k or None,
            top_p=rl.top_p if rl.top_p < 1 else None,
            eos_token_id=self.stop_ids(),
            pad_token_id=tok.pad_token_id or 0,
        )
        model = self.weights(model)
        if getattr(rl, "sampling_devices", 0):  # the key too, from the training state's devices
            from jax.sharding import NamedSharding, PartitionSpec

            key = moved(key, NamedSharding(self.mesh, PartitionSpec()))
        group = rl.num_generations if group is None else group
        self.routes = None
        if getattr(rl, "generation_backend", "static") == "paged" and pixel_values is not None:
            raise ValueError(
                "generation_backend = 'paged' with image prompts: the paged engine reads no images yet; expected "
                "generation_backend = 'static'"
            )
        if getattr(rl, "generation_backend", "static") == "paged":
            self.paged = PagedRollout(model, prompt, mask, key, group, config, self.mesh, keep=self.keep_pages)
            self.keep_pages = False
            out = self.paged.completions()
            self.routes = self.paged.routes
            return out
        routed = routes_shape(model.config) is not None  # an MoE policy: its experts are recorded
        images = {} if pixel_values is None else {"pixel_values": pixel_values}
        out = jg.generate(
            model,
            prompt,
            mask,
            config,
            mesh=self.mesh,
            rng=key,
            num_return_sequences=group,
            record_routes=routed,
            **images,
        )
        self.routes = None if out.routes is None else np.asarray(out.routes)
        return np.asarray(out.completion_ids), np.asarray(out.completion_mask), np.asarray(out.completion_logps)

    def done(self) -> None:
        """The rollout under way is finished: its paged engine and the pages it kept are freed."""
        if self.paged is not None:
            self.paged.close()
            self.paged = None

    def kv_cache_bytes(self, model: Any, *, prompts: int, width: int) -> int:
        """The most one rollout's KV cache holds for `model` (`jaxloom plan`): `prompts × num_generations`
        completions, each `width` positions (the widest row), every layer's keys and values. The paged engine's
        pool is whole pages (`PAGE_SIZE`) and its trash page; the static sampler holds the prompts' prefill beside
        the group's copy of it."""
        from jaxloom.generation.paged import CacheLayout

        per_position, completions = CacheLayout.of(model).page_bytes(1), prompts * self.rl.num_generations
        if getattr(self.rl, "generation_backend", "static") == "paged":
            return (1 + completions * -(-width // PAGE_SIZE)) * PAGE_SIZE * per_position
        return (completions + prompts) * width * per_position
