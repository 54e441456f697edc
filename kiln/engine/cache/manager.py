"""`CacheManager`: the only code that moves pages between allocators, the prefix cache and
requests, for every state component. The scheduler asks it to admit, grow, trim, cache and
release requests; the integrity check proves that every page has exactly one owner.

Page spaces: the main space holds the components kept for every token (full-attention KV, MSA
index keys). Each windowed component (sliding-window KV, ShortConv inputs) has a `WindowSpace`:
its own allocator and request-to-token table, and a `history` = how many tokens before a query
its ops read. A request frees its windowed pages as soon as they fall out of that history, so a
long decode holds at most history + one page of them.

With HiCache (`hicache.py`) the tree's nodes may live on the host or come from disk: `match`
reads the disk pages after the local match into the host tier, then loads every host-only page
the match needs back to the device (whole nodes for the main space, the window before the
boundary for windowed spaces) and records how many tokens each tier served.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from kiln.engine.cache.allocator import PageAllocator, check_owners
from kiln.engine.cache.pools import ReqToTokenPool, write_pages
from kiln.engine.cache.radix import RadixCache, TreeNode, eviction_size
from kiln.engine.request import Req

if TYPE_CHECKING:
    from kiln.engine.cache.hicache import HiCache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class WindowSpace:
    name: str
    allocator: PageAllocator
    table: torch.Tensor  # [max_reqs + 1, max_context] token slots, rows shared with ReqToTokenPool
    history: int  # tokens before a query that its ops read


class CacheManager:
    def __init__(self, allocator: PageAllocator, req_to_token: ReqToTokenPool,
                 tree: Optional[RadixCache], windows: Optional[list[WindowSpace]] = None):
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.tree = tree  # None: prefix caching disabled
        self.page_size = allocator.page_size
        self.windows = {w.name: w for w in (windows or [])}
        # Per windowed component: tree-owned page -> number of running requests reading it.
        self.win_refs: dict[str, Counter] = {c: Counter() for c in self.windows}
        self.hicache: Optional[HiCache] = None  # host and disk tiers, set by EngineCore
        self.deep_check = False  # tests: check_integrity also compares host copies with the device

    # ---- capacity ------------------------------------------------------------------------
    @property
    def available_pages(self) -> int:
        """Main pages obtainable now: free plus evictable."""
        return self.allocator.num_free + (self.tree.num_evictable if self.tree else 0)

    def max_chunk_tokens(self) -> Optional[int]:
        """Largest prefill chunk the window spaces can hold for one request (None: no limit)."""
        caps = [(w.allocator.capacity - 2) * self.page_size - w.history for w in self.windows.values()]
        return max(self.page_size, min(caps)) if caps else None

    def used_tokens(self) -> int:
        return (self.allocator.capacity - self.allocator.num_free) * self.page_size

    def _alloc(self, n: int) -> Optional[list[int]]:
        if n > self.allocator.num_free and self.tree is not None:
            self.tree.evict(eviction_size(n - self.allocator.num_free, self.allocator.capacity))
        return self.allocator.alloc(n)

    def _alloc_win(self, c: str, n: int) -> Optional[list[int]]:
        a = self.windows[c].allocator
        if n > a.num_free and self.tree is not None:
            self.tree.evict_window(c, eviction_size(n - a.num_free, a.capacity), self.win_refs[c])
            if n > a.num_free:  # dropping whole leaves frees windowed pages too
                self.tree.evict(n - a.num_free)
        return a.alloc(n)

    # ---- request lifecycle ---------------------------------------------------------------
    def match(self, req: Req, max_tokens: Optional[int] = None) -> int:
        """Attach the longest cached prefix of the request's tokens that every component can
        serve (leaving at least one token to compute, whose logits we need; at most
        `max_tokens`), loading host-resident data back to the device. Locks it. Returns the
        number of cached tokens; `req.match_tiers` splits them by the tier that served them."""
        assert req.slot == -1 and not req.pages
        req.win_pages = {c: [] for c in self.windows}
        req.win_trimmed = {c: 0 for c in self.windows}
        req.match_tiers = {"device": 0, "host": 0, "disk": 0}
        if self.tree is None:
            return 0
        ids = req.all_ids
        limit = len(ids) - 1 if max_tokens is None else min(len(ids) - 1, max_tokens)
        max_pages = limit // self.page_size
        disk = self.hicache.prefetch(ids, max_pages) if self.hicache is not None else (0, 0)
        on_device = None  # pages already on the device (always a prefix of the path)
        while True:
            pages, node = self.tree.match_prefix(ids, max_pages=max_pages)
            if self.windows and pages:
                valid = self._valid_boundary(self.tree.path(node), len(pages))
                if valid < len(pages) and on_device is None and self.hicache is not None \
                        and self.hicache.refill_windows(node, valid):  # the disk kept windows we lost
                    valid = self._valid_boundary(self.tree.path(node), len(pages))
                if valid < len(pages):
                    pages, node = self.tree.match_prefix(ids, max_pages=valid)
            self.tree.lock(node)
            if on_device is None:
                on_device = sum(p is not None for p in pages)
            usable = self._load_back(node, len(pages))
            if usable == len(pages):
                break
            self.tree.unlock(node)  # not enough device memory: settle for a shorter prefix
            max_pages = usable
        pages = [n.pages[j] for n, j in self.tree.path(node)]
        on_device = min(on_device, len(pages))
        req.cache_node = node
        req.pages = list(pages)
        req.num_cached_pages = len(pages)
        req.num_computed = len(pages) * self.page_size
        from_disk = max(0, min(disk[1], len(pages)) - disk[0])
        req.match_tiers = {"device": on_device * self.page_size,
                            "host": (len(pages) - on_device - from_disk) * self.page_size,
                            "disk": from_disk * self.page_size}
        if self.windows and pages:
            path = self.tree.path(node)
            for c, w in self.windows.items():
                first = self._first_needed_page(req.num_computed, w.history)
                view = [None] * len(pages)
                for i in range(first, len(pages)):
                    n, j = path[i]
                    view[i] = n.win[c][j]
                    assert view[i] is not None, "validated boundary lacks a windowed page"
                    self.win_refs[c][view[i]] += 1
                req.win_pages[c] = view
                req.win_trimmed[c] = first
        return req.num_computed

    def _load_back(self, node: TreeNode, num_pages: int) -> int:
        """Bring the data a match of `num_pages` pages ending at (locked) `node` needs onto the
        device: host-only nodes of the path, and windowed pages before the boundary that only the
        host holds. Returns `num_pages`, or fewer where device memory ran out."""
        if self.hicache is None or num_pages == 0:
            return num_pages
        for n in self.tree.host_only_run(node):
            dev = self._alloc(len(n.pages))
            if dev is None:
                return self.tree.depth(n)
            self.hicache.load_node(n, dev)
        path = self.tree.path(node)
        held: list[tuple[str, int]] = []  # loaded windowed pages, protected while we allocate more
        loads: dict[str, list] = {c: [] for c in self.windows}  # (node, j, device page), copied at once
        try:
            for c, w in self.windows.items():
                for i in range(self._first_needed_page(num_pages * self.page_size, w.history), num_pages):
                    n, j = path[i]
                    if n.win[c][j] is None:
                        page = self._alloc_win(c, 1)
                        if page is None:
                            return num_pages - 1
                        n.win[c][j] = page[0]  # claimed now; its data comes with the batch below
                        loads[c].append((n, j, page[0]))
                    self.win_refs[c][n.win[c][j]] += 1
                    held.append((c, n.win[c][j]))
        finally:
            for c, items in loads.items():  # one copy per component (per-page copies cost ~ms each)
                self.hicache.load_windows(c, items)
            for c, p in held:
                self.win_refs[c][p] -= 1
        return num_pages

    def _first_needed_page(self, num_tokens: int, history: int) -> int:
        return max(0, num_tokens - history) // self.page_size

    def _valid_boundary(self, path, num_pages: int) -> int:
        """Deepest page boundary b <= num_pages where every windowed component holds the pages
        covering its history before b."""
        holes = {}  # per component: holes[i] = tombstones (on the device and the host) in pages [0, i)
        for c in self.windows:
            acc, h = 0, [0]
            for n, j in path[:num_pages]:
                acc += n.win[c][j] is None and n.host_win[c][j] is None
                h.append(acc)
            holes[c] = h
        for b in range(num_pages, 0, -1):
            if all(holes[c][b] == holes[c][self._first_needed_page(b * self.page_size, w.history)]
                   for c, w in self.windows.items()):
                return b
        return 0

    def unmatch(self, req: Req) -> None:
        """Undo `match` for a request that could not be admitted."""
        for c, view in req.win_pages.items():
            for p in view:
                if p is not None:
                    self.win_refs[c][p] -= 1
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node, req.pages, req.num_cached_pages, req.num_computed = None, [], 0, 0
        req.win_pages, req.win_trimmed = {}, {}

    def assign_slot(self, req: Req) -> bool:
        slot = self.req_to_token.alloc()
        if slot is None:
            return False
        req.slot = slot
        self.req_to_token.write_pages(slot, 0, req.pages, self.page_size)
        for c, w in self.windows.items():
            write_pages(w.table, slot, 0, req.win_pages[c], self.page_size)
        if self.hicache is not None and req.cache_node is not None:
            self.hicache.on_hit(req.cache_node)  # admitted: the matched prefix was used
        return True

    def before_forward(self) -> None:
        """Make the forward wait for host -> device copies issued while scheduling."""
        if self.hicache is not None:
            self.hicache.before_forward()

    def on_idle(self) -> None:
        """No request runs or waits: HiCache lands its copies and disk writes still in flight."""
        if self.hicache is not None:
            self.hicache.on_idle()

    def grow(self, req: Req, num_tokens: int, table_writes: Optional[list] = None) -> bool:
        """Make sure pages of every component cover positions [0, num_tokens). False (nothing
        taken) if memory is short even after evicting from the prefix cache.

        `table_writes`: a list that collects the page-table writes instead of making them now
        (`write_pages_batched` applies them, before any forward reads the tables)."""
        need = -(-num_tokens // self.page_size) - len(req.pages)  # cdiv, inline: called per decode per step
        if need <= 0:
            return True
        got: dict[str, list[int]] = {}
        for c in self.windows:
            # pages wholly before the history of the first new token are never needed
            first = self._first_needed_page(req.num_computed, self.windows[c].history)
            skip = max(0, first - len(req.pages))
            new = self._alloc_win(c, need - skip)
            if new is None:
                for c2, pages in got.items():
                    self.windows[c2].allocator.free([p for p in pages if p is not None])
                return False
            got[c] = [None] * skip + new
        new = self._alloc(need)
        if new is None:
            for c, pages in got.items():
                self.windows[c].allocator.free([p for p in pages if p is not None])
            return False
        writes = [(self.req_to_token.table, req.slot, len(req.pages), new)]
        writes += [(self.windows[c].table, req.slot, len(req.pages), pages) for c, pages in got.items()]
        if table_writes is None:
            for table, slot, first, pages in writes:
                write_pages(table, slot, first, pages, self.page_size)
        else:
            table_writes += writes
        for c, pages in got.items():
            req.win_pages[c].extend(pages)
        req.pages.extend(new)
        return True

    def shrink(self, req: Req, num_tokens: int) -> None:
        """Free the pages of every component beyond positions [0, num_tokens) (speculative
        decoding's rejected positions). They are private: the request computed nothing there."""
        keep = cdiv(num_tokens, self.page_size)
        assert keep >= req.num_cached_pages and num_tokens >= req.num_computed, "shrink into computed state"
        self.allocator.free(req.pages[keep:])
        del req.pages[keep:]
        for c in self.windows:
            for i in range(keep, len(req.win_pages[c])):
                self._drop_window_page(req, c, i)
            del req.win_pages[c][keep:]

    def trim(self, req: Req) -> None:
        """Drop windowed pages that fell out of the request's history: private ones are freed,
        cached ones only stop being protected."""
        for c, w in self.windows.items():
            first = self._first_needed_page(req.num_computed, w.history)
            view = req.win_pages[c]
            for i in range(req.win_trimmed[c], min(first, len(view))):
                self._drop_window_page(req, c, i)
            req.win_trimmed[c] = max(req.win_trimmed[c], first)

    def _drop_window_page(self, req: Req, c: str, i: int) -> None:
        """Let go of the request's page i of window space c: a cached page (owned by the tree)
        only stops being protected by this request, a private page is freed."""
        p = req.win_pages[c][i]
        if p is None:
            return
        if i < req.num_cached_pages:
            self.win_refs[c][p] -= 1
        else:
            self.windows[c].allocator.free([p])
        req.win_pages[c][i] = None

    def cache(self, req: Req) -> None:
        """Hand the request's fully computed pages to the prefix cache (keeping them locked for
        the request). Pages the tree already had are swapped for the tree's copies; windowed
        tombstones in the tree are refilled from the request where it still holds the page."""
        if self.tree is None:
            return
        ps = self.page_size
        computed = req.num_computed if req.cache_limit is None else min(req.num_computed, req.cache_limit)
        full = computed // ps
        if full <= req.num_cached_pages:
            return
        ids = req.all_ids[: full * ps]
        win = {c: req.win_pages[c][:full] for c in self.windows}
        tree_pages, node = self.tree.insert(ids, req.pages[:full], win)
        path = self.tree.path(node) if self.windows else None
        for i in range(req.num_cached_pages, full):
            if tree_pages[i] != req.pages[i]:  # the tree already had this page
                self.allocator.free([req.pages[i]])
                req.pages[i] = tree_pages[i]
                self.req_to_token.write_pages(req.slot, i, [tree_pages[i]], ps)
                for c, w in self.windows.items():
                    n, j = path[i]
                    mine, theirs = req.win_pages[c][i], n.win[c][j]
                    if theirs is None:
                        n.win[c][j] = mine  # refill the tombstone (or keep it if we hold none)
                        if mine is not None and self.hicache is not None:
                            self.hicache.on_window_refill(n, c, j)
                    elif mine is not None:
                        w.allocator.free([mine])
                        req.win_pages[c][i] = theirs
                        write_pages(w.table, req.slot, i, [theirs], ps)
            for c in self.windows:
                if req.win_pages[c][i] is not None:  # now tree-owned and still read by us
                    self.win_refs[c][req.win_pages[c][i]] += 1
        self.tree.lock(node)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node = node
        req.num_cached_pages = full
        if self.hicache is not None:
            self.hicache.on_insert(node)

    def release(self, req: Req, cache: bool = True) -> None:
        """Give back everything the request holds: computed full pages go to the prefix cache
        (unlocked, so evictable), the rest to the allocators."""
        if cache and req.slot != -1:
            self.cache(req)
        private = req.pages[req.num_cached_pages:]
        if private:
            self.allocator.free(private)
        for c in self.windows:
            for i in range(len(req.win_pages.get(c, []))):
                self._drop_window_page(req, c, i)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        if req.slot != -1:
            self.req_to_token.free(req.slot)
        req.slot, req.pages, req.num_cached_pages, req.cache_node, req.num_computed = -1, [], 0, None, 0
        req.cache_limit = None
        req.win_pages, req.win_trimmed = {}, {}

    def flush(self) -> None:
        """Drop the whole prefix cache, every tier (only when no request holds pages)."""
        if self.hicache is not None:
            self.hicache.flush()
        if self.tree is not None:
            self.allocator.free(self.tree.pages_owned())
            for c, w in self.windows.items():
                w.allocator.free(self.tree.win_pages_owned(c))
                self.win_refs[c].clear()
            self.tree.reset()

    # ---- integrity -----------------------------------------------------------------------
    def check_integrity(self, running: list[Req]) -> None:
        """Every page of every component is free, in the tree, or private to exactly one running
        request; locks and windowed read counts match the running requests; request rows point
        at their pages; every running request holds the windowed history it needs."""
        self._check_space("main", self.allocator, self.tree.pages_owned() if self.tree else [],
                          {r.rid: r.pages[r.num_cached_pages:] for r in running})
        for c, w in self.windows.items():
            tree_pages = self.tree.win_pages_owned(c) if self.tree else []
            private = {r.rid: [p for p in r.win_pages[c][r.num_cached_pages:] if p is not None] for r in running}
            self._check_space(c, w.allocator, tree_pages, private)
            refs = Counter()
            tree_set = set(tree_pages)
            for r in running:
                view = r.win_pages[c]
                assert len(view) == len(r.pages), f"{r.rid}: {c} view length"
                for i in range(self._first_needed_page(r.num_computed, w.history), len(view)):
                    assert view[i] is not None, f"{r.rid}: {c} page {i} inside the window is missing"
                for p in view[: r.num_cached_pages]:
                    if p is not None:
                        assert p in tree_set, f"{r.rid}: cached {c} page {p} not in the tree"
                        refs[p] += 1
                self._check_row(w.table, r, view)
            assert +self.win_refs[c] == refs, f"{c}: read counts {dict(+self.win_refs[c])} != {dict(refs)}"
        locks: dict[int, int] = {}
        slots = set()
        tree_pages = set(self.tree.pages_owned()) if self.tree else set()
        for r in running:
            assert r.slot not in slots, f"request slot {r.slot} shared"
            slots.add(r.slot)
            for p in r.pages[: r.num_cached_pages]:
                assert p in tree_pages, f"{r.rid}: cached page {p} not in the prefix cache"
            if r.cache_node is not None:
                locks[id(r.cache_node)] = locks.get(id(r.cache_node), 0) + 1
            assert len(r.pages) * self.page_size >= r.num_computed, f"{r.rid}: computed tokens without pages"
            self._check_row(self.req_to_token.table, r, r.pages)
        assert self.req_to_token.num_free + len(slots) == self.req_to_token.max_reqs, "request slot leaked"
        if self.tree is not None:
            self.tree.check(locks)
        if self.hicache is not None:
            self.hicache.check(deep=self.deep_check)

    def _check_space(self, name: str, allocator: PageAllocator, tree_pages: list[int],
                     private: dict[str, list[int]]) -> None:
        check_owners(name, allocator, {"prefix cache": tree_pages,
                                       **{f"request {rid}": pages for rid, pages in private.items()}})

    def _check_row(self, table: torch.Tensor, r: Req, pages: list) -> None:
        ps = self.page_size
        for i, p in enumerate(pages):
            if p is not None and i * ps < table.shape[1]:
                assert int(table[r.slot, i * ps]) == p * ps, f"{r.rid}: request-to-token row stale"
