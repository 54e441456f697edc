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
- Outputs (logits, the final hidden states, block-drafter taps and the routed-expert ids the MoE
  gates record) are static tensors too: callers consume them before the next replay.
- With speculative decoding, the verify forward gets graphs too: a *uniform extend* of q = k + 1
  tokens per sequence (the last committed token and k drafts) with logits for every row, over the
  same batch-size ladder (padding sequences have no prefix and write to slot 0). Its attention
  runs the decode kernel with one query per token (`PagedBackend.SHORT_EXTEND`).

Kernels that run inside must not synchronise with the host or size their grids from tensor values:
`kiln.kernels` is written that way, and a replay is checked against an eager forward in
`tests/engine/test_cuda_graph.py` (GPU).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Callable, ContextManager, Optional, Protocol, Sequence

import torch

from kiln.engine.batch import ForwardBatch, ForwardMode
from kiln.engine.cache.host_pool import unlock_dropped
from kiln.ops import verify_moves

logger = logging.getLogger(__name__)

MAX_VERIFY_TOKENS = 1024


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The captured batch sizes, ascending, up to `max_bs` (which is always included)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16))
    sizes = [s for s in sizes if s < max_bs] + [max_bs]
    return sorted(set(sizes))


class CudaGraphRunner:
    """Captures `forward(batch) -> logits` for decode batches (and speculative verify batches)
    and replays it.

    `forward` is the runner's eager forward; `windows` the names of the window spaces whose write
    slots the batch carries (`ForwardBatch.win_out_locs`). `tokens_per_seq` lists the batch shapes
    to capture: 1 is decode; q > 1 is a *uniform extend* of q tokens per sequence on top of any
    cached prefix, with logits for every row (a speculative round verifying q - 1 drafts). Every
    shape shares the static buffers and one memory pool. `capture_context(bs, q)`, if given, wraps
    the capture of each graph of `bs` sequences of `q` tokens."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], max_bs: int,
                 windows: list[str], device: torch.device, tokens_per_seq: Sequence[int] = (1,),
                 capture_context: Optional[Callable[[int, int], ContextManager]] = None, use_kernels: bool = False):
        self.forward = forward
        # `replay_moved`'s input moves: one Triton launch, or the PyTorch reference's ~13
        self.move_inputs = verify_moves.move_verify_inputs
        if use_kernels:
            from kiln.kernels import verify_moves as one_launch

            self.move_inputs = one_launch.move_verify_inputs
        self.capture_context = capture_context or (lambda bs, q: contextlib.nullcontext())
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.tokens_per_seq = sorted(set(tokens_per_seq))
        assert self.tokens_per_seq[0] >= 1, self.tokens_per_seq
        # Verify shapes stop at MAX_VERIFY_TOKENS tokens (logits for every row are large): a
        # bigger verify batch runs eager, where its launch overhead matters less.
        self.sizes_of = {q: [s for s in self.sizes if q == 1 or s * q <= max(MAX_VERIFY_TOKENS, q)]
                         for q in self.tokens_per_seq}
        self.device = device
        n = self.max_bs
        nt = max(self.sizes_of[q][-1] * q for q in self.tokens_per_seq)
        z = lambda size: torch.zeros(size, dtype=torch.int64, device=device)  # noqa: E731
        # per token
        self.input_ids, self.positions, self.out_loc = z(nt), z(nt), z(nt)
        self.win_locs = {c: z(nt) for c in windows}
        self.arange = torch.arange(nt, dtype=torch.int64, device=device)
        self.token_slots = z(nt)  # verify shapes: each token's request row, filled per replay
        # per sequence
        self.req_slots, self.prefix_lens = z(n), z(n)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor, ForwardBatch]] = {}
        # (batch, q, n) of the last replay: what `replay_moved` moves on
        self.last: Optional[tuple[ForwardBatch, int, int]] = None

    def _batch(self, bs: int, q: int, like: Optional[ForwardBatch] = None) -> ForwardBatch:
        """A batch of `bs` sequences of `q` new tokens whose every tensor is a view of the static
        buffers (extend lengths and starts are constants of the shape: views of those of `like`,
        a captured batch of the shape, when given)."""
        t = bs * q
        b = ForwardBatch(mode=ForwardMode.DECODE if q == 1 else ForwardMode.EXTEND,
                         input_ids=self.input_ids[:t], positions=self.positions[:t],
                         prefix_lens=[0] * bs, extend_lens=[q] * bs, logits_indices=self.arange[:t],
                         req_slots=self.req_slots[:bs], out_cache_loc=self.out_loc[:t],
                         win_out_locs={c: w[:t] for c, w in self.win_locs.items()})
        b.seq_lens_t, b.prefix_lens_t = self.seq_lens[:bs], self.prefix_lens[:bs]
        if like is not None:
            b.extend_lens_t, b.extend_starts_t = like.extend_lens_t[:bs], like.extend_starts_t[:bs]
        else:
            b.extend_lens_t = torch.full((bs,), q, dtype=torch.int64, device=self.device)
            b.extend_starts_t = self.arange[:bs] * q
        b.max_extend_len = q
        b.in_graph = True
        if q > 1:
            b.extras["token_slots"] = self.token_slots[:t]
        return b

    @torch.inference_mode()
    def capture(self, capturer: Optional["GraphCapturer"] = None, warmups: int = 2) -> None:
        """Capture every (shape, size), the most tokens first (later captures reuse the first
        one's pool). `capturer` defaults to CUDA graphs with `warmups` eager runs before each
        capture; tests pass one that re-runs the forward on replay."""
        capturer = capturer or CudaGraphCapturer(self.device, warmups)
        for q in sorted(self.tokens_per_seq, key=lambda q: -q * self.sizes_of[q][-1]):
            for bs in reversed(self.sizes_of[q]):
                batch = self._batch(bs, q)
                with self.capture_context(bs, q):
                    replay, logits = capturer.capture(lambda batch=batch: self.forward(batch))
                self.graphs[(q, bs)] = (replay, logits, batch)
        capturer.done(self.sizes)

    def shape_of(self, batch: ForwardBatch) -> Optional[int]:
        """The captured tokens-per-sequence that `batch` is an instance of, or None."""
        if not self.graphs or batch.extras.get("replay_experts"):
            return None
        if batch.mode == ForwardMode.DECODE:
            q = 1
        else:
            q = batch.extend_lens[0] if batch.extend_lens else 0
            # logit rows are ascending and distinct, so as many as tokens means every row in order
            if q <= 1 or any(e != q for e in batch.extend_lens) or batch.logits_indices.shape[0] != batch.num_tokens:
                return None
        if q not in self.sizes_of or batch.batch_size > self.sizes_of[q][-1]:
            return None
        return q

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.shape_of(batch) is not None

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [rows, V] of a batch `can_run` accepted (a view of a static buffer); the final
        hidden states, block-drafter taps and routed-expert ids land in `batch` as views too."""
        q = self.shape_of(batch)
        n = batch.batch_size
        bs = next(s for s in self.sizes_of[q] if s >= n)
        t, tp = n * q, bs * q
        # The inputs in one multi-tensor copy (one launch on CUDA when every tensor has one dtype
        # and device and every pair is dense with equal strides; otherwise torch copies pair by
        # pair, as before): at batch 1 the host's time to queue a step is on a speculative
        # round's critical path.
        dst = [self.input_ids[:t], self.positions[:t], self.out_loc[:t], self.req_slots[:n], self.seq_lens[:n],
               self.prefix_lens[:n]]
        src = [batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_slots, batch.seq_lens_t,
               batch.prefix_lens_t]
        for c, w in self.win_locs.items():
            dst.append(w[:t])
            src.append(batch.win_out_locs[c])
        torch._foreach_copy_(dst, src)
        if q > 1:  # the verify attention reads each token's request row (PagedBackend._token_slots)
            self.token_slots[:t].view(n, q).copy_(batch.req_slots[:, None].expand(n, q))  # (no repeat_interleave: no size sync)
        if bs > n:  # padding sequences: request row 0, no prefix, writing to the scratch slot 0
            torch._foreach_zero_([buf[t:tp] for buf in (self.input_ids, self.positions, self.out_loc, self.token_slots,
                                                        *self.win_locs.values())]
                                 + [self.req_slots[n:bs], self.prefix_lens[n:bs]])
            self.seq_lens[n:bs].fill_(q)
        self.last = (batch, q, n)
        return self._replay(q, bs, t, batch)

    def _replay(self, q: int, bs: int, t: int, batch: ForwardBatch) -> torch.Tensor:
        """Replay (q, bs) on the static buffers as they are; its outputs' first t rows land in
        `batch` (views) and the logits' are returned."""
        replay, logits, captured = self.graphs[(q, bs)]
        replay()
        routed = captured.extras.get("routed_experts")
        if routed is not None:
            batch.extras["routed_experts"] = {i: ids[:t] for i, ids in routed.items()}
        hidden = captured.extras.get("hidden")
        if hidden is not None:
            batch.extras["hidden"] = hidden[:t]
        batch.capture_layers = captured.capture_layers
        batch.captured = {i: h[:t] for i, h in captured.captured.items()}
        return logits[:t]

    def moves_on(self, batch: ForwardBatch, n: int) -> bool:
        """Whether `batch` is a verify batch of `n` sequences and the last one replayed: its inputs
        are still in the static buffers, for `replay_moved`."""
        return self.last is not None and self.last[0] is batch and self.last[1] > 1 and self.last[2] == n

    def replay_moved(self, shift: torch.Tensor, last: torch.Tensor, last_at_shift: bool, drafts: torch.Tensor,
                     tables: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ForwardBatch]:
        """Replay the last replayed verify shape again with every sequence moved on, without the
        host: sequence b's positions, prefix and sequence lengths advance by `shift[b]` ([n] on the
        device), its rows read [its last committed token, drafts[b]] (the token is
        last[b, shift[b] - 1] if `last_at_shift`, else last[b, 0]), and the write slots of the new
        positions are looked up on the device in the page tables (`tables`: "main" and every window
        space, rows by request slot). One launch with kernels (`kiln.kernels.verify_moves`).
        Padding sequences stay as they were. The caller guarantees that every new position has its
        pages in the tables. Returns (logits [n * q, V], a batch whose tensors are views of the
        static buffers, with the outputs `replay` sets)."""
        _, q, n = self.last
        assert q > 1 and tuple(drafts.shape) == (n, q - 1), (q, n, tuple(drafts.shape))
        t = n * q
        bs = next(s for s in self.sizes_of[q] if s >= n)
        maps = [(tables["main"], self.out_loc)] + [(tables[c], w) for c, w in self.win_locs.items()]
        self.move_inputs(shift, last, last_at_shift, drafts, self.positions[:t].view(n, q), self.prefix_lens[:n],
                         self.seq_lens[:n], self.req_slots[:n], self.input_ids[:t].view(n, q),
                         [(table, out[:t].view(n, q)) for table, out in maps])
        batch = self._batch(n, q, like=self.graphs[(q, bs)][2])
        self.last = (batch, q, n)
        return self._replay(q, bs, t, batch), batch


class GraphCapturer(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record `fn` once; return (replay, the output tensor that each replay refreshes)."""

    def done(self, sizes: list[int]) -> None:
        """Called after the last capture."""


@contextlib.contextmanager
def _collector_off():
    """The cyclic garbage collector paused (reference counting still frees), restored after."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class CudaGraphCapturer:
    """`torch.cuda.CUDAGraph` capture on a side stream, all graphs in one memory pool.

    `warmups` eager runs precede each capture, so that first-use work (Triton's compiles and
    autotuning, cuBLAS handles, tensors a module caches) happens outside it. A recapture of
    shapes that already ran (after a memory release) needs none: that work is done, and the
    warm-ups were two thirds of a resume's capture time.

    The cyclic garbage collector is off during a capture (`_collector_off`) and runs once before
    the first: a collection inside one could destroy CUDA graphs or events that an earlier engine
    left in a reference cycle, an operation a capturing stream forbids, and the capture fails
    ("operation not permitted when stream is capturing"; torch's `graph` stopped collecting first
    in 2.x). The GPU suite hit it on an H100, one test of many engines per process."""

    def __init__(self, device: torch.device, warmups: int = 2):
        assert warmups >= 0, warmups
        self.device = device
        self.warmups = warmups
        self.stream = torch.cuda.Stream(device)
        self.pool = None
        gc.collect()  # what earlier engines left in cycles goes now, not inside a capture
        torch.cuda.synchronize(device)
        self.free_before = torch.cuda.mem_get_info(device)[0]

    def capture(self, fn):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmups):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with _collector_off(), torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, out

    def done(self, sizes: list[int]) -> None:
        torch.cuda.synchronize(self.device)
        unlock_dropped()  # host pools dropped during the captures (their finalizers only park)
        used = (self.free_before - torch.cuda.mem_get_info(self.device)[0]) / 2**30
        logger.info("captured CUDA graphs for decode batch sizes %s (%.2f GiB)", sizes, used)
