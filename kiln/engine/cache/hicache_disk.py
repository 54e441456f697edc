"""`DiskTier`: the disk (L3) half of `HiCache` (`hicache.py`), under the host pool (L2).

With `--hicache-storage-backend file`, a node's pages are queued once it is on the host and
written once that copy has landed (`_drain_disk`), keyed by chained page hashes (`storage.py`);
windowed data both tiers dropped is read back for the nodes of a match (`refill_windows`).
Under tensor parallelism every rank has its own files and the ranks agree on what the disk
returned (`_agree`). When a request is matched, the pages after its local match
are looked up on disk, read into the host pool as a host-only leaf, then loaded back like any
host hit. Reads are synchronous in this implementation, so `best_effort` behaves like
`wait_complete`: every consecutive page found is read before the request is scheduled;
`timeout` stops reading once PREFETCH_TIMEOUT_BASE_S + PREFETCH_TIMEOUT_PER_PAGE_S x pages has
passed.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from kiln.engine.cache.radix import TreeNode
from kiln.engine.cache.storage import page_hash

PREFETCH_TIMEOUT_BASE_S = 0.2
PREFETCH_TIMEOUT_PER_PAGE_S = 0.002


class DiskTier:
    """The disk methods of `HiCache`, which owns the state they use: the tree, the host pool,
    `storage` (None without a disk tier), the chain's `root_hash`, the tensor-parallel context
    `pc` and the write queue `_disk_queue`; it also uses the host half's `_alloc_host` and `tail`."""

    def hashes(self, node: TreeNode) -> list[str]:
        """The chained page keys of `node` (computed once, for the node and its ancestors)."""
        root, ps = self.tree.root, self.page_size
        if node is root:
            return []
        chain, x = [], node
        while x is not root and x.hashes is None:
            chain.append(x)
            x = x.parent
        h = self.root_hash if x is root else x.hashes[-1]
        for y in reversed(chain):
            keys = []
            for j in range(len(y.pages)):
                h = page_hash(h, y.key[j * ps:(j + 1) * ps])
                keys.append(h)
            y.hashes = keys
        return node.hashes

    def _write_disk(self, node: TreeNode) -> None:
        """Queue a node that reached the host for the disk (written by `_drain_disk`)."""
        if not node.on_disk and node.host is not None:
            self._disk_queue.setdefault(id(node), (node, self.host.generation))

    def _attached(self, node: TreeNode) -> bool:
        return node.parent is not None and node.parent.children.get(self.tree._child_key(node.key, 0)) is node

    def _drain_disk(self, before_generation: Optional[int] = None) -> None:
        """Write queued nodes (those queued before `before_generation`, or all) and their
        ancestors that reached the host but not the disk (e.g. the upper half of a split)."""
        for key, (node, gen) in list(self._disk_queue.items()):
            if before_generation is not None and gen >= before_generation:
                break  # queued in generation order
            del self._disk_queue[key]
            x = node
            while x is not self.tree.root and self._attached(x) and x.host is not None and not x.on_disk:
                self._write_node(x)
                x = x.parent

    def _write_node(self, node: TreeNode) -> None:
        ps = self.page_size
        keys = self.hashes(node)
        todo = [j for j, k in enumerate(keys) if not self.storage.exists(k)]
        main = self.host.read("main", [node.host[j] for j in todo]) if todo else []
        for i, j in enumerate(todo):
            data = {"main": [t[i * ps:(i + 1) * ps] for t in main]}
            for c, w in node.host_win.items():
                if w[j] is not None:
                    data[c] = self.host.read(c, [w[j]])
            self.stats.disk_written_pages += self.storage.put(keys[j], data)
        node.on_disk = all(self.storage.exists(k) for k in keys)  # else retried at the next backup

    def _agree(self, flags: list[bool]) -> list[bool]:
        """True where every tensor-parallel rank has True (one all-reduce; free without TP)."""
        if self.pc.tp_size == 1 or not flags:
            return flags
        import torch.distributed as dist

        t = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.pc.cpu_group or self.pc.tp_group)
        return [bool(x) for x in t.tolist()]

    def _page_fits(self, data: dict) -> bool:
        """A page read from disk has this pool's buffers and shapes (else it is ignored)."""
        for space, tensors in data.items():
            s = self.host.spaces.get(space)
            if s is None or len(tensors) != len(s.tensors):
                return False
            for t, h in zip(tensors, s.tensors):
                if tuple(t.shape) != (self.page_size,) + tuple(h.shape[1:]) or t.dtype != h.dtype:
                    return False
        return "main" in data

    def prefetch(self, ids: list[int], max_pages: int) -> tuple[int, int]:
        """Read the pages of `ids` that follow the tree's match from disk into the host tier (a
        host-only leaf). Returns the page range [first, end) that came from disk."""
        if self.storage is None:
            return 0, 0
        ps = self.page_size
        start_time = time.monotonic()
        pages, node = self.tree.match_prefix(ids, max_pages=max_pages)
        i0 = len(pages)
        limit = min(max_pages, len(ids) // ps)
        if i0 >= limit:
            return i0, i0
        deadline = (start_time + PREFETCH_TIMEOUT_BASE_S + PREFETCH_TIMEOUT_PER_PAGE_S * (limit - i0)
                    if self.cfg.prefetch_policy == "timeout" else float("inf"))
        h = self.root_hash if node is self.tree.root else self.hashes(node)[-1]
        found: list[tuple[str, dict]] = []
        for i in range(i0, limit):
            h = page_hash(h, ids[i * ps:(i + 1) * ps])
            data = self.storage.get(h)
            if data is None or not self._page_fits(data):
                break
            found.append((h, data))
            if time.monotonic() > deadline:
                break
        found = found[:self.pc.min_int(len(found))]  # every rank reads as many pages
        if not found:
            return i0, i0
        self.tree.lock(node)  # host eviction must not remove the node we attach to
        try:
            main = self.host.spaces["main"].allocator
            hp = self._alloc_host("main", len(found)) or main.alloc(min(len(found), main.num_free))
            if not hp:
                return i0, i0
            found = found[:len(hp)]
            n = len(found)
            nbuf = len(self.host.spaces["main"].tensors)
            self.host.write("main", hp, [torch.cat([d["main"][b] for _, d in found]) for b in range(nbuf)])
            host_win: dict[str, list[Optional[int]]] = {}
            has = self._agree([c in d for _, d in found for c in self.histories])  # same on every rank
            for k, c in enumerate(self.histories):
                js = [j for j in range(n) if has[j * len(self.histories) + k]]
                hw = self._alloc_host(c, len(js)) if js else None
                host_win[c] = [None] * n
                if hw:
                    nb = len(self.host.spaces[c].tensors)
                    self.host.write(c, hw, [torch.cat([found[j][1][c][b] for j in js]) for b in range(nb)])
                    for j, p in zip(js, hw):
                        host_win[c][j] = p
            leaf = self.tree.add_host_leaf(node, ids[i0 * ps:(i0 + n) * ps], hp, host_win)
            leaf.hashes = [k for k, _ in found]
            leaf.on_disk = True
            self.stats.disk_read_pages += n
            return i0, i0 + n
        finally:
            self.tree.unlock(node)

    def refill_windows(self, node: TreeNode, from_page: int) -> int:
        """Read back from disk the windowed data that both the device and the host dropped, in
        the tails of the on-disk nodes on the path to `node` that end after page `from_page`
        (the boundaries a match could not use). Returns how many windowed pages came back."""
        if self.storage is None or not self.histories:
            return 0
        nodes, x = [], node
        while x is not self.tree.root:
            nodes.append(x)
            x = x.parent
        # (node, page, component) tails missing on both tiers; the same list on every TP rank
        wanted: list[tuple[TreeNode, int, str]] = []
        end = self.tree.depth(node) + len(node.pages)
        for n in nodes:  # deepest first: the boundaries we most want
            if end <= from_page:
                break
            end -= len(n.pages)
            for c in self.histories:
                wanted += [(n, j, c) for j in self.tail(n, c) if n.win[c][j] is None and n.host_win[c][j] is None]
        if not wanted:
            return 0
        reads: dict[tuple[int, int], Optional[dict]] = {}
        for n, j, _ in wanted:
            if n.on_disk and (id(n), j) not in reads:
                data = self.storage.get(self.hashes(n)[j])
                reads[(id(n), j)] = data if data is not None and self._page_fits(data) else None
                self.stats.disk_read_pages += data is not None
        ok = self._agree([c in (reads.get((id(n), j)) or {}) for n, j, c in wanted])
        refilled = 0
        self.tree.lock(node)  # host window eviction must leave the path alone
        try:
            for (n, j, c), good in zip(wanted, ok):
                hp = self._alloc_host(c, 1, exclude=n) if good else None
                if hp:
                    self.host.write(c, hp, reads[(id(n), j)][c])
                    n.host_win[c][j] = hp[0]
                    refilled += 1
        finally:
            self.tree.unlock(node)
        return refilled

    def weights_changed(self) -> None:
        """The live weights differ from the ones the model identity names (an RL update): from
        now on disk keys chain from a new root, so a server restarted on the original checkpoint
        never reads pages computed with other weights (and vice versa)."""
        self.weights_version += 1
        self.root_hash = page_hash(self.namespace_hash, [self.weights_version])
        self._disk_queue.clear()  # those copies hold KV of the old weights
        for n in self.tree._nodes():
            n.hashes, n.on_disk = None, False
