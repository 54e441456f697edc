"""The decode GEMV's tiles (`kiln.kernels.gemv`): which loop and tile a shape takes, and the
candidates the benchmarks sweep.

The tile is a fixed function of the shape (`fma_tile`, `prenorm_tile`, `dot_tile`), not
autotuned: an autotuned tile depends on timing, so two processes could sum in different orders
and their outputs differ in the last bits. `python -m benchmarks.kernel_bench.gemv --sweep` (and
`kernel_bench.lm_head --sweep`) time `candidate_tiles` to revisit the rules; the measurements
behind each rule are cited in its docstring (docs/benchmarks.md).
"""

from __future__ import annotations

import triton

MAX_ROWS = 16  # one MMA tile of activation rows; larger decode batches take cuBLAS
FMA_MAX_ROWS = 4
# Rows an fp32 weight (a MoE router) takes widened from half precision, in blocks of FMA_MAX_ROWS:
# cuBLAS runs that product as a cast, a split-K SIMT SGEMM and its reduction (~11 us a layer at
# 8-32 rows on an H100; docs/benchmarks.md, forty-ninth pass).
WIDEN_MAX_ROWS = 64

# Candidate FMA tiles (BLOCK_N, BLOCK_K, warps): what `benchmarks/kernel_bench/gemv.py` sweeps.
FMA_TILES = ((1, 2048, 4), (2, 1024, 4), (2, 2048, 8), (4, 512, 4), (4, 1024, 4), (4, 1024, 8),
             (8, 512, 4), (8, 256, 4), (16, 256, 8), (4, 2048, 8), (8, 2048, 8))
# At one row, K in (ONE_TILE_MIN_K, ONE_TILE_MAX_K] takes a tile as deep as the row (ONE_TILE).
ONE_TILE_MIN_K, ONE_TILE_MAX_K = 1024, 2048
ROUTER_MAX_ROWS = 256  # a norm-prologue GEMV this narrow is a MoE router: one row per program
# MMA tiles (BLOCK_N, BLOCK_K, warps, stages): the first is `dot_tile`'s, the rest what the sweeps
# time beside it (wider and shallower tiles, more stages: more weight bytes in flight per program).
DOT_TILES = ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 3), (16, 128, 4, 6), (32, 128, 4, 4),
             (32, 256, 8, 4), (64, 128, 4, 4), (64, 128, 8, 5), (64, 256, 8, 3), (128, 128, 8, 3))
# An LM head's MMA tile (`dot_tile`), for weights of at least HEAD_MIN_N rows (vocabularies; the
# largest dense projection of the presets, an 8B gate_up, has 28672).
HEAD_DOT_TILE = (64, 128, 4, 4)
HEAD_MIN_N = 32768
INTERPRETER_TILE = dict(BLOCK_N=4, BLOCK_K=32)
INTERPRETER_PROGRAMS = 8  # about this many programs per interpreted FMA launch (`interpreter_tile`)
INTERPRETER_MAX_BLOCK_N = 16


def interpreter_tile(n: int, rope_half: int = 0) -> dict:
    """The FMA tile under Triton's interpreter (the CPU tests) for n weight rows: BLOCK_K 32, so
    the tests' tiny rows (hidden 64) take several K steps, and BLOCK_N from INTERPRETER_TILE's 4
    up to 16 for about INTERPRETER_PROGRAMS programs. The interpreter's cost is per program and
    per op, not per element: on 4-row tiles a tiny model's 512-row LM head took 128 programs, and
    the GEMV most of an engine test's time. A narrow weight (a router) keeps 4 rows per program,
    so several programs still cover it. With a RoPE epilogue (`rope_half`: half the head dim) a
    tile's rows must pair within a head: BLOCK_N / 2 divides rope_half."""
    bn = triton.next_power_of_2(triton.cdiv(n, INTERPRETER_PROGRAMS))
    bn = min(INTERPRETER_MAX_BLOCK_N, max(INTERPRETER_TILE["BLOCK_N"], bn))
    while rope_half and bn > INTERPRETER_TILE["BLOCK_N"] and rope_half % (bn // 2):
        bn //= 2
    return dict(INTERPRETER_TILE, BLOCK_N=bn)


def fma_tile(m: int, k: int) -> dict:
    """The FMA tile for m rows of depth k, fixed by shape so that every process sums in the same
    order (an autotuned tile depends on timing, and so would the last bits of every output).
    From the sweeps on an H200 (docs/benchmarks.md, "ninth pass"): at 1 row, 2x1024 on 4 warps is
    the best or within a few percent of it at K <= 4096 (Llama-8B qkv, o, gate_up), and 4x1024 on
    8 warps at the long K of down projections; with the accumulator holding 2 or 4 rows, 4x1024
    and 4x512 on 4 warps win. At 1 row and 1024 < K <= 2048 (the hybrids' hidden size) one
    4x2048 tile on 8 warps covers the row: the loop-free path (ONE_TILE), whose whole row is
    loaded before the PDL wait, is faster there in a dependent chain and in the engine
    (docs/benchmarks.md, twenty-third pass); at K <= 1024 the 2x1024 tile covers it already."""
    if m == 1:
        if ONE_TILE_MIN_K < k <= ONE_TILE_MAX_K:
            return dict(BLOCK_N=4, BLOCK_K=ONE_TILE_MAX_K, num_warps=8, num_stages=1)
        bn, bk, warps = (2, 1024, 4) if k <= 4096 else (4, 1024, 8)
    elif m == 2:
        bn, bk, warps = 4, 1024, 4
    else:
        bn, bk, warps = 4, 512, 4
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1)


def prenorm_tile(m: int, n: int, k: int) -> dict:
    """The FMA tile of a GEMV with the norm in its prologue (`gemv_prenorm`), weight [n, k]. Every
    program recomputes the normed rows of its K tiles (h + residual, the scale, the norm weight),
    work that `fma_tile`'s narrow one-row tiles would repeat for every 2 output columns: at one row
    and n >= 2048, 4 columns per program (2 gate + 2 up rows with glu) share it, the best tile of
    a sweep of a decoder layer's chain at the Inkling `bench` and 8B shapes; a smaller weight (a
    router) keeps `fma_tile`'s programs (docs/benchmarks.md, sixteenth pass). At one row and
    1024 < K <= 2048, one tile covers the row (ONE_TILE): 8x2048 on 8 warps for n >= 2048 (every
    program then fits on the GPU at once), and a router's (n <= ROUTER_MAX_ROWS) one row per
    program on 4 warps, its 64 programs each one round trip of weights (twenty-third pass); the
    sizes between (not timed) take `fma_tile`'s one-tile 4x2048, whose rows still pair for a
    RoPE epilogue (a qkv projection split by tensor parallelism)."""
    if m == 1 and ONE_TILE_MIN_K < k <= ONE_TILE_MAX_K:
        if n >= 2048:
            return dict(BLOCK_N=8, BLOCK_K=ONE_TILE_MAX_K, num_warps=8, num_stages=1)
        if n <= ROUTER_MAX_ROWS:
            return dict(BLOCK_N=1, BLOCK_K=ONE_TILE_MAX_K, num_warps=4, num_stages=1)
    if m == 1 and n >= 2048:
        return dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=1)
    return fma_tile(m, k)


def dot_tile(n: int = 0) -> dict:
    """The MMA tile for 5..16 rows (1..16 with `gemv`'s `mma`) of a weight of n rows (fixed, for
    the same reason as `fma_tile`). An LM head (n >= HEAD_MIN_N) takes HEAD_DOT_TILE: 64 weight
    rows of 128 columns per program, each tile loaded once for all rows. On an H100 it streamed a
    49216 x 2048 head at 98% of the copy bandwidth at 5 and 8 rows (68.0-68.5 us against cuBLAS +
    cast's 76.2-77.1 and the first tile's 78.2-79.0; forty-ninth pass), with fp32 logits 69.1-71.3
    us against 80.0-83.3 at 2-16 rows (docs/benchmarks.md, fiftieth pass)."""
    bn, bk, warps, stages = HEAD_DOT_TILE if n >= HEAD_MIN_N else DOT_TILES[0]
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def interpreter_dot_tile(n: int) -> dict:
    """The MMA tile under Triton's interpreter: 16 x 32 tiles, and as with `interpreter_tile`
    wider ones for a large weight, so that a tiny model's 49K-row LM head takes about
    INTERPRETER_PROGRAMS programs, not thousands (the interpreter's cost is per program)."""
    return dict(BLOCK_N=max(16, triton.next_power_of_2(triton.cdiv(n, INTERPRETER_PROGRAMS))), BLOCK_K=32)


def candidate_tiles(m: int) -> list[dict]:
    """The tiles `benchmarks/kernel_bench/gemv.py --sweep` times for m rows: the MMA tiles past
    FMA_MAX_ROWS, else the FMA tiles whose fp32 accumulator (BLOCK_M x BLOCK_N x BLOCK_K over the
    threads) stays at <= 64 registers per thread."""
    if m > FMA_MAX_ROWS:
        return [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=wp, num_stages=st) for bn, bk, wp, st in DOT_TILES]
    block_m = triton.next_power_of_2(m)
    return [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=wp, num_stages=1) for bn, bk, wp in FMA_TILES
            if block_m * bn * bk <= 64 * 32 * wp]
