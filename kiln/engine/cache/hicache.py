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

Disk (`--hicache-storage-backend file`): `hicache_disk.py` (`DiskTier`, which `HiCache` extends).
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from kiln.dist.parallel import SINGLE, ParallelContext
from kiln.engine.cache.allocator import check_owners
from kiln.engine.cache.hicache_config import HiCacheConfig, host_pages_sized, model_identity
from kiln.engine.cache.host_pool import HostPool, device_spaces
from kiln.engine.cache.radix import RadixCache, TreeNode, eviction_size
from kiln.engine.cache.hicache_disk import DiskTier
from kiln.engine.cache.storage import FileStorage, default_storage_dir, model_namespace

logger = logging.getLogger(__name__)

SELECTIVE_THRESHOLD = 2  # matches before write_through_selective copies a node to the host


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


class HiCache(DiskTier):
    """The controller of the host (L2) and disk (L3) tiers: the module docstring says when data
    moves. The disk half lives in `DiskTier` (`hicache_disk.py`)."""

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
