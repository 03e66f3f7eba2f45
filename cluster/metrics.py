"""Prometheus metrics of the front end: request latencies and outcomes, admission, and the workers' state.

Per-worker series exist while the worker does: `forget_worker` removes every series labelled with a
worker that left (a failed call dropped it, or its heartbeat expired; see `routing.ClusterRouter`), so a
cluster-wide sum never counts requests on workers that are gone.

What workers report as running totals (prefix-cache tokens, handoff bytes/seconds/count, misroutes) is
exposed as counters (`..._total`, monotone): each report adds what the worker's total grew by since its
last one. (They used to be gauges with the same names less `_total`.)
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# report field -> (attribute, metric name (`_total` is added), help, roles it applies to)
_WORKER_COUNTERS = {
    "prefix_cache_hits": ("prefix_hit_tokens", "moray_prefix_cache_hit_tokens", "prompt tokens a worker found cached", None),
    "prefix_cache_host_hits": (
        "prefix_host_hit_tokens",
        "moray_prefix_cache_host_hit_tokens",
        "of the prefix hit tokens, those copied back from a worker's host KV tier",
        None,
    ),
    "host_blocks_saved": (
        "host_saved_blocks",
        "moray_kv_host_saved_blocks",
        "device KV blocks a worker copied to its host tier on eviction",
        None,
    ),
    "host_blocks_loaded": (
        "host_loaded_blocks",
        "moray_kv_host_loaded_blocks",
        "host-tier KV blocks a worker copied back for a prefix hit",
        None,
    ),
    "host_blocks_evicted": ("host_evicted_blocks", "moray_kv_host_evicted_blocks", "KV blocks a worker's host tier dropped for room", None),
    "host_copy_seconds": ("host_copy_seconds", "moray_kv_host_copy_seconds", "host time a worker spent on its host tier's copies", None),
    "evicted_live_session_blocks": (
        "evicted_live_session_blocks",
        "moray_kv_evicted_live_session_blocks",
        "cached KV blocks (either tier) evicted while their session was live: the retention order's last resort",
        None,
    ),
    "prefix_cache_queries": ("prefix_query_tokens", "moray_prefix_cache_query_tokens", "prompt tokens a worker looked up", None),
    "misrouted": ("misrouted", "moray_misrouted_requests", "requests a worker received although the router chose another", None),
    "handoff_bytes": ("handoff_bytes", "moray_kv_handoff_bytes", "KV bytes a decode worker imported", "decode"),
    "handoff_state_bytes": (
        "handoff_state_bytes",
        "moray_kv_handoff_state_bytes",
        "of the handoff bytes, linear-attention state (hybrid models)",
        "decode",
    ),
    "handoff_seconds": ("handoff_seconds", "moray_kv_handoff_seconds", "time a decode worker spent importing KV", "decode"),
    "handoffs": ("handoffs", "moray_kv_handoffs", "KV handoffs a decode worker completed", "decode"),
}


class FrontendMetrics:
    # A report measured this soon after a worker was forgotten is one that was in flight when it died.
    FORGET_GRACE_S = 0.5

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.ttft = Histogram("moray_time_to_first_token_seconds", "time to first token", ["path"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            "moray_time_per_output_token_seconds", "mean time per output token after the first", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram("moray_e2e_request_latency_seconds", "end-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter(
            "moray_requests_total",
            "finished requests by outcome: the finish reason (stop, length, ...), error, timeout or cancelled",
            ["api", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("moray_prompt_tokens_total", "prompt tokens", registry=r)
        self.generation_tokens = Counter("moray_generation_tokens_total", "generated tokens", registry=r)
        self.cached_tokens = Counter("moray_cached_prompt_tokens_total", "prompt tokens served from a prefix cache", registry=r)
        # Admission control and failures (cluster/orchestrator.py).
        self.queued = Gauge("moray_ingress_queued_requests", "requests this ingress admitted that have no first token yet", registry=r)
        self.rejected = Counter("moray_rejected_requests", "requests refused by admission control", ["reason"], registry=r)
        self.timeouts = Counter("moray_request_timeouts", "requests aborted at server.request_timeout_s", ["stage"], registry=r)
        self.failovers = Counter(
            "moray_failovers",
            "requests whose worker failed: retried on another (before any token went out) or failed",
            ["result"],
            registry=r,
        )
        # Worker state, per live worker.
        self.queue_depth = Gauge("moray_queue_depth", "requests waiting in a worker's scheduler", ["worker", "role"], registry=r)
        self.running = Gauge("moray_running_requests", "requests running in a worker", ["worker", "role"], registry=r)
        self.kv_usage = Gauge("moray_kv_cache_usage_ratio", "fraction of a worker's KV blocks in use", ["worker", "role"], registry=r)
        self.host_kv_usage = Gauge(
            "moray_kv_host_tier_usage_ratio", "fraction of a worker's host-tier KV blocks holding a block", ["worker", "role"], registry=r
        )
        self.kv_bytes_per_token = Gauge(
            "moray_kv_cache_bytes_per_token", "KV bytes one token takes over all layers on a worker", ["worker", "role"], registry=r
        )
        for _, (attr, name, help_, role) in _WORKER_COUNTERS.items():
            setattr(self, attr, Counter(name, help_, ["worker"] if role else ["worker", "role"], registry=r))
        self._totals: dict[str, dict[str, float]] = {}  # worker -> report field -> last total seen
        self._roles: dict[str, str] = {}
        self._forgotten: dict[str, float] = {}  # worker -> when (time.time)

    def observe_worker(self, load: dict) -> None:
        w, role = load["worker_id"], load["role"]
        forgotten = self._forgotten.get(w)
        if forgotten is not None:
            if (load.get("ts") or time.time()) < forgotten + self.FORGET_GRACE_S:
                return  # sent before the worker was dropped: do not bring its series back
            del self._forgotten[w]
        self._roles[w] = role
        self.queue_depth.labels(w, role).set(load["num_waiting"])
        self.running.labels(w, role).set(load["num_running"])
        self.kv_usage.labels(w, role).set(load["kv_usage"])
        self.host_kv_usage.labels(w, role).set(load.get("host_kv_usage", 0.0))
        if "kv_bytes_per_token" in load:
            self.kv_bytes_per_token.labels(w, role).set(load["kv_bytes_per_token"])
        totals = self._totals.setdefault(w, {})
        for field, (attr, _, _, only) in _WORKER_COUNTERS.items():
            if only is not None and role != only:
                continue
            value = load.get(field, 0) or 0
            last = totals.get(field, 0)
            counter = getattr(self, attr)
            child = counter.labels(w) if only else counter.labels(w, role)
            # A total below the last one means the worker's counters restarted: count it from zero.
            child.inc(value - last if value >= last else value)
            totals[field] = value

    def forget_worker(self, worker_id: str) -> None:
        """Removes every series labelled with `worker_id` (it failed or its heartbeat expired)."""
        self._forgotten[worker_id] = time.time()
        role = self._roles.pop(worker_id, None)
        self._totals.pop(worker_id, None)
        if role is None:
            return
        for gauge in (self.queue_depth, self.running, self.kv_usage, self.host_kv_usage, self.kv_bytes_per_token):
            _remove(gauge, worker_id, role)
        for _, (attr, _, _, only) in _WORKER_COUNTERS.items():
            _remove(getattr(self, attr), *((worker_id,) if only else (worker_id, role)))
        if len(self._forgotten) > 1024:  # workers never come back under the same id; keep it bounded
            horizon = time.time() - 60
            self._forgotten = {w: t for w, t in self._forgotten.items() if t > horizon}

    def workers(self) -> list[str]:
        """Workers with series now."""
        return sorted(self._roles)

    def render(self, *extra_registries: CollectorRegistry) -> bytes:
        return b"".join(generate_latest(r) for r in (self.registry, *extra_registries))


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
