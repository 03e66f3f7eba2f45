"""The front end: OpenAI-compatible HTTP (FastAPI under Serve) and the moray.v1 gRPC service.

Everything a client can get wrong is checked here, before any worker is involved: auth, body size,
JSON, types, model name, chat messages, prompt length, token ids, sampling parameters. Errors are
HTTP 4xx with an OpenAI-style body, or gRPC INVALID_ARGUMENT / UNAUTHENTICATED / NOT_FOUND.
"""


import gc
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from protos.moray.v1 import moray_pb2
from workers.engine.kv_events import KVEvent
from workers.engine.sampling_params import SamplingParams
from workers.models import load_config
from workers.models.tokenizer import Tokenizer

from . import openai_api as oa
from .config import ClusterConfig, parse_cluster_config
from .metrics import FrontendMetrics
from .orchestrator import Chunk, Orchestrator, RequestTrace
from .router.types import RouteDecision
from .routing import NoWorkersAvailable, build_router

log = logging.getLogger("moray.cluster")

api = FastAPI(title="Moray", docs_url=None, redoc_url=None)


@dataclass
class PreparedRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    session_id: str | None
    decision: RouteDecision | None = None


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
        self.metrics = FrontendMetrics()
        self.router = build_router(self.config)
        colocated = self.config.mode == "colocated"
        self.orchestrator = Orchestrator(
            self.router, prefill_handle, decode_handle, engine.block_size, self.model_name, colocated
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
        return [w for w, l in self.workers.items() if l["role"] == role and l["reported_at"] >= horizon and l["healthy"]]

    # ------------------------------------------------------------------ shared validation

    def check_auth(self, authorization: str | None) -> None:
        if not self.api_keys:
            return
        if not authorization:
            raise oa.APIError(401, "missing API key: send 'Authorization: Bearer <key>'", "authentication_error", code="invalid_api_key")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in self.api_keys:
            raise oa.APIError(401, "invalid API key", "authentication_error", code="invalid_api_key")

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise oa.APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'", param="model", code="model_not_found")

    def check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise oa.APIError(400, "the prompt is empty", param="prompt")
        limit = self.max_model_len - 1
        if self.config.server.max_prompt_tokens:
            limit = min(limit, self.config.server.max_prompt_tokens)
        if len(prompt) > limit:
            raise oa.APIError(400, f"the prompt has {len(prompt)} tokens; the limit is {limit}", param="prompt", code="context_length_exceeded")
        bad = next((t for t in prompt if not 0 <= t < self.model_cfg.vocab_size), None)
        if bad is not None:
            raise oa.APIError(400, f"token id {bad} is outside the vocabulary [0, {self.model_cfg.vocab_size})", param="prompt")

    def encode_text(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise oa.APIError(400, "this model has no tokenizer: send token ids", param="prompt")
        return self.tokenizer.encode(text)

    def sampling(self, body: oa._Common, logprobs: int | None, max_tokens: int | None) -> SamplingParams:
        try:
            return body.sampling_params(logprobs, max_tokens, default_max_tokens=16)
        except ValueError as e:
            raise oa.APIError(400, str(e)) from None

    def prepare_completion(self, body: oa.CompletionRequest, session: str | None) -> PreparedRequest:
        self.check_model(body.model)
        if body.echo:
            raise oa.APIError(400, "echo is not supported", param="echo")
        prompt = self.encode_text(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        self.check_prompt(prompt)
        params = self.sampling(body, body.logprobs, body.max_tokens)
        return PreparedRequest(oa.new_id("cmpl"), prompt, params, session or body.user)

    def prepare_chat(self, body: oa.ChatCompletionRequest, session: str | None) -> PreparedRequest:
        self.check_model(body.model)
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise oa.APIError(400, "this model has no chat template: use /v1/completions")
        try:
            prompt = self.tokenizer.apply_chat_template(body.template_messages(), add_generation_prompt=body.add_generation_prompt, tokenize=True)
        except ValueError as e:
            raise oa.APIError(400, f"messages: {e}", param="messages") from None
        self.check_prompt(prompt)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self.sampling(body, logprobs, body.max_completion_tokens or body.max_tokens)
        return PreparedRequest(oa.new_id("chatcmpl"), prompt, params, session or body.user)

    # ------------------------------------------------------------------ running a request

    async def decide(self, req: PreparedRequest) -> PreparedRequest:
        try:
            req.decision = await self.orchestrator.route(req.request_id, req.prompt, req.session_id)
        except NoWorkersAvailable:
            raise oa.APIError(503, "no worker is ready yet; retry shortly", "service_unavailable") from None
        return req

    async def run(self, req: PreparedRequest, api_name: str) -> AsyncIterator[Chunk]:
        trace = RequestTrace()
        outcome = "error"
        tokens = 0
        try:
            async for chunk in self.orchestrator.stream(req.request_id, req.prompt, req.params, req.decision, trace):
                tokens = chunk.completion_tokens
                if chunk.finished:
                    outcome = chunk.finish_reason or "stop"
                    self.metrics.cached_tokens.inc(chunk.num_cached_tokens)
                    self.router.record_reuse(chunk.num_cached_tokens)
                yield chunk
        except BaseException:
            outcome = "cancelled" if outcome == "error" else outcome
            raise
        finally:
            self.record(trace, api_name, outcome, len(req.prompt), tokens)

    def record(self, trace: RequestTrace, api_name: str, outcome: str, prompt_tokens: int, tokens: int) -> None:
        end = trace.end or time.perf_counter()
        self.metrics.requests.labels(api_name, outcome).inc()
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(tokens)
        if trace.first_token is not None:
            self.metrics.ttft.labels("disaggregated" if trace.remote_prefill else "local").observe(trace.first_token - trace.start)
            if tokens > 1:
                self.metrics.tpot.observe((end - trace.first_token) / (tokens - 1))
        self.metrics.e2e.observe(end - trace.start)

    def detok(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else str(token)

    # ------------------------------------------------------------------ HTTP

    async def _parse(self, request: Request, model_cls):
        self.check_auth(request.headers.get("authorization"))
        length = request.headers.get("content-length")
        limit = self.config.server.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            raise oa.APIError(413, f"request body is larger than {limit} bytes")
        raw = await request.body()
        if len(raw) > limit:
            raise oa.APIError(413, f"request body is larger than {limit} bytes")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise oa.APIError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise oa.APIError(400, "the body must be a JSON object")
        try:
            return model_cls.model_validate(data)
        except ValidationError as e:
            raise oa.validation_error(e) from None

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        try:
            body = await self._parse(request, oa.CompletionRequest)
            req = await self.decide(self.prepare_completion(body, request.headers.get("x-session-id")))
        except oa.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        if body.stream:
            return StreamingResponse(self._completion_sse(req, body), media_type="text/event-stream")
        return JSONResponse(await self._completion_full(req, body))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        try:
            body = await self._parse(request, oa.ChatCompletionRequest)
            req = await self.decide(self.prepare_chat(body, request.headers.get("x-session-id")))
        except oa.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        if body.stream:
            return StreamingResponse(self._chat_sse(req, body), media_type="text/event-stream")
        return JSONResponse(await self._chat_full(req, body))

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
            "id": req.request_id, "object": "text_completion", "created": oa.created(), "model": self.model_name,
            "choices": [choice], "usage": oa.usage(len(req.prompt), len(tokens), last.num_cached_tokens),
        }

    async def _chat_full(self, req: PreparedRequest, body: oa.ChatCompletionRequest) -> dict:
        tokens, text, logprobs, last = await self._collect(req, "chat")
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": last.finish_reason, "logprobs": None}
        if body.logprobs:
            choice["logprobs"] = oa.chat_logprobs(tokens, logprobs, body.top_logprobs or 0, self.detok)
        return {
            "id": req.request_id, "object": "chat.completion", "created": oa.created(), "model": self.model_name,
            "choices": [choice], "usage": oa.usage(len(req.prompt), len(tokens), last.num_cached_tokens),
        }

    async def _sse(self, req: PreparedRequest, body, api_name: str, make_choice, obj: str):
        created = oa.created()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        last = None
        try:
            first = True
            async for chunk in self.run(req, api_name):
                last = chunk
                event = {"id": req.request_id, "object": obj, "created": created, "model": self.model_name,
                         "choices": [make_choice(chunk, first)]}
                first = False
                yield f"data: {json.dumps(event)}\n\n"
            if include_usage and last is not None:
                event = {"id": req.request_id, "object": obj, "created": created, "model": self.model_name, "choices": [],
                         "usage": oa.usage(len(req.prompt), last.completion_tokens, last.num_cached_tokens)}
                yield f"data: {json.dumps(event)}\n\n"
        except oa.APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            log.exception("stream %s failed", req.request_id)
            yield f"data: {json.dumps(oa.APIError(500, f'internal error: {type(e).__name__}', 'server_error').body())}\n\n"
        yield "data: [DONE]\n\n"

    def _completion_sse(self, req: PreparedRequest, body: oa.CompletionRequest):
        def choice(chunk: Chunk, first: bool) -> dict:
            out = {"index": 0, "text": chunk.text, "finish_reason": chunk.finish_reason if chunk.finished else None, "logprobs": None}
            if body.logprobs is not None and chunk.logprobs:
                out["logprobs"] = oa.completion_logprobs([self.detok(t) for t in chunk.token_ids], chunk.logprobs, chunk.token_ids, self.detok)
            return out

        return self._sse(req, body, "completions", choice, "text_completion")

    def _chat_sse(self, req: PreparedRequest, body: oa.ChatCompletionRequest):
        def choice(chunk: Chunk, first: bool) -> dict:
            delta = {"role": "assistant", "content": chunk.text} if first else {"content": chunk.text}
            out = {"index": 0, "delta": delta, "finish_reason": chunk.finish_reason if chunk.finished else None, "logprobs": None}
            if body.logprobs and chunk.logprobs:
                out["logprobs"] = oa.chat_logprobs(chunk.token_ids, chunk.logprobs, body.top_logprobs or 0, self.detok)
            return out

        return self._sse(req, body, "chat", choice, "chat.completion.chunk")

    @api.get("/v1/models")
    async def models(self, request: Request):
        try:
            self.check_auth(request.headers.get("authorization"))
        except oa.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
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

    def _grpc_prepare(self, request: moray_pb2.GenerateRequest, context) -> PreparedRequest:
        metadata = dict(context.invocation_metadata()) if context is not None else {}
        self.check_auth(metadata.get("authorization"))
        if request.model:
            self.check_model(request.model)
        kind = request.WhichOneof("input")
        if kind == "prompt":
            prompt = self.encode_text(request.prompt)
        elif kind == "token_ids":
            prompt = list(request.token_ids.ids)
        elif kind == "messages":
            if self.tokenizer is None or self.tokenizer.chat_template is None:
                raise oa.APIError(400, "this model has no chat template")
            try:
                prompt = self.tokenizer.apply_chat_template(
                    [{"role": m.role, "content": m.content} for m in request.messages.messages], tokenize=True
                )
            except ValueError as e:
                raise oa.APIError(400, f"messages: {e}") from None
        else:
            raise oa.APIError(400, "one of prompt, token_ids or messages is required")
        self.check_prompt(prompt)
        s = request.sampling
        fields = {name: getattr(s, name) for name in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty") if s.HasField(name)}
        try:
            params = SamplingParams(stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, **fields)
        except ValueError as e:
            raise oa.APIError(400, str(e)) from None
        return PreparedRequest(request.request_id or oa.new_id("grpc"), prompt, params, request.session_id or None)

    @staticmethod
    def _grpc_fail(context, e: oa.APIError) -> None:
        """Sets the status on the context and re-raises: Serve keeps a status set before an exception."""
        code = {
            401: grpc.StatusCode.UNAUTHENTICATED,
            404: grpc.StatusCode.NOT_FOUND,
            503: grpc.StatusCode.UNAVAILABLE,
        }.get(e.status, grpc.StatusCode.INVALID_ARGUMENT)
        context.set_code(code)
        context.set_details(e.message)
        raise e

    @staticmethod
    def _pb_logprobs(chunk: Chunk) -> list:
        if not chunk.logprobs:
            return []
        return [moray_pb2.TokenLogprobs(token_id=t, logprob=lp.get(t, 0.0), top=lp) for t, lp in zip(chunk.token_ids, chunk.logprobs)]

    async def Generate(self, request: moray_pb2.GenerateRequest, grpc_context=None):
        try:
            req = await self.decide(self._grpc_prepare(request, grpc_context))
        except oa.APIError as e:
            self._grpc_fail(grpc_context, e)
            return
        async for chunk in self.run(req, "grpc"):
            msg = moray_pb2.GenerateResponse(
                request_id=req.request_id, token_ids=chunk.token_ids, text=chunk.text, finished=chunk.finished,
                finish_reason=chunk.finish_reason or "", logprobs=self._pb_logprobs(chunk),
            )
            if chunk.finished:
                msg.usage.CopyFrom(moray_pb2.Usage(prompt_tokens=len(req.prompt), completion_tokens=chunk.completion_tokens, cached_tokens=chunk.num_cached_tokens))
            yield msg

    async def Complete(self, request: moray_pb2.GenerateRequest, grpc_context=None) -> moray_pb2.CompleteResponse:
        try:
            req = await self.decide(self._grpc_prepare(request, grpc_context))
        except oa.APIError as e:
            self._grpc_fail(grpc_context, e)
            return moray_pb2.CompleteResponse()
        tokens, text, logprobs, last = await self._collect(req, "grpc")
        return moray_pb2.CompleteResponse(
            request_id=req.request_id, token_ids=tokens, text=text, finish_reason=last.finish_reason or "",
            usage=moray_pb2.Usage(prompt_tokens=len(req.prompt), completion_tokens=len(tokens), cached_tokens=last.num_cached_tokens),
        )

    async def ListModels(self, request: moray_pb2.ListModelsRequest, grpc_context=None) -> moray_pb2.ListModelsResponse:
        card = self._model_card()
        return moray_pb2.ListModelsResponse(models=[moray_pb2.ModelInfo(id=card["id"], owned_by="moray", created=card["created"], max_model_len=card["max_model_len"])])

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
