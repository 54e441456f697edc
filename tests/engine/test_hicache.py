"""HiCache: prefixes evicted from the device pool come back from host memory (L2) and disk (L3).

A device pool of 128 tokens and a host pool half its size force every scenario through device
eviction to the host, host eviction (the disk keeps the pages) and load-back, for the Llama family
and both hybrid models (sliding-window KV and ShortConv state for Inkling, MSA index keys for
MiniMax-M3). Greedy outputs must equal a large-pool engine without HiCache, and every sampled
logit row the packed reference forward within 1e-4. The integrity check runs after every
scheduler step and covers every tier, comparing each host copy with the device data it copies.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from kiln.config import EngineConfig
from kiln.engine.cache.hicache_config import HiCacheConfig
from kiln.engine.cache.storage import FileStorage, model_namespace, page_hash
from kiln.engine.core import EngineCore
from kiln.engine.io import GenerateReq
from kiln.engine.request import SamplingParams
from tests.engine.test_hybrid_engine import INKLING, MINIMAX, assert_reference, make_core, run, sampled_logits

LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512,
             tie_word_embeddings=True)
ARCHS = {"llama": LLAMA, "inkling": INKLING, "minimax_m3": MINIMAX}
# 32 device pages of 4 tokens; small chunks so nodes (and window tails) are short.
SMALL = dict(page_size=4, max_total_tokens=128, max_running_requests=2, chunked_prefill_size=16,
             max_prefill_tokens=32)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    (d / "config.json").write_text(json.dumps(ARCHS[request.param]))
    return str(d)


def hicache_core(model_dir: str, store, **kw) -> EngineCore:
    opts = {**SMALL, "enable_hierarchical_cache": True, "hicache_ratio": 0.5,
            "hicache_storage_backend": "file", "hicache_storage_dir": str(store), **kw}
    if opts["hicache_storage_backend"] is None:
        opts.pop("hicache_storage_dir")
    core = make_core(model_dir, **opts)
    core.cache.deep_check = True
    return core


def contexts(n: int = 8, length: int = 90, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (length,), generator=g).tolist() for _ in range(n)]


def agent_rounds(core: EngineCore, rounds: int = 3, tag: str = "a") -> dict:
    """Three sessions take turns; each turn resends its session's context, 12 tokens longer. The
    working set (3 x 64 tokens) outgrows the device pool, so turns find their prefix on the host
    or on disk."""
    ctx = contexts()[:3]
    res = {}
    for r in range(rounds):
        for s, c in enumerate(ctx):
            res.update(run(core, [c[:40 + 12 * r]], max_tokens=6, tag=f"{tag}{r}{s}_"))
    return res


def shared_prompt(core: EngineCore) -> dict:
    """Three requests share a system prompt, three unrelated ones evict it, two more reuse it."""
    ctx = contexts()
    system = ctx[0][:32]
    res = {}
    for i in range(3):
        res.update(run(core, [system + ctx[1 + i][:12]], max_tokens=6, tag=f"s{i}_"))
    for i in range(3):
        res.update(run(core, [ctx[4 + i][:40]], max_tokens=6, tag=f"f{i}_"))
    for i in range(2):
        res.update(run(core, [system + ctx[1 + i][12:24]], max_tokens=6, tag=f"t{i}_"))
    return res


def outputs(res: dict) -> dict:
    return {rid: v[1] for rid, v in res.items()}


@pytest.fixture(scope="module")
def expected(model_dir):
    """Greedy outputs of a large-pool engine without HiCache."""
    core = make_core(model_dir, **{**SMALL, "max_total_tokens": 4096})
    return {"agent": outputs(agent_rounds(core)), "shared": outputs(shared_prompt(core))}


def test_every_tier_serves_exact_hits_and_survives_a_restart(model_dir, expected, tmp_path):
    core = hicache_core(model_dir, tmp_path)
    res = agent_rounds(core)
    assert outputs(res) == expected["agent"]
    assert_reference(core, res)
    s = core.stats()
    assert s.cached_tokens_device_total > 0 and s.cached_tokens_host_total > 0 and s.cached_tokens_disk_total > 0, s
    assert s.cached_tokens_total == s.cached_tokens_device_total + s.cached_tokens_host_total + s.cached_tokens_disk_total
    assert s.hicache_loaded_tokens_total > 0 and s.hicache_disk_written_tokens_total > 0
    if core.cache.windows:  # sliding-window KV and ShortConv inputs came back from the host
        assert core.cache.hicache.stats.loaded_window_pages > 0
    core.shutdown()  # lands the disk writes, unlocks the host pool
    # A new engine on the same folder: the first turns are disk hits.
    again = hicache_core(model_dir, tmp_path)
    res = agent_rounds(again)
    assert outputs(res) == expected["agent"]
    assert_reference(again, res)
    first = [v[3] for rid, v in res.items() if rid.startswith("a0")]
    assert all(c > 0 for c in first), f"restarted engine missed the disk: {first}"
    assert again.stats().cached_tokens_disk_total >= sum(first)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_write_policies(model_dir, expected, tmp_path, policy):
    core = hicache_core(model_dir, tmp_path, hicache_write_policy=policy, hicache_ratio=1.0,
                        hicache_storage_backend=None)
    hc = core.cache.hicache
    first = contexts()[0][:32] + contexts()[1][:12]
    run(core, [first], max_tokens=6, tag="s0_")
    # Nothing was evicted yet: only write_through has copied anything to the host.
    assert (hc.stats.backed_up_pages > 0) == (policy == "write_through"), hc.stats
    core.flush_cache()
    res = shared_prompt(core)
    assert outputs(res) == expected["shared"]
    assert_reference(core, res)
    s = core.stats()
    assert s.cached_tokens_host_total > 0, s  # the system prompt came back from the host
    if policy == "write_through_selective":  # only the prompt reused twice went to the host
        assert hc.stats.backed_up_pages * core.cache.page_size < s.prompt_tokens_total // 2, hc.stats


def test_abort_during_load_back_and_flush_every_tier(model_dir, expected, tmp_path):
    core = hicache_core(model_dir, tmp_path)
    ctx = contexts()
    agent_rounds(core, rounds=1)  # sessions 0-2 cached; session 0 already evicted from the device
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    core.add_request(GenerateReq(rid="x", input_ids=ctx[0][:52], params=params))
    core.add_request(GenerateReq(rid="y", input_ids=ctx[1][:52], params=params))
    out = []
    for o in core.step():  # admitted: their prefixes were loaded back from the host or read from disk
        out += o.new_token_ids if o.rid == "y" else []
    assert any(r.rid == "x" for r in core.scheduler.running)
    assert core.scheduler.running[0].match_tiers["device"] < 40  # not all on the device
    core.abort("x")
    core.check_integrity()
    while core.has_work():
        for o in core.step():
            out += o.new_token_ids if o.rid == "y" else []
    assert out == expected["agent"]["a11_0"]
    # A request aborted while waiting holds nothing.
    core.add_request(GenerateReq(rid="z", input_ids=ctx[2][:52], params=params))
    core.abort("z")
    core.step()
    core.check_integrity()
    # Flush: device, host and this model's disk folder are empty; the next turn computes again.
    hc = core.cache.hicache
    assert hc.storage.num_pages() > 0
    assert core.flush_cache()
    assert core.cache.tree.num_pages == 0 and not core.cache.tree.root.children
    for space in hc.host.spaces.values():
        assert space.allocator.num_free == space.allocator.capacity
    assert hc.storage.num_pages() == 0
    core.check_integrity()
    res = run(core, [ctx[0][:52]], max_tokens=6, tag="a10_")
    assert res["a10_0"][1] == expected["agent"]["a10_0"] and res["a10_0"][3] == 0


@pytest.mark.parametrize("seed", range(2))
def test_random_operations_keep_every_tier_consistent(model_dir, tmp_path, seed):
    """Concurrent requests over few shared documents, random aborts and flushes, a tiny host pool
    and a disk tier: every finished request matches the reference forward, integrity holds
    after every step."""
    rng = random.Random(seed)
    core = hicache_core(model_dir, tmp_path, hicache_ratio=0.3,
                        hicache_write_policy=rng.choice(["write_through", "write_back"]))
    docs = contexts(n=4, length=80, seed=seed + 10)
    finished, n = {}, 0
    with sampled_logits(core) as rows:
        prompts, outs = {}, {}
        for step in range(120):
            if rng.random() < 0.3:
                doc = rng.choice(docs)
                ids = doc[:rng.randint(20, 70)] + [rng.randrange(512) for _ in range(rng.randint(0, 6))]
                rid = f"q{n}"
                n += 1
                prompts[rid] = ids
                core.add_request(GenerateReq(rid=rid, input_ids=ids, params=SamplingParams(
                    max_tokens=rng.randint(1, 8), temperature=0.0, ignore_eos=True)))
            live = [r.rid for r in list(core.scheduler.running) + list(core.scheduler.waiting)]
            if live and rng.random() < 0.05:
                core.abort(rng.choice(live))
            if rng.random() < 0.02:
                core.flush_cache()  # refused while requests run
            for o in core.step():
                assert o.error is None, o.error
                outs.setdefault(o.rid, []).extend(o.new_token_ids)
                if o.finished:
                    finished[o.rid] = o.finish_reason
        while core.has_work():
            for o in core.step():
                outs.setdefault(o.rid, []).extend(o.new_token_ids)
                if o.finished:
                    finished[o.rid] = o.finish_reason
        core.check_integrity()
        done = {rid: (prompts[rid], outs[rid], rows[rid], 0) for rid, why in finished.items() if why == "length"}
        assert len(done) >= 5
        assert_reference(core, done)
        s = core.stats()  # every tier was exercised
        assert s.hicache_backed_up_tokens_total > 0 and s.hicache_disk_written_tokens_total > 0, s
        assert s.hicache_loaded_tokens_total + s.hicache_disk_read_tokens_total > 0, s


def test_bad_flags_are_named():
    def err(**kw) -> str:
        with pytest.raises(ValueError) as e:
            HiCacheConfig.from_engine_config(EngineConfig(**kw))
        return str(e.value)

    assert "--enable-hierarchical-cache" in err(hicache_storage_backend="file")
    assert "--enable-hierarchical-cache" in err(hicache_ratio=4.0)
    assert "--disable-radix-cache" in err(enable_hierarchical_cache=True, disable_radix_cache=True)
    assert "--hicache-ratio" in err(enable_hierarchical_cache=True, hicache_ratio=0.0)
    assert "--hicache-size" in err(enable_hierarchical_cache=True, hicache_size=-1.0)
    assert "--hicache-write-policy" in err(enable_hierarchical_cache=True, hicache_write_policy="lazy")
    assert "--hicache-storage-backend" in err(enable_hierarchical_cache=True, hicache_storage_dir="/tmp/x")
    assert "--hicache-storage-prefetch-policy" in err(enable_hierarchical_cache=True,
                                                      hicache_storage_prefetch_policy="never")
    assert HiCacheConfig.from_engine_config(EngineConfig()) is None


def test_hicache_size_in_gb(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    core = hicache_core(str(tmp_path), tmp_path, hicache_size=0.001, hicache_storage_backend=None)
    host = core.cache.hicache.host
    assert 0.5e6 < host.nbytes() <= 1e6 + 64 * 1024  # within one page of the size asked for


def test_disk_keys_chain_over_the_prefix_and_the_model(tmp_path):
    a, b = model_namespace({"config": 1}), model_namespace({"config": 2})
    assert a != b
    assert page_hash(a, [1, 2]) != page_hash(b, [1, 2])
    assert page_hash(page_hash(a, [1, 2]), [3, 4]) != page_hash(page_hash(a, [9, 2]), [3, 4])
    store = FileStorage(str(tmp_path), a)
    key = page_hash(a, [1, 2])
    big = torch.arange(100_000.0)
    assert store.put(key, {"main": [big[:2]]}) and not store.put(key, {"main": [big[2:4]]})
    got = store.get(key)
    assert torch.equal(got["main"][0], torch.tensor([0.0, 1.0]))
    assert os.path.getsize(store.path(key)) < 10_000  # the view's base storage was not written
    assert not [f for _, _, fs in os.walk(store.dir) for f in fs if ".tmp-" in f]
    with open(store.path(key), "wb") as f:  # a damaged file reads as absent and goes away
        f.write(b"garbage")
    assert store.get(key) is None and not store.exists(key)
    other = FileStorage(str(tmp_path), b)
    other.put(page_hash(b, [1, 2]), {"main": [big[:2]]})
    store.clear()
    assert store.num_pages() == 0 and other.num_pages() == 1  # flush removes this model's pages only


def test_report_without_hicache_is_all_device(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    core = make_core(str(tmp_path), page_size=4)
    base = contexts()[0][:40]
    run(core, [base], tag="a")
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    core.add_request(GenerateReq(rid="b", input_ids=base + [1, 2, 3], params=params))
    details = None
    while core.has_work():
        for o in core.step():
            details = o.cached_tokens_details or details
    assert details == {"device": 40, "host": 0, "disk": 0}


@pytest.mark.gpu
def test_cuda_pinned_side_stream_copies(model_dir, tmp_path):
    """On CUDA the tiers copy through pinned memory on a side stream; the forward must still see
    every load-back (same greedy outputs as a large-pool engine, host copies equal the device)."""
    cuda = dict(device="cuda", dtype="float32")
    core = hicache_core(model_dir, tmp_path, **cuda)
    assert core.cache.hicache.host.spaces["main"].tensors[0].is_pinned()
    res = agent_rounds(core)
    base = make_core(model_dir, **{**SMALL, "max_total_tokens": 4096, **cuda})
    assert outputs(res) == outputs(agent_rounds(base))
    s = core.stats()
    assert s.cached_tokens_host_total > 0 and s.cached_tokens_disk_total > 0, s
    host = core.cache.hicache.host.spaces["main"].tensors[0]
    core.shutdown()  # unlocks the pool
    assert _registers_again(host)


def _registers_again(host: torch.Tensor) -> bool:
    """Whether a host buffer (still allocated: the caller holds it) is no longer page-locked:
    registering it succeeds (it is unregistered again)."""
    cudart = torch.cuda.cudart()
    ok = int(cudart.cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)) == 0
    assert int(cudart.cudaHostUnregister(host.data_ptr())) == 0
    return ok


@pytest.mark.gpu
def test_cuda_host_pool_unlocks_its_buffers():
    """The pool's page-locked registration ends while its memory is still allocated: at `close`,
    or at the next safe point after the pool is dropped (its finalizer only parks the buffers: it
    may run inside a CUDA graph capture). A registration left behind outlives the memory: when the
    allocator hands those addresses out again, CUDA DMAs from the old pages (a later engine in
    the process read stale page tables)."""
    import gc

    from kiln.engine.cache.host_pool import HostPool, unlock_dropped

    dev = torch.device("cuda")
    kv = torch.zeros(64, 2, 8, device=dev)

    def pool_buffer():
        pool = HostPool({"main": lambda: [kv]}, {"main": 8}, 4, dev)
        host = pool.spaces["main"].tensors[0]
        assert host.is_pinned()
        return pool, host

    pool, host = pool_buffer()
    pool.close()
    assert _registers_again(host)

    pool, host = pool_buffer()
    del pool
    gc.collect()
    unlock_dropped()
    assert _registers_again(host)

    # Dropped inside a CUDA graph capture: the capture stays valid, and the next pool unlocks it.
    pool, host = pool_buffer()
    x = torch.zeros(4, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x + 1
        del pool
        gc.collect()
    graph.replay()
    assert y.sum().item() == 4
    pool_buffer()[0].close()
    assert _registers_again(host)


@pytest.mark.gpu
def test_failed_host_registration_leaves_no_cuda_error():
    """After a failed cudaHostRegister (here: the range is registered already), `_clear_cuda_error`
    keeps it from surfacing as the next kernel's failure (the runtime keeps it as the thread's
    last error; call 2 of the ninth pass showed the next op raising without it)."""
    from kiln.engine.cache.host_pool import _clear_cuda_error

    cudart = torch.cuda.cudart()
    t = torch.empty(1 << 16)
    nbytes = t.numel() * t.element_size()
    assert int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)) == 0
    try:
        assert int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)) != 0
        _clear_cuda_error(torch.device("cuda"))
        assert torch.ones(4, device="cuda").sum().item() == 4
    finally:
        cudart.cudaHostUnregister(t.data_ptr())


def test_dropped_pools_buffers_are_unregistered_once_at_a_safe_point(monkeypatch):
    """`_Unlocker` bookkeeping, with the CUDA calls faked: parking calls nothing; `unlock_dropped`
    synchronizes each device once, then unregisters every parked buffer once."""
    from kiln.engine.cache import host_pool

    calls = []

    class FakeCudart:
        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", str(device))))
    unlocker = host_pool._Unlocker()
    monkeypatch.setattr(host_pool, "_UNLOCKER", unlocker)
    a, b = torch.empty(4), torch.empty(8)
    first, second = [a], [b]
    unlocker.park(first, torch.device("cuda", 0))
    unlocker.park(second, torch.device("cuda", 0))
    assert first == [] and second == [] and calls == []  # a finalizer touches no CUDA
    host_pool.unlock_dropped()
    assert calls[0] == ("sync", "cuda:0")
    assert sorted(calls[1:]) == sorted([("unregister", a.data_ptr()), ("unregister", b.data_ptr())])
    host_pool.unlock_dropped()
    assert len(calls) == 3  # each buffer once

    def failing_sync(device=None):
        raise RuntimeError("device lost")

    unlocker.park([a], torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "synchronize", failing_sync)
    with pytest.raises(RuntimeError, match="device lost"):
        host_pool.unlock_dropped()
    assert unlocker.parked == [(a, torch.device("cuda", 0))]  # still allocated, still parked


def test_weight_update_moves_disk_keys(tmp_path):
    """Pages computed after a weight update must never be found by an engine that loads the
    original weights (a restart): their disk keys chain from another root."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    core = hicache_core(str(tmp_path), tmp_path / "store")
    prompt = contexts()[0][:40]
    run(core, [prompt], tag="a")
    name, tensor = next(iter(core.runner.model.state_dict().items()))
    core.update_weights_from_tensor([(name, tensor)], flush_cache=False)
    res = run(core, [contexts()[1][:40]], tag="b")  # written under the new root only
    assert res["b0"][3] == 0
    again = hicache_core(str(tmp_path), tmp_path / "store")
    assert run(again, [prompt], tag="c")["c0"][3] > 0  # original weights: found
    assert run(again, [contexts()[1][:40]], tag="d")["d0"][3] == 0  # other weights: not found


def test_too_large_prompt_with_a_cached_prefix_is_rejected(tmp_path):
    """A lone prompt larger than the pool whose prefix is cached must be rejected, not retried
    forever (the check once compared only its uncached pages with the pool minus its own)."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    core = make_core(str(tmp_path), page_size=4, max_total_tokens=64)
    base = contexts()[0][:40]
    run(core, [base], tag="a")
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    core.add_request(GenerateReq(rid="big", input_ids=base + contexts()[1][:40], params=params))
    errors = []
    for _ in range(20):
        errors += [o.error for o in core.step() if o.error]
        if not core.has_work():
            break
    assert errors and "pool holds only" in errors[0]


def _tp_rank(rank: int, model_dir: str, store: str, port: int, results) -> None:
    import gc

    from kiln.dist.init import init_tensor_parallel, shutdown

    torch.set_num_threads(1)
    pc = init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", "cpu")
    try:
        outs = []
        for _ in range(2):  # the second engine starts on the first one's disk pages
            core = EngineCore(EngineConfig(model_path=model_dir, load_format="dummy", skip_tokenizer_init=True,
                                           device="cpu", dtype="float32", tp_size=2, **SMALL,
                                           enable_hierarchical_cache=True, hicache_ratio=0.5,
                                           hicache_storage_backend="file", hicache_storage_dir=store), pc=pc)
            core.scheduler.check_after_step = True
            core.cache.deep_check = True
            res = agent_rounds(core)
            s = core.stats()
            outs.append(({k: v[1] for k, v in res.items()},
                         (s.cached_tokens_device_total, s.cached_tokens_host_total, s.cached_tokens_disk_total)))
        results.put((rank, outs))
        # Free the engine before leaving the group: tearing gloo down under live tensors can abort
        # the process at exit ("terminate called without an active exception"; as in test_tensor_parallel)
        del core
        gc.collect()
    finally:
        shutdown(pc)


@pytest.mark.slow
def test_tensor_parallel_ranks_agree_on_every_tier(tmp_path):
    """tp 2 (two gloo processes): both ranks keep their own host pool and disk pages (keys differ
    per rank) and make the same cache decisions, so they produce the same tokens and hits as one
    process would decide for both; a second engine finds the disk pages of its own rank."""
    import multiprocessing as mp

    from tests.kiln_server import free_port

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_tp_rank, args=(r, str(tmp_path), str(tmp_path / "store"), port, results))
             for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got[0] == got[1], "the ranks decided differently"
    (first, tiers), (again, again_tiers) = got[0]
    assert first == again
    assert tiers[1] > 0 and tiers[2] > 0 and again_tiers[2] > 0, (tiers, again_tiers)
    assert len(os.listdir(tmp_path / "store")) == 2  # one namespace per rank
