"""HiCache options: the checked `HiCacheConfig`, the host pool's size per page space, and the
model identity that keys the disk tier. Pure functions of the engine's configuration and pools;
the tiers themselves live in `hicache.py`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
STORAGE_BACKENDS = ("file",)


@dataclass(frozen=True)
class HiCacheConfig:
    """The HiCache options of `EngineConfig`, checked."""

    ratio: float = 2.0
    size_gb: float = 0.0  # > 0 overrides ratio
    write_policy: str = "write_through"
    storage_backend: Optional[str] = None
    storage_dir: Optional[str] = None
    prefetch_policy: str = "best_effort"

    @classmethod
    def from_engine_config(cls, cfg) -> Optional["HiCacheConfig"]:
        """None when HiCache is off; ValueError naming the flag for any bad combination."""
        hc = cls(cfg.hicache_ratio, cfg.hicache_size, cfg.hicache_write_policy, cfg.hicache_storage_backend,
                 cfg.hicache_storage_dir, cfg.hicache_storage_prefetch_policy)
        if not cfg.enable_hierarchical_cache:
            default = cls()
            changed = [flag for flag, a, b in (
                ("--hicache-ratio", hc.ratio, default.ratio), ("--hicache-size", hc.size_gb, default.size_gb),
                ("--hicache-write-policy", hc.write_policy, default.write_policy),
                ("--hicache-storage-backend", hc.storage_backend, None),
                ("--hicache-storage-dir", hc.storage_dir, None),
                ("--hicache-storage-prefetch-policy", hc.prefetch_policy, default.prefetch_policy)) if a != b]
            if changed:
                raise ValueError(f"{', '.join(changed)} need(s) --enable-hierarchical-cache")
            return None
        if cfg.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache extends the prefix cache; it cannot be combined "
                             "with --disable-radix-cache")
        if not hc.ratio > 0:
            raise ValueError(f"--hicache-ratio must be > 0 (host pool = ratio x device pool), got {hc.ratio}")
        if hc.size_gb < 0:
            raise ValueError(f"--hicache-size must be >= 0 GB (0: use --hicache-ratio), got {hc.size_gb}")
        for flag, value, allowed in (("--hicache-write-policy", hc.write_policy, WRITE_POLICIES),
                                     ("--hicache-storage-prefetch-policy", hc.prefetch_policy, PREFETCH_POLICIES)):
            if value not in allowed:
                raise ValueError(f"{flag} must be one of {', '.join(allowed)}; got {value!r}")
        if hc.storage_backend is not None and hc.storage_backend not in STORAGE_BACKENDS:
            raise ValueError(f"--hicache-storage-backend must be one of {', '.join(STORAGE_BACKENDS)}; "
                             f"got {hc.storage_backend!r}")
        if hc.storage_dir is not None and hc.storage_backend is None:
            raise ValueError("--hicache-storage-dir needs --hicache-storage-backend file")
        return hc


def model_identity(source, config, runner) -> dict:
    """What the disk tier's keys must depend on: a page computed by another model, other
    weights, dtype, page size or state layout must never be found."""
    weights = []
    for f in source.weight_files:
        st = os.stat(f)
        weights.append((os.path.basename(f), st.st_size, st.st_mtime_ns))
    identity = {
        "format": 1,
        "model_dir": os.path.realpath(source.model_dir),
        "config": source.config,
        "load_format": source.load_format,
        "weights": weights,
        "dummy_seed": config.seed if source.load_format == "dummy" else None,
        "dtype": str(runner.dtype),
        "page_size": config.page_size,
        "tp_size": config.tp_size,
        "tp_rank": runner.pc.tp_rank,  # each rank stores its own shard of the heads
        "specs": [(s.kind.value, list(s.layer_ids), list(s.shape), str(s.dtype), s.window) for s in runner.specs],
    }
    if getattr(runner, "draft_identity", None):  # a DFlash drafter's context K/V rides in the main pages
        identity["draft_model"] = runner.draft_identity
    return identity


def host_pages_plan(ratio: float, device_pages: dict[str, int], histories: dict[str, int], page_size: int,
                    chunk_tokens: int) -> dict[str, int]:
    """Usable host pages per space for a host pool `ratio` x the device pool.

    Main: ratio x the device's main pages. A window space keeps only the window before each
    cached node's end, so it needs about (window pages + 1) per node, and nodes are about one
    prefill chunk long: the host window space gets that fraction of the host main pages (at
    most all of them); at least ratio x its device space, but never more pages than the host main
    space (a node never has more window pages than pages). The device window spaces are sized for
    every running request's window (`ModelRunner._pool_tokens`), which for long windows dwarfs
    what cached prefixes need: ratio x that would pin hundreds of GB of host memory for nothing."""
    main = max(1, int(ratio * (device_pages["main"] - 1)))
    plan = {"main": main}
    node_pages = max(1, chunk_tokens // page_size)
    for c, h in histories.items():
        per_node = -(-h // page_size) + 1
        plan[c] = max(int(main * min(1.0, per_node / node_pages)), min(int(ratio * (device_pages[c] - 1)), main), 1)
    return plan


def host_pages_sized(cfg: HiCacheConfig, device_pages: dict[str, int], histories: dict[str, int], page_size: int,
                     chunk_tokens: int, page_bytes: dict[str, int]) -> dict[str, int]:
    """`host_pages_plan` at `--hicache-ratio`, or, with `--hicache-size`, at the largest ratio whose
    plan fits in that many GB (bisection: the bytes grow with the ratio)."""
    def plan(ratio: float) -> dict[str, int]:
        return host_pages_plan(ratio, device_pages, histories, page_size, chunk_tokens)

    if cfg.size_gb <= 0:
        return plan(cfg.ratio)
    budget = cfg.size_gb * 1e9
    nbytes = lambda r: sum(page_bytes[n] * p for n, p in plan(r).items())  # noqa: E731
    lo, hi = 0.0, 1.0
    while nbytes(hi) < budget and hi < 1e6:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if nbytes(mid) <= budget else (lo, mid)
    return plan(lo)
