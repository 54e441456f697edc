"""Which sorted rows of the grouped MoE GEMMs (`kiln.kernels.moe`) belong to which expert.

Token t's KS = k + C slots (its k routed selections, then the C shared chunks) are sorted by
expert into segments padded to BLOCK_M rows, so that every BLOCK_M-row block of a GEMM belongs to
one expert; the padding rows hold the sentinel `num_slots`. `_align_kernel` stores them (the
sorted slots and the segment ends); `_block_expert` finds a GEMM program's expert from the ends.
`align_in_one_program` stores the same for a few tokens from one program: the router's gate
kernel, which has just selected them (`kiln.kernels.moe_gate`, `align=`), so that no launch of its
own stands between the gate and the gate/up GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.kernels.launch import wait_for_previous

_INT32_MAX = tl.constexpr(2147483647)
# Routed assignments (T * k) up to which a gate aligns its tokens itself (`GateAlign`): its one
# program compares every pair of them in registers.
GATE_ALIGN_MAX_ASSIGNMENTS = 64


def sorted_rows(num_tokens: int, top_k: int, num_experts: int, chunks: int, block_m: int) -> int:
    """Rows of the sorted-slot buffer, in whole blocks of block_m: the worst case, where every
    nonempty routed expert pads block_m - 1 rows and each shared chunk holds all tokens."""
    routed = num_tokens * top_k + min(num_experts, num_tokens * top_k) * (block_m - 1)
    rows = routed + chunks * triton.cdiv(num_tokens, block_m) * block_m
    return triton.cdiv(rows, block_m) * block_m


@dataclass
class GateAlign:
    """The grouped MoE's sorted slots and segment ends for one layer's few tokens, which the gate
    kernel stores right after its selection (`kiln.kernels.moe_gate`, `align=`;
    `align_in_one_program`) instead of `_align_kernel` after it. `filled` says that a gate did
    (set when it launches: a gate on the reference path, with replayed ids, leaves it False and
    `fused_experts` aligns as before)."""

    sorted_slots: torch.Tensor
    seg_end: torch.Tensor
    num_tokens: int
    top_k: int
    num_experts: int
    chunks: int
    block_m: int
    filled: bool = False

    @classmethod
    def new(cls, num_tokens: int, top_k: int, num_experts: int, chunks: int, block_m: int,
            device: torch.device) -> Optional["GateAlign"]:
        """Buffers for the layer's tokens, or None past what one gate program aligns (more than
        16 tokens, its largest program, or GATE_ALIGN_MAX_ASSIGNMENTS assignments)."""
        if not (0 < num_tokens <= 16 and num_tokens * top_k <= GATE_ALIGN_MAX_ASSIGNMENTS):
            return None
        rows = sorted_rows(num_tokens, top_k, num_experts, chunks, block_m)
        return cls(torch.empty(rows, dtype=torch.int32, device=device),
                   torch.empty(num_experts + chunks, dtype=torch.int32, device=device),
                   num_tokens, top_k, num_experts, chunks, block_m)

    @property
    def num_slots(self) -> int:
        return self.num_tokens * (self.top_k + self.chunks)

    def kernel_args(self) -> dict:
        """The gate kernel's arguments for `align_in_one_program` (ALIGN on)."""
        e_tot = self.num_experts + self.chunks
        return dict(sorted_ptr=self.sorted_slots, seg_end_ptr=self.seg_end, num_slots=self.num_slots, ALIGN=True,
                    E_TOT=e_tot, KS=self.top_k + self.chunks, BLOCK_M=self.block_m,
                    E_PAD=max(32, triton.next_power_of_2(e_tot)),
                    A_PAD=max(16, triton.next_power_of_2(self.num_tokens * self.top_k)),
                    T_PAD=triton.next_power_of_2(self.num_tokens))


def no_gate_align(ids: torch.Tensor) -> dict:
    """The gate kernel's arguments without the alignment (ALIGN off; ids stands in for the pointers)."""
    return dict(sorted_ptr=ids, seg_end_ptr=ids, num_slots=0, ALIGN=False, E_TOT=1, KS=1, BLOCK_M=16, E_PAD=32,
                A_PAD=16, T_PAD=1)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, seg_end_ptr, num_routed, num_tokens, num_slots,
                  E: tl.constexpr, E_TOT: tl.constexpr, K: tl.constexpr, KS: tl.constexpr,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    e = tl.program_id(0)
    bins = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_routed, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ok = offs < num_routed
        ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
        counts += tl.histogram(ids, E_PAD, mask=ok)
    # Every token uses every shared chunk once.
    counts = tl.where((bins >= E) & (bins < E_TOT), num_tokens, counts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    mine = bins == e
    my_end = tl.sum(tl.where(mine, ends, 0), axis=0)
    my_start = my_end - tl.sum(tl.where(mine, padded, 0), axis=0)
    my_count = tl.sum(tl.where(mine, counts, 0), axis=0)
    if e == 0:
        tl.store(seg_end_ptr + bins, ends, mask=bins < E_TOT)
    if e < E:
        # Assignment i = t*K + j goes to slot t*KS + j, in token order within the segment.
        base = my_start
        for start in range(0, num_routed, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            ok = offs < num_routed
            ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
            hit = (ids == e) & ok
            rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
            slot = (offs // K) * KS + offs % K
            tl.store(sorted_ptr + base + rank, slot, mask=hit)
            base += tl.sum(hit.to(tl.int32), axis=0)
    else:
        for start in range(0, num_tokens, CHUNK):
            t = start + tl.arange(0, CHUNK)
            tl.store(sorted_ptr + my_start + t, t * KS + K + (e - E), mask=t < num_tokens)
    pad = my_start + my_count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + pad, num_slots, mask=pad < my_end)


@triton.jit
def align_in_one_program(ids_ptr, sorted_ptr, seg_end_ptr, num_tokens, num_slots,
                         E: tl.constexpr, E_TOT: tl.constexpr, K: tl.constexpr, KS: tl.constexpr,
                         BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, A_PAD: tl.constexpr, T_PAD: tl.constexpr):
    """`_align_kernel`'s whole grid in one program: the same sorted slots and segment ends, bit for
    bit, for num_tokens <= T_PAD tokens of K routed ids each (num_tokens * K <= A_PAD). An
    assignment's place in its segment is the number of earlier assignments of its expert (an
    [A_PAD, A_PAD] comparison in registers, where `_align_kernel` takes a running sum per expert).
    The ids must be readable by every thread of the program: a caller that has just stored them
    passes a barrier first."""
    a = tl.arange(0, A_PAD)
    a_ok = a < num_tokens * K
    ids = tl.load(ids_ptr + a, mask=a_ok, other=-1).to(tl.int32)  # (-1: in no bin)
    bins = tl.arange(0, E_PAD)
    onehot = ids[:, None] == bins[None, :]
    counts = tl.sum(onehot.to(tl.int32), axis=0)
    counts = tl.where((bins >= E) & (bins < E_TOT), num_tokens, counts)  # every token uses every shared chunk
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(seg_end_ptr + bins, ends, mask=bins < E_TOT)
    # Assignment i = t*K + j goes to slot t*KS + j, in token order within its expert's segment.
    rank = tl.sum(((ids[:, None] == ids[None, :]) & (a[None, :] < a[:, None])).to(tl.int32), axis=1)
    start = tl.sum(tl.where(onehot, starts[None, :], 0), axis=1)
    tl.store(sorted_ptr + start + rank, (a // K) * KS + a % K, mask=a_ok)
    t = tl.arange(0, T_PAD)
    chunk = (bins >= E) & (bins < E_TOT)
    tl.store(sorted_ptr + starts[:, None] + t[None, :], t[None, :] * KS + K + (bins - E)[:, None],
             mask=chunk[:, None] & (t < num_tokens)[None, :])
    pad = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ptr + pad, num_slots, mask=pad < ends[:, None])


@triton.jit
def _block_expert(seg_end_ptr, m_start, E_TOT: tl.constexpr, E_PAD: tl.constexpr):
    """The expert whose segment holds row `m_start`; E_TOT for rows past the last segment."""
    bins = tl.arange(0, E_PAD)
    ends = tl.load(seg_end_ptr + bins, mask=bins < E_TOT, other=_INT32_MAX)
    return tl.sum((ends <= m_start).to(tl.int32), axis=0)
