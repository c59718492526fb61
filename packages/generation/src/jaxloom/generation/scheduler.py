"""Which sequences run: the decode slots, the queue waiting for them and the pages each one holds."""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np

from .pages import PagePool


@dataclasses.dataclass(eq=False)
class Request:
    request_id: int
    prompt: list[int]
    max_new_tokens: int
    eos: frozenset[int]
    stop: tuple[str, ...]
    keep: bool
    sampling: tuple[float, int, float]  # temperature (0: greedy), top_k (0: off), top_p (1: off)
    sequences: list[Sequence] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Sequence:
    request: Request
    index: int
    key: np.ndarray  # uint32[2]: fold_in(fold_in(PRNGKey(seed), request seed), index)
    tokens: list[int]
    start: int  # where this turn's completion begins in `tokens`
    limit: int  # the most tokens the sequence may hold this turn
    pages: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0  # positions written in `pages`
    slot: int = -1
    admitted: int = 0
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None
    routes: np.ndarray | None = None  # [limit, L, k] int16: an MoE model's experts per position (-1: not run)

    @property
    def fresh_member(self) -> bool:
        """Not started and one of several completions of its prompt: admitted with its group."""
        return self.cached == 0 and len(self.tokens) == len(self.request.prompt) and len(self.request.sequences) > 1


def size_class(n: int) -> int:
    """`n` rounded up to the next of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and their halfway points):
    a decode chunk's width and read length, each compiled once, never more than a third above what is used."""
    n = max(int(n), 1)
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if power >= 4 and n <= power * 3 // 4 else power


class Scheduler:
    """The slots (`max_num_seqs`), the waiting queue and the page `pool` of an `LLMEngine`: what to admit
    (first come first served, a group's completions together), the pages each running sequence needs for its
    next `decode_chunk` steps, and whom to preempt when they run out (the youngest). `stats` counts preemptions.
    The pool is attached when the engine first steps; until then only the context and the slots are checked."""

    def __init__(self, max_num_seqs: int, decode_chunk: int, page_size: int, max_model_len: int, stats):
        self.max_num_seqs, self.decode_chunk, self.page_size = max_num_seqs, decode_chunk, page_size
        self.max_model_len, self.stats = max_model_len, stats
        self.pool: PagePool | None = None
        self.max_pages = -(-max_model_len // page_size)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.slots: list[Sequence | None] = [None] * max_num_seqs
        self._admissions = itertools.count()

    def running(self) -> list[Sequence]:
        """The sequences in slots, in slot order."""
        return [s for s in self.slots if s is not None]

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def finish(self, s: Sequence, keep: bool) -> None:
        """`s` ended: free its slot, and its pages — all of them, or with `keep` those past what is cached."""
        self.slots[s.slot], s.slot = None, -1
        held = self.pool.pages_for(s.cached) if keep else 0
        self.pool.release(s.pages[held:])
        s.pages = s.pages[:held]

    def check_fits(self, req: Request, total: int, n: int) -> None:
        """Refuse a sequence of `total` tokens (`n` of them admitted together) that could never run."""
        if total > self.max_model_len:
            raise ValueError(
                f"request {req.request_id}: {total} tokens (prompt {len(req.prompt)} + max_new_tokens "
                f"{req.max_new_tokens}) exceed the model's context of {self.max_model_len}"
            )
        if n > self.max_num_seqs:
            raise ValueError(f"request {req.request_id}: n = {n} completions exceed max_num_seqs {self.max_num_seqs}")
        if self.pool is not None:  # one sequence at its longest alone; a group's admission together
            shared = len(req.prompt) // self.page_size if n > 1 else 0
            start = self.pool.pages_for(min(len(req.prompt) + self.decode_chunk, total))
            need = max(self.pool.pages_for(total), shared + n * (start - shared))
            if need > self.pool.usable:
                raise ValueError(
                    f"request {req.request_id}: {total} tokens (n = {n}) need {need} pages of {self.page_size}; "
                    f"the KV cache pool has {self.pool.usable} ({self.pool.usable * self.page_size} tokens). "
                    "Raise num_pages or kv_cache_memory, or shorten the request"
                )

    def admit(self) -> list[list[Sequence]]:
        """Move waiting sequences into free slots, first come first served, while their pages fit; returns them
        in units (a fresh group's completions together: one prefill)."""
        units: list[list[Sequence]] = []
        free = [i for i, s in enumerate(self.slots) if s is None]
        while self.waiting and free:
            head = self.waiting[0]
            unit = [head]
            if head.fresh_member:
                unit = [s for s in self.waiting if s.request is head.request and s.fresh_member]
            if len(unit) > len(free) or not self.allocate(unit):
                break
            for s in unit:
                self.waiting.remove(s)
                s.slot, s.admitted = free.pop(0), next(self._admissions)
                self.slots[s.slot] = s
            units.append(unit)
        return units

    def allocate(self, unit: list[Sequence]) -> bool:
        """Pages for `unit`'s tokens and one decode chunk: a group shares its prompt's full pages. False (nothing
        taken) when they do not fit now."""
        first = unit[0]
        target = min(len(first.tokens) + self.decode_chunk, first.limit)
        have = len(first.pages)
        if len(unit) == 1:
            need = self.pool.pages_for(target) - have
            if need > self.pool.free:
                return False
            first.pages += self.pool.take(need)
            return True
        shared = len(first.tokens) // self.page_size
        own = self.pool.pages_for(target) - shared
        if shared + own * len(unit) > self.pool.free:
            return False
        common = self.pool.take(shared)
        for i, s in enumerate(unit):
            s.pages = (common if i == 0 else self.pool.share(common)) + self.pool.take(own)
        return True

    def grow(self) -> None:
        """Pages for each running sequence's next chunk; the youngest are preempted when the pool runs out."""
        for s in sorted(self.running(), key=lambda s: s.admitted):
            if s.slot < 0:  # preempted below for an older sequence
                continue
            need = self.pool.pages_for(min(s.cached + self.decode_chunk, s.limit)) - len(s.pages)
            while need > self.pool.free:
                victim = max((v for v in self.slots if v is not None), key=lambda v: v.admitted)
                self.preempt(victim)
                if victim is s:
                    break
            if s.slot >= 0 and need > 0:
                s.pages += self.pool.take(need)

    def preempt(self, s: Sequence) -> None:
        """Free `s`'s pages and slot; it waits at the head of the queue and recomputes its cache when admitted."""
        self.pool.release(s.pages)
        s.pages, s.cached = [], 0
        self.slots[s.slot], s.slot = None, -1
        self.waiting.appendleft(s)
        self.stats["preemptions"] += 1

    def read_pages(self, cached: list[int]) -> int:
        """The pages a call reads per row: the longest row's, rounded up to a `size_class` (one compile per
        size), at most a sequence's whole table."""
        return min(size_class(max(self.pool.pages_for(c) for c in cached)), self.max_pages)
