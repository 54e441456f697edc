"""Decode projections through Kiln's GEMV (`kiln.kernels.gemv`) instead of cuBLAS.

At a few rows per forward a projection is a pure weight stream. On the engine's kernel path, when
the forward has at most `batch.backend.gemv_max_rows` rows (`--gemv-max-rows`, 1 by default on Hopper),
`decode_linear` runs a Kiln linear layer's matmul as one GEMV launch whose weight stream starts
before its predecessor has completed (PDL), then the all-reduce of a row-parallel layer;
`decode_swiglu` also folds the MLPs' SiLU-and-mul into the gate_up GEMV, `decode_linear_conv`
a decode ShortConv on the projection's output (Inkling's o_proj + o_conv) into its epilogue, and
`decode_prenorm` a sublayer's pre-norm into the prologue of its first projection (or router), and
`decode_qkv_rope` RoPE and the cache write into the epilogue of a qkv projection (`qkv_rope_args`),
`decode_linear_norm` the next sublayer's pre-norm into the epilogue of a sublayer's last
projection (where the prologue fold does not apply), and `decode_logits` runs the LM head.
Anywhere else (the CPU engine, more rows, the trainer, anything autograd records,
`--kernel-backend reference`, an adapter's forward, a bias) it calls the module, so those paths
do not change by a bit.

The GEMV reads its weights before waiting for the kernel before it (and, up to
`batch.backend.gemv_prefetch_bytes`, asks the whole matrix into L2 there: `--gemv-l2-prefetch-mb`),
so that kernel must not write them. Inside a forward none does; weight updates (RL syncs, LoRA merges) run between
forwards, and every forward starts with the embedding.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from kiln.engine.batch import ForwardMode
from kiln.kernels import kernel_path, kernels_supported
from kiln.layers.activation import silu_and_mul
from kiln.layers.attention import Attention
from kiln.layers.embedding import ParallelLMHead
from kiln.layers.linear import ColumnParallelLinear, RowParallelLinear
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding
from kiln.layers.shortconv import ShortConv


@functools.lru_cache(maxsize=None)
def _kernels():
    # Imported on first use: it needs Triton, which the CPU build of torch does not ship.
    from kiln.kernels import gemv
    return gemv


_PLAIN_FORWARDS = (ColumnParallelLinear.forward, RowParallelLinear.forward)


def hooked(*modules: nn.Module) -> bool:
    """Whether any of `modules` has forward hooks: a call a hook must see cannot be split into parts
    or fused into another kernel."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def gemv_path(batch, x: torch.Tensor, linear: nn.Module, max_rows: Optional[int] = None) -> bool:
    """Whether `linear(x)` takes the GEMV: the engine's kernel path with nothing recorded by
    autograd, 2-D x of at most `gemv_max_rows` rows (`max_rows` instead when given, with the GEMV
    on: `gemv_max_rows` > 0) in the weight's dtype, and a plain Kiln linear without bias or hooks
    (anything that changes the module's forward, an adapter such as LoRA's, must run; a bias would
    be rounded once more than in F.linear's epilogue)."""
    rows = getattr(getattr(batch, "backend", None), "gemv_max_rows", 0)
    if max_rows is not None and rows > 0:
        rows = max_rows
    return (x.dim() == 2 and 0 < x.shape[0] <= rows and x.dtype == linear.weight.dtype
            and linear.bias is None and type(linear).forward in _PLAIN_FORWARDS
            and not linear._forward_hooks and not linear._forward_pre_hooks
            and kernel_path(batch, x, linear.weight))


# Rows up to which `decode_linear_norm` runs a norm in the GEMV's epilogue. On an H200 at the 8B shape
# (docs/benchmarks.md, twentieth pass) one row gained (a batch-1 step 4.10 against 4.22 ms; the dense
# chain 117.2 against 118.9 us per layer) and two lost (the chain 140.4 against 135.5 us: the rows
# are normed in two passes there).
NORM_EPILOGUE_MAX_ROWS = 1


def _prefetch_bytes(batch) -> int:
    return getattr(batch.backend, "gemv_prefetch_bytes", 0)


def decode_swiglu(gate_up: nn.Module, x: torch.Tensor, batch) -> torch.Tensor:
    """silu(gate) * up of a fused gate_up projection (`kiln.layers.activation.silu_and_mul` of
    `gate_up(x)`). Through the GEMV (`gemv_path`, at most FMA_MAX_ROWS rows) both run as one
    launch, bit-identical to the GEMV followed by the SiLU-and-mul kernel."""
    if gemv_path(batch, x, gate_up) and x.shape[0] <= _kernels().FMA_MAX_ROWS:
        return _kernels().gemv(x, gate_up.weight, glu=True, prefetch_bytes=_prefetch_bytes(batch))
    return silu_and_mul(decode_linear(gate_up, x, batch), batch)


def decode_linear(linear: nn.Module, x: torch.Tensor, batch, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """linear(x), through the GEMV when `gemv_path` allows (then the all-reduce of a row-parallel
    layer, as its forward does). `weight`: a column-parallel linear's weight with more rows stacked
    after it (`kiln.layers.stacked_weights`), read by the GEMV instead (the output has them all)."""
    if not gemv_path(batch, x, linear):
        return linear(x)
    y = _kernels().gemv(x, linear.weight if weight is None else weight, prefetch_bytes=_prefetch_bytes(batch))
    if isinstance(linear, RowParallelLinear) and linear.reduce_output:
        y = linear.pc.all_reduce(y)
    return y


def qkv_rope_args(attn: nn.Module, rotary: nn.Module, positions: torch.Tensor, x: torch.Tensor,
                  qkv_proj: nn.Module, batch) -> Optional[tuple]:
    """The `rope=` arguments of `kiln.kernels.gemv.gemv` when this decode step's qkv projection of x
    may rotate q and k and write k and v into the cache in its epilogue (then `Attention.attend_stored`
    attends): the GEMV takes qkv_proj (`gemv_path`, at most FMA_MAX_ROWS rows), `attn` and
    `rotary` are plain modules without hooks (their calls are replaced), and the backend has them
    for this step (`PagedBackend.decode_rope_args`: a decode step on the kernel path). None
    otherwise: the caller then projects and calls the attention with `rope=`."""
    backend = getattr(batch, "backend", None)
    if not hasattr(backend, "decode_rope_args") or not gemv_path(batch, x, qkv_proj):
        return None
    if type(attn).forward is not Attention.forward or type(rotary).forward is not RotaryEmbedding.forward or any(
            m._forward_hooks or m._forward_pre_hooks for m in (attn, rotary)):
        return None
    if x.shape[0] > _kernels().FMA_MAX_ROWS:
        return None
    return backend.decode_rope_args(attn, rotary, positions, batch)


def decode_qkv_rope(qkv_proj: nn.Module, x: torch.Tensor, rope: tuple, batch) -> torch.Tensor:
    """q of qkv_proj(x), rotated, with k rotated and v written into the cache: one GEMV launch
    (`kiln.kernels.gemv.gemv(rope=)`) for what a qkv projection and `rope_store` do. rope:
    `qkv_rope_args`'s."""
    return _kernels().gemv(x, qkv_proj.weight, prefetch_bytes=_prefetch_bytes(batch), rope=rope)


def _folds_norm(norm: nn.Module, sublayer: nn.Module, linear: nn.Module, h: torch.Tensor,
                residual: Optional[torch.Tensor], batch, router: bool) -> bool:
    """Whether norm's work can move into the prologue of linear's GEMV: h at most
    `--fold-norms-max-hidden` wide (`batch.backend.fold_norms_max_hidden`), the GEMV's FMA loop
    (`gemv_path`, at most FMA_MAX_ROWS rows; a router's fp32 weight on the router GEMV's path,
    `kiln.kernels.moe_gate.router_logits`), a residual like h, and nothing that must see the
    separate calls: a plain RMSNorm without hooks, and no hooks on the sublayer (whose call the
    fold may replace by its parts) or on linear (a router's would see its input only after the
    logits were computed)."""
    if h.dim() != 2 or h.shape[1] > getattr(getattr(batch, "backend", None), "fold_norms_max_hidden", 0):
        return False
    if type(norm).forward is not RMSNorm.forward or any(
            m._forward_hooks or m._forward_pre_hooks for m in (norm, sublayer, linear)):
        return False
    if residual is not None and (residual.shape != h.shape or residual.dtype != h.dtype):
        return False
    if router:  # fp32 logits whatever h's dtype (`router_logits`), where the MoE kernels use them (CUDA)
        on_gemv = (getattr(batch.backend, "gemv_max_rows", 0) > 0 and linear.weight.dtype == torch.float32
                   and kernels_supported(h.device) and kernel_path(batch, h, linear.weight))
    else:
        on_gemv = gemv_path(batch, h, linear)
    # the row limit last: it imports the kernels, which need Triton (off the kernel path: absent)
    return on_gemv and kernel_path(batch, h, residual, norm.weight) and 0 < h.shape[0] <= _kernels().FMA_MAX_ROWS


def decode_prenorm(norm: nn.Module, sublayer: nn.Module, linear: nn.Module, h: torch.Tensor,
                   residual: Optional[torch.Tensor], batch, glu: bool = False, keep_normed: bool = False,
                   router: bool = False, rope: Optional[tuple] = None, weight: Optional[torch.Tensor] = None
                   ) -> tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    """The pre-norm of `sublayer`, whose first projection is `linear`: x = norm(h + residual)
    (norm(h) when residual is None). Returns (y, h + residual, x):
    - at decode on the GEMV path (`_folds_norm`), the norm runs in the prologue of linear's GEMV
      (`kiln.kernels.gemv.gemv_prenorm`; one launch fewer) and y = linear(x) (silu(gate) * up with
      glu; with `router`, linear is a MoE router and y its fp32 logits); x is returned with
      `keep_normed` only (for other readers of it), else None. The caller then runs the rest of
      the sublayer from y. With `rope` (`qkv_rope_args`) y is the rotated q of a qkv projection
      whose k and v are in the cache;
    - otherwise the norm runs as before and y is None: the caller calls the sublayer on x.
    `weight`: as `decode_linear`'s (linear's weight with more rows after it, so y has them too)."""
    if _folds_norm(norm, sublayer, linear, h, residual, batch, router):
        # no L2 prefetch for a router, as `router_logits` has none
        w = linear.weight if weight is None else weight
        return _kernels().gemv_prenorm(h, residual, norm.weight, norm.eps, w, glu=glu,
                                       keep_normed=keep_normed, prefetch_bytes=0 if router else _prefetch_bytes(batch),
                                       rope=rope)
    x, residual = (norm(h, batch), h) if residual is None else norm(h, batch, residual)
    return None, residual, x


def epilogue_conv_args(conv: nn.Module, x: torch.Tensor, batch, chunk: bool = False) -> Optional[tuple]:
    """The decode state of `conv` (a `kiln.kernels.shortconv.short_conv_decode` argument tuple
    after x) when a kernel whose output it convolves may run it in its epilogue: a plain
    ShortConv (no subclass forward, no hooks: those must run), a backend that offers
    `decode_conv_args` and has it for this batch (a decode step on the kernel path), and state kept
    in x's dtype. None otherwise: the caller then runs `conv` itself. chunk: instead the state of
    this forward's rows as short chunks (a speculative verify; `PagedBackend.chunk_conv_args`), for
    the GEMV's `conv_chunk` epilogue."""
    method = "chunk_conv_args" if chunk else "decode_conv_args"
    if (type(conv).forward is not ShortConv.forward or conv._forward_hooks or conv._forward_pre_hooks
            or not hasattr(getattr(batch, "backend", None), method)):
        return None
    args = getattr(batch.backend, method)(conv, batch)
    if args is None or args[1].dtype != x.dtype:  # the epilogue keeps the state in x's dtype
        return None
    return args


def decode_linear_conv(linear: nn.Module, conv: nn.Module, x: torch.Tensor, batch) -> torch.Tensor:
    """conv(linear(x)) for a `kiln.layers.shortconv.ShortConv` on a projection's output, with the
    conv in the GEMV's epilogue (`epilogue_conv_args`; one launch fewer; never with an all-reduce
    between the two): on the GEMV path of a decode step (at most FMA_MAX_ROWS rows), and with the
    GEMV on for a forward of short chunks (a speculative verify) of at most FMA_MAX_ROWS rows,
    whatever `--gemv-max-rows`' limit (Inkling's o_proj and its dense layer's down_proj: at 4 rows
    the GEMV streams those weights faster than cuBLAS, docs/benchmarks.md, ninth pass; the verify's
    rounds gained with it, nineteenth pass). Decode steps of 2-4 rows keep the limit: with both
    conv epilogues there, batch 4 ran 2% slower (nineteenth pass)."""
    args, chunk = None, False
    reduce = isinstance(linear, RowParallelLinear) and linear.reduce_output and linear.pc.tp_size > 1
    if not reduce and gemv_path(batch, x, linear) and x.shape[0] <= _kernels().FMA_MAX_ROWS:
        args = epilogue_conv_args(conv, x, batch)
    gemv_on = getattr(getattr(batch, "backend", None), "gemv_max_rows", 0) > 0  # (then Triton is there)
    if args is None and not reduce and gemv_on and gemv_path(batch, x, linear, max_rows=_kernels().FMA_MAX_ROWS):
        args = epilogue_conv_args(conv, x, batch, chunk=True)
        chunk = args is not None
    if args is None:
        return conv(decode_linear(linear, x, batch), batch)
    return _kernels().gemv(x, linear.weight, prefetch_bytes=_prefetch_bytes(batch), conv=args, conv_chunk=chunk)


def decode_linear_norm(linear: nn.Module, x: torch.Tensor, batch, residual: Optional[torch.Tensor],
                       norm: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(norm(linear(x) + residual), linear(x) + residual), the norm (the next sublayer's pre-norm)
    in the epilogue of linear's GEMV (`kiln.kernels.gemv.gemv_add_norm`, one launch fewer), or
    None where that does not apply; the caller then runs linear and the norm apart. It applies
    on the GEMV path (`gemv_path`) at up to NORM_EPILOGUE_MAX_ROWS rows with `--disable-norm-epilogue` off,
    for a norm wider than `--fold-norms-max-hidden` (narrower ones fold into the prologue of the
    GEMV that reads them, `decode_prenorm`, measured faster there), without an all-reduce between
    linear and the norm, a residual like the output, and a plain RMSNorm without hooks (the
    caller checks its own modules, whose calls it splits into their parts: `hooked`)."""
    backend = getattr(batch, "backend", None)
    if not getattr(backend, "norm_epilogue", False) or residual is None or x.dim() != 2:
        return None
    n = linear.weight.shape[0]
    if (n <= getattr(backend, "fold_norms_max_hidden", 0) or residual.shape != (x.shape[0], n)
            or residual.dtype != x.dtype):
        return None
    if isinstance(linear, RowParallelLinear) and linear.reduce_output and linear.pc.tp_size > 1:
        return None
    if type(norm).forward is not RMSNorm.forward or hooked(norm):
        return None
    if not (gemv_path(batch, x, linear) and x.shape[0] <= NORM_EPILOGUE_MAX_ROWS
            and kernel_path(batch, residual, norm.weight)):
        return None
    return _kernels().gemv_add_norm(x, linear.weight, residual, norm.weight, norm.eps, norm.epilogue_counter,
                                    prefetch_bytes=_prefetch_bytes(batch))


def decode_logits(head: nn.Module, hidden: torch.Tensor, batch) -> torch.Tensor:
    """`head.compute_logits(hidden[batch.logits_indices]).float()` (a `ParallelLMHead`; the models'
    `compute_logits`). In a decode CUDA graph, whose logit rows are its rows in order
    (`CudaGraphRunner._batch`), the gather is skipped; on the GEMV path (`gemv_path`'s rules: at
    most --gemv-max-rows rows, no hooks, no subclass's `compute_logits`) the product runs through the
    GEMV, whose weight stream starts before the kernel before it completes (cuBLAS's waits for it:
    no PDL)."""
    in_order = (getattr(batch, "in_graph", False) and getattr(batch, "mode", None) is ForwardMode.DECODE
                and batch.logits_indices.shape[0] == hidden.shape[0])
    return head_logits(head, hidden if in_order else hidden[batch.logits_indices], batch)


def head_logits(head: nn.Module, rows: torch.Tensor, batch) -> torch.Tensor:
    """`head.compute_logits(rows).float()` for the rows themselves (`decode_logits` after its row
    selection; the MTP draft heads' rows), through the GEMV under `decode_logits`'s rules, except
    that with the GEMV on (--gemv-max-rows > 0) 2..MAX_ROWS rows take it too, on the MMA loop's
    head tile (69-71 us against cuBLAS + cast's 80-83 at 2-16 rows for a 49216 x 2048 head on an
    H100, and a batch-1 K = 3 round 2.72 -> 2.67 ms: docs/benchmarks.md, fiftieth pass). `batch`
    None: the module."""
    max_rows = getattr(getattr(batch, "backend", None), "gemv_max_rows", 0)
    plain = type(head).compute_logits is ParallelLMHead.compute_logits and not hooked(head)  # (an adapter's must run)
    # (the row limit last: it imports the kernels, which need Triton; off the kernel path: absent)
    if (plain and max_rows > 0 and rows.dim() == 2 and rows.dtype == head.weight.dtype
            and kernel_path(batch, rows, head.weight) and 0 < rows.shape[0] <= _kernels().MAX_ROWS):
        # fp32 logits straight from the GEMV: `.float()` of its bf16 result, bit for bit, one launch
        # fewer. One row takes the FMA loop; more the MMA loop's head tile whatever --gemv-max-rows
        # (a verify, the draft heads and decode at batch 2-16)
        return head.gather(_kernels().gemv(rows, head.weight, prefetch_bytes=_prefetch_bytes(batch),
                                           float_out=True, mma=rows.shape[0] > 1))
    return head.compute_logits(rows).float()
