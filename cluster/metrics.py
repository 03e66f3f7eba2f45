"""Prometheus metrics of the front end: request latencies and the workers' reported state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.ttft = Histogram("moray_time_to_first_token_seconds", "time to first token", ["path"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("moray_time_per_output_token_seconds", "mean time per output token after the first", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("moray_e2e_request_latency_seconds", "end-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("moray_requests_total", "finished requests", ["api", "outcome"], registry=r)
        self.prompt_tokens = Counter("moray_prompt_tokens_total", "prompt tokens", registry=r)
        self.generation_tokens = Counter("moray_generation_tokens_total", "generated tokens", registry=r)
        self.cached_tokens = Counter("moray_cached_prompt_tokens_total", "prompt tokens served from a prefix cache", registry=r)
        self.queue_depth = Gauge("moray_queue_depth", "requests waiting in a worker's scheduler", ["worker", "role"], registry=r)
        self.running = Gauge("moray_running_requests", "requests running in a worker", ["worker", "role"], registry=r)
        self.kv_usage = Gauge("moray_kv_cache_usage_ratio", "fraction of a worker's KV blocks in use", ["worker", "role"], registry=r)
        self.prefix_hit_tokens = Gauge("moray_prefix_cache_hit_tokens", "prompt tokens a worker found cached (cumulative)", ["worker", "role"], registry=r)
        self.prefix_query_tokens = Gauge("moray_prefix_cache_query_tokens", "prompt tokens a worker looked up (cumulative)", ["worker", "role"], registry=r)
        self.handoff_bytes = Gauge("moray_kv_handoff_bytes", "KV bytes a decode worker imported (cumulative)", ["worker"], registry=r)
        self.handoff_state_bytes = Gauge(
            "moray_kv_handoff_state_bytes", "of the handoff bytes, linear-attention state (hybrid models; cumulative)", ["worker"], registry=r
        )
        self.handoff_seconds = Gauge("moray_kv_handoff_seconds", "time a decode worker spent importing KV (cumulative)", ["worker"], registry=r)
        self.misrouted = Gauge("moray_misrouted_requests", "requests a worker received although the router chose another (cumulative)", ["worker", "role"], registry=r)
        self.handoffs = Gauge("moray_kv_handoffs", "KV handoffs a decode worker completed (cumulative)", ["worker"], registry=r)

    def observe_worker(self, load: dict) -> None:
        w, role = load["worker_id"], load["role"]
        self.queue_depth.labels(w, role).set(load["num_waiting"])
        self.running.labels(w, role).set(load["num_running"])
        self.kv_usage.labels(w, role).set(load["kv_usage"])
        self.prefix_hit_tokens.labels(w, role).set(load["prefix_cache_hits"])
        self.prefix_query_tokens.labels(w, role).set(load["prefix_cache_queries"])
        self.misrouted.labels(w, role).set(load.get("misrouted", 0))
        if role == "decode":
            self.handoff_bytes.labels(w).set(load.get("handoff_bytes", 0))
            self.handoff_state_bytes.labels(w).set(load.get("handoff_state_bytes", 0))
            self.handoff_seconds.labels(w).set(load.get("handoff_seconds", 0.0))
            self.handoffs.labels(w).set(load.get("handoffs", 0))

    def render(self, *extra_registries: CollectorRegistry) -> bytes:
        return b"".join(generate_latest(r) for r in (self.registry, *extra_registries))
