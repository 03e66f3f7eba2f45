"""Router metrics, in a Prometheus registry of their own that the ingress can serve at /metrics
(`prometheus_client.generate_latest(metrics.registry)`), or in a registry the caller passes in.

Cache effectiveness is three counters that only mean something together:
  cached_tokens_best    the most prefix tokens any live candidate held (what perfect affinity would get)
  cached_tokens_chosen  prefix tokens on the worker the router picked (what it expected to be reused)
  reused_tokens         what the engines actually reused (`Router.record_reuse`, from engine outputs'
                        num_cached_tokens)
best - chosen is the cache traded away for load balance; chosen - reused is index staleness.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .types import WorkerLoad

_LOAD_FIELDS = ("inflight_prefill_tokens", "active_decode_blocks", "kv_usage", "num_waiting")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, gauge_interval_s: float = 1.0, index_purges: bool = True):
        """`index_purges`: count the index's purges here (False when the index lives in another process,
        the membership registry, which counts them under the same name)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "moray_router_decisions", "routing decisions by policy and deciding branch", ["policy", "branch"], registry=r
        )
        self.prefill = Counter("moray_router_prefill", "decisions by where the prompt is prefilled", ["where"], registry=r)
        self.decision_seconds = Histogram(
            "moray_router_decision_seconds",
            "time to make one routing decision (index lookup included)",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.25),
            registry=r,
        )
        self.prompt_tokens = Counter("moray_router_prompt_tokens", "prompt tokens routed", registry=r)
        self.routed_tokens = Counter(
            "moray_router_routed_prompt_tokens", "prompt tokens routed to each decode worker", ["worker"], registry=r
        )
        self.cached_best = Counter("moray_router_cached_tokens_best", "cached prefix tokens on the best live candidate", registry=r)
        self.cached_chosen = Counter("moray_router_cached_tokens_chosen", "cached prefix tokens on the chosen worker", registry=r)
        self.reused = Counter("moray_router_reused_tokens", "prefix tokens the engines reported actually reused", registry=r)
        self.degraded = Counter(
            "moray_router_redis_degraded", "decisions made by load alone because the KV index was unavailable", registry=r
        )
        self.index_errors = Counter("moray_router_index_errors", "failed KV index calls", ["op"], registry=r)
        self.index_up = Gauge("moray_router_index_up", "1 while the KV index answers, 0 while degraded", registry=r)
        self.index_up.set(1)
        self.sequence_gaps = index_purges_counter(r) if index_purges else None
        self.index_lag = Gauge(
            "moray_router_index_lag_seconds", "age of a worker's KV events when they reached the index", ["worker"], registry=r
        )
        self.worker_load = Gauge("moray_router_worker_load", "last heartbeat load of each live worker", ["worker", "field"], registry=r)
        self.live_workers = Gauge("moray_router_live_workers", "workers with a fresh heartbeat", registry=r)
        self.worker_failures = Counter(
            "moray_router_worker_failures", "workers dropped at once because a call to them failed (actor died, engine stopped)", registry=r
        )
        self._gauge_interval_s = gauge_interval_s
        self._gauges_at = 0.0
        self._gauge_workers: set[str] = set()
        # Workers forgotten since their last heartbeat: KV events they sent before dying still reach the
        # index afterwards and must not bring their series back.
        self._gone: set[str] = set()
        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels: str):
        """`metric.labels(*labels)`, remembered: prometheus_client's lookup takes a lock and validates
        the labels on every call, a noticeable share of a decision's time."""
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def _forget_child(self, metric, *labels: str) -> None:
        _remove(metric, *labels)
        self._children.pop((id(metric), *labels), None)

    def on_purge(self, worker_id: str, reason: str) -> None:
        if self.sequence_gaps is not None:
            self.sequence_gaps.labels(worker_id, reason).inc()

    def observe_event_lag(self, worker_id: str, lag_s: float) -> None:
        if worker_id in self._gone:
            return
        self.child(self.index_lag, worker_id).set(max(0.0, lag_s))

    def load_gauges_due(self) -> bool:
        return time.monotonic() - self._gauges_at >= self._gauge_interval_s

    def maybe_update_loads(self, loads: dict[str, WorkerLoad], force: bool = False) -> None:
        """Per-worker gauges, refreshed at most once per interval (not on every decision; the router
        also refreshes them on heartbeats and maintenance, so they follow an idle cluster too)."""
        now = time.monotonic()
        if not force and now - self._gauges_at < self._gauge_interval_s:
            return
        self._gauges_at = now
        for w in self._gauge_workers - loads.keys():  # dead workers' series go away
            for f in _LOAD_FIELDS:
                _remove(self.worker_load, w, f)
        for (w,) in [k for k in self.index_lag._metrics if k[0] not in loads]:  # also ones set by a late event
            self._forget_child(self.index_lag, w)
        self._gone -= loads.keys()  # a worker that came back
        for w, load in loads.items():
            for f in _LOAD_FIELDS:
                self.worker_load.labels(w, f).set(getattr(load, f))
            if load.index_lag_s:
                self.index_lag.labels(w).set(load.index_lag_s)
        self._gauge_workers = set(loads)
        self.live_workers.set(len(loads))

    def forget_worker(self, worker_id: str) -> None:
        """Removes every series labelled with a worker that left (failed, or its heartbeat expired)."""
        for f in _LOAD_FIELDS:
            _remove(self.worker_load, worker_id, f)
        _remove(self.index_lag, worker_id)
        _remove(self.routed_tokens, worker_id)
        self._gauge_workers.discard(worker_id)
        self._gone.add(worker_id)
        if self.sequence_gaps is not None:
            forget_purges(self.sequence_gaps, worker_id)
        # Cached children of removed series would be orphans: the next inc must create a fresh one.
        for key in [k for k in self._children if worker_id in k[1:]]:
            del self._children[key]
        self.live_workers.set(len(self._gauge_workers))


def index_purges_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "moray_router_index_purges", "worker entries purged: sequence gap, new epoch or cleared", ["worker", "reason"], registry=registry
    )


def forget_purges(counter: Counter, worker_id: str) -> None:
    for labels in [k for k in counter._metrics if k[0] == worker_id]:  # every reason
        _remove(counter, *labels)


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
