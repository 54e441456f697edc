"""The FastAPI app: routes, API-key check, errors in OpenAI's shape, and Prometheus metrics.

The event loop never runs model work: handlers go through the TokenizerManager to the engine
process. Every error a client can cause comes back as 400 with
{"error": {"message", "type", "param", "code"}} and a message that says what to change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import time
from typing import Any, Iterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln import __version__
from kiln.config import EngineConfig
from kiln.engine.io import SchedulerStats
from kiln.engine.request import SamplingParams
from kiln.engine import io
from kiln.server.protocol import (AbortRequest, APIError, ChatCompletionRequest, CompletionRequest,
                                  DestroyWeightsUpdateGroupRequest, DetokenizeRequest, GenerateRequest,
                                  InitWeightsUpdateGroupRequest, LoadLoraAdapterRequest, MemoryTagsRequest,
                                  PauseGenerationRequest, StartProfileRequest, TokenizeRequest,
                                  UnloadLoraAdapterRequest, UpdateWeightsFromDiskRequest,
                                  UpdateWeightsFromDistributedRequest, UpdateWeightsFromTensorRequest,
                                  UpdateWeightVersionRequest, validation_message)
from kiln.server.serving import Serving
from kiln.server.tokenizer_manager import EngineDeadError, TokenizerManager

logger = logging.getLogger("kiln.server")
OPEN_PATHS = {"/health", "/metrics"}  # reachable without the API key (probes, scrapers)


def create_app(config: EngineConfig, tm: TokenizerManager, aliases: Optional[set[str]] = None) -> FastAPI:
    """Build the app around a TokenizerManager (whose sockets open on startup)."""
    info = tm.info
    serving = Serving(tm, info.name, set(aliases or ()) | {info.model_dir})
    metrics = EngineMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await tm.start()
        try:
            yield
        finally:
            await tm.stop()

    app = FastAPI(title="Kiln", version=__version__, lifespan=lifespan)

    # ---- errors --------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(e.errors()))
        return JSONResponse(APIError(message, param=param).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("Internal error")
        err = APIError(f"Internal server error ({type(e).__name__}: {e}); see the server log.", status=500,
                       type="internal_error")
        return JSONResponse(err.body(), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(str(e.detail), status=e.status_code).body(), status_code=e.status_code)

    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)

    # ---- OpenAI and native generation ----------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(req, raw)

    @app.post("/generate")
    async def generate(req: GenerateRequest, raw: Request) -> Response:
        return await serving.generate(req, raw)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": info.name, "object": "model", "created": int(time.time()), "owned_by": "kiln",
            "root": info.model_dir, "max_model_len": info.context_length}]}

    # SGLang serves both the bare and the /v1 paths; vLLM the bare ones.
    async def tokenize(req: TokenizeRequest) -> dict:
        return serving.tokenize(req)

    async def detokenize(req: DetokenizeRequest) -> dict:
        return serving.detokenize(req)

    for prefix in ("", "/v1"):
        app.add_api_route(f"{prefix}/tokenize", tokenize, methods=["POST"])
        app.add_api_route(f"{prefix}/detokenize", detokenize, methods=["POST"])

    # ---- health, metrics, control --------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if tm.dead:
            return JSONResponse(APIError(tm.dead, status=503, type="service_unavailable").body(), status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Generate one token end to end: proves the engine loop is alive, not just the process."""
        try:
            handle = tm.submit([0], SamplingParams(max_tokens=1, temperature=0.0))
            async for _ in tm.stream([handle]):
                pass
        except (EngineDeadError, ValueError) as e:
            return JSONResponse(APIError(str(e), status=503, type="service_unavailable").body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        try:
            metrics.update(await tm.get_stats())
        except EngineDeadError:
            pass  # still export the last snapshot; /health reports the failure
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def flush() -> JSONResponse:
        try:
            result = await tm.flush_cache()
        except EngineDeadError as e:
            raise APIError(str(e), status=503, type="service_unavailable") from e
        msg = "Cache flushed." if result.success else (result.message or "Cache not flushed.")
        return JSONResponse({"success": result.success, "message": msg}, status_code=200 if result.success else 400)

    app.add_api_route("/flush_cache", flush, methods=["POST", "GET"])

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest) -> dict:
        if req.abort_all:
            n = tm.abort_all()
            return {"success": True, "message": f"Aborted {n} requests.", "num_aborted": n}
        if not req.rid:
            raise APIError("Send the 'rid' of the request to abort, or 'abort_all': true.", param="rid")
        return {"success": tm.abort(req.rid)}

    async def server_info() -> dict:
        stats = await tm.get_stats() if not tm.dead else SchedulerStats()
        return {"version": __version__, "config": dataclasses.asdict(config), "model": dataclasses.asdict(info),
                "stats": dataclasses.asdict(stats), "num_api_requests": len(tm.handles)}

    async def model_info() -> dict:
        return {"model_path": info.model_dir, "served_model_name": info.name, "context_length": info.context_length,
                "vocab_size": info.vocab_size, "eos_token_ids": list(info.eos_token_ids), "is_generation": True}

    app.add_api_route("/server_info", server_info, methods=["GET"])
    app.add_api_route("/get_server_info", server_info, methods=["GET"])
    app.add_api_route("/model_info", model_info, methods=["GET"])
    app.add_api_route("/get_model_info", model_info, methods=["GET"])

    # ---- RL control (SGLang's endpoints; see docs/serving.md "RL control endpoints") ------------
    async def rl_control(msg: Any, weight_version: Optional[str] = None) -> JSONResponse:
        """{"success", "message"} with 200, or 400 with the OpenAI error object added. A weight
        update that succeeds relabels the weights with `weight_version`, when given."""
        try:
            result = await tm.rl_control(msg)
        except EngineDeadError as e:
            raise APIError(str(e), status=503, type="service_unavailable") from e
        body = {"success": result.success, "message": result.message, **result.extra}
        if result.success:
            if weight_version is not None:
                tm.weight_version = weight_version
            return JSONResponse(body)
        return JSONResponse({**body, **APIError(result.message).body()}, status_code=400)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest) -> JSONResponse:
        return await rl_control(io.UpdateWeightsFromDiskReq(req.model_path, req.flush_cache), req.weight_version)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(req: UpdateWeightsFromTensorRequest) -> JSONResponse:
        return await rl_control(io.UpdateWeightsFromTensorReq(req.decode(), req.flush_cache), req.weight_version)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(req: InitWeightsUpdateGroupRequest) -> JSONResponse:
        return await rl_control(io.InitWeightsUpdateGroupReq(req.master_address, req.master_port, req.rank_offset,
                                                             req.world_size, req.group_name, req.backend,
                                                             req.timeout_s))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        return await rl_control(io.UpdateWeightsFromDistributedReq(req.names, req.dtypes, req.shapes, req.group_name,
                                                                   req.flush_cache), req.weight_version)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyWeightsUpdateGroupRequest) -> JSONResponse:
        return await rl_control(io.DestroyWeightsUpdateGroupReq(req.group_name))

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict:
        return {"weight_version": tm.weight_version}

    @app.post("/update_weight_version")
    async def update_weight_version(req: UpdateWeightVersionRequest) -> dict:
        n = tm.abort_all() if req.abort_all_requests else 0
        tm.weight_version = req.new_version
        return {"success": True, "message": f"Weight version {req.new_version!r}; aborted {n} requests.",
                "weight_version": req.new_version, "num_aborted": n}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(req: MemoryTagsRequest) -> JSONResponse:
        return await rl_control(io.ReleaseMemoryReq(req.tags))

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(req: MemoryTagsRequest) -> JSONResponse:
        return await rl_control(io.ResumeMemoryReq(req.tags))

    @app.post("/pause_generation")
    async def pause_generation(req: PauseGenerationRequest) -> JSONResponse:
        return await rl_control(io.PauseGenerationReq(req.mode))

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        return await rl_control(io.ContinueGenerationReq())

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoraAdapterRequest) -> JSONResponse:
        return await rl_control(io.LoadLoraReq(req.lora_name, req.lora_path))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoraAdapterRequest) -> JSONResponse:
        return await rl_control(io.UnloadLoraReq(req.lora_name))

    # ---- profiling (SGLang's /start_profile and /stop_profile) ---------------------------------
    @app.post("/start_profile")
    async def start_profile(req: Optional[StartProfileRequest] = None) -> JSONResponse:
        from kiln.engine.profiler import ProfileOptions

        req = req or StartProfileRequest()
        opts = ProfileOptions(output_dir=req.output_dir or config.profile_dir, num_steps=req.num_steps,
                              activities=tuple(req.activities), with_stack=req.with_stack,
                              record_shapes=req.record_shapes, prefix=req.profile_prefix or "")
        return await rl_control(io.StartProfileReq(opts))

    @app.post("/stop_profile")
    async def stop_profile() -> JSONResponse:
        return await rl_control(io.StopProfileReq())

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    return app


class APIKeyMiddleware:
    """401 unless 'Authorization: Bearer <key>'. Plain ASGI (not BaseHTTPMiddleware), so handlers
    still see the client's disconnect through `request.is_disconnected()`."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.expected):
                err = APIError("Invalid or missing API key; send 'Authorization: Bearer <key>' with the "
                               "key given to --api-key.", status=401)
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class EngineMetrics:
    """Prometheus view of the engine's `SchedulerStats` (fetched on each scrape)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        self.stats = SchedulerStats()
        self.gen_throughput = 0.0
        self._last: Optional[tuple[float, int]] = None
        self.registry.register(self)

    def update(self, stats: SchedulerStats) -> None:
        now = time.monotonic()
        if self._last is None:
            self._last = (now, stats.generation_tokens_total)
        elif now - self._last[0] >= 0.5:  # throughput over the interval since the last scrape
            t0, g0 = self._last
            self.gen_throughput = (stats.generation_tokens_total - g0) / (now - t0)
            self._last = (now, stats.generation_tokens_total)
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats
        gauges = [
            ("kiln_num_running_reqs", "Requests in the running batch.", s.num_running),
            ("kiln_num_queue_reqs", "Requests waiting for admission.", s.num_waiting),
            ("kiln_kv_usage", "Fraction of the KV pool in use.", s.kv_usage),
            ("kiln_kv_used_tokens", "KV pool slots in use.", s.kv_used_tokens),
            ("kiln_kv_total_tokens", "KV pool size in tokens.", s.kv_total_tokens),
            ("kiln_cache_hit_rate", "Prompt tokens served from the prefix cache / all prompt tokens.",
             s.cache_hit_rate),
            ("kiln_gen_throughput", "Generated tokens per second since the previous scrape.", self.gen_throughput),
            ("kiln_hicache_host_used_tokens", "HiCache host pool slots in use.", s.hicache_host_used_tokens),
            ("kiln_hicache_host_total_tokens", "HiCache host pool size in tokens (0: HiCache off).",
             s.hicache_host_total_tokens),
        ]
        if s.spec is not None:
            gauges.append(("kiln_spec_accept_length",
                           "Speculative decoding: mean tokens produced per verify step (accepted drafts + 1).",
                           s.spec.accept_length))
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        if s.spec is not None:
            rate = GaugeMetricFamily("kiln_spec_accept_rate", "Speculative decoding: fraction of proposed "
                                     "drafts accepted, per draft position.", labels=["position"])
            for i, v in enumerate(s.spec.accept_rate_per_position):
                rate.add_metric([str(i + 1)], v)
            yield rate
            steps = CounterMetricFamily("kiln_spec_steps_by_draft_length", "Speculative decoding: steps "
                                        "whose decoding requests were offered this many drafts "
                                        "(--speculative-adaptive chooses it per step).", labels=["length"])
            for k, v in enumerate(s.spec.steps_by_length):
                steps.add_metric([str(k)], v)
            yield steps
        counters = [
            ("kiln_prompt_tokens", "Prompt tokens processed.", s.prompt_tokens_total),
            ("kiln_cached_tokens", "Prompt tokens served from the prefix cache.", s.cached_tokens_total),
            ("kiln_generation_tokens", "Tokens generated.", s.generation_tokens_total),
            ("kiln_retractions", "Requests retracted under memory pressure.", s.num_retractions_total),
        ]
        counters += [
            ("kiln_hicache_backed_up_tokens", "Tokens copied from the device pool to the host pool.",
             s.hicache_backed_up_tokens_total),
            ("kiln_hicache_loaded_tokens", "Tokens loaded back from the host pool to the device pool.",
             s.hicache_loaded_tokens_total),
            ("kiln_hicache_disk_written_tokens", "Tokens written to the HiCache disk tier.",
             s.hicache_disk_written_tokens_total),
            ("kiln_hicache_disk_read_tokens", "Tokens read from the HiCache disk tier.", s.hicache_disk_read_tokens_total),
        ]
        if s.spec is not None:
            counters += [("kiln_spec_verify_steps", "Speculative verify steps with at least one draft.",
                          s.spec.verify_steps),
                         ("kiln_spec_accepted_tokens", "Draft tokens accepted.", s.spec.accepted_tokens),
                         ("kiln_spec_verifies_queued_ahead",
                          "Verify forwards queued before the previous round's samples were read back.",
                          s.spec.verifies_queued_ahead)]
        for name, doc, value in counters:  # exported as <name>_total
            yield CounterMetricFamily(name, doc, value=value)
        tiers = CounterMetricFamily("kiln_cached_tokens_by_tier",
                                    "Prompt tokens served from the prefix cache, by the tier that held them.",
                                    labels=["tier"])
        for tier, value in (("device", s.cached_tokens_device_total), ("host", s.cached_tokens_host_total),
                            ("disk", s.cached_tokens_disk_total)):
            tiers.add_metric([tier], value)
        yield tiers
