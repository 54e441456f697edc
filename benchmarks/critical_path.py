"""What each kernel costs a decode step on its critical path: decode with some launches cut.

    python benchmarks/critical_path.py --cut attention -- --model-path preset:inkling/bench \
        --dummy-init auto --batch-sizes 1 --input-len 1024 --output-len 128 --cuda-graph-max-bs 8

runs `decode_batch.py` (the arguments after `--`) with the named kernels made no-ops: their
launches return at once, so neither the GPU nor the stream waits for them. A batch-1 step is a
chain of dependent kernels (PDL overlaps each launch with its predecessor's tail), so the step
time a cut saves is what that kernel adds to the chain: its bytes and its latency together, the
number a profile cannot give (a PDL kernel is charged from its launch, while it still waits).
Compare a cut's saving with the bytes the kernel reads at the measured bandwidth to see how much
of it is latency. The outputs of a cut kernel are whatever its buffers held, so the step's tokens
are garbage; every later kernel does the same work whatever the values, yet on an H200 the cuts
that took a step far below the real one timed bimodally between runs (e.g. 0.49 or 1.07 ms for
the same cut; docs/benchmarks.md, twenty-second pass): repeat a run before trusting it. Cuts
(`CUTS`):

- `gate`: the MoE router's selection (sink gate, MiniMax-M3's gate) returns fixed distinct experts
  with equal weights, without a launch (the router GEMV before it still runs). Every cut but
  `norm` implies it (`IMPLIES`), so compare the others with a `gate` run;
- `prologue`: Inkling's conv + q/k-norm + cache-write attention prologue (with
  `--attention-prologue-max-bs` above 0 it runs inside the decode attention, which this cut does
  not touch), MiniMax-M3's norms + RoPEs + cache-write prologue;
- `attention`: decode attention (split kernel and its merge), MSA's scores, selection, sparse
  attention and combine;
- `experts`: the one-token expert GEMVs (gate/up and down + out_conv);
- `expert_up` / `expert_down`: one of them;
- `grouped`: the grouped expert GEMMs with their align and slot-sum launches (a verify's MoE);
- `gemv`: every dense GEMV (projections, routers, the LM head);
- `norm`: the RMSNorm launches (those not folded into a GEMV: the final norm).

Several `--cut` flags, or one comma-separated list, cut together. This is a measuring tool: it
patches module attributes of this process only and never runs inside the engine proper.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Optional

import torch

# cut -> the Triton kernels (module, attribute) whose launches become no-ops
KERNELS: dict[str, list[tuple[str, str]]] = {
    "prologue": [("kiln.kernels.conv_qk_norm", "_conv_qk_norm_kernel"),
                 ("kiln.kernels.msa_prologue", "_msa_prologue_kernel")],
    "attention": [("kiln.kernels.decode_attention", "_decode_kernel"),
                  ("kiln.kernels.decode_attention", "_merge_kernel"),
                  ("kiln.kernels.msa_scores", "_decode_scores_kernel"), ("kiln.kernels.msa", "_select_kernel"),
                  ("kiln.kernels.msa", "_sparse_attn_kernel"), ("kiln.kernels.msa", "_combine_kernel")],
    "expert_up": [("kiln.kernels.moe_gemv", "_expert_up_gemv_kernel")],
    "expert_down": [("kiln.kernels.moe_gemv", "_expert_down_gemv_kernel")],
    "gemv": [("kiln.kernels.gemv", "_gemv_fma_kernel"), ("kiln.kernels.gemv", "_gemv_dot_kernel")],
    "norm": [("kiln.kernels.norm", "_rms_norm_kernel")],
}
KERNELS["experts"] = KERNELS["expert_up"] + KERNELS["expert_down"]
# the grouped path (a speculative verify, decode past one token): all of it, or the gate/up GEMM
# would read the garbage of a cut align
KERNELS["grouped"] = [("kiln.kernels.moe", k) for k in
                      ("_align_kernel", "_gate_up_kernel", "_down_kernel", "_sum_slots_kernel", "_sum_slots_conv_kernel")]
# A cut kernel's output is garbage, which can reach a router as NaN logits, and a selection over
# NaN names an expert that does not exist: every cut upstream of a router also cuts the gate (fixed
# routing). So a kernel's cost is T(gate) - T(gate + kernel); the gate's own is T(none) - T(gate).
IMPLIES = {cut: ["gate"] for cut in KERNELS if cut != "norm"}  # the final norm feeds no router
CUTS = sorted([*KERNELS, "gate"])


def _skip_launch(*args, **kwargs) -> None:
    return None


def _fixed_routing(top_k: int, num_experts: int, num_tokens: int, device, cache: dict):
    """Distinct experts 0, s, 2s, ... (s spreads them over the table) for every token, cached per
    shape so that a CUDA graph captures stable addresses."""
    key = (top_k, num_experts, num_tokens, str(device))
    if key not in cache:
        step = max(num_experts // top_k, 1)
        ids = (torch.arange(top_k, device=device) * step % num_experts).repeat(num_tokens, 1)
        cache[key] = ids
    return cache[key]


def _fixed_gates() -> dict[str, Callable]:
    """Replacements for `sink_gate` / `minimax_gate` (their signatures) returning fixed routing."""
    cache: dict = {}

    def sink_gate(x, weight, expert_bias, global_scale, top_k, route_scale, *args, **kwargs):
        e, t = expert_bias.shape[0], x.shape[0]
        s = weight.shape[0] - e
        ids = _fixed_routing(top_k, e, t, x.device, cache)
        key = ("sink_w", top_k, s, t, str(x.device))
        if key not in cache:
            w = torch.full((t, top_k + s), 1.0 / (top_k + s), dtype=torch.float32, device=x.device)
            cache[key] = (w[:, :top_k].contiguous(), w[:, top_k:].contiguous())
        return (ids, *cache[key])

    def minimax_gate(x, weight, bias, top_k, routed_scaling_factor, *args, **kwargs):
        e, t = weight.shape[0], x.shape[0]
        ids = _fixed_routing(top_k, e, t, x.device, cache)
        key = ("mm_w", top_k, t, str(x.device))
        if key not in cache:
            cache[key] = torch.full((t, top_k), 1.0 / top_k, dtype=torch.float32, device=x.device)
        return ids, cache[key]

    return {"sink_gate": sink_gate, "minimax_gate": minimax_gate}


def expand(cuts: list[str]) -> list[str]:
    """The cuts with what they imply, in `CUTS` order; ValueError naming the choices on an unknown one."""
    out = set()
    for c in cuts:
        if c not in CUTS:
            raise ValueError(f"unknown cut {c!r}; choose from {', '.join(CUTS)}")
        out.add(c)
        out.update(IMPLIES.get(c, []))
    return [c for c in CUTS if c in out]


def install(cuts: list[str]) -> Callable[[], None]:
    """Make the named kernels no-ops in this process; returns a function that undoes it."""
    undo: list[Callable[[], None]] = []
    for cut in expand(cuts):
        if cut == "gate":
            moe = importlib.import_module("kiln.kernels.moe")
            for name, fn in _fixed_gates().items():
                old = getattr(moe, name)
                setattr(moe, name, fn)
                undo.append(lambda name=name, old=old: setattr(moe, name, old))
            continue
        for module, attr in KERNELS[cut]:
            kernel = getattr(importlib.import_module(module), attr)
            # `kernel[grid](...)` looks `run` up on the instance first
            kernel.run = _skip_launch
            undo.append(lambda kernel=kernel: kernel.__dict__.pop("run", None))
    return lambda: [u() for u in reversed(undo)]


def main(argv: Optional[list[str]] = None) -> dict:
    # decode_batch and kiln (uninstalled) importable; done here, not at import, because
    # benchmarks/kernel_bench would shadow the `kernels` package (transformers probes for it) in the
    # process that imports this module
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.dirname(here), here]
    argv = list(sys.argv[1:] if argv is None else argv)
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cut", action="append", default=[], help=f"Kernels to cut (comma-separated): {', '.join(CUTS)}.")
    args = p.parse_args(own)
    cuts = expand([c for arg in args.cut for c in arg.split(",") if c])
    print(f"# critical_path: cut {', '.join(cuts) or 'nothing'}", flush=True)
    install(cuts)
    import decode_batch
    return decode_batch.main(rest)


if __name__ == "__main__":
    main()
