"""`HostPool`: HiCache's host-memory tier (L2), one host space per device page space.

A host space mirrors its device space buffer for buffer (same per-token shapes and dtypes, e.g.
every layer's K and V of the main space, or every ShortConv site of the "conv" space) with its own
`PageAllocator`, so host page h holds token slots [h * page_size, (h + 1) * page_size) of every
buffer. Copies move whole pages between the tiers.

Device -> host copies land in the host pool later (`finish_pending` waits for them before
anything on the host reads or overwrites those pages). On CUDA the host buffers are page-locked
and both directions run on one side stream, straight between the device pages and the pool: a
device -> host copy gathers the pages on the device and DMAs each run of consecutive host pages
into the pool; a host -> device copy DMAs the runs into a device buffer and scatters it. Because
both directions share the stream, a load-back of a page whose backup is still in flight reads
it after it lands, with no host wait. With a `LayerGate` the forward waits for each buffer's
copies right before the layer that uses it (layer-wise overlap of load-back and forward);
without one it waits for all of them (`before_forward`). The side stream first waits for the
work already queued on the compute stream, so a backup always reads fully computed pages. On CPU
a backup is staged and scattered into the pool at `finish_pending`, so the tests exercise the
same ordering.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kiln.engine.cache.allocator import PageAllocator
from kiln.engine.cache.layer_gate import LayerGate

logger = logging.getLogger(__name__)

# Device tensors of one page space, read at call time: RL memory release swaps the pool tensors.
DeviceTensors = Callable[[], list[torch.Tensor]]


def device_spaces(runner) -> dict[str, DeviceTensors]:
    """The device buffers of each page space of a `ModelRunner` (main, and "swa" / "conv" when
    the model has them), in a fixed order shared with the host spaces."""
    def space(*pools):
        return lambda: [t for p in pools if p is not None for t in p.tensors()]

    spaces = {"main": space(runner.full_kv, runner.index_k, getattr(runner, "draft_kv", None))}
    if runner.swa_kv is not None:
        spaces["swa"] = space(runner.swa_kv)
    if runner.conv is not None:
        spaces["conv"] = space(runner.conv)
    return spaces


@dataclass
class HostSpace:
    name: str
    allocator: PageAllocator
    tensors: list[torch.Tensor]  # host buffers, [num_pages * page_size, *shape] each
    device_tensors: DeviceTensors



@dataclass
class _PendingCopy:
    """A device -> host copy of some pages of one space that has not landed in the host pool:
    on CUDA it has once `done` fires (`staged` is None: the DMA writes the pool directly); on CPU
    `staged[i]` still has to go to `host[i][index]`."""

    space: str
    pages: frozenset
    generation: int  # HostPool.generation when issued (one per forward)
    done: Optional[torch.cuda.Event]
    host: list[torch.Tensor]
    staged: Optional[list[torch.Tensor]]
    index: torch.Tensor


def page_runs(pages: list[int], page_size: int) -> list[tuple[int, int]]:
    """(first slot, number of slots) of each run of consecutive pages, in the order given: the
    slots of `pages` as few contiguous copies."""
    runs: list[list[int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p * page_size:
            runs[-1][1] += page_size
        else:
            runs.append([p * page_size, page_size])
    return [(a, n) for a, n in runs]


def _by_host_page(host_pages: list[int], dev_pages: list[int]) -> tuple[list[int], list[int]]:
    """The (host page, device page) pairs ordered by host page, so that host pages freed and
    reused in any order still form runs of consecutive pages (`page_runs`)."""
    pairs = sorted(zip(host_pages, dev_pages))
    return [h for h, _ in pairs], [d for _, d in pairs]


def available_host_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo (None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _Unlocker:
    """Page-locked buffers of dropped pools, waiting to be unregistered.

    A registration must end while its memory is still allocated. One that outlives its memory is
    silent corruption: when the allocator hands those addresses out again, CUDA still treats them
    as locked and DMAs from the old physical pages, so a pageable tensor copied to the GPU from
    there arrives as stale data (seen as garbage page-table indices in a later engine of the same
    process), and registering the range again fails. A dropped pool's finalizer therefore only
    parks its buffers here (keeping them allocated): it can run at any allocation, inside a CUDA
    graph capture of this or another thread, where a CUDA call would invalidate the capture. They
    are unregistered at the next safe point: a pool's creation or forward, or the end of a capture
    (`unlock_dropped`)."""

    def __init__(self):
        # Reentrant: an allocation under the lock can run garbage collection, and with it another
        # dropped pool's finalizer (`park`) on this thread.
        self.lock = threading.RLock()
        self.parked: list[tuple[torch.Tensor, torch.device]] = []

    def park(self, buffers: list[torch.Tensor], device: torch.device) -> None:
        with self.lock:
            self.parked += [(t, device) for t in buffers]
        buffers.clear()

    def unlock(self) -> None:
        """Unregister every parked buffer (after the device's copies that may still use it)."""
        with self.lock:
            parked, self.parked = self.parked, []
        try:
            for device in {d for _, d in parked}:
                torch.cuda.synchronize(device)
            while parked:
                t, device = parked[-1]
                _unregister(t, device)
                parked.pop()
        finally:  # an error above: what is left stays allocated, parked for the next try
            with self.lock:
                self.parked += parked


_UNLOCKER = _Unlocker()  # process-wide, like the CUDA registrations it tracks


def unlock_dropped() -> None:
    """Unregister the page-locked buffers of dropped host pools (call outside any CUDA graph
    capture; cheap when there are none)."""
    if _UNLOCKER.parked:
        _UNLOCKER.unlock()


def _unregister(t: torch.Tensor, device: torch.device) -> None:
    if int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr())) != 0:
        _clear_cuda_error(device)


def _clear_cuda_error(device: torch.device) -> None:
    """Consume the CUDA runtime's last error: a failed runtime call leaves it set, and PyTorch's
    next kernel-launch check would raise it as that kernel's own failure."""
    try:
        torch.zeros(1, device=device)
    except RuntimeError:
        pass


class HostPool:
    """Host spaces of `host_pages[name]` usable pages each."""

    def __init__(self, spaces: dict[str, DeviceTensors], host_pages: dict[str, int], page_size: int,
                 device: torch.device, gate: Optional[LayerGate] = None):
        self.page_size = page_size
        self.gate = gate  # per-buffer copy events for the forward (CUDA); None: wait for all
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending: list[_PendingCopy] = []
        self.generation = 0  # forwards so far (before_forward calls)
        # Buffers page-locked with cudaHostRegister: unregistered by `close`, or parked for the
        # next safe point when the pool is dropped without it (`_Unlocker`).
        self._locked: list[torch.Tensor] = []
        if self.cuda:
            unlock_dropped()
            self._dropped = weakref.finalize(self, _UNLOCKER.park, self._locked, self.device)
            self._dropped.atexit = False  # at exit the process's memory goes away anyway
        plans = {name: (dev(), max(1, host_pages[name]) + 1) for name, dev in spaces.items()}  # + page 0
        need = sum(pages * page_size * sum(t[0].numel() * t.element_size() for t in tensors)
                   for tensors, pages in plans.values())
        avail = available_host_bytes()
        if avail is not None and need > 0.9 * avail:
            raise ValueError(f"the HiCache host pool needs {need / 1e9:.2f} GB but only {avail / 1e9:.2f} GB "
                             "of host memory is available; lower --hicache-ratio or --hicache-size")
        self.spaces: dict[str, HostSpace] = {}
        for name, (tensors, pages) in plans.items():
            host = [self._host_buffer((pages * page_size,) + tuple(t.shape[1:]), t.dtype) for t in tensors]
            self.spaces[name] = HostSpace(name, PageAllocator(pages, page_size), host, spaces[name])
        logger.info("HiCache host pool: %s (%.2f GB)", ", ".join(
            f"{n}: {s.allocator.capacity} pages" for n, s in self.spaces.items()), self.nbytes() / 1e9)

    def _host_buffer(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer; on CUDA page-locked in place with cudaHostRegister (as SGLang does):
        PyTorch's pinned allocator rounds each block up to a power of two, which for a host pool
        of many GB would waste up to half of it. Free pages are never read, so no zero fill."""
        t = torch.empty(shape, dtype=dtype)
        if self.cuda and t.numel():
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(err) == 0:
                self._locked.append(t)
            else:  # could not lock this much memory: fall back to the pinned allocator
                _clear_cuda_error(self.device)
                logger.warning("cudaHostRegister failed (%s); using PyTorch's pinned allocator", err)
                t = torch.empty(shape, dtype=dtype, pin_memory=True)
        return t

    def close(self) -> None:
        """Unregister the page-locked buffers now (outside any CUDA graph capture), as a dropped
        pool's are at the next safe point (`_Unlocker`); the pool's copies are finished first."""
        if self.cuda:
            self._dropped.detach()
            _UNLOCKER.park(self._locked, self.device)
            _UNLOCKER.unlock()
        self._pending.clear()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.spaces.values() for t in s.tensors)

    def _slots(self, pages: list[int], device) -> torch.Tensor:
        ps = self.page_size
        idx = (torch.tensor(pages, dtype=torch.long)[:, None] * ps + torch.arange(ps)).flatten()
        if torch.device(device).type == "cuda":  # pageable copies would wait for queued forwards
            return idx.pin_memory().to(device, non_blocking=True)
        return idx

    # ---- copies --------------------------------------------------------------------------
    def to_host(self, space: str, dev_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages into host pages of one space (all of its buffers). The data lands
        in the host pool later (`finish_pending`), on CPU too, so tests exercise the ordering."""
        if not dev_pages:
            return
        s = self.spaces[space]
        hidx = self._slots(host_pages, "cpu")
        if not self.cuda:
            didx = self._slots(dev_pages, self.device)
            staged = [d.index_select(0, didx) for d in s.device_tensors()]
            self._pending.append(_PendingCopy(space, frozenset(host_pages), self.generation, None,
                                              s.tensors, staged, hidx))
            return
        host_pages, dev_pages = _by_host_page(host_pages, dev_pages)
        runs = page_runs(host_pages, self.page_size)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):  # device temporaries belong to the side stream
            didx = self._slots(dev_pages, self.device)
            for h, d in zip(s.tensors, s.device_tensors()):
                # One gather on the device, then DMA of each run of host pages straight into the
                # page-locked pool: no staging buffer and no scatter on the host.
                g = d.index_select(0, didx)
                self._gate(d)  # the forward may overwrite these pages once they are read
                at = 0
                for first, n in runs:
                    h[first:first + n].copy_(g[at:at + n], non_blocking=True)
                    at += n
            done = torch.cuda.Event()
            done.record(self.stream)
        self._pending.append(_PendingCopy(space, frozenset(host_pages), self.generation, done, s.tensors,
                                          None, hidx))

    def to_device(self, space: str, host_pages: list[int], dev_pages: list[int]) -> None:
        """Copy host pages into device pages of one space (ready before the next forward)."""
        if not dev_pages:
            return
        s = self.spaces[space]
        if not self.cuda:
            self.finish_pending(space, host_pages)
            hidx = self._slots(host_pages, "cpu")
            didx = self._slots(dev_pages, self.device)
            for h, d in zip(s.tensors, s.device_tensors()):
                d.index_copy_(0, didx, h.index_select(0, hidx))
            return
        # On CUDA a pending device -> host copy into these pages is on the same side stream, so
        # this copy reads after it lands: no host wait.
        host_pages, dev_pages = _by_host_page(host_pages, dev_pages)
        runs = page_runs(host_pages, self.page_size)
        n_slots = len(host_pages) * self.page_size
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            didx = self._slots(dev_pages, self.device)
            for h, d in zip(s.tensors, s.device_tensors()):
                # DMA straight from the page-locked pool: no gather on the host.
                stage = torch.empty((n_slots,) + tuple(h.shape[1:]), dtype=h.dtype, device=self.device)
                at = 0
                for first, n in runs:
                    stage[at:at + n].copy_(h[first:first + n], non_blocking=True)
                    at += n
                d.index_copy_(0, didx, stage)
                self._gate(d)

    def _gate(self, buffer: torch.Tensor) -> None:
        """Record that the side stream's copies on `buffer` so far end here (CUDA, with a gate)."""
        if self.gate is not None:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self.gate.record(buffer, ev)

    def read(self, space: str, host_pages: list[int]) -> list[torch.Tensor]:
        """Copies of the host pages' data, one tensor per buffer ([n * page_size, *shape])."""
        self.finish_pending(space, host_pages)
        hidx = self._slots(host_pages, "cpu")
        return [h.index_select(0, hidx) for h in self.spaces[space].tensors]

    def write(self, space: str, host_pages: list[int], data: list[torch.Tensor]) -> None:
        """Fill host pages from tensors shaped like `read` returns them (from the disk tier)."""
        self.finish_pending(space, host_pages)  # an older copy must not land on top later
        s = self.spaces[space]
        if len(data) != len(s.tensors):
            raise ValueError(f"{space}: {len(data)} buffers for a space of {len(s.tensors)}")
        hidx = self._slots(host_pages, "cpu")
        for h, t in zip(s.tensors, data):
            h.index_copy_(0, hidx, t.to(h.dtype))

    def pending(self, space: str, host_pages: list[int]) -> bool:
        """Whether a device -> host copy into one of these pages has not landed yet."""
        pages = set(host_pages)
        return any(p.space == space and p.pages & pages for p in self._pending)

    def finish_pending(self, space: Optional[str] = None, host_pages: Optional[list[int]] = None,
                       before_generation: Optional[int] = None) -> None:
        """Land device -> host copies, oldest first (the order keeps a reused host page right):
        all of them; or up to the last one into `host_pages` of `space`; or those issued before
        `before_generation`. On CUDA this waits for them, and so for the forward they follow."""
        if before_generation is not None:
            k = sum(p.generation < before_generation for p in self._pending)  # generations only grow
        elif space is not None:
            pages = set(host_pages or ())
            hits = [i for i, p in enumerate(self._pending) if p.space == space and p.pages & pages]
            k = hits[-1] + 1 if hits else 0
        else:
            k = len(self._pending)
        for p in self._pending[:k]:
            if p.done is not None:
                p.done.synchronize()
            for h, t in zip(p.host, p.staged or ()):  # CPU: scatter the staged copy
                h.index_copy_(0, p.index, t)
        del self._pending[:k]

    def before_forward(self) -> None:
        """Called once per step before its forward is queued. Copies issued two steps ago or
        earlier have landed on the device side by now (their forward's tokens were read back),
        so they are scattered into the host pool without waiting; then the compute stream waits
        for every copy issued so far (load-backs, and backups that read pages the forward may
        overwrite)."""
        self.finish_pending(before_generation=self.generation - 1)
        self.generation += 1
        if self.cuda:
            unlock_dropped()  # a safe point: no capture runs while the scheduler steps
        if self.gate is None:
            self.wait_device()

    def wait_device(self) -> None:
        """The compute stream waits for the side stream's copies (CUDA)."""
        if self.gate is not None:
            self.gate.wait_all()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def reset(self) -> None:
        """Every host page free again; copies in flight are dropped (their data is discarded)."""
        if self._pending and self.cuda:
            self._pending[-1].done.synchronize()  # their staging buffers may still be written
        self._pending.clear()
        for s in self.spaces.values():
            s.allocator.reset()

