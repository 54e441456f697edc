"""`DraftVocab`: the vocabulary a drafter's LM head scores (`--speculative-token-map`, FR-Spec).

A draft LM head over the whole vocabulary reads every row of the LM head for every draft: the MTP
chain once per layer (on the Inkling `bench` preset three 202 MB reads per round, a third of what a
K = 3 round must read beyond a plain step; docs/benchmarks.md, "H200, sixth pass"), a block
drafter (DFlash, DSpark) once per block for its K rows. FR-Spec (Zhao et al.,
2025) drafts from the most frequent tokens only: the draft logits are h @ W[hot]^T, the drafts
are hot[argmax], and the verify stays exact because it never trusts a draft, only checks it
against the target (greedy, point masses, or q for exact verification; q is then the drafter's
distribution over the hot tokens, 0 elsewhere).

The map is SGLang's `--speculative-token-map`: a file of token ids, `.pt` (a 1-D integer tensor or
a list, as `torch.save` writes it) or `.json` (a list). `hot_tokens` builds one from token
sequences (e.g. `kiln train-draft`'s generations): `python -m kiln.engine.spec.draft_vocab`.

The hot rows are a copy of the LM head's rows ([N, H], made once; with tensor parallelism every
rank holds all N, gathered from the ranks' vocabulary slices), so a graph can read them at a
fixed address; `refresh` copies them again after the weights change (RL updates, LoRA merges).
The copy (N x H) stays on the device when RL releases the weights to the host.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from typing import Iterable, Optional

import torch
import torch.nn.functional as F

from kiln.layers.decode_gemv import head_logits


def load_token_map(path: str, vocab_size: int) -> list[int]:
    """The token ids of a `--speculative-token-map` file, checked: a clear error for a missing
    file, an unknown format, an empty map, duplicates or ids outside the vocabulary."""
    if not os.path.isfile(path):
        raise ValueError(f"--speculative-token-map {path!r}: no such file (a .pt or .json list of token ids; "
                         f"`python -m kiln.engine.spec.draft_vocab` writes one)")
    if path.endswith(".json"):
        with open(path) as f:
            ids = json.load(f)
    elif path.endswith(".pt"):
        ids = torch.load(path, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"--speculative-token-map {path!r}: use a .pt or .json file of token ids")
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"--speculative-token-map {path!r}: expected a non-empty list of integer token ids")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"--speculative-token-map {path!r}: ids outside the vocabulary [0, {vocab_size}): {bad[:4]}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"--speculative-token-map {path!r}: token ids repeat")
    return ids


class DraftVocab:
    """Draft logits over the hot tokens (or the whole vocabulary when `ids` is None) and the map
    from their columns back to token ids."""

    def __init__(self, lm_head, ids: Optional[list[int]] = None):
        self.lm_head = lm_head
        self.vocab_size = lm_head.vocab_size
        self.ids = self.weight = None
        if ids is not None:
            self.ids = torch.tensor(ids, dtype=torch.int64, device=lm_head.weight.device)
            self.weight = torch.empty(len(ids), lm_head.weight.shape[1], dtype=lm_head.weight.dtype,
                                      device=lm_head.weight.device)
            self.refresh()

    def refresh(self) -> None:
        """Copy the hot rows of the LM head again (after its weights changed), in place. With
        tensor parallelism each rank holds a slice of the vocabulary's rows and every rank gets
        every hot row: each fills in the rows of its slice, and a sum over the ranks assembles
        them (every rank calls this, as every rank applies each weight update)."""
        if self.ids is None:
            return
        w, pc = self.lm_head.weight, self.lm_head.pc
        if pc.tp_size == 1:
            self.weight.copy_(w.index_select(0, self.ids.to(w.device)))
            return
        local = self.ids.to(w.device) - self.lm_head.start
        mine = (local >= 0) & (local < w.shape[0])
        rows = torch.zeros_like(self.weight)
        rows[mine] = w.index_select(0, local[mine])
        self.weight.copy_(pc.all_reduce(rows))

    def logits(self, h: torch.Tensor, batch=None) -> torch.Tensor:
        """fp32 draft logits [..., size]. With the forward's `batch`, a head over the whole
        vocabulary takes the GEMV where the LM head of a decode step would
        (`kiln.layers.decode_gemv.head_logits`: in the forty-third and forty-fourth passes'
        H100 timelines the MTP draft head at batch 1 took ~75 us on cuBLAS where a decode step's
        LM head took ~65 us on the GEMV; this path itself is not yet timed on a GPU)."""
        if self.ids is None:
            return head_logits(self.lm_head, h, batch)
        return F.linear(h, self.weight).float()

    def tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """Token ids of draft-logit columns (e.g. their argmax)."""
        return columns if self.ids is None else self.ids[columns]

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the whole vocabulary, -inf outside the hot tokens: what the sampler
        processes into q (zero there) and what tests compare."""
        if self.ids is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids, logits)


def hot_tokens(sequences: Iterable[Iterable[int]], size: int) -> list[int]:
    """The `size` most frequent ids of `sequences` (ties: the lower id first), most frequent first."""
    counts = Counter(t for seq in sequences for t in seq)
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description="Write a --speculative-token-map: the most frequent token ids of "
                                            "a JSONL of generations (kiln train-draft's DIR/data/generations.jsonl).")
    p.add_argument("--data", required=True, help="JSONL with 'output_ids' (and optionally 'prompt_ids') per line.")
    p.add_argument("--size", type=int, required=True, help="Tokens in the map.")
    p.add_argument("--with-prompts", action="store_true", help="Count prompt tokens too.")
    p.add_argument("--out", required=True, help="Output file: .pt (torch.save of an int64 tensor) or .json.")
    args = p.parse_args(argv)
    with open(args.data) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    seqs = [r.get("prompt_ids", []) + r["output_ids"] if args.with_prompts else r["output_ids"] for r in rows]
    ids = hot_tokens(seqs, args.size)
    if args.out.endswith(".json"):
        with open(args.out, "w") as f:
            json.dump(ids, f)
    else:
        torch.save(torch.tensor(ids, dtype=torch.int64), args.out)
    hot, total = set(ids), sum(len(s) for s in seqs)
    covered = sum(1 for s in seqs for t in s if t in hot)
    print(f"wrote {len(ids)} token ids to {args.out}: they cover {covered / max(total, 1):.1%} of the "
          f"{total} counted tokens")


if __name__ == "__main__":
    main()
