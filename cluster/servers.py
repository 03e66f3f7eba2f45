"""Serve deployments for the worker pools: each replica is one engine (a `workers.worker` class).

A replica's worker id is its Serve replica id, so the router's choice can be honoured by
`targeting.TargetedRequestRouter`. Every replica reports its load and KV events to the router
(`Ingress.report`) a few times a second, or straight to Redis when the cluster uses a Redis index.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Awaitable, Callable, TypeVar

from ray import serve

from workers.engine.sampling_params import SamplingParams
from workers.worker import DecodeWorker, EngineWorker, PrefillResult, PrefillWorker, StreamUpdate

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
        self, request_id: str, prompt: list[int], params: SamplingParams, target_replica: str | None = None, session_id: str | None = None
    ):
        self._arrived(target_replica)
        async for out in self.worker.generate(request_id, prompt, params, session_id=session_id):
            yield StreamUpdate.of(out)

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
        self, request_id: str, prompt: list[int], params: SamplingParams, target_replica: str | None = None, session_id: str | None = None
    ) -> PrefillResult:
        self._arrived(target_replica)
        return await self.worker.prefill(request_id, prompt, params, session_id=session_id)

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
    ):
        self._arrived(target_replica)
        source = handoff.worker_id

        async def fetch_chunk(layer_start: int, layer_end: int):
            return await self.prefill_handle.kv_chunk.remote(request_id, layer_start, layer_end, target_replica=source)

        def release():
            # Outside this request's context: it runs exactly when this request is being cancelled, and
            # Serve cancels a cancelled request's child calls (the prefill side would keep the KV).
            return detached(lambda: self.prefill_handle.release.remote(request_id, target_replica=source))

        async for out in self.worker.generate_from_prefill(
            request_id, prompt, params, handoff, fetch_chunk, release, session_id=session_id
        ):
            yield StreamUpdate.of(out)
