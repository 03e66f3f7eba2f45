"""The protocol front end: OpenAI-compatible HTTP (FastAPI under Serve), the moray.v1 gRPC service, auth, SSE.

It turns bytes into request models and `TokenDelta`s into responses, and nothing else: validation,
tokenising, routing and failover are the request pipeline's (`pipeline.py`), which it calls with a parsed
body and which hands back the request's deltas. Everything a client can get wrong is checked before any
worker is involved: auth here, then the pipeline's one validation layer both protocols share. Errors are
HTTP 4xx with an OpenAI-style body, or gRPC INVALID_ARGUMENT / UNAUTHENTICATED / NOT_FOUND /
RESOURCE_EXHAUSTED with a one-line message. A `ValueError` a worker raises (the engine's own checks, a
second line of defence) is a 400 / INVALID_ARGUMENT too; nothing a client gets carries a traceback.
"""

import asyncio
import gc
import json
import logging
import os
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from protos.moray.v1 import moray_pb2
from workers.messages import TokenDelta

from . import logs, tool_calls, tracing, validation
from . import openai_api as oa
from .config import ClusterConfig, parse_cluster_config
from .direct_ingress import DirectIngress
from .grpc_service import quiet_client_errors
from .pipeline import PreparedRequest, RequestPipeline
from .reasoning import TAGS, ThinkSplitter, split_reasoning

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


def _grpc_metadata(context) -> dict:
    return dict(context.invocation_metadata()) if context is not None else {}


def _channel_id() -> str:
    """(Defined before the class: `serve.ingress` copies the class when it is defined.) What the decode workers know this front-end replica by: its Serve replica id (a fresh id outside
    Serve, e.g. in-process tests)."""
    try:
        return "frontend-" + serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a replica
        return "frontend-" + uuid.uuid4().hex[:8]


class _ChoiceFailed(Exception):
    """One choice's stream failed (carries the request, for the error's mapping, and the cause)."""

    def __init__(self, req: PreparedRequest, error: BaseException):
        super().__init__(str(error))
        self.req, self.error = req, error


@dataclass
class _Collected:
    """One choice's whole output (non-streamed responses)."""

    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    last: TokenDelta | None = None


@serve.deployment
@serve.ingress(api)
class Frontend:
    def __init__(self, cluster_config: dict, prefill_handle, decode_handle, registry_handle):
        self.config: ClusterConfig = parse_cluster_config(cluster_config)
        logs.configure(self.config.observability)
        tracing.configure(self.config.observability, "ingress")
        quiet_client_errors()
        self.api_keys = set(self.config.server.api_keys)
        if self.config.server.api_keys_env:
            self.api_keys |= {k for k in os.environ.get(self.config.server.api_keys_env, "").split(",") if k}
        self.pipeline = RequestPipeline(self.config, prefill_handle, decode_handle, registry_handle, _channel_id())
        self.model_name = self.pipeline.model_name
        self.max_model_len = self.pipeline.max_model_len
        self.created = int(time.time())
        # Startup state (Ray, FastAPI, the tokenizer, a mirrored index) lives as long as the replica: keep
        # it out of the garbage collector's full passes, which would otherwise stall routing decisions.
        gc.collect()
        gc.freeze()
        self.direct = None
        if self.config.server.ingress == "direct":
            self.direct = DirectIngress(self, api, self.config.server)
            self.direct.start()

    def __del__(self):
        # Serve calls this when it stops the replica (scale-down, redeploy, shutdown). Not a coroutine: a
        # front end collected outside Serve (in-process tests) would leave one never awaited.
        if getattr(self, "direct", None) is not None:
            self.direct.close()

    # ------------------------------------------------------------------ shared validation

    def check_auth(self, authorization: str | None) -> None:
        if not self.api_keys:
            return
        if not authorization:
            raise oa.APIError(401, "missing API key: send 'Authorization: Bearer <key>'", "authentication_error", code="invalid_api_key")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in self.api_keys:
            raise oa.APIError(401, "invalid API key", "authentication_error", code="invalid_api_key")

    def detok(self, token: int) -> str:
        return self.pipeline.detok(token)

    # ------------------------------------------------------------------ HTTP

    async def _parse(self, request: Request, model_cls, empty_ok: bool = False):
        """The request's body as `model_cls`, after the API key and size checks (`empty_ok`: no body at all
        means every field's default)."""
        self.check_auth(request.headers.get("authorization"))
        self.pipeline.validator.check_content_length(request.headers.get("content-length"))
        chunks, size = [], 0
        async for chunk in request.stream():  # a body without Content-Length is cut off at the limit too
            size += len(chunk)
            self.pipeline.validator.check_size(size)
            chunks.append(chunk)
        raw = b"".join(chunks)
        return model_cls() if empty_ok and not raw.strip() else validation.parse_request(raw, model_cls)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        try:
            body = await self._parse(request, oa.CompletionRequest)
            reqs = await self.pipeline.decide_all(
                await self.pipeline.prepare_completion(body, request.headers.get("x-session-id")), request.headers
            )
        except oa.APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=getattr(e, "headers", None))
        if body.stream:
            return await self._streaming(self._sse(reqs, body, "completions", self._completion_choice(body), "text_completion"))
        try:
            return JSONResponse(await self._completion_full(reqs, body))
        except _ChoiceFailed as e:
            return self._http_error(e.req, e.error)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        try:
            body = await self._parse(request, oa.ChatCompletionRequest)
            reqs = await self.pipeline.decide_all(
                await self.pipeline.prepare_chat(body, request.headers.get("x-session-id")), request.headers
            )
        except oa.APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=getattr(e, "headers", None))
        if body.stream:
            return await self._streaming(self._sse(reqs, body, "chat", self._chat_choice(body), "chat.completion.chunk"))
        try:
            return JSONResponse(await self._chat_full(reqs, body))
        except _ChoiceFailed as e:
            return self._http_error(e.req, e.error)

    def _http_error(self, req: PreparedRequest, e: BaseException) -> JSONResponse:
        err = self.pipeline.failure(req, e)
        return JSONResponse(err.body(), status_code=err.status, headers=getattr(err, "headers", None))

    async def _streaming(self, events: AsyncIterator[str]):
        """Starts an SSE stream only once its first event is ready: a request a worker refuses (the
        engine's second-line checks) is still an HTTP error, not a 200 with an error event."""
        try:
            first = await anext(events)
        except StopAsyncIteration:
            first = None
        except _ChoiceFailed as e:
            return self._http_error(e.req, e.error)

        async def body():
            try:
                if first is not None:
                    yield first
                    async for event in events:
                        yield event
            finally:
                await events.aclose()

        return StreamingResponse(body(), media_type="text/event-stream")

    async def _deltas(self, reqs: list[PreparedRequest], api_name: str, whole: bool = False):
        """(request, delta) from every choice's stream as they come; a failure is `_ChoiceFailed`."""
        if len(reqs) == 1:
            req = reqs[0]
            try:
                async with aclosing(self.pipeline.run(req, api_name, whole)) as stream:
                    async for delta in stream:
                        yield req, delta
            except Exception as e:  # noqa: BLE001 - mapped by the caller
                raise _ChoiceFailed(req, e) from None
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(req: PreparedRequest) -> None:
            try:
                async with aclosing(self.pipeline.run(req, api_name, whole)) as stream:
                    async for delta in stream:
                        queue.put_nowait((req, delta, None))
                queue.put_nowait((req, None, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((req, None, e))

        tasks = [asyncio.create_task(pump(r)) for r in reqs]
        try:
            running = len(reqs)
            while running:
                req, delta, error = await queue.get()
                if error is not None:
                    raise _ChoiceFailed(req, error)
                if delta is None:
                    running -= 1
                    continue
                yield req, delta
        finally:  # a failed choice, or the client left: the others stop too
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(self, reqs: list[PreparedRequest], api_name: str) -> dict[int, "_Collected"]:
        """Every choice's whole output, by choice index."""
        out = {r.index: _Collected() for r in reqs}
        async for req, chunk in self._deltas(reqs, api_name, whole=True):
            c = out[req.index]
            c.tokens += chunk.token_ids
            c.text.append(chunk.text)
            c.logprobs += chunk.logprobs or []
            if chunk.prompt_logprobs is not None:
                c.prompt_logprobs = chunk.prompt_logprobs
            c.last = chunk
        return out

    @staticmethod
    def _usage(reqs: list[PreparedRequest], n: int, completion_tokens: dict[int, int], cached: dict[int, int]) -> dict:
        """Usage summed over the choices: each prompt's tokens counted once (n samples share it), every
        choice's output."""
        firsts = [r for r in reqs if r.index % n == 0]
        return oa.usage(sum(len(r.prompt) for r in firsts), sum(completion_tokens.values()), sum(cached.get(r.index, 0) for r in firsts))

    def _echo_logprobs(self, req: PreparedRequest, prompt_logprobs, k: int) -> tuple[list[int], list]:
        """The prompt's tokens and their logprob entries (the first has none), for echo with logprobs."""
        entries = oa.prompt_logprob_entries(prompt_logprobs, k)
        return list(req.prompt), entries + [None] * (len(req.prompt) - len(entries))

    async def _completion_full(self, reqs: list[PreparedRequest], body: oa.CompletionRequest) -> dict:
        got = await self._collect(reqs, "completions")
        choices = []
        for r in reqs:
            c = got[r.index]
            tokens, text, logprobs = ([], "", []) if r.score_only else (c.tokens, "".join(c.text), c.logprobs)
            finish = "length" if r.score_only else c.last.finish_reason
            choice = {"index": r.index, "text": (r.echo or "") + text, "finish_reason": finish, "logprobs": None}
            if body.logprobs is not None:
                if r.echo is not None:
                    p_tokens, p_entries = self._echo_logprobs(r, c.prompt_logprobs, body.logprobs)
                    tokens, logprobs = p_tokens + tokens, p_entries + logprobs
                choice["logprobs"] = oa.completion_logprobs([self.detok(t) for t in tokens], logprobs, tokens, self.detok)
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = oa.vllm_prompt_logprobs(c.prompt_logprobs, self.detok)
            self._explain_violation(choice, r, text)
            choices.append(choice)
        generated = {r.index: 0 if r.score_only else len(got[r.index].tokens) for r in reqs}
        cached = {r.index: got[r.index].last.num_cached_tokens for r in reqs}
        return {
            "id": reqs[0].client_id,
            "object": "text_completion",
            "created": oa.created(),
            "model": self.model_name,
            "choices": choices,
            "usage": self._usage(reqs, body.n, generated, cached),
        }

    async def _chat_full(self, reqs: list[PreparedRequest], body: oa.ChatCompletionRequest) -> dict:
        got = await self._collect(reqs, "chat")
        choices = []
        for r in reqs:
            c = got[r.index]
            message = {"role": "assistant", "content": "".join(c.text)}
            finish_reason = c.last.finish_reason
            if r.reasoning is not None:
                message["reasoning_content"], message["content"] = split_reasoning(message["content"], r.reasoning, r.reasoning_tags)
            if r.tool_format is not None:
                content, calls = tool_calls.parse(message["content"], r.tool_format)
                if calls:
                    message["content"] = content.strip() or None
                    message["tool_calls"] = [call.openai() for call in calls]
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            choice = {"index": r.index, "message": message, "finish_reason": finish_reason, "logprobs": None}
            self._explain_violation(choice, r, "".join(c.text))
            if body.logprobs:
                choice["logprobs"] = oa.chat_logprobs(c.tokens, c.logprobs, body.top_logprobs or 0, self.detok)
            choices.append(choice)
        out = {
            "id": reqs[0].client_id,
            "object": "chat.completion",
            "created": oa.created(),
            "model": self.model_name,
            "choices": choices,
            "usage": self._usage(
                reqs,
                body.n,
                {r.index: len(got[r.index].tokens) for r in reqs},
                {r.index: got[r.index].last.num_cached_tokens for r in reqs},
            ),
        }
        if body.prompt_logprobs is not None:  # vLLM: one prompt, so once per response
            out["prompt_logprobs"] = oa.vllm_prompt_logprobs(got[reqs[0].index].prompt_logprobs, self.detok)
        return out

    def _explain_violation(self, choice: dict, req: PreparedRequest, text: str) -> None:
        """finish_reason schema_violation (structured_coerce_one_of let through an output the schema as sent
        refuses): the choice says why."""
        if choice["finish_reason"] == "schema_violation":
            choice["schema_violation"] = self.pipeline.validator.grammars.violation(req.params.structured, text)

    async def _sse(self, reqs: list[PreparedRequest], body, api_name: str, make_choice, obj: str):
        """The SSE events of every choice, interleaved as their tokens come. `make_choice(req)` gives the
        function that turns that choice's deltas into its `choices` entries."""
        created = oa.created()
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous)
        choice_of = {r.index: make_choice(r) for r in reqs}
        generated = {r.index: 0 for r in reqs}
        cached: dict[int, int] = {}
        rid = reqs[0].client_id
        sent = False
        try:
            async for req, chunk in self._deltas(reqs, api_name):
                generated[req.index] = chunk.num_output_tokens
                cached[req.index] = chunk.num_cached_tokens
                event = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice_of[req.index](chunk)]}
                if continuous:
                    event["usage"] = self._usage(reqs, body.n, generated, cached)
                sent = True
                yield f"data: {json.dumps(event)}\n\n"
            if include_usage and sent:
                event = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": self._usage(reqs, body.n, generated, cached),
                }
                yield f"data: {json.dumps(event)}\n\n"
        except _ChoiceFailed as e:  # reported to the client without a traceback
            if not sent:  # nothing sent yet: `_streaming` answers with an HTTP error instead
                raise
            yield f"data: {json.dumps(self.pipeline.failure(e.req, e.error).body())}\n\n"
        yield "data: [DONE]\n\n"

    def _completion_choice(self, body: oa.CompletionRequest):
        def for_request(req: PreparedRequest):
            offset, first = 0, True

            def choice(chunk: TokenDelta) -> dict:
                nonlocal offset, first
                text, tokens, entries = chunk.text, list(chunk.token_ids), list(chunk.logprobs or [])
                if first and req.echo is not None:
                    text = req.echo + text
                    if body.logprobs is not None:
                        p_tokens, p_entries = self._echo_logprobs(req, chunk.prompt_logprobs, body.logprobs)
                        tokens, entries = p_tokens + tokens, p_entries + entries
                out = {
                    "index": req.index,
                    "text": text,
                    "finish_reason": chunk.finish_reason if chunk.finished else None,
                    "logprobs": None,
                }
                if body.logprobs is not None and tokens:
                    strings = [self.detok(t) for t in tokens]
                    out["logprobs"] = oa.completion_logprobs(strings, entries, tokens, self.detok, offset)
                    offset += sum(len(t) for t in strings)
                if first and body.prompt_logprobs is not None:
                    out["prompt_logprobs"] = oa.vllm_prompt_logprobs(chunk.prompt_logprobs, self.detok)
                first = False
                return out

            return choice

        return for_request

    def _chat_choice(self, body: oa.ChatCompletionRequest):
        def for_request(req: PreparedRequest):
            splitter = ThinkSplitter(in_reasoning=req.reasoning, tags=TAGS[req.reasoning_tags]) if req.reasoning is not None else None
            calls = tool_calls.ToolCallStream(req.tool_format) if req.tool_format is not None else None
            first = True

            def choice(chunk: TokenDelta) -> dict:
                nonlocal first
                delta = {"role": "assistant"} if first else {}
                first = False
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
                out = {"index": req.index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
                if body.logprobs and chunk.logprobs:
                    out["logprobs"] = oa.chat_logprobs(chunk.token_ids, chunk.logprobs, body.top_logprobs or 0, self.detok)
                return out

            return choice

        return for_request

    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's /tokenize: a prompt's (or rendered chat's) token ids, the context length, optionally the
        token strings."""
        try:
            body = await self._parse(request, oa.TokenizeRequest)
            tokens = await self.pipeline.validator.tokenize(body)
        except oa.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        strs = [self.detok(t) for t in tokens] if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens, "token_strs": strs}

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        try:
            body = await self._parse(request, oa.DetokenizeRequest)
            return {"prompt": self.pipeline.validator.detokenize(body)}
        except oa.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)

    @api.post("/admin/rebalance_experts")
    async def rebalance_experts(self, request: Request):
        """The manual trigger of expert load balancing (`engine.eplb`) on every live worker; like SGLang's
        EPLB rebalance endpoint. `{"wait": true}` answers once every placement is swapped in. The answer
        says per worker whether it started one (false: balancing off there, or one already under way)."""
        try:
            body = await self._parse(request, oa.RebalanceExpertsRequest, empty_ok=True)
        except oa.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return {"workers": await self.pipeline.rebalance_experts(body.wait)}

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
        status = await self.health_status()
        return JSONResponse(status, status_code=200 if status["status"] == "ok" else 503)

    async def health_status(self) -> dict:
        await self.pipeline.ensure_membership()
        return self.pipeline.health()

    @api.get("/metrics")
    async def metrics_endpoint(self):
        return Response(await self.pipeline.render_metrics(), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ gRPC (moray.v1.Moray)

    async def _grpc_prepare(self, request, context) -> PreparedRequest:
        """`request`: the wire bytes (cluster.grpc_service) or a parsed GenerateRequest."""
        self.check_auth(_grpc_metadata(context).get("authorization"))
        return await self.pipeline.prepare_grpc(request)

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
    def _pb_logprobs(token_ids: list[int], logprobs: list | None) -> list:
        if not logprobs:
            return []
        return [moray_pb2.TokenLogprobs(token_id=t, logprob=lp.get(t, 0.0), top=lp) for t, lp in zip(token_ids, logprobs)]

    @staticmethod
    def _pb_prompt_logprobs(prompt: list[int], prompt_logprobs: list | None) -> list:
        """Prompt tokens 1.. with their logprobs and the top N (position 0 has none)."""
        entries = oa.prompt_logprob_entries(prompt_logprobs, oa.MAX_CHOICES)
        return [moray_pb2.TokenLogprobs(token_id=t, logprob=e[t], top=e) for t, e in zip(prompt, entries) if e is not None]

    async def Generate(self, request, grpc_context=None):
        # A streaming method reports a status only by raising (Serve carries the status set on the context);
        # `quiet_client_errors` keeps those client errors out of the error logs.
        try:
            req = await self.pipeline.decide(await self._grpc_prepare(request, grpc_context), _grpc_metadata(grpc_context))
        except oa.APIError as e:
            self._grpc_status(grpc_context, e)
            raise
        try:
            async for chunk in self.pipeline.run(req, "grpc"):
                msg = moray_pb2.GenerateResponse(
                    request_id=req.client_id,
                    token_ids=chunk.token_ids,
                    text=chunk.text,
                    finished=chunk.finished,
                    finish_reason=chunk.finish_reason or "",
                    logprobs=self._pb_logprobs(chunk.token_ids, chunk.logprobs),
                    prompt_logprobs=self._pb_prompt_logprobs(req.prompt, chunk.prompt_logprobs),
                )
                if chunk.finished:
                    msg.usage.CopyFrom(
                        moray_pb2.Usage(
                            prompt_tokens=len(req.prompt), completion_tokens=chunk.num_output_tokens, cached_tokens=chunk.num_cached_tokens
                        )
                    )
                yield msg
        except Exception as e:  # noqa: BLE001 - a clean status, never a traceback, for the client
            err = self.pipeline.failure(req, e)
            self._grpc_status(grpc_context, err)
            raise err from None

    async def Complete(self, request, grpc_context=None) -> moray_pb2.CompleteResponse:
        # A unary method returns with the status set on the context: nothing raised, nothing logged by Serve.
        try:
            req = await self.pipeline.decide(await self._grpc_prepare(request, grpc_context), _grpc_metadata(grpc_context))
        except oa.APIError as e:
            self._grpc_status(grpc_context, e)
            return moray_pb2.CompleteResponse()
        try:
            got = (await self._collect([req], "grpc"))[req.index]
        except _ChoiceFailed as e:  # a clean status, never a traceback, for the client
            self._grpc_status(grpc_context, self.pipeline.failure(req, e.error))
            return moray_pb2.CompleteResponse()
        last = got.last
        return moray_pb2.CompleteResponse(
            request_id=req.client_id,
            token_ids=got.tokens,
            text="".join(got.text),
            finish_reason=last.finish_reason or "",
            usage=moray_pb2.Usage(prompt_tokens=len(req.prompt), completion_tokens=len(got.tokens), cached_tokens=last.num_cached_tokens),
            logprobs=self._pb_logprobs(got.tokens, got.logprobs),
            prompt_logprobs=self._pb_prompt_logprobs(req.prompt, got.prompt_logprobs),
        )

    async def ListModels(self, request: moray_pb2.ListModelsRequest, grpc_context=None) -> moray_pb2.ListModelsResponse:
        card = self._model_card()
        return moray_pb2.ListModelsResponse(
            models=[moray_pb2.ModelInfo(id=card["id"], owned_by="moray", created=card["created"], max_model_len=card["max_model_len"])]
        )

    async def Health(self, request: moray_pb2.HealthRequest, grpc_context=None) -> moray_pb2.HealthResponse:
        s = await self.health_status()
        return moray_pb2.HealthResponse(status=s["status"], prefill_workers=s["prefill_workers"], decode_workers=s["decode_workers"])

    # grpc.health.v1.Health/Check
    async def Check(self, request, grpc_context=None):
        from grpc_health.v1 import health_pb2

        serving = (await self.health_status())["status"] == "ok"
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
