"""Shared test doubles for the serving path, in one place (no test module keeps a copy).

- `LocalHandle`: a Serve deployment handle over objects in this process (`target_replica` picks one): the
  real servers, the real registry, calls recorded.
- `FakeEngineWorker`: stands in for `workers.worker`'s prefill and decode workers (no engine): tokens on a
  timer, a number of slots, and `kill()` as a killed replica fails (its calls raise ActorDiedError, its
  channels break or, `quietly`, just end). Its channels are the real `workers.outbox.Outbox`.
- `serving(...)`: the real front end (request pipeline, orchestrator, router, channels) over the real
  `PrefillServer` / `DecodeServer` / `Registry` classes wrapping fake workers, every worker registered.
- `heartbeat(...)`: a worker's heartbeat message, idle unless told otherwise.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from cluster_harness import API_KEY, cluster_config
from ray.exceptions import ActorDiedError

from workers.kv_transfer import ImportStats, import_chunks
from workers.messages import (
    EngineStats,
    HandoffCounters,
    KVChunk,
    PrefillHandoff,
    TokenDelta,
    WorkerHeartbeat,
    WorkerReport,
)
from workers.outbox import ChannelClosed, Outbox
from workers.worker import WorkerCounters

# ============================================================================ handles


class LocalResponse:
    """A unary Serve response: awaitable once, `.result()`, cancellable."""

    def __init__(self, coro, on_cancel=None):
        self._coro, self._on_cancel, self._task = coro, on_cancel, None

    def __await__(self):
        return self._coro.__await__()

    def result(self, timeout_s=None):
        return asyncio.run(self._coro)

    def cancel(self):
        if self._on_cancel is not None:
            self._on_cancel()


class LocalStream:
    """A streaming Serve response: an async iterator, cancellable."""

    def __init__(self, agen):
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self):
        asyncio.ensure_future(self.agen.aclose())


class LocalHandle:
    """`handle.method.remote(*args, target_replica=...)` on one object, or on one of a dict of replicas
    (a target that is not there raises ActorDiedError, as a dead replica's call does). `calls` records
    (method, args, kwargs)."""

    def __init__(self, replicas: dict[str, Any] | Any):
        self.replicas = replicas
        self.calls: list[tuple[str, tuple, dict]] = []

    def options(self, **_):
        return self

    def __getattr__(self, method: str):
        handle = self

        class Method:
            @staticmethod
            def remote(*args, **kwargs):
                handle.calls.append((method, args, kwargs))
                target = handle.replicas
                if isinstance(target, dict):
                    replica = target.get(kwargs.get("target_replica"))
                    if replica is None:
                        return LocalResponse(_raise(ActorDiedError()))
                    target = replica
                result = getattr(target, method)(*args, **kwargs)
                if inspect.isasyncgen(result):
                    return LocalStream(result)
                return LocalResponse(result if inspect.iscoroutine(result) else _value(result))

        return Method()


async def _raise(e):
    raise e


async def _value(v):
    return v


# ============================================================================ workers


def heartbeat(worker: str, role: str = "decode", ts: float | None = None, **engine) -> WorkerHeartbeat:
    """A worker's heartbeat, idle unless told otherwise (`engine`: EngineStats fields)."""
    stats = EngineStats(**{"num_free_blocks": 100, "num_total_blocks": 100, "kv_event_epoch": 1, **engine})
    return WorkerHeartbeat(worker, role, time.time() if ts is None else ts, engine=stats)


class FakeEngineWorker:
    """A prefill or decode worker without an engine: `slots` requests run at once (the rest wait for a slot:
    no token yet; 0: nothing ever starts), one token every `delay` seconds. A prefill answers with token 42
    ("first "); decode tokens are 100 + i with text f"t{i} ". `fail_decode`: the decode side breaks with a
    RuntimeError instead of its first token."""

    def __init__(self, wid: str, role: str = "decode", slots: int = 8, delay: float = 0.005, fail_decode: bool = False):
        self.worker_id, self.role, self.delay, self.fail_decode = wid, role, delay, fail_decode
        self.slots_n = slots
        self._slots: asyncio.Semaphore | None = None
        self._dead: asyncio.Event | None = None
        self.quiet = False
        self.counters = WorkerCounters()
        self.channels: dict[str, Outbox] = {}
        self._running: dict[str, tuple[asyncio.Task, Outbox, Any]] = {}
        self.started: list[str] = []  # decode requests that got a slot
        self.aborted: list[str] = []
        self.released: list[str] = []
        self.prefilled: list[str] = []
        self.requests: list = []  # every PrefillRequest / DecodeRequest received
        self.tokens_out = 0  # decode deltas sent
        self.linger_s = 2.0  # an idle channel's life (workers' channel_linger_s)
        self.closing_delay_s = 0.0  # how long its `closing` batch takes to reach the front end
        self.start_delay_s = 0.0  # how long a decode start takes to reach the worker

    @property
    def dead(self) -> asyncio.Event:
        if self._dead is None:
            self._dead = asyncio.Event()
        return self._dead

    def kill(self, quietly: bool = False) -> None:
        """`quietly`: its channels end as if complete (a killed replica's Serve stream sometimes does)."""
        self.quiet = quietly
        self.dead.set()

    def heartbeat(self) -> WorkerHeartbeat:
        return replace(heartbeat(self.worker_id, self.role), handoff=HandoffCounters(), misrouted=self.counters.misrouted)

    async def _alive(self, aw):
        """Awaits `aw`, raising ActorDiedError as soon as the worker dies."""
        task = asyncio.ensure_future(aw)
        death = asyncio.ensure_future(self.dead.wait())
        try:
            done, _ = await asyncio.wait({task, death}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            death.cancel()
        if task in done:
            return task.result()
        task.cancel()
        raise ActorDiedError()

    # ---------------------------------------------------------------- prefill side

    async def prefill(self, request) -> PrefillHandoff:
        self.requests.append(request)
        if self.dead.is_set():
            raise ActorDiedError()
        await self._alive(asyncio.sleep(self.delay))
        self.prefilled.append(request.request_id)
        first = TokenDelta(request.request_id, [42], "first ", 1, 0)
        chunks = [KVChunk.of(request.request_id, i, "kv", i, i + 1, 0, 1, np.zeros((1, 32), np.float32)) for i in range(2)]
        return PrefillHandoff(
            request.request_id,
            self.worker_id,
            first,
            len(request.prompt),
            tuple(c.header for c in chunks),
            tuple(c.data for c in chunks),
            "local",
        )

    async def release(self, request_id: str) -> bool:
        self.released.append(request_id)
        return True

    # ---------------------------------------------------------------- decode side

    async def channel(self, channel_id: str):
        if self.dead.is_set():
            raise ActorDiedError()
        outbox = self.channels[channel_id] = Outbox(
            self.worker_id, self.linger_s, lambda: any(o is outbox for _, o, _ in self._running.values())
        )
        batches = outbox.batches()
        try:
            while True:
                try:
                    batch = await self._alive(anext(batches))
                except StopAsyncIteration:
                    return
                except ActorDiedError:
                    if self.quiet:
                        return
                    raise
                if batch.closing:
                    await asyncio.sleep(self.closing_delay_s)
                yield batch
        finally:
            for rid in [r for r, (_, o, _) in self._running.items() if o is outbox]:
                self.abort(rid)

    async def start(self, request, fetch_chunk=None, release=None, on_end=None, on_import=None) -> None:
        self.requests.append(request)
        await asyncio.sleep(self.start_delay_s)
        if self.dead.is_set():
            raise ActorDiedError()
        if request.request_id in self._running:  # as the real engine refuses it (a 400 at the front end)
            raise ValueError(f"request id {request.request_id!r} is already in use")
        outbox = self.channels.get(request.channel)
        if outbox is None or outbox.closed:
            raise ChannelClosed(request.channel)
        task = asyncio.ensure_future(self._decode(request, outbox, fetch_chunk, release, on_end, on_import))
        self._running[request.request_id] = (task, outbox, on_end)

    def abort(self, request_id: str, target_replica=None) -> None:
        run = self._running.pop(request_id, None)
        if run is not None:
            self.aborted.append(request_id)
            run[0].cancel()
            if run[2] is not None:
                run[2](None, None)

    async def _decode(self, request, outbox: Outbox, fetch_chunk, release, on_end, on_import=None) -> None:
        rid, params = request.request_id, request.params
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.slots_n) if self.slots_n else None
        acquired = False
        try:
            if self._slots is None:
                await self._alive(asyncio.Event().wait())  # slots=0: never starts
            await self._alive(self._slots.acquire())
            acquired = True
            self.started.append(rid)
            if request.handoff is not None and request.handoff.chunks:
                start = time.perf_counter()
                fetch = fetch_chunk or (lambda header, handle: asyncio.sleep(0, handle))
                stats = ImportStats()
                await import_chunks(
                    request.handoff.chunks, request.handoff.sources, 0, fetch, lambda h, d, last: asyncio.sleep(0, True), stats
                )
                if on_import is not None:
                    on_import(stats, time.perf_counter() - start, None)
                if release is not None:
                    await release()
            if self.fail_decode:
                error = RuntimeError("the decode step broke")
                outbox.put(error)
                if on_end is not None:
                    on_end(None, error)
                return
            # Token i is 100 + i, text "t{i} ", whichever worker makes it: a migrated request (resume) goes on
            # exactly where the dead one stopped, as a real engine's greedy output does.
            first = len(request.resume) or (1 if request.handoff is not None else 0)
            for i in range(first, params.max_tokens):
                await self._alive(asyncio.sleep(self.delay))
                done = i == params.max_tokens - 1
                delta = TokenDelta(rid, [100 + i], f"t{i} ", i + 1, 0, "length" if done else None)
                outbox.put(delta)
                self.tokens_out += 1
                if done:
                    self._running.pop(rid, None)
                    outbox.request_ended()
                    if on_end is not None:
                        on_end(delta, None)
        except ActorDiedError:
            pass  # the channel breaks (or ends, quietly) for everyone on it
        finally:
            if acquired:
                self._slots.release()


# ============================================================================ the serving path in process


def prefill_server(worker: FakeEngineWorker):
    from cluster.servers import PrefillServer

    server = object.__new__(PrefillServer)
    server.worker, server.worker_id = worker, worker.worker_id
    return server


def decode_server(worker: FakeEngineWorker, prefill_handle=None, direct: bool = False):
    """`direct`: it offers direct channels (a real socket on loopback: cluster/direct_stream.py)."""
    from cluster.handles import PrefillPool
    from cluster.servers import DecodeServer

    server = object.__new__(DecodeServer)
    server.worker, server.worker_id = worker, worker.worker_id
    server.prefill = PrefillPool(prefill_handle) if prefill_handle is not None else None
    if direct:
        server.serve_direct("127.0.0.1")
    return server


class Serving:
    """The real front end over fake workers in process: `frontend`, its `pipeline`, the `registry`, the
    handles (with their recorded calls) and the workers."""

    def __init__(self, frontend, registry, prefill: LocalHandle | None, decode: LocalHandle, workers: list[FakeEngineWorker]):
        self.frontend, self.pipeline, self.registry = frontend, frontend.pipeline, registry
        self.prefill_handle, self.decode_handle, self.workers = prefill, decode, workers

    async def report(self, *workers: FakeEngineWorker) -> None:
        """The workers' heartbeats reach the registry, and the front end's view follows."""
        for w in workers or self.workers:
            await self.registry.report(WorkerReport(w.heartbeat()))
        await self.pipeline.refresh_membership()

    def metric(self, name: str, labels: dict | None = None) -> float | None:
        if name.startswith("vllm:"):  # vLLM's names carry the model
            labels = {"model_name": self.pipeline.model_name, **(labels or {})}
        value = self.pipeline.metrics.registry.get_sample_value(name, labels or {})
        if value is None:
            value = self.registry.worker_metrics.registry.get_sample_value(name, labels or {})
        return value


async def serving(
    model_dir: Path,
    prefill: list[FakeEngineWorker],
    decode: list[FakeEngineWorker],
    router: dict | None = None,
    direct: bool = False,
    **overrides,
) -> Serving:
    """`overrides`: cluster config sections (`server={...}`, `observability={...}`, ...). Colocated when
    there is no prefill worker. Round-robin routing unless `router` says otherwise. `direct`: the decode
    servers offer direct channels and the front end takes them (else the channels are Serve streams)."""
    from cluster.frontend import Frontend
    from cluster.registry import Registry

    mode = {"mode": "colocated"} if not prefill else {}
    router = {"policy": "round-robin", "remote_prefill_min_tokens": 0, **(router or {})}
    transport = "direct" if direct else "serve"
    cfg = cluster_config(model_dir, name=overrides.pop("name", "fake"), router=router, stream_transport=transport, **mode, **overrides)
    registry = Registry(cfg)
    prefill_handle = LocalHandle({w.worker_id: prefill_server(w) for w in prefill}) if prefill else None
    decode_handle = LocalHandle({w.worker_id: decode_server(w, prefill_handle, direct) for w in decode})
    frontend = Frontend.func_or_class.__bases__[0](cfg, prefill_handle, decode_handle, LocalHandle(registry))
    s = Serving(frontend, registry, prefill_handle, decode_handle, [*prefill, *decode])
    await s.report()
    return s


# ============================================================================ HTTP and gRPC in process


def http_request(body: dict, path: str = "/v1/completions", headers: dict | None = None, stay: bool = True):
    """A starlette Request carrying `body`. `stay`: the client stays connected until the response ends."""
    from starlette.requests import Request

    raw = json.dumps(body).encode()
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            if stay:
                await asyncio.Event().wait()  # the client stays until we stop reading
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    h = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json", "content-length": str(len(raw)), **(headers or {})}
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(k.encode(), v.encode()) for k, v in h.items()],
        "query_string": b"",
    }
    return Request(scope, receive)


class FakeContext:
    """A gRPC servicer context: the status a method set, and the client's metadata."""

    def __init__(self):
        self.code, self.details = None, None

    def invocation_metadata(self):
        return [("authorization", f"Bearer {API_KEY}")]

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


async def sse_events(response, stop_after: int | None = None) -> list:
    """The SSE events of a StreamingResponse (parsed JSON, or the string "[DONE]")."""
    events = []
    async for part in response.body_iterator:
        text = part.decode() if isinstance(part, bytes) else part
        for line in text.splitlines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
        if stop_after is not None and len(events) >= stop_after:
            await response.body_iterator.aclose()  # the client leaves
            break
    return events


def body_of(response) -> dict:
    return json.loads(response.body)


def run(coro, timeout: float = 60):
    """asyncio.run with a limit: a request that never ends fails the test instead of hanging it."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(predicate, timeout: float = 10.0, every: float = 0.005) -> None:
    """Waits (asynchronously) until `predicate()` holds; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(every)


# ============================================================================ a front end without workers


class ScriptedOrchestrator:
    """Stands in for the pipeline's orchestrator: routes nowhere and streams `script` (TokenDeltas; an
    exception in it is raised there), or `tokens` deltas of token 7, or raises `error` before the first."""

    def __init__(self, script: list | None = None, *, error: BaseException | None = None, tokens: int = 3, delay: float = 0.0):
        if script is None:
            script = (
                []
                if error is not None
                else [TokenDelta("r", [7], "x", i + 1, 0, "length" if i == tokens - 1 else None) for i in range(tokens)]
            )
        self.script, self.error, self.delay = script, error, delay
        self.ids: list[str] = []
        self.queued = 0

    async def route(self, request_id, prompt, session_id, span=None):
        from types import SimpleNamespace

        return SimpleNamespace(prefill_worker=None, decode_worker="d")

    async def stream(self, request_id, prompt, params, decision, trace, session_id=None, whole=False):
        self.ids.append(request_id)
        if self.error is not None:
            raise self.error
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            await asyncio.sleep(self.delay)
            yield replace(item, request_id=request_id)


def frontend_without_workers(model_dir: Path, **overrides):
    """The real front end with a registry and no worker (set `pipeline.orchestrator` to script one)."""
    from cluster.frontend import Frontend
    from cluster.registry import Registry

    cfg = cluster_config(model_dir, name=overrides.pop("name", "inproc"), **overrides)
    return Frontend.func_or_class.__bases__[0](cfg, None, LocalHandle({}), LocalHandle(Registry(cfg)))
