"""The front end's view of the router: decisions, and the reports workers send it.

Wraps `cluster.router.Router` (index + policy). With the in-memory index, workers' KV events and loads
arrive through `report`; with a Redis index the workers write them to Redis themselves (see
`reporting.py`) and `report` only refreshes this replica's view of worker health for /health.
"""

from __future__ import annotations

import time

from workers.engine.kv_events import KVEvent

from .config import ClusterConfig
from .router.router import Router
from .router.types import NoWorkersAvailable, RouteDecision, RouteRequest, WorkerLoad


def worker_load(load: dict) -> WorkerLoad:
    """The router's load record from a worker's report (`workers.worker.EngineWorker.load`)."""
    return WorkerLoad(
        worker_id=load["worker_id"],
        role=load["role"],
        inflight_prefill_tokens=load["pending_prefill_tokens"],
        active_decode_blocks=load["num_total_blocks"] - load["num_free_blocks"],
        kv_usage=load["kv_usage"],
        num_waiting=load["num_waiting"],
        epoch=load["epoch"],
        last_seq=load["last_seq"],
        ts=time.time(),
        sparse_blocks=bool(load.get("sparse_blocks", False)),  # hybrid engines: boundary blocks only
    )


class ClusterRouter:
    def __init__(self, cfg: ClusterConfig):
        self.uses_redis = cfg.kv_index.backend != "memory"
        self.router = Router.from_config(cfg.router, cfg.kv_index, cfg.engine.model_name, cfg.engine.block_size)
        self._maintain_every_s = cfg.router.heartbeat_ttl_s
        self._last_maintain = time.monotonic()

    def route(self, request: RouteRequest) -> RouteDecision:
        return self.router.route(request)

    async def aroute(self, request: RouteRequest) -> RouteDecision:
        return await self.router.aroute(request)

    def report(self, load: dict, events: list[KVEvent]) -> None:
        if time.monotonic() - self._last_maintain > self._maintain_every_s:
            self._last_maintain = time.monotonic()
            self.router.maintain()  # forget workers whose heartbeats stopped
        if self.uses_redis:
            return  # the worker's own sink keeps Redis current
        if events:
            self.router.index.apply(events)
        self.router.index.heartbeat(worker_load(load))

    def record_reuse(self, tokens: int) -> None:
        self.router.record_reuse(tokens)

    def registries(self):
        return [self.router.metrics.registry]


def build_router(cfg: ClusterConfig) -> ClusterRouter:
    return ClusterRouter(cfg)


__all__ = ["ClusterRouter", "NoWorkersAvailable", "build_router", "worker_load"]
