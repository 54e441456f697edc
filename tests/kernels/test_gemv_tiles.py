"""The decode GEMV's tile rules (`kiln.kernels.gemv_tiles`): each a function of the shape only,
within its register budget, pairing rows where the RoPE epilogue needs it; and every tile the
benchmarks sweep computes the product (on Triton's interpreter, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.kernels.gemv import gemv  # noqa: E402
from kiln.kernels.gemv_tiles import FMA_MAX_ROWS, FMA_TILES, candidate_tiles, fma_tile  # noqa: E402
from tests.kernels.test_gemv import FP32, _case  # noqa: E402


@pytest.mark.parametrize("m", [1, 3, 5])
def test_every_candidate_tile_matches_linear(m):
    """The tiles the benchmark's sweep passes in (`gemv(..., tile)`), on the interpreter in fp32."""
    x, w = _case(m, 37, 200, torch.float32, "cpu", seed=m)
    tiles = candidate_tiles(m)
    assert tiles
    for tile in tiles:
        torch.testing.assert_close(gemv(x, w, tile), F.linear(x, w), **FP32)


def test_fma_tiles_are_candidates_within_the_register_budget():
    """The tile is a function of the shape only, one of the swept candidates, and its fp32
    accumulator stays at <= 64 registers per thread (BLOCK_M x BLOCK_N x BLOCK_K over the threads)."""
    for m in range(1, FMA_MAX_ROWS + 1):
        for k in (64, 2048, 4096, 4097, 14336):
            t = fma_tile(m, k)
            assert (t["BLOCK_N"], t["BLOCK_K"], t["num_warps"]) in FMA_TILES
            block_m = 1 << (m - 1).bit_length()
            assert block_m * t["BLOCK_N"] * t["BLOCK_K"] <= 64 * 32 * t["num_warps"], (m, k, t)


def test_one_row_prenorm_tiles_pair_rows_for_rope():
    """At one row and 1024 < K <= 2048 the norm-prologue tile is one row per program only for a
    router (<= ROUTER_MAX_ROWS rows); a wider weight, e.g. a qkv projection split by tensor
    parallelism (1536 rows of Llama-3.2-1B at tp 2), keeps an even BLOCK_N, as the RoPE epilogue's
    row pairs need, and every one-row tile covers the row."""
    from kiln.kernels.gemv_tiles import ROUTER_MAX_ROWS, prenorm_tile

    for k in (1025, 2048):
        for n in (64, 66, ROUTER_MAX_ROWS, ROUTER_MAX_ROWS + 1, 1536, 1792, 2048, 3584):
            t = prenorm_tile(1, n, k)
            assert t["BLOCK_K"] >= k, (n, k, t)
            assert (t["BLOCK_N"] == 1) == (n <= ROUTER_MAX_ROWS), (n, k, t)
            assert n <= ROUTER_MAX_ROWS or t["BLOCK_N"] % 2 == 0, (n, k, t)


def test_interpreter_tiles_keep_several_programs_and_rope_pairs():
    """Under the interpreter a GEMV takes ~INTERPRETER_PROGRAMS programs of 4-16 rows, BLOCK_K 32
    (several K steps at the tests' hidden 64), and with a RoPE epilogue rows that pair within a
    head (BLOCK_N / 2 divides half the head dim)."""
    from kiln.kernels.gemv_tiles import INTERPRETER_TILE, interpreter_tile

    want = {8: 4, 10: 4, 64: 8, 128: 16, 192: 16, 512: 16, 5000: 16}
    assert {n: interpreter_tile(n)["BLOCK_N"] for n in want} == want
    assert all(interpreter_tile(n)["BLOCK_K"] == INTERPRETER_TILE["BLOCK_K"] == 32 for n in want)
    for half, bn in ((8, 16), (4, 8), (2, 4), (6, 4), (12, 8)):  # head dims 16, 8, 4, 12, 24
        t = interpreter_tile(512, rope_half=half)
        assert t["BLOCK_N"] == bn and half % (t["BLOCK_N"] // 2) == 0, (half, t)


def test_lm_heads_take_the_head_tile_on_the_mma_loop():
    """`dot_tile`: a vocabulary-sized weight (>= HEAD_MIN_N rows) takes HEAD_DOT_TILE, one of the
    swept MMA candidates; the presets' dense projections (up to an 8B gate_up's 28672 rows) keep the
    first. Under the interpreter the MMA loop keeps ~INTERPRETER_PROGRAMS programs for a 49K-row
    head, and its 16-row floor for a narrow weight."""
    from kiln.kernels.gemv_tiles import (DOT_TILES, HEAD_DOT_TILE, HEAD_MIN_N, INTERPRETER_PROGRAMS, dot_tile,
                                         interpreter_dot_tile)

    def key(t):
        return t["BLOCK_N"], t["BLOCK_K"], t["num_warps"], t["num_stages"]

    assert HEAD_DOT_TILE in DOT_TILES
    assert key(dot_tile()) == key(dot_tile(28672)) == DOT_TILES[0]
    assert key(dot_tile(HEAD_MIN_N)) == key(dot_tile(49216)) == key(dot_tile(128256)) == HEAD_DOT_TILE
    assert 28672 < HEAD_MIN_N <= 49152  # (SmolLM2's vocabulary)
    assert interpreter_dot_tile(37)["BLOCK_N"] == 16
    assert -(-49216 // interpreter_dot_tile(49216)["BLOCK_N"]) <= INTERPRETER_PROGRAMS
