"""`AsyncEngine`: the engine core on a background thread, with asyncio streams per request.

The core stays single-threaded: every call from the event loop (add, abort, KV export/import) is
queued and run on the engine thread between steps. A step's deltas go back to the event loop in one hop
(one `call_soon_threadsafe` per step, not one per request), where each reaches its request's sink: a
`RequestStream` (an async iterator per request) or a callable (the decode worker's channel outboxes, which
send the step's deltas on as one message per front end). Leaving a stream early (client disconnect,
cancellation) aborts the request and frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import AsyncIterator, Callable, Sequence, TypeVar

from workers.messages import EngineStats, TokenDelta

from .config import EngineConfig
from .engine import EngineCore, KVImport
from .sampling_params import SamplingParams

log = logging.getLogger("moray.engine")
T = TypeVar("T")
Sink = Callable[[TokenDelta | BaseException], None]


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; the worker must be restarted."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True, core: EngineCore | None = None):
        self.core = core or EngineCore(config, show_progress=show_progress)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, Sink]] = {}  # request -> where its deltas go
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="moray-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._run_commands()
                if self.core.has_unfinished():
                    deltas = self.core.step()
                    if deltas:
                        self._deliver(deltas)
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - the thread must report, not vanish
            log.exception("engine thread failed")
            self.error = e
            self._fail_everyone(EngineDeadError(f"engine failed: {e}"))

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.core))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        """Hands a step's deltas to the event loop(s) of their requests: one hop per loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[TokenDelta]] = {}
        for delta in deltas:
            entry = self._sinks.get(delta.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append(delta)
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._dispatch, batch)
            except RuntimeError:  # that loop has closed: nobody is listening there any more
                pass

    def _dispatch(self, deltas: list[TokenDelta]) -> None:
        """On the event loop: each delta to its request's sink (a request's last delta retires its sink)."""
        for delta in deltas:
            entry = self._sinks.get(delta.request_id)
            if entry is None:
                continue
            if delta.finished:
                del self._sinks[delta.request_id]
            entry[1](delta)

    def _fail_everyone(self, error: BaseException) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[str]] = {}
        for rid, (loop, _) in list(self._sinks.items()):
            by_loop.setdefault(loop, []).append(rid)

        def fail(rids: list[str]) -> None:
            for rid in rids:
                entry = self._sinks.pop(rid, None)
                if entry is not None:
                    entry[1](error)

        for loop, rids in by_loop.items():
            try:
                loop.call_soon_threadsafe(fail, rids)
            except RuntimeError:
                pass

    # ---------------------------------------------------------------- event-loop side

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def check_health(self) -> None:
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")

    def submit(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future:
        """Runs `fn(core)` on the engine thread; returns a concurrent future."""
        self.check_health()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        self._wake.set()
        return future

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    async def start_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        sink: Sink,
        hold_kv: bool = False,
        kv_import: KVImport | None = None,
        session_id: str | None = None,
        resume: Sequence[int] = (),
    ) -> None:
        """Adds a request (ValueError at once for invalid input) whose deltas are passed to `sink` on this
        event loop, ending with the one whose `finish_reason` is set (or an `EngineDeadError`).

        An id that already has a sink here is refused before anything is touched: a duplicate must never
        take over (or drop) the running request's deltas."""
        if request_id in self._sinks:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._sinks[request_id] = (asyncio.get_running_loop(), sink)
        try:
            self.check_health()
            await self.call(lambda c: c.add_request(request_id, prompt_token_ids, params, hold_kv, kv_import, session_id, resume))
        except BaseException:
            self._drop_sink(request_id, sink)
            raise

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, **kw) -> "RequestStream":
        """`start_request` with the deltas as an async iterator."""
        q: asyncio.Queue = asyncio.Queue()
        await self.start_request(request_id, prompt_token_ids, params, q.put_nowait, **kw)
        return RequestStream(self, request_id, q)

    def _drop_sink(self, request_id: str, sink: Sink) -> None:
        """Forgets `request_id`'s sink only if it is still `sink`."""
        entry = self._sinks.get(request_id)
        if entry is not None and entry[1] == sink:
            del self._sinks[request_id]

    def forget(self, request_id: str, sink: Sink) -> None:
        """Stops passing `request_id`'s deltas to `sink` and aborts the request if it still runs."""
        entry = self._sinks.get(request_id)
        if entry is None or entry[1] != sink:
            return  # finished already (its last delta retired the sink), or not ours
        del self._sinks[request_id]
        if self.healthy:
            self.submit(lambda c: c.abort(request_id))

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, **kw) -> AsyncIterator[TokenDelta]:
        stream = await self.add_request(request_id, prompt_token_ids, params, **kw)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        await self.call(lambda c: c.abort(request_id))

    def take_staged(self, request_id: str):
        """A finished `hold_kv` request's staged KV (`EngineCore.take_staged`; thread-safe, no engine call)."""
        return self.core.take_staged(request_id)

    def import_from_block_now(self, request_id: str) -> int | None:
        """`EngineCore.import_from_block`, read from this thread without an engine call (it waits for a
        step boundary): set when the request was added (whose call has returned), and one dict lookup."""
        return self.core.import_from_block(request_id)

    async def import_chunk(self, request_id: str, kind: str, block_start: int, layer_start: int, data, finish: bool = False) -> bool:
        """Writes one KV chunk ("kv" or "state"); with `finish`, also marks the KV ready, in the same engine call."""

        def write(c) -> bool:
            done = c.import_state(request_id, data) if kind == "state" else c.import_kv(request_id, block_start, layer_start, data)
            return done and (not finish or c.finish_import(request_id))

        return await self.call(write)

    async def release_kv(self, request_id: str) -> bool:
        return await self.call(lambda c: c.release_kv(request_id))

    def stats(self) -> EngineStats:
        """A snapshot read from another thread: counters may be one step stale, never torn."""
        return self.core.stats()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)


class RequestStream:
    """Async iterator over one request's deltas; closing it before the end aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, q: asyncio.Queue):
        self.engine, self.request_id, self._q = engine, request_id, q
        self.finished = False
        self.closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> TokenDelta:
        if self.finished or self.closed:
            raise StopAsyncIteration
        item = await self._q.get()
        if isinstance(item, BaseException):
            self.closed = True
            raise item
        self.finished = item.finished
        return item

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self.engine.forget(self.request_id, self._q.put_nowait)
