"""`AsyncEngine`: the engine core on a background thread, with asyncio streams per request.

The core stays single-threaded: every call from the event loop (add, abort, KV export/import) is
queued and run on the engine thread between steps. Outputs go back to each request's asyncio queue.
Leaving a `generate` stream early (client disconnect, cancellation) aborts the request and frees its
KV blocks at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import AsyncIterator, Callable, Sequence, TypeVar

from .config import EngineConfig
from .engine import EngineCore, EngineStats, KVImport, RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger("moray.engine")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; the worker must be restarted."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True, core: EngineCore | None = None):
        self.core = core or EngineCore(config, show_progress=show_progress)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
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
                    for out in self.core.step():
                        self._deliver(out.request_id, out)
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - the thread must report, not vanish
            log.exception("engine thread failed")
            self.error = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine failed: {e}"))

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

    def _deliver(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

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

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        hold_kv: bool = False,
        kv_import: KVImport | None = None,
        session_id: str | None = None,
    ) -> "RequestStream":
        """Adds a request (ValueError at once for invalid input) and returns its output stream.

        An id that already has a stream here is refused before anything is touched: a duplicate must never
        take over (or drop) the running request's stream."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        try:
            await self.call(lambda c: c.add_request(request_id, prompt_token_ids, params, hold_kv, kv_import, session_id=session_id))
        except BaseException:
            self._drop_stream(request_id, q)
            raise
        return RequestStream(self, request_id, q)

    def _drop_stream(self, request_id: str, q: asyncio.Queue) -> None:
        """Forgets `request_id`'s stream only if it is still the one with queue `q`."""
        entry = self._streams.get(request_id)
        if entry is not None and entry[1] is q:
            del self._streams[request_id]

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, **kw
    ) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt_token_ids, params, **kw)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        await self.call(lambda c: c.abort(request_id))

    async def export_kv(self, request_id: str, layer_start: int, layer_end: int):
        return await self.call(lambda c: c.export_kv(request_id, layer_start, layer_end))

    async def import_kv(self, request_id: str, layer_start: int, data) -> bool:
        return await self.call(lambda c: c.import_kv(request_id, layer_start, data))

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
    """Async iterator over one request's outputs; closing it before the end aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, q: asyncio.Queue):
        self.engine, self.request_id, self._q = engine, request_id, q
        self.finished = False
        self.closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
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
        self.engine._drop_stream(self.request_id, self._q)
        if not self.finished and self.engine.healthy:
            self.engine.submit(lambda c: c.abort(self.request_id))
