"""The front end's view of the router: decisions, the reports workers send it, and which workers are live.

Wraps `cluster.router.Router` (index + policy). With the in-memory index, workers' KV events and loads
arrive through `report`; with a Redis index the workers write them to Redis themselves (see
`reporting.py`) and `report` only refreshes this replica's view of worker health for /health.

A worker leaves in one of two ways: a call to it fails because it is gone (`worker_failed`, from the
orchestrator: routing, /health and /metrics drop it at once), or its heartbeat expires. Either way the
listeners registered with `on_worker_gone` hear of it once (the ingress removes its metric series).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from workers.engine.kv_events import KVEvent

from .config import ClusterConfig
from .router.router import Router
from .router.types import IndexUnavailable, NoWorkersAvailable, RouteDecision, RouteRequest, WorkerLoad

log = logging.getLogger("moray.cluster")


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
        # When the worker measured it: a report that was in flight when the worker died is older than
        # the failure that dropped it, so it cannot bring the worker back.
        ts=load.get("ts") or time.time(),
        sparse_blocks=bool(load.get("sparse_blocks", False)),  # hybrid engines: boundary blocks only
    )


class ClusterRouter:
    def __init__(self, cfg: ClusterConfig):
        self.uses_redis = cfg.kv_index.backend != "memory"
        self.router = Router.from_config(cfg.router, cfg.kv_index, cfg.engine.model_name, cfg.engine.block_size)
        self.heartbeat_ttl_s = cfg.router.heartbeat_ttl_s
        self._maintain_every_s = cfg.router.heartbeat_ttl_s
        self._last_maintain = time.monotonic()
        self._reported: dict[str, float] = {}  # worker -> when its last report arrived (monotonic)
        self._roles: dict[str, str] = {}  # worker -> role, from its reports
        self._gone_listeners: list[Callable[[str], None]] = []

    def route(self, request: RouteRequest) -> RouteDecision:
        return self.router.route(request)

    async def aroute(self, request: RouteRequest) -> RouteDecision:
        return await self.router.aroute(request)

    @property
    def speculative_renew_s(self) -> float:
        """How often a request still waiting for its first token has its speculative entries renewed
        (0: never): half their lifetime, so they never lapse in between."""
        return self.router.config.speculative_ttl_s / 2

    def renew_speculative(self, request: RouteRequest, decision: RouteDecision) -> None:
        self.router.renew_speculative(request, decision)

    # ------------------------------------------------------------------ membership

    def on_worker_gone(self, listener: Callable[[str], None]) -> None:
        """`listener(worker_id)` is called when a worker failed or its heartbeat expired."""
        self._gone_listeners.append(listener)

    def _gone(self, worker_id: str) -> None:
        self._reported.pop(worker_id, None)
        for listener in self._gone_listeners:
            try:
                listener(worker_id)
            except Exception:  # noqa: BLE001 - bookkeeping must not break a request
                log.exception("worker-gone listener failed")

    def worker_failed(self, worker_id: str) -> None:
        """A call to the worker failed because it is gone: stop routing to it and stop counting it live."""
        if self.router.worker_failed(worker_id):
            log.warning("worker %s failed: dropped from routing and /health", worker_id)
            self._gone(worker_id)

    def is_failed(self, worker_id: str) -> bool:
        return self.router.is_failed(worker_id)

    def role(self, worker_id: str) -> str | None:
        """The role a worker reported ("prefill", "decode", "both"), None if it never reported here."""
        return self._roles.get(worker_id)

    def expire(self) -> list[str]:
        """Workers whose last report is older than the heartbeat TTL leave (series, gauges)."""
        horizon = time.monotonic() - self.heartbeat_ttl_s
        expired = [w for w, at in self._reported.items() if at < horizon]
        for w in expired:
            self._gone(w)
        return expired

    # ------------------------------------------------------------------ reports

    def report(self, load: dict, events: list[KVEvent]) -> None:
        worker = load["worker_id"]
        self._roles[worker] = load["role"]
        self.router.heartbeat_seen(worker, load.get("ts") or time.time())
        if not self.router.is_failed(worker):
            self._reported[worker] = time.monotonic()
        if time.monotonic() - self._last_maintain > self._maintain_every_s:
            self._last_maintain = time.monotonic()
            self.expire()
            self.router.maintain()  # forget workers whose heartbeats stopped
        if not self.uses_redis:
            if events:
                self.router.index.apply(events)
            self.router.index.heartbeat(worker_load(load))
        self.router.refresh_load_gauges()  # at most once a second; between decisions too

    def record_reuse(self, tokens: int) -> None:
        self.router.record_reuse(tokens)

    def registries(self):
        """The router's registries for /metrics, brought up to date first (expired workers leave)."""
        self.expire()
        self.router.refresh_load_gauges()
        return [self.router.metrics.registry]


def build_router(cfg: ClusterConfig) -> ClusterRouter:
    return ClusterRouter(cfg)


__all__ = ["ClusterRouter", "IndexUnavailable", "NoWorkersAvailable", "build_router", "worker_load"]
