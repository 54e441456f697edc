"""`PageAllocator`: hands out fixed-size pages of token slots.

Page 0 is reserved as a scratch page (padding rows of a CUDA-graph batch write there), so real
pages are 1..num_pages-1. Token slot of (page, offset) = page * page_size + offset.
"""

from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        assert num_pages >= 2, "need at least one page besides the scratch page"
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() gives low ids first
        self._is_free = [False] + [True] * (num_pages - 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Allocatable pages (all but the scratch page)."""
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert 0 < p < self.num_pages and not self._is_free[p], f"double free or bad page {p}"
            self._is_free[p] = True
            self._free.append(p)

    def free_pages(self) -> set[int]:
        return set(self._free)

    def reset(self) -> None:
        self.__init__(self.num_pages, self.page_size)


def check_owners(name: str, allocator: PageAllocator, owned: dict[str, list[int]]) -> None:
    """Assert that every page of `allocator` has exactly one owner: its free list or one entry
    of `owned` (owner name -> pages, e.g. "prefix cache", "request r0")."""
    owners: dict[int, str] = {}

    def own(page: int, who: str) -> None:
        assert page not in owners, f"{name} page {page} owned by both {owners[page]} and {who}"
        owners[page] = who

    for p in allocator.free_pages():
        own(p, "free list")
    for who, pages in owned.items():
        for p in pages:
            own(p, who)
    missing = set(range(1, allocator.num_pages)) - set(owners)
    assert not missing, f"{name} pages leaked (no owner): {sorted(missing)[:10]}"
