"""Rollout backends of the GRPO loop: one interface, a colocated engine or remote `kiln serve`s.

    rollout.generate(prompt_ids_list, params_list, routed) -> [[sample, ...] per prompt]
    rollout.sync_full(trainer) -> bytes sent        rollout.sync_lora(trainer, name) -> bytes sent
    rollout.tokenizer / rollout.apply_chat_template(messages)      rollout.shutdown()
    rollout.release_memory() -> {"kv_cache_bytes": ...}    rollout.resume_memory()   (colocated training)

A sample is {"prompt_ids", "output_ids", "text", "finish_reason", "rollout_logp", "routed_experts"}
(routed_experts: [len(prompt) + len(output) - 1, num_moe_layers, k] or None).

- `ColocatedRollout(engine)`: a `kiln.offline.Engine` in this process; weights move by reference.
- `RemoteRollout(urls)`: `kiln serve` instances over HTTP. Prompts go round-robin over the urls
  (a thread pool, one request per prompt, n samples each), full weights go bucketed through
  `/update_weights_from_tensor` and a LoRA adapter through a temp PEFT dir + `/load_lora_adapter`
  (so the servers must share a filesystem with the trainer for LoRA). Weight syncs happen between
  steps, when no rollout request is running, so no pause/continue is needed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch


MEMORY_TAGS = ("kv_cache", "weights")  # what release_memory frees (EngineCore.release_memory_occupation)


class ColocatedRollout:
    """Rollouts in a colocated `kiln.offline.Engine`."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.engine.apply_chat_template(messages)

    def generate(self, prompt_ids: list[list[int]], params: list, routed: bool = False) -> list[list[dict]]:
        # A LoRA adapter is merged into the engine's weights by sync_lora: no per-request adapter.
        outs = self.engine.generate(prompt_ids, params, return_routed_experts=routed, use_tqdm=False)
        return [[{"prompt_ids": list(out.prompt_token_ids), "output_ids": list(o.token_ids), "text": o.text,
                  "finish_reason": o.finish_reason, "rollout_logp": [lp[0] for lp in (o.logprobs or [])],
                  "routed_experts": o.routed_experts} for o in out.outputs] for out in outs]

    @property
    def device_type(self) -> str:
        """'cuda' or 'cpu': where the engine's weights and KV cache live."""
        runner = getattr(getattr(self.engine, "core", None), "runner", None)
        return getattr(getattr(runner, "device", None), "type", "cpu")

    def release_memory(self) -> dict:
        """Free the engine's KV cache (the pools; the prefix cache is flushed) and move its weights
        to pinned host memory (CUDA only), so the trainer can use the memory. Returns the engine's
        report."""
        return self.engine.release_memory_occupation(list(MEMORY_TAGS))

    def resume_memory(self) -> None:
        """Weights back on the device, fresh (zeroed) KV pools of the same size."""
        self.engine.resume_memory_occupation(list(MEMORY_TAGS))

    def sync_full(self, trainer: Any) -> int:
        from kiln.rl.sync import sync_full

        info = sync_full(trainer, self.engine)
        self.engine.flush_cache()  # cached prompt KV came from the old weights (the engine flushes too)
        return int(info["bytes"])

    def sync_lora(self, trainer: Any, name: str) -> int:
        from kiln.rl.sync import sync_lora

        info = sync_lora(trainer, self.engine, name)
        self.engine.flush_cache()
        return int(info["bytes"])

    def shutdown(self) -> None:
        self.engine.shutdown()


class RemoteRolloutError(RuntimeError):
    """A `kiln serve` used for rollouts is unreachable or answered with an error."""


def _sampling_params(p: Any) -> dict:
    """SGLang `sampling_params` of a `kiln.SamplingParams`."""
    return {"max_new_tokens": p.max_tokens, "min_new_tokens": p.min_tokens, "temperature": p.temperature,
            "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p, "repetition_penalty": p.repetition_penalty,
            "frequency_penalty": p.frequency_penalty, "presence_penalty": p.presence_penalty,
            "stop": list(p.stop), "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos,
            "skip_special_tokens": p.skip_special_tokens, "no_stop_trim": p.include_stop_str_in_output,
            "n": p.n, "seed": p.seed}


class RemoteRollout:
    """Rollouts on `kiln serve` instances (start them with `--enable-return-routed-experts` for
    MoE routing replay). `model_path` gives the local tokenizer (prompts are sent as token ids)."""

    def __init__(self, urls: list[str], model_path: Optional[str] = None, *, timeout: float = 600.0,
                 api_key: Optional[str] = None, chat_template: Optional[str] = None, weight_sync: str = "http",
                 weight_sync_master: str = ""):
        if not urls:
            raise ValueError("RemoteRollout needs at least one server url")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        self.api_key = api_key
        self.weight_sync, self.weight_sync_master = weight_sync, weight_sync_master
        self.broadcaster: Any = None  # the weight update group, opened at the first distributed sync
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        from kiln.loader import load_tokenizer
        from kiln.loader.source import resolve_model

        self.tokenizer = load_tokenizer(resolve_model(model_path).model_dir, None, chat_template)
        for url in self.urls:  # fail at start, not mid-step
            self._request("GET", url, "/health")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _request(self, method: str, url: str, path: str, body: Optional[dict] = None) -> Any:
        import httpx

        try:
            r = httpx.request(method, url + path, json=body, headers=self.headers, timeout=self.timeout)
        except httpx.HTTPError as e:
            raise RemoteRolloutError(f"kiln serve at {url} is unreachable ({path}): {type(e).__name__}: {e}") from e
        try:
            data = r.json()
        except ValueError:
            data = None
        if r.status_code != 200 or (isinstance(data, dict) and data.get("success") is False):
            msg = r.text
            if isinstance(data, dict):
                err = data.get("error")
                msg = data.get("message") or (err.get("message") if isinstance(err, dict) else err) or msg
            raise RemoteRolloutError(f"kiln serve at {url} failed {path} ({r.status_code}): {msg}")
        return data

    def _generate_one(self, url: str, ids: list[int], p: Any, routed: bool) -> list[dict]:
        body = {"input_ids": list(ids), "sampling_params": _sampling_params(p), "return_logprob": True,
                "top_logprobs_num": 0, "return_routed_experts": bool(routed)}
        data = self._request("POST", url, "/generate", body)
        items = data if isinstance(data, list) else [data]
        if len(items) != p.n:
            raise RemoteRolloutError(f"kiln serve at {url} returned {len(items)} samples, expected {p.n}")
        samples = []
        for it in items:
            meta = it["meta_info"]
            reason = meta.get("finish_reason")
            if isinstance(reason, dict):
                reason = reason.get("type")
            re_ = meta.get("routed_experts")
            if routed and re_ is None:
                raise RemoteRolloutError(f"kiln serve at {url} returned no routed_experts: start it with "
                                         "--enable-return-routed-experts (or set routing_replay false)")
            samples.append({
                "prompt_ids": list(ids), "output_ids": list(it["output_ids"]), "text": it["text"],
                "finish_reason": reason,
                "rollout_logp": [float(lp[0]) for lp in meta.get("output_token_logprobs") or []],
                "routed_experts": None if re_ is None else torch.tensor(re_, dtype=torch.int32),
            })
        return samples

    def generate(self, prompt_ids: list[list[int]], params: list, routed: bool = False) -> list[list[dict]]:
        if not isinstance(params, (list, tuple)):
            params = [params] * len(prompt_ids)
        jobs = [(self.urls[i % len(self.urls)], ids, p) for i, (ids, p) in enumerate(zip(prompt_ids, params))]
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), 64))) as pool:
            futs = [pool.submit(self._generate_one, url, ids, p, routed) for url, ids, p in jobs]
            return [f.result() for f in futs]

    def sync_full(self, trainer: Any, bucket_bytes: Optional[int] = None) -> int:
        from kiln.server.client import DEFAULT_BUCKET_BYTES, update_weights_from_tensor

        named = [(n, t) for n, t in trainer.named_weights_for_sync()]
        if self.weight_sync == "distributed":
            self._broadcast(named)
            return sum(t.numel() * t.element_size() for _, t in named) * len(self.urls)
        for url in self.urls:
            try:
                update_weights_from_tensor(url, named, bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
                                           api_key=self.api_key, timeout=self.timeout)
            except Exception as e:  # noqa: BLE001 - name the server
                raise RemoteRolloutError(f"weight sync to kiln serve at {url} failed: {type(e).__name__}: {e}") from e
        return sum(t.numel() * t.element_size() for _, t in named) * len(self.urls)

    def _broadcast(self, named: list) -> None:
        """Full weights through one weight update group with every server (opened once): NCCL
        when the trainer's weights are on a GPU, gloo when they are on the CPU."""
        from kiln.server.client import WeightBroadcaster

        if self.broadcaster is None:
            host, _, port = self.weight_sync_master.rpartition(":")
            if not host:
                from kiln.dist.net import free_port

                host, port = "127.0.0.1", str(free_port())
            backend = "nccl" if named and named[0][1].is_cuda else "gloo"
            try:
                self.broadcaster = WeightBroadcaster(self.urls, host, int(port), backend=backend, api_key=self.api_key,
                                                     timeout_s=min(self.timeout, 600.0)).open()
            except Exception as e:  # noqa: BLE001 - say which sync failed
                raise RemoteRolloutError(f"opening the weight update group with {self.urls} at {host}:{port} "
                                         f"failed: {type(e).__name__}: {e}") from e
        try:
            self.broadcaster.update(named)
        except Exception as e:  # noqa: BLE001
            self.broadcaster = None  # the failed update tore the group down: the next sync opens another
            raise RemoteRolloutError(f"weight sync through the update group failed: {type(e).__name__}: {e}") from e

    def sync_lora(self, trainer: Any, name: str) -> int:
        from kiln.rl.lora import ADAPTER_WEIGHTS, save_adapter

        d = tempfile.mkdtemp(prefix="kiln_rl_lora_")
        try:
            save_adapter(trainer.model, d)
            for url in self.urls:
                self._request("POST", url, "/load_lora_adapter", {"lora_name": name, "lora_path": d})
            return os.path.getsize(os.path.join(d, ADAPTER_WEIGHTS)) * len(self.urls)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def release_memory(self) -> dict:
        """/release_memory_occupation on every server (useful only when they share the trainer's
        GPUs, e.g. placed on the same node by kiln.rl.ray_launcher)."""
        out: dict = {"kv_cache_bytes": 0}
        for url in self.urls:
            data = self._request("POST", url, "/release_memory_occupation", {"tags": list(MEMORY_TAGS)})
            if isinstance(data, dict):
                out["kv_cache_bytes"] += int(data.get("kv_cache_bytes", 0) or 0)
        return out

    def resume_memory(self) -> None:
        for url in self.urls:
            self._request("POST", url, "/resume_memory_occupation", {"tags": list(MEMORY_TAGS)})

    def shutdown(self) -> None:  # the servers belong to whoever started them; the group is ours
        if self.broadcaster is not None:
            self.broadcaster, broadcaster = None, self.broadcaster
            broadcaster.close()
