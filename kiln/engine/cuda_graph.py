"""`CudaGraphRunner`: decode steps replayed from CUDA graphs, one graph per batch size.

A decode step of a small batch launches hundreds of kernels (a few per layer per op) that each run
for microseconds; launched one by one from Python, the GPU waits on the CPU most of the time.
Captured once per batch size, a whole step is one `graph.replay()`.

How it works (the same scheme as SGLang's and vLLM's decode graphs):
- Static buffers hold every input of a decode forward: token ids, positions, request rows, sequence
  lengths and the cache slots each state component writes (main page space and window spaces).
  A captured graph reads only these buffers, so a replay with new values in them is a new step.
- Graphs are captured for a ladder of batch sizes (1, 2, 4, 8, then steps of 8 up to 64, of 16 up
  to 256). A batch of n replays the smallest captured size >= n; the padding rows read request row
  0 at length 1 and write their state to slot 0 of every space, the scratch page that the
  allocators never hand out, so padding never touches a live request.
- Captures run largest first and share one memory pool, so the graphs together need about the
  activation memory of the largest; the runner reserves that memory before it sizes the KV pools.
- Outputs (logits, and the routed-expert ids the MoE gates record) are static tensors too: callers
  consume them before the next replay.

Kernels that run inside must not synchronise with the host or size their grids from tensor values:
`kiln.kernels` is written that way, and a replay is checked against an eager forward in
`tests/engine/test_cuda_graph.py` (GPU).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Protocol

import torch

from kiln.engine.batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The captured batch sizes, ascending, up to `max_bs` (which is always included)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16))
    sizes = [s for s in sizes if s < max_bs] + [max_bs]
    return sorted(set(sizes))


class CudaGraphRunner:
    """Captures `forward(batch) -> logits` for decode batches and replays it.

    `forward` is the runner's eager forward; `windows` the names of the window spaces whose write
    slots the batch carries (`ForwardBatch.win_out_locs`)."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], max_bs: int,
                 windows: list[str], device: torch.device):
        self.forward = forward
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.device = device
        n = self.max_bs
        z = lambda: torch.zeros(n, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.positions, self.req_slots, self.out_loc = z(), z(), z(), z()
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.prefix_lens = torch.zeros(n, dtype=torch.int64, device=device)
        self.win_locs = {c: z() for c in windows}
        self.arange = torch.arange(n, dtype=torch.int64, device=device)
        self.ones = torch.ones(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor, dict]] = {}

    def _batch(self, bs: int) -> ForwardBatch:
        """A decode batch of `bs` rows whose every tensor is a view of the static buffers."""
        b = ForwardBatch(mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
                         prefix_lens=[0] * bs, extend_lens=[1] * bs, logits_indices=self.arange[:bs],
                         req_slots=self.req_slots[:bs], out_cache_loc=self.out_loc[:bs],
                         win_out_locs={c: t[:bs] for c, t in self.win_locs.items()})
        b.seq_lens_t, b.prefix_lens_t = self.seq_lens[:bs], self.prefix_lens[:bs]
        b.extend_lens_t, b.extend_starts_t = self.ones[:bs], self.arange[:bs]
        b.max_extend_len = 1
        return b

    @torch.inference_mode()
    def capture(self, capturer: Optional["GraphCapturer"] = None) -> None:
        """Capture every size, largest first (later captures reuse the first one's pool).
        `capturer` defaults to CUDA graphs; tests pass one that re-runs the forward on replay."""
        capturer = capturer or CudaGraphCapturer(self.device)
        for bs in reversed(self.sizes):
            batch = self._batch(bs)
            replay, logits = capturer.capture(lambda batch=batch: self.forward(batch))
            self.graphs[bs] = (replay, logits, batch.extras)
        capturer.done(self.sizes)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (bool(self.graphs) and batch.mode == ForwardMode.DECODE and batch.batch_size <= self.max_bs
                and not batch.extras.get("replay_experts"))

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [n, V] of a decode batch of n rows (a view of a static buffer)."""
        n = batch.batch_size
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.req_slots[:n].copy_(batch.req_slots)
        self.out_loc[:n].copy_(batch.out_cache_loc)
        self.seq_lens[:n].copy_(batch.seq_lens_t)
        self.prefix_lens[:n].copy_(batch.prefix_lens_t)
        for c, t in self.win_locs.items():
            t[:n].copy_(batch.win_out_locs[c])
        if bs > n:  # padding rows: request row 0 at length 1, writing to the scratch slot 0
            for t in (self.input_ids, self.positions, self.req_slots, self.out_loc, self.prefix_lens,
                      *self.win_locs.values()):
                t[n:bs].zero_()
            self.seq_lens[n:bs].fill_(1)
        replay, logits, extras = self.graphs[bs]
        replay()
        routed = extras.get("routed_experts")
        if routed is not None:
            batch.extras["routed_experts"] = {i: ids[:n] for i, ids in routed.items()}
        return logits[:n]


class GraphCapturer(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record `fn` once; return (replay, the output tensor that each replay refreshes)."""

    def done(self, sizes: list[int]) -> None:
        """Called after the last capture."""


class CudaGraphCapturer:
    """`torch.cuda.CUDAGraph` capture on a side stream, all graphs in one memory pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = None
        torch.cuda.synchronize(device)
        self.free_before = torch.cuda.mem_get_info(device)[0]

    def capture(self, fn):
        # Warm up outside the capture: Triton compiles and autotunes on first use, and the
        # allocator settles its blocks.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, out

    def done(self, sizes: list[int]) -> None:
        torch.cuda.synchronize(self.device)
        used = (self.free_before - torch.cuda.mem_get_info(self.device)[0]) / 2**30
        logger.info("captured CUDA graphs for decode batch sizes %s (%.2f GiB)", sizes, used)
