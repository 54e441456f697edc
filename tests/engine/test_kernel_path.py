"""The engine's kernel path (`kernel_backend="triton"`: Triton attention, ShortConv and MSA kernels
fed with device-side lengths) generates what the reference path generates.

On the CPU the kernels run under Triton's interpreter (tests/conftest.py), which makes this the
CI check that `PagedBackend` hands the kernels the right addressing; on a GPU the same test runs
compiled kernels (and CUDA graphs, see test_cuda_graph.py).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.engine.test_hybrid_engine import ARCHS, make_core, prompts, run

LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
CONFIGS = {**ARCHS, "llama": LLAMA}
# Triton's interpreter costs time per kernel launch and per program, so the CPU tests of the
# kernel path (here, test_graph_buffers.py, the kernel-path MTP test) run these architectures
# with fewer layers, keeping one of each kind and two in every KV space that has several:
# Inkling's dense and MoE sliding-window layers and its full-attention layer, MiniMax-M3's dense
# layer and two MoE layers (the Llamas keep their two). And with a 128-token context: the decode
# grids are sized by it (MSA's block scores, the attention's splits; a sequence's keys still
# split in two).
FEWER_LAYERS = {
    "inkling": dict(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "minimax_m3": dict(num_hidden_layers=3),
}
INTERP_CONFIGS = {arch: {**cfg, **FEWER_LAYERS.get(arch, {})} for arch, cfg in CONFIGS.items()}
INTERP_CONTEXT = 128

pytest.importorskip("triton")


@pytest.fixture(scope="module", params=sorted(INTERP_CONFIGS))
def interp_dir(request, tmp_path_factory) -> str:
    """A model directory (config.json only, dummy weights) per `INTERP_CONFIGS` architecture."""
    d = tmp_path_factory.mktemp(request.param)
    (d / "config.json").write_text(json.dumps(INTERP_CONFIGS[request.param]))
    return str(d)


def greedy(core, reqs, max_tokens=5):
    """Greedy outputs {rid: ids} and {rid: [logit rows sampled]} of requests run together."""
    res = run(core, reqs, max_tokens=max_tokens)
    return {rid: r[1] for rid, r in res.items()}, {rid: r[2] for rid, r in res.items()}


def test_kernel_path_equals_reference(interp_dir, monkeypatch):
    from kiln.kernels import attention as attn_kernels
    from kiln.kernels import decode_attention, rotary
    from kiln.ops.attention import RelProjection

    # Llama's RoPE goes through the fused RoPE + cache write, never the separate rotation.
    fused, separate = _count_calls(monkeypatch, rotary, "rope_store"), _count_calls(monkeypatch, rotary, "rope")
    # Inkling's decode attention computes the relative bias from its projection's input.
    projected = _count_calls(monkeypatch, attn_kernels, "decode_attention",
                             when=lambda *a, **kw: isinstance(a[8] if len(a) > 8 else kw.get("rel"), RelProjection))
    # Inkling's decode writes K/V in its fused prologue.
    from kiln.kernels import conv_qk_norm as prologue_kernels
    in_prologue = _count_calls(monkeypatch, prologue_kernels, "conv_qk_norm_store")
    # MiniMax-M3's norms, RoPEs and cache write: one launch (kiln.kernels.msa_prologue) in every mode.
    from kiln.kernels import msa_prologue
    in_msa_prologue = _count_calls(monkeypatch, msa_prologue, "msa_prologue")
    # Decode attention merges its splits in the attention kernel (the engine passes its counters):
    # a launch of the separate merge kernel fails the test.
    monkeypatch.setattr(decode_attention, "_merge_kernel", None)
    # Prompts longer than the tiny sliding window (16) and MSA's selection start (32 tokens),
    # chunked (chunk 24 < prompt) so that extends have a cached prefix.
    # The interpreter runs MSA's kernels slowly: MiniMax-M3 gets two short-ish prompts.
    reqs = prompts(2, seed=1, lo=34, hi=44) if "minimax" in interp_dir else prompts(3, seed=1, lo=30, hi=60)
    kw = dict(page_size=4, chunked_prefill_size=24, max_prefill_tokens=64, context_length=INTERP_CONTEXT)
    want_out, want_rows = greedy(make_core(interp_dir, kernel_backend="reference", **kw), reqs, max_tokens=4)
    core = make_core(interp_dir, kernel_backend="triton", **kw)
    assert core.runner.use_kernels and core.runner.backend.gemv_max_rows == 0  # the GEMV's default off the GPU
    gemv_calls = _count_gemv(monkeypatch)
    got_out, got_rows = greedy(core, reqs, max_tokens=4)
    assert not gemv_calls  # --gemv-max-rows 0: every projection on F.linear, no norm folded
    assert got_out == want_out
    for rid in want_rows:
        torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-4, rtol=1e-4)
    if _arch(interp_dir) == "llama":
        assert fused[0] > 0 and separate[0] == 0, (fused, separate)
    assert (projected[0] > 0) == (_arch(interp_dir) == "inkling"), projected
    assert (in_prologue[0] > 0) == (_arch(interp_dir) == "inkling"), in_prologue
    assert (in_msa_prologue[0] > 0) == (_arch(interp_dir) == "minimax_m3"), in_msa_prologue
    assert not core.runner.backend.split_counters.any()  # every call leaves them zeroed


@pytest.mark.parametrize("interp_dir", ["llama", "inkling"], indirect=True)
def test_kernel_path_early_kv_at_batch_1_is_bit_identical(interp_dir, monkeypatch):
    """Decode steps of at most --attention-early-kv-max-bs sequences (1 by default) run the
    attention with `early_kv` (counted), and the engine's logits equal those of 0 (never) bit for
    bit; a verify or a larger step never takes it."""
    from kiln.kernels import attention as attn_kernels

    early = _count_calls(monkeypatch, attn_kernels, "decode_attention", when=lambda *a, **kw: kw.get("early_kv"))
    reqs = prompts(1, seed=10, lo=20, hi=30)
    kw = dict(page_size=4, chunked_prefill_size=24, max_prefill_tokens=64, context_length=INTERP_CONTEXT,
              kernel_backend="triton")
    want_out, want_rows = greedy(make_core(interp_dir, attention_early_kv_max_bs=0, **kw), reqs, max_tokens=4)
    assert early[0] == 0
    got_out, got_rows = greedy(make_core(interp_dir, **kw), reqs, max_tokens=4)
    assert early[0] > 0
    assert got_out == want_out
    for rid in want_rows:
        assert torch.equal(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]))


def _prologue_in_attention(monkeypatch, interp_dir, **kw) -> None:
    """One Inkling request: decode steps of at most --attention-prologue-max-bs sequences (here 1)
    make each layer's K/V inside the decode attention (counted: `prologue` passed, no
    `conv_qk_norm_store`) and generate what 0 (the default: the prologue kernel) generates;
    logits within summation-order tolerances."""
    from kiln.kernels import attention as attn_kernels
    from kiln.kernels import conv_qk_norm as prologue_kernels

    inside = _count_calls(monkeypatch, attn_kernels, "decode_attention", when=lambda *a, **k: k.get("prologue"))
    apart = _count_calls(monkeypatch, prologue_kernels, "conv_qk_norm_store")
    reqs = prompts(1, seed=12, lo=20, hi=30)
    # counts of this request's steps only: on a GPU the start-up warm-up serves a batch of 3, past
    # the flag's 1, whose steps run the prologue kernel apart
    kw.setdefault("skip_server_warmup", True)
    want_out, want_rows = greedy(make_core(interp_dir, attention_prologue_max_bs=0, **kw), reqs, max_tokens=4)
    assert inside[0] == 0 and apart[0] > 0
    calls_apart = apart[0]
    core = make_core(interp_dir, attention_prologue_max_bs=1, **kw)
    got_out, got_rows = greedy(core, reqs, max_tokens=4)
    # every decode step's layers (on a GPU: the batch-1 graph's capture), none apart
    assert inside[0] > 0 and inside[0] % core.runner.model.config.num_hidden_layers == 0, inside
    assert apart[0] == calls_apart
    assert got_out == want_out
    for rid in want_rows:
        torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("interp_dir", ["minimax_m3"], indirect=True)
def test_kernel_path_msa_prologue_equals_five_launches(interp_dir, monkeypatch):
    """MiniMax-M3 on the kernel path, prefill and decode: the one-launch prologue (counted), which
    at decode also scores MSA's blocks (counted), generates what --disable-msa-prologue (norm, norm,
    RoPE, RoPE, cache write) generates, and so does the prologue with the scores in a launch of
    their own (--disable-msa-prologue-scores)."""
    from kiln.kernels import msa_prologue

    calls = _count_calls(monkeypatch, msa_prologue, "msa_prologue")
    scored = _count_calls(monkeypatch, msa_prologue, "msa_prologue", when=lambda *a, **kw: kw.get("scores"))
    reqs = prompts(1, seed=4, lo=34, hi=40)  # past MSA's selection start (32): two chunks, then decode
    kw = dict(page_size=4, chunked_prefill_size=24, max_prefill_tokens=64, context_length=INTERP_CONTEXT,
              kernel_backend="triton")
    want_out, want_rows = greedy(make_core(interp_dir, disable_msa_prologue=True, **kw), reqs, max_tokens=3)
    assert calls[0] == 0
    for flags in ({}, {"disable_msa_prologue_scores": True}):
        calls[0] = scored[0] = 0
        got_out, got_rows = greedy(make_core(interp_dir, **flags, **kw), reqs, max_tokens=3)
        assert calls[0] > 0 and (scored[0] > 0) == (not flags), (calls, scored)
        assert got_out == want_out
        for rid in want_rows:
            torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("interp_dir", ["inkling"], indirect=True)
def test_kernel_path_prologue_in_attention_at_batch_1(interp_dir, monkeypatch):
    _prologue_in_attention(monkeypatch, interp_dir, page_size=4, chunked_prefill_size=24, max_prefill_tokens=64,
                           context_length=INTERP_CONTEXT, kernel_backend="triton")


def _count_calls(monkeypatch, module, name: str, when=None) -> list[int]:
    """[calls] of module.name from now on (a list, so that the caller sees the count grow); with
    `when`, only the calls whose arguments it accepts."""
    calls, real = [0], getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += when is None or bool(when(*args, **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _count_gemv(monkeypatch, glu_calls: dict | None = None, conv_calls: dict | None = None,
                norm_calls: dict | None = None, rope_calls: dict | None = None,
                norm_out_calls: dict | None = None, rows: dict | None = None) -> dict:
    """Count `kiln.kernels.gemv.gemv`, `gemv_prenorm` and `gemv_add_norm` calls per weight (by data
    pointer) from now on; those with the SiLU-and-mul folded in (glu=True) also into `glu_calls`,
    those with a ShortConv epilogue into `conv_calls`, those with a norm prologue into
    `norm_calls`, those with RoPE and the cache write in their epilogue into `rope_calls`, those
    with a norm epilogue into `norm_out_calls`; `rows` maps each pointer to its weight's rows."""
    from kiln.kernels import gemv as gemv_module

    calls: dict[int, int] = {}

    def count(into, weight):
        if into is not None:
            into[weight.data_ptr()] = into.get(weight.data_ptr(), 0) + 1
        if rows is not None:
            rows[weight.data_ptr()] = weight.shape[0]

    real, real_prenorm, real_add_norm = gemv_module.gemv, gemv_module.gemv_prenorm, gemv_module.gemv_add_norm

    def counted(x, weight, **kw):
        count(calls, weight)
        count(glu_calls if kw.get("glu") else None, weight)
        count(conv_calls if kw.get("conv") is not None else None, weight)
        count(rope_calls if kw.get("rope") is not None else None, weight)
        return real(x, weight, **kw)

    def counted_prenorm(h, residual, norm_weight, eps, weight, **kw):
        count(calls, weight)
        count(glu_calls if kw.get("glu") else None, weight)
        count(norm_calls, weight)
        count(rope_calls if kw.get("rope") is not None else None, weight)
        return real_prenorm(h, residual, norm_weight, eps, weight, **kw)

    def counted_add_norm(x, weight, *args, **kw):
        count(calls, weight)
        count(norm_out_calls, weight)
        return real_add_norm(x, weight, *args, **kw)

    monkeypatch.setattr(gemv_module, "gemv", counted)
    monkeypatch.setattr(gemv_module, "gemv_prenorm", counted_prenorm)
    monkeypatch.setattr(gemv_module, "gemv_add_norm", counted_add_norm)
    return calls


def _gemv_modules(core, calls: dict) -> set[str]:
    """Names (without the layer index) of the modules whose weights went through the GEMV."""
    names = {p.data_ptr(): n for n, p in core.runner.model.named_parameters()}
    return {".".join(x for x in names[ptr].split(".")[:-1] if not x.isdigit()) for ptr in calls}


# The projections each architecture routes through the GEMV at decode (kiln/layers/decode_gemv.py),
# the LM head included (`decode_logits`).
GEMV_MODULES = {
    "llama": {"model.layers.self_attn.qkv_proj", "model.layers.self_attn.o_proj",
              "model.layers.mlp.gate_up_proj", "model.layers.mlp.down_proj", "lm_head"},
    "inkling": {"model.layers.self_attn.qkvr_proj", "model.layers.self_attn.o_proj",
                "model.layers.mlp.gate_up_proj", "model.layers.mlp.down_proj", "lm_head"},
    # (MiniMax-M3's indexer.qk_proj: in the qkv_proj GEMV, its weight stacked after qkv_proj's)
    "minimax_m3": {"model.layers.self_attn.qkv_proj", "model.layers.self_attn.o_proj",
                   "model.layers.mlp.gate_up_proj", "model.layers.mlp.down_proj", "lm_head"},
}
# Where the MoE kernels run (CUDA; the CPU engine keeps the MoE reference), the routers' logits too.
ROUTERS = {"llama": set(), "inkling": {"model.layers.mlp.router"}, "minimax_m3": {"model.layers.mlp.gate"}}


def _arch(arch_dir: str) -> str:
    base = os.path.basename(arch_dir)  # the architecture's name, numbered by tmp_path_factory
    return next(a for a in GEMV_MODULES if base.startswith(a))


@pytest.mark.parametrize("interp_dir", ["llama", "inkling", "minimax_m3"], indirect=True)
def test_decode_gemv_path_equals_reference(interp_dir, monkeypatch):
    """Decode steps of at most --gemv-max-rows rows project through Kiln's GEMV and generate what
    the reference path generates (0, the CPU's default, keeps every projection on F.linear:
    `test_kernel_path_equals_reference` checks that). The GEMV is counted per
    weight, so a projection that silently falls back (e.g. loses its `batch`) fails. Under
    --fold-norms-max-hidden (by default) the pre-norms run in the prologues of the first
    projections that read them (the hybrids run only that variant here: the interpreter's time);
    without it, Llama's run in the epilogues of the projections before them."""
    from kiln.layers import decode_gemv

    arch = _arch(interp_dir)
    monkeypatch.setattr(decode_gemv, "NORM_EPILOGUE_MAX_ROWS", 4)  # the epilogue at these 3-row steps
    glu_calls: dict[int, int] = {}
    conv_calls: dict[int, int] = {}
    norm_calls: dict[int, int] = {}
    rope_calls: dict[int, int] = {}
    norm_out_calls: dict[int, int] = {}
    weight_rows: dict[int, int] = {}
    calls = _count_gemv(monkeypatch, glu_calls, conv_calls, norm_calls, rope_calls, norm_out_calls, weight_rows)
    llama = arch == "llama"
    # hybrids: prompts past the tiny sliding window and MSA's selection start, as above
    reqs = prompts(3, seed=2, lo=20, hi=30) if llama else prompts(2, seed=2, lo=34, hi=40)
    kw = dict(page_size=4, chunked_prefill_size=24, max_prefill_tokens=64, context_length=INTERP_CONTEXT)
    want_out, want_rows = greedy(make_core(interp_dir, kernel_backend="reference", **kw), reqs, max_tokens=4)
    # (--gemv-max-rows 0, the default on the CPU: test_kernel_path_equals_reference)
    for rows, fold in (((4, False), (4, True)) if llama else ((4, True),)):
        for c in (calls, glu_calls, conv_calls, norm_calls, rope_calls, norm_out_calls):
            c.clear()
        # the fold by default (hidden 64 <= --fold-norms-max-hidden's 2048); 0 turns it off
        core = make_core(interp_dir, kernel_backend="triton", gemv_max_rows=rows,
                         **({} if fold else dict(fold_norms_max_hidden=0)), **kw)
        got_out, got_rows = greedy(core, reqs, max_tokens=4)
        assert got_out == want_out
        for rid in want_rows:
            torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-4, rtol=1e-4)
        assert _gemv_modules(core, calls) == GEMV_MODULES[arch]
        if arch == "minimax_m3":  # each qkv GEMV also projects the indexer: one launch for both
            for layer in core.runner.model.model.layers:
                a = layer.self_attn
                assert weight_rows[a.qkv_proj.weight.data_ptr()] == a.qkv_proj.weight.shape[0] + \
                    a.indexer.qk_proj.weight.shape[0]
        if llama:  # 3 decode steps of 3 rows, 2 layers x 4 projections (prefill chunks are longer), and the
            # LM head on those steps and on prefill chunks that want at most 4 rows of logits
            head = core.runner.model.lm_head.weight.data_ptr()
            assert sum(n for ptr, n in calls.items() if ptr != head) == 3 * 2 * 4 and calls[head] >= 3, calls
        # Every dense MLP's SiLU-and-mul rides in its gate_up GEMV (at most 4 rows: the FMA loop).
        assert _gemv_modules(core, glu_calls) == {m for m in GEMV_MODULES[arch] if "gate_up" in m}
        # Inkling's o_conv runs in its o_proj GEMV's epilogue, the dense layer's out_conv in its
        # down_proj's (the MoE layers' in the expert down GEMV's, on CUDA only: the CPU engine keeps
        # the MoE reference).
        assert _gemv_modules(core, conv_calls) == (
            {"model.layers.self_attn.o_proj", "model.layers.mlp.down_proj"} if arch == "inkling" else set())
        # Folded norms: the input norm into qkv(r) (and MiniMax-M3's indexer, stacked after it),
        # a dense MLP's post-attention norm into gate_up; MoE layers keep theirs on the CPU (the
        # MoE reference computes its own logits; on CUDA the router GEMV takes it).
        assert _gemv_modules(core, norm_calls) == ({m for m in GEMV_MODULES[arch] if "qkv" in m or "gate_up" in m}
                                                   if fold else set())
        # Llama's qkv GEMV rotates q and k and writes the cache in its epilogue, folded norm or not
        # (`qkv_rope_args`); the hybrids have no RoPE.
        assert _gemv_modules(core, rope_calls) == ({"model.layers.self_attn.qkv_proj"} if llama else set())
        # Unfolded, Llama's post-attention norm runs in o_proj's epilogue, the next layer's input
        # norm and the final norm in down_proj's (`decode_linear_norm`).
        assert _gemv_modules(core, norm_out_calls) == (
            {"model.layers.self_attn.o_proj", "model.layers.mlp.down_proj"} if llama and not fold else set())


@pytest.mark.gpu
@pytest.mark.parametrize("arch_dir", ["llama", "inkling", "minimax_m3"], indirect=True)
def test_decode_gemv_on_cuda_equals_cublas(arch_dir, monkeypatch):
    """On the GPU (compiled kernels, CUDA graphs, fp32): one request decoding through the GEMV (the
    default on an sm_90+ GPU, --gemv-max-rows 1 elsewhere) generates what --gemv-max-rows 0 (cuBLAS)
    generates."""
    arch = _arch(arch_dir)
    calls = _count_gemv(monkeypatch)
    reqs = prompts(1, seed=3, lo=34, hi=40)
    kw = dict(page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=4)
    want_out, want_rows = greedy(make_core(arch_dir, gemv_max_rows=0, **kw), reqs, max_tokens=8)
    assert not calls
    from kiln.kernels.launch import pdl_supported

    core = make_core(arch_dir, **kw)
    # the default: 1 where PDL lets the GEMV stream early (sm_90+), else 0 and the flag asks for it
    assert core.runner.backend.gemv_max_rows == int(pdl_supported(core.runner.device))
    if not pdl_supported(core.runner.device):
        core = make_core(arch_dir, gemv_max_rows=1, **kw)
    got_out, got_rows = greedy(core, reqs, max_tokens=8)
    assert got_out == want_out
    for rid in want_rows:
        torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-3, rtol=1e-3)
    assert _gemv_modules(core, calls) == GEMV_MODULES[arch] | ROUTERS[arch]


@pytest.mark.gpu
@pytest.mark.parametrize("arch_dir", ["inkling"], indirect=True)
def test_prologue_in_attention_on_cuda_equals_prologue_kernel(arch_dir, monkeypatch):
    """On the GPU (compiled kernels, CUDA graphs, fp32, the GEMV path): the prologue inside the
    decode attention at batch 1 generates what the prologue kernel generates."""
    # graphs of batch 1 only: a larger one's capture would run the prologue kernel (past the flag's 1)
    _prologue_in_attention(monkeypatch, arch_dir, page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=1)


@pytest.mark.gpu
@pytest.mark.parametrize("arch_dir", ["llama"], indirect=True)
@pytest.mark.parametrize("fold", [0, 2048])
def test_fused_qkv_rope_on_cuda_equals_rope_store(arch_dir, fold, monkeypatch):
    """On the GPU (compiled, CUDA graphs, fp32, batch 1): the qkv GEMV with RoPE and the cache
    write in its epilogue (counted), with and without the norm in its prologue, generates what
    --disable-fused-qkv-rope (the GEMV, then `rope_store`) generates."""
    reqs = prompts(1, seed=9, lo=34, hi=40)
    kw = dict(page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=4, gemv_max_rows=1,
              fold_norms_max_hidden=fold)
    want_out, want_rows = greedy(make_core(arch_dir, disable_fused_qkv_rope=True, **kw), reqs, max_tokens=8)
    rope_calls: dict[int, int] = {}
    _count_gemv(monkeypatch, rope_calls=rope_calls)
    core = make_core(arch_dir, **kw)
    got_out, got_rows = greedy(core, reqs, max_tokens=8)
    assert _gemv_modules(core, rope_calls) == {"model.layers.self_attn.qkv_proj"}
    assert got_out == want_out
    for rid in want_rows:
        torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("arch_dir", ["llama"], indirect=True)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_norm_epilogue_on_cuda_equals_norm_kernel(arch_dir, batch_size, monkeypatch):
    """On the GPU (compiled, CUDA graphs, fp32): with the fold off, the post-attention norms run in
    o_proj's GEMV epilogue and the input and final norms in down_proj's (counted; the last
    program of thousands norms the rows in real shapes: `test_gemv_add_norm_real_shapes`), and
    the engine generates what it generates with the norm kernel (--disable-norm-epilogue), at one
    row (the default's limit) and at three."""
    from kiln.layers import decode_gemv

    monkeypatch.setattr(decode_gemv, "NORM_EPILOGUE_MAX_ROWS", batch_size)
    reqs = prompts(batch_size, seed=8, lo=34, hi=40)
    kw = dict(page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=4, gemv_max_rows=batch_size,
              fold_norms_max_hidden=0)
    norm_out_calls: dict[int, int] = {}
    _count_gemv(monkeypatch, norm_out_calls=norm_out_calls)
    want_out, want_rows = greedy(make_core(arch_dir, disable_norm_epilogue=True, **kw), reqs, max_tokens=8)
    assert not norm_out_calls  # the flag keeps the norm kernel
    core = make_core(arch_dir, **kw)
    got_out, got_rows = greedy(core, reqs, max_tokens=8)
    assert _gemv_modules(core, norm_out_calls) == {"model.layers.self_attn.o_proj", "model.layers.mlp.down_proj"}
    assert got_out == want_out
    for rid in want_rows:
        torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("arch_dir", ["inkling"], indirect=True)
def test_out_conv_epilogue_on_cuda_equals_separate_conv(arch_dir, monkeypatch):
    """On the GPU (compiled, CUDA graphs, fp32, batch 1): Inkling's out_conv runs in the one-token
    down expert GEMV's epilogue (counted), and the engine generates what it generates with every
    conv as its own launch (`epilogue_conv_args` declining)."""
    from kiln.kernels import moe as km
    from kiln.layers import decode_gemv
    from kiln.layers import moe as moe_layer

    reqs = prompts(1, seed=5, lo=34, hi=40)
    kw = dict(page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=4, gemv_max_rows=1)
    with monkeypatch.context() as m:  # both users of the rule: the dense down_proj and the MoE
        m.setattr(decode_gemv, "epilogue_conv_args", lambda *a, **kw: None)
        m.setattr(moe_layer, "epilogue_conv_args", lambda *a, **kw: None)
        want_out, want_rows = greedy(make_core(arch_dir, **kw), reqs, max_tokens=8)
    fused = []
    real = km.fused_experts
    monkeypatch.setattr(km, "fused_experts", lambda *a, conv=None, **k: (fused.append(conv is not None),
                                                                          real(*a, conv=conv, **k))[1])
    got_out, got_rows = greedy(make_core(arch_dir, **kw), reqs, max_tokens=8)
    assert any(fused), "no MoE layer ran out_conv in its down GEMV"
    assert got_out == want_out
    for rid in want_rows:
        torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("arch_dir", ["inkling", "minimax_m3"], indirect=True)
def test_fused_router_gate_on_cuda_equals_two_launches(arch_dir, monkeypatch):
    """On the GPU (compiled, CUDA graphs, fp32, batch 1): `--fused-router-gate` runs each router's
    logits and gate as one launch (counted) and generates what the two launches generate."""
    from kiln.kernels import moe_gate

    reqs = prompts(1, seed=6, lo=34, hi=40)
    # without the norms folded: a router GEMV with the norm in its prologue computes the logits itself
    kw = dict(page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=4, gemv_max_rows=1,
              fold_norms_max_hidden=0)
    want_out, want_rows = greedy(make_core(arch_dir, **kw), reqs, max_tokens=8)
    fused = []
    real = moe_gate._fused_router_gate
    monkeypatch.setattr(moe_gate, "_fused_router_gate", lambda *a, **k: (fused.append(1), real(*a, **k))[1])
    got_out, got_rows = greedy(make_core(arch_dir, fused_router_gate=True, **kw), reqs, max_tokens=8)
    assert fused, "no router ran its gate in the same launch"
    assert got_out == want_out
    for rid in want_rows:
        torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("arch_dir", ["llama", "inkling", "minimax_m3"], indirect=True)
def test_fold_norms_on_cuda_equals_separate_norms(arch_dir, monkeypatch):
    """On the GPU (compiled, CUDA graphs, fp32, batch 1): --fold-norms-max-hidden runs the pre-norms
    in the GEMVs' prologues (counted; the routers' too, where the MoE kernels take their logits) and
    generates what the separate norm launches generate."""
    reqs = prompts(1, seed=7, lo=34, hi=40)
    kw = dict(page_size=4, dtype="float32", device="cuda", cuda_graph_max_bs=4, gemv_max_rows=1)
    want_out, want_rows = greedy(make_core(arch_dir, fold_norms_max_hidden=0, disable_norm_epilogue=True, **kw),
                                 reqs, max_tokens=8)
    norm_calls: dict[int, int] = {}
    _count_gemv(monkeypatch, norm_calls=norm_calls)
    core = make_core(arch_dir, fold_norms_max_hidden=2048, **kw)
    got_out, got_rows = greedy(core, reqs, max_tokens=8)
    # the input norms into qkv(r), the post-attention norms into the routers and dense gate_ups
    arch = _arch(arch_dir)
    folded = {m for m in GEMV_MODULES[arch] if "qkv" in m or "gate_up" in m} | ROUTERS[arch]
    assert _gemv_modules(core, norm_calls) == folded
    assert got_out == want_out
    for rid in want_rows:
        torch.testing.assert_close(torch.stack(got_rows[rid]), torch.stack(want_rows[rid]), atol=1e-4, rtol=1e-4)
