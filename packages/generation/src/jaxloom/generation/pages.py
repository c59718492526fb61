"""The host side of the paged KV cache: which pages are free and who holds each one."""

from __future__ import annotations

import heapq

from .paged import TRASH_PAGE


class PagePool:
    """`num_pages` pages of `page_size` positions; page 0 is the trash page and never handed out. A page can be
    held by several sequences (a group's shared prompt pages) and returns to the free list when the last lets
    go. Pages are handed out lowest first, so a run's page assignment (and so its memory layout) repeats."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages = {num_pages}; expected at least 2 (page 0 is the trash page)")
        self.num_pages, self.page_size = num_pages, page_size
        self.refs = [0] * num_pages
        self._free = [p for p in range(num_pages) if p != TRASH_PAGE]
        heapq.heapify(self._free)

    @property
    def usable(self) -> int:
        """The pages a sequence may ever hold (all but the trash page)."""
        return self.num_pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    def pages_for(self, positions: int) -> int:
        """How many pages `positions` positions fill."""
        return -(-positions // self.page_size)

    def take(self, n: int) -> list[int]:
        """`n` free pages, now held once each."""
        if n > len(self._free):
            raise RuntimeError(f"{n} pages asked, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> list[int]:
        """`pages` held once more (a group member's view of its prompt's full pages)."""
        for p in pages:
            self.refs[p] += 1
        return list(pages)

    def release(self, pages: list[int]) -> None:
        """Let go of `pages`; each returns to the free list when nobody holds it."""
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                heapq.heappush(self._free, p)
            elif self.refs[p] < 0:
                raise RuntimeError(f"page {p} released more often than it was taken")
