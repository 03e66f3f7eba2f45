"""Serve deployments for the worker pools: each replica is one engine (a `workers.worker` class).

A replica's worker id is its Serve replica id, so the router's choice can be honoured by
`targeting.TargetedRequestRouter`. Every replica reports its load and KV events to the router
(`Ingress.report`) a few times a second, or straight to Redis when the cluster uses a Redis index.
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from workers.engine.sampling_params import SamplingParams
from workers.worker import DecodeWorker, EngineWorker, PrefillResult, PrefillWorker

from .config import ClusterConfig, parse_cluster_config
from .reporting import WorkerReporter

log = logging.getLogger("moray.cluster")


class _WorkerServer:
    pool: str

    def _start(self, cluster_config: dict, make_worker):
        self.config: ClusterConfig = parse_cluster_config(cluster_config)
        context = serve.get_replica_context()
        self.worker_id = context.replica_id.unique_id
        engine_config = self.config.engine_for(self.pool, self.worker_id)
        log.info("%s replica %s: loading %s", self.pool, self.worker_id, engine_config.model)
        self.worker: EngineWorker = make_worker(engine_config)
        self.reporter = WorkerReporter(self.config, self.worker, context.app_name)
        self.reporter.start()

    async def check_health(self) -> None:
        """Serve's health probe: a dead engine thread marks the replica unhealthy (it is replaced)."""
        self.worker.engine.check_health()

    async def load(self, target_replica: str | None = None) -> dict:
        return self.worker.load()

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, target_replica: str | None = None):
        async for out in self.worker.generate(request_id, prompt, params):
            yield out

    def __del__(self):
        try:
            self.reporter.stop()
            self.worker.engine.shutdown()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass


class PrefillServer(_WorkerServer):
    pool = "prefill"

    def __init__(self, cluster_config: dict):
        self._start(cluster_config, lambda cfg: PrefillWorker(cfg))

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, target_replica: str | None = None) -> PrefillResult:
        return await self.worker.prefill(request_id, prompt, params)

    async def kv_chunk(self, request_id: str, layer_start: int, layer_end: int, target_replica: str | None = None):
        return await self.worker.kv_chunk(request_id, layer_start, layer_end)

    async def release(self, request_id: str, target_replica: str | None = None) -> bool:
        return await self.worker.release(request_id)


class DecodeServer(_WorkerServer):
    pool = "decode"

    def __init__(self, cluster_config: dict, prefill_handle=None):
        self.prefill_handle = prefill_handle
        self._start(cluster_config, lambda cfg: DecodeWorker(cfg, layers_per_chunk=self.config.handoff_layers_per_chunk))

    async def generate_from_prefill(
        self, request_id: str, prompt: list[int], params: SamplingParams, handoff: PrefillResult, target_replica: str | None = None
    ):
        source = handoff.worker_id

        async def fetch_chunk(layer_start: int, layer_end: int):
            return await self.prefill_handle.kv_chunk.remote(request_id, layer_start, layer_end, target_replica=source)

        async def release():
            return await self.prefill_handle.release.remote(request_id, target_replica=source)

        async for out in self.worker.generate_from_prefill(request_id, prompt, params, handoff, fetch_chunk, release):
            yield out


