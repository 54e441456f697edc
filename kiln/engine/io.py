"""Messages between the API side (tokenizer, detokenizer, HTTP) and the scheduler.

They are plain dataclasses: pickled over ZMQ between processes, passed as objects in-process
(the offline `Engine`). Token ids only: no text ever reaches the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kiln.engine.request import FinishReason, Req, ReqStatus, SamplingParams
from kiln.engine.spec.metrics import SpecCounts

# One logprob entry: (logprob of the token, [(token_id, logprob), ...] top alternatives).
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass
class GenerateReq:
    """A tokenized request. `n > 1` in params is expanded by the sender into `n` GenerateReqs
    whose rids are `f"{rid}-{i}"`; the scheduler always sees n == 1."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_routed_experts: bool = False


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class StatsReq:
    """Ask the scheduler for a `SchedulerStats` snapshot."""


# ---- Control messages (SGLang's control endpoints: RL's weight and memory calls, profiling). The
# scheduler handles them between two steps, in arrival order, and answers each with one
# `ControlResult`.

MEMORY_TAGS = ("kv_cache", "weights")
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class UpdateWeightsFromDiskReq:
    model_path: str
    flush_cache: bool = True


@dataclass
class UpdateWeightsFromTensorReq:
    """(on-disk name, CPU tensor) pairs, pickled with the message (any subset of the weights)."""

    named_tensors: list = field(default_factory=list)
    flush_cache: bool = True


@dataclass
class InitWeightsUpdateGroupReq:
    """Join a trainer's weight update group (`kiln.dist.weight_update_group`) as rank
    rank_offset + tp_rank."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout_s: float = 600.0


@dataclass
class UpdateWeightsFromDistributedReq:
    """Receive these tensors from rank 0 of the group, one broadcast each in this order, and
    load them (any subset of the weights, by on-disk name)."""

    names: list
    dtypes: list
    shapes: list
    group_name: str = "weight_update_group"
    flush_cache: bool = True


@dataclass
class DestroyWeightsUpdateGroupReq:
    group_name: str = "weight_update_group"


@dataclass
class StartProfileReq:
    """Start a torch.profiler trace of the next steps (`kiln.engine.profiler.ProfileOptions`)."""

    options: Any


@dataclass
class StopProfileReq:
    pass


@dataclass
class ReleaseMemoryReq:
    tags: Optional[list[str]] = None  # None: every tag


@dataclass
class ResumeMemoryReq:
    tags: Optional[list[str]] = None


@dataclass
class PauseGenerationReq:
    mode: str = "abort"  # "abort" | "retract" | "in_place"


@dataclass
class ContinueGenerationReq:
    pass


@dataclass
class LoadLoraReq:
    name: str
    path: Any  # a PEFT adapter directory, or {"state_dict": ..., "config": ...}


@dataclass
class UnloadLoraReq:
    name: str


CONTROL_REQS = (UpdateWeightsFromDiskReq, UpdateWeightsFromTensorReq, InitWeightsUpdateGroupReq,
                UpdateWeightsFromDistributedReq, DestroyWeightsUpdateGroupReq, ReleaseMemoryReq, ResumeMemoryReq,
                PauseGenerationReq, ContinueGenerationReq, LoadLoraReq, UnloadLoraReq, StartProfileReq, StopProfileReq)


@dataclass
class ControlResult:
    success: bool
    message: str = ""
    extra: dict = field(default_factory=dict)


@dataclass
class ReqOutput:
    """What one request produced in one scheduler step (incremental)."""

    rid: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: Optional[str] = None  # FinishReason value
    # The stop token id / matched stop that ended the request, when finish_reason == "stop"
    matched_stop: Optional[int] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # cached_tokens by the tier that served them: {"device", "host", "disk"} (HiCache)
    cached_tokens_details: Optional[dict] = None
    completion_tokens: int = 0
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # sent once, when complete
    error: Optional[str] = None  # set when the scheduler rejected the request
    # Sent once, when finished and asked for: int32 [prompt + output - 1, num_moe_layers, top_k],
    # the expert ids of every forwarded token (the last sampled token is never forwarded).
    routed_experts: Optional[Any] = None
    # Speculative decoding: this request's acceptance so far (None without speculation).
    spec: Optional[SpecCounts] = None

    @classmethod
    def of(cls, r: Req, num_new: int) -> "ReqOutput":
        """Request r's output for a step that appended its last `num_new` tokens."""
        n_out = len(r.output_ids)
        finished = r.status is ReqStatus.FINISHED
        out = cls(rid=r.rid, new_token_ids=r.output_ids[n_out - num_new:] if num_new else [], finished=finished,
                  finish_reason=r.finish_reason.value if r.finish_reason else None,
                  prompt_tokens=len(r.prompt_ids), cached_tokens=r.cached_tokens,
                  cached_tokens_details=r.cached_tiers or None, completion_tokens=n_out)
        if r.finish_reason == FinishReason.STOP and n_out:
            out.matched_stop = r.output_ids[-1]
        if r.params.logprobs is not None and num_new:
            out.new_logprobs = r.output_logprobs[-num_new:]
        if finished:
            out.routed_experts = r.routed_experts
        if r.prompt_logprobs is not None and len(r.output_ids) == num_new and num_new:
            out.prompt_logprobs = r.prompt_logprobs
        if r.spec is not None:
            out.spec = r.spec.counts.copy()
        return out

    def __reduce__(self):
        # Pickled as the positional field values: the scheduler process sends one per running
        # request per step, and a dataclass's default pickling (a state dict each) took 0.86 ms to
        # dump and 1.2 ms to load at 512 requests on a 2-core CPU, against 0.29 / 0.26 this way.
        # Every field, in declaration order (tests/engine/test_io_pickle.py checks it).
        return (ReqOutput, (self.rid, self.new_token_ids, self.finished, self.finish_reason, self.matched_stop,
                            self.prompt_tokens, self.cached_tokens, self.cached_tokens_details,
                            self.completion_tokens, self.new_logprobs, self.prompt_logprobs, self.error,
                            self.routed_experts, self.spec))


@dataclass
class BatchOutput:
    outputs: list[ReqOutput]


@dataclass
class FlushCacheResult:
    success: bool
    message: str = ""


@dataclass
class SchedulerStats:
    """Gauges and counters the server exports on /metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0
    prompt_tokens_total: int = 0  # counters since start
    cached_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_retractions_total: int = 0
    spec: Optional[SpecCounts] = None  # speculative decoding's acceptance counters (None: off)
    # Cached prompt tokens by the tier that served them (device only without HiCache)
    cached_tokens_device_total: int = 0
    cached_tokens_host_total: int = 0
    cached_tokens_disk_total: int = 0
    # HiCache (zero when off): host pool gauges and tokens moved between tiers
    hicache_host_used_tokens: int = 0
    hicache_host_total_tokens: int = 0
    hicache_backed_up_tokens_total: int = 0  # device -> host
    hicache_loaded_tokens_total: int = 0  # host -> device
    hicache_disk_written_tokens_total: int = 0
    hicache_disk_read_tokens_total: int = 0

    def add_tier_hits(self, tiers: dict) -> None:
        self.cached_tokens_device_total += tiers.get("device", 0)
        self.cached_tokens_host_total += tiers.get("host", 0)
        self.cached_tokens_disk_total += tiers.get("disk", 0)

    def set_hicache(self, h: Any, page_size: int) -> None:
        """Copy a `HiCacheStats` snapshot (pages) in, as tokens."""
        self.hicache_host_used_tokens = h.host_used_pages * page_size
        self.hicache_host_total_tokens = h.host_total_pages * page_size
        self.hicache_backed_up_tokens_total = h.backed_up_pages * page_size
        self.hicache_loaded_tokens_total = h.loaded_pages * page_size
        self.hicache_disk_written_tokens_total = h.disk_written_pages * page_size
        self.hicache_disk_read_tokens_total = h.disk_read_pages * page_size

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / max(1, self.kv_total_tokens)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens_total / max(1, self.prompt_tokens_total)
