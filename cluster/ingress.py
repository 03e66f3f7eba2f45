"""The front end: OpenAI-compatible HTTP (FastAPI under Serve) and the moray.v1 gRPC service.

Everything a client can get wrong is checked here, before any worker is involved: auth, then the one
validation layer both protocols share (`validation.py`: body size, JSON, strict types, unsupported
fields, model name, chat messages, prompt length, token ids, sampling parameters, context length).
Errors are HTTP 4xx with an OpenAI-style body, or gRPC INVALID_ARGUMENT / UNAUTHENTICATED / NOT_FOUND /
RESOURCE_EXHAUSTED with a one-line message. A `ValueError` a worker raises (the engine's own checks, a
second line of defence) is a 400 / INVALID_ARGUMENT too; nothing a client gets carries a traceback.
"""

import asyncio
import gc
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from protos.moray.v1 import moray_pb2
from workers.engine.kv_events import KVEvent
from workers.engine.sampling_params import SamplingParams
from workers.models import load_config
from workers.models.tokenizer import Tokenizer

from . import logs, tool_calls, tracing, validation
from . import openai_api as oa
from .config import ClusterConfig, parse_cluster_config
from .grpc_service import quiet_client_errors
from .metrics import FrontendMetrics
from .orchestrator import Chunk, Orchestrator, RequestTrace
from .reasoning import ThinkSplitter, split_reasoning
from .router.types import RouteDecision
from .routing import NoWorkersAvailable, build_router

log = logging.getLogger("moray.cluster")

api = FastAPI(title="Moray", docs_url=None, redoc_url=None)


@api.exception_handler(StarletteHTTPException)
async def _routing_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and methods answer in the OpenAI error shape every client parses, not FastAPI's
    `{"detail": ...}` (found by `moray bench fuzz`)."""
    if e.status_code == 404:
        message = f"unknown route: {request.method} {request.url.path}"
    elif e.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(e.detail)
    type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(oa.APIError(e.status_code, message, type_).body(), status_code=e.status_code, headers=e.headers)


@dataclass
class PreparedRequest:
    request_id: str  # always server-generated: what workers and the router see
    prompt: list[int]
    params: SamplingParams
    session_id: str | None
    decision: RouteDecision | None = None
    # What the client is told: a gRPC client may choose its own id. It never reaches a worker, so two
    # requests with the same client id cannot touch each other.
    public_id: str | None = None
    reasoning: bool | None = None  # see Checked.reasoning
    tool_format: str | None = None  # see Checked.tool_format
    stage: str = "ingress"  # where it was when it failed (the orchestrator's RequestTrace.stage)
    span: Any = None  # its ingress span while tracing is on (cluster/tracing.py)

    @property
    def client_id(self) -> str:
        return self.public_id or self.request_id


def _grpc_metadata(context) -> dict:
    return dict(context.invocation_metadata()) if context is not None else {}


class _StreamRefused(Exception):
    """A stream that failed before its first event (carries the cause to `Ingress._streaming`)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


@serve.deployment
@serve.ingress(api)
class Ingress:
    def __init__(self, cluster_config: dict, prefill_handle, decode_handle):
        self.config: ClusterConfig = parse_cluster_config(cluster_config)
        engine = self.config.engine
        self.model_name = engine.model_name
        _, self.model_cfg = load_config(engine.model)
        self.max_model_len = engine.max_model_len or min(self.model_cfg.max_position_embeddings, 4096)
        self.tokenizer = Tokenizer.from_dir(engine.model) if os.path.isfile(os.path.join(engine.model, "tokenizer.json")) else None
        self.api_keys = set(self.config.server.api_keys)
        if self.config.server.api_keys_env:
            self.api_keys |= {k for k in os.environ.get(self.config.server.api_keys_env, "").split(",") if k}
        self.validator = validation.RequestValidator(
            model_name=self.model_name,
            vocab_size=self.model_cfg.vocab_size,
            max_model_len=self.max_model_len,
            tokenizer=self.tokenizer,
            max_body_bytes=self.config.server.max_body_bytes,
            max_prompt_tokens=self.config.server.max_prompt_tokens,
            tool_call_parser=self.config.server.tool_call_parser,
        )
        logs.configure(self.config.observability)
        tracing.configure(self.config.observability, "ingress")
        quiet_client_errors()
        self.metrics = FrontendMetrics(model_name=self.model_name, max_model_len=self.max_model_len)
        self.router = build_router(self.config)
        self.router.on_worker_gone(self.metrics.forget_worker)  # a failed/expired worker's series leave /metrics
        colocated = self.config.mode == "colocated"
        self.orchestrator = Orchestrator(
            self.router,
            prefill_handle,
            decode_handle,
            engine.block_size,
            self.model_name,
            colocated,
            server=self.config.server,
            metrics=self.metrics,  # admission control, timeouts, failover counts
        )
        self.workers: dict[str, dict] = {}
        self.created = int(time.time())
        # Startup state (Ray, FastAPI, the tokenizer, a mirrored index) lives as long as the replica: keep
        # it out of the garbage collector's full passes, which would otherwise stall routing decisions.
        gc.collect()
        gc.freeze()

    # ------------------------------------------------------------------ worker reports

    async def report(self, load: dict, events: list[dict]) -> None:
        self.workers[load["worker_id"]] = {**load, "reported_at": time.time()}
        self.metrics.observe_worker(load)
        self.router.report(load, [KVEvent.from_dict(e) for e in events])

    def live_workers(self, role: str) -> list[str]:
        horizon = time.time() - self.config.router.heartbeat_ttl_s
        return [
            w
            for w, l in self.workers.items()
            if l["role"] == role and l["reported_at"] >= horizon and l["healthy"] and not self.router.is_failed(w)
        ]

    # ------------------------------------------------------------------ shared validation

    def check_auth(self, authorization: str | None) -> None:
        if not self.api_keys:
            return
        if not authorization:
            raise oa.APIError(401, "missing API key: send 'Authorization: Bearer <key>'", "authentication_error", code="invalid_api_key")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in self.api_keys:
            raise oa.APIError(401, "invalid API key", "authentication_error", code="invalid_api_key")

    async def prepare_completion(self, body: oa.CompletionRequest, session: str | None) -> PreparedRequest:
        checked = await self.validator.completion(body)
        return PreparedRequest(oa.new_id("cmpl"), checked.prompt, checked.params, session or body.user)

    async def prepare_chat(self, body: oa.ChatCompletionRequest, session: str | None) -> PreparedRequest:
        checked = await self.validator.chat(body)
        return PreparedRequest(
            oa.new_id("chatcmpl"),
            checked.prompt,
            checked.params,
            session or body.user,
            reasoning=checked.reasoning,
            tool_format=checked.tool_format,
        )

    # ------------------------------------------------------------------ running a request

    async def decide(self, req: PreparedRequest, carrier=None) -> PreparedRequest:
        """Admits and routes the request; its ingress span starts here (`carrier`: HTTP headers or gRPC
        metadata, which may hold the client's traceparent) and ends in `run`."""
        logs.current_request_id.set(req.request_id)
        attributes = {"moray.request_id": req.request_id, "moray.model": self.model_name, "moray.prompt_tokens": len(req.prompt)}
        req.span = tracing.start_span("ingress", tracing.extract(carrier), attributes, server=True)
        try:
            req.decision = await self.orchestrator.route(req.request_id, req.prompt, req.session_id, req.span)
        except BaseException as e:
            tracing.end_span(req.span, error=e)  # refused (429, 503) or the client left: it ends here
            if isinstance(e, NoWorkersAvailable):
                raise oa.APIError(503, "no worker is ready yet; retry shortly", "service_unavailable") from None
            raise
        return req

    async def run(self, req: PreparedRequest, api_name: str) -> AsyncIterator[Chunk]:
        trace = RequestTrace(span=req.span)
        outcome = "error"
        failure = None
        tokens = 0
        last_at = None  # when the previous chunk with tokens arrived (inter-token latency)
        try:
            async for chunk in self.orchestrator.stream(req.request_id, req.prompt, req.params, req.decision, trace, req.session_id):
                if chunk.completion_tokens > tokens:
                    now = time.perf_counter()
                    if last_at is not None:
                        self.metrics.observe_token_gap(now - last_at, chunk.completion_tokens - tokens)
                    last_at = now
                tokens = chunk.completion_tokens
                if chunk.finished:
                    outcome = chunk.finish_reason or "stop"
                    self.metrics.cached_tokens.inc(chunk.num_cached_tokens)
                    self.router.record_reuse(chunk.num_cached_tokens)
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            outcome = "cancelled" if outcome == "error" else outcome
            raise
        except Exception as e:
            failure = e
            raise
        finally:
            req.stage = trace.stage
            self.record(trace, api_name, outcome, len(req.prompt), tokens)
            tracing.end_span(req.span, {"moray.api": api_name, "moray.outcome": outcome, "moray.completion_tokens": tokens}, error=failure)

    def record(self, trace: RequestTrace, api_name: str, outcome: str, prompt_tokens: int, tokens: int) -> None:
        path = "disaggregated" if trace.remote_prefill else "local"
        end = trace.end or time.perf_counter()
        self.metrics.observe_request(api_name, outcome, prompt_tokens, tokens, trace.start, trace.first_token, end, path)

    def detok(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else str(token)

    # ------------------------------------------------------------------ HTTP

    async def _parse(self, request: Request, model_cls):
        self.check_auth(request.headers.get("authorization"))
        self.validator.check_content_length(request.headers.get("content-length"))
        chunks, size = [], 0
        async for chunk in request.stream():  # a body without Content-Length is cut off at the limit too
            size += len(chunk)
            self.validator.check_size(size)
            chunks.append(chunk)
        return validation.parse_request(b"".join(chunks), model_cls)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        try:
            body = await self._parse(request, oa.CompletionRequest)
            req = await self.decide(await self.prepare_completion(body, request.headers.get("x-session-id")), request.headers)
        except oa.APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=getattr(e, "headers", None))
        if body.stream:
            return await self._streaming(req, self._completion_sse(req, body))
        try:
            return JSONResponse(await self._completion_full(req, body))
        except Exception as e:  # noqa: BLE001 - mapped to a 4xx/5xx without a traceback
            return self._http_error(req, e)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        try:
            body = await self._parse(request, oa.ChatCompletionRequest)
            req = await self.decide(await self.prepare_chat(body, request.headers.get("x-session-id")), request.headers)
        except oa.APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=getattr(e, "headers", None))
        if body.stream:
            return await self._streaming(req, self._chat_sse(req, body))
        try:
            return JSONResponse(await self._chat_full(req, body))
        except Exception as e:  # noqa: BLE001 - mapped to a 4xx/5xx without a traceback
            return self._http_error(req, e)

    def _failure(self, req: PreparedRequest, e: BaseException) -> oa.APIError:
        """What a client is told about a request that failed after validation (never a traceback). Our own
        failures (5xx: a worker failed, a timeout, an internal error) are logged at ERROR with the request id
        and stage, which `moray serve` shows on its console; a client's mistakes only at INFO."""
        err = validation.client_error(e)
        context = {"request_id": req.request_id, "stage": req.stage, "client_request_id": req.public_id}
        if err is not None:  # a worker's ValueError, or an APIError (e.g. the orchestrator's 429/503/504)
            level = logging.INFO if err.status < 500 else logging.ERROR
            log.log(level, "request %s failed during %s: %s %s", req.request_id, req.stage, err.status, err.message, extra=context)
            return err
        log.error(
            "request %s failed during %s: internal error: %s: %s", req.request_id, req.stage, type(e).__name__, e, exc_info=e, extra=context
        )
        return oa.APIError(500, f"internal error: {type(e).__name__}", "server_error")

    def _http_error(self, req: PreparedRequest, e: BaseException) -> JSONResponse:
        err = self._failure(req, e)
        return JSONResponse(err.body(), status_code=err.status, headers=getattr(err, "headers", None))

    async def _streaming(self, req: PreparedRequest, events: AsyncIterator[str]):
        """Starts an SSE stream only once its first event is ready: a request a worker refuses (the
        engine's second-line checks) is still an HTTP error, not a 200 with an error event."""
        try:
            first = await anext(events)
        except StopAsyncIteration:
            first = None
        except _StreamRefused as e:
            return self._http_error(req, e.error)

        async def body():
            try:
                if first is not None:
                    yield first
                    async for event in events:
                        yield event
            finally:
                await events.aclose()

        return StreamingResponse(body(), media_type="text/event-stream")

    async def _collect(self, req: PreparedRequest, api_name: str):
        tokens, text, logprobs, last = [], [], [], None
        async for chunk in self.run(req, api_name):
            tokens += chunk.token_ids
            text.append(chunk.text)
            logprobs += chunk.logprobs or []
            last = chunk
        return tokens, "".join(text), logprobs, last

    async def _completion_full(self, req: PreparedRequest, body: oa.CompletionRequest) -> dict:
        tokens, text, logprobs, last = await self._collect(req, "completions")
        choice = {"index": 0, "text": text, "finish_reason": last.finish_reason, "logprobs": None}
        if body.logprobs is not None:
            choice["logprobs"] = oa.completion_logprobs([self.detok(t) for t in tokens], logprobs, tokens, self.detok)
        return {
            "id": req.request_id,
            "object": "text_completion",
            "created": oa.created(),
            "model": self.model_name,
            "choices": [choice],
            "usage": oa.usage(len(req.prompt), len(tokens), last.num_cached_tokens),
        }

    async def _chat_full(self, req: PreparedRequest, body: oa.ChatCompletionRequest) -> dict:
        tokens, text, logprobs, last = await self._collect(req, "chat")
        message = {"role": "assistant", "content": text}
        finish_reason = last.finish_reason
        if req.reasoning is not None:
            message["reasoning_content"], message["content"] = split_reasoning(text, req.reasoning)
        if req.tool_format is not None:
            content, calls = tool_calls.parse(message["content"], req.tool_format)
            if calls:
                message["content"] = content.strip() or None
                message["tool_calls"] = [c.openai() for c in calls]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        choice = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
        if body.logprobs:
            choice["logprobs"] = oa.chat_logprobs(tokens, logprobs, body.top_logprobs or 0, self.detok)
        return {
            "id": req.request_id,
            "object": "chat.completion",
            "created": oa.created(),
            "model": self.model_name,
            "choices": [choice],
            "usage": oa.usage(len(req.prompt), len(tokens), last.num_cached_tokens),
        }

    async def _sse(self, req: PreparedRequest, body, api_name: str, make_choice, obj: str):
        created = oa.created()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        last = None
        first = True
        try:
            async for chunk in self.run(req, api_name):
                last = chunk
                event = {
                    "id": req.request_id,
                    "object": obj,
                    "created": created,
                    "model": self.model_name,
                    "choices": [make_choice(chunk, first)],
                }
                first = False
                yield f"data: {json.dumps(event)}\n\n"
            if include_usage and last is not None:
                event = {
                    "id": req.request_id,
                    "object": obj,
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": oa.usage(len(req.prompt), last.completion_tokens, last.num_cached_tokens),
                }
                yield f"data: {json.dumps(event)}\n\n"
        except Exception as e:  # noqa: BLE001 - reported to the client without a traceback
            if first:  # nothing sent yet: `_streaming` answers with an HTTP error instead
                raise _StreamRefused(e) from None
            yield f"data: {json.dumps(self._failure(req, e).body())}\n\n"
        yield "data: [DONE]\n\n"

    def _completion_sse(self, req: PreparedRequest, body: oa.CompletionRequest):
        def choice(chunk: Chunk, first: bool) -> dict:
            out = {"index": 0, "text": chunk.text, "finish_reason": chunk.finish_reason if chunk.finished else None, "logprobs": None}
            if body.logprobs is not None and chunk.logprobs:
                out["logprobs"] = oa.completion_logprobs(
                    [self.detok(t) for t in chunk.token_ids], chunk.logprobs, chunk.token_ids, self.detok
                )
            return out

        return self._sse(req, body, "completions", choice, "text_completion")

    def _chat_sse(self, req: PreparedRequest, body: oa.ChatCompletionRequest):
        splitter = ThinkSplitter(in_reasoning=req.reasoning) if req.reasoning is not None else None
        calls = tool_calls.ToolCallStream(req.tool_format) if req.tool_format is not None else None

        def choice(chunk: Chunk, first: bool) -> dict:
            delta = {"role": "assistant"} if first else {}
            reasoning, content = "", chunk.text
            if splitter is not None:
                reasoning, content = splitter.feed(chunk.text)
                if chunk.finished:
                    tail = splitter.finish()
                    reasoning, content = reasoning + tail[0], content + tail[1]
            if calls is not None:
                content = calls.feed(content) + (calls.finish() if chunk.finished else "")
                new = calls.new_calls()
                if new:
                    delta["tool_calls"] = [call.openai(index) for index, call in new]
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content or not (reasoning or delta.get("tool_calls")):
                delta["content"] = content
            finish_reason = chunk.finish_reason if chunk.finished else None
            if finish_reason == "stop" and calls is not None and calls.calls:
                finish_reason = "tool_calls"
            out = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            if body.logprobs and chunk.logprobs:
                out["logprobs"] = oa.chat_logprobs(chunk.token_ids, chunk.logprobs, body.top_logprobs or 0, self.detok)
            return out

        return self._sse(req, body, "chat", choice, "chat.completion.chunk")

    @api.get("/v1/models")
    async def models(self, request: Request):
        try:
            self.check_auth(request.headers.get("authorization"))
        except oa.APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=getattr(e, "headers", None))
        return {"object": "list", "data": [self._model_card()]}

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "moray", "max_model_len": self.max_model_len}

    @api.get("/health")
    async def health(self):
        status = self.health_status()
        return JSONResponse(status, status_code=200 if status["status"] == "ok" else 503)

    def health_status(self) -> dict:
        decode = self.live_workers("decode")
        prefill = self.live_workers("prefill")
        ok = bool(decode) and (self.config.mode == "colocated" or bool(prefill))
        return {"status": "ok" if ok else "degraded", "decode_workers": len(decode), "prefill_workers": len(prefill)}

    @api.get("/metrics")
    async def metrics_endpoint(self):
        return Response(self.metrics.render(*self.router.registries()), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ gRPC (moray.v1.Moray)

    async def _grpc_prepare(self, request, context) -> PreparedRequest:
        """`request`: the wire bytes (cluster.grpc_service) or a parsed GenerateRequest."""
        metadata = _grpc_metadata(context)
        self.check_auth(metadata.get("authorization"))
        request = self.validator.parse_grpc(request)
        checked = await self.validator.grpc(request)
        return PreparedRequest(
            oa.new_id("grpc"), checked.prompt, checked.params, request.session_id or None, public_id=request.request_id or None
        )

    @staticmethod
    def _grpc_status(context, e: oa.APIError) -> None:
        code = {
            401: grpc.StatusCode.UNAUTHENTICATED,
            404: grpc.StatusCode.NOT_FOUND,
            413: grpc.StatusCode.RESOURCE_EXHAUSTED,
            429: grpc.StatusCode.RESOURCE_EXHAUSTED,  # admission control (orchestrator.Overloaded)
            503: grpc.StatusCode.UNAVAILABLE,
            504: grpc.StatusCode.DEADLINE_EXCEEDED,  # server.request_timeout_s (orchestrator.RequestTimedOut)
        }.get(e.status, grpc.StatusCode.INTERNAL if e.status >= 500 else grpc.StatusCode.INVALID_ARGUMENT)
        if e.status < 500:
            log.info("gRPC request refused (%s): %s", code.name, e.message)
        if context is not None:
            context.set_code(code)
            context.set_details(e.message)

    @staticmethod
    def _pb_logprobs(chunk: Chunk) -> list:
        if not chunk.logprobs:
            return []
        return [moray_pb2.TokenLogprobs(token_id=t, logprob=lp.get(t, 0.0), top=lp) for t, lp in zip(chunk.token_ids, chunk.logprobs)]

    async def Generate(self, request, grpc_context=None):
        # A streaming method reports a status only by raising (Serve carries the status set on the context);
        # `quiet_client_errors` keeps those client errors out of the error logs.
        try:
            req = await self.decide(await self._grpc_prepare(request, grpc_context), _grpc_metadata(grpc_context))
        except oa.APIError as e:
            self._grpc_status(grpc_context, e)
            raise
        try:
            async for chunk in self.run(req, "grpc"):
                msg = moray_pb2.GenerateResponse(
                    request_id=req.client_id,
                    token_ids=chunk.token_ids,
                    text=chunk.text,
                    finished=chunk.finished,
                    finish_reason=chunk.finish_reason or "",
                    logprobs=self._pb_logprobs(chunk),
                )
                if chunk.finished:
                    msg.usage.CopyFrom(
                        moray_pb2.Usage(
                            prompt_tokens=len(req.prompt), completion_tokens=chunk.completion_tokens, cached_tokens=chunk.num_cached_tokens
                        )
                    )
                yield msg
        except Exception as e:  # noqa: BLE001 - a clean status, never a traceback, for the client
            err = self._failure(req, e)
            self._grpc_status(grpc_context, err)
            raise err from None

    async def Complete(self, request, grpc_context=None) -> moray_pb2.CompleteResponse:
        # A unary method returns with the status set on the context: nothing raised, nothing logged by Serve.
        try:
            req = await self.decide(await self._grpc_prepare(request, grpc_context), _grpc_metadata(grpc_context))
        except oa.APIError as e:
            self._grpc_status(grpc_context, e)
            return moray_pb2.CompleteResponse()
        try:
            tokens, text, logprobs, last = await self._collect(req, "grpc")
        except Exception as e:  # noqa: BLE001 - a clean status, never a traceback, for the client
            self._grpc_status(grpc_context, self._failure(req, e))
            return moray_pb2.CompleteResponse()
        return moray_pb2.CompleteResponse(
            request_id=req.client_id,
            token_ids=tokens,
            text=text,
            finish_reason=last.finish_reason or "",
            usage=moray_pb2.Usage(prompt_tokens=len(req.prompt), completion_tokens=len(tokens), cached_tokens=last.num_cached_tokens),
        )

    async def ListModels(self, request: moray_pb2.ListModelsRequest, grpc_context=None) -> moray_pb2.ListModelsResponse:
        card = self._model_card()
        return moray_pb2.ListModelsResponse(
            models=[moray_pb2.ModelInfo(id=card["id"], owned_by="moray", created=card["created"], max_model_len=card["max_model_len"])]
        )

    async def Health(self, request: moray_pb2.HealthRequest, grpc_context=None) -> moray_pb2.HealthResponse:
        s = self.health_status()
        return moray_pb2.HealthResponse(status=s["status"], prefill_workers=s["prefill_workers"], decode_workers=s["decode_workers"])

    # grpc.health.v1.Health/Check
    async def Check(self, request, grpc_context=None):
        from grpc_health.v1 import health_pb2

        serving = self.health_status()["status"] == "ok"
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
