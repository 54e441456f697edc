"""Small HTTP helpers for a running `kiln serve` (RL trainers on another machine or process).

    from kiln.server.client import update_weights_from_tensor
    update_weights_from_tensor("http://host:30000", model.state_dict().items())

Tensors travel as base64 in JSON, in buckets of at most `bucket_bytes` raw bytes per request
(the server refuses more than `kiln.server.protocol.MAX_TENSOR_UPDATE_BYTES` per call).
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


def update_weights_from_tensor(url: str, named_tensors: Iterable[tuple[str, torch.Tensor]],
                               bucket_bytes: int = DEFAULT_BUCKET_BYTES, flush_cache: bool = True,
                               api_key: Optional[str] = None, timeout: float = 600.0) -> dict:
    """POST the tensors to `url`/update_weights_from_tensor in buckets; the prefix cache is
    flushed once, after the last bucket (when `flush_cache`). Raises RuntimeError naming the
    server's message if a bucket fails. Returns {"success", "message", "num_tensors", "num_requests"}."""
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
            body = {"named_tensors": [encode_tensor(n, t) for n, t in group],
                    "flush_cache": flush_cache and i == len(groups) - 1}
            r = client.post(url.rstrip("/") + "/update_weights_from_tensor", json=body)
            data: Any = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            if r.status_code != 200 or not data.get("success"):
                msg = data.get("message") or data.get("error", {}).get("message") or r.text
                raise RuntimeError(f"update_weights_from_tensor bucket {i + 1}/{len(groups)} failed "
                                   f"({r.status_code}): {msg}")
            total += len(group)
    return {"success": True, "message": f"Updated {total} tensors in {len(groups)} requests.",
            "num_tensors": total, "num_requests": len(groups)}
