"""`RadixCache`: a page-granular radix tree over token ids that owns cached KV pages.

Every edge holds whole pages: a node's key is a multiple of `page_size` tokens and `pages[i]`
holds tokens `key[i*ps:(i+1)*ps]`. A page belongs to exactly one owner at a time: the allocator's
free list, one tree node, or one running request (its private, not-yet-cached pages).

Locks: a running request that reuses a cached prefix locks the path from its node to the root
(`lock`); locked pages are never evicted. Unlocked leaves are evicted in LRU order.

A page id addresses every per-token state component at once (one page holds `page_size` tokens of
all of them), so the tree stores pages, not per-component values; components whose state is not
per-token (ShortConv, sliding windows) attach to nodes in the hybrid-model work (DESIGN.md §4).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional

from kiln.engine.cache.allocator import PageAllocator


class TreeNode:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...] = (), pages: Optional[list[int]] = None,
                 parent: Optional["TreeNode"] = None):
        self.key = key
        self.pages: list[int] = pages or []
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: "TreeNode") -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self._clock = itertools.count(1)
        self.reset()

    # ---- bookkeeping ---------------------------------------------------------------------
    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self.num_pages = 0  # pages owned by the tree
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

        Returns its pages and the node where it ends (splitting a node if the match ends inside
        it, so that the returned node can be locked exactly)."""
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

    def _split(self, node: TreeNode, m: int) -> TreeNode:
        """Split `node` after its first m pages; returns the new upper node."""
        ps = self.page_size
        upper = TreeNode(node.key[:m * ps], node.pages[:m], node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.parent.children[self._child_key(upper.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[m * ps:], node.pages[m:], upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    # ---- insertion -----------------------------------------------------------------------
    def insert(self, ids: list[int], pages: list[int]) -> tuple[list[int], TreeNode]:
        """Cache `pages` as holding `ids` (len(ids) == len(pages) * page_size).

        Where the tree already holds a prefix, its pages win and the caller still owns (and must
        free) its duplicates. Returns the tree's pages for the whole key and the final node."""
        ps = self.page_size
        assert len(ids) == len(pages) * ps, (len(ids), len(pages))
        tree_pages, node = self.match_prefix(ids)
        i = len(tree_pages)
        if i < len(pages):
            leaf = TreeNode(tuple(ids[i * ps:]), list(pages[i:]), node)
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
        """Free at least `num_pages` pages from unlocked leaves, least recently used first.
        Returns the number freed (less if not enough are evictable)."""
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            node = heapq.heappop(leaves)
            self.allocator.free(node.pages)
            freed += len(node.pages)
            self.num_pages -= len(node.pages)
            self.num_evictable -= len(node.pages)
            parent = node.parent
            del parent.children[self._child_key(node.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
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

    def check(self, expected_locks: dict[int, int]) -> None:
        """Assert the tree's invariants. `expected_locks[id(node)]` = how many running requests
        lock that node."""
        ps = self.page_size
        total = evictable = 0
        for n in self._nodes():
            assert len(n.key) == len(n.pages) * ps, "node key/page length mismatch"
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
