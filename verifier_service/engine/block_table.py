"""One session's pages: position p lives in page `pages[p // P]`, slot `p % P`."""

from __future__ import annotations

from verifier_service.engine.kv_cache import KVCache
from verifier_service.engine.page_pool import PagePool


class BlockTable:
    def __init__(self, pool: PagePool, page_size: int, pages: list[int] | None = None):
        self.pool = pool
        self.page_size = page_size
        self.pages: list[int] = pages or []

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_needed(self, start: int, end: int) -> int:
        """New pages a write of positions [start, end) takes: growth plus copies of shared pages."""
        grow = max(0, self.pages_for(end) - len(self.pages))
        first, last = start // self.page_size, min(self.pages_for(end), len(self.pages))
        return grow + sum(self.pool.is_shared(p) for p in self.pages[first:last])

    def prepare_write(self, start: int, end: int, kv: KVCache) -> None:
        """Make positions [start, end) writable: allocate missing pages, un-share shared ones.
        Callers check `pages_needed` against the pool first, so this cannot fail half-way."""
        first, last = start // self.page_size, min(self.pages_for(end), len(self.pages))
        shared = [i for i in range(first, last) if self.pool.is_shared(self.pages[i])]
        if shared:
            fresh = self.pool.allocate(len(shared))
            kv.copy_pages([self.pages[i] for i in shared], fresh)
            self.pool.release([self.pages[i] for i in shared])
            for i, page in zip(shared, fresh):
                self.pages[i] = page
        grow = self.pages_for(end) - len(self.pages)
        if grow > 0:
            self.pages.extend(self.pool.allocate(grow))

    def truncate(self, num_tokens: int) -> None:
        """Keep only the pages that hold the first `num_tokens` positions."""
        keep = self.pages_for(num_tokens)
        self.pool.release(self.pages[keep:])
        del self.pages[keep:]

    def fork(self) -> BlockTable:
        self.pool.share(self.pages)
        return BlockTable(self.pool, self.page_size, list(self.pages))

    def slot(self, position: int) -> int:
        return self.pages[position // self.page_size] * self.page_size + position % self.page_size

    def release(self) -> None:
        self.truncate(0)
