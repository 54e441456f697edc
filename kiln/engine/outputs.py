"""What `kiln.Engine.generate` returns (vLLM's shape, so RL code written for vLLM reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from kiln.engine.io import TokenLogprob


@dataclass
class CompletionOutput:
    """One sampled sequence of a request (a request with n = k has k of them).

    `logprobs` has one (logprob, [(token_id, logprob), ...]) per token when logprobs were asked
    for. `matched_stop` is the stop string or stop token id that ended the sequence, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    logprobs: Optional[list[TokenLogprob]] = None
    matched_stop: Union[str, int, None] = None
    routed_experts: Any = None
    # Speculative decoding: `SpecCounts` (verify steps, per-position proposed/accepted), or None.
    spec: Any = None


@dataclass
class RequestOutput:
    """The result of one prompt. `prompt` is None when the prompt was given as token ids.

    `prompt_logprobs` is aligned with `prompt_token_ids` (entry 0 is None) when asked for.
    `num_cached_tokens` are prompt tokens served from the prefix cache; `cached_tokens_details`
    splits them by the tier that served them ({"device", "host", "disk"}, HiCache).
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    num_cached_tokens: int = 0
    cached_tokens_details: Optional[dict] = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
