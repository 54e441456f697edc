"""Speculative decoding on the engine's kernel path (Triton's interpreter on the CPU, fewer layers):
the MTP layers through the extend kernel, a verify's o_proj + o_conv on the GEMV, and the draft
heads of one row on the GEMV, each against the reference path's greedy output and the
teacher-forced MTP reference."""

from __future__ import annotations

import json

import pytest

from tests.engine.test_hybrid_engine import assert_reference, prompts
from tests.engine.test_speculative import (assert_mtp_reference, model_dir, plain_core, run_plain,  # noqa: F401
                                           run_spec, spec_core)


def _fewer_layers(model_dir: str, tmp_path) -> tuple[str, dict]:
    """A copy of the model's config with fewer layers, for the interpreter
    (`tests.engine.test_kernel_path.FEWER_LAYERS`): (its directory, the original config)."""
    from tests.engine.test_kernel_path import FEWER_LAYERS

    with open(f"{model_dir}/config.json") as f:
        cfg = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **FEWER_LAYERS.get(cfg["model_type"], {})}))
    return str(tmp_path), cfg


def test_kernel_path_mtp_matches_reference_path(model_dir, tmp_path, monkeypatch):
    # The Triton kernels (under the interpreter on the CPU) serve the MTP layers too: explicit
    # query positions, key_gap and key_offset in the extend kernel. Partial acceptance, so that
    # catch-up rows, draft rows and rejected drafts all occur; drafts must equal the reference.
    pytest.importorskip("triton")
    from kiln.kernels import attention as attn_kernels
    from kiln.ops.attention import RelProjection
    from tests.engine.test_kernel_path import INTERP_CONTEXT, _count_calls

    model_dir, cfg = _fewer_layers(model_dir, tmp_path)
    ps = prompts(2, seed=21, lo=18, hi=40)
    core = spec_core(model_dir, 3, alpha=0.01, page_size=4, kernel_backend="triton", context_length=INTERP_CONTEXT)
    assert core.runner.use_kernels
    # rows of a verify: several per request; Inkling's bias as a RelProjection (computed in the kernel)
    verify_projected = _count_calls(monkeypatch, attn_kernels, "decode_attention",
                                    when=lambda *a, **kw: isinstance(a[8], RelProjection)
                                    and a[4].numel() > len(set(a[4].tolist())))
    res, drafts, _ = run_spec(core, ps, max_tokens=12)
    if cfg["model_type"] == "inkling":  # verifies compute the relative bias in the decode kernel too
        assert verify_projected[0] > 0
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(model_dir, alpha=0.01, page_size=4), ps,
                                                              max_tokens=12)
    assert_reference(core, res)
    assert assert_mtp_reference(core, res, drafts) > 0


@pytest.mark.parametrize("model_dir", ["inkling"], indirect=True)
def test_kernel_path_verify_on_the_gemv_matches_reference_path(model_dir, tmp_path, monkeypatch):
    # With the GEMV on (--gemv-max-rows 1), a verify of at most 4 rows (K = 3 at batch 1: one chunk
    # of 4 rows; chunks of several requests are covered by the kernel's test) runs o_proj through
    # Kiln's GEMV (under the interpreter) with o_conv in its epilogue over the verify's chunk
    # (`conv_chunk`): greedy output equals plain greedy, and every emitted token's logits equal a
    # fresh reference prefill (the conv states the epilogue wrote are the ones the next rounds read).
    pytest.importorskip("triton")
    from kiln.kernels import gemv as gemv_module
    from tests.engine.test_kernel_path import INTERP_CONTEXT

    model_dir, _ = _fewer_layers(model_dir, tmp_path)
    chunk_rows = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda x, w, **kw: (
        kw.get("conv_chunk") and chunk_rows.append(x.shape[0]), real(x, w, **kw))[1])
    num_reqs, k = 1, 3
    ps = prompts(num_reqs, seed=23, lo=18, hi=40)
    core = spec_core(model_dir, k, alpha=0.01, page_size=4, kernel_backend="triton", context_length=INTERP_CONTEXT,
                     gemv_max_rows=1)
    res, _, _ = run_spec(core, ps, max_tokens=8)
    assert num_reqs * (k + 1) in chunk_rows  # whole verifies took the chunk epilogue
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(model_dir, alpha=0.01, page_size=4), ps,
                                                              max_tokens=8)
    assert_reference(core, res)


@pytest.mark.parametrize("model_dir", ["inkling"], indirect=True)
def test_kernel_path_draft_heads_on_the_gemv_match_reference_path(model_dir, tmp_path, monkeypatch):
    # With the GEMV on (--gemv-max-rows 1), an MTP draft head runs through Kiln's GEMV as a decode
    # step's LM head does (`DraftVocab.logits` with the pass's batch), one row on the FMA loop and
    # more (the prefill's, a verify's) on the MMA loop's head tile: the drafts still equal the
    # teacher-forced reference, and the output plain greedy's.
    pytest.importorskip("triton")
    from kiln.engine.spec import draft_vocab
    from kiln.kernels import gemv as gemv_module
    from tests.engine.test_kernel_path import INTERP_CONTEXT

    model_dir, _ = _fewer_layers(model_dir, tmp_path)
    gemv_calls, heads = [], []
    real_gemv, real_head = gemv_module.gemv, draft_vocab.head_logits
    monkeypatch.setattr(gemv_module, "gemv",
                        lambda x, w, **kw: (gemv_calls.append(kw.get("mma", False)), real_gemv(x, w, **kw))[1])

    def head(lm_head, rows, batch):
        before = len(gemv_calls)
        out = real_head(lm_head, rows, batch)
        heads.append((rows.shape[0], gemv_calls[before:]))
        return out

    monkeypatch.setattr(draft_vocab, "head_logits", head)
    ps = prompts(2, seed=29, lo=18, hi=40)
    core = spec_core(model_dir, 3, alpha=0.01, page_size=4, kernel_backend="triton", context_length=INTERP_CONTEXT,
                     gemv_max_rows=1)
    res, drafts, _ = run_spec(core, ps, max_tokens=8)
    assert heads and all(mma == [n > 1] for n, mma in heads), heads  # one GEMV each, the MMA loop past a row
    assert {n > 1 for n, _ in heads} == {False, True}, heads  # (batch 2, and 1 once a request is done)
    assert {rid: r[1] for rid, r in res.items()} == run_plain(plain_core(model_dir, alpha=0.01, page_size=4), ps,
                                                              max_tokens=8)
    assert assert_mtp_reference(core, res, drafts) > 0
