"""RL control endpoints of `kiln serve` (SGLang's shapes) on the tiny Inkling, fp32 CPU: weight
updates from tensors and from disk, memory release/resume, pause/continue, LoRA load/unload, and
400 on bad input."""

import os
import threading
import time

import httpx
import pytest
import torch
from tests.kiln_server import free_port, kiln_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
ENGINE = ["--max-total-tokens", "4096", "--max-running-requests", "8"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from kiln.models.init_model import init_model

    d = tmp_path_factory.mktemp("rl_endpoints")
    init_model("inkling", "tiny", str(d / "m0"), seed=0)
    init_model("inkling", "tiny", str(d / "m1"), seed=1)
    return str(d / "m0"), str(d / "m1"), d


@pytest.fixture(scope="module")
def server(models):
    with kiln_server(["--model-path", models[0], "--device", "cpu", "--log-level", "warning", *ENGINE,
                      "--profile-dir", str(models[2] / "traces")],
                     timeout=120, env={"OMP_NUM_THREADS": "1"}) as (url, _):
        yield url


def gen(url: str, n: int = 12, ids=PROMPT) -> list[int]:
    r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def post(url: str, path: str, body=None, status: int = 200) -> dict:
    r = httpx.post(url + path, json=body if body is not None else {}, timeout=120)
    assert r.status_code == status, (path, r.status_code, r.text)
    data = r.json()
    if status == 200:
        assert data["success"] is True and isinstance(data["message"], str)
    else:
        assert data["error"]["message"] and data["error"]["code"] == status, data
    return data


def stats(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=30).json()["stats"]


def layer0(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    from kiln.loader import iter_weights, resolve_model

    return [(n, t.clone()) for n, t in iter_weights(resolve_model(model_dir)) if ".layers.0." in n]


def test_update_weights_from_tensor_round_trip(server, models):
    from kiln.server.client import update_weights_from_tensor

    base = gen(server)
    originals = layer0(models[0])
    assert originals
    g = torch.Generator().manual_seed(0)
    perturbed = [(n, t + 0.5 * t.float().std().nan_to_num(1.0) * torch.randn(t.shape, generator=g))
                 for n, t in originals]
    res = update_weights_from_tensor(server, perturbed, bucket_bytes=16 * 1024)
    assert res["num_tensors"] == len(originals) and res["num_requests"] > 1  # bucketed
    assert gen(server) != base
    update_weights_from_tensor(server, originals)
    assert gen(server) == base


def test_update_weights_from_distributed_round_trip(server, models):
    """A trainer's broadcast (gloo on the CPU) loads exactly what the same tensors sent over HTTP
    load, bucket by bucket, and restores the originals; a second group of the same name and an
    update through an unknown group fail at once, without hanging a broadcast."""
    from kiln.server.client import WeightBroadcaster, update_weights_from_tensor

    base = gen(server)
    originals = layer0(models[0])
    g = torch.Generator().manual_seed(1)
    perturbed = [(n, t + 0.5 * t.float().std().nan_to_num(1.0) * torch.randn(t.shape, generator=g))
                 for n, t in originals]
    update_weights_from_tensor(server, perturbed)
    want = gen(server)
    update_weights_from_tensor(server, originals)
    assert want != base and gen(server) == base
    with WeightBroadcaster([server], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                           timeout_s=60) as wb:
        assert wb.ranks == [1] and wb.world_size == 2  # the server's tensor-parallel size, from /server_info
        res = wb.update(perturbed, bucket_bytes=16 * 1024)
        assert res["num_tensors"] == len(perturbed) and res["num_requests"] > 1
        assert gen(server) == want
        post(server, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": wb.master_port,
                                                    "rank_offset": 1, "world_size": 2, "backend": "gloo"},
             status=400)
        err = post(server, "/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                                "shapes": [[1]], "group_name": "nope"}, status=400)
        assert "no weight update group 'nope'" in err["error"]["message"]
        wb.update(originals)
        assert gen(server) == base
    post(server, "/destroy_weights_update_group", {}, status=400)  # closed with the `with`
    # A failed update tears the group down on both ends (none is left waiting, or holding bytes of
    # the failed update for the next one), whether the server refused after receiving (an unknown
    # tensor name) or before (here: it no longer has the group); the name is then free again.
    for forget_group, tensors, match in [(False, [("no.such.tensor", torch.zeros(1))], "no.such.tensor"),
                                         (True, originals, "no weight update group")]:
        wb = WeightBroadcaster([server], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                               timeout_s=60).open()
        if forget_group:
            post(server, "/destroy_weights_update_group", {})
        t0 = time.time()
        with pytest.raises(RuntimeError, match=match):
            wb.update(tensors)
        assert wb.group is None and time.time() - t0 < 30
        post(server, "/destroy_weights_update_group", {}, status=400)  # gone on the server too
    with WeightBroadcaster([server], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                           timeout_s=60) as wb:
        wb.update(perturbed)
        assert gen(server) == want
        wb.update(originals)
    assert gen(server) == base


def test_profile_endpoints(server, models):
    """/start_profile then /stop_profile write a torch.profiler trace of the steps between them
    (to --profile-dir unless the request names an output_dir); num_steps ends it by itself."""
    import gzip
    import json

    started = post(server, "/start_profile", {"profile_prefix": "a"})
    assert started["trace_path"] == str(models[2] / "traces" / "a-TP-0.trace.json.gz")
    post(server, "/start_profile", {}, status=400)  # one at a time
    gen(server, 4)
    stopped = post(server, "/stop_profile")
    assert stopped["trace_path"] == started["trace_path"]
    with gzip.open(stopped["trace_path"], "rt") as f:
        assert any(e.get("name", "").startswith("aten::") for e in json.load(f)["traceEvents"])
    out = models[2] / "other"
    path = post(server, "/start_profile", {"output_dir": str(out), "num_steps": 2, "activities": ["CPU", "MEM"],
                                           "record_shapes": True})["trace_path"]
    assert path.startswith(str(out))
    gen(server, 4)
    assert os.path.exists(path)
    post(server, "/stop_profile", status=400)  # ended after its 2 steps


def test_weight_version_and_abort_all(server, models):
    """meta_info.weight_version follows the updates that name one (not a failed one) and
    /update_weight_version; /abort_request with abort_all ends every running request."""
    from kiln.server.client import update_weights_from_tensor

    def version() -> str:
        r = httpx.post(server + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}},
                       timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()["meta_info"]["weight_version"]
        assert got == httpx.get(server + "/get_weight_version").json()["weight_version"]
        return got

    post(server, "/update_weights_from_disk", {"model_path": models[0], "weight_version": "v1"})
    assert version() == "v1"
    post(server, "/update_weights_from_disk", {"model_path": "/no/such/dir", "weight_version": "bad"}, status=400)
    assert version() == "v1"
    update_weights_from_tensor(server, layer0(models[0]), bucket_bytes=16 * 1024, weight_version="v2")
    assert version() == "v2"

    box: dict = {}

    def long_generation(i: int) -> None:
        box[i] = httpx.post(server + "/generate", json={"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 3000, "ignore_eos": True}}, timeout=120)

    threads = [threading.Thread(target=long_generation, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while stats(server)["num_running"] < 2:
        assert time.time() < deadline, "the two requests never ran together"
        time.sleep(0.05)
    done = post(server, "/update_weight_version", {"new_version": "v3"})  # aborts what runs, by default
    assert done["num_aborted"] == 2 and done["weight_version"] == "v3"
    for t in threads:
        t.join(60)
    for r in box.values():
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 3000
    assert version() == "v3"
    t = threading.Thread(target=long_generation, args=(2,))
    t.start()
    while stats(server)["num_running"] < 1:
        assert time.time() < deadline + 30
        time.sleep(0.05)
    assert post(server, "/abort_request", {"abort_all": True})["num_aborted"] == 1
    t.join(60)
    assert box[2].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_update_weights_from_disk(server, models):
    from kiln import Engine, SamplingParams

    base = gen(server)
    out = post(server, "/update_weights_from_disk", {"model_path": models[1]})
    assert out["num_tensors"] > 0
    with Engine(models[1], device="cpu", max_total_tokens=4096, max_running_requests=8) as llm:
        want = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    assert gen(server) == list(want) != base
    post(server, "/update_weights_from_disk", {"model_path": models[0]})
    assert gen(server) == base


def test_release_resume_kv_cache(server):
    base = gen(server)
    out = post(server, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert out["kv_cache_bytes"] > 0
    post(server, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert gen(server) == base
    post(server, "/release_memory_occupation", {})  # both tags (weights: a no-op on CPU)
    post(server, "/resume_memory_occupation", {})
    assert gen(server) == base


def _run_long(server, n, box):
    box["ids"] = gen(server, n)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_continue(server, mode):
    n = 300
    ref = gen(server, n)
    box: dict = {}
    t = threading.Thread(target=_run_long, args=(server, n, box))
    t.start()
    deadline = time.time() + 30
    while stats(server)["num_running"] == 0 and time.time() < deadline:
        time.sleep(0.02)
    if mode == "retract":  # a weight update while requests run, unpaused, is refused
        msg = post(server, "/update_weights_from_tensor", {"named_tensors": [
            {"name": "model.norm.weight", "dtype": "float32", "shape": [0], "data_b64": ""}]}, status=400)
        assert "pause_generation" in msg["message"] and msg["success"] is False
    out = post(server, "/pause_generation", {"mode": mode})
    assert out["num_requests"] == (1 if mode == "retract" else 0)
    s = stats(server)
    assert (s["num_running"], s["num_waiting"]) == ((0, 1) if mode == "retract" else (1, 0))
    time.sleep(0.3)
    assert t.is_alive()  # nothing steps while paused
    post(server, "/continue_generation")
    t.join(timeout=120)
    assert box["ids"] == ref


def test_pause_abort(server):
    box: dict = {}

    def run():
        r = httpx.post(server + "/generate", json={"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}}, timeout=120)
        box["resp"] = r.json()

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 30
    while stats(server)["num_running"] == 0 and time.time() < deadline:
        time.sleep(0.02)
    assert post(server, "/pause_generation", {"mode": "abort"})["num_requests"] == 1
    t.join(timeout=30)
    assert box["resp"]["meta_info"]["finish_reason"]["type"] == "abort"
    post(server, "/continue_generation")
    assert len(gen(server)) == 12


def test_lora_load_unload(server, models):
    from kiln.rl.lora import save_adapter
    from kiln.rl.trainer import PolicyTrainer

    adapter = str(models[2] / "adapter")
    trainer = PolicyTrainer(models[0])
    trainer.enable_lora(rank=4, alpha=8, seed=0)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_B" in name:
                p.normal_(std=0.5)
    save_adapter(trainer.model, adapter)
    base = gen(server)
    post(server, "/load_lora_adapter", {"lora_name": "a", "lora_path": adapter})
    assert gen(server) != base
    post(server, "/unload_lora_adapter", {"lora_name": "a"})
    assert gen(server) == base


BAD = [
    ("/update_weights_from_disk", {}),
    ("/update_weights_from_disk", {"model_path": "/no/such/model"}),
    ("/update_weights_from_tensor", {"named_tensors": []}),
    ("/update_weights_from_tensor", {"named_tensors": [{"name": "x", "dtype": "complex7", "shape": [1], "data_b64": ""}]}),
    ("/update_weights_from_tensor", {"named_tensors": [{"name": "model.norm.weight", "dtype": "float32",
                                                        "shape": [4], "data_b64": "AAAA"}]}),
    ("/update_weights_from_tensor", {"named_tensors": [{"name": "model.norm.weight", "dtype": "float32",
                                                        "shape": [1], "data_b64": "!!!"}]}),
    ("/update_weights_from_tensor", {"named_tensors": [{"name": "no.such.tensor", "dtype": "float32",
                                                        "shape": [1], "data_b64": "AAAAAA=="}]}),
    ("/release_memory_occupation", {"tags": ["gpu"]}),
    ("/resume_memory_occupation", {"tags": "kv_cache"}),
    ("/pause_generation", {"mode": "sleep"}),
    ("/load_lora_adapter", {"lora_name": "a"}),
    ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/no/such/adapter"}),
    ("/unload_lora_adapter", {}),
    ("/unload_lora_adapter", {"lora_name": "never-loaded"}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2, "backend": "mpi"}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0,
                                    "world_size": 2}),
    ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [1]]}),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float99"], "shapes": [[1]]}),
    ("/destroy_weights_update_group", {"group_name": "never-opened"}),
    ("/start_profile", {"activities": ["TPU"]}),
    ("/start_profile", {"num_steps": 0}),
    ("/start_profile", {"profile_prefix": "../up"}),
    ("/stop_profile", {}),
    ("/abort_request", {}),
    ("/update_weight_version", {"new_version": ""}),
]


@pytest.mark.parametrize("path,body", BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_bad_input_400(server, path, body):
    post(server, path, body, status=400)
    assert gen(server, 4)  # the server still serves


def test_offline_engine_mirrors(models):
    """kiln.Engine: release/resume, pause (retract) from another thread while a request runs,
    update_weights_from_disk."""
    from kiln import Engine, SamplingParams

    sp = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    # The threaded request is longer, so that it is surely still running through the checks below;
    # greedy, so its first 200 tokens are `ref`.
    long_sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    with Engine(models[0], device="cpu", max_total_tokens=4096, max_running_requests=8) as llm:
        ref = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.release_memory_occupation()["kv_cache_bytes"] > 0
        llm.resume_memory_occupation()
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("out", llm.generate([PROMPT], long_sp, use_tqdm=False)))
        t.start()
        deadline = time.time() + 30
        while llm.stats().num_running == 0:  # a bounded wait: a finished request must fail, not hang
            assert time.time() < deadline and t.is_alive(), "the request never showed up as running"
            time.sleep(0.005)
        with pytest.raises(RuntimeError, match="pause_generation"):  # running, not paused
            llm.release_memory_occupation(["kv_cache"])
        assert llm.pause_generation("retract") == 1
        llm.release_memory_occupation(["kv_cache"])  # retracted requests hold no pages
        time.sleep(0.2)
        llm.resume_memory_occupation(["kv_cache"])
        assert t.is_alive()
        llm.continue_generation()
        t.join(timeout=60)
        assert box["out"][0].outputs[0].token_ids[:len(ref)] == ref
        with pytest.raises(ValueError, match="mode"):
            llm.pause_generation("sleep")
        llm.update_weights_from_disk(models[1])
        assert llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids != ref


def test_offline_engine_update_weights_from_distributed(models):
    """kiln.Engine's mirror: the trainer's end from another thread, the other model's layer 0
    broadcast in; generation then equals the same tensors loaded by update_weights_from_tensor."""
    from kiln import Engine, SamplingParams
    from kiln.dist.weight_update_group import broadcast_tensors, open_group

    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tensors = layer0(models[1])
    port, box = free_port(), {}
    with Engine(models[0], device="cpu", max_total_tokens=4096, max_running_requests=8) as llm:
        ref = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
        trainer = threading.Thread(target=lambda: box.setdefault("g", open_group("127.0.0.1", port, 0, 2, "g", "gloo", 60)))
        trainer.start()
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="g", backend="gloo", timeout_s=60)
        trainer.join()
        trainer = threading.Thread(target=broadcast_tensors, args=(box["g"], [t for _, t in tensors]))
        trainer.start()
        n = llm.update_weights_from_distributed([n for n, _ in tensors], [str(t.dtype) for _, t in tensors],
                                                [list(t.shape) for _, t in tensors], group_name="g")
        trainer.join()
        assert n == len(tensors)
        out = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
        llm.destroy_weights_update_group("g")
        with pytest.raises(ValueError, match="no weight update group"):
            llm.destroy_weights_update_group("g")
        llm.update_weights_from_disk(models[0])
        llm.update_weights_from_tensor(tensors)
        assert out != ref and llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids == out


def test_control_calls_get_the_lock_between_steps(models):
    """Control calls from another thread get through while a generation runs: the driving thread
    steps aside between steps (`kiln.offline.CoreLock`). With a plain lock it re-acquired the lock
    right after releasing it, and a stats or pause call could wait for the whole generation."""
    from kiln import Engine, SamplingParams

    sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    with Engine(models[0], device="cpu", max_total_tokens=4096, max_running_requests=8) as llm:
        t = threading.Thread(target=lambda: llm.generate([PROMPT], sp, use_tqdm=False))
        t.start()
        calls = 0
        while t.is_alive() and calls < 20:
            llm.stats()
            calls += 1
            time.sleep(0.01)
        t.join(timeout=120)
        assert calls == 20, f"only {calls} control calls got through during a 400-token generation"
