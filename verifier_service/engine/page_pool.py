"""Free-list allocator of KV pages with reference counts (forks share pages copy-on-write), and the pages a
prefix cache keeps: released but still indexed, they count as free and are reused least recently released first."""

from __future__ import annotations

from collections import OrderedDict

from verifier_service.engine.prefix_cache import PrefixCache
from verifier_service.errors import CapacityError


class PagePool:
    def __init__(self, num_pages: int, prefix_cache: PrefixCache | None = None):
        self.num_pages = num_pages
        self.free_pages = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.refcount = [0] * num_pages
        self.prefix_cache = prefix_cache
        self.evictable: OrderedDict[int, None] = OrderedDict()  # indexed pages nobody holds, oldest first

    @property
    def num_free(self) -> int:
        return len(self.free_pages) + len(self.evictable)

    def can_allocate(self, count: int) -> bool:
        return count <= self.num_free

    def allocate(self, count: int) -> list[int]:
        if not self.can_allocate(count):
            raise CapacityError(f"KV cache full: {count} pages needed, {self.num_free} free of {self.num_pages}")
        pages = [self._free_page() for _ in range(count)]
        for page in pages:
            self.refcount[page] = 1
        return pages

    def _free_page(self) -> int:
        if self.free_pages:
            return self.free_pages.pop()
        page, _ = self.evictable.popitem(last=False)
        self.prefix_cache.forget(page)
        return page

    def share(self, pages: list[int]) -> None:
        for page in pages:
            self.refcount[page] += 1

    def take(self, pages: list[int]) -> None:
        """Hold pages a prefix cache matched: those nobody held leave the evictable list."""
        for page in pages:
            self.evictable.pop(page, None)
        self.share(pages)

    def release(self, pages: list[int]) -> None:
        for page in pages:
            # NOTE: a page returns to the free list only when its last owner lets go.
            assert self.refcount[page] > 0, f"page {page} released twice"
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                if self.prefix_cache is not None and self.prefix_cache.holds(page):
                    self.evictable[page] = None
                else:
                    self.free_pages.append(page)

    def is_shared(self, page: int) -> bool:
        return self.refcount[page] > 1
