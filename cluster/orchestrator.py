"""One request's path through the cluster: admit -> route -> (remote prefill -> KV handoff) -> decode -> stream.

The request pipeline's (cluster/pipeline.py) execution half, protocol-free: it yields the request's
`TokenDelta`s, which the front end formats. Its errors are `APIError`s (an HTTP status the gRPC side maps to
a code, and a one-line message), so both protocols report them like any other.

Admission: `route` admits a request only while fewer than `server.max_queued_requests` admitted requests
of this front-end replica wait for their first token; beyond that it raises `Overloaded` (429 with
Retry-After / RESOURCE_EXHAUSTED) instead of letting every request's latency grow.

Timeouts: a request still running `server.request_timeout_s` after it started is aborted (the worker
calls are cancelled or the decode worker told to abort, which frees their KV) and ends with
`RequestTimedOut` (504 / DEADLINE_EXCEEDED); if tokens went out already, after a final delta with
finish_reason "timeout". The Serve HTTP proxy has the same limit end to end, so the pipeline acts
`_PROXY_MARGIN_S` earlier: the client gets this clear error rather than the proxy's bare 408.

Worker failures (its actor died, its engine stopped, its channel broke): the membership view drops the
worker at once and the registry hears of it. A request that has sent the client nothing yet is routed again
without it and rerun (at most `MAX_ATTEMPTS` workers); after a remote prefill whose first token went out,
only the decode side is retried, with the same handoff (the new decode worker fetches the KV the prefill
worker published, or recomputes the prompt when that is gone). A stream whose decode tokens went out
*migrates*: it is sent to another decode worker with every output token the client has (`DecodeRequest.
resume`), which recomputes prompt + those tokens and continues after them: the client sees one unbroken
stream, nothing twice (greedy and seeded output equal an uninterrupted run). After `server.max_migrations`
moves it ends with a final delta (finish_reason "error") and `WorkerFailed`. A decode worker that drains
(Serve stops its replica: scale-down, redeploy) hands its streams over the same way, while moves remain
(counted as migrations too); the worker is not failed, and streams that may not move finish where they are.

Held KV: when a stream ends early after a remote prefill (client gone, failure, timeout), the prefill
worker is told to release the KV it holds for the handoff at once (idempotent), whatever stage the
decode side reached.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable

from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError

from workers.engine.async_engine import EngineDeadError
from workers.engine.block_hash import block_hashes
from workers.engine.sampling_params import SamplingParams
from workers.messages import DecodeRequest, PrefillHandoff, PrefillRequest, TokenDelta
from workers.outbox import ChannelClosed

from . import tracing
from .channels import ChannelFailed, ChannelIdleClosed, DecodeChannels, Draining
from .direct_stream import ConnectionLost
from .handles import DecodePool, PrefillPool, WrongReplica, detached
from .openai_api import APIError
from .router.types import NoWorkersAvailable, RouteDecision, RouteRequest

log = logging.getLogger("moray.cluster")

MAX_ATTEMPTS = 3  # workers a request is tried on when they fail under it
OVERLOAD_RETRY_AFTER_S = 1
_PROXY_MARGIN_S = 0.5  # at most; 5% of short limits
_REOPENS = 3  # a channel that closed (idle) just as a request started on it is opened again, this often


@dataclass
class RequestTrace:
    """Timings and routing of one request, for metrics."""

    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    end: float | None = None
    decision: RouteDecision | None = None
    remote_prefill: bool = False
    attempts: int = 0  # workers tried (more than one after a failover)
    stage: str = "route"  # where the request is: route, prefill, decode (named when it fails)
    span: Any = None  # the request's front-end span (cluster.tracing), parent of the router and worker spans


class Overloaded(APIError):
    """Admission control refused the request: too many are waiting for their first token."""

    def __init__(self, message: str, retry_after_s: int = OVERLOAD_RETRY_AFTER_S):
        super().__init__(429, message, "rate_limit_error", code="overloaded")
        self.retry_after_s = retry_after_s
        self.headers = {"Retry-After": str(retry_after_s)}

    def __reduce__(self):
        return (Overloaded, (self.message, self.retry_after_s))


class RequestTimedOut(APIError):
    """The request ran past `server.request_timeout_s`; it was aborted and its KV freed."""

    def __init__(self, message: str):
        super().__init__(504, message, "timeout_error", code="request_timeout")

    def __reduce__(self):
        return (RequestTimedOut, (self.message,))


class WorkerFailed(APIError):
    """The worker serving the request failed after tokens went out, or no live worker was left to retry on.
    `detail` (the cause as the worker reported it) is logged, never sent to the client."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(503, message, "server_error", code="worker_failed")
        self.detail = detail

    def __reduce__(self):
        return (WorkerFailed, (self.message, self.detail))


def worker_gone(e: BaseException) -> bool:
    """Whether a call failed because the worker is gone (so another worker may serve the request)."""
    return isinstance(e, (RayActorError, EngineDeadError, ReplicaUnavailableError, WrongReplica, ChannelFailed, ConnectionLost))


class WorkerDraining(Exception):
    """The decode worker drains: the request moves to another one."""


class _Failure(Exception):
    def __init__(self, worker: str, stage: str, cause: BaseException):
        if isinstance(cause, ChannelFailed):  # the channel is the messenger: name what broke it
            cause = cause.cause
        super().__init__(f"{stage} worker {worker} failed: {type(cause).__name__}")
        self.worker, self.stage, self.cause = worker, stage, cause
        self.drained = isinstance(cause, WorkerDraining)  # not a failure: the worker is being stopped
        # The worker answered: it closed the channel as idle, so it no longer runs the request, but it is
        # alive. Marking it failed took the only decode worker out of routing and /health (a full run's
        # fuzz test: every request after such a loss got a 503 for a heartbeat's time).
        self.worker_alive = isinstance(cause, ChannelIdleClosed)

    @property
    def detail(self) -> str:
        return f"{type(self.cause).__name__}: {self.cause}"


class Orchestrator:
    def __init__(
        self,
        router,
        prefill: PrefillPool | None,
        decode: DecodePool,
        channels: DecodeChannels,
        block_size: int,
        model_name: str,
        colocated: bool,
        *,
        server=None,  # cluster.config.ServerConfig: request_timeout_s, max_queued_requests
        metrics=None,  # cluster.metrics.FrontendMetrics
        on_worker_failed: Callable[[str], None] | None = None,
        role_of: Callable[[str], str | None] | None = None,
    ):
        self.router = router
        self.prefill = prefill
        self.decode = decode
        self.channels = channels
        self.block_size = block_size
        self.model_name = model_name
        self.colocated = colocated
        self.request_timeout_s: float | None = getattr(server, "request_timeout_s", None)
        self.max_queued_requests: int = getattr(server, "max_queued_requests", 0) or 0
        self.max_migrations: int = getattr(server, "max_migrations", 0) or 0
        self.metrics = metrics
        self.on_worker_failed = on_worker_failed or (lambda worker: None)
        self.role_of = role_of or (lambda worker: None)
        self._queued: dict[str, float] = {}  # admitted request -> when (monotonic); until its first token
        # Routed requests without a first token: their speculative index entries are kept alive meanwhile.
        self._unstarted: dict[str, tuple[RouteRequest, RouteDecision]] = {}
        self._renewer: asyncio.Task | None = None

    # ------------------------------------------------------------------ admission and routing

    @property
    def queued(self) -> int:
        """Requests admitted here that have no first token yet."""
        return len(self._queued)

    def _admit(self, request_id: str) -> None:
        now = time.monotonic()
        if self.request_timeout_s and self._queued:
            # Entries of requests that never streamed (their caller failed in between) cannot outlive a timeout.
            stale = now - self.request_timeout_s - 1.0
            while self._queued and next(iter(self._queued.values())) < stale:
                del self._queued[next(iter(self._queued))]
        if self.max_queued_requests and len(self._queued) >= self.max_queued_requests:
            if self.metrics is not None:
                self.metrics.rejected.labels("overloaded").inc()
            raise Overloaded(
                f"the server is overloaded: {len(self._queued)} requests are waiting for their first token "
                f"(server.max_queued_requests); retry after {OVERLOAD_RETRY_AFTER_S}s"
            )
        self._queued[request_id] = now
        self._observe_queue()

    def release(self, request_id: str) -> None:
        """An admitted request that will not be run (another choice of its client request was refused)."""
        self._started(request_id)

    def _started(self, request_id: str) -> None:
        self._unstarted.pop(request_id, None)
        if self._queued.pop(request_id, None) is not None:
            self._observe_queue()

    def _hold_speculative(self, request: RouteRequest, decision: RouteDecision) -> None:
        """Until the request's first token (its prefill is done and the worker's KV events are on their
        way), its speculative entries are renewed: a request queued on a busy worker keeps attracting the
        requests that share its prefix to that worker."""
        every = self.router.config.speculative_ttl_s / 2  # half their lifetime: they never lapse in between
        if not every:
            return
        self._unstarted[request.request_id] = (request, decision)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_speculative(every), context=contextvars.Context())

    async def _renew_speculative(self, every: float) -> None:
        while self._unstarted:
            await asyncio.sleep(every)
            stale = time.monotonic() - (self.request_timeout_s or 600.0) - 1.0
            for request_id, (request, decision) in list(self._unstarted.items()):
                since = self._queued.get(request_id)
                if since is None or since < stale:  # started or gone without a word, or never streamed
                    self._unstarted.pop(request_id, None)
                    continue
                try:
                    self.router.renew_speculative(request, decision)
                except Exception:  # noqa: BLE001 - best effort: the entries only lapse early
                    log.debug("renewing speculative entries of %s failed", request_id, exc_info=True)

    def _observe_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.queued.set(len(self._queued))

    async def route(self, request_id: str, prompt: list[int], session_id: str | None, span=None) -> RouteDecision:
        """Admits the request (raises `Overloaded`) and routes it (raises `NoWorkersAvailable` when no
        worker has registered yet). An admitted request must be run with `stream`. `span`: the request's
        front-end span, parent of the router span."""
        self._admit(request_id)
        try:
            return await self._route(request_id, prompt, session_id, span)
        except BaseException:
            self._started(request_id)
            raise

    async def _route(self, request_id: str, prompt: list[int], session_id: str | None, span=None) -> RouteDecision:
        with tracing.span("router", span, {"moray.request_id": request_id}) as router_span:
            hashes = block_hashes(prompt, self.block_size, self.model_name)
            route_request = RouteRequest(request_id, hashes, len(prompt), session_id)
            decision = await self.router.aroute(route_request)
            if self.colocated and decision.prefill_worker is not None:
                decision = replace(decision, prefill_worker=None)
            if request_id in self._queued:
                self._hold_speculative(route_request, decision)
            tracing.set_attributes(router_span, tracing.decision_attributes(decision))
        return decision

    # ------------------------------------------------------------------ running

    def _deadline(self, trace: RequestTrace) -> float | None:
        """The loop time at which the request is aborted, or None without a limit."""
        if not self.request_timeout_s:
            return None
        budget = self.request_timeout_s - min(_PROXY_MARGIN_S, 0.05 * self.request_timeout_s)
        return asyncio.get_running_loop().time() + budget - (time.perf_counter() - trace.start)

    async def stream(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        decision: RouteDecision,
        trace: RequestTrace,
        session_id: str | None = None,
        whole: bool = False,
    ) -> AsyncIterator[TokenDelta]:
        """Runs the request on the decided workers and yields its deltas; `session_id` (the conversation)
        goes to the workers, whose caches keep a live session's blocks longest. `whole`: the caller wants
        the output only at the end (non-streamed): after the first token, the rest comes as one delta."""
        deadline = self._deadline(trace)
        handoff: PrefillHandoff | None = None  # the remote prefill's answer once its first token went out
        sent_decode = 0  # deltas from the decode side that went out (they cannot be taken back)
        generated: list[int] = []  # every output token that went out: a migrated request resumes after them
        migrations = 0
        last: TokenDelta | None = None
        finished = False  # the last delta (finish_reason set) went out
        completed = False  # ... because the request ran to its end (the workers let go of the KV themselves)
        stage = "route"
        try:
            while True:
                trace.attempts += 1
                trace.decision = decision
                try:
                    if handoff is None and decision.prefill_worker is not None:
                        stage = trace.stage = "prefill"
                        trace.remote_prefill = True
                        result = await self._prefill(request_id, prompt, params, decision, deadline, session_id, trace.span)
                        trace.first_token = time.perf_counter()
                        self._started(request_id)
                        last = result.first
                        if last.finished:
                            finished = completed = True
                            yield last
                            return
                        handoff = result
                        generated += last.token_ids
                        yield last
                    stage = trace.stage = "decode"
                    # Migrated: the new worker recomputes prompt + output so far (no handoff) and goes on.
                    resume = tuple(generated) if migrations else ()
                    decoder = self._decode(
                        request_id,
                        prompt,
                        params,
                        decision,
                        None if resume else handoff,
                        deadline,
                        session_id,
                        trace.span,
                        whole,
                        resume,
                        # Whether a drain may move the request now (once moves are used up it finishes there).
                        movable=lambda: migrations < self.max_migrations if sent_decode else trace.attempts < MAX_ATTEMPTS,
                    )
                    # aclosing: a client that leaves at a yield below stops the decode side at once.
                    async with aclosing(decoder):
                        async for delta in decoder:
                            if trace.first_token is None:
                                trace.first_token = time.perf_counter()
                            self._started(request_id)
                            finished = completed = delta.finished
                            last = delta
                            sent_decode += 1
                            generated += delta.token_ids
                            yield delta
                            if finished:
                                return
                    return
                except _Failure as f:
                    if not f.drained and not f.worker_alive:
                        self.on_worker_failed(f.worker)
                    # Nothing of the decode side went out: run it again elsewhere. Tokens went out: migrate
                    # (the new worker continues after them), at most `server.max_migrations` times.
                    migrate = sent_decode > 0
                    retry = migrations < self.max_migrations if migrate else trace.attempts < MAX_ATTEMPTS
                    if retry:
                        try:
                            fresh = await self._route(request_id, prompt, None, trace.span)
                            # The router never offers a prefill worker for decode; kept as a guard (the
                            # decode pool cannot run there).
                            retry = self.role_of(fresh.decode_worker) != "prefill"
                        except NoWorkersAvailable:
                            retry = False
                    if not retry:
                        if self.metrics is not None:
                            self.metrics.failovers.labels("failed").inc()
                        message = f"the {f.stage} worker serving this request failed ({type(f.cause).__name__})"
                        if last is not None:
                            finished = True
                            yield _end(last, "error")
                            moved = f" (moved {migrations} times already)" if migrations else ""
                            raise WorkerFailed(
                                f"{message} after {last.num_output_tokens} tokens{moved}; the stream is incomplete", f.detail
                            ) from None
                        raise WorkerFailed(f"{message} and no other worker could take it; retry shortly", f.detail) from None
                    if migrate:
                        migrations += 1
                        trace.attempts -= 1  # a migration is not a failed start
                    if self.metrics is not None:
                        self.metrics.failovers.labels("drained" if f.drained else "migrated" if migrate else "retried").inc()
                    context = {"request_id": request_id, "stage": f.stage}
                    how = f"moving it after {len(generated)} tokens to" if migrate else "retrying on"
                    if f.drained:
                        log.info(
                            "request %s: its decode worker %s drains; %s %s", request_id, f.worker, how, fresh.decode_worker, extra=context
                        )
                    else:  # ERROR although the request goes on: a worker failed under it (`moray serve` shows it).
                        log.error("request %s failed during %s: %s; %s %s", request_id, f.stage, f, how, fresh.decode_worker, extra=context)
                    # After a remote prefill whose token went out, only the decode side moves.
                    decision = replace(fresh, prefill_worker=None) if handoff is not None or migrate else fresh
        except RequestTimedOut:
            if self.metrics is not None:
                self.metrics.timeouts.labels(stage).inc()
            if last is not None and not finished:
                finished = True
                yield _end(last, "timeout")
            raise
        finally:
            trace.end = time.perf_counter()
            self._started(request_id)
            if handoff is not None and not completed:
                # Ended early after the handoff began (client gone, failure, timeout): the prefill worker
                # frees the KV it holds now, not at its hold timeout, whatever the decode side got to.
                self._release_later(request_id, handoff.worker_id)

    async def _prefill(self, request_id, prompt, params, decision: RouteDecision, deadline, session_id=None, span=None) -> PrefillHandoff:
        worker = decision.prefill_worker
        request = PrefillRequest(request_id, prompt, params, session_id, tracing.inject(span))
        try:
            return await _until(self.prefill.prefill(worker, request), deadline, "prefill")
        except (asyncio.CancelledError, RequestTimedOut):
            # The result may be on its way (the hold already made): let go of it as well.
            self._release_later(request_id, worker)
            raise
        except Exception as e:
            if worker_gone(e):
                self._release_later(request_id, worker)  # merely unreachable, it may still hold the KV
                raise _Failure(worker, "prefill", e) from e
            raise

    async def _decode(
        self,
        request_id,
        prompt,
        params,
        decision: RouteDecision,
        handoff,
        deadline,
        session_id=None,
        span=None,
        whole=False,
        resume=(),
        movable: Callable[[], bool] = lambda: False,
    ):
        """The decode worker's deltas for the request, from this front end's channel to it. `resume`: the
        output tokens the client has already (a migrated request). When the worker drains and `movable()`,
        it stops here with a `_Failure` whose `drained` is set (the request is aborted there)."""
        worker = decision.decode_worker
        trace_context = tracing.inject(span)
        started = finished = False
        try:
            for _ in range(_REOPENS):
                tokens = await _until(self._subscribe(worker, request_id), deadline, "decode")
                request = DecodeRequest(request_id, prompt, params, tokens.channel, handoff, session_id, trace_context, resume)
                try:
                    await _until(self.decode.start(worker, request), deadline, "decode")
                except ChannelClosed:  # the channel closed (idle) between opening and this start: again
                    self.channels.unsubscribe(worker, request_id)
                    await _until(self.channels.refused(worker, tokens.channel), deadline, "decode")
                    continue
                except (RequestTimedOut, asyncio.CancelledError):
                    started = True  # it may have reached the worker: abort it there to be sure
                    raise
                except Exception as e:
                    if worker_gone(e):
                        finished = True  # nothing to abort on a dead replica
                        raise _Failure(worker, "decode", e) from e
                    raise
                started = True
                # One timer for the whole stream, not one per token: at the deadline it queues a marker.
                timer = asyncio.get_running_loop().call_at(deadline, tokens.put_nowait, _DEADLINE) if deadline is not None else None
                try:
                    while not finished:
                        item = await tokens.get()
                        if item is _DEADLINE:
                            raise _timed_out("decode")
                        if isinstance(item, Draining):
                            if movable():
                                raise _Failure(worker, "decode", WorkerDraining(f"decode worker {worker} drains"))
                            continue
                        if isinstance(item, BaseException):
                            finished = True  # the channel is gone: so is the request on the worker
                            raise _Failure(worker, "decode", item)
                        item = _merge_waiting(item, tokens)
                        finished = item.finished
                        tokens.until_done = whole  # after the first delta (its time is the TTFT)
                        yield item
                finally:
                    if timer is not None:
                        timer.cancel()
                return
            raise _Failure(worker, "decode", ChannelFailed(worker, ChannelIdleClosed()))
        finally:
            self.channels.unsubscribe(worker, request_id)
            if started and not finished:
                # Client gone, failure or timeout: the decode worker aborts the request and frees its blocks.
                detached(lambda: self.decode.abort(worker, request_id))

    async def _subscribe(self, worker: str, request_id: str):
        try:
            return await self.channels.subscribe(worker, request_id)
        except ChannelFailed as e:
            raise _Failure(worker, "decode", e) from e

    def _release_later(self, request_id: str, worker: str | None) -> None:
        """Tells the prefill worker to free the KV it holds for the request (in the background)."""
        if self.prefill is None or worker is None:
            return
        try:
            # A fresh context: made from a request being cancelled, the call would be that request's
            # child, and Serve cancels a cancelled request's children (this one must get through).
            detached(lambda: asyncio.wait_for(self.prefill.release(worker, request_id), 30))
        except RuntimeError:  # no loop (interpreter shutdown)
            return


def _end(last: TokenDelta, reason: str) -> TokenDelta:
    """The final delta of a stream the pipeline ends itself (error, timeout): nothing new."""
    return TokenDelta(last.request_id, [], "", last.num_output_tokens, last.num_cached_tokens, reason)


_DEADLINE = object()  # queued on a request's tokens when its time is up


def _merge_waiting(delta: TokenDelta, tokens) -> TokenDelta:
    """`delta` and the deltas queued behind it, as one: a consumer that fell behind (the client reads slowly,
    the CPU is busy) catches up in one step instead of one wake-up per engine step (vLLM's output collector
    does the same)."""
    more = tokens.take_deltas()
    if not more:
        return delta
    merged = TokenDelta(
        delta.request_id,
        list(delta.token_ids),
        delta.text,
        delta.num_output_tokens,
        delta.num_cached_tokens,
        delta.finish_reason,
        list(delta.logprobs) if delta.logprobs is not None else None,
        delta.prompt_logprobs,
        delta.queue_s,
    )
    for d in more:
        merged.token_ids += d.token_ids
        merged.text += d.text
        merged.num_output_tokens, merged.num_cached_tokens, merged.finish_reason = d.num_output_tokens, d.num_cached_tokens, d.finish_reason
        if d.logprobs is not None:
            merged.logprobs = (merged.logprobs or []) + d.logprobs
    return merged


def _timed_out(stage: str) -> RequestTimedOut:
    return RequestTimedOut(f"the request did not finish within server.request_timeout_s (stopped during {stage}); it was aborted")


async def _until(awaitable, deadline: float | None, stage: str) -> Any:
    """Awaits `awaitable`, cancelling it and raising `RequestTimedOut` at `deadline` (loop time)."""
    if deadline is None:
        return await awaitable
    try:
        async with asyncio.timeout_at(deadline) as cm:
            return await awaitable
    except TimeoutError:
        if cm.expired():
            raise _timed_out(stage) from None
        raise
