"""HiCache through `kiln serve` (SmolLM2, greedy): the OpenAI usage and /metrics split cached
tokens by tier, outputs stay the same when prefixes come back from host memory or disk,
/flush_cache empties every tier, and a restarted server finds its pages on disk."""

from __future__ import annotations

import os
import re

import httpx

from tests.kiln_server import kiln_server

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["rivers and lakes", "mountain ranges", "deep oceans"]


def prompt(topic: str) -> str:
    return (f"Here is a long list of facts about {topic}, written for a school encyclopedia. " * 6
            + "The most surprising fact is")


def complete(url: str, text: str) -> tuple[str, dict]:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 8,
                                                   "temperature": 0.0}, timeout=120)
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["text"], body["usage"]


def tier_metric(url: str, tier: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf'^kiln_cached_tokens_by_tier_total{{tier="{tier}"}} (\S+)$', text, re.MULTILINE)
    assert m, f"kiln_cached_tokens_by_tier_total{{tier={tier!r}}} missing from /metrics"
    return float(m.group(1))


def disk_pages(store: str) -> int:
    return sum(f.endswith(".pt") for _, _, files in os.walk(store) for f in files)


def test_hicache_report_flush_and_restart(tmp_path):
    store = str(tmp_path / "hicache")
    # A device pool of 16 pages holds one prompt (~10 pages) at a time; the host pool as much.
    args = ["--device", "cpu", "--log-level", "warning", "--page-size", "16", "--max-total-tokens", "256",
            "--max-running-requests", "2", "--enable-hierarchical-cache", "--hicache-ratio", "1",
            "--hicache-storage-backend", "file", "--hicache-storage-dir", store]
    with kiln_server(args) as (url, _):
        first = [complete(url, prompt(t)) for t in TOPICS]
        again = [complete(url, prompt(t)) for t in TOPICS]
        assert [t for t, _ in again] == [t for t, _ in first]
        for _, usage in again:
            details = usage["prompt_tokens_details"]
            tiers = details["cached_tokens_details"]
            assert details["cached_tokens"] == sum(tiers.values()) > 0
            assert tiers["device"] == 0, "each prompt should have been evicted from the device"
        assert tier_metric(url, "host") + tier_metric(url, "disk") > 0
        assert disk_pages(store) > 0
        assert httpx.post(url + "/flush_cache").status_code == 200
        assert disk_pages(store) == 0
        text, usage = complete(url, prompt(TOPICS[0]))
        assert text == first[0][0] and usage["prompt_tokens_details"]["cached_tokens"] == 0
    with kiln_server(args) as (url, _):  # a new process: the pages written after the flush are on disk
        text, usage = complete(url, prompt(TOPICS[0]))
        assert text == first[0][0]
        tiers = usage["prompt_tokens_details"]["cached_tokens_details"]
        assert tiers["disk"] > 0 and tiers["disk"] == usage["prompt_tokens_details"]["cached_tokens"]
