"""The benchmarks on the hybrid presets: `roofline_bytes` against hand counts from the tiny
presets' config numbers (MODELS.md 2 and 3 shapes), Llama numbers unchanged, `preset:` model
paths, and both scripts end to end on the tiny presets with the transformers row skipped."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import common  # noqa: E402
import hf_baseline  # noqa: E402
import latency  # noqa: E402
import offline_throughput  # noqa: E402
import roofline  # noqa: E402

from kiln.models import presets  # noqa: E402

V = 49216  # the presets' vocabulary (SmolLM2 + 5 special tokens, rounded to 64)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _swiglu(h, i):
    return 3 * h * i


def _inkling_tiny_hand(batch_contexts, nb):
    """Inkling tiny: H=64, L=6 (layers 0-4 sliding W=16, layer 5 full), Hq=4, Hkv=2, D=16,
    d_r=8, R=24, K=4, dense MLP 96 in layer 0, MoE (E=8, k=2, S=2, width 32) in layers 1-5,
    2 MTP layers, V=49216, untied."""
    h, hq, hkv, d, dr, r, kk = 64, 4, 2, 16, 8, 24, 4
    attn = h * (hq * d + 2 * hkv * d + hq * dr) + r * dr + hq * d * h + 2 * d  # qkvr, rel_proj, o, q/k norm
    convs = 2 * (hkv * d) * kk + 2 * h * kk  # k_conv, v_conv (Hkv*D channels), o_conv, out_conv (H)
    layer = attn + convs + 2 * h  # + input / post-attention norms
    expert = _swiglu(h, 32)
    router = (8 + 2) * h + 1  # routed + shared rows, global_scale
    dense = 6 * layer + _swiglu(h, 96) + 5 * (router + 2 * expert) + h  # + final norm
    lm_head = V * h
    b = len(batch_contexts)
    hit = 8 * (1 - (1 - 2 / 8) ** b)
    weights = (dense + lm_head + 5 * hit * expert) * nb
    active = (dense + lm_head + 5 * 2 * expert) * nb
    full = sum(2 * hkv * d * c for c in batch_contexts) * nb  # layer 5
    swa = sum(5 * 2 * hkv * d * min(c, 16) for c in batch_contexts) * nb  # layers 0-4
    conv = b * 6 * (2 * hkv * d + 2 * h) * (kk - 1) * nb  # 4 sites per layer, K-1 inputs each
    mtp = 2 * (3 * h + 2 * h * h + attn + 2 * h + _swiglu(h, 96))  # no ShortConv in MTP blocks
    return {"weights": weights, "active": active, "kv": full + swa + conv, "full": full, "swa": swa,
            "conv": conv, "mtp": mtp * nb, "routed_all": 5 * 8 * expert * nb}


def _minimax_tiny_hand(batch_contexts, nb):
    """MiniMax-M3 tiny: H=64, L=4 (MSA everywhere: B=8, N=4, DI=16), Hq=4, Hkv=2, D=16, dense MLP
    96 in layer 0, MoE (E=8, k=2, width 32, one shared expert of 32) in layers 1-3, untied."""
    h, hq, hkv, d, di = 64, 4, 2, 16, 16
    attn = 2 * hq * d * h + 2 * hkv * d * h + 2 * d + 2 * hkv * di * h  # q, o, k, v, q/k norm, indexer
    layer = attn + 2 * h
    expert = _swiglu(h, 32)
    dense = 4 * layer + _swiglu(h, 96) + 3 * (8 * h + expert) + h  # gate + shared expert; final norm
    lm_head = V * h
    b = len(batch_contexts)
    hit = 8 * (1 - (1 - 2 / 8) ** b)
    weights = (dense + lm_head + 3 * hit * expert) * nb
    active = (dense + lm_head + 3 * 2 * expert) * nb
    index_k = sum(4 * hkv * di * c for c in batch_contexts) * nb
    msa_kv = sum(4 * 2 * hkv * d * min(c, 8 * 4) for c in batch_contexts) * nb
    return {"weights": weights, "active": active, "kv": index_k + msa_kv, "index_k": index_k, "msa_kv": msa_kv}


@pytest.mark.parametrize("dtype,nb", [(torch.float32, 4), (torch.bfloat16, 2)])
@pytest.mark.parametrize("contexts", [[136], [5, 40, 100]])
def test_roofline_inkling_tiny_hand_count(dtype, nb, contexts):
    rl = roofline.roofline_bytes(roofline.meta_model(presets.get_preset("inkling", "tiny"), dtype), contexts)
    hand = _inkling_tiny_hand(contexts, nb)
    assert rl["weight_bytes"] == pytest.approx(hand["weights"], rel=1e-12)
    assert rl["active_weight_bytes"] == hand["active"]
    assert rl["kv"]["full_kv"] == hand["full"] and rl["kv"]["swa_kv"] == hand["swa"]
    assert rl["kv"]["conv"] == hand["conv"] and rl["kv_bytes"] == hand["kv"]
    assert rl["kv"]["index_k"] == rl["kv"]["msa_kv"] == 0
    assert rl["weights"]["not_in_decode"] == hand["mtp"]  # MTP layers: loaded, not read
    assert rl["weights"]["routed_all"] == hand["routed_all"]
    assert rl["weights"]["shared_experts"] == 5 * 2 * _swiglu(64, 32) * nb  # S=2 per MoE layer, always read
    assert rl["weights"]["embedding_not_read"] == V * 64 * nb
    assert rl["bytes_per_step"] == pytest.approx(hand["weights"] + hand["kv"], rel=1e-12)
    assert rl["moe"]["experts"] == 8 and rl["moe"]["top_k"] == 2 and rl["moe"]["layers"] == 5
    # Every parameter is in exactly one class, and the total matches the preset's own count.
    assert rl["params"]["total"] == presets.param_counts(presets.PRESETS["inkling"]["tiny"])[0]
    assert rl["weight_bytes_all_params"] == rl["params"]["total"] * nb


@pytest.mark.parametrize("contexts", [[136], [5, 40, 100]])
def test_roofline_minimax_tiny_hand_count(contexts):
    rl = roofline.roofline_bytes(roofline.meta_model(presets.get_preset("minimax_m3", "tiny"), torch.float32),
                                 contexts)
    hand = _minimax_tiny_hand(contexts, 4)
    assert rl["weight_bytes"] == pytest.approx(hand["weights"], rel=1e-12)
    assert rl["active_weight_bytes"] == hand["active"]
    assert rl["kv"]["index_k"] == hand["index_k"] and rl["kv"]["msa_kv"] == hand["msa_kv"]
    assert rl["kv"]["full_kv"] == rl["kv"]["swa_kv"] == rl["kv"]["conv"] == 0
    assert rl["kv_bytes"] == hand["kv"]
    assert rl["params"]["total"] == presets.param_counts(presets.PRESETS["minimax_m3"]["tiny"])[0]


@pytest.mark.parametrize("k", [1, 2])
def test_round_bytes_of_mtp_rounds_by_hand(k):
    """A round of K MTP drafts reads the verify (the target's weights at B (K + 1) rows, the B
    sequences' state once), the first K MTP layers and K draft heads (of a token map's rows)."""
    ctx = [40, 100]
    m = roofline.meta_model(presets.get_preset("inkling", "tiny"), torch.float32)
    rb = roofline.round_bytes(m, ctx, k, "mtp")
    rows = _inkling_tiny_hand([c for c in ctx for _ in range(k + 1)], 4)
    hand = _inkling_tiny_hand(ctx, 4)
    assert rb["verify_weight_bytes"] == pytest.approx(rows["weights"], rel=1e-12)
    assert rows["weights"] > hand["weights"]  # more rows hit more experts
    assert rb["kv_bytes"] == hand["kv"]
    assert rb["drafter_bytes"] == hand["mtp"] * k / 2  # tiny has 2 MTP layers of one shape
    assert rb["draft_head_bytes"] == k * V * 64 * 4
    assert rb["bytes_per_round"] == pytest.approx(rows["weights"] + hand["kv"] + hand["mtp"] * k / 2 + k * V * 64 * 4)
    assert roofline.round_bytes(m, ctx, k, "mtp", draft_head_rows=100)["draft_head_bytes"] == k * 100 * 64 * 4
    with pytest.raises(AssertionError, match="3 MTP steps, 2 MTP layers"):
        roofline.round_bytes(m, ctx, 3, "mtp")
    ngram = roofline.round_bytes(m, ctx, k, "ngram")
    assert ngram["drafter_bytes"] == ngram["draft_head_bytes"] == 0
    assert ngram["bytes_per_round"] == rb["verify_weight_bytes"] + rb["kv_bytes"]
    with pytest.raises(ValueError, match="unknown speculative algorithm"):
        roofline.round_bytes(m, ctx, k, "eagle")


def test_round_bytes_of_dspark_rounds():
    """A block drafter is read once a round with one draft head for its K rows; DSpark's is the
    target's own (counted by `presets.param_counts`), and without one the round is refused."""
    cfg = presets.get_preset("minimax_m3", "tiny", dspark=True)
    m = roofline.meta_model(cfg, torch.float32)
    rb = roofline.round_bytes(m, [60], 3, "dspark")
    drafter = presets.param_counts(cfg)[0] - presets.param_counts(presets.get_preset("minimax_m3", "tiny"))[0]
    assert rb["drafter_bytes"] == drafter * 4 and rb["draft_head_bytes"] == V * 64 * 4
    assert rb["verify_weight_bytes"] == pytest.approx(_minimax_tiny_hand([60] * 4, 4)["weights"], rel=1e-12)
    assert rb["kv_bytes"] == _minimax_tiny_hand([60], 4)["kv"]
    with pytest.raises(AssertionError, match="no block drafter"):
        roofline.round_bytes(roofline.meta_model(presets.get_preset("minimax_m3", "tiny"), torch.float32), [60], 3,
                             "dspark")


def test_expected_experts_and_batch_one():
    assert roofline.expected_distinct_experts(64, 6, 1) == 6
    assert roofline.expected_distinct_experts(8, 2, 3) == pytest.approx(8 * (1 - 0.75 ** 3))
    assert roofline.expected_distinct_experts(64, 6, 10_000) == pytest.approx(64)
    # Batch-1 "active" = what a step at batch 1 reads.
    m = roofline.meta_model(presets.get_preset("minimax_m3", "tiny"), torch.float32)
    assert roofline.roofline_bytes(m, [50])["weight_bytes"] == roofline.roofline_bytes(m, [50, 60])["active_weight_bytes"]


def test_roofline_bytes_equals_llama_formula():
    """On the Llama family the model-counted roofline is the formula's, to the byte."""
    for name, ctxs in (("llama-3.1-8b", [1000, 24]), ("qwen3-0.6b", [1088])):
        cfg = os.path.join(REPO, "benchmarks", "configs", name)
        new = roofline.roofline_bytes(roofline.meta_model(cfg, torch.bfloat16), ctxs)
        old = roofline.roofline(cfg, torch.bfloat16, ctxs)
        for key in ("weight_bytes", "weight_bytes_all_params", "kv_bytes", "kv_bytes_per_token", "bytes_per_step"):
            assert new[key] == old[key], (name, key)
        assert new["params"]["decode_read"] == old["params"]["decode_read"]
        assert new["params"]["total"] == old["params"]["total"]
        assert new["moe"] is None
    assert new["params"]["tied"]


def test_preset_model_path(tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    common.add_engine_args(p)
    args = p.parse_args(["--model-path", "preset:minimax_m3/tiny", "--load-format", "auto", "--device", "cpu"])
    config = common.engine_config(args)
    assert config.load_format == "dummy" and os.path.basename(config.model_path) == "minimax_m3-tiny"
    with open(os.path.join(config.model_path, "config.json")) as f:
        assert json.load(f) == presets.get_preset("minimax_m3", "tiny")
    assert hf_baseline.hf_unsupported_reason(config.model_path) == "transformers has no model_type 'minimax_m3'"
    assert hf_baseline.hf_unsupported_reason(os.path.join(REPO, "benchmarks", "configs", "qwen3-0.6b")) is None
    with pytest.raises(ValueError):
        common.resolve_model_path("preset:inkling")
    dspark = common.resolve_model_path("preset:minimax_m3/bench+dspark")
    assert os.path.basename(dspark) == "minimax_m3-bench+dspark"
    with open(os.path.join(dspark, "config.json")) as f:
        cfg = json.load(f)
    assert cfg == presets.get_preset("minimax_m3", "bench", dspark=True)
    assert cfg["dspark_config"]["num_layers"] == 5 and cfg["dspark_config"]["mask_token_id"] == cfg["vocab_size"] - 1
    with pytest.raises(ValueError, match="belongs to MiniMax-M3"):
        common.resolve_model_path("preset:inkling/tiny+dspark")


def test_latency_on_inkling_tiny(one_thread, capsys):
    result = latency.main(["--model-path", "preset:inkling/tiny", "--quick", "--hf", "--device", "cpu",
                           "--dtype", "float32", "--threads", "1", "--num-runs", "1"])
    rows = {r["engine"]: r for r in result["rows"]}
    assert set(rows) == {"kiln", "transformers"}
    assert rows["transformers"]["note"].startswith("skipped: transformers has no model_type 'inkling'")
    assert rows["kiln"]["decode_tok_s"] > 0 and rows["kiln"]["frac_of_nominal"] > 0
    rl = result["meta"]["roofline"]
    assert rl["moe"]["layers"] == 5 and rl["kv"]["swa_kv"] > 0 and rl["kv"]["conv"] > 0
    text = capsys.readouterr().out
    assert "inkling-tiny" in text and "active weights (batch 1)" in text and "sliding-window KV" in text


def test_offline_on_minimax_tiny(one_thread):
    result = offline_throughput.main(["--model-path", "preset:minimax_m3/tiny", "--quick", "--hf", "--device",
                                      "cpu", "--dtype", "float32", "--threads", "1", "--no-progress",
                                      "--num-requests", "4"])
    rows = {r["engine"]: r for r in result["rows"]}
    assert set(rows) == {"kiln", "transformers"}
    assert rows["kiln"]["complete"] and rows["kiln"]["output_tok_s"] > 0
    assert "skipped" in rows["transformers"]["note"]
