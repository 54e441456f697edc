"""Weight update groups (`kiln.dist.weight_update_group`): specs from a request, the broadcasts
between a trainer (rank 0) and engine ranks in threads over gloo, and, on two GPUs, NCCL into a
CUDA engine. The HTTP endpoints and `WeightBroadcaster` are tested in
tests/server/test_rl_endpoints.py and, through `kiln rl`, tests/rl/test_remote_rollout.py."""

from __future__ import annotations

import threading

import pytest
import torch

from kiln.dist.net import free_port
from kiln.dist.weight_update_group import (WeightUpdateGroups, broadcast_tensors, open_group, parse_dtype,
                                           tensor_specs)


def test_specs_from_a_request():
    specs = tensor_specs(["a", "b"], ["bfloat16", "torch.int64"], [[2, 3], []])
    assert [(s.name, s.dtype, s.shape) for s in specs] == [("a", torch.bfloat16, (2, 3)), ("b", torch.int64, ())]
    for args, match in [((["a"], ["float32"], []), "one entry per tensor"), (([], [], []), "names is empty"),
                        ((["a"], ["float99"], [[1]]), "unknown dtype 'float99'"),
                        ((["a"], ["float32"], [[-1]]), "non-negative")]:
        with pytest.raises(ValueError, match=match):
            tensor_specs(*args)
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("Tensor")  # an attribute of torch, not a dtype


def test_open_group_checks_its_arguments():
    with pytest.raises(ValueError, match="backend must be one of"):
        open_group("127.0.0.1", 1, 1, 2, "g", "mpi", 1.0)
    with pytest.raises(ValueError, match="outside a group of world_size 2"):
        open_group("127.0.0.1", 1, 2, 2, "g", "gloo", 1.0)


def test_broadcast_reaches_every_engine_rank():
    """Rank 0 broadcasts tensors of several dtypes and shapes (a scalar, an empty one); two engine
    ranks receive them in order, equal bit for bit; the group is then destroyed."""
    g = torch.Generator().manual_seed(0)
    sent = [("w", torch.randn(3, 5, generator=g).to(torch.bfloat16)), ("ids", torch.arange(7)),
            ("scalar", torch.tensor(2.5)), ("empty", torch.empty(0, 4)), ("mask", torch.rand(4, generator=g) > 0.5)]
    specs = tensor_specs([n for n, _ in sent], [str(t.dtype) for _, t in sent], [list(t.shape) for _, t in sent])
    port, got, errors = free_port(), {}, []

    def engine(rank: int) -> None:
        try:
            groups = WeightUpdateGroups()
            groups.init("wg", "127.0.0.1", port, rank, 3, "gloo", 60)
            got[rank] = groups.receive("wg", specs, torch.device("cpu"))
            groups.destroy("wg")
            with pytest.raises(ValueError, match="no weight update group 'wg'"):
                groups.get("wg")
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=engine, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    trainer = open_group("127.0.0.1", port, 0, 3, "wg", "gloo", 60)
    broadcast_tensors(trainer, [t for _, t in sent])
    for t in threads:
        t.join(60)
    assert not errors, errors
    for rank in (1, 2):
        assert [n for n, _ in got[rank]] == [n for n, _ in sent]
        for (_, a), (_, b) in zip(got[rank], sent):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_second_group_of_the_same_name_is_refused():
    groups = WeightUpdateGroups()
    groups.groups["wg"] = (object(), "gloo")  # as if open: the name check comes before any rendezvous
    with pytest.raises(ValueError, match="already open"):
        groups.init("wg", "127.0.0.1", 1, 1, 2, "gloo", 1.0)


def test_update_group_into_a_tp2_server(tmp_path):
    """`kiln serve --tp 2`: the broadcaster finds two ranks (/server_info), both join (world size
    3) and each loads its shard of the other model's layer 0; the server then generates as it
    does with the same tensors sent over HTTP."""
    import httpx

    from kiln.loader import iter_weights, resolve_model
    from kiln.models.init_model import init_model
    from kiln.server.client import WeightBroadcaster, update_weights_from_tensor
    from tests.kiln_server import kiln_server

    for seed in (0, 1):
        init_model("inkling", "tiny", str(tmp_path / f"m{seed}"), seed=seed)
    tensors = [(n, t.clone()) for n, t in iter_weights(resolve_model(str(tmp_path / "m1"))) if ".layers.0." in n]
    args = ["--model-path", str(tmp_path / "m0"), "--device", "cpu", "--dtype", "float32", "--tp", "2",
            "--max-total-tokens", "1024", "--log-level", "warning"]
    with kiln_server(args, env={"OMP_NUM_THREADS": "1"}) as (url, _):
        def gen() -> list[int]:
            r = httpx.post(url + "/generate", json={"input_ids": [5, 17, 99, 3, 250, 8], "sampling_params": {
                "max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["output_ids"]

        base = gen()
        with WeightBroadcaster([url], "127.0.0.1", free_port(), backend="gloo", timeout_s=60) as wb:
            assert wb.ranks == [2] and wb.world_size == 3
            wb.update(tensors)
            out = gen()
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "m0")}, timeout=120)
        assert r.status_code == 200 and gen() == base, r.text
        update_weights_from_tensor(url, tensors)
        assert out != base and gen() == out


@pytest.mark.gpu
def test_nccl_into_a_cuda_engine(tmp_path):
    """The trainer on cuda:0 (a thread, rank 0) broadcasts a checkpoint's layer 0 over NCCL into a
    `kiln.Engine` on cuda:1; its greedy output then equals the same tensors loaded from the host."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: the trainer's and the engine's")
    from kiln import Engine, SamplingParams
    from kiln.loader import iter_weights, resolve_model
    from kiln.models.init_model import init_model

    for seed in (0, 1):
        init_model("inkling", "tiny", str(tmp_path / f"m{seed}"), seed=seed)
    tensors = [(n, t.clone()) for n, t in iter_weights(resolve_model(str(tmp_path / "m1"))) if ".layers.0." in n]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    port, box = free_port(), {}

    def trainer(tensors_on_gpu: bool) -> None:
        torch.cuda.set_device(0)
        if "g" not in box:
            box["g"] = open_group("127.0.0.1", port, 0, 2, "g", "nccl", 120)
        if tensors_on_gpu:
            broadcast_tensors(box["g"], [t.to("cuda:0") for _, t in tensors])
            torch.cuda.synchronize(0)

    torch.cuda.set_device(1)
    with Engine(str(tmp_path / "m0"), device="cuda", dtype="float32", max_total_tokens=4096,
                max_running_requests=8) as llm:
        base = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
        t = threading.Thread(target=trainer, args=(False,))
        t.start()
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="g", backend="nccl", timeout_s=120)
        t.join()
        t = threading.Thread(target=trainer, args=(True,))
        t.start()
        llm.update_weights_from_distributed([n for n, _ in tensors], [str(x.dtype) for _, x in tensors],
                                            [list(x.shape) for _, x in tensors], group_name="g")
        t.join()
        out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
        llm.destroy_weights_update_group("g")
        llm.update_weights_from_tensor(tensors)
        assert out != base and llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids == out
