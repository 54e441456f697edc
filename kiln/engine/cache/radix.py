"""`RadixCache`: one page-granular radix tree over token ids for every state component.

Every edge holds whole pages: a node's key is a multiple of `page_size` tokens and `pages[i]`
holds tokens `key[i*ps:(i+1)*ps]` in the main page space (the components kept for every token:
full-attention KV, MSA index keys). Windowed components (sliding-window KV, ShortConv inputs) live
in page spaces of their own: `win[name][i]` is that component's page for the same tokens, or None
when it was dropped (a tombstone). A tombstone never breaks a path: the main pages stay, and the
cache manager only ends a match at a boundary where every windowed component still holds the
history it needs (SGLang's UnifiedRadixCache idea).

Tiers (HiCache, `hicache.py`): a node's main pages are either all on the device (`pages[i]` ints)
or all evicted (`pages[i] is None`); then the node must hold a host copy (`host`, host page ids),
which it may also hold while on the device. Windowed data has per-page host copies (`host_win`).
Device-resident nodes form a subtree hanging from the root (a node on the device has its parent on
the device), so device eviction takes device leaves and a match that reaches host-only nodes ends
in a run of them that load back in order. Without HiCache every node is on the device.

Ownership: a page belongs to exactly one owner at a time: its allocator's free list, one tree
node, or one running request. Locks: a running request locks the path from its node to the root;
locked nodes are never evicted from any tier. Windowed pages are protected more narrowly (only the
pages inside some running request's window, counted by the manager), so a long cached prompt does
not pin its whole sliding-window history.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional, Protocol

from kiln.engine.cache.allocator import PageAllocator


# Evicting walks the whole prefix tree (`RadixCache.evict` collects every unlocked leaf, then
# pops a heap; `evict_window` and HiCache's host evictions sort every node). Under decode each
# request grows one page at a time, so with a full cache one walk per page cost a step ~5 ms per
# growing request at ~8K cached sequences, and offline generation ran 2-6x slower once the pool
# had filled (docs/serving.md, "Semantics worth knowing"). The cache's users therefore evict at
# least this share of a page space at a time (`eviction_size`), so one walk serves many
# allocations.
EVICT_MIN_SHARE = 1 / 64


def eviction_size(short: int, capacity: int) -> int:
    """Pages to evict when an allocation is `short` pages short in a space of `capacity` pages."""
    return max(short, int(capacity * EVICT_MIN_SHARE))


class TreeNode:
    __slots__ = ("key", "pages", "win", "host", "host_win", "hashes", "on_disk", "hits",
                 "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...] = (), pages: Optional[list] = None,
                 parent: Optional["TreeNode"] = None, win: Optional[dict] = None):
        self.key = key
        self.pages: list[Optional[int]] = pages or []  # device main pages; all None once evicted
        self.win: dict[str, list[Optional[int]]] = win or {}
        # HiCache: host copies (main: all pages or None; windowed: per page), the chained page
        # hashes keying the disk tier (computed when first needed), whether every page is on disk,
        # and how often a match used this node (write_through_selective).
        self.host: Optional[list[int]] = None
        self.host_win: dict[str, list[Optional[int]]] = {c: [None] * len(self.pages) for c in self.win}
        self.hashes: Optional[list[str]] = None
        self.on_disk = False
        self.hits = 0
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0

    @property
    def on_device(self) -> bool:
        return not self.pages or self.pages[0] is not None

    @property
    def num_device_pages(self) -> int:
        return len(self.pages) if self.on_device else 0

    def __lt__(self, other: "TreeNode") -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


class TierHooks(Protocol):
    """What the tree asks of the lower tiers (implemented by `hicache.HiCache`)."""

    def on_evict(self, node: TreeNode) -> bool:
        """Before `node`'s device pages are freed: True if it keeps a host copy (stays in the tree)."""

    def on_window_evict(self, node: TreeNode, comp: str, j: int) -> None:
        """Before windowed page j of `node` is tombstoned on the device."""

    def free_host(self, node: TreeNode) -> None:
        """`node` leaves the tree: give back its host pages."""

    def on_adopt(self, node: TreeNode) -> None:
        """A host-only node took a request's freshly computed pages (`insert`)."""


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int,
                 win_allocators: Optional[dict[str, PageAllocator]] = None):
        self.allocator = allocator
        self.page_size = page_size
        self.win_allocators = win_allocators or {}
        self.tiers: Optional[TierHooks] = None  # set by HiCache
        self._clock = itertools.count(1)
        self.reset()

    # ---- bookkeeping ---------------------------------------------------------------------
    def reset(self) -> None:
        self.root = TreeNode(win={c: [] for c in self.win_allocators})
        self.root.lock_ref = 1  # the root is never evicted
        self.num_pages = 0  # device main pages owned by the tree
        self.num_evictable = 0  # of those, pages in nodes with lock_ref == 0

    def _touch(self, node: TreeNode) -> None:
        t = next(self._clock)
        while node is not None:
            node.last_access = t
            node = node.parent

    def _child_key(self, ids, i: int) -> tuple[int, ...]:
        return tuple(ids[i:i + self.page_size])

    # ---- lookup --------------------------------------------------------------------------
    def match_prefix(self, ids: list[int], max_pages: Optional[int] = None) -> tuple[list, TreeNode]:
        """Longest cached page-aligned prefix of `ids` (at most `max_pages` pages), in any tier.

        Returns its main pages (None for pages only on the host) and the node where it ends
        (splitting a node if the match ends inside it, so that the returned node can be locked
        exactly)."""
        ps = self.page_size
        limit = len(ids) // ps if max_pages is None else min(max_pages, len(ids) // ps)
        node, pages, i = self.root, [], 0  # i counts pages matched
        while i < limit:
            child = node.children.get(self._child_key(ids, i * ps))
            if child is None:
                break
            n = len(child.pages)
            m = 0
            while m < n and i + m < limit and tuple(child.key[m * ps:(m + 1) * ps]) == self._child_key(ids, (i + m) * ps):
                m += 1
            if m < n:
                child = self._split(child, m)
            pages.extend(child.pages)
            node, i = child, i + m
            if m < n:
                break
        self._touch(node)
        return pages, node

    def path(self, node: TreeNode) -> list[tuple[TreeNode, int]]:
        """(node, index) of every page from the root to `node`, in token order."""
        nodes = []
        while node is not None:
            nodes.append(node)
            node = node.parent
        return [(n, j) for n in reversed(nodes) for j in range(len(n.pages))]

    def _split(self, node: TreeNode, m: int) -> TreeNode:
        """Split `node` after its first m pages; returns the new upper node."""
        ps = self.page_size
        upper = TreeNode(node.key[:m * ps], node.pages[:m], node.parent,
                         {c: w[:m] for c, w in node.win.items()})
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.host = None if node.host is None else node.host[:m]
        upper.host_win = {c: w[:m] for c, w in node.host_win.items()}
        upper.hashes = None if node.hashes is None else node.hashes[:m]
        upper.on_disk, upper.hits = node.on_disk, node.hits
        upper.parent.children[self._child_key(upper.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[m * ps:], node.pages[m:], upper
        node.win = {c: w[m:] for c, w in node.win.items()}
        node.host = None if node.host is None else node.host[m:]
        node.host_win = {c: w[m:] for c, w in node.host_win.items()}
        node.hashes = None if node.hashes is None else node.hashes[m:]
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    # ---- insertion -----------------------------------------------------------------------
    def insert(self, ids: list[int], pages: list[int],
               win: Optional[dict[str, list[Optional[int]]]] = None) -> tuple[list[int], TreeNode]:
        """Cache `pages` (and windowed pages `win[c]`, None allowed) as holding `ids`.

        Where the tree already holds a prefix on the device, its pages win and the caller still
        owns (and must free or hand over) its duplicates. Nodes of the prefix that are only on the
        host adopt the caller's pages (they are the same tokens, freshly computed). Returns the
        tree's main pages for the whole key and the final node."""
        ps = self.page_size
        assert len(ids) == len(pages) * ps, (len(ids), len(pages))
        win = win or {}
        tree_pages, node = self.match_prefix(ids)
        for n in self.host_only_run(node):
            start = self.depth(n)
            self.adopt(n, list(pages[start:start + len(n.pages)]),
                       {c: list(win.get(c, [None] * len(pages))[start:start + len(n.pages)])
                        for c in self.win_allocators})
            if self.tiers is not None:
                self.tiers.on_adopt(n)
            tree_pages[start:start + len(n.pages)] = n.pages
        i = len(tree_pages)
        if i < len(pages):
            leaf = TreeNode(tuple(ids[i * ps:]), list(pages[i:]), node,
                            {c: list(win.get(c, [None] * len(pages))[i:]) for c in self.win_allocators})
            node.children[self._child_key(leaf.key, 0)] = leaf
            self.num_pages += len(leaf.pages)
            self.num_evictable += len(leaf.pages)
            tree_pages = tree_pages + leaf.pages
            node = leaf
            self._touch(node)
        return tree_pages, node

    def host_only_run(self, node: TreeNode) -> list[TreeNode]:
        """The host-only nodes at the end of the path to `node`, root side first."""
        run = []
        while node is not self.root and not node.on_device:
            run.append(node)
            node = node.parent
        return list(reversed(run))

    def depth(self, node: TreeNode) -> int:
        """Pages from the root to the start of `node`."""
        d, node = 0, node.parent
        while node is not None:
            d += len(node.pages)
            node = node.parent
        return d

    def adopt(self, node: TreeNode, pages: list[int], win: dict[str, list[Optional[int]]]) -> None:
        """A host-only node takes device pages (loaded back, or computed again) and windowed
        device pages where it has none."""
        assert not node.on_device and node.parent.on_device, "device nodes must hang from the root"
        node.pages = list(pages)
        for c, w in win.items():
            node.win[c] = [mine if mine is not None else theirs for mine, theirs in zip(node.win[c], w)]
        self.num_pages += len(pages)
        if node.lock_ref == 0:
            self.num_evictable += len(pages)

    def add_host_leaf(self, parent: TreeNode, ids: list[int], host: list[int],
                      host_win: dict[str, list[Optional[int]]]) -> TreeNode:
        """A new leaf under `parent` whose data is only on the host (read back from disk)."""
        n = len(host)
        leaf = TreeNode(tuple(ids), [None] * n, parent, {c: [None] * n for c in self.win_allocators})
        leaf.host = list(host)
        leaf.host_win = {c: list(host_win.get(c, [None] * n)) for c in self.win_allocators}
        parent.children[self._child_key(leaf.key, 0)] = leaf
        self._touch(leaf)
        return leaf

    # ---- locks ---------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        while node is not None:
            if node.lock_ref == 0:
                self.num_evictable -= node.num_device_pages
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not None:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable += node.num_device_pages
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------
    def _device_leaf(self, n: TreeNode) -> bool:
        return (n is not self.root and n.on_device and n.lock_ref == 0
                and not any(c.on_device for c in n.children.values()))

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` device main pages from unlocked device leaves, least recently
        used first (their windowed pages go too). A node with a host copy stays in the tree,
        host-only; the others leave it. Returns the number freed."""
        leaves = [n for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            node = heapq.heappop(leaves)
            if not self._device_leaf(node):
                continue
            keep = self.tiers is not None and self.tiers.on_evict(node)
            n = len(node.pages)
            self.allocator.free(node.pages)
            for c, w in node.win.items():
                self.win_allocators[c].free([p for p in w if p is not None])
            freed += n
            self.num_pages -= n
            self.num_evictable -= n
            parent = node.parent
            if keep:
                node.pages = [None] * n
                node.win = {c: [None] * n for c in node.win}
            else:
                self.delete(node)
            if self._device_leaf(parent):
                heapq.heappush(leaves, parent)
        return freed

    def delete(self, node: TreeNode) -> None:
        """Remove a node that holds no device pages any more, with its (host-only) subtree."""
        for child in list(node.children.values()):
            assert not child.on_device and child.lock_ref == 0, "deleting a node under use"
            self.delete(child)
        if self.tiers is not None:
            self.tiers.free_host(node)
        del node.parent.children[self._child_key(node.key, 0)]

    def evict_window(self, comp: str, num_pages: int, protected: dict[int, int]) -> int:
        """Tombstone at least `num_pages` pages of windowed component `comp`, least recently used
        nodes first, skipping pages some running request still reads (`protected[page] > 0`).
        The main pages stay, so paths stay valid."""
        freed = 0
        for node in sorted(self._nodes(), key=lambda n: n.last_access):
            w = node.win.get(comp)
            if not w:
                continue
            drop = [j for j, p in enumerate(w) if p is not None and not protected.get(p)]
            if drop:
                if self.tiers is not None:
                    for j in drop:
                        self.tiers.on_window_evict(node, comp, j)
                self.win_allocators[comp].free([w[j] for j in drop])
                for j in drop:
                    w[j] = None
                freed += len(drop)
            if freed >= num_pages:
                break
        return freed

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    # ---- integrity -----------------------------------------------------------------------
    def pages_owned(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages if p is not None]

    def win_pages_owned(self, comp: str) -> list[int]:
        return [p for n in self._nodes() for p in n.win.get(comp, []) if p is not None]

    def host_pages_owned(self) -> list[int]:
        return [p for n in self._nodes() if n.host is not None for p in n.host]

    def host_win_pages_owned(self, comp: str) -> list[int]:
        return [p for n in self._nodes() for p in n.host_win.get(comp, []) if p is not None]

    def check(self, expected_locks: dict[int, int]) -> None:
        """Assert the tree's invariants. `expected_locks[id(node)]` = how many running requests
        lock that node."""
        ps = self.page_size
        total = evictable = 0
        for n in self._nodes():
            assert len(n.key) == len(n.pages) * ps, "node key/page length mismatch"
            assert set(n.win) == set(self.win_allocators), "node lacks a windowed component entry"
            assert set(n.host_win) == set(self.win_allocators), "node lacks a host windowed entry"
            for c, w in n.win.items():
                assert len(w) == len(n.pages), f"component {c}: entry count differs from main pages"
                assert len(n.host_win[c]) == len(n.pages), f"component {c}: host entry count differs"
                assert n.on_device or all(p is None for p in w), f"{c} pages on a host-only node"
            assert all(p is None for p in n.pages) or all(p is not None for p in n.pages), \
                "a node is partly on the device"
            if n is not self.root:
                assert n.on_device or n.host is not None, "a node lost its data (no device or host copy)"
                assert not n.on_device or n.parent.on_device, "a device node under a host-only node"
                assert n.host is None or len(n.host) == len(n.pages), "host copy length mismatch"
                assert n.hashes is None or len(n.hashes) == len(n.pages), "page hash count mismatch"
            for k, c in n.children.items():
                assert c.parent is n and k == self._child_key(c.key, 0), "broken child link"
                assert len(c.pages) > 0, "empty non-root node"
            own = expected_locks.get(id(n), 0) + (1 if n is self.root else 0)
            assert own == 0 or n.on_device, "a running request locks a node that is not on the device"
            assert n.lock_ref == own + sum(c.lock_ref for c in n.children.values()), \
                f"lock_ref {n.lock_ref} != own locks {own} + children's"
            total += n.num_device_pages
            if n.lock_ref == 0:
                evictable += n.num_device_pages
        assert total == self.num_pages, (total, self.num_pages)
        assert evictable == self.num_evictable, (evictable, self.num_evictable)
