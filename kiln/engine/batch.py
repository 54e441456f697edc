"""`ForwardBatch`: everything one model forward sees.

A batch is a list of sequences, each contributing `extend_len` new tokens on top of `prefix_len`
tokens whose state is already cached. Prefill, chunked prefill, decode (extend_len == 1) and mixed
batches are all the same shape of data; `mode` only tells kernels which fast path applies.
The trainer builds the same object for packed sequences with `prefix_len == 0` and no cache.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # every sequence adds >= 1 token, at least one adds more than one
    DECODE = "decode"  # every sequence adds exactly one token
    TRAIN = "train"  # packed whole sequences, no cache (the trainer's reference forward)


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    prefix_lens: list[int]  # [B] tokens already cached per sequence
    extend_lens: list[int]  # [B] new tokens per sequence (sum == T)
    logits_indices: torch.Tensor  # [N] rows of the hidden states whose logits are wanted
    # Cache addressing (None in TRAIN mode)
    req_slots: Optional[torch.Tensor] = None  # [B] rows of req_to_token
    out_cache_loc: Optional[torch.Tensor] = None  # [T] main-space token slots receiving this forward's state
    win_out_locs: dict = field(default_factory=dict)  # window space name -> [T] token slots
    # The state backend: executes every op that reads or writes cached state (attention, and for
    # hybrid models ShortConv and MSA). Paged in the engine, packed (no cache) in the trainer.
    backend: Any = None
    # Per-forward scratch owned by layers (e.g. routing capture); never read across forwards.
    extras: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def extend_starts(self) -> list[int]:
        """Offset of each sequence's first new token in the flat token dimension."""
        starts, acc = [], 0
        for e in self.extend_lens:
            starts.append(acc)
            acc += e
        return starts
