"""`benchmarks/speedup_bound.py`: the speedup ceiling of a speculative round from its bytes, and the
measured-experts override of `roofline.round_bytes` it relies on."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import common  # noqa: E402
import roofline  # noqa: E402
import speedup_bound  # noqa: E402

from kiln.models import presets  # noqa: E402


def _tiny():
    return roofline.meta_model(presets.get_preset("inkling", "tiny"), torch.bfloat16)


def test_measured_experts_replace_uniform_routing():
    """`experts_hit` sets the distinct experts per MoE layer: at top-k it reads what one token does,
    and each expert beyond adds one expert's bytes in every MoE layer."""
    m = _tiny()
    one = roofline.roofline_bytes(m, [40])
    moe = one["moe"]
    per_expert = one["weights"]["routed_all"] / (moe["experts"] * moe["layers"])
    four_at_k = roofline.roofline_bytes(m, [40] * 4, experts_hit=moe["top_k"])
    assert four_at_k["weight_bytes"] == pytest.approx(one["weight_bytes"])
    uniform = roofline.roofline_bytes(m, [40] * 4)
    hit = roofline.expected_distinct_experts(moe["experts"], moe["top_k"], 4)
    assert uniform["weight_bytes"] == pytest.approx(one["weight_bytes"] + (hit - moe["top_k"]) * per_expert * moe["layers"])
    rb = roofline.round_bytes(m, [40], 3, "ngram", verify_experts_hit=moe["top_k"] + 1)
    assert rb["bytes_per_round"] == pytest.approx(one["bytes_per_step"] + per_expert * moe["layers"])
    with pytest.raises(ValueError, match="experts hit"):
        roofline.roofline_bytes(m, [40] * 4, experts_hit=moe["top_k"] - 1)


def test_plain_needed_inverts_the_bound():
    """At the plain step `plain_needed` returns, the ceiling is the target exactly; at L <= target
    no plain step reaches it; a plain step already slow enough needs nothing more."""
    bp, br = 0.48, 0.81
    t = speedup_bound.plain_needed(3, 2.5, bp, br)
    assert 3 * t / (br + t - bp) == pytest.approx(2.5)
    assert speedup_bound.plain_needed(2.5, 2.5, bp, br) is None
    assert speedup_bound.plain_needed(3, 1.0, bp, br) == bp  # any step at its bytes already gives 3 / (br / bp) > 1


def test_bounds_rows_are_consistent():
    m = _tiny()
    cfg = common.model_config_of(presets.get_preset("inkling", "tiny"))
    plain = roofline.roofline_bytes(m, [100])["bytes_per_step"]
    bw = 1e12
    bytes_ms = plain / bw * 1e3
    head, rows = speedup_bound.bounds(m, [100], 2, 3 * bytes_ms, bw, [3.0, 4.0], 2.5, None, [None, 64, 0],
                                      speedup_bound.dflash_drafter(cfg))
    assert head["plain_bytes_ms"] == pytest.approx(bytes_ms)
    names = [r.variant for r in rows]
    assert names[0] == "ngram K=2" and "mtp K=2, full head" in names and "dflash K=2, head of 64 rows" in names
    for r in rows:
        floor = r.round_gb * 1e9 / bw * 1e3 + 2 * bytes_ms
        assert r.round_floor_ms == pytest.approx(floor)
        assert r.speedup[3.0] == pytest.approx(3 * 3 * bytes_ms / floor)
        assert r.at_roofline[3.0] == pytest.approx(3 * plain / (r.round_gb * 1e9))
        assert r.extra_gb > 0
    by = {r.variant: r for r in rows}
    # A smaller draft head reads less, so its ceiling is higher; prompt lookup reads no drafter.
    assert by["mtp K=2, head of 0 rows"].speedup[3.0] > by["mtp K=2, head of 64 rows"].speedup[3.0] \
        > by["mtp K=2, full head"].speedup[3.0]
    assert by["ngram K=2"].round_gb < by["dflash K=2, head of 0 rows"].round_gb
    # At its own bytes (H = 0) the ceiling is the both-at-the-roofline one.
    _, at_bytes = speedup_bound.bounds(m, [100], 2, bytes_ms, bw, [3.0], 2.5, None, [None], None)
    assert at_bytes[1].speedup[3.0] == pytest.approx(at_bytes[1].at_roofline[3.0])
    with pytest.raises(ValueError, match="faster than its bytes"):
        speedup_bound.bounds(m, [100], 2, 0.5 * bytes_ms, bw, [3.0], 2.5, None, [None], None)


def test_main_on_inkling_tiny(tmp_path, capsys):
    out = tmp_path / "bound.json"
    speedup_bound.main(["--model-path", "preset:inkling/tiny", "--num-steps", "2", "--plain-step-ms", "1.0",
                        "--bandwidth-tbs", "1.0", "--draft-head-rows", "full,64", "--out", str(out)])
    text = capsys.readouterr().out
    assert "| mtp K=2, head of 64 rows |" in text and "plain step needed for 2.5x at L = 3" in text
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 5 and rows[0]["variant"] == "ngram K=2"


def test_inkling_bench_mtp_cannot_reach_the_target_at_three():
    """The claims docs/speculative.md makes for issue 6 (the forty-sixth pass's 1.174 ms plain step
    on the H200, 4.25 TB/s, 11.9 distinct experts at a verify's 4 rows): MTP at K = 3 stays below
    2.5x at L = 3 whatever its draft head; DFlash's 1-layer drafter crosses it only with a head
    of fewer than 16K rows; a faster plain step lowers the ceiling."""
    m = roofline.meta_model(presets.get_preset("inkling", "bench"), torch.bfloat16)
    cfg = common.model_config_of(presets.get_preset("inkling", "bench"))
    _, rows = speedup_bound.bounds(m, [1088], 3, 1.174, 4.25e12, [3.0, 4.0], 2.5, 11.9, [None, 16384, 0],
                                   speedup_bound.dflash_drafter(cfg))
    mtp = [r for r in rows if r.variant.startswith("mtp")]
    assert len(mtp) == 3 and all(r.speedup[3.0] < 2.5 < r.speedup[4.0] for r in mtp)
    dflash = {r.variant: r.speedup[3.0] for r in rows if r.variant.startswith("dflash")}
    assert dflash["dflash K=3, full head"] < dflash["dflash K=3, head of 16384 rows"] < 2.5 < dflash["dflash K=3, head of 0 rows"]
    assert all(r.plain_needed_ms > 1.174 for r in mtp)
    _, faster = speedup_bound.bounds(m, [1088], 3, 0.9, 4.25e12, [3.0], 2.5, 11.9, [0], None)
    assert faster[1].speedup[3.0] < mtp[2].speedup[3.0]
