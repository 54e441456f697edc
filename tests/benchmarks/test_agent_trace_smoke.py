"""Smoke test of benchmarks/agent_trace.py on CPU: a seeded trace, replayed over HTTP against two
real `kiln serve` processes (device-only caching and HiCache with a disk tier) on a tiny Llama
whose pool holds one session at a time, so the HiCache server serves turns from host or disk."""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import agent_trace  # noqa: E402

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "intermediate_size": 128,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}
TRACE = ["--system-len", "16", "--context-len", "60", "--tool-len", "20", "--sigma", "0.1", "--turns", "3,4",
         "--output-len", "2,6", "--think-s", "0", "--vocab", "10,500", "--sessions-per-user", "2"]


def test_trace_is_seeded_and_grows_each_turn():
    spec = agent_trace.TraceSpec(sessions=3, system_len=16, context_len=60, tool_len=20, seed=5)
    a, b = agent_trace.make_trace(spec), agent_trace.make_trace(spec)
    assert [[t.new_tokens for t in s.turns] for s in a] == [[t.new_tokens for t in s.turns] for s in b]
    system = a[0].turns[0].new_tokens[:16]
    assert all(s.turns[0].new_tokens[:16] == system for s in a)  # one shared system prompt
    assert all(4 <= len(s.turns) <= 12 for s in a)


def test_agent_trace_replay_two_servers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    serve = (f"--model-path {tmp_path} --load-format dummy --skip-tokenizer-init --device cpu --page-size 4 "
             "--max-total-tokens 200 --log-level warning")
    out, png = tmp_path / "agent.json", tmp_path / "agent.png"
    rows = agent_trace.main(["--serve-args", serve, "--variant", "device=",
                             "--variant", f"hicache=--enable-hierarchical-cache --hicache-ratio 1 "
                                          f"--hicache-storage-backend file --hicache-storage-dir {tmp_path / 'disk'}",
                             "--concurrency", "1,2", *TRACE, "--out", str(out), "--plot", str(png)])
    assert [(r["variant"], r["concurrency"]) for r in rows] == [("device", 1), ("device", 2), ("hicache", 1),
                                                                 ("hicache", 2)]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] > 0 and r["throughput_tok_s_gpu"] > 0, r
        assert r["per_user_tok_s"] > 0 and r["ttft_p50_s"] > 0
        assert abs(r["hit_rate"] - (r["hit_device"] + r["hit_host"] + r["hit_disk"])) < 1e-9
    assert all(r["hit_host"] == r["hit_disk"] == 0 for r in rows[:2])
    assert rows[3]["hit_host"] + rows[3]["hit_disk"] > 0, rows[3]
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    assert png.stat().st_size > 1000
