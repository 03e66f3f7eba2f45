"""The request pipeline: validate, tokenise, route, run with failover; protocol-free.

    front end --body--> prepare_*  (validation.py: strict types, limits, the chat template, tokenising)
              --PreparedRequest--> decide (admission, the router, over the membership view)
              --> run: TokenDeltas (orchestrator.py: remote prefill, the decode channel, failover, timeouts)

The front end (cluster/frontend.py) owns HTTP, gRPC, auth and SSE and calls only this. The pipeline follows
the membership registry's feed (one stream of changes): the membership into this replica's `MembershipView`, and with
the in-memory KV index the index's changes into a local copy the router decides from. It tells the registry
when a call found a worker gone, and records each request's latencies (TTFT, inter-token, end to end) as the
client sees them.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from workers.engine.sampling_params import SamplingParams
from workers.messages import TokenDelta
from workers.models import load_config
from workers.models.tokenizer import Tokenizer

from . import logs, tracing, validation
from . import openai_api as oa
from .channels import DecodeChannels
from .config import ClusterConfig
from .handles import DecodePool, PrefillPool, RegistryClient, detached
from .membership import MembershipView
from .metrics import FrontendMetrics
from .orchestrator import Orchestrator, RequestTrace
from .registry import RegistryFeed
from .router.metrics import RouterMetrics
from .router.router import Router, build_index
from .router.types import NoWorkersAvailable, RouteDecision

log = logging.getLogger("moray.cluster")

FEED_WAIT_S = 1.0  # after the registry failed to answer, try again this much later
FEED_MIN_INTERVAL_S = 0.1  # the registry streams at most 10 changes a second, however many workers report


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
    reasoning: bool | None = None  # see validation.Checked.reasoning
    reasoning_tags: str = "think"  # see validation.Checked.reasoning_tags
    tool_format: str | None = None  # see validation.Checked.tool_format
    index: int = 0  # the choice it answers (prompt i, sample j of n: i * n + j, as OpenAI numbers them)
    echo: str | None = None  # see validation.Checked.echo
    score_only: bool = False  # see validation.Checked.score_only
    stage: str = "ingress"  # where it was when it failed (the orchestrator's RequestTrace.stage)
    span: Any = None  # its front-end span while tracing is on (cluster/tracing.py)

    @property
    def client_id(self) -> str:
        return self.public_id or self.request_id


def _nth_sample(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n samples: its own seed when the request is seeded (so n samples differ, and the same
    request gives the same n), else the same parameters (each engine request draws its own)."""
    if j == 0 or params.seed is None:
        return params
    return params.model_copy(update={"seed": params.seed + j})


def _choices(kind: str, batch: list[validation.Checked], n: int, session: str | None) -> list[PreparedRequest]:
    """The engine requests of one client request: `n` samples of each checked prompt, numbered as OpenAI
    numbers choices (prompt i, sample j: i * n + j), all answering under the first one's id."""
    public = oa.new_id(kind)
    return [
        PreparedRequest(
            f"{public}-{index}" if index else public,
            c.prompt,
            _nth_sample(c.params, index % n),
            session,
            reasoning=c.reasoning,
            reasoning_tags=c.reasoning_tags,
            tool_format=c.tool_format,
            index=index,
            echo=c.echo,
            score_only=c.score_only,
            public_id=public,
        )
        for index, c in enumerate(c for c in batch for _ in range(n))
    ]


class RequestPipeline:
    def __init__(self, config: ClusterConfig, prefill_handle, decode_handle, registry_handle, channel_id: str):
        self.config = config
        engine = config.engine
        self.model_name = engine.model_name
        _, self.model_cfg = load_config(engine.model)
        self.max_model_len = engine.max_model_len or min(self.model_cfg.max_position_embeddings, 4096)
        self.tokenizer = Tokenizer.from_dir(engine.model) if os.path.isfile(os.path.join(engine.model, "tokenizer.json")) else None
        self.validator = validation.RequestValidator(
            model_name=self.model_name,
            vocab_size=self.model_cfg.vocab_size,
            max_model_len=self.max_model_len,
            tokenizer=self.tokenizer,
            max_body_bytes=config.server.max_body_bytes,
            max_prompt_tokens=config.server.max_prompt_tokens,
            tool_call_parser=config.server.tool_call_parser,
            coerce_one_of=engine.structured_coerce_one_of,
        )
        self.metrics = FrontendMetrics(model_name=self.model_name, max_model_len=self.max_model_len)
        self.registry = RegistryClient(registry_handle)
        self.membership = MembershipView()
        memory = config.kv_index.backend == "memory"
        self.feed = RegistryFeed(config.router.heartbeat_ttl_s, config.router.session_ttl_s) if memory else None
        self.router = self._build_router()
        self.membership.on_gone(self.router.metrics.forget_worker)  # a dead worker's router series leave /metrics
        decode = DecodePool(decode_handle, direct=config.stream_transport == "direct")
        self.channels = DecodeChannels(decode, channel_id)  # the channels and the starts share its connections
        self.orchestrator = Orchestrator(
            self.router,
            PrefillPool(prefill_handle) if prefill_handle is not None else None,
            decode,
            self.channels,
            engine.block_size,
            self.model_name,
            config.mode == "colocated",
            server=config.server,
            metrics=self.metrics,  # admission control, timeouts, failover counts
            on_worker_failed=self.worker_failed,
            role_of=self.membership.role,
        )
        self._refresher: asyncio.Task | None = None
        self._first_view: asyncio.Future | None = None  # the one registry call of the first requests (ensure_membership)
        self._cursor = None
        self._cleaned_at = time.monotonic()

    def _build_router(self) -> Router:
        cfg = self.config
        index = self.feed.index if self.feed is not None else build_index(cfg.kv_index, cfg.engine.model_name, cfg.router)
        return Router(
            index,
            cfg.router,
            block_size=cfg.engine.block_size,
            metrics=RouterMetrics(),
            membership=self.membership,
            state_boundaries=self.model_cfg.is_hybrid,
        )

    # ------------------------------------------------------------------ membership

    async def refresh_membership(self, wait_s: float = 0.0) -> None:
        """Takes what changed at the registry (waiting up to `wait_s` for something)."""
        self._apply(await self.registry.changes(self._cursor, wait_s))

    def _apply(self, changes) -> None:
        """The registry's changes: the membership (the router filters every decision through it) and the
        in-memory index's KV events and loads."""
        if self.feed is not None:
            self.feed.apply(changes)
            if time.monotonic() - self._cleaned_at > self.config.router.heartbeat_ttl_s:
                self._cleaned_at = time.monotonic()
                self.router.maintain()  # the entries and metric series of workers gone for a TTL
        self._cursor = changes.cursor
        self.membership.update(changes.membership)
        self.router.refresh_load_gauges()
        self._move_off_draining()

    def _move_off_draining(self) -> None:
        """Streams on a draining decode worker move to another (mid-stream migration), so that the replica
        can stop now; with no other decode worker alive they stay and finish there."""
        if not self.membership.live("decode"):
            return
        for worker in self.membership.draining("decode"):
            self.channels.drain(worker)

    def start_membership_refresh(self) -> None:
        """Follows the registry in the background (called once an event loop runs)."""
        if self._refresher is None or self._refresher.done():
            # A fresh context: started while serving a request, its calls would be that request's children,
            # which Serve cancels when the request ends early.
            self._refresher = asyncio.get_running_loop().create_task(self._follow_forever(), context=contextvars.Context())

    async def _follow_forever(self) -> None:
        warned = False
        while True:
            stream = self.registry.follow(self._cursor, FEED_MIN_INTERVAL_S)
            try:
                async for changes in stream:
                    self._apply(changes)
                    warned = False
            except asyncio.CancelledError:
                stream.cancel()
                if asyncio.current_task().cancelling():
                    raise  # this front end is stopping
            except Exception as e:  # noqa: BLE001 - the registry may be (re)starting: keep the last view
                if not warned:
                    log.warning("the membership registry does not answer: %s", e)
                    warned = True
                await asyncio.sleep(FEED_WAIT_S)

    async def ensure_membership(self) -> None:
        """Starts the view's refresh, and takes a first snapshot now if there is none yet (so /health is
        right from the first probe)."""
        self.start_membership_refresh()
        if self.membership.snapshot.taken_at:
            return
        # Requests arriving together at a fresh front end share one call (not one each on the registry).
        if self._first_view is None or self._first_view.done():
            self._first_view = asyncio.get_running_loop().create_task(self.refresh_membership(), context=contextvars.Context())
            self._first_view.add_done_callback(lambda t: t.cancelled() or t.exception())  # read even if every waiter left
        try:
            await asyncio.shield(self._first_view)  # one request leaving does not cancel the others' call
        except Exception:  # noqa: BLE001 - not yet: the refresh keeps trying
            pass

    def worker_failed(self, worker: str) -> None:
        """A call found `worker` gone: route around it here at once, and tell the registry."""
        at = time.time()
        if self.membership.mark_failed(worker, at):
            log.warning("worker %s failed: dropped from routing and /health", worker)
            self.router.metrics.worker_failures.inc()
            detached(lambda: self.registry.worker_failed(worker, at))

    async def rebalance_experts(self, wait: bool) -> dict[str, bool | str]:
        """Every live worker's expert rebalance (the manual trigger of `engine.eplb`): worker -> whether it
        started one (False: balancing off there, or one under way), or the error that worker answered."""
        await self.ensure_membership()
        pools = [(w, self.orchestrator.decode) for w in self.membership.live("decode")]
        if self.orchestrator.prefill is not None:
            pools += [(w, self.orchestrator.prefill) for w in self.membership.live("prefill")]
        results = await asyncio.gather(*(pool.rebalance_experts(w, wait) for w, pool in pools), return_exceptions=True)
        return {w: r if isinstance(r, bool) else f"{type(r).__name__}: {r}" for (w, _), r in zip(pools, results)}

    def health(self) -> dict:
        decode = self.membership.live("decode")
        prefill = self.membership.live("prefill")
        ok = bool(decode) and (self.config.mode == "colocated" or bool(prefill))
        return {"status": "ok" if ok else "degraded", "decode_workers": len(decode), "prefill_workers": len(prefill)}

    async def render_metrics(self) -> bytes:
        try:
            workers = await asyncio.wait_for(self.registry.metrics(), 5)
        except Exception:  # noqa: BLE001 - the registry is (re)starting: this scrape has no worker series
            workers = b""
        self.router.refresh_load_gauges()
        return self.metrics.render(self.router.metrics.registry, workers)

    # ------------------------------------------------------------------ validation and tokenising

    async def prepare_completion(self, body: oa.CompletionRequest, session: str | None) -> list[PreparedRequest]:
        """One engine request per choice: per prompt of the batch, `n` samples."""
        batch = await self.validator.completion(body)
        if len(batch) * body.n > oa.MAX_CHOICES:
            raise oa.APIError(400, f"{len(batch)} prompts x n={body.n} is more than {oa.MAX_CHOICES} choices", param="n")
        return _choices("cmpl", batch, body.n, session or body.user)

    async def prepare_chat(self, body: oa.ChatCompletionRequest, session: str | None) -> list[PreparedRequest]:
        """One engine request per choice (`n`)."""
        return _choices("chatcmpl", [await self.validator.chat(body)], body.n, session or body.user)

    async def prepare_grpc(self, request) -> PreparedRequest:
        """`request`: the wire bytes (cluster.grpc_service) or a parsed GenerateRequest."""
        request = self.validator.parse_grpc(request)
        checked = await self.validator.grpc(request)
        return PreparedRequest(
            oa.new_id("grpc"), checked.prompt, checked.params, request.session_id or None, public_id=request.request_id or None
        )

    # ------------------------------------------------------------------ running

    async def decide_all(self, reqs: list[PreparedRequest], carrier=None) -> list[PreparedRequest]:
        """`decide` for each choice of one client request; if one is refused, the ones admitted before it
        are let go and the refusal is the answer."""
        done: list[PreparedRequest] = []
        try:
            for r in reqs:
                done.append(await self.decide(r, carrier))
        except BaseException:
            for r in done:
                self.orchestrator.release(r.request_id)
                tracing.end_span(r.span)
            raise
        return done

    async def decide(self, req: PreparedRequest, carrier=None) -> PreparedRequest:
        """Admits and routes the request; its front-end span starts here (`carrier`: HTTP headers or gRPC
        metadata, which may hold the client's traceparent) and ends in `run`."""
        # A front end's first request (a new or restarted replica, or one of several that a health check never
        # reached) waits for the registry's view, not a 503 for want of one; later ones return at once.
        await self.ensure_membership()
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

    async def run(self, req: PreparedRequest, api_name: str, whole: bool = False) -> AsyncIterator[TokenDelta]:
        """The request's deltas (the last one has `finish_reason`); errors are `APIError`s or a worker's
        `ValueError` (both mapped by `failure`). `whole`: for a response sent only at the end (non-streamed):
        the first delta, then the rest as one (its inter-token latency is then the mean over those tokens)."""
        trace = RequestTrace(span=req.span)
        outcome = "error"
        failure = None
        tokens = 0
        queue_s = None  # the engine's wait before the request's first step (its first delta says)
        last_at = None  # when the previous delta with tokens arrived (inter-token latency)
        try:
            stream = self.orchestrator.stream(req.request_id, req.prompt, req.params, req.decision, trace, req.session_id, whole)
            async for delta in stream:
                if queue_s is None:
                    queue_s = delta.queue_s
                if delta.num_output_tokens > tokens:
                    now = time.perf_counter()
                    if last_at is not None:
                        self.metrics.observe_token_gap(now - last_at, delta.num_output_tokens - tokens)
                    last_at = now
                tokens = delta.num_output_tokens
                if delta.finished:
                    outcome = delta.finish_reason
                    self.metrics.cached_tokens.inc(delta.num_cached_tokens)
                    self.router.record_reuse(delta.num_cached_tokens)
                yield delta
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            outcome = "cancelled" if outcome == "error" else outcome
            raise
        except Exception as e:
            failure = e
            raise
        finally:
            req.stage = trace.stage
            self._record(trace, api_name, outcome, len(req.prompt), tokens, queue_s, req.params.max_tokens)
            tracing.end_span(req.span, {"moray.api": api_name, "moray.outcome": outcome, "moray.completion_tokens": tokens}, error=failure)

    def _record(
        self, trace: RequestTrace, api_name: str, outcome: str, prompt_tokens: int, tokens: int, queue_s=None, max_tokens=None
    ) -> None:
        path = "disaggregated" if trace.remote_prefill else "local"
        end = trace.end or time.perf_counter()
        self.metrics.observe_request(
            api_name, outcome, prompt_tokens, tokens, trace.start, trace.first_token, end, path, queue_s, max_tokens
        )

    def failure(self, req: PreparedRequest, e: BaseException) -> oa.APIError:
        """What a client is told about a request that failed after validation (never a traceback). Our own
        failures (5xx: a worker failed, a timeout, an internal error) are logged at ERROR with the request id
        and stage, which `moray serve` shows on its console; a client's mistakes only at INFO."""
        err = validation.client_error(e)
        context = {"request_id": req.request_id, "stage": req.stage, "client_request_id": req.public_id}
        if err is not None:  # a worker's ValueError, or an APIError (e.g. the orchestrator's 429/503/504)
            level = logging.INFO if err.status < 500 else logging.ERROR
            detail = f" ({err.detail})" if getattr(err, "detail", "") else ""
            log.log(
                level, "request %s failed during %s: %s %s%s", req.request_id, req.stage, err.status, err.message, detail, extra=context
            )
            return err
        log.error(
            "request %s failed during %s: internal error: %s: %s", req.request_id, req.stage, type(e).__name__, e, exc_info=e, extra=context
        )
        return oa.APIError(500, f"internal error: {type(e).__name__}", "server_error")

    def detok(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else str(token)

    def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        self.channels.close()
