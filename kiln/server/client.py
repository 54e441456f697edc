"""Small HTTP helpers for a running `kiln serve` (RL trainers on another machine or process).

    from kiln.server.client import update_weights_from_tensor
    update_weights_from_tensor("http://host:30000", model.state_dict().items())

Tensors travel as base64 in JSON, in buckets of at most `bucket_bytes` raw bytes per request
(the server refuses more than `kiln.server.protocol.MAX_TENSOR_UPDATE_BYTES` per call).
`WeightBroadcaster` sends them through a process group instead (NCCL between GPUs, SGLang's
`/update_weights_from_distributed`).
"""

from __future__ import annotations

import base64
from typing import Any, Iterable, Optional

import torch

DEFAULT_BUCKET_BYTES = 64 * 2**20


def encode_tensor(name: str, tensor: torch.Tensor) -> dict:
    """{"name", "dtype", "shape", "data_b64"} of one tensor (copied to CPU, contiguous)."""
    t = tensor.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data_b64": base64.b64encode(raw).decode("ascii")}


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most `bucket_bytes` (a bigger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def control_error(r: Any) -> Optional[str]:
    """The server's message when a control call (`{"success", "message"}` answers) failed, else None."""
    data: Any = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code == 200 and data.get("success"):
        return None
    return data.get("message") or data.get("error", {}).get("message") or r.text


def update_weights_from_tensor(url: str, named_tensors: Iterable[tuple[str, torch.Tensor]],
                               bucket_bytes: int = DEFAULT_BUCKET_BYTES, flush_cache: bool = True,
                               api_key: Optional[str] = None, timeout: float = 600.0,
                               weight_version: Optional[str] = None) -> dict:
    """POST the tensors to `url`/update_weights_from_tensor in buckets; the prefix cache is
    flushed once, after the last bucket (when `flush_cache`), which also carries `weight_version`.
    Raises RuntimeError naming the server's message if a bucket fails. Returns {"success",
    "message", "num_tensors", "num_requests"}."""
    import httpx

    from kiln.server.protocol import MAX_TENSOR_UPDATE_BYTES

    bucket_bytes = min(bucket_bytes, MAX_TENSOR_UPDATE_BYTES)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    groups = list(buckets(named_tensors, bucket_bytes))
    if not groups:
        raise ValueError("named_tensors is empty")
    total = 0
    with httpx.Client(timeout=timeout, headers=headers) as client:
        for i, group in enumerate(groups):
            last = i == len(groups) - 1
            body = {"named_tensors": [encode_tensor(n, t) for n, t in group], "flush_cache": flush_cache and last,
                    **({"weight_version": weight_version} if last and weight_version is not None else {})}
            r = client.post(url.rstrip("/") + "/update_weights_from_tensor", json=body)
            msg = control_error(r)
            if msg is not None:
                raise RuntimeError(f"update_weights_from_tensor bucket {i + 1}/{len(groups)} failed "
                                   f"({r.status_code}): {msg}")
            total += len(group)
    return {"success": True, "message": f"Updated {total} tensors in {len(groups)} requests.",
            "num_tensors": total, "num_requests": len(groups)}


class WeightBroadcaster:
    """The trainer's end of a weight update group with running servers (`kiln serve`, or any
    server with SGLang's endpoints): this process is rank 0 and broadcasts, each server's
    tensor-parallel ranks receive (`kiln.dist.weight_update_group`). Over NCCL the weights go
    GPU to GPU, with no base64 and no copy through the host, unlike `update_weights_from_tensor`.

        with WeightBroadcaster(["http://gpu1:30000"], master_address="10.0.0.5", master_port=29600) as wb:
            wb.update(model.state_dict().items())     # after each optimizer step

    `ranks_per_server`: each server's tensor-parallel size (default: read from /server_info).
    A server that answers with an error raises RuntimeError naming it at once, and the group is
    aborted here and destroyed on the servers (`group` is None: open a new one), so that no end is
    left waiting on a broadcast or holding bytes of an update that failed."""

    def __init__(self, urls: list[str], master_address: str, master_port: int, backend: str = "nccl",
                 group_name: str = "weight_update_group", ranks_per_server: Optional[list[int]] = None,
                 api_key: Optional[str] = None, timeout_s: float = 600.0):
        if not urls:
            raise ValueError("urls is empty; give the servers to update")
        self.urls = [u.rstrip("/") for u in urls]
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.group_name, self.timeout_s = group_name, timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.ranks = list(ranks_per_server) if ranks_per_server is not None else [self._tp_size(u) for u in self.urls]
        if len(self.ranks) != len(self.urls) or min(self.ranks) < 1:
            raise ValueError(f"ranks_per_server must give one size >= 1 per url; got {self.ranks}")
        self.group: Any = None

    @property
    def world_size(self) -> int:
        return 1 + sum(self.ranks)

    def open(self) -> "WeightBroadcaster":
        """Create the group: rank 0 here, each server's ranks after the ranks of the servers before it."""
        from kiln.dist.weight_update_group import open_group

        offsets = [1 + sum(self.ranks[:i]) for i in range(len(self.urls))]
        bodies = [{"master_address": self.master_address, "master_port": self.master_port, "rank_offset": off,
                   "world_size": self.world_size, "group_name": self.group_name, "backend": self.backend,
                   "timeout_s": self.timeout_s} for off in offsets]
        group = self._collective(lambda: open_group(self.master_address, self.master_port, 0, self.world_size,
                                                    self.group_name, self.backend, self.timeout_s),
                                 "/init_weights_update_group", bodies)
        self.group = group
        return self

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], flush_cache: bool = True,
               bucket_bytes: int = 512 * 2**20, weight_version: Optional[str] = None) -> dict:
        """Send (checkpoint name, tensor) pairs to every server, one request and one broadcast per
        tensor of each bucket of at most `bucket_bytes` (what a server holds before loading it);
        the prefix caches are flushed, and the weights labelled `weight_version`, with the last
        bucket. Returns {"num_tensors", "num_requests"}."""
        from kiln.dist.weight_update_group import broadcast_tensors

        if self.group is None:
            raise RuntimeError("the weight update group is not open; call open() (or use `with`)")
        device = torch.device("cpu") if self.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        groups = list(buckets(named_tensors, bucket_bytes))
        if not groups:
            raise ValueError("named_tensors is empty")
        for i, group in enumerate(groups):
            tensors = [t.detach().to(device) for _, t in group]
            last = i == len(groups) - 1
            body = {"names": [n for n, _ in group], "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                    "shapes": [list(t.shape) for t in tensors], "group_name": self.group_name,
                    "flush_cache": flush_cache and last,
                    **({"weight_version": weight_version} if last and weight_version is not None else {})}
            self._collective(lambda: broadcast_tensors(self.group, tensors), "/update_weights_from_distributed",
                             [body] * len(self.urls))
        return {"num_tensors": sum(len(g) for g in groups), "num_requests": len(groups)}

    def close(self) -> None:
        """Destroy the group on every server and here."""
        if self.group is None:
            return
        group, self.group = self.group, None
        try:
            for url in self.urls:
                self._post(url, "/destroy_weights_update_group", {"group_name": self.group_name})
        finally:
            if hasattr(group, "shutdown"):
                group.shutdown()

    def __enter__(self) -> "WeightBroadcaster":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- plumbing ------------------------------------------------------------------------
    def _collective(self, work: Any, path: str, bodies: list[dict]) -> Any:
        """Run this end of a collective (`work`) beside one POST per server. The servers' ends run
        inside their requests, so the two must overlap; a server's error raises at once rather
        than after the collective's timeout."""
        import threading
        from concurrent.futures import ThreadPoolExecutor

        box: dict = {}

        def run() -> None:
            try:
                box["result"] = work()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e

        worker = threading.Thread(target=run, daemon=True)  # a collective cannot be interrupted
        worker.start()
        with ThreadPoolExecutor(len(self.urls)) as pool:
            futures = [pool.submit(self._post, url, path, body) for url, body in zip(self.urls, bodies)]
            errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if failed:
            # Whether the server had started receiving is unknown here (gloo's root may finish its
            # sends into buffers no one reads), and a group whose ends disagree on what was sent
            # would hand the next update stale bytes: tear it down on both sides.
            if self.group is not None:
                self.group.abort()
                self.group = None
                for url in self.urls:  # best effort: free the name on the servers for the next open
                    try:
                        self._post(url, "/destroy_weights_update_group", {"group_name": self.group_name})
                    except Exception:  # noqa: BLE001 - a server whose receive broke dropped it already
                        pass
            raise failed[0]
        worker.join(self.timeout_s)
        if "error" in box:
            raise box["error"]
        if worker.is_alive():
            raise TimeoutError(f"{path}: the servers answered but this end did not finish within {self.timeout_s} s")
        return box.get("result")

    def _post(self, url: str, path: str, body: dict) -> dict:
        import httpx

        r = httpx.post(url + path, json=body, headers=self.headers, timeout=self.timeout_s + 30)
        msg = control_error(r)
        if msg is not None:
            raise RuntimeError(f"{url}{path} failed ({r.status_code}): {msg}")
        return r.json()

    def _tp_size(self, url: str) -> int:
        import httpx

        r = httpx.get(url.rstrip("/") + "/server_info", headers=self.headers, timeout=30)
        r.raise_for_status()
        info = r.json()
        return int(info.get("config", info).get("tp_size", 1))
