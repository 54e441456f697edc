"""The most a speculative round can speed up decoding, from the bytes it must read and the plain
step it is compared with (issue 6's target: 2.5x at batch 1 for an acceptance length of 3 or more).

    python benchmarks/speedup_bound.py --model-path preset:inkling/bench --num-steps 3 \\
        --plain-step-ms 1.174 --bandwidth-tbs 4.25 --verify-experts 11.9

No GPU is needed: the bytes come from the model built on the meta device (`roofline.round_bytes`).
A round of K drafts must read everything a plain step reads plus (`roofline.round_bytes`):

- the experts its verify's K + 1 rows touch beyond one token's top-k (`--verify-experts`, the
  distinct experts per MoE layer measured with `decode_batch.py --count-experts`; default: uniform
  independent routing);
- the drafter: MTP's first K layers and K draft heads, or a block drafter and one head; a draft
  head reads the LM head's rows, or a token map's (`--draft-head-rows`, FR-Spec).

The model of time is the one the profiles support (docs/benchmarks.md, "The hybrids' batch-1 target
in numbers"): a step takes its bytes at the copy bandwidth plus H, the time its dependent launches
add beyond their bytes. A verify runs the plain step's layers in the same dependent order, so it
is taken to pay at least the plain step's H (an assumption every profiled round has met, not a
theorem); a drafter's launches are counted as free. So, with the plain step
measured at T (bytes Bp) and a round reading Br:

    round >= Br / BW + (T - Bp / BW)          speedup at acceptance length L <= L * T / round

Both bounds are optimistic for the round. The script also gives the plain step T* at which the
target becomes reachable under this bound: a faster plain step (a smaller H) lowers the ceiling,
and with both steps at the roofline (H = 0) the ceiling is L * Bp / Br.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Optional

import torch

import common
import roofline

# The DFlash drafter the H200 passes time on Inkling `bench` (benchmarks/h200_passes/s38.sh): one
# layer, block 8. Its hidden size, mask token (the last id) and three taps ([1, 12, 22] of 24
# layers) come from the target (`dflash_drafter`), so the tiny preset gets one too.
BENCH_DFLASH = {"model_type": "dflash", "num_layers": 1, "block_size": 8, "num_attention_heads": 16,
                "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144}


@dataclass
class Bound:
    """One drafter variant's round: its bytes and the speedup ceilings they leave."""

    variant: str
    round_gb: float           # bytes a round must read
    extra_gb: float           # beyond a plain step's
    round_floor_ms: float     # Br / BW + the plain step's time beyond its bytes
    speedup: dict             # L -> the ceiling L * T / round_floor
    at_roofline: dict         # L -> L * Bp / Br (both steps at the copy bandwidth)
    plain_needed_ms: Optional[float]  # the plain step from which on the target is within the ceiling
                                      # at the smallest L (None: never)


def dflash_drafter(target_cfg) -> torch.nn.Module:
    """The benches' 1-layer DFlash drafter on the meta device (shapes only)."""
    from kiln.models.block_drafter import BlockDrafter
    from kiln.models.block_drafter_config import BlockDrafterConfig

    cfg = BlockDrafterConfig.from_dict(dict(BENCH_DFLASH, hidden_size=target_cfg.hidden_size,
                                            mask_token_id=target_cfg.vocab_size - 1,
                                            target_layer_ids=_taps(target_cfg.num_hidden_layers)),
                                       target_cfg, where="speedup_bound.BENCH_DFLASH")
    with torch.device("meta"):
        return BlockDrafter(cfg, max_positions=64).to(torch.bfloat16)


def _taps(layers: int) -> list[int]:
    """Three tapped layers spread over the target, as the bench drafter's [1, 12, 22] of 24."""
    return sorted({min(1, layers - 1), layers // 2, max(layers - 2, 0)})


def plain_needed(L: float, target: float, bp_ms: float, br_ms: float) -> Optional[float]:
    """The plain step T at which L * T / (br + T - bp) equals `target` (None if L <= target: the
    target is then out of reach against any plain step)."""
    if L <= target:
        return None
    h = (target * br_ms - L * bp_ms) / (L - target)
    return bp_ms + max(h, 0.0)


def bounds(model, contexts: list[float], num_steps: int, plain_ms: float, bandwidth: float,
           accept_lengths: list[float], target: float, verify_experts: Optional[float],
           head_rows: list[Optional[int]], drafter: Optional[torch.nn.Module]) -> tuple[dict, list[Bound]]:
    """The plain step's bytes and a `Bound` per drafter variant (MTP and, given `drafter`, DFlash,
    with each draft-head size; prompt lookup, which reads no drafter)."""
    plain = roofline.roofline_bytes(model, contexts)
    bp = plain["bytes_per_step"]
    bp_ms = bp / bandwidth * 1e3
    if plain_ms < bp_ms:
        raise ValueError(f"--plain-step-ms {plain_ms}: faster than its bytes allow ({bp_ms:.3f} ms at "
                         f"{bandwidth / 1e12:.2f} TB/s); check the step time and --bandwidth-tbs")
    variants = [("ngram", None, None)]
    for rows in head_rows:
        variants.append(("mtp", rows, None))
        if drafter is not None:
            variants.append(("dflash", rows, drafter))
    out = []
    for algo, rows, dr in variants:
        rb = roofline.round_bytes(model, contexts, num_steps, algo, drafter=dr, draft_head_rows=rows,
                                  verify_experts_hit=verify_experts)
        br = rb["bytes_per_round"]
        floor = br / bandwidth * 1e3 + (plain_ms - bp_ms)
        head = "" if algo == "ngram" else (", full head" if rows is None else f", head of {rows} rows")
        needed = plain_needed(min(accept_lengths), target, bp_ms, br / bandwidth * 1e3)
        out.append(Bound(f"{algo} K={num_steps}{head}", br / 1e9, (br - bp) / 1e9, floor,
                         {L: L * plain_ms / floor for L in accept_lengths},
                         {L: L * bp / br for L in accept_lengths}, needed))
    return {"plain_gb": bp / 1e9, "plain_bytes_ms": bp_ms, "plain_ms": plain_ms}, out


def table(head: dict, rows: list[Bound], target: float, accept_lengths: list[float]) -> str:
    """`bounds`' result as a markdown table, as docs/speculative.md quotes it."""
    Ls = " | ".join(f"at L = {L:g}" for L in accept_lengths)
    lines = [f"plain step: {head['plain_gb']:.3f} GB, {head['plain_bytes_ms']:.3f} ms of bytes, "
             f"{head['plain_ms']:.3f} ms measured", "",
             f"| round | GB | beyond plain | round >= ms | {Ls} | both at the roofline, L = "
             f"{min(accept_lengths):g} | plain step needed for {target:g}x at L = {min(accept_lengths):g} |",
             "|---" * (6 + len(accept_lengths)) + "|"]
    for b in rows:
        sp = " | ".join(f"{b.speedup[L]:.2f}x" for L in accept_lengths)
        need = "never" if b.plain_needed_ms is None else f">= {b.plain_needed_ms:.3f} ms"
        lines.append(f"| {b.variant} | {b.round_gb:.3f} | {b.extra_gb:.3f} | {b.round_floor_ms:.3f} | {sp} | "
                     f"{b.at_roofline[min(accept_lengths)]:.2f}x | {need} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="preset:inkling/bench")
    p.add_argument("--num-steps", type=int, default=3, help="K, the drafts a round verifies")
    p.add_argument("--context", type=float, default=1024 + 64,
                   help="tokens attended over (the benches' 1K prompt and half their 128 outputs)")
    p.add_argument("--plain-step-ms", type=float, required=True, help="the measured plain decode step")
    p.add_argument("--bandwidth-tbs", type=float, required=True, help="the measured copy bandwidth, TB/s")
    p.add_argument("--verify-experts", type=float, default=None,
                   help="distinct routed experts a verify's K + 1 rows touch per MoE layer "
                        "(decode_batch.py --count-experts); default: uniform routing")
    p.add_argument("--draft-head-rows", default="full,16384,0",
                   help="draft-head sizes to compare: 'full' (the LM head) or a token map's rows")
    p.add_argument("--accept-lengths", default="3,4")
    p.add_argument("--target", type=float, default=2.5)
    p.add_argument("--no-dflash", action="store_true", help="leave out the bench DFlash drafter")
    p.add_argument("--out", default=None, help="also write the rows as JSON")
    args = p.parse_args(argv)

    path = common.resolve_model_path(args.model_path)
    model = roofline.meta_model(path, torch.bfloat16)
    cfg = common.model_config_of(path)
    heads = [None if r == "full" else int(r) for r in args.draft_head_rows.split(",")]
    Ls = [float(x) for x in args.accept_lengths.split(",")]
    head, rows = bounds(model, [args.context], args.num_steps, args.plain_step_ms, args.bandwidth_tbs * 1e12,
                        Ls, args.target, args.verify_experts, heads,
                        None if args.no_dflash else dflash_drafter(cfg))
    print(table(head, rows, args.target, Ls))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), **head, "rows": [asdict(b) for b in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
