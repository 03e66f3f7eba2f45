"""Serve deployments for the worker pools: each replica is one engine (a `workers.worker` class).

A replica's worker id is its Serve replica id, so the router's choice can be honoured by
`targeting.TargetedRequestRouter`. Every replica reports its load and KV events to the router
(`Ingress.report`) a few times a second, or straight to Redis when the cluster uses a Redis index.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from contextlib import aclosing
from typing import Awaitable, Callable, TypeVar

from ray import serve

from workers.engine.sampling_params import SamplingParams
from workers.worker import DecodeWorker, EngineWorker, PrefillResult, PrefillWorker, StreamUpdate

from . import logs, tracing
from .config import ClusterConfig, parse_cluster_config
from .reporting import WorkerReporter

log = logging.getLogger("moray.cluster")
T = TypeVar("T")


def detached(call: Callable[[], Awaitable[T]]) -> Awaitable[T]:
    """Makes and awaits a Serve handle call in a fresh context, so that it is no child of the request
    being served (Serve cancels those when that request is cancelled); shielded from our own caller's
    cancellation too."""

    async def run() -> T:
        return await call()

    task = asyncio.get_running_loop().create_task(run(), context=contextvars.Context())
    _detached_tasks.add(task)  # kept alive even when nobody awaits it any more
    task.add_done_callback(_detached_tasks.discard)
    return asyncio.shield(task)


_detached_tasks: set[asyncio.Task] = set()


class _WorkerServer:
    pool: str

    def _start(self, cluster_config: dict, make_worker):
        self.config: ClusterConfig = parse_cluster_config(cluster_config)
        logs.configure(self.config.observability)
        tracing.configure(self.config.observability, self.pool)
        context = serve.get_replica_context()
        self.worker_id = context.replica_id.unique_id
        engine_config = self.config.engine_for(self.pool, self.worker_id)
        pool = getattr(self.config, self.pool)
        log.info("%s replica %s: loading %s", self.pool, self.worker_id, engine_config.model)
        self.followers = None
        engine = None
        if pool.hosts_per_replica > 1:
            from .multihost import start_multihost_engine

            engine, self.followers = start_multihost_engine(engine_config, pool)
        self.worker: EngineWorker = make_worker(engine_config, engine)
        self.reporter = WorkerReporter(self.config, self.worker, context.app_name)
        self.reporter.start()

    async def check_health(self) -> None:
        """Serve's health probe: a dead engine thread marks the replica unhealthy (it is replaced)."""
        self.worker.engine.check_health()
        if self.followers is not None:
            await self.followers.acheck()  # every host of a multi-host replica must be alive

    async def load(self, target_replica: str | None = None) -> dict:
        return self.worker.load()

    def _arrived(self, target_replica: str | None) -> None:
        """Counts calls meant for another replica (Serve fell back: the target was gone or full)."""
        if target_replica and target_replica != self.worker_id:
            self.worker.counters.misrouted += 1

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        target_replica: str | None = None,
        session_id: str | None = None,
        trace_context: dict[str, str] | None = None,
    ):
        """Prefill and decode here (colocated, or a prompt the router found not worth a remote prefill)."""
        self._arrived(target_replica)
        logs.current_request_id.set(request_id)
        span = self._decode_span(request_id, prompt, trace_context, remote_prefill=False)
        outputs = self.worker.generate(request_id, prompt, params, session_id=session_id)
        async with aclosing(_traced_updates(outputs, span)) as updates:
            async for update in updates:
                yield update

    def _decode_span(self, request_id: str, prompt: list[int], trace_context, remote_prefill: bool):
        attributes = {"moray.request_id": request_id, "moray.worker": self.worker_id, "moray.prompt_tokens": len(prompt)}
        return tracing.start_span("decode", tracing.extract(trace_context), {**attributes, "moray.remote_prefill": remote_prefill})

    def __del__(self):
        try:
            self.reporter.stop()
            self.worker.engine.shutdown()
            if self.followers is not None:
                self.followers.shutdown()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass


class PrefillServer(_WorkerServer):
    pool = "prefill"

    def __init__(self, cluster_config: dict):
        self._start(cluster_config, lambda cfg, engine: PrefillWorker(cfg, engine=engine))

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        target_replica: str | None = None,
        session_id: str | None = None,
        trace_context: dict[str, str] | None = None,
    ) -> PrefillResult:
        self._arrived(target_replica)
        logs.current_request_id.set(request_id)
        attributes = {"moray.request_id": request_id, "moray.worker": self.worker_id, "moray.prompt_tokens": len(prompt)}
        with tracing.span("prefill", tracing.extract(trace_context), attributes) as span:
            result = await self.worker.prefill(request_id, prompt, params, session_id=session_id)
            tracing.set_attributes(span, {"moray.cached_tokens": result.num_cached_tokens, "moray.finished": result.finished})
        return result

    async def kv_chunk(self, request_id: str, layer_start: int, layer_end: int, target_replica: str | None = None):
        return await self.worker.kv_chunk(request_id, layer_start, layer_end)

    async def release(self, request_id: str, target_replica: str | None = None) -> bool:
        return await self.worker.release(request_id)


class DecodeServer(_WorkerServer):
    pool = "decode"

    def __init__(self, cluster_config: dict, prefill_handle=None):
        self.prefill_handle = prefill_handle
        self._start(
            cluster_config, lambda cfg, engine: DecodeWorker(cfg, layers_per_chunk=self.config.handoff_layers_per_chunk, engine=engine)
        )

    async def generate_from_prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        handoff: PrefillResult,
        target_replica: str | None = None,
        session_id: str | None = None,
        trace_context: dict[str, str] | None = None,
    ):
        self._arrived(target_replica)
        logs.current_request_id.set(request_id)
        span = self._decode_span(request_id, prompt, trace_context, remote_prefill=True)
        source = handoff.worker_id

        async def fetch_chunk(layer_start: int, layer_end: int):
            return await self.prefill_handle.kv_chunk.remote(request_id, layer_start, layer_end, target_replica=source)

        def release():
            # Outside this request's context: it runs exactly when this request is being cancelled, and
            # Serve cancels a cancelled request's child calls (the prefill side would keep the KV).
            return detached(lambda: self.prefill_handle.release.remote(request_id, target_replica=source))

        fetch = tracing.traced_fetch(fetch_chunk, span, handoff.num_layers)  # the kv_handoff span
        outputs = self.worker.generate_from_prefill(request_id, prompt, params, handoff, fetch, release, session_id=session_id)
        async with aclosing(_traced_updates(outputs, span)) as updates:
            async for update in updates:
                yield update


async def _traced_updates(outputs, span):
    """The engine's outputs as `StreamUpdate`s; the decode span (None: tracing off) ends with the stream,
    carrying the tokens generated and the finish reason."""
    last = None
    failure = None
    try:
        async with aclosing(outputs):  # closed (the request aborted, its KV freed) with the stream, not by the GC
            async for out in outputs:
                last = StreamUpdate.of(out)
                yield last
    except BaseException as e:
        failure = e
        raise
    finally:
        if span is not None:
            done = {} if last is None else {"moray.completion_tokens": last.num_tokens, "moray.cached_tokens": last.num_cached_tokens}
            tracing.end_span(span, {**done, "moray.finish_reason": last.finish_reason if last else None}, error=failure)
