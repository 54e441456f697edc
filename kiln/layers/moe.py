"""Mixture-of-experts layers shared by Inkling (`SinkMoE`) and MiniMax-M3 (`MiniMaxMoE`).

- `SinkGate` / `MiniMaxGate`: the routers (MODELS.md 2.3 / 3.2), fp32, ties to the lower id.
- `Experts`: routed SwiGLU experts stacked as `w13 [E, 2I, H]` and `w2 [E, H, I]`.
- `SharedExperts`: always-on SwiGLU experts in the "linearised" layout (one gate/up GEMM, one down
  GEMM for all of them), optionally weighted per token.
- Routing capture / replay (RL): every gate records the ids it used in
  `batch.extras["routed_experts"][moe_index]` (int32 [T, k]); when
  `batch.extras["replay_experts"]` holds ids for its `moe_index`, it uses them instead of its own
  top-k, but recomputes the weights from the live router so gradients still reach it.

Tensor parallelism shards the expert intermediate dim; routers are replicated.

Two paths compute the same thing. The reference ops in `kiln.ops.moe` run on the CPU, whenever
autograd records (training, RL recompute) and, for a gate, when its ids are replayed (so ids and
gradients stay exact). Otherwise, on CUDA with Triton, the fused kernels in `kiln.kernels.moe` run:
one kernel per router and one grouped-GEMM pipeline for routed + shared experts. That path has no
host syncs (the engine captures decode in CUDA graphs); choosing it looks only at devices, dtypes
and `requires_grad`, never at tensor values.
"""

from __future__ import annotations

import functools
import re
from typing import Iterator, Optional

import torch
from torch import nn

from kiln import kernels
from kiln.dist.parallel import SINGLE, ParallelContext
from kiln.layers.decode_gemv import epilogue_conv_args
from kiln.ops import moe as ref_ops


def _frozen(*shape: int) -> nn.Parameter:
    # Engine convention: parameters start without grad; the trainer enables what it trains.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _router_weight(*shape: int) -> nn.Parameter:
    """A router's weight: kept in fp32 whatever the serving dtype (`cast_parameters`), since the
    router GEMM runs in fp32 (`F.linear(x.float(), weight.float())` is then a no-op on the weight)."""
    p = _frozen(*shape)
    p.keep_fp32 = True
    return p


@functools.lru_cache(maxsize=None)
def _kernel_ops():
    # Imported on first use: it needs Triton, which the CPU build of torch does not ship.
    from kiln.kernels import moe
    return moe


def _use_kernels(x: torch.Tensor, *tensors: Optional[torch.Tensor]) -> bool:
    """Fused Triton kernels apply: CUDA with Triton, and autograd records nothing through these
    tensors (the kernels have no backward)."""
    if not kernels.kernels_supported(x.device):
        return False
    return not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad for t in (x, *tensors))


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """The experts' fp32 silu(gate) * up (`kiln.ops.moe.swiglu_act`): one Triton launch with an fp32
    result when `_use_kernels` allows it (the expert paths the fused GEMMs do not cover: shared
    experts they cannot fold in, LoRA experts under no_grad), else the reference."""
    if _use_kernels(gate_up):
        from kiln.kernels.activation import silu_and_mul

        return silu_and_mul(gate_up, torch.float32)
    return ref_ops.swiglu_act(gate_up)


def _router_gemv(batch) -> bool:
    """Whether the router's logits of a few rows go through Kiln's GEMV: on the engine's kernel
    path with the decode GEMV on (`--gemv-max-rows` > 0). Up to WIDEN_MAX_ROWS rows (blocks of 4
    side by side) whatever the flag's row limit, for decode batches and speculative verifies:
    there cuBLAS runs the fp32 GEMM as a cast, a split-K SIMT kernel and its reduction
    (`kiln.kernels.moe_gate.router_logits`; docs/benchmarks.md has the measurements)."""
    backend = getattr(batch, "backend", None)
    return getattr(backend, "use_kernels", False) and getattr(backend, "gemv_max_rows", 0) > 0


def _fused_gate_counter(gate: nn.Module, batch) -> Optional[torch.Tensor]:
    """The gate's selection counter when its logits and gate run as one launch: on the router
    GEMV's path (`_router_gemv`) with `--fused-router-gate`; None otherwise (two launches)."""
    backend = getattr(batch, "backend", None)
    return gate.selection_counter if _router_gemv(batch) and getattr(backend, "fused_router_gate", False) else None


def _selection_counter(gate: nn.Module) -> None:
    """The fused router kernel's program count (`kiln.kernels.moe_gate._router_gate_kernel`):
    int32 [1], zero between calls (the kernel's last program resets it), one per gate so that no
    two layers share it; not part of the checkpoint."""
    gate.register_buffer("selection_counter", torch.zeros(1, dtype=torch.int32), persistent=False)


def _routing(gate: nn.Module, batch, compute):
    """Run `compute(forced_ids)` with replayed ids if the batch has some for this gate, and record
    the ids used."""
    extras = batch.extras if batch is not None else None
    replay = (extras or {}).get("replay_experts") or {}
    forced = replay.get(gate.moe_index)
    out = compute(forced)
    if extras is not None and getattr(batch, "record_routing", True):
        extras.setdefault("routed_experts", {})[gate.moe_index] = out[0].int()
    return out


class SinkGate(nn.Module):
    """Inkling's router: forward(x, batch, logits=None) -> (topk_ids [T,k] int64, routed_w [T,k] fp32,
    shared_w [T,S] fp32). `logits` = F.linear(x.float(), weight) when the caller has them (the
    router GEMV with the layer's norm in its prologue, `kiln.layers.decode_gemv.decode_prenorm`):
    the kernel path then selects from them; the reference path (replayed ids, autograd) ignores them."""

    def __init__(self, hidden: int, num_experts: int, num_shared: int, top_k: int,
                 route_scale: float = 1.0, moe_index: int = 0):
        super().__init__()
        self.num_experts, self.num_shared, self.top_k = num_experts, num_shared, top_k
        self.route_scale = float(route_scale)
        self.moe_index = moe_index
        self.weight = _router_weight(num_experts + num_shared, hidden)
        # Load-balancing bias: steers selection only, adjusted outside autograd.
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.global_scale = nn.Parameter(torch.ones(()), requires_grad=False)
        _selection_counter(self)

    def forward(self, x: torch.Tensor, batch=None, logits: Optional[torch.Tensor] = None):
        def compute(forced):
            if forced is None and _use_kernels(x, self.weight, self.global_scale):
                return _kernel_ops().sink_gate(x, self.weight, self.expert_bias, self.global_scale,
                                               self.top_k, self.route_scale, _router_gemv(batch),
                                               _fused_gate_counter(self, batch), logits)
            return ref_ops.sink_gate_ref(x, self.weight, self.expert_bias, self.global_scale,
                                         self.top_k, self.route_scale, forced)
        return _routing(self, batch, compute)


class MiniMaxGate(nn.Module):
    """MiniMax-M3's router: forward(x, batch, logits=None) -> (topk_ids [T,k] int64, routed_w [T,k]
    fp32); `logits` as in `SinkGate`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, routed_scaling_factor: float = 1.0,
                 moe_index: int = 0):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.moe_index = moe_index
        self.weight = _router_weight(num_experts, hidden)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        _selection_counter(self)

    def forward(self, x: torch.Tensor, batch=None, logits: Optional[torch.Tensor] = None):
        def compute(forced):
            if forced is None and _use_kernels(x, self.weight):
                return _kernel_ops().minimax_gate(x, self.weight, self.e_score_correction_bias,
                                                  self.top_k, self.routed_scaling_factor, _router_gemv(batch),
                                                  _fused_gate_counter(self, batch), logits)
            return ref_ops.minimax_gate_ref(x, self.weight, self.e_score_correction_bias, self.top_k,
                                            self.routed_scaling_factor, forced)
        return _routing(self, batch, compute)


def _load_swiglu_slice(w13: torch.Tensor, w2: torch.Tensor, inter: int, pc: ParallelContext,
                       kind: str, loaded: torch.Tensor, gate_rows: slice, up_rows: slice,
                       down_cols: slice) -> None:
    """Copy this rank's shard of one expert's gate/up/down matrix into stacked storage."""
    start, n = pc.shard(inter)
    if kind == "down":
        w2[:, down_cols].copy_(loaded[:, start:start + n])
    else:
        w13[gate_rows if kind == "gate" else up_rows].copy_(loaded[start:start + n])


class Experts(nn.Module):
    """Routed SwiGLU experts. forward(x [T,H], topk_ids [T,k], topk_weights [T,k] fp32) -> [T,H]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, pc: ParallelContext = SINGLE,
                 reduce_output: bool = True):
        super().__init__()
        self.pc, self.reduce_output = pc, reduce_output
        self.num_experts, self.intermediate = num_experts, intermediate
        _, self.inter_per_rank = pc.shard(intermediate)
        self.w13 = _frozen(num_experts, 2 * self.inter_per_rank, hidden)
        self.w2 = _frozen(num_experts, hidden, self.inter_per_rank)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """shard_id = (expert, "gate" | "up" | "down"): checkpoint `experts.{e}.{kind}_proj`."""
        e, kind = shard_id
        n = self.inter_per_rank
        _load_swiglu_slice(self.w13.data[e], self.w2.data[e], self.intermediate, self.pc, kind,
                           loaded.to(param.dtype), slice(0, n), slice(n, 2 * n), slice(0, n))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if _use_kernels(x, self.w13, self.w2, topk_weights):
            out = _kernel_ops().fused_experts(x, self.w13, self.w2, topk_ids, topk_weights, torch.float32)
        else:
            out = ref_ops.experts_torch(x, self.w13, self.w2, topk_ids, topk_weights, torch.float32)
        if self.reduce_output:
            out = self.pc.all_reduce(out)
        return out.to(out_dtype or x.dtype)

    def checkpoint_items(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(on-disk name, tensor) per expert matrix, e.g. `{prefix}experts.3.up_proj.weight`."""
        n = self.inter_per_rank
        for e in range(self.num_experts):
            yield f"{prefix}experts.{e}.gate_proj.weight", self.w13[e, :n]
            yield f"{prefix}experts.{e}.up_proj.weight", self.w13[e, n:]
            yield f"{prefix}experts.{e}.down_proj.weight", self.w2[e]


class SharedExperts(nn.Module):
    """S always-on SwiGLU experts stored linearised: `w13 [2*S*I, H]` = [gate_0..; up_0..],
    `w2 [H, S*I]` = [down_0 | down_1 ..], so all of them run as two dense GEMMs.
    forward(x, weights [T,S] fp32 or None) -> fp32 [T,H] (this rank's partial sum under TP)."""

    def __init__(self, num_shared: int, hidden: int, intermediate: int, pc: ParallelContext = SINGLE,
                 indexed: bool = True):
        super().__init__()
        self.pc, self.num_shared, self.intermediate = pc, num_shared, intermediate
        self.indexed = indexed  # on disk: shared_experts.{s}.* (True) or shared_experts.* (False)
        _, self.inter_per_rank = pc.shard(intermediate)
        self.w13 = _frozen(2 * num_shared * self.inter_per_rank, hidden)
        self.w2 = _frozen(hidden, num_shared * self.inter_per_rank)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader

    def _rows(self, s: int) -> tuple[slice, slice, slice]:
        n, half = self.inter_per_rank, self.num_shared * self.inter_per_rank
        return slice(s * n, (s + 1) * n), slice(half + s * n, half + (s + 1) * n), slice(s * n, (s + 1) * n)

    def weight_loader(self, param, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        s, kind = shard_id
        _load_swiglu_slice(self.w13.data, self.w2.data, self.intermediate, self.pc, kind,
                           loaded.to(param.dtype), *self._rows(s))

    def forward(self, x: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        return ref_ops.shared_experts_ref(x, self.w13, self.w2, weights, act=swiglu)

    def checkpoint_items(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        for s in range(self.num_shared):
            gate, up, down = self._rows(s)
            base = f"{prefix}shared_experts.{s}." if self.indexed else f"{prefix}shared_experts."
            yield base + "gate_proj.weight", self.w13[gate]
            yield base + "up_proj.weight", self.w13[up]
            yield base + "down_proj.weight", self.w2[:, down]


def _routed_plus_shared(experts: Experts, shared: SharedExperts, x: torch.Tensor, ids: torch.Tensor,
                        routed_w: torch.Tensor, shared_w: Optional[torch.Tensor],
                        pc: ParallelContext, out_conv: Optional[nn.Module] = None, batch=None) -> torch.Tensor:
    """The MoE layer's output [T, H] in x's dtype: routed + shared experts summed in fp32, the sum
    all-reduced over the TP ranks, cast once, then `out_conv` if given. On the kernel path the
    shared experts are always-selected extra slots of the routed grouped GEMMs, and on one rank
    the single cast happens there too (under TP the fp32 partial sums wait for the all-reduce).

    `out_conv`: a ShortConv on the layer's output (Inkling's out_conv): in the epilogue of the
    experts' last kernel where it runs there (one rank; a decode step on the expert GEMVs, or a
    verify's short chunks of at most a few tokens on the grouped path: `kiln.kernels.moe.takes_conv`,
    `epilogue_conv_args`), else as its own call after the all-reduce."""
    out_dtype = torch.float32 if pc.tp_size > 1 else x.dtype
    # A subclass with its own forward (the LoRA mixin adds adapters to the weights) keeps it.
    plain = type(experts).forward is Experts.forward
    out = None
    if plain and _use_kernels(x, experts.w13, experts.w2, shared.w13, shared.w2, routed_w, shared_w):
        ops = _kernel_ops()
        if ops.shared_chunks(experts.inter_per_rank, shared.w2, shared_w):
            conv, chunk = None, False
            gemv_tokens = getattr(getattr(batch, "backend", None), "moe_gemv_max_tokens", None)
            if out_conv is not None and pc.tp_size == 1:
                # a decode step on the expert GEMVs: the down GEMV's epilogue; a verify's short
                # chunks on the grouped path: the slot sum's. Decode steps of 2-4 tokens keep the
                # separate conv (with it in the sum, batch 4 ran 2% slower: nineteenth pass).
                if ops.on_gemv_path(x.shape[0], gemv_max_tokens=gemv_tokens):
                    conv = epilogue_conv_args(out_conv, x, batch)
                elif ops.takes_conv(x.shape[0], gemv_max_tokens=gemv_tokens, chunk=True):
                    conv = epilogue_conv_args(out_conv, x, batch, chunk=True)
                    chunk = conv is not None
            out = ops.fused_experts(x, experts.w13, experts.w2, ids, routed_w, out_dtype,
                                    shared=(shared.w13, shared.w2, shared_w), conv=conv, gemv_max_tokens=gemv_tokens,
                                    conv_chunk=chunk)
            if conv is not None:
                return out
    if out is None:
        out = (experts(x, ids, routed_w, torch.float32) + shared(x, shared_w)).to(out_dtype)
    out = pc.all_reduce(out).to(x.dtype)
    return out if out_conv is None else out_conv(out, batch)


class SinkMoE(nn.Module):
    """Inkling's MoE: sum_{j in T} w_j Expert_j(m) + sum_s w_s Shared_s(m), fp32, cast once."""

    def __init__(self, cfg, moe_index: int, pc: ParallelContext = SINGLE):
        super().__init__()
        self.pc = pc
        self.router = SinkGate(cfg.hidden_size, cfg.num_experts, cfg.num_shared_experts,
                               cfg.num_experts_per_tok, cfg.route_scale, moe_index)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, pc,
                               reduce_output=False)
        self.shared_experts = SharedExperts(cfg.num_shared_experts, cfg.hidden_size,
                                            cfg.moe_intermediate_size, pc)

    def forward(self, x: torch.Tensor, batch=None, out_conv: Optional[nn.Module] = None,
                router_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The MoE output, through `out_conv` (a ShortConv on it) when given: at a decode step on the
        expert GEMVs (batch 1 by default) or a verify of at most a few tokens that conv runs in the
        expert kernels' epilogue (`_routed_plus_shared`), so a forward hook on this module sees the
        output after the conv. `router_logits`: the router's logits of x
        when the caller has them (`SinkGate`)."""
        ids, routed_w, shared_w = self.router(x, batch, router_logits)
        return _routed_plus_shared(self.experts, self.shared_experts, x, ids, routed_w, shared_w, self.pc,
                                   out_conv, batch)


class MiniMaxMoE(nn.Module):
    """MiniMax-M3's MoE: sum_{j in T} w_j Expert_j(m) + SharedExpert(m) (weight 1), fp32, cast once."""

    def __init__(self, cfg, moe_index: int, pc: ParallelContext = SINGLE):
        super().__init__()
        self.pc = pc
        self.gate = MiniMaxGate(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                getattr(cfg, "routed_scaling_factor", 1.0), moe_index)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, pc,
                               reduce_output=False)
        # One conventional shared expert (`shared_experts.{gate,up,down}_proj` on disk), sized like
        # DeepSeek's: num_shared_experts * moe_intermediate_size.
        shared_inter = cfg.moe_intermediate_size * int(getattr(cfg, "num_shared_experts", 1) or 1)
        self.shared_experts = SharedExperts(1, cfg.hidden_size, shared_inter, pc, indexed=False)

    def forward(self, x: torch.Tensor, batch=None, router_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The MoE output; `router_logits`: the gate's logits of x when the caller has them (`MiniMaxGate`)."""
        ids, routed_w = self.gate(x, batch, router_logits)
        return _routed_plus_shared(self.experts, self.shared_experts, x, ids, routed_w, None, self.pc, batch=batch)


_EXPERT_NAME = re.compile(r"^(.*\.)?experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_SHARED_NAME = re.compile(r"^(.*\.)?shared_experts\.(?:(\d+)\.)?(gate|up|down)_proj\.weight$")


def moe_param_for(name: str) -> Optional[tuple[str, tuple[int, str]]]:
    """Map an on-disk expert tensor name to (our parameter name, shard_id for its weight_loader);
    None if `name` is not a routed or shared expert matrix.

    `model.layers.3.mlp.experts.5.up_proj.weight` -> (`model.layers.3.mlp.experts.w13`, (5, "up"))
    `...mlp.shared_experts.1.down_proj.weight` -> (`...mlp.shared_experts.w2`, (1, "down"))
    `...mlp.shared_experts.gate_proj.weight` (MiniMax) -> (`...mlp.shared_experts.w13`, (0, "gate"))
    """
    m = _SHARED_NAME.match(name)
    if m:
        prefix, idx, kind = m.group(1) or "", m.group(2), m.group(3)
        return f"{prefix}shared_experts.{'w2' if kind == 'down' else 'w13'}", (int(idx or 0), kind)
    m = _EXPERT_NAME.match(name)
    if m:
        prefix, e, kind = m.group(1) or "", int(m.group(2)), m.group(3)
        return f"{prefix}experts.{'w2' if kind == 'down' else 'w13'}", (e, kind)
    return None
