"""Request bodies of the HTTP API (pydantic), and their mapping onto `SamplingParams`.

OpenAI's /v1/chat/completions and /v1/completions, plus SGLang's native /generate. Responses are
built as plain dicts in `serving.py` (the OpenAI client parses them into its own types). Unknown
fields are ignored, as OpenAI-compatible servers commonly do, so newer clients keep working.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from kiln.engine.request import SamplingParams


class APIError(Exception):
    """An error returned to the client in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.type = message, status, param, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    type: str
    text: Optional[str] = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None  # an earlier assistant turn's reasoning, sent back

    def to_template(self, index: int) -> dict[str, Any]:
        """The dict a chat template expects: content joined into one string."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(f"messages[{index}].content has a part of type {part.type!r}; this "
                                   "model accepts text parts only ({'type': 'text', 'text': ...}).",
                                   param=f"messages.{index}.content")
                texts.append(part.text)
            content = "".join(texts)
        out: dict[str, Any] = {"role": self.role, "content": content if content is not None else ""}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls is not None:
            out["tool_calls"] = [_parsed_arguments(c) for c in self.tool_calls]
        return out


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sends a call's arguments as a JSON string; chat templates iterate a mapping."""
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            return call  # not JSON: the template gets the string as sent
        if isinstance(args, dict):
            return {**call, "function": {**fn, "arguments": args}}
    return call


class StreamOptions(_Lenient):
    include_usage: bool = False


class _OpenAISampling(_Lenient):
    """Sampling fields shared by chat and completions (OpenAI names plus vLLM/SGLang extras)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: Optional[str] = None
    # Structured output: OpenAI's response_format, or SGLang's regex / ebnf extras (kiln.engine.grammar)
    response_format: Optional[dict[str, Any]] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None  # token id (a string, as JSON keys are) -> [-100, 100]

    def json_schema(self) -> Optional[str]:
        """The JSON schema the answer must match (`response_format`), or None."""
        from kiln.engine.grammar import response_format_grammar

        try:
            grammar = response_format_grammar(self.response_format)
        except ValueError as e:
            raise APIError(str(e), param="response_format") from e
        return grammar[1] if grammar is not None else None

    def sampling_params(self, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
        d = SamplingParams()
        json_schema = self.json_schema()
        return SamplingParams(
            json_schema=json_schema, regex=self.regex, ebnf=self.ebnf,
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=_pick(self.temperature, d.temperature), top_p=_pick(self.top_p, d.top_p),
            top_k=_pick(self.top_k, d.top_k), min_p=_pick(self.min_p, d.min_p),
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, seed=self.seed, stop=_stops(self.stop),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, n=self.n, logprobs=logprobs,
            logit_bias=_logit_bias(self.logit_bias))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True  # False: tool_choice "required" makes exactly one call
    chat_template_kwargs: Optional[dict[str, Any]] = None
    separate_reasoning: bool = True  # SGLang: false leaves <think>...</think> in the content (--reasoning-parser)

    def forced_tools(self) -> Optional[tuple[str, Optional[str]]]:
        """tool_choice "required" or a named function: (the answer's JSON schema, the name or
        None); None otherwise (`kiln.server.parsers.forced_tools`)."""
        from kiln.server.parsers.forced_tools import forced_tool_choice

        try:
            return forced_tool_choice(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ValueError as e:
            raise APIError(str(e), param="tool_choice") from e

    def json_schema(self) -> Optional[str]:
        forced = self.forced_tools()
        if forced is None:
            return super().json_schema()
        given = [n for n in ("response_format", "regex", "ebnf") if getattr(self, n) is not None
                 and not (n == "response_format" and self.response_format.get("type") in (None, "text"))]
        if given:
            raise APIError(f"tool_choice {self.tool_choice!r} constrains the answer to tool calls; it cannot be "
                           f"combined with {given[0]} (use tool_choice 'auto')", param="tool_choice")
        return forced[0]


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False
    max_tokens: Optional[int] = 16  # OpenAI's legacy default


class GenerateSampling(_Lenient):
    """SGLang's `sampling_params` names."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    json_schema: Union[str, dict[str, Any], None] = None  # a JSON string (SGLang) or the schema itself
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = Field(default=None, alias="sampling_seed")

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class GenerateRequest(_Lenient):
    """SGLang's native request: `text` or `input_ids` (one, or a batch)."""

    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_routed_experts: bool = False
    stream: bool = False
    rid: Optional[str] = None

    def to_sampling_params(self) -> SamplingParams:
        s = self.sampling_params
        lp = self.top_logprobs_num if self.return_logprob else None
        schema = json.dumps(s.json_schema) if isinstance(s.json_schema, dict) else s.json_schema
        return SamplingParams(
            max_tokens=s.max_new_tokens, min_tokens=s.min_new_tokens, temperature=s.temperature,
            top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, frequency_penalty=s.frequency_penalty,
            presence_penalty=s.presence_penalty, repetition_penalty=s.repetition_penalty,
            stop=_stops(s.stop), stop_token_ids=list(s.stop_token_ids or []), ignore_eos=s.ignore_eos,
            skip_special_tokens=s.skip_special_tokens, include_stop_str_in_output=s.no_stop_trim,
            n=s.n, seed=s.seed, logprobs=lp, json_schema=schema, regex=s.regex, ebnf=s.ebnf,
            logit_bias=_logit_bias(s.logit_bias),
            prompt_logprobs=lp if self.return_logprob and self.logprob_start_len >= 0 else None)


class AbortRequest(_Lenient):
    """SGLang's /abort_request: one request by its rid, or every request (`abort_all`, as RL
    rollouts do when they have enough samples)."""

    rid: Optional[str] = None
    abort_all: bool = False


class UpdateWeightVersionRequest(_Lenient):
    """SGLang's /update_weight_version: the label /generate reports as meta_info.weight_version."""

    new_version: str = Field(min_length=1)
    abort_all_requests: bool = True


class TokenizeRequest(_Lenient):
    """/tokenize: SGLang's `prompt` (one text or a batch) or vLLM's chat form `messages`, whose ids
    are the ones /v1/chat/completions would prefill."""

    model: Optional[str] = None
    prompt: Union[str, list[str], None] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True  # `prompt` only: a chat template writes its own special tokens
    add_generation_prompt: bool = True  # `messages` only
    tools: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False  # vLLM: each id's piece as the tokenizer spells it


class DetokenizeRequest(_Lenient):
    """/detokenize: one list of ids, or a batch of them."""

    model: Optional[str] = None
    tokens: Union[list[int], list[list[int]]]
    skip_special_tokens: bool = True


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _logit_bias(bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    """OpenAI's logit_bias (JSON keys are strings) with integer token ids."""
    if bias is None:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise APIError(f"logit_bias keys must be token ids, got {sorted(bias)!r}", param="logit_bias") from None


def _stops(stop: Union[str, list[str], None]) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def validation_message(errors: list[dict]) -> tuple[str, Optional[str]]:
    """One readable sentence from pydantic's errors, naming the field: ("temperature: ...", "temperature")."""
    parts, first = [], None
    for err in errors[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx", {}).get("error", "")
            return f"The request body is not valid JSON ({ctx}); send a JSON object.", None
        field = ".".join(loc) or "body"
        first = first or field
        msg = err.get("msg", "invalid value")
        if err.get("type") == "missing":
            parts.append(f"'{field}' is required")
        else:
            got = err.get("input")
            shown = f" (got {got!r:.60})" if got is not None and not isinstance(got, (dict, list)) else ""
            parts.append(f"'{field}': {msg}{shown}")
    return "Invalid request: " + "; ".join(parts) + ".", first


# ---- RL control endpoints (SGLang's shapes) ------------------------------------------------

MAX_TENSOR_UPDATE_BYTES = 256 * 2**20  # decoded bytes per /update_weights_from_tensor call
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UpdateWeightsFromDiskRequest(_Lenient):
    model_path: str = Field(min_length=1)
    flush_cache: bool = True
    weight_version: Optional[str] = None  # on success, what /generate reports as meta_info.weight_version


class NamedTensor(_Strict):
    name: str = Field(min_length=1)
    dtype: Literal[TENSOR_DTYPES]  # type: ignore[valid-type]
    shape: list[int]
    data_b64: str


class UpdateWeightsFromTensorRequest(_Lenient):
    named_tensors: list[NamedTensor] = Field(min_length=1)
    flush_cache: bool = True
    weight_version: Optional[str] = None  # on success, what /generate reports as meta_info.weight_version

    def decode(self) -> list[tuple[str, Any]]:
        """(name, CPU tensor) pairs; APIError (400) on a bad entry or a body over the size cap."""
        import base64
        import binascii
        import math

        import torch

        total = 0
        out = []
        for i, t in enumerate(self.named_tensors):
            if any(d < 0 for d in t.shape):
                raise APIError(f"named_tensors[{i}].shape must hold non-negative sizes; got {t.shape}",
                               param=f"named_tensors.{i}.shape")
            dtype = getattr(torch, t.dtype)
            try:
                raw = base64.b64decode(t.data_b64, validate=True)
            except (binascii.Error, ValueError) as e:
                raise APIError(f"named_tensors[{i}].data_b64 is not valid base64 ({e})",
                               param=f"named_tensors.{i}.data_b64") from e
            total += len(raw)
            if total > MAX_TENSOR_UPDATE_BYTES:
                raise APIError(f"The tensors of one /update_weights_from_tensor call may hold at most "
                               f"{MAX_TENSOR_UPDATE_BYTES // 2**20} MiB; send them in buckets "
                               "(kiln.server.client.update_weights_from_tensor(url, named_tensors, "
                               "bucket_bytes=...) does this).", param="named_tensors")
            expected = math.prod(t.shape) * torch.empty(0, dtype=dtype).element_size()
            if len(raw) != expected:
                raise APIError(f"named_tensors[{i}] ({t.name}): data_b64 holds {len(raw)} bytes but "
                               f"{t.dtype} {t.shape} needs {expected}", param=f"named_tensors.{i}.data_b64")
            tensor = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
            out.append((t.name, tensor.reshape(t.shape)))
        return out


class InitWeightsUpdateGroupRequest(_Lenient):
    """SGLang's /init_weights_update_group: join the trainer's group (the trainer is rank 0 and
    hosts its store at master_address:master_port) as rank rank_offset + tensor-parallel rank."""

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field(default="weight_update_group", min_length=1)
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout_s: float = Field(default=600.0, gt=0, le=600.0)  # the API process waits at most that long


class UpdateWeightsFromDistributedRequest(_Lenient):
    """SGLang's /update_weights_from_distributed: the tensors rank 0 broadcasts next, in order."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: Optional[str] = None


class DestroyWeightsUpdateGroupRequest(_Lenient):
    group_name: str = "weight_update_group"


class StartProfileRequest(_Lenient):
    """SGLang's /start_profile: a torch.profiler trace of the engine's next steps."""

    output_dir: Optional[str] = None  # default: --profile-dir
    num_steps: Optional[int] = Field(default=None, ge=1)  # None: until /stop_profile
    activities: list[Literal["CPU", "GPU", "MEM"]] = Field(default_factory=lambda: ["CPU", "GPU"], min_length=1)
    with_stack: bool = False
    record_shapes: bool = False
    profile_prefix: Optional[str] = Field(default=None, pattern=r"^[\w.-]+$")  # default: the start time


class MemoryTagsRequest(_Lenient):
    tags: Optional[list[Literal["kv_cache", "weights"]]] = None  # None: both


class PauseGenerationRequest(_Lenient):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class LoadLoraAdapterRequest(_Lenient):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Lenient):
    lora_name: str = Field(min_length=1)
