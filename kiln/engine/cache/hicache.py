"""`HiCache`: host-memory (L2) and disk (L3) tiers under the prefix cache, for every component.

The radix tree (`radix.py`) records where each node's data lives; this module decides when data
moves and moves it (SGLang's HiCache, over typed components: full KV, MSA index keys,
sliding-window KV and ShortConv inputs).

Device -> host, by `--hicache-write-policy`:
- write_through: a node is copied when it is cached (inserted);
- write_through_selective: once matches have used it SELECTIVE_THRESHOLD times;
- write_back: when it is evicted from the device.
A device eviction keeps a node that has a host copy (host-only); other nodes leave the tree. When
the host pool is full, host copies of nodes still on the device are dropped first (no data is
lost), then host-only leaves leave the tree, least recently used first.

Host -> device: a match that reaches host-only nodes gets device pages for them and copies the
data back before the forward that needs it (`CacheManager.match`, `before_forward`).

Windowed components (sliding-window KV, ShortConv inputs) only matter in the window before the
boundary where a request resumes. A node's host copy of windowed data covers the window before
its end (`tail`: chunked prefills and finished requests create nodes whose ends are exactly the
boundaries later requests resume from); pages outside it stay tombstones on the host. A boundary
is valid when every windowed page of its window is on the device or on the host.

Disk (`--hicache-storage-backend file`): a node's pages are queued once it is on the host and
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

import heapq
import logging
import time
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from kiln.dist.parallel import SINGLE, ParallelContext
from kiln.engine.cache.allocator import check_owners
from kiln.engine.cache.hicache_config import HiCacheConfig, host_pages_sized, model_identity
from kiln.engine.cache.host_pool import HostPool, device_spaces
from kiln.engine.cache.radix import RadixCache, TreeNode, eviction_size
from kiln.engine.cache.storage import FileStorage, default_storage_dir, model_namespace, page_hash

logger = logging.getLogger(__name__)

SELECTIVE_THRESHOLD = 2  # matches before write_through_selective copies a node to the host
PREFETCH_TIMEOUT_BASE_S = 0.2
PREFETCH_TIMEOUT_PER_PAGE_S = 0.002


@dataclass
class HiCacheStats:
    """Lower-tier gauges and counters, in pages."""

    host_used_pages: int = 0
    host_total_pages: int = 0
    backed_up_pages: int = 0  # device -> host
    loaded_pages: int = 0  # host -> device
    loaded_window_pages: int = 0  # windowed pages (sliding-window KV, ShortConv inputs), host -> device
    disk_written_pages: int = 0
    disk_read_pages: int = 0


class HiCache:
    def __init__(self, cfg: HiCacheConfig, tree: RadixCache, host: HostPool, histories: dict[str, int],
                 storage: Optional[FileStorage] = None, root_hash: str = "", pc: ParallelContext = SINGLE):
        self.cfg = cfg
        # Tensor parallelism: every rank runs the same scheduler on its own shard, so the tiers
        # must decide alike; only disk reads can differ between ranks (a file one rank lacks,
        # a timeout), and the ranks agree on them (`_agree`, SGLang's all-reduce(min)).
        self.pc = pc
        self.tree = tree
        tree.tiers = self
        self.host = host
        self.histories = histories  # window space -> tokens of history a query reads
        self.storage = storage
        self.root_hash = self.namespace_hash = root_hash or (storage.namespace if storage else "")
        self.weights_version = 0
        self.page_size = tree.page_size
        self.stats = HiCacheStats()
        # Nodes waiting to be written to disk, with the host pool generation of their copy: a
        # write reads the host pages, so it waits until that copy has landed (`before_forward`).
        self._disk_queue: dict[int, tuple[TreeNode, int]] = {}

    # ---- policy hooks (called by the manager and the tree) -----------------------------------
    def _wants_host(self, node: TreeNode) -> bool:
        return self.cfg.write_policy != "write_through_selective" or node.hits >= SELECTIVE_THRESHOLD

    def on_insert(self, node: TreeNode) -> None:
        if self.cfg.write_policy == "write_through":
            self.backup(node)

    def on_hit(self, node: TreeNode) -> None:
        """A request was admitted on the path to `node`."""
        while node is not self.tree.root:
            node.hits += 1
            if self.cfg.write_policy == "write_through_selective" and node.hits >= SELECTIVE_THRESHOLD:
                self.backup(node)
            node = node.parent

    def on_evict(self, node: TreeNode) -> bool:
        if node.host is None and self._wants_host(node):
            self.backup(node)
        return node.host is not None

    def on_window_evict(self, node: TreeNode, comp: str, j: int) -> None:
        # write_back and selective copy on eviction; write_through already copied the tail.
        if node.host_win[comp][j] is None and self._wants_host(node) and j in self.tail(node, comp):
            self._backup_window(node, comp, [j])

    def on_adopt(self, node: TreeNode) -> None:
        # The request computed these tokens again; its values may differ from the host copy in
        # the last bits (other batch shapes), so the host copy is refreshed to keep one version.
        self.host.to_host("main", node.pages, node.host)
        for c, w in node.win.items():
            both = [(d, h) for d, h in zip(w, node.host_win[c]) if d is not None and h is not None]
            self.host.to_host(c, [d for d, _ in both], [h for _, h in both])

    def on_window_refill(self, node: TreeNode, comp: str, j: int) -> None:
        """A request's page refilled a device tombstone: refresh the host copy as in `on_adopt`."""
        if node.host_win[comp][j] is not None:
            self.host.to_host(comp, [node.win[comp][j]], [node.host_win[comp][j]])

    def free_host(self, node: TreeNode) -> None:
        if node.host is not None:
            self.host.spaces["main"].allocator.free(node.host)
            node.host = None
        for c, w in node.host_win.items():
            self.host.spaces[c].allocator.free([p for p in w if p is not None])
            node.host_win[c] = [None] * len(w)

    # ---- device -> host ------------------------------------------------------------------------
    def tail(self, node: TreeNode, comp: str) -> range:
        """Pages of `node` inside the window before its end (what a boundary there needs)."""
        ps, n = self.page_size, len(node.pages)
        start = self.tree.depth(node)
        first = max(0, (start + n) * ps - self.histories[comp]) // ps
        return range(max(first - start, 0), n)

    def backup(self, node: TreeNode) -> bool:
        """Give a device node a host copy (main pages, and its windowed tail) and write it to
        disk. False if the host pool has no room for the main pages."""
        if not node.on_device:
            return node.host is not None
        if node.host is None:
            hp = self._alloc_host("main", len(node.pages))
            if hp is None:
                return False
            self.host.to_host("main", node.pages, hp)
            node.host = hp
            self.stats.backed_up_pages += len(hp)
        for c in node.win:
            self._backup_window(node, c, self.tail(node, c))
        if self.storage is not None:
            self._write_disk(node)
        return True

    def _backup_window(self, node: TreeNode, comp: str, js: Iterable[int]) -> None:
        js = [j for j in js if node.win[comp][j] is not None and node.host_win[comp][j] is None]
        hp = self._alloc_host(comp, len(js), exclude=node) if js else None
        if hp is None:
            return  # no room: those pages stay tombstones on the host
        self.host.to_host(comp, [node.win[comp][j] for j in js], hp)
        for j, h in zip(js, hp):
            node.host_win[comp][j] = h

    # ---- host -> device ------------------------------------------------------------------------
    def load_node(self, node: TreeNode, dev_pages: list[int]) -> None:
        """Copy a host-only node's main data into `dev_pages`; the node is on the device again."""
        self.host.to_device("main", node.host, dev_pages)
        self.tree.adopt(node, dev_pages, {})
        self.stats.loaded_pages += len(dev_pages)

    def load_windows(self, comp: str, items: list[tuple[TreeNode, int, int]]) -> None:
        """Copy host-only windowed pages (node, page index j, device page) of one component back
        to the device in one batch; each node's window entry points at its device page."""
        if not items:
            return
        self.host.to_device(comp, [n.host_win[comp][j] for n, j, _ in items], [d for _, _, d in items])
        for n, j, d in items:
            n.win[comp][j] = d
        self.stats.loaded_window_pages += len(items)

    # ---- host allocation and eviction ----------------------------------------------------------
    def _alloc_host(self, space: str, n: int, exclude: Optional[TreeNode] = None) -> Optional[list[int]]:
        a = self.host.spaces[space].allocator
        if n > a.num_free:  # in batches, as on the device: each eviction walks the whole tree
            if space == "main":
                self.evict_host(eviction_size(n - a.num_free, a.capacity))
            else:
                self.evict_host_window(space, eviction_size(n - a.num_free, a.capacity), exclude)
        return a.alloc(n)

    def _host_leaf(self, n: TreeNode) -> bool:
        return n is not self.tree.root and not n.on_device and not n.children and n.lock_ref == 0

    def evict_host(self, num_pages: int) -> int:
        """Free host main pages; returns how many. Copies of nodes still on the device go first
        (nothing is lost; such a node is copied again if it is evicted from the device later),
        least recently used first; then unlocked host-only leaves leave the tree, LRU first
        (a page also on disk can still be read back from there)."""
        freed = 0
        for node in sorted((n for n in self.tree._nodes() if n.on_device and n.host is not None),
                           key=lambda n: n.last_access):
            if freed >= num_pages:
                return freed
            freed += len(node.host)
            self.host.spaces["main"].allocator.free(node.host)
            node.host = None
        leaves = [n for n in self.tree._nodes() if self._host_leaf(n)]
        heapq.heapify(leaves)
        while freed < num_pages and leaves:
            node = heapq.heappop(leaves)
            if not self._host_leaf(node):
                continue
            freed += len(node.pages)
            parent = node.parent
            self.tree.delete(node)
            if self._host_leaf(parent):
                heapq.heappush(leaves, parent)
        return freed

    def evict_host_window(self, comp: str, num_pages: int, exclude: Optional[TreeNode] = None) -> int:
        """Tombstone host copies of windowed pages in unlocked nodes: first copies of pages still
        on the device, then the others, least recently used nodes first."""
        freed = 0
        order = sorted((n for n in self.tree._nodes() if n is not exclude and n.lock_ref == 0),
                       key=lambda n: n.last_access)
        for redundant_only in (True, False):
            for node in order:
                w, dev = node.host_win.get(comp, []), node.win.get(comp, [])
                drop = [j for j, p in enumerate(w) if p is not None and (dev[j] is not None or not redundant_only)]
                if drop:
                    self.host.spaces[comp].allocator.free([w[j] for j in drop])
                    for j in drop:
                        w[j] = None
                    freed += len(drop)
                if freed >= num_pages:
                    return freed
        return freed

    # ---- disk ------------------------------------------------------------------------------------
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

    # ---- maintenance -----------------------------------------------------------------------------
    def before_forward(self) -> None:
        """Once per step, before its forward: copies from earlier steps land in the host pool
        and their disk writes go out (without waiting for the device); the forward waits for
        this step's load-backs."""
        self.host.before_forward()
        if self.storage is not None:
            self._drain_disk(before_generation=self.host.generation - 2)

    def on_idle(self) -> None:
        """Nothing runs: land every copy and write everything queued for the disk."""
        self.host.finish_pending()
        if self.storage is not None:
            self._drain_disk()

    def close(self) -> None:
        """Engine shutdown: write what is queued for the disk, then unlock the host pool's memory."""
        self.on_idle()
        self.host.close()

    def flush(self) -> None:
        """Empty the host pool and this model's disk pages (the manager resets the tree)."""
        self._disk_queue.clear()
        self.host.reset()
        if self.storage is not None:
            self.storage.clear()

    def snapshot(self) -> HiCacheStats:
        a = self.host.spaces["main"].allocator
        self.stats.host_used_pages = a.capacity - a.num_free
        self.stats.host_total_pages = a.capacity
        return HiCacheStats(**vars(self.stats))

    def check(self, deep: bool = False) -> None:
        """Every host page has one owner; every node on disk has its files; with `deep`, every
        host copy that has landed equals the device data it copies. Changes no state."""
        self.host.wait_device()  # device reads below come after loads still in flight
        tree = self.tree
        check_owners("host main", self.host.spaces["main"].allocator, {"prefix cache": tree.host_pages_owned()})
        for c in self.histories:
            check_owners(f"host {c}", self.host.spaces[c].allocator, {"prefix cache": tree.host_win_pages_owned(c)})
        for n in tree._nodes():
            if self.storage is not None and n.on_disk:
                missing = [k for k in self.hashes(n) if not self.storage.exists(k)]
                assert not missing, f"a node marked on disk lacks {len(missing)} page files"
            if deep and n.on_device and n.host is not None and not self.host.pending("main", n.host):
                self._assert_same("main", n.pages, n.host)
            if deep:
                for c, w in n.win.items():
                    both = [(d, h) for d, h in zip(w, n.host_win[c])
                            if d is not None and h is not None and not self.host.pending(c, [h])]
                    if both:
                        self._assert_same(c, [d for d, _ in both], [h for _, h in both])

    def _assert_same(self, space: str, dev_pages: list[int], host_pages: list[int]) -> None:
        s = self.host.spaces[space]
        didx = self.host._slots(dev_pages, self.host.device)
        hidx = self.host._slots(host_pages, "cpu")
        for h, d in zip(s.tensors, s.device_tensors()):
            assert torch.equal(d.index_select(0, didx).cpu(), h.index_select(0, hidx)), \
                f"host copy of {space} pages {dev_pages[:4]} differs from the device"


def build_hicache(cfg: HiCacheConfig, tree: RadixCache, runner, source, config) -> HiCache:
    """The host pool (sized from the device pools), the optional file storage, and the controller."""
    spaces = device_spaces(runner)
    device_pages = {"main": runner.num_pages, **runner.window_pages}
    histories = dict(runner.window_history)
    chunk = config.max_prefill_tokens if config.chunked_prefill_size <= 0 else \
        min(config.max_prefill_tokens, config.chunked_prefill_size)
    page_bytes = {name: config.page_size * sum(t[0].numel() * t.element_size() for t in get())
                  for name, get in spaces.items()}
    plan = host_pages_sized(cfg, device_pages, histories, config.page_size, chunk, page_bytes)
    host = HostPool(spaces, plan, config.page_size, runner.device, gate=runner.load_gate)
    storage = None
    if cfg.storage_backend == "file":
        identity = model_identity(source, config, runner)
        storage = FileStorage(cfg.storage_dir or default_storage_dir(), model_namespace(identity), identity)
        logger.info("HiCache disk tier: %s (%d pages)", storage.dir, storage.num_pages())
    return HiCache(cfg, tree, host, histories, storage, pc=runner.pc)
