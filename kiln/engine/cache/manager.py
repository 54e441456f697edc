"""`CacheManager`: the only code that moves pages between the allocator, the prefix cache and
requests. The scheduler asks it to admit, grow, cache and release requests; the integrity check
proves that every page has exactly one owner.
"""

from __future__ import annotations

from typing import Optional

from kiln.engine.cache.allocator import PageAllocator
from kiln.engine.cache.pools import ReqToTokenPool
from kiln.engine.cache.radix import RadixCache
from kiln.engine.request import Req


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CacheManager:
    def __init__(self, allocator: PageAllocator, req_to_token: ReqToTokenPool,
                 tree: Optional[RadixCache]):
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.tree = tree  # None: prefix caching disabled
        self.page_size = allocator.page_size

    # ---- capacity ------------------------------------------------------------------------
    @property
    def available_pages(self) -> int:
        """Pages obtainable now: free plus evictable."""
        return self.allocator.num_free + (self.tree.num_evictable if self.tree else 0)

    def used_tokens(self) -> int:
        return (self.allocator.capacity - self.allocator.num_free) * self.page_size

    def _alloc(self, n: int) -> Optional[list[int]]:
        if n > self.allocator.num_free and self.tree is not None:
            self.tree.evict(n - self.allocator.num_free)
        return self.allocator.alloc(n)

    # ---- request lifecycle ---------------------------------------------------------------
    def match(self, req: Req, max_tokens: Optional[int] = None) -> int:
        """Attach the longest cached prefix of the request's tokens (leaving at least one token
        to compute, whose logits we need; at most `max_tokens`). Locks it. Returns the number of
        cached tokens."""
        assert req.slot == -1 and not req.pages
        if self.tree is None:
            return 0
        ids = req.all_ids
        limit = len(ids) - 1 if max_tokens is None else min(len(ids) - 1, max_tokens)
        pages, node = self.tree.match_prefix(ids, max_pages=limit // self.page_size)
        self.tree.lock(node)
        req.cache_node = node
        req.pages = list(pages)
        req.num_cached_pages = len(pages)
        req.num_computed = len(pages) * self.page_size
        return req.num_computed

    def unmatch(self, req: Req) -> None:
        """Undo `match` for a request that could not be admitted."""
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node, req.pages, req.num_cached_pages, req.num_computed = None, [], 0, 0

    def assign_slot(self, req: Req) -> bool:
        slot = self.req_to_token.alloc()
        if slot is None:
            return False
        req.slot = slot
        self.req_to_token.write_pages(slot, 0, req.pages, self.page_size)
        return True

    def grow(self, req: Req, num_tokens: int) -> bool:
        """Make sure pages cover positions [0, num_tokens). False (nothing taken) if memory is
        short even after evicting the prefix cache."""
        need = cdiv(num_tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        new = self._alloc(need)
        if new is None:
            return False
        self.req_to_token.write_pages(req.slot, len(req.pages), new, self.page_size)
        req.pages.extend(new)
        return True

    def cache(self, req: Req) -> None:
        """Hand the request's fully computed pages to the prefix cache (keeping them locked for
        the request). Pages the tree already had are swapped for the tree's copies."""
        if self.tree is None:
            return
        ps = self.page_size
        full = req.num_computed // ps
        if full <= req.num_cached_pages:
            return
        ids = req.all_ids[: full * ps]
        tree_pages, node = self.tree.insert(ids, req.pages[:full])
        dup = [i for i in range(req.num_cached_pages, full) if tree_pages[i] != req.pages[i]]
        if dup:
            self.allocator.free([req.pages[i] for i in dup])
            for i in dup:
                req.pages[i] = tree_pages[i]
                self.req_to_token.write_pages(req.slot, i, [tree_pages[i]], ps)
        self.tree.lock(node)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node = node
        req.num_cached_pages = full

    def release(self, req: Req, cache: bool = True) -> None:
        """Give back everything the request holds: computed full pages go to the prefix cache
        (unlocked, so evictable), the rest to the allocator."""
        if cache and req.slot != -1:
            self.cache(req)
        private = req.pages[req.num_cached_pages:]
        if private:
            self.allocator.free(private)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        if req.slot != -1:
            self.req_to_token.free(req.slot)
        req.slot, req.pages, req.num_cached_pages, req.cache_node, req.num_computed = -1, [], 0, None, 0

    def flush(self) -> None:
        """Drop the whole prefix cache (only when no request holds pages)."""
        if self.tree is not None:
            self.allocator.free(self.tree.pages_owned())
            self.tree.reset()

    # ---- integrity -----------------------------------------------------------------------
    def check_integrity(self, running: list[Req]) -> None:
        """Every page is free, in the tree, or private to exactly one running request; locks
        match the running requests; request rows point at their pages."""
        owners: dict[int, str] = {}

        def own(page: int, who: str) -> None:
            assert page not in owners, f"page {page} owned by both {owners[page]} and {who}"
            owners[page] = who

        for p in self.allocator.free_pages():
            own(p, "free list")
        tree_pages = set(self.tree.pages_owned()) if self.tree else set()
        for p in tree_pages:
            own(p, "prefix cache")
        locks: dict[int, int] = {}
        slots = set()
        for r in running:
            assert r.slot not in slots, f"request slot {r.slot} shared"
            slots.add(r.slot)
            for p in r.pages[: r.num_cached_pages]:
                assert p in tree_pages, f"{r.rid}: cached page {p} not in the prefix cache"
            for p in r.pages[r.num_cached_pages:]:
                own(p, f"request {r.rid}")
            if r.cache_node is not None:
                locks[id(r.cache_node)] = locks.get(id(r.cache_node), 0) + 1
            assert len(r.pages) * self.page_size >= r.num_computed, f"{r.rid}: computed tokens without pages"
            if r.pages:
                row = self.req_to_token.table[r.slot, : len(r.pages) * self.page_size: self.page_size]
                row = row[: len(r.pages)].tolist()
                assert row == [p * self.page_size for p in r.pages][: len(row)], f"{r.rid}: req_to_token stale"
        missing = set(range(1, self.allocator.num_pages)) - set(owners)
        assert not missing, f"pages leaked (no owner): {sorted(missing)[:10]}"
        assert self.req_to_token.num_free + len(slots) == self.req_to_token.max_reqs, "request slot leaked"
        if self.tree is not None:
            self.tree.check(locks)
