"""Free-list allocator of KV pages with reference counts (forks share pages copy-on-write)."""

from __future__ import annotations

from verifier_service.errors import CapacityError


class PagePool:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free_pages = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.refcount = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self.free_pages)

    def allocate(self, count: int) -> list[int]:
        if not self.can_allocate(count):
            raise CapacityError(f"KV cache full: {count} pages needed, {self.num_free} free of {self.num_pages}")
        pages = [self.free_pages.pop() for _ in range(count)]
        for page in pages:
            self.refcount[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for page in pages:
            self.refcount[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            # NOTE: a page returns to the free list only when its last owner lets go.
            assert self.refcount[page] > 0, f"page {page} released twice"
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                self.free_pages.append(page)

    def is_shared(self, page: int) -> bool:
        return self.refcount[page] > 1
