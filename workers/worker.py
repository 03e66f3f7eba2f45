"""Prefill and decode workers: one engine each, with the handoff protocol between them.

These classes know nothing of Ray Serve; `cluster/servers.py` wraps them in deployments and supplies the
transport (how a decode worker pulls a KV chunk from a prefill worker, how its channels reach the front
ends). What they send and receive are the messages of `workers/messages.py`.

Handoff: the prefill worker computes the uncached part of the prompt, samples the first token and holds
the prompt's KV blocks (`PrefillHandoff`). The decode worker allocates blocks, pulls the KV in chunks of
layers (all chunk requests in flight at once, each checked against its header and imported as it arrives)
and continues decoding. Held KV that nobody pulls is released after `hold_timeout_s`, so a vanished
decode side leaks nothing.

Channels: a decode worker sends a front end's tokens on one channel per front-end replica, one
`TokenDeltaBatch` per engine step with every one of its requests' new tokens (`workers/outbox.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import jax

from workers.engine.async_engine import AsyncEngine, Sink
from workers.engine.config import EngineConfig
from workers.engine.engine import KVImport
from workers.engine.sampler import check_stop
from workers.messages import (
    DecodeRequest,
    HandoffCounters,
    KVChunk,
    KVChunkCorrupt,
    PrefillHandoff,
    PrefillRequest,
    TokenDelta,
    TokenDeltaBatch,
    WorkerHeartbeat,
    WorkerReport,
    WorkerState,
)

from .outbox import ChannelClosed, Outbox

log = logging.getLogger("moray.worker")

FetchChunk = Callable[[int, int], Awaitable[KVChunk]]
Release = Callable[[], Awaitable[object]]
OnEnd = Callable[[TokenDelta | None, BaseException | None], None]


@dataclass
class WorkerCounters:
    """Running totals a worker reports (mutable here; sent as `HandoffCounters`)."""

    handoffs: int = 0
    handoff_bytes: int = 0
    handoff_state_bytes: int = 0
    handoff_seconds: float = 0.0
    held_released_by_timeout: int = 0
    import_failures: int = 0
    corrupt_chunks: int = 0
    misrouted: int = 0  # requests that reached this worker although the router chose another
    history: list[dict] = field(default_factory=list)  # the last handoffs: bytes, seconds, chunks

    def handoff(self) -> HandoffCounters:
        return HandoffCounters(
            self.handoffs,
            self.handoff_bytes,
            self.handoff_state_bytes,
            self.handoff_seconds,
            self.import_failures,
            self.corrupt_chunks,
            self.held_released_by_timeout,
        )


class EngineWorker:
    role = "both"

    def __init__(self, engine_config: EngineConfig, show_progress: bool = False, engine: AsyncEngine | None = None):
        self.config = engine_config
        self.worker_id = engine_config.worker_id
        self.engine = engine or AsyncEngine(engine_config, show_progress=show_progress)
        self.counters = WorkerCounters()
        self.state = WorkerState.ALIVE
        self._events = self.engine.core.events.subscribe()

    @property
    def num_handoff_units(self) -> int:
        """Units of a KV handoff: full-attention layers, plus the packed state of a hybrid model."""
        return self.engine.core.num_handoff_layers

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            role=self.role,
            ts=time.time(),
            state=self.state,
            engine=self.engine.stats(),
            handoff=self.counters.handoff(),
            misrouted=self.counters.misrouted,
            healthy=self.engine.healthy,
            num_processes=jax.process_count(),
        )

    def report(self, with_events: bool = True) -> WorkerReport:
        """The heartbeat and the KV events since the last report (dropped when `with_events` is False: the
        cluster's Redis index gets them from the worker's own event sink)."""
        events = self._events.drain()
        return WorkerReport(self.heartbeat(), events if with_events else [])

    def drain(self) -> None:
        """Takes no new requests from now on (the registry tells the routers); running ones finish."""
        self.state = WorkerState.DRAINING

    def kv_events(self):
        """The engine's KV event publisher (a Redis sink attaches to it)."""
        return self.engine.core.events

    async def _add(self, request_id: str, prompt: list[int], params, sink: Sink, **kw) -> None:
        """`engine.start_request`, safe against cancellation: a call cancelled (the client left) just as the
        engine thread took the request would leave it there with nobody to abort it (running to its end,
        holding KV, or waiting forever for an import); abort it then (a no-op if it never got in)."""
        try:
            await self.engine.start_request(request_id, prompt, params, sink, **kw)
        except asyncio.CancelledError:
            if self.engine.healthy:
                self.engine.submit(lambda core: core.abort(request_id))
            raise

    async def _deltas(self, request_id: str, prompt: list[int], params, **kw) -> AsyncIterator[TokenDelta]:
        q: asyncio.Queue = asyncio.Queue()
        await self._add(request_id, prompt, params, q.put_nowait, **kw)
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.engine.forget(request_id, q.put_nowait)  # left early: abort it and free its blocks


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, engine_config: EngineConfig, hold_timeout_s: float = 60.0, **kw):
        super().__init__(engine_config, **kw)
        self.hold_timeout_s = hold_timeout_s
        # Requests released before their KV was held (the client left during the prefill): let go of
        # the KV as soon as the prefill ends instead of holding it for nobody. request -> when (monotonic)
        self._unwanted: dict[str, float] = {}

    async def prefill(self, request: PrefillRequest) -> PrefillHandoff:
        start = time.perf_counter()
        params = request.params
        first_only = params.model_copy(update={"max_tokens": 1, "min_tokens": min(params.min_tokens, 1), "stop": ()})
        deltas = [
            d async for d in self._deltas(request.request_id, request.prompt, first_only, hold_kv=True, session_id=request.session_id)
        ]
        token = deltas[0].token_ids[0]
        text = "".join(d.text for d in deltas)
        stop = check_stop([token], "", text, params, self.engine.core.eos_token_ids)
        last = deltas[-1]
        first = TokenDelta(
            request.request_id,
            [token],
            stop.text,
            1,
            last.num_cached_tokens,
            stop.reason if stop.finished else None,
            deltas[0].logprobs,
            deltas[0].prompt_logprobs,
        )
        handoff = PrefillHandoff(
            request.request_id, self.worker_id, first, len(request.prompt), self.num_handoff_units, time.perf_counter() - start
        )
        if first.finished or self._unwanted.pop(request.request_id, None) is not None:
            await self.engine.release_kv(request.request_id)
        else:
            asyncio.get_running_loop().call_later(self.hold_timeout_s, self._expire_hold, request.request_id)
        return handoff

    def _expire_hold(self, request_id: str) -> None:
        def release(core):
            if core.release_kv(request_id):
                self.counters.held_released_by_timeout += 1
                log.warning("released unclaimed KV of %s after %.0fs", request_id, self.hold_timeout_s)

        if self.engine.healthy:
            self.engine.submit(release)

    async def kv_chunk(self, request_id: str, unit_start: int, unit_end: int) -> KVChunk:
        data = await self.engine.export_kv(request_id, unit_start, unit_end)
        return KVChunk.of(request_id, unit_start, unit_end, data)

    async def release(self, request_id: str) -> bool:
        """Frees the KV held for a handoff (idempotent). Called before the hold exists (the client left
        during the prefill), it makes the prefill let go of the KV when it ends."""
        if await self.engine.release_kv(request_id):
            return True
        now = time.monotonic()
        if len(self._unwanted) > 1024:
            self._unwanted = {r: t for r, t in self._unwanted.items() if t > now - self.hold_timeout_s}
        self._unwanted[request_id] = now
        return await self.engine.release_kv(request_id)  # held in the meantime


@dataclass
class _Running:
    """A request this decode worker runs: where its deltas go, and its KV import while one runs."""

    sink: Sink
    outbox: Outbox | None = None
    importer: asyncio.Task | None = None
    release: Release | None = None
    on_end: OnEnd | None = None


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(
        self, engine_config: EngineConfig, layers_per_chunk: int = 1, channel_linger_s: float = 2.0, stream_interval_s: float = 0.0, **kw
    ):
        super().__init__(engine_config, **kw)
        self.layers_per_chunk = layers_per_chunk
        self.channel_linger_s = channel_linger_s
        self.stream_interval_s = stream_interval_s
        self.channels: dict[str, Outbox] = {}
        self._running: dict[str, _Running] = {}

    # ---------------------------------------------------------------- channels

    async def channel(self, channel_id: str) -> AsyncIterator[TokenDeltaBatch]:
        """One front end's channel: a handshake batch (the channel is open), then one batch per step with
        every new delta of its requests. It ends (after a `closing` batch) once none of its requests has run
        for `channel_linger_s`; leaving it early (the front end went away) aborts the requests still on it."""
        old = self.channels.get(channel_id)
        if old is not None:
            # The front end opened it again, so it gave up on the old stream and its requests: end both.
            old.close()
        outbox = self.channels[channel_id] = Outbox(
            self.worker_id, self.channel_linger_s, lambda: self._running_on(outbox), self.stream_interval_s
        )
        try:
            async for batch in outbox.batches():
                yield batch
        finally:
            outbox.close()
            if self.channels.get(channel_id) is outbox:
                del self.channels[channel_id]
            for request_id in [r for r, run in self._running.items() if run.outbox is outbox]:
                self.abort(request_id)

    def _running_on(self, outbox: Outbox) -> bool:
        return any(run.outbox is outbox for run in self._running.values())

    async def start(self, request: DecodeRequest, fetch_chunk: FetchChunk | None = None, release: Release | None = None, on_end=None):
        """Starts a request whose deltas go out on its channel (`ChannelClosed` if that is not open here)."""
        outbox = self.channels.get(request.channel)
        if outbox is None or outbox.closed:
            # The prefill side keeps its hold: the front end opens the channel and sends this request again.
            raise ChannelClosed(f"channel {request.channel!r} is not open on {self.worker_id}")
        await self._begin(request, outbox.put, fetch_chunk, release, on_end, outbox)

    async def stream(self, request: DecodeRequest, fetch_chunk: FetchChunk | None = None, release: Release | None = None):
        """The request's deltas as an async iterator, without a channel (in-process callers and tests)."""
        q: asyncio.Queue = asyncio.Queue()
        await self._begin(request, q.put_nowait, fetch_chunk, release, None, None)
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Stops a request (the client left, the front end timed it out or gave it to another worker)."""
        run = self._running.get(request_id)
        if run is not None:
            self.engine.forget(request_id, run.sink)
            self._ended(request_id, None, None)

    # ---------------------------------------------------------------- running a request

    async def _begin(self, request: DecodeRequest, deliver, fetch_chunk, release, on_end, outbox) -> None:
        rid = request.request_id

        def sink(item: TokenDelta | BaseException) -> None:
            deliver(item)
            if isinstance(item, BaseException):
                self._ended(rid, None, item)
            elif item.finished:
                self._ended(rid, item, None)

        run = self._running[rid] = _Running(sink, outbox, release=release, on_end=on_end)
        handoff = request.handoff
        kv_import = KVImport(handoff.first.token_ids[0], handoff.first.num_cached_tokens) if handoff is not None else None
        try:
            await self._add(rid, request.prompt, request.params, sink, kv_import=kv_import, session_id=request.session_id)
        except BaseException as e:
            # Refused or cancelled before the import began: nobody else will free the prefill side's KV.
            if self._running.get(rid) is run:
                del self._running[rid]
            if release is not None:
                await asyncio.shield(_release_quietly(release))
            if on_end is not None:
                on_end(None, e)
            raise
        if handoff is not None and rid in self._running:
            run.importer = asyncio.create_task(self._import_all(rid, handoff, fetch_chunk, release))

    def _ended(self, request_id: str, last: TokenDelta | None, error: BaseException | None) -> None:
        run = self._running.pop(request_id, None)
        if run is None:
            return
        if run.importer is not None and not run.importer.done():
            run.importer.cancel()  # its own `finally` still tells the prefill side to let go (shielded)
        if run.outbox is not None:
            run.outbox.request_ended()
        if run.on_end is not None:
            run.on_end(last, error)

    async def _import_all(self, request_id: str, handoff: PrefillHandoff, fetch_chunk: FetchChunk, release) -> None:
        start = time.perf_counter()
        moved = {"bytes": 0, "state_bytes": 0, "chunks": 0}
        core = self.engine.core

        async def one(unit_start: int, unit_end: int) -> None:
            chunk = await fetch_chunk(unit_start, unit_end)
            try:
                data = chunk.verified(request_id, unit_start, unit_end)
            except KVChunkCorrupt:
                self.counters.corrupt_chunks += 1
                raise
            moved["bytes"] += data.nbytes
            if unit_start >= core.cfg.num_kv_layers:
                moved["state_bytes"] += data.nbytes
            moved["chunks"] += 1
            await self.engine.import_kv(request_id, unit_start, data)

        try:
            await asyncio.gather(*(one(a, b) for a, b in core.handoff_chunks(self.layers_per_chunk)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any transport failure or damaged chunk: recompute locally
            log.warning("KV import for %s failed (%s); prefilling locally", request_id, e)
            self.counters.import_failures += 1
            self.engine.submit(lambda c: c.recompute_instead_of_import(request_id))
        else:
            # Counted before the release: a short request can finish (and cancel this task) while the
            # release is in flight, and the bytes it moved must still show.
            self._count_handoff(moved, time.perf_counter() - start)
        finally:
            # Shielded: the cancellation above must not leave the prefill side holding the blocks.
            await asyncio.shield(_release_quietly(release))

    def _count_handoff(self, moved: dict, seconds: float) -> None:
        c = self.counters
        c.handoffs += 1
        c.handoff_bytes += moved["bytes"]
        c.handoff_state_bytes += moved["state_bytes"]
        c.handoff_seconds += seconds
        c.history = (c.history + [{**moved, "seconds": seconds}])[-256:]


async def _release_quietly(release) -> None:
    """Frees the prefill side's held KV; failures are harmless (its hold timeout frees it anyway)."""
    if release is None:
        return
    try:
        await release()
    except Exception:  # noqa: BLE001
        pass
