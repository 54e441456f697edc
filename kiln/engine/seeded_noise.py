"""`SeededStream`: a seeded request's sampling randomness, drawn for a whole batch in one op.

A torch generator per seeded request meant one launch per seeded row per draw (`exponential_`
of V values each): hundreds per decode step at rollout batch sizes on CUDA, where every GRPO
sample has a seed, and ~1.5 ms a row of 49,152 values on a 2-core CPU. A counter-based stream
instead derives value j of the request's d-th draw from a hash of (seed, d, j), the splitmix64
finaliser, so every seeded row of a batch draws with the same few tensor ops:

    key = mix(seed * C1 + d)            one per row
    x_j = mix(key + j * C1)             one per value
    u_j = (top 53 bits of x_j + 1/2) / 2^53 in (0, 1)    (float64; 23 bits for float32 uniforms)

A row's values depend only on its seed and how many draws the request made before (`draws`,
kept on the request like a generator was, so retraction does not replay them), never on the
batch, and they are the same on the CPU and on CUDA (integer ops; the logarithm may differ in
the last bit). Exp(1) noise is -log(u) in float64, whose smallest values (the race's winners)
keep full precision when cast to float32.

Integer products wrap modulo 2^64 (torch's int64 arithmetic on both devices); right shifts of
negative int64 are arithmetic, so each is masked to a logical shift. On a GPU with Triton the same
values come from one kernel launch (`kiln.kernels.seeded_noise`) instead of ~20 elementwise ops
over int64 temporaries.
"""

from __future__ import annotations

import torch

from kiln.engine.batch import host_tensor
from kiln.kernels import kernels_supported

_M64 = 1 << 64


def _i64(x: int) -> int:
    return x - _M64 if x >= 1 << 63 else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MUL1 = _i64(0xBF58476D1CE4E5B9)
_MUL2 = _i64(0x94D049BB133111EB)


# On the CPU a batch is hashed this many rows at a time, so that the int64 temporaries (8 bytes a
# value) stay in cache: at 256 rows of 49,152 values one pass over the whole batch was 2.6x slower
# than the generators it replaces.
CPU_ROWS_PER_CHUNK = 8


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 values."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser (a bijection of 64-bit words with full avalanche), in place on x."""
    x ^= _shr(x, 30)
    x *= _MUL1
    x ^= _shr(x, 27)
    x *= _MUL2
    x ^= _shr(x, 31)
    return x


class SeededStream:
    """A seeded request's draws: `take()` hands out (seed, draw index) and counts the draw."""

    __slots__ = ("seed", "draws")

    def __init__(self, seed: int):
        self.seed = _i64(seed % _M64)
        self.draws = 0

    def take(self) -> tuple[int, int]:
        d = self.draws
        self.draws += 1
        return self.seed, d


def _bits(keys: torch.Tensor, width: int) -> torch.Tensor:
    """[S, width] hashed int64 words for rows keyed (seed, draw index) `keys` [S, 2]."""
    row = _mix(keys[:, 0] * _GOLDEN + keys[:, 1])
    cols = torch.arange(width, dtype=torch.int64, device=keys.device) * _GOLDEN
    return _mix(row[:, None] + cols[None, :])


def _per_chunk(keys: torch.Tensor, width: int, values) -> torch.Tensor:
    """`values(bits)` of every row, a few rows at a time on the CPU (CPU_ROWS_PER_CHUNK)."""
    if keys.device.type != "cpu" or keys.shape[0] <= CPU_ROWS_PER_CHUNK:
        return values(_bits(keys, width))
    return torch.cat([values(_bits(k, width)) for k in keys.split(CPU_ROWS_PER_CHUNK)])


def stream_keys(streams: list[SeededStream], device) -> torch.Tensor:
    """[S, 2] int64 (seed, draw index) of one draw from each stream (each counts it)."""
    flat = [v for s in streams for v in s.take()]
    return host_tensor(flat, torch.int64, device).to(device, non_blocking=True).view(-1, 2)


def exponentials(keys: torch.Tensor, width: int) -> torch.Tensor:
    """[S, width] float32 Exp(1) values, row i from the draw `keys[i]` (on a GPU with Triton: one
    launch, `kiln.kernels.seeded_noise`)."""
    if _one_launch(keys):
        from kiln.kernels.seeded_noise import noise

        return noise(keys, width, exponential=True)
    return _exponentials_ref(keys, width)


def uniforms(keys: torch.Tensor, width: int) -> torch.Tensor:
    """[S, width] float32 U(0, 1) values (odd multiples of 2^-24: never 0, never 1)."""
    if _one_launch(keys):
        from kiln.kernels.seeded_noise import noise

        return noise(keys, width, exponential=False)
    return _uniforms_ref(keys, width)


def _one_launch(keys: torch.Tensor) -> bool:
    return keys.is_cuda and kernels_supported(keys.device)


def _exponentials_ref(keys: torch.Tensor, width: int) -> torch.Tensor:
    """`exponentials` in torch ops (the kernel's reference; the CPU path)."""
    def values(bits: torch.Tensor) -> torch.Tensor:
        u = _shr(bits, 11).double().add_(0.5).mul_(2.0 ** -53)
        return u.log_().neg_().float()

    return _per_chunk(keys, width, values)


def _uniforms_ref(keys: torch.Tensor, width: int) -> torch.Tensor:
    """`uniforms` in torch ops (the kernel's reference; the CPU path)."""
    return _per_chunk(keys, width, lambda bits: _shr(bits, 41).double().add_(0.5).mul_(2.0 ** -23).float())
