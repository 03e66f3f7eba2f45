"""Typed wrappers for the Serve handles: every call one process of the cluster makes on another.

A deployment method is named in exactly one place, here, with the message types it takes and returns
(`workers/messages.py`); `tests/test_messages.py` checks every name and keyword against the deployment
classes, so a renamed method or argument fails a test instead of a request.

    PrefillPool   front end -> PrefillServer   prefill; decode worker -> PrefillServer: release
                  (the KV itself moves through a KV transport: cluster/kv_transport.py)
    DecodePool    front end -> DecodeServer    channel (stream), start_batch, abort; with a direct channel
                  the batches, starts and aborts go over its own connection (cluster/direct_stream.py)
    RegistryClient workers, front ends -> Registry   report, worker_failed, changes, follow (stream), metrics

Calls to a worker carry `target_replica` (the router's choice, honoured by `cluster.targeting`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, Awaitable, Callable, TypeVar

from workers.messages import DecodeRequest, PrefillHandoff, PrefillRequest, StreamOffer, TokenDeltaBatch, WorkerReport

from .direct_stream import DirectChannel
from .targeting import TARGET_KWARG

log = logging.getLogger("moray.cluster")

T = TypeVar("T")

# Start batches a direct channel carries at once (a Serve call carries one at a time: `_StartBatches`).
DIRECT_STARTS_IN_FLIGHT = 8

# deployment -> the methods called on it (checked against the classes by tests/test_messages.py)
CALLS = {
    "PrefillServer": ("prefill", "release"),
    "DecodeServer": ("channel", "start_batch", "abort"),
    "Registry": ("report", "worker_failed", "changes", "follow", "metrics"),
}


class WrongReplica(RuntimeError):
    """A call meant for another replica reached this one (Serve fell back because the target is gone): for a
    channel or a decode request that is the target's failure, not a request this replica may take."""


async def _cancellable(response) -> Any:
    """Awaits a Serve response; if our caller is cancelled, the replica-side call is cancelled too."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise


def detached(call: Callable[[], Awaitable[T]]) -> asyncio.Future:
    """Makes a Serve call in a fresh context, so that it is no child of the request being served (Serve
    cancels those when that request is cancelled: a release or abort sent while a client leaves must get
    through); kept alive and shielded from our own caller's cancellation."""

    async def run() -> T:
        return await call()

    task = asyncio.get_running_loop().create_task(run(), context=contextvars.Context())
    _detached_tasks.add(task)
    task.add_done_callback(_detached_tasks.discard)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure here is not worth a warning
    return asyncio.shield(task)


_detached_tasks: set[asyncio.Task] = set()


class PrefillPool:
    def __init__(self, handle):
        self._handle = handle

    async def prefill(self, worker: str, request: PrefillRequest) -> PrefillHandoff:
        return await _cancellable(self._handle.prefill.remote(request, **{TARGET_KWARG: worker}))

    async def release(self, worker: str, request_id: str) -> bool:
        return await self._handle.release.remote(request_id, **{TARGET_KWARG: worker})

    async def rebalance_experts(self, worker: str, wait: bool) -> bool:
        return await self._handle.rebalance_experts.remote(wait, **{TARGET_KWARG: worker})


class DecodePool:
    """`direct`: channels ask their worker for a direct connection (cluster/direct_stream.py); a channel's
    starts and aborts then go over it. A worker that offers none, or that cannot be reached, stays on Serve."""

    def __init__(self, handle, direct: bool = False):
        self._handle = handle
        self.direct = direct
        self._starts: dict[str, _StartBatches] = {}
        self._connections: dict[str, DirectChannel] = {}  # worker -> the connection of this front end's channel
        self._unreachable: set[str] = set()  # workers whose offer could not be connected to: Serve only

    def channel(self, worker: str, channel_id: str):
        """The worker's stream of encoded `TokenDeltaBatch`es for this front end (async iterator; `.cancel()`)."""
        if self.direct and worker not in self._unreachable:
            return _OpeningChannel(self, worker, channel_id)
        return self._serve_channel(worker, channel_id)

    def _serve_channel(self, worker: str, channel_id: str, **kw):
        return self._handle.options(stream=True).channel.remote(channel_id, **kw, **{TARGET_KWARG: worker})

    async def start(self, worker: str, request: DecodeRequest) -> None:
        """Starts the request on `worker` (returns once its engine took it). The starts for one worker travel
        together: one call carries every request that arrived while the previous call was on its way."""
        connection = self._connections.get(worker)
        if connection is not None and connection.name == request.channel and not _holds_object_refs(request):
            await connection.starts.start(request)
            return
        batches = self._starts.get(worker)
        if batches is None:
            batches = self._starts[worker] = _StartBatches(lambda requests: self._start_batch(worker, requests))
        await batches.start(request)

    async def _start_batch(self, worker: str, requests: list[DecodeRequest]) -> list[BaseException | None]:
        return await self._handle.start_batch.remote(requests, **{TARGET_KWARG: worker})

    async def rebalance_experts(self, worker: str, wait: bool) -> bool:
        return await self._handle.rebalance_experts.remote(wait, **{TARGET_KWARG: worker})

    async def abort(self, worker: str, request_id: str) -> None:
        batches = self._starts.get(worker)
        if batches is not None and not await batches.settled(request_id):
            return  # it was never sent: nothing runs there
        connection = self._connections.get(worker)
        if connection is not None and not connection.closed:
            if await connection.starts.settled(request_id):
                connection.abort(request_id)  # after its start (whichever way it went): it cannot overtake it
            return
        await self._handle.abort.remote(request_id, **{TARGET_KWARG: worker})

    def _connected(self, connection: DirectChannel) -> None:
        connection.starts = _StartBatches(connection.start_batch, max_in_flight=DIRECT_STARTS_IN_FLIGHT)
        self._connections[connection.worker] = connection

    def _disconnected(self, connection: DirectChannel) -> None:
        if self._connections.get(connection.worker) is connection:
            del self._connections[connection.worker]


def _holds_object_refs(request: DecodeRequest) -> bool:
    """Whether the request's handoff names KV chunks in Ray's object store. Those references must travel
    through Ray's own serialisation (it registers the decode worker as their borrower; pickled on a socket,
    the worker's fetch waited for the transfer timeout and prefilled again), so such a start goes over Serve."""
    if request.handoff is None:
        return False
    import ray

    return any(isinstance(source, ray.ObjectRef) for source in request.handoff.sources)


class _OpeningChannel:
    """A channel asking for a direct connection: its Serve call's first item is the worker's `StreamOffer`
    (then the batches come over the connection, and the call stays open as the lease) or, from a worker
    without one, the first batch of a plain Serve stream."""

    def __init__(self, pool: DecodePool, worker: str, name: str):
        self._pool, self.worker, self.name = pool, worker, name
        self._serve = pool._serve_channel(worker, name, direct=True)
        self._stream = None  # what the batches come from, once known
        self._cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._stream is None:
            first = await anext(self._serve)
            if not isinstance(first, StreamOffer):
                self._stream = self._serve
                return first
            self._stream = await self._connect(first)
        return await anext(self._stream)

    async def _connect(self, offer: StreamOffer):
        pool = self._pool
        try:
            connection = await DirectChannel.connect(self.worker, self.name, self._serve, offer, lambda: pool._disconnected(connection))
        except (OSError, TimeoutError) as e:
            # Not reachable from here (another network, a firewall): this worker's channels stay on Serve.
            log.warning("no direct channel to %s at %s:%s (%s): its tokens go through Serve", self.worker, offer.host, offer.port, e)
            pool._unreachable.add(self.worker)
            self._serve.cancel()
            self._serve = pool._serve_channel(self.worker, self.name)
            return self._serve
        pool._connected(connection)
        if self._cancelled:
            connection.cancel()
        return connection

    def cancel(self) -> None:
        self._cancelled = True
        if self._stream is not None and self._stream is not self._serve:
            self._stream.cancel()
        self._serve.cancel()


class _StartBatches:
    """One worker's starts, sent as batches: whatever arrived while the previous batch was on its way goes with
    the next. A Serve call costs each side milliseconds of CPU, so over Serve at most one call is in flight (a
    closed loop at concurrency 64 starts dozens of requests within one call's time). A frame on a direct
    channel costs microseconds: there up to `max_in_flight` batches travel at once, each carrying what arrived
    within one turn of the event loop. Held back behind one slow answer (the front end's loop is busy parsing
    the wave of requests that follows a wave of finishes), the first start ran alone on the engine for tens of
    milliseconds and the rest arrived together, which kept the waves in lockstep with a straggler between them.

    A caller that gives up before its batch left takes its request out; an abort for a request whose batch is
    on its way waits for that batch (it must not overtake the start)."""

    def __init__(self, send: Callable[[list[DecodeRequest]], Awaitable[list[BaseException | None]]], max_in_flight: int = 1):
        self._send = send
        self._max_in_flight = max_in_flight
        self._waiting: dict[str, tuple[DecodeRequest, asyncio.Future]] = {}
        self._sent: dict[str, asyncio.Future] = {}  # request id -> the future of the call carrying it
        self._senders: set[asyncio.Task] = set()
        self._collector: asyncio.Task | None = None  # the sender scheduled that has not taken its batch yet

    async def start(self, request: DecodeRequest) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even if its caller left
        self._waiting[request.request_id] = (request, done)
        self._kick()
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            self._waiting.pop(request.request_id, None)  # not sent yet: it never will be
            raise

    async def settled(self, request_id: str) -> bool:
        """False if the request was never sent (it is dropped now); else True once its call has returned."""
        if self._waiting.pop(request_id, None) is not None:
            return False
        call = self._sent.get(request_id)
        if call is not None:
            await asyncio.wait([call])
        return True

    def _kick(self) -> None:
        """Schedules a sender unless one is about to take the waiting starts or the limit is reached (then the
        first sender back takes them)."""
        if self._collector is not None or not self._waiting or len(self._senders) >= self._max_in_flight:
            return
        # A fresh context: the call carries other requests too, and must not be cancelled with this one's.
        task = self._collector = asyncio.get_running_loop().create_task(self._send_waiting(), context=contextvars.Context())
        self._senders.add(task)
        task.add_done_callback(self._sender_done)

    def _sender_done(self, task: asyncio.Task) -> None:
        self._senders.discard(task)
        if self._collector is task:  # cancelled before it ran (its loop closed)
            self._collector = None
        if not task.cancelled():
            self._kick()

    async def _send_waiting(self) -> None:
        self._collector = None
        batch, self._waiting = self._waiting, {}
        if not batch:
            return
        call = asyncio.get_running_loop().create_future()
        self._sent.update(dict.fromkeys(batch, call))
        try:
            results = await self._send([request for request, _ in batch.values()])
        except asyncio.CancelledError:
            for _, done in batch.values():
                done.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - the whole call failed (the worker is gone): every request did
            results = [e] * len(batch)
        finally:
            call.set_result(None)
            for rid in batch:
                self._sent.pop(rid, None)
        for (_, done), result in zip(batch.values(), results, strict=True):
            if done.done():
                continue
            if result is None:
                done.set_result(None)
            else:
                done.set_exception(result)


class RegistryClient:
    """The membership registry's methods. Async ones for event-loop callers; `report_sync` blocks (the
    workers' reporter thread)."""

    def __init__(self, handle):
        self._handle = handle

    async def report(self, report: WorkerReport) -> None:
        await self._handle.report.remote(report)

    def report_sync(self, report: WorkerReport, timeout_s: float = 5.0) -> None:
        self._handle.report.remote(report).result(timeout_s=timeout_s)

    async def worker_failed(self, worker: str, at: float) -> None:
        await self._handle.worker_failed.remote(worker, at)

    async def changes(self, cursor: tuple[str, int] | None, wait_s: float):
        """What changed since `cursor` (`registry.RegistryChanges`), waiting up to `wait_s` for something."""
        return await self._handle.changes.remote(cursor, wait_s)

    def follow(self, cursor: tuple[str, int] | None, min_interval_s: float):
        """The changes as they happen (an async iterator of `registry.RegistryChanges`; `.cancel()`)."""
        return self._handle.options(stream=True).follow.remote(cursor, min_interval_s)

    async def metrics(self) -> bytes:
        return await self._handle.metrics.remote()


__all__ = ["CALLS", "DecodePool", "PrefillPool", "RegistryClient", "TokenDeltaBatch", "WrongReplica", "detached"]
