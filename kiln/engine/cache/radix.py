"""`RadixCache`: one page-granular radix tree over token ids for every state component.

Every edge holds whole pages: a node's key is a multiple of `page_size` tokens and `pages[i]`
holds tokens `key[i*ps:(i+1)*ps]` in the main page space (the components kept for every token:
full-attention KV, MSA index keys). Windowed components (sliding-window KV, ShortConv inputs) live
in page spaces of their own: `win[name][i]` is that component's page for the same tokens, or None
when it was dropped (a tombstone). A tombstone never breaks a path: the main pages stay, and the
cache manager only ends a match at a boundary where every windowed component still holds the
history it needs (SGLang's UnifiedRadixCache idea).

Ownership: a page belongs to exactly one owner at a time: its allocator's free list, one tree
node, or one running request. Locks: a running request locks the path from its node to the root;
locked main pages are never evicted. Windowed pages are protected more narrowly (only the pages
inside some running request's window, counted by the manager), so a long cached prompt does not
pin its whole sliding-window history.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional

from kiln.engine.cache.allocator import PageAllocator


class TreeNode:
    __slots__ = ("key", "pages", "win", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...] = (), pages: Optional[list[int]] = None,
                 parent: Optional["TreeNode"] = None, win: Optional[dict] = None):
        self.key = key
        self.pages: list[int] = pages or []
        self.win: dict[str, list[Optional[int]]] = win or {}
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: "TreeNode") -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int,
                 win_allocators: Optional[dict[str, PageAllocator]] = None):
        self.allocator = allocator
        self.page_size = page_size
        self.win_allocators = win_allocators or {}
        self._clock = itertools.count(1)
        self.reset()

    # ---- bookkeeping ---------------------------------------------------------------------
    def reset(self) -> None:
        self.root = TreeNode(win={c: [] for c in self.win_allocators})
        self.root.lock_ref = 1  # the root is never evicted
        self.num_pages = 0  # main pages owned by the tree
        self.num_evictable = 0  # of those, pages in nodes with lock_ref == 0

    def _touch(self, node: TreeNode) -> None:
        t = next(self._clock)
        while node is not None:
            node.last_access = t
            node = node.parent

    def _child_key(self, ids, i: int) -> tuple[int, ...]:
        return tuple(ids[i:i + self.page_size])

    # ---- lookup --------------------------------------------------------------------------
    def match_prefix(self, ids: list[int], max_pages: Optional[int] = None) -> tuple[list[int], TreeNode]:
        """Longest cached page-aligned prefix of `ids` (at most `max_pages` pages).

        Returns its main pages and the node where it ends (splitting a node if the match ends
        inside it, so that the returned node can be locked exactly)."""
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
        upper.parent.children[self._child_key(upper.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[m * ps:], node.pages[m:], upper
        node.win = {c: w[m:] for c, w in node.win.items()}
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    # ---- insertion -----------------------------------------------------------------------
    def insert(self, ids: list[int], pages: list[int],
               win: Optional[dict[str, list[Optional[int]]]] = None) -> tuple[list[int], TreeNode]:
        """Cache `pages` (and windowed pages `win[c]`, None allowed) as holding `ids`.

        Where the tree already holds a prefix, its pages win and the caller still owns (and must
        free or hand over) its duplicates. Returns the tree's main pages for the whole key and
        the final node."""
        ps = self.page_size
        assert len(ids) == len(pages) * ps, (len(ids), len(pages))
        win = win or {}
        tree_pages, node = self.match_prefix(ids)
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

    # ---- locks ---------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        while node is not None:
            if node.lock_ref == 0:
                self.num_evictable -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not None:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable += len(node.pages)
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` main pages from unlocked leaves, least recently used first
        (their windowed pages go too). Returns the number freed."""
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            node = heapq.heappop(leaves)
            self.allocator.free(node.pages)
            for c, w in node.win.items():
                self.win_allocators[c].free([p for p in w if p is not None])
            freed += len(node.pages)
            self.num_pages -= len(node.pages)
            self.num_evictable -= len(node.pages)
            parent = node.parent
            del parent.children[self._child_key(node.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

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
        return [p for n in self._nodes() for p in n.pages]

    def win_pages_owned(self, comp: str) -> list[int]:
        return [p for n in self._nodes() for p in n.win.get(comp, []) if p is not None]

    def check(self, expected_locks: dict[int, int]) -> None:
        """Assert the tree's invariants. `expected_locks[id(node)]` = how many running requests
        lock that node."""
        ps = self.page_size
        total = evictable = 0
        for n in self._nodes():
            assert len(n.key) == len(n.pages) * ps, "node key/page length mismatch"
            assert set(n.win) == set(self.win_allocators), "node lacks a windowed component entry"
            for c, w in n.win.items():
                assert len(w) == len(n.pages), f"component {c}: entry count differs from main pages"
            for k, c in n.children.items():
                assert c.parent is n and k == self._child_key(c.key, 0), "broken child link"
                assert len(c.pages) > 0, "empty non-root node"
            own = expected_locks.get(id(n), 0) + (1 if n is self.root else 0)
            assert n.lock_ref == own + sum(c.lock_ref for c in n.children.values()), \
                f"lock_ref {n.lock_ref} != own locks {own} + children's"
            total += len(n.pages)
            if n.lock_ref == 0:
                evictable += len(n.pages)
        assert total == self.num_pages, (total, self.num_pages)
        assert evictable == self.num_evictable, (evictable, self.num_evictable)
