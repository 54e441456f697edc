"""The reference forward: whole packed sequences, no cache, every row's logits.

What tests compare the engine against, and what the trainer recomputes logprobs with. Positions
restart at 0 at every sequence start and nothing reads across one, so packing sequences together
gives each the logits it would get alone. Works for every Kiln model (Llama family, Inkling).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kiln.engine.batch import ForwardBatch, ForwardMode
from kiln.layers.attention import PackedAttentionBackend


def packed_batch(input_ids: torch.Tensor, seq_lens: Sequence[int],
                 replay: Optional[dict[int, torch.Tensor]] = None, pad_under_grad: bool = False) -> ForwardBatch:
    """A TRAIN-mode batch over sequences packed along dim 0 of `input_ids` [T] (`pad_under_grad`:
    see `PackedAttentionBackend`)."""
    seq_lens = [int(n) for n in seq_lens]
    assert sum(seq_lens) == input_ids.shape[0], (seq_lens, tuple(input_ids.shape))
    dev = input_ids.device
    positions = torch.cat([torch.arange(n, device=dev) for n in seq_lens])
    batch = ForwardBatch(mode=ForwardMode.TRAIN, input_ids=input_ids, positions=positions,
                         prefix_lens=[0] * len(seq_lens), extend_lens=seq_lens,
                         logits_indices=torch.arange(input_ids.shape[0], device=dev),
                         backend=PackedAttentionBackend(pad_under_grad))
    if replay is not None:
        # {moe_layer_index: LongTensor [T, k]}: MoE gates use these ids instead of their top-k.
        batch.extras["replay_experts"] = replay
    return batch


def packed_forward(model: torch.nn.Module, input_ids: torch.Tensor, seq_lens: Sequence[int],
                   replay: Optional[dict[int, torch.Tensor]] = None
                   ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """(logits [T, V] fp32, routed experts {moe_layer_index: int32 [T, k]}; empty for dense models).

    Runs under the caller's grad mode, so the trainer can backpropagate through it."""
    batch = packed_batch(input_ids, seq_lens, replay)
    hidden = model(batch)
    return model.compute_logits(hidden, batch), batch.extras.get("routed_experts", {})
