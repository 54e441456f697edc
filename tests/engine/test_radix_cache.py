"""RadixCache and PageAllocator invariants under random operation sequences."""

from __future__ import annotations

import random

import pytest

from kiln.engine.cache.allocator import PageAllocator
from kiln.engine.cache.radix import RadixCache

PS = 4


def test_allocator_all_or_nothing_and_double_free():
    a = PageAllocator(num_pages=5, page_size=PS)
    assert a.capacity == 4 and a.num_free == 4
    assert a.alloc(5) is None and a.num_free == 4
    pages = a.alloc(3)
    assert sorted(pages) == [1, 2, 3] and 0 not in pages  # page 0 is the scratch page
    a.free(pages[:1])
    with pytest.raises(AssertionError):
        a.free(pages[:1])


def test_match_split_and_insert_dedup():
    a = PageAllocator(32, PS)
    t = RadixCache(a, PS)
    ids = list(range(12))
    pages = a.alloc(3)
    tree_pages, node = t.insert(ids, pages)
    assert tree_pages == pages and t.num_pages == 3
    # a match ending inside the node splits it
    got, mid = t.match_prefix(ids[:8] + [99, 98, 97, 96])
    assert got == pages[:2] and mid is not node and node.parent is mid
    # inserting the same prefix again keeps the tree's pages; the caller frees its duplicates
    dup = a.alloc(3)
    tree_pages, _ = t.insert(ids, dup)
    assert tree_pages == pages and t.num_pages == 3
    a.free(dup)
    # a partial page never matches
    got, _ = t.match_prefix(ids[:7])
    assert got == pages[:1]


def test_locked_pages_survive_eviction():
    a = PageAllocator(16, PS)
    t = RadixCache(a, PS)
    p1, n1 = t.insert(list(range(8)), a.alloc(2))
    p2, n2 = t.insert(list(range(100, 108)), a.alloc(2))
    t.lock(n1)
    assert t.num_evictable == 2
    assert t.evict(10) == 2
    assert t.match_prefix(list(range(8)))[0] == p1
    assert t.match_prefix(list(range(100, 108)))[0] == []
    t.unlock(n1)
    assert t.evict(10) == 2 and t.num_pages == 0 and a.num_free == a.capacity


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    a = PageAllocator(64, PS)
    t = RadixCache(a, PS)
    content: dict[int, tuple] = {}  # page -> tokens it holds (tree pages only)
    locks: dict[int, int] = {}
    locked_nodes = []
    vocab = [rng.randrange(3) for _ in range(4)]  # few distinct tokens: lots of shared prefixes
    for _ in range(300):
        owned = set(t.pages_owned())
        for p in [p for p in content if p not in owned]:
            del content[p]  # evicted pages may be reallocated with other tokens
        op = rng.random()
        if op < 0.5:
            n = rng.randint(1, 6)
            ids = [rng.choice(vocab) for _ in range(n * PS)]
            if a.num_free < n:
                continue
            pages = a.alloc(n)
            tree_pages, node = t.insert(ids, pages)
            a.free([p for p, q in zip(pages, tree_pages) if p != q])
            for i, p in enumerate(tree_pages):
                chunk = tuple(ids[i * PS:(i + 1) * PS])
                assert content.setdefault(p, chunk) == chunk, "tree page holds other tokens"
        elif op < 0.7:
            ids = [rng.choice(vocab) for _ in range(rng.randint(1, 24))]
            pages, node = t.match_prefix(ids)
            for i, p in enumerate(pages):
                assert content[p] == tuple(ids[i * PS:(i + 1) * PS])
            if rng.random() < 0.5:
                t.lock(node)
                locked_nodes.append(node)
                locks[id(node)] = locks.get(id(node), 0) + 1
        elif op < 0.85 and locked_nodes:
            node = locked_nodes.pop(rng.randrange(len(locked_nodes)))
            t.unlock(node)
            locks[id(node)] -= 1
        else:
            t.evict(rng.randint(1, 8))
        owned = set(t.pages_owned())
        assert owned.isdisjoint(a.free_pages())
        assert len(owned) + a.num_free == a.capacity
        t.check({k: v for k, v in locks.items() if v})


def test_a_full_cache_evicts_in_batches_not_a_tree_walk_per_page():
    """Growing requests one page at a time against a pool full of cached prefixes: the manager
    evicts at least EVICT_MIN_SHARE of the pool per walk of the tree (one walk per page made a full
    cache's decode steps several times slower), least recently used first, and hands out every page."""
    from kiln.engine.cache import manager as cm
    from kiln.engine.cache.pools import ReqToTokenPool
    from kiln.engine.cache.radix import eviction_size

    a = PageAllocator(1025, PS)  # 1024 usable pages: 16 per eviction
    t = RadixCache(a, PS)
    for i in range(256):  # 256 cached sequences of 4 pages fill the pool
        t.insert([i] * (4 * PS), a.alloc(4))
    assert a.num_free == 0 and t.num_evictable == 1024
    m = cm.CacheManager(a, ReqToTokenPool(4, 64, "cpu"), t)
    walks, real = [], t.evict
    t.evict = lambda n: (walks.append(n), real(n))[1]
    got = [m._alloc(1) for _ in range(64)]
    assert all(p is not None and len(p) == 1 for p in got)
    assert walks == [16] * 4, walks
    assert t.match_prefix([0] * (4 * PS))[0] == [] and len(t.match_prefix([255] * (4 * PS))[0]) == 4
    assert eviction_size(3, 100) == 3 and eviction_size(40, 1024) == 40
