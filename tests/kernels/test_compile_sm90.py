"""Kernels compile for the H200 (sm_90), on the CPU.

Triton's interpreter (how the CPU tests run the kernels) accepts programs the compiler rejects,
e.g. a name bound to bf16 in one branch of an `if` and to fp32 in the other, and never runs the
PDL wait (`kiln.kernels.launch`), which is inline PTX. Triton compiles to
PTX and cubin without a GPU, so these tests build the kernels with data-dependent branches for
sm_90 with representative signatures, before a GPU run finds out. The compile runs in a child
process: under the interpreter (tests/conftest.py) `@triton.jit` functions cannot be compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compile_sm90(kernel, types: dict, constexprs: dict, default: str = "i32", divisible: tuple = (),
                 num_warps: int = 4) -> dict:
    """Compile `kernel` (a `@triton.jit` function, not interpreted) for sm_90: `types` names each
    non-`default` argument's Triton type ('*bf16', 'fp32', ...); `constexprs` the constexpr values.
    `divisible` names arguments to specialise as multiples of 16 (as a launch with such values
    would). Returns the compiled asm by stage ('ptx', 'cubin', ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else types.get(n, default) for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    asm = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps)).asm
    assert "cubin" in asm
    return asm


def conv_qk_norm(has_lam: bool, to_cache: bool = False) -> None:
    from kiln.kernels.conv_qk_norm import _conv_qk_norm_kernel

    bf16 = ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "k_out_ptr", "v_out_ptr", "qn_w_ptr", "kn_w_ptr",
            "kc_w_ptr", "vc_w_ptr", "k_buf_ptr", "v_buf_ptr")
    types = {**{n: "*bf16" for n in bf16}, "lam_ptr": "*fp32", "q_eps": "fp32", "k_eps": "fp32",
             **{n: "*i64" for n in ("table_ptr", "slots_ptr", "pos_ptr", "out_locs_ptr", "cache_locs_ptr")}}
    compile_sm90(_conv_qk_norm_kernel, types, dict(K=4, HAS_LAM=has_lam, TO_CACHE=to_cache, BLOCK_H=4,
                                                   BLOCK_D=128, PDL=True))


def extend_attention(mtp: bool) -> None:
    from kiln.kernels.extend_attention import _extend_kernel

    types = {**{n: "*bf16" for n in ("Q", "K", "V", "Out")}, "Rel": "*fp32", "scale_log2": "fp32",
             **{n: "*i64" for n in ("ReqToToken", "ReqSlots", "PrefixLens", "ExtendLens", "ExtendStarts",
                                    "Positions")}}
    compile_sm90(_extend_kernel, types, dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=32,
                                             HAS_WINDOW=mtp, HAS_REL=mtp, HAS_POSITIONS=mtp, HAS_GAP=mtp,
                                             DOT_PRECISION="tf32", PDL=mtp))


def block_attention() -> None:
    """A block's rows x heads in one tile (64 rows at DSpark `bench`): the key loop pipelined as
    `decode_attention`'s."""
    from kiln.kernels.block_attention import _block_attention_kernel

    types = {**{n: "*bf16" for n in ("Q", "K", "V", "Out")}, "MidO": "*fp32", "MidLse": "*fp32",
             "scale_log2": "fp32", **{n: "*i64" for n in ("ReqToToken", "ReqSlots", "SeqLens")}}
    aligned = tuple(n for n in _block_attention_kernel.arg_names
                    if types.get(n, "").startswith("*") or n.startswith("stride_"))
    asm = compile_sm90(_block_attention_kernel, types, dict(GROUP=4, ROWS=16, BLOCK_M=64, HEAD_DIM=128, BLOCK_D=128,
                                                            BLOCK_N=64, SPLIT=True, MIN_SPLIT=64,
                                                            DOT_PRECISION="tf32", PDL=True), divisible=aligned)
    copies = [line for line in asm["ttgir"].splitlines() if "async_copy_global_to_local" in line]
    assert sum("64x128x!tt.ptr<bf16>" in line for line in copies) >= 2, "the K and V loads are not pipelined"


def decode_attention(mtp: bool, merge_here: bool = False, rel_proj: bool = False, early_kv: bool = False,
                     prologue: bool = False) -> None:
    """merge_here: the splits merged in the kernel (an acq_rel atomic count, then the last program
    of a head group reads the others' partials through L2). rel_proj: Inkling's bias computed per
    key from r and P (`RelProjection`), with a full layer's lam. early_kv: the first block's keys
    are loaded before the PDL wait. prologue: Inkling's convs and norms inside (`AttentionPrologue`)."""
    from kiln.kernels.decode_attention import _decode_kernel

    types = {**{n: "*bf16" for n in ("Q", "K", "V", "Out", "RelW")}, "MidO": "*fp32", "MidLse": "*fp32",
             "Rel": "*bf16" if rel_proj else "*fp32", "Lam": "*fp32",
             "scale_log2": "fp32", **{n: "*i64" for n in ("ReqToToken", "ReqSlots", "SeqLens")}, "Counters": "*i32"}
    if prologue:
        types.update({n: "*bf16" for n in ("KRaw", "VRaw", "QNormW", "KNormW", "KConvW", "VConvW", "KBuf", "VBuf")},
                     QLam="*fp32", q_eps="fp32", k_eps="fp32",
                     **{n: "*i64" for n in ("ConvTable", "Positions", "ConvLocs")})
    # Pointers and strides are marked multiples of 16, as the engine's are (Triton specialises on
    # that; only MidLse's may not be, and it is not in the loop): without it no load can become an
    # asynchronous copy.
    aligned = tuple(n for n in _decode_kernel.arg_names if types.get(n, "").startswith("*") or n.startswith("stride_"))
    asm = compile_sm90(_decode_kernel, types, dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64,
                                                   SPLIT=True, HAS_WINDOW=mtp, HAS_REL=mtp or rel_proj, HAS_GAP=mtp,
                                                   DOT_PRECISION="tf32", PDL=True, MERGE_HERE=merge_here,
                                                   MIN_SPLIT=64, BLOCK_H=4, SPLIT_TILE=16, REL_PROJ=rel_proj,
                                                   HAS_LAM=rel_proj, BLOCK_R=32, EARLY_KV=early_kv,
                                                   PROLOGUE=prologue, CONV_K=4, HAS_QLAM=prologue and rel_proj),
                       divisible=aligned)
    ptx = asm["ptx"]
    if early_kv:  # vector loads of the K/V tile (not only the scalar lengths) are issued before the wait
        before = ptx[:ptx.index("griddepcontrol.wait")]
        assert "ld.global.v4" in before or "cp.async" in before, "early_kv loads no K/V tile before the PDL wait"
    # The key loop is software-pipelined: the slot indices and the K/V tiles of the next blocks are
    # in flight (asynchronous copies) while a block is scored. A long split is latency-bound without it.
    copies = [line for line in asm["ttgir"].splitlines() if "async_copy_global_to_local" in line]
    assert sum("64x128x!tt.ptr<bf16>" in line for line in copies) >= 2, "the K and V loads are not pipelined"
    assert any("64x!tt.ptr<i64>" in line for line in copies), "the slot loads are not pipelined"
    if merge_here:
        assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx, "the merge needs ordered counts and L2 reads"


def rope() -> None:
    from kiln.kernels.rotary import _rope_kernel

    types = {**{n: "*bf16" for n in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr")},
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64"}
    compile_sm90(_rope_kernel, types, dict(HALF=64, BLOCK_D=64, BLOCK_H=32, PDL=True))


def rope_store() -> None:
    from kiln.kernels.rotary import _rope_store_kernel

    types = {**{n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "kc_ptr", "vc_ptr")},
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "loc_ptr": "*i32"}
    compile_sm90(_rope_store_kernel, types, dict(HALF=64, BLOCK_D=64, BLOCK_H=32, BLOCK_HK=8, BLOCK_DV=128, PDL=True))


def rms_norm(pdl) -> str:
    """The PDL wait (inline PTX `griddepcontrol.wait`) must assemble for sm_90. Returns the PTX."""
    from kiln.kernels.norm import _rms_norm_kernel

    types = {**{n: "*bf16" for n in ("x_ptr", "r_ptr", "w_ptr", "out_ptr", "r_out_ptr")}, "eps": "fp32"}
    return compile_sm90(_rms_norm_kernel, types, dict(HAS_RESIDUAL=True, ONE_PASS=True, BLOCK_R=1, BLOCK_H=4096,
                                                      PDL=pdl))["ptx"]


def rms_norm_trigger() -> None:
    """--pdl-early-trigger (PDL 2): the kernel lets its successor launch right after its wait."""
    ptx = rms_norm(2)
    assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")


def moe_gemv(shared: bool, conv: bool = False, trace: bool = False) -> None:
    """The MoE one-token path (`kiln.kernels.moe_gemv`) at the bench shape's tiles: a data-dependent
    expert (routed) or a shared chunk per slot, KS unrolled slots in the down kernel, whose first
    slot's id and weight tile load before its PDL wait with the early trigger (the id from L2:
    `.cg`) and after it without; with `conv`, Inkling's out_conv in the down kernel's epilogue.
    With `trace`, both kernels' timer reads (`kiln.kernels.trace`: five each); none without."""
    from kiln.kernels.moe_gemv import _expert_down_gemv_kernel, _expert_up_gemv_kernel, gemv_tiles

    up, down = ({k: v for k, v in t.items() if k.startswith("BLOCK")} for t in gemv_tiles(2048, 512))
    w = {n: "*bf16" for n in ("x_ptr", "act_ptr", "out_ptr", "w13_ptr", "sw13_ptr", "w2_ptr", "sw2_ptr", "CW", "CBUF")}
    types = {**w, "ids_ptr": "*i64", "topk_w_ptr": "*fp32", "shared_w_ptr": "*fp32", "TR": "*i64",
             **{n: "*i64" for n in ("CTAB", "CSLOTS", "CLENS", "CLOCS")}}
    div = ("x_ptr", "act_ptr", "out_ptr", "w13_ptr", "sw13_ptr", "w2_ptr", "sw2_ptr", "H", "I", "stride_xt",
           "stride_we", "stride_wn", "stride_sn", "stride_wh", "stride_sh")
    ks = 8 if shared else 6
    names = lambda k: tuple(n for n in div if n in k.arg_names)  # noqa: E731
    up_ptx = compile_sm90(_expert_up_gemv_kernel, types, dict(K=6, KS=ks, PDL=True, TRACE=trace, **up),
                          divisible=names(_expert_up_gemv_kernel))["ptx"]
    assert up_ptx.count("%globaltimer") == (5 if trace else 0)
    for pdl in (1, 2):
        ptx = compile_sm90(_expert_down_gemv_kernel, types,
                           dict(K=6, KS=ks, NUM_SW=2, SW_REP=1, HAS_SW=shared, PDL=pdl, CONV=conv,
                                CK=4 if conv else 1, CKP=4 if conv else 1, CCHUNK=False, TRACE=trace, **down),
                           divisible=names(_expert_down_gemv_kernel))["ptx"]
        assert ptx.count("%globaltimer") == (5 if trace else 0)
        before = ptx[:ptx.index("griddepcontrol.wait")]
        if pdl == 2:  # the early trigger: the id and weight stream start before the wait
            assert "ld.global.cg" in before and "ld.global.v4" in before, "the first tile must load before the wait"
        else:  # without it the kernel waits first
            assert "ld.global" not in before, "without the early trigger nothing may load before the wait"


def router_gate(sink: bool) -> None:
    """The router's logits and the gate in one launch (`kiln.kernels.moe_gate._router_gate_kernel`)
    on the router GEMV's one-row tile: the fp32 weight stream starts before the wait; every warp's
    logits are stored before a barrier, then the acq_rel count; the last program reads the
    logits from L2."""
    from kiln.kernels.gemv_tiles import fma_tile
    from kiln.kernels.moe_gate import _router_gate_kernel

    tile = {k: v for k, v in fma_tile(1, 2048).items() if k.startswith("BLOCK")}
    types = {"x_ptr": "*bf16", "w_ptr": "*fp32", "z_ptr": "*fp32", "counter_ptr": "*i32", "bias_ptr": "*fp32",
             "gscale_ptr": "*fp32", "ids_ptr": "*i64", "rw_ptr": "*fp32", "sw_ptr": "*fp32", "scale": "fp32"}
    ptx = compile_sm90(_router_gate_kernel, types, dict(E=64, S=2 if sink else 0, K=6, N_PAD=128 if sink else 64,
                                                        BLOCK_T=1, SINK=sink, PRECISE=True, PDL=2, **tile),
                       divisible=("x_ptr", "w_ptr", "z_ptr", "H", "stride_xt"))["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    assert "ld.global" in ptx[:wait], "the router weight stream must start before the wait"
    atom = ptx.index("atom.global.gpu.acq_rel.add")
    stores_done = ptx.rindex("st.global", 0, atom)
    assert "bar.sync" in ptx[stores_done:atom], "a barrier must order every warp's stores before the count"
    assert "ld.global.cg" in ptx[atom:], "the last program reads the logits from L2"


def gates() -> None:
    """The sink and MiniMax-M3 gates on one token over one warp (their decode launch) and 16 over
    four: the selection's packed int64 keys (a bitcast and shifts) compile, with no shared-memory
    barrier on one warp."""
    from kiln.kernels.moe_gate import _minimax_gate_kernel, _sink_gate_kernel

    types = {"z_ptr": "*fp32", "bias_ptr": "*fp32", "gscale_ptr": "*fp32", "ids_ptr": "*i64", "rw_ptr": "*fp32",
             "sw_ptr": "*fp32", "w_ptr": "*fp32", "route_scale": "fp32", "scaling": "fp32"}
    for bt, warps in ((1, 1), (16, 4)):
        sink = compile_sm90(_sink_gate_kernel, types, dict(E=64, S=2, K=6, N_PAD=128, BLOCK_T=bt, PRECISE=True, PDL=2),
                            num_warps=warps)["ptx"]
        mm = compile_sm90(_minimax_gate_kernel, types, dict(E=64, K=6, N_PAD=64, BLOCK_T=bt, PRECISE=True, PDL=2),
                          num_warps=warps)["ptx"]
        if warps == 1:
            assert "bar.sync" not in sink and "bar.sync" not in mm, "one warp needs no barrier"


def gemv_router() -> None:
    """The routers' GEMV: bf16 rows, an fp32 weight and fp32 logits, up to 4 rows."""
    from kiln.kernels.gemv import _gemv_fma_kernel
    from kiln.kernels.gemv_tiles import fma_tile

    tile = {k: v for k, v in fma_tile(4, 2048).items() if k.startswith("BLOCK")}
    for m_blocks in (1, 2):  # (2: past 4 rows, blocks of rows side by side)
        ptx = compile_sm90(_gemv_fma_kernel, {"X": "*bf16", "W": "*fp32", "Y": "*fp32"},
                           dict(BLOCK_M=4, PDL=True, GLU=False, PREFETCH=True, CONV=False, CK=1, CKP=1, CCHUNK=False,
                                **NO_NORM, **tile, ROPE=False, HALF=1, TRACE=False, XPIPE=True, ONE_TILE=False,
                                M_BLOCKS=m_blocks))["ptx"]
        assert ("%ctaid.y" in ptx) == (m_blocks > 1), "one block of rows reads no second grid axis"


def gemv_head() -> None:
    """An LM head of a few rows on the MMA loop (`gemv(..., mma=True, float_out=True)`): the head
    tile's weight stream before the PDL wait, and fp32 logits rounded through bf16 (as `.float()`
    of a bf16 result), which the plain bf16 store does not need."""
    from kiln.kernels.gemv import _gemv_dot_kernel
    from kiln.kernels.gemv_tiles import dot_tile

    tile = {k: v for k, v in dot_tile(49216).items() if k.startswith("BLOCK")}
    ptx = {}
    for float_out in (False, True):
        consts = dict(PRECISION="tf32", PDL=True, PREFETCH=False, ROUND_TO_X=float_out, **tile)
        types = {"X": "*bf16", "W": "*bf16", "Y": "*fp32" if float_out else "*bf16"}
        ptx[float_out] = compile_sm90(_gemv_dot_kernel, types, consts,
                                      divisible=("X", "W", "Y", "N", "K", "stride_xm", "stride_wn", "stride_ym"))["ptx"]
    for code in ptx.values():
        assert "ld.global.v4" in code[:code.index("griddepcontrol.wait")], "the weight stream starts before the wait"
    tail = ptx[True][ptx[True].rindex("mma."):]  # (the MMA loop's wgmma / mma, then the epilogue)
    assert "cvt.rn.bf16" in tail and "st.global" in tail, "the fp32 logits are rounded through bf16"


NO_NORM = dict(NORM=False, NORM_RES=False, NORM_KEEP=False, NORM_BLOCK=1, NORM_OUT=False, NORM_ONE_PASS=False)


def gemv(fma: bool, glu: bool = False, prefetch: bool = False, conv: bool = False, norm: bool = False,
         rope: bool = False, chunk: bool = False, norm_out: bool = False, trace: bool = False) -> None:
    """Both decode GEMV loops compile and issue their first weight load before the PDL wait (the
    point of the kernel); with PREFETCH, the L2 bulk prefetch of the matrix too
    (`kiln.kernels.prefetch`), and without it no prefetch at all. With the norm prologue (Inkling
    bench's qkvr with `prenorm_tile`: residual, normed rows kept), nothing of the norm is read
    before the wait. With the RoPE epilogue (the 8B's qkv, a row pair per program) the weight rows
    are still streamed before the wait. With `chunk`, the conv epilogue over a verify's 4 rows. With
    the norm epilogue (the 8B's o_proj, the row in registers), the last program's acq_rel count
    and its reads of the other programs' columns through L2. With `trace`, the timer reads
    (`kiln.kernels.trace`): five, one before the first weight load, and no timer
    at all without it."""
    from kiln.kernels.gemv import _gemv_dot_kernel, _gemv_fma_kernel
    from kiln.kernels.gemv_tiles import dot_tile, fma_tile, prenorm_tile

    types = {**{n: "*bf16" for n in ("X", "W", "Y", "CW", "CBUF", "NR", "NW", "NS", "NX", "KC", "VC")}, "eps": "fp32",
             "NCNT": "*i32", "TR": "*i64",
             **{n: "*i64" for n in ("CTAB", "CSLOTS", "CLENS", "CLOCS", "POS", "LOC")},
             **{n: "*fp32" for n in ("COS", "SIN")}}
    # Triton specialises 16-divisible ints and pointers at launch; without that the loads would
    # not vectorise and the check below would look at scalar loads.
    div = ("X", "W", "Y", "N", "K", "stride_xm", "stride_wn", "stride_ym") + (
        ("NR", "NW", "NS", "NX", "stride_nr") if fma else ())
    # the tiles the engine launches at the 8B shape, and with a norm at Inkling bench's qkvr (num_warps
    # only changes the layout, not the order)
    tile = prenorm_tile(1, 3328, 2048) if norm else fma_tile(1, 4096) if fma else dot_tile()
    tile = {k: v for k, v in tile.items() if k.startswith("BLOCK")}
    if glu:
        tile["BLOCK_N"] //= 2
    if fma:
        norm_consts = dict(NO_NORM, NORM=True, NORM_RES=True, NORM_KEEP=True, NORM_BLOCK=2048) if norm else NO_NORM
        if norm_out:
            norm_consts = dict(NO_NORM, NORM_OUT=True, NORM_ONE_PASS=True, NORM_BLOCK=4096)
        kernel, consts = _gemv_fma_kernel, dict(BLOCK_M=4 if chunk else 1, PDL=True, GLU=glu, PREFETCH=prefetch,
                                                CONV=conv, CK=4 if conv else 1, CKP=4 if conv else 1, CCHUNK=chunk,
                                                **norm_consts, **tile, ROPE=rope, HALF=64 if rope else 1,
                                                TRACE=trace, XPIPE=True, ONE_TILE=tile["BLOCK_K"] >= 2048)
    else:
        kernel, consts = _gemv_dot_kernel, dict(PRECISION="tf32", PDL=True, PREFETCH=prefetch, **tile)
    ptx = compile_sm90(kernel, types, consts, divisible=div)["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    assert "ld.global.v4" in ptx[:wait], "the weight stream must start before the PDL wait"
    if norm or rope:  # the weight tile only, as without them: the norm's and RoPE's inputs come after the wait
        plain = compile_sm90(kernel, types, {**consts, **NO_NORM, "ROPE": False, "HALF": 1}, divisible=div)["ptx"]
        assert ptx[:wait].count("ld.global") == plain[:plain.index("griddepcontrol.wait")].count("ld.global")
    if norm_out:
        tail = ptx[wait:]
        assert "atom.global.gpu.acq_rel.add" in tail and "ld.global.cg.v4" in tail, "the count, the L2 reads"
    if prefetch:
        assert "cp.async.bulk.prefetch.L2.global" in ptx[:wait], "the L2 prefetch must be issued before the wait"
    else:
        assert "cp.async.bulk.prefetch" not in ptx
    if trace:
        first_timer = ptx.index("%globaltimer")
        assert first_timer < ptx.index("ld.global.v4") < wait, "the start time precedes the weight stream"
        assert ptx.count("%globaltimer") == 5 and "%globaltimer" in ptx[wait:] and "%smid" in ptx[wait:]
    else:
        assert "%globaltimer" not in ptx and "%smid" not in ptx


def sum_slots_conv() -> None:
    """The grouped MoE's slot sum with out_conv over a verify's 4 tokens in its epilogue."""
    from kiln.kernels.moe import SUM_CONV_BLOCK_H, _sum_slots_conv_kernel

    types = {"slots_ptr": "*fp32", "out_ptr": "*bf16", "CW": "*bf16", "CBUF": "*bf16",
             **{n: "*i64" for n in ("CTAB", "CSLOTS", "CLENS", "CLOCS")}}
    compile_sm90(_sum_slots_conv_kernel, types, dict(KS=8, BLOCK_M=4, BLOCK_H=SUM_CONV_BLOCK_H, CONV=True, CK=4, CKP=4,
                                                     CCHUNK=True, PDL=True))


def grouped_moe() -> None:
    """The grouped MoE's gate/up and down GEMMs at the bench shape's decode tiles."""
    from kiln.kernels.moe import _down_kernel, _gate_up_kernel, pick_config

    cfg = pick_config(4, 6, 64, 2048, 512)
    common = dict(E=64, E_TOT=66, E_PAD=128, KS=8, BLOCK_M=cfg.block_m, EVEN_K=True, PRECISION="tf32", PDL=True)
    bn, bk, warps, stages = cfg.up
    compile_sm90(_gate_up_kernel, {"x_ptr": "*bf16", "w13_ptr": "*bf16", "sw13_ptr": "*bf16", "sorted_ptr": "*i32",
                                   "seg_end_ptr": "*i32", "act_ptr": "*bf16"},
                 dict(common, BLOCK_N=bn, BLOCK_K=bk), num_warps=warps)
    bn, bk, warps, stages = cfg.down
    compile_sm90(_down_kernel, {"act_ptr": "*bf16", "w2_ptr": "*bf16", "sw2_ptr": "*bf16", "sorted_ptr": "*i32",
                                "seg_end_ptr": "*i32", "topk_w_ptr": "*fp32", "shared_w_ptr": "*fp32",
                                "out_ptr": "*fp32"},
                 dict(common, K=6, NUM_SW=2, SW_REP=1, HAS_SW=True, BLOCK_N=bn, BLOCK_K=bk), num_warps=warps)


def argmax() -> None:
    """The greedy argmax's two kernels."""
    from kiln.kernels.argmax import _chunk_max_kernel, _merge_kernel

    compile_sm90(_chunk_max_kernel, {"x_ptr": "*fp32", "part_v_ptr": "*fp32", "part_i_ptr": "*i32"},
                 dict(CHUNK=4096, BLOCK=1024, PDL=True))
    compile_sm90(_merge_kernel, {"part_v_ptr": "*fp32", "part_i_ptr": "*i32", "ids_ptr": "*i64"},
                 dict(BLOCK=16, PDL=True))


def softmax() -> None:
    """The sampler's two-launch softmax (bf16 logits read as fp32, an IEEE division)."""
    from kiln.kernels.softmax import _softmax_kernel, _softmax_stats_kernel

    types = {"logits_ptr": "*bf16", "t_ptr": "*fp32", "part_m_ptr": "*fp32", "part_s_ptr": "*fp32", "out_ptr": "*fp32"}
    compile_sm90(_softmax_stats_kernel, types, dict(CHUNK=1024, PDL=True))
    compile_sm90(_softmax_kernel, types, dict(CHUNK=1024, CP2=64, PDL=True))


def sampling_select() -> None:
    """The filter's table over chunks and its selection (data-dependent `while` loops, a scratch copy
    through a cumsum, scalar `if`s)."""
    from kiln.kernels.sampling import _copy_kernel, _select_kernel, _table_kernel

    types = {**{n: "*fp32" for n in ("probs_ptr", "part_m_ptr", "part_x_ptr", "meta_f_ptr", "scratch_ptr",
                                     "top_ps_ptr", "min_ps_ptr", "pre_f_ptr")},
             "part_c_ptr": "*i32", "meta_i_ptr": "*i32", "pre_i_ptr": "*i32", "top_ks_ptr": "*i64"}
    compile_sm90(_table_kernel, types, dict(CHUNK=1024, BLOCK=128, NT=64, PDL=True), num_warps=8)
    compile_sm90(_copy_kernel, types, dict(CAP=4096, CHUNK=1024, NT=64, CHUNKS=64, PDL=True), num_warps=8)
    for table, pre in ((False, False), (True, False), (True, True)):
        compile_sm90(_select_kernel, types, dict(CAP=4096, BLOCK=4096, BLOCK_P=1024, NP=8, BLOCK_S=256, NP_S=16,
                                                 NT=64, CHUNKS=64, TABLE=table, PRE=pre, PDL=True), num_warps=8)


def seeded_noise() -> None:
    """The counter-based noise (uint64 arithmetic with constants past 2^63, a float64 logarithm)."""
    from kiln.kernels.seeded_noise import _noise_kernel

    for exponential in (True, False):
        compile_sm90(_noise_kernel, {"keys_ptr": "*i64", "out_ptr": "*fp32"},
                     dict(EXPONENTIAL=exponential, BLOCK=1024, PDL=True))


def spec_verify() -> None:
    """Exact verification: a runtime loop over the drafts carrying scalar weights, a scalar `if`
    inside it, and cumsums over the chunk sums and a chunk."""
    from kiln.kernels.spec_verify import _partials_kernel, _sample_kernel

    types = {**{n: "*fp32" for n in ("p_ptr", "q_ptr", "ua_ptr", "ur_ptr", "part_r_ptr", "part_p_ptr")},
             **{n: "*i64" for n in ("d_ptr", "n_ptr", "y_ptr", "out_ptr")}}
    for block in (False, True):
        compile_sm90(_partials_kernel, types, dict(BLOCKWISE=block, G=4, CHUNK=4096, BLOCK=1024, PDL=True))
        compile_sm90(_sample_kernel, types, dict(BLOCKWISE=block, G=4, G1=4, CP2=16, CHUNK=4096, BLOCK=1024,
                                                 PDL=True))


def msa_scores() -> None:
    """The MSA score kernels loop over blocks with a `while` on a loaded length (the compiler must
    accept the loop-carried block id next to a loaded int64 position)."""
    from kiln.kernels.msa_scores import _decode_scores_kernel, _extend_scores_kernel

    i64 = ("r2t_ptr", "rslot_ptr", "qpos_ptr", "seq_rslot_ptr", "seq_prefix_ptr", "seq_len_ptr", "seq_start_ptr")
    types = {"qI_ptr": "*bf16", "kI_ptr": "*bf16", "s_ptr": "*fp32", "sqrt_di": "fp32",
             **{n: "*i64" for n in i64}}
    compile_sm90(_decode_scores_kernel, types, dict(HALF=64, BLOCK_HALF=64, BLOCK_SIZE=128, TILE_T=64, PDL=True))
    compile_sm90(_extend_scores_kernel, types, dict(NUM_SEQS_P=4, DI=128, DI_P=128, BLOCK_SIZE=128, TILE_Q=32,
                                                    TILE_T=64, DOT_PREC="tf32", PDL=True))


def msa_sparse_merge() -> None:
    """MSA's sparse attention merging its splits in the kernel (an acq_rel count, then the last
    split reads the group's partials through L2, one unrolled combine per head)."""
    from kiln.kernels.msa import _sparse_attn_kernel

    types = {**{n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")},
             **{n: "*fp32" for n in ("opart_ptr", "mpart_ptr", "lpart_ptr")}, "counters_ptr": "*i32",
             **{n: "*i64" for n in ("r2t_ptr", "rslot_ptr", "qpos_ptr", "sel_ptr")}, "scale_log2": "fp32"}
    asm = compile_sm90(_sparse_attn_kernel, types, dict(HG=4, HG_P=16, D=128, D_P=128, BLOCK_SIZE=128, TILE_T=128,
                                                         TOPK=16, BLOCKS_PER_SPLIT=1, SPLITS=16, DOT_PREC="tf32",
                                                         PDL=True, MERGE_HERE=True, SPLITS_P=16, SELECT_HERE=False,
                                                         TOPK_P=16, CHUNK=1, NUM_CHUNKS=1))
    assert "atom.global.gpu.acq_rel.add" in asm["ptx"] and "ld.global.cg" in asm["ptx"]


def msa_select_here() -> None:
    """MSA's sparse attention selecting its blocks from the scores itself (the selection's serial
    chain of int64 max reductions inside the attention kernel), one chunk and several."""
    from kiln.kernels.msa import _sparse_attn_kernel

    types = {**{n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")},
             **{n: "*fp32" for n in ("opart_ptr", "mpart_ptr", "lpart_ptr", "sel_ptr")}, "counters_ptr": "*i32",
             **{n: "*i64" for n in ("r2t_ptr", "rslot_ptr", "qpos_ptr")}, "scale_log2": "fp32"}
    for chunks in (1, 4):
        compile_sm90(_sparse_attn_kernel, types, dict(HG=4, HG_P=16, D=128, D_P=128, BLOCK_SIZE=128, TILE_T=128,
                                                      TOPK=16, BLOCKS_PER_SPLIT=1, SPLITS=16, DOT_PREC="tf32",
                                                      PDL=True, MERGE_HERE=True, SPLITS_P=16, SELECT_HERE=True,
                                                      TOPK_P=16, CHUNK=64, NUM_CHUNKS=chunks))


def msa_prologue() -> None:
    """MiniMax-M3's prologue: a branch per role (q / k with v / qI / kI), norms in two of them."""
    from kiln.kernels.msa_prologue import _msa_prologue_kernel

    bf16 = ("q_ptr", "k_ptr", "v_ptr", "qi_ptr", "ki_ptr", "q_out_ptr", "qi_out_ptr", "kc_ptr", "vc_ptr", "kic_ptr",
            "qn_w_ptr", "kn_w_ptr")
    types = {**{n: "*bf16" for n in bf16}, **{n: "*fp32" for n in ("cos_ptr", "sin_ptr", "icos_ptr", "isin_ptr")},
             "pos_ptr": "*i64", "loc_ptr": "*i64", "q_eps": "fp32", "k_eps": "fp32", "r2t_ptr": "*i64",
             "rslot_ptr": "*i64", "s_ptr": "*fp32", "sqrt_di": "fp32"}
    off = dict(SCORES=False, BLOCK_SIZE=1, TILE_T=1)
    compile_sm90(_msa_prologue_kernel, types, dict(HALF=64, IHALF=64, BLOCK_D=64, BLOCK_DI=64, BLOCK_H=4, PDL=True,
                                                   **off))
    # index heads of another size than the attention's: no value may change shape across the branches
    compile_sm90(_msa_prologue_kernel, types, dict(HALF=64, IHALF=32, BLOCK_D=64, BLOCK_DI=32, BLOCK_H=4, PDL=True,
                                                   **off))
    # with MSA's decode scores in the same launch (16 warps, as the score kernel)
    compile_sm90(_msa_prologue_kernel, types, dict(HALF=64, IHALF=64, BLOCK_D=64, BLOCK_DI=64, BLOCK_H=4, PDL=True,
                                                   SCORES=True, BLOCK_SIZE=128, TILE_T=64), num_warps=16)


def persistent_chain() -> None:
    """benchmarks/kernel_bench/persistent_chain.py: a `while` over atomic tickets with a spin on
    another atomic inside an `if` (the benchmark's GPU run must not be where this is found out)."""
    from benchmarks.kernel_bench.persistent_chain import _chain_kernel

    compile_sm90(_chain_kernel, {"W": "*bf16", "X0": "*bf16", "Y": "*bf16", "DONE": "*i32", "TICKET": "*i32"},
                 dict(M=4, N=2048, K=2048, BLOCK_N=4))


CASES = {"conv_qk_norm": lambda: conv_qk_norm(False), "conv_qk_norm_lam": lambda: conv_qk_norm(True),
         "conv_qk_norm_store": lambda: conv_qk_norm(True, to_cache=True),
         "extend": lambda: extend_attention(False), "extend_mtp": lambda: extend_attention(True),
         "decode": lambda: decode_attention(False), "decode_mtp": lambda: decode_attention(True),
         "rms_norm": lambda: rms_norm(False), "rms_norm_pdl": lambda: rms_norm(True), "rms_norm_trigger": rms_norm_trigger,
         "gemv_fma": lambda: gemv(True), "gemv_dot": lambda: gemv(False), "gemv_glu": lambda: gemv(True, glu=True),
         "gemv_fma_prefetch": lambda: gemv(True, prefetch=True), "gemv_conv": lambda: gemv(True, conv=True),
         "gemv_conv_chunk": lambda: gemv(True, conv=True, chunk=True), "sum_slots_conv": sum_slots_conv,
         "grouped_moe": grouped_moe,
         "argmax": argmax, "seeded_noise": seeded_noise, "sampling_select": sampling_select, "spec_verify": spec_verify, "softmax": softmax,
         "gemv_norm": lambda: gemv(True, norm=True), "gemv_glu_norm": lambda: gemv(True, glu=True, norm=True),
         "gemv_dot_prefetch": lambda: gemv(False, prefetch=True), "gemv_rope": lambda: gemv(True, rope=True),
         "gemv_norm_rope": lambda: gemv(True, norm=True, rope=True), "gemv_norm_out": lambda: gemv(True, norm_out=True),
         "gemv_router": gemv_router, "gemv_head": gemv_head,
         "gemv_norm_traced": lambda: gemv(True, norm=True, trace=True), "moe_gemv": lambda: moe_gemv(False),
         "moe_gemv_shared": lambda: moe_gemv(True),
         "moe_gemv_conv": lambda: moe_gemv(True, conv=True),
         "moe_gemv_traced": lambda: moe_gemv(True, conv=True, trace=True), "router_gate_sink": lambda: router_gate(True),
         "router_gate_minimax": lambda: router_gate(False), "gates": gates,
         "decode_merge_here": lambda: decode_attention(False, merge_here=True), "rope_store": rope_store,
         "decode_rel_proj": lambda: decode_attention(False, merge_here=True, rel_proj=True),
         "decode_early_kv": lambda: decode_attention(False, merge_here=True, early_kv=True),
         "decode_early_kv_rel_proj": lambda: decode_attention(False, merge_here=True, rel_proj=True, early_kv=True),
         "decode_prologue": lambda: decode_attention(False, merge_here=True, rel_proj=True, early_kv=True,
                                                     prologue=True),
         "decode_prologue_sliding": lambda: decode_attention(False, merge_here=True, early_kv=True, prologue=True),
         "rope": rope, "block_attention": block_attention, "msa_scores": msa_scores, "msa_prologue": msa_prologue, "msa_sparse_merge": msa_sparse_merge,
         "msa_select_here": msa_select_here, "persistent_chain": persistent_chain}


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *CASES], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    for name in sys.argv[1:]:
        CASES[name]()
        print("compiled", name)
