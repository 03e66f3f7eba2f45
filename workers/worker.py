"""Prefill and decode workers: one engine each, with the handoff protocol between them.

These classes know nothing of Ray Serve; `cluster/servers.py` wraps them in deployments and supplies the
transport (how a decode worker pulls a KV chunk from a prefill worker, how its channels reach the front
ends). What they send and receive are the messages of `workers/messages.py`.

Handoff (`workers/kv_transfer.py`): the prefill worker computes the uncached part of the prompt and samples
the first token; its engine stages the prompt's KV to the host and frees the blocks; the worker cuts the
copy into checksummed chunks and publishes them through its KV transport (`PrefillHandoff` carries their
headers and handles). The decode worker allocates blocks, fetches the chunks its prefix cache lacks (a
few in flight, each verified and written as it arrives, a bad one fetched once more) and continues
decoding; whatever goes wrong, it prefills locally instead. Published KV that nobody fetched is dropped
after `hold_timeout_s`, so a vanished decode side leaks nothing.

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
from workers.engine.engine import KVImport, StagedKV
from workers.engine.sampler import check_stop
from workers.kv_transfer import (
    DEFAULT_CHUNK_BYTES,
    ImportStats,
    KVExport,
    KVTransferFailed,
    KVTransport,
    LocalTransport,
    PeerExports,
    Published,
    import_chunks,
    merge_published,
    needed,
)
from workers.messages import (
    DecodeRequest,
    HandoffCounters,
    KVChunkHeader,
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

FetchChunk = Callable[[KVChunkHeader, object], Awaitable[object]]  # (header, handle) -> data
Release = Callable[[], Awaitable[object]]
OnEnd = Callable[[TokenDelta | None, BaseException | None], None]
OnImport = Callable[[ImportStats, float, BaseException | None], None]  # an import ended: what moved, seconds, why it failed


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
    refetched_chunks: int = 0
    skipped_bytes: int = 0
    exports: int = 0
    export_bytes: int = 0
    export_seconds: float = 0.0
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
            self.refetched_chunks,
            self.skipped_bytes,
            self.exports,
            self.export_bytes,
            self.export_seconds,
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

    def __init__(
        self,
        engine_config: EngineConfig,
        hold_timeout_s: float = 60.0,
        transport: KVTransport | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        peers: PeerExports | None = None,
        **kw,
    ):
        super().__init__(engine_config, **kw)
        self.hold_timeout_s = hold_timeout_s
        self.transport = transport or LocalTransport()
        self.chunk_bytes = chunk_bytes
        self.peers = peers  # the other hosts of a multi-host engine: each exports the blocks it holds
        self._published: set[str] = set()  # requests whose chunks are published, until released or expired
        # Requests released before their KV was published (the client left during the prefill): let go of
        # it as soon as the prefill ends instead of holding it for nobody. request -> when (monotonic)
        self._unwanted: dict[str, float] = {}

    async def prefill(self, request: PrefillRequest) -> PrefillHandoff:
        start = time.perf_counter()
        rid, params = request.request_id, request.params
        first_only = params.model_copy(update={"max_tokens": 1, "min_tokens": min(params.min_tokens, 1), "stop": ()})
        deltas = [d async for d in self._deltas(rid, request.prompt, first_only, hold_kv=True, session_id=request.session_id)]
        token = deltas[0].token_ids[0]
        text = "".join(d.text for d in deltas)
        stop = check_stop([token], "", text, params, self.engine.core.eos_token_ids)
        last = deltas[-1]
        first = TokenDelta(
            rid,
            [token],
            stop.text,
            1,
            last.num_cached_tokens,
            stop.reason if stop.finished else None,
            deltas[0].logprobs,
            deltas[0].prompt_logprobs,
            deltas[0].queue_s,
        )
        prefill_s = time.perf_counter() - start
        staged = self.engine.take_staged(rid)
        if first.finished or staged is None or self._unwanted.pop(rid, None) is not None:
            await self.engine.release_kv(rid)  # nothing to hand over
            return PrefillHandoff(rid, self.worker_id, first, len(request.prompt), prefill_time_s=prefill_s)
        try:
            export, headers, sources = await self._publish(staged)
        except Exception as e:  # noqa: BLE001 - a host's export failed: the decode side prefills instead
            log.warning("could not export the KV of %s (%s): the decode worker prefills it", rid, e)
            await self.engine.release_kv(rid)
            return PrefillHandoff(rid, self.worker_id, first, len(request.prompt), prefill_time_s=prefill_s)
        c = self.counters
        c.exports, c.export_bytes, c.export_seconds = (
            c.exports + 1,
            c.export_bytes + sum(h.nbytes for h in headers),
            c.export_seconds + export.staged_seconds,
        )
        if self._unwanted.pop(rid, None) is not None:  # released while it was being published
            self._unpublish(rid)
        else:
            asyncio.get_running_loop().call_later(self.hold_timeout_s, self._expire_hold, rid)
        export_s = time.perf_counter() - start - prefill_s
        return PrefillHandoff(
            rid,
            self.worker_id,
            first,
            len(request.prompt),
            headers,
            sources,
            self.transport.name,
            prefill_s,
            export_s,
            staged.window_start_block,
        )

    async def _publish(self, staged: StagedKV) -> tuple[KVExport, tuple, tuple]:
        """Publishes this host's part of the KV (waiting for its host copy off the event loop), and the
        other hosts' parts on a multi-host engine; returns the export and the handoff's chunk list."""
        rid = staged.request_id
        try:
            export = await asyncio.to_thread(KVExport.build, staged, self.chunk_bytes, self.transport.reserve)
            parts: list[Published] = [(export.headers, await self.transport.publish(export))]
            if self.peers is not None:
                parts += await self.peers.export(rid, self.chunk_bytes)
        except BaseException:
            self.transport.unpublish(rid)  # whatever part got published
            if self.peers is not None:
                self.peers.unpublish(rid)
            raise
        # Published only now: a release that came during the export marked it unwanted (see `prefill`).
        self._published.add(rid)
        headers, sources = merge_published(parts)
        return export, headers, sources

    def _unpublish(self, request_id: str) -> bool:
        if request_id not in self._published:
            return False
        self._published.discard(request_id)
        self.transport.unpublish(request_id)
        if self.peers is not None:
            self.peers.unpublish(request_id)
        return True

    def _expire_hold(self, request_id: str) -> None:
        if self._unpublish(request_id):
            self.counters.held_released_by_timeout += 1
            log.warning("dropped the unclaimed KV of %s after %.0fs", request_id, self.hold_timeout_s)

    async def release(self, request_id: str) -> bool:
        """Lets go of a handoff's KV (idempotent): the decode side has it, or gave up on it. Called before
        the KV was published (the client left during the prefill), it drops the KV when the prefill ends."""
        if self._unpublish(request_id) or await self.engine.release_kv(request_id):
            return True
        now = time.monotonic()
        if len(self._unwanted) > 1024:
            self._unwanted = {r: t for r, t in self._unwanted.items() if t > now - self.hold_timeout_s}
        self._unwanted[request_id] = now
        return False


@dataclass
class _Running:
    """A request this decode worker runs: where its deltas go, and its KV import while one runs."""

    sink: Sink
    outbox: Outbox | None = None
    importer: asyncio.Task | None = None
    release: Release | None = None
    on_end: OnEnd | None = None
    on_import: OnImport | None = None


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(
        self,
        engine_config: EngineConfig,
        channel_linger_s: float = 2.0,
        stream_interval_s: float = 0.0,
        transport: KVTransport | None = None,
        chunks_in_flight: int = 4,
        handoff_timeout_s: float = 30.0,
        **kw,
    ):
        super().__init__(engine_config, **kw)
        self.transport = transport or LocalTransport()
        self.chunks_in_flight = chunks_in_flight
        self.handoff_timeout_s = handoff_timeout_s
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

    async def start(
        self,
        request: DecodeRequest,
        fetch_chunk: FetchChunk | None = None,
        release: Release | None = None,
        on_end: OnEnd | None = None,
        on_import: OnImport | None = None,
    ):
        """Starts a request whose deltas go out on its channel (`ChannelClosed` if that is not open here)."""
        outbox = self.channels.get(request.channel)
        if outbox is None or outbox.closed:
            # The prefill side keeps its hold: the front end opens the channel and sends this request again.
            raise ChannelClosed(f"channel {request.channel!r} is not open on {self.worker_id}")
        await self._begin(request, outbox.put, fetch_chunk, release, on_end, outbox, on_import)

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

    async def _begin(self, request: DecodeRequest, deliver, fetch_chunk, release, on_end, outbox, on_import=None) -> None:
        rid = request.request_id

        def sink(item: TokenDelta | BaseException) -> None:
            deliver(item)
            if isinstance(item, BaseException):
                self._ended(rid, None, item)
            elif item.finished:
                self._ended(rid, item, None)

        run = self._running[rid] = _Running(sink, outbox, release=release, on_end=on_end, on_import=on_import)
        handoff = request.handoff
        kv_import = None
        if handoff is not None:
            kv_import = KVImport(handoff.first.token_ids[0], handoff.first.num_cached_tokens, handoff.window_start_block)
        try:
            await self._add(
                rid, request.prompt, request.params, sink, kv_import=kv_import, session_id=request.session_id, resume=request.resume
            )
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
            run.importer = asyncio.create_task(self._import_all(rid, handoff, fetch_chunk, release, on_import))

    def _ended(self, request_id: str, last: TokenDelta | None, error: BaseException | None) -> None:
        run = self._running.pop(request_id, None)
        if run is None:
            return
        if run.importer is not None and not run.importer.done() and (last is None or last.finish_reason == "abort"):
            run.importer.cancel()  # its own `finally` still tells the prefill side to let go (shielded)
        # A request that finished otherwise decoded on its KV: its importer has had the engine's last answer
        # and only counts the handoff and releases the prefill side's copy. Cancelling it there (its wake-up
        # can come after the last token of a short request, under load) lost the handoff from the counters.
        if run.outbox is not None:
            run.outbox.request_ended()
        if run.on_end is not None:
            run.on_end(last, error)

    async def _import_all(self, request_id: str, handoff: PrefillHandoff, fetch_chunk: FetchChunk | None, release, on_import=None) -> None:
        """Moves the handoff's KV into the engine (`workers/kv_transfer.py`), or makes the request prefill
        locally if anything goes wrong: it is never decoded on missing or damaged KV."""
        start = time.perf_counter()
        stats = ImportStats()
        engine = self.engine
        error: BaseException | None = None

        async def write(header: KVChunkHeader, data, last: bool) -> bool:
            return await engine.import_chunk(request_id, header.kind, header.block_start, header.layer_start, data, finish=last)

        try:
            if not handoff.chunks:
                raise KVTransferFailed(f"{handoff.worker_id} published no KV for it")
            from_block = engine.import_from_block_now(request_id)
            if from_block is None:
                return  # it prefills locally already (no room for the KV when it arrived), or it ended
            if not needed(handoff.chunks, from_block):  # our prefix cache holds the whole prompt: nothing moves
                stats.skipped_bytes = handoff.nbytes
                importing = engine.call(lambda c: c.finish_import(request_id))
            else:
                importing = import_chunks(
                    handoff.chunks, handoff.sources, from_block, fetch_chunk or self.transport.fetch, write, stats, self.chunks_in_flight
                )
            if await asyncio.wait_for(importing, self.handoff_timeout_s):
                # Counted before the release: a short request can finish (and cancel this task) while the
                # release is in flight, and the bytes it moved must still show.
                self._count_handoff(stats, time.perf_counter() - start)
        except asyncio.CancelledError as e:
            error = e
            raise
        except Exception as e:  # noqa: BLE001 - a transport failure, a chunk bad twice, the deadline: recompute locally
            error = e
            log.warning("KV import for %s failed (%s); prefilling locally", request_id, str(e) or type(e).__name__)
            self.counters.import_failures += 1
            self.engine.submit(lambda c: c.recompute_instead_of_import(request_id))
        finally:
            self.counters.corrupt_chunks += stats.corrupt
            self.counters.refetched_chunks += stats.refetched
            if on_import is not None:
                on_import(stats, time.perf_counter() - start, error)
            # Shielded: the cancellation above must not leave the prefill side holding the KV.
            await asyncio.shield(_release_quietly(release))

    def _count_handoff(self, stats: ImportStats, seconds: float) -> None:
        c = self.counters
        c.handoffs += 1
        c.handoff_bytes += stats.bytes
        c.handoff_state_bytes += stats.state_bytes
        c.skipped_bytes += stats.skipped_bytes
        c.handoff_seconds += seconds
        moved = {"bytes": stats.bytes, "state_bytes": stats.state_bytes, "skipped_bytes": stats.skipped_bytes, "chunks": stats.chunks}
        c.history = (c.history + [{**moved, "seconds": seconds, "first_chunk_seconds": stats.first_chunk_s}])[-256:]


async def _release_quietly(release) -> None:
    """Frees the prefill side's held KV; failures are harmless (its hold timeout frees it anyway)."""
    if release is None:
        return
    try:
        await release()
    except Exception:  # noqa: BLE001
        pass
