"""`ForwardBatch`: everything one model forward sees.

A batch is a list of sequences, each contributing `extend_len` new tokens on top of `prefix_len`
tokens whose state is already cached. Prefill, chunked prefill, decode (extend_len == 1) and mixed
batches are all the same shape of data; `mode` only tells kernels which fast path applies.
The trainer builds the same object for packed sequences with `prefix_len == 0` and no cache.
"""

from __future__ import annotations

import array
import enum
import itertools
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
    # MoE gates record the expert ids they used in extras["routed_experts"] (RL routing capture and
    # replay). The engine turns it off unless --enable-return-routed-experts: the int32 copy is a
    # kernel per MoE layer in every step.
    record_routing: bool = True
    # Device copies of the per-sequence lengths for kernels, which must not read host lists
    # (a CUDA graph replays them with new values). Set by `set_device_metadata`.
    seq_lens_t: Optional[torch.Tensor] = None  # [B] int64, prefix + extend
    prefix_lens_t: Optional[torch.Tensor] = None  # [B] int64
    extend_lens_t: Optional[torch.Tensor] = None  # [B] int64
    extend_starts_t: Optional[torch.Tensor] = None  # [B] int64
    max_extend_len: int = 0  # host int: the extend kernels' grid
    # A CUDA graph's batch (`CudaGraphRunner`): its host length lists are the shape's
    # placeholders, so no kernel may size anything from them (only the device copies above hold
    # the replay's lengths).
    in_graph: bool = False
    # Taps for block drafters (speculative decoding): the model's layer loop keeps the input hidden
    # state of every layer listed here (the residual entering it, SGLang's capture convention).
    capture_layers: tuple = ()
    captured: dict = field(default_factory=dict)  # layer id -> [T, H]

    def capture(self, layer_id: int, h: torch.Tensor, residual: Optional[torch.Tensor] = None) -> None:
        """Called by the model loop with the stream entering layer `layer_id`: the layers carry it
        as (h, residual) (vLLM's layout), so the tap is h + residual (h alone before layer 0)."""
        if layer_id in self.capture_layers:
            self.captured[layer_id] = h if residual is None else h + residual

    def taps(self) -> torch.Tensor:
        """The captured hidden states concatenated in `capture_layers` order: [T, len * H]."""
        return torch.cat([self.captured[i] for i in self.capture_layers], dim=-1)

    @staticmethod
    def length_lists(prefix_lens: list[int], extend_lens: list[int]) -> dict[str, list[int]]:
        """The per-sequence lengths kernels read, as lists to copy (with the batch's other inputs,
        in one transfer) and hand to `set_device_metadata`."""
        starts = list(itertools.accumulate(extend_lens[:-1], initial=0)) if extend_lens else []
        return {"meta:seq": [p + e for p, e in zip(prefix_lens, extend_lens)], "meta:prefix": list(prefix_lens),
                "meta:extend": list(extend_lens), "meta:start": starts}

    def set_device_metadata(self, t: dict[str, torch.Tensor]) -> "ForwardBatch":
        """Take the device copies of `length_lists` (keys as it names them)."""
        self.seq_lens_t, self.prefix_lens_t = t["meta:seq"], t["meta:prefix"]
        self.extend_lens_t, self.extend_starts_t = t["meta:extend"], t["meta:start"]
        self.max_extend_len = max(self.extend_lens, default=0)
        return self

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


def int64_to_device(lists: dict[str, list[int]], device) -> dict[str, torch.Tensor]:
    """Several int lists as int64 tensors on `device` through one (pinned, asynchronous on CUDA)
    host-to-device copy: a decode step has a dozen small inputs, and one copy each would cost a
    dozen synchronous transfers."""
    names, sizes, flat = list(lists), [len(v) for v in lists.values()], []
    for v in lists.values():
        flat.extend(v)
    dev = host_tensor(flat, torch.int64, device).to(device, non_blocking=True)
    return dict(zip(names, dev.split(sizes)))


# dtypes whose Python lists convert through the `array` module (C loops: ~16 ns an element against
# torch.tensor's ~55 on a 2-core CPU; a step at batch 512 converts several thousand).
_ARRAY_CODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


def host_tensor(data: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A Python list (flat, or rows of equal length) as a host tensor to copy to `device`, in
    pinned memory when `device` is CUDA, so that a non-blocking copy from it does not wait for the
    work queued on the stream (a pageable copy can wait for the forward the scheduler has just
    queued, serialising the scheduler with the GPU). Equal to `torch.tensor(data, dtype=dtype)`."""
    pin = torch.device(device).type == "cuda"
    flat = _as_array(data, dtype)
    if flat is None:  # deeper nesting, ragged rows, or values the array module does not take
        return torch.tensor(data, dtype=dtype, pin_memory=pin)
    shape = (len(data), len(data[0])) if data and isinstance(data[0], (list, tuple)) else (len(data),)
    # frombuffer keeps the array alive and shares its memory (no copy); nothing else holds it
    t = torch.frombuffer(flat, dtype=dtype).view(shape) if len(flat) else torch.empty(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype, pin_memory=True).copy_(t) if pin else t


def _as_array(data: list, dtype: torch.dtype) -> Optional[array.array]:
    code = _ARRAY_CODES.get(dtype)
    if code is None or not isinstance(data, list):
        return None
    try:
        if data and isinstance(data[0], (list, tuple)):
            width = len(data[0])
            if any(not isinstance(r, (list, tuple)) or len(r) != width for r in data):
                return None
            return array.array(code, itertools.chain.from_iterable(data))
        return array.array(code, data)
    except (TypeError, OverflowError):  # bools, nested lists, ints beyond int64, ...
        return None
