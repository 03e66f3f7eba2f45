"""Prometheus metrics: the front end's (`FrontendMetrics`: request latencies and outcomes, admission) and the
workers' state (`WorkerMetrics`, kept by the membership registry from the heartbeats it receives).

Per-worker series exist while the worker does: `forget_worker` removes every series labelled with a
worker that left (a failed call killed it, or its heartbeat expired; see `membership.Membership`), so a
cluster-wide sum never counts requests on workers that are gone. A front end's /metrics is its own
registry, its router's and the registry's worker series, one scrape.

What workers report as running totals (prefix-cache tokens, handoff bytes/seconds/count, misroutes) is
exposed as counters (`..._total`, monotone): each report adds what the worker's total grew by since its
last one. (They used to be gauges with the same names less `_total`.)

Names. What vLLM also measures is exported under vLLM's name, type, label (`model_name`) and histogram
buckets, and only there, so dashboards, alerts and autoscalers built for vLLM (GKE's vLLM dashboard, the
Inference Gateway) read Moray unchanged: request latencies, token counts, finished requests, and the
per-worker scheduler and KV-cache state (a worker is vLLM's `engine` label, plus `role`). What vLLM has no
name for keeps a `moray_` name: router decisions, KV handoff, host tier, admission, failures, failovers.
"""

from __future__ import annotations

import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histogram_quantile over a mixed fleet lines up.
VLLM_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
VLLM_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0
)  # fmt: skip


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets for a max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


# heartbeat field -> (attribute, metric name (`_total` is added), help, roles it applies to)
_WORKER_COUNTERS = {
    "engine.prefix_cache_hits": ("prefix_hits", "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", None),
    "engine.host_hit_tokens": (
        "prefix_host_hit_tokens",
        "moray_prefix_cache_host_hit_tokens",
        "of the prefix hit tokens, those copied back from a worker's host KV tier",
        None,
    ),
    "engine.host_blocks_saved": (
        "host_saved_blocks",
        "moray_kv_host_saved_blocks",
        "device KV blocks a worker copied to its host tier on eviction",
        None,
    ),
    "engine.host_blocks_loaded": (
        "host_loaded_blocks",
        "moray_kv_host_loaded_blocks",
        "host-tier KV blocks a worker copied back for a prefix hit",
        None,
    ),
    "engine.host_blocks_evicted": (
        "host_evicted_blocks",
        "moray_kv_host_evicted_blocks",
        "KV blocks a worker's host tier dropped for room",
        None,
    ),
    "engine.host_copy_seconds": (
        "host_copy_seconds",
        "moray_kv_host_copy_seconds",
        "host time a worker spent on its host tier's copies",
        None,
    ),
    "engine.evicted_live_session_blocks": (
        "evicted_live_session_blocks",
        "moray_kv_evicted_live_session_blocks",
        "cached KV blocks (either tier) evicted while their session was live: the retention order's last resort",
        None,
    ),
    "engine.prefix_cache_queries": (
        "prefix_queries",
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        None,
    ),
    "engine.num_preemptions": ("preemptions", "vllm:num_preemptions", "Cumulative number of preemption from the engine.", None),
    "engine.spec_num_drafts": ("spec_drafts", "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", None),
    "engine.expert_routed_tokens": (
        "expert_routed_tokens",
        "moray_expert_routed_tokens",
        "token-to-expert assignments a worker's MoE layers routed (padding excluded; a snapshot every few dozen steps)",
        None,
    ),
    "engine.expert_rebalances": (
        "expert_rebalances",
        "moray_expert_rebalances",
        "expert placements a worker's load balancer swapped in (engine.eplb)",
        None,
    ),
    "engine.spec_num_draft_tokens": ("spec_draft_tokens", "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", None),
    "engine.spec_num_accepted_tokens": (
        "spec_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
        None,
    ),
    "misrouted": ("misrouted", "moray_misrouted_requests", "requests a worker received although the router chose another", None),
    "handoff.bytes": ("handoff_bytes", "moray_kv_handoff_bytes", "KV bytes a decode worker imported", "decode"),
    "handoff.state_bytes": (
        "handoff_state_bytes",
        "moray_kv_handoff_state_bytes",
        "of the handoff bytes, linear-attention state (hybrid models)",
        "decode",
    ),
    "handoff.seconds": ("handoff_seconds", "moray_kv_handoff_seconds", "time a decode worker spent importing KV", "decode"),
    "handoff.handoffs": ("handoffs", "moray_kv_handoffs", "KV handoffs a decode worker completed", "decode"),
    "handoff.corrupt_chunks": (
        "handoff_corrupt_chunks",
        "moray_kv_handoff_corrupt_chunks",
        "KV chunks a decode worker refused: they failed their header check or checksum (fetched again, then recomputed)",
        "decode",
    ),
    "handoff.refetched_chunks": (
        "handoff_refetched_chunks",
        "moray_kv_handoff_refetched_chunks",
        "KV chunks a decode worker fetched a second time (the first failed its check or its fetch)",
        "decode",
    ),
    "handoff.import_failures": (
        "handoff_import_failures",
        "moray_kv_handoff_import_failures",
        "handoffs a decode worker prefilled locally instead (the KV did not arrive, or arrived damaged twice)",
        "decode",
    ),
    "handoff.skipped_bytes": (
        "handoff_skipped_bytes",
        "moray_kv_handoff_skipped_bytes",
        "KV bytes a decode worker did not move: its own prefix cache held those blocks",
        "decode",
    ),
    "handoff.export_bytes": ("handoff_export_bytes", "moray_kv_export_bytes", "KV bytes a prefill worker published", "prefill"),
    "handoff.export_seconds": (
        "handoff_export_seconds",
        "moray_kv_export_seconds",
        "time from a prefill engine's dispatch of a KV copy to the copy being on the host (off the engine thread)",
        "prefill",
    ),
}


def _field(hb, path: str):
    part, _, name = path.partition(".")
    return getattr(getattr(hb, part), name) if name else getattr(hb, part)


def observe_many(child, amount: float, count: int) -> None:
    """`count` observations of `amount` on a histogram's child, in one bucket search and two additions.
    prometheus_client observes one value at a time (a linear search of the buckets and two locked additions
    each): a delta of n tokens cost n of those. This reads the child's buckets and sum, which
    prometheus_client keeps private; tests/test_metrics.py checks the exposition equals `count` observes."""
    child._sum.inc(amount * count)
    child._buckets[bisect_left(child._upper_bounds, amount)].inc(count)


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "moray", max_model_len: int = 4096):
        r = self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        m = ["model_name"]
        # Request latencies and sizes, as the ingress sees them (vLLM's names; `path`: local or disaggregated prefill).
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            [*m, "path"],
            buckets=VLLM_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            m,
            buckets=VLLM_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            m,
            buckets=VLLM_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            m,
            buckets=VLLM_REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", m, buckets=token_buckets, registry=r
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", m, buckets=token_buckets, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*m, "finished_reason"], registry=r
        )
        self.request_failures = Counter(
            "moray_request_failures",
            "requests that did not finish: error (server side), timeout (server.request_timeout_s) or cancelled (the client left)",
            ["api", "outcome"],
            registry=r,
        )
        # Per-request phases (vLLM's names, so its dashboard and GKE's have no empty panel): queue = waiting
        # for the first engine step (the engine's clock), prefill = the rest of the time to the first
        # token (routing and the step itself, as the ingress sees it), decode = first token to the end.
        phase = {"buckets": VLLM_REQUEST_LATENCY_BUCKETS, "registry": r}
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", m, **phase)
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", m, **phase
        )
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", m, **phase)
        self.inference_time = Histogram(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", m, **phase
        )
        self.max_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            m,
            buckets=token_buckets,
            registry=r,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", m, registry=r)
        self.cached_tokens = Counter("moray_cached_prompt_tokens_total", "prompt tokens served from a prefix cache", registry=r)
        # Admission control and failures (cluster/orchestrator.py).
        self.queued = Gauge("moray_ingress_queued_requests", "requests this ingress admitted that have no first token yet", registry=r)
        self.rejected = Counter("moray_rejected_requests", "requests refused by admission control", ["reason"], registry=r)
        self.timeouts = Counter("moray_request_timeouts", "requests aborted at server.request_timeout_s", ["stage"], registry=r)
        self.failovers = Counter(
            "moray_failovers",
            "requests whose worker failed: retried on another (before any token went out), migrated (resumed on another after "
            "the tokens already sent) or failed; and requests moved off a draining worker (drained)",
            ["result"],
            registry=r,
        )
        # Every finished request observes a dozen series and every delta the inter-token latency: their
        # children are looked up once (`labels` takes a lock and builds a key each time).
        one = lambda metric: metric.labels(model_name)  # noqa: E731
        self._itl_child = one(self.itl)
        self._per_request = [one(m) for m in (self.queue_time, self.prefill_time, self.decode_time, self.inference_time)]
        self._max_tokens, self._tpot, self._e2e = one(self.max_generation_tokens), one(self.tpot), one(self.e2e)
        self._prompt_sizes, self._generation_sizes = one(self.request_prompt_tokens), one(self.request_generation_tokens)
        self._prompt_total, self._generation_total = one(self.prompt_tokens), one(self.generation_tokens)
        self._ttft_by_path: dict[str, object] = {}
        self._success_by_reason: dict[str, object] = {}

    # ------------------------------------------------------------------ requests

    def observe_request(
        self,
        api: str,
        outcome: str,
        prompt_tokens: int,
        tokens: int,
        start: float,
        first_token: float | None,
        end: float,
        path: str,
        queue_s: float | None = None,
        max_tokens: int | None = None,
    ) -> None:
        """One finished request: `outcome` is its finish reason (stop, length, ...), or error/timeout/cancelled.
        `queue_s`: the engine's wait before its first step; `max_tokens`: the generation tokens it asked for."""
        name = self.model_name
        if max_tokens is not None:
            self._max_tokens.observe(max_tokens)
        if first_token is not None and outcome not in FAILED_OUTCOMES:
            queued = min(queue_s or 0.0, first_token - start)
            queue, prefill, decode, inference = self._per_request
            queue.observe(queued)
            prefill.observe(first_token - start - queued)
            decode.observe(end - first_token)
            inference.observe(end - start - queued)
        if outcome in FAILED_OUTCOMES:
            self.request_failures.labels(api, outcome).inc()
        else:
            success = self._success_by_reason.get(outcome)
            if success is None:
                success = self._success_by_reason[outcome] = self.request_success.labels(name, outcome)
            success.inc()
        self._prompt_total.inc(prompt_tokens)
        self._generation_total.inc(tokens)
        self._prompt_sizes.observe(prompt_tokens)
        self._generation_sizes.observe(tokens)
        if first_token is not None:
            ttft = self._ttft_by_path.get(path)
            if ttft is None:
                ttft = self._ttft_by_path[path] = self.ttft.labels(name, path)
            ttft.observe(first_token - start)
            if tokens > 1:
                self._tpot.observe((end - first_token) / (tokens - 1))
        self._e2e.observe(end - start)

    def observe_token_gap(self, seconds: float, new_tokens: int) -> None:
        """A stream chunk after the first: `new_tokens` tokens arrived `seconds` after the previous chunk
        (each token one observation of `seconds / new_tokens`, as vLLM counts them)."""
        observe_many(self._itl_child, seconds / new_tokens, new_tokens)

    def render(self, *extra: CollectorRegistry | bytes) -> bytes:
        """This registry's exposition followed by the others' (registries, or exposition text already made)."""
        parts = [generate_latest(self.registry)]
        parts += [r if isinstance(r, bytes) else generate_latest(r) for r in extra]
        return b"".join(parts)


class WorkerMetrics:
    """Every live worker's state, from its heartbeats: vLLM's engine-level names (a worker is an engine)."""

    # A report measured this soon after a worker was forgotten is one that was in flight when it died.
    FORGET_GRACE_S = 0.5

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "moray"):
        r = self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        w = ["model_name", "engine", "role"]
        self.queue_depth = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", w, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", w, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", w, registry=r)
        self.host_kv_usage = Gauge(
            "moray_kv_host_tier_usage_ratio", "fraction of a worker's host-tier KV blocks holding a block", ["worker", "role"], registry=r
        )
        self.kv_bytes_per_token = Gauge(
            "moray_kv_cache_bytes_per_token", "KV bytes one token takes over all layers on a worker", ["worker", "role"], registry=r
        )
        self.state_bytes = Gauge(
            "moray_state_snapshot_bytes", "device bytes a hybrid model's state snapshots hold on a worker", ["worker", "role"], registry=r
        )
        self.expert_imbalance = Gauge(
            "moray_expert_rank_imbalance_ratio",
            "the worst MoE layer's busiest expert-parallel rank over the mean rank, by tokens routed in the last ~256 steps",
            ["worker", "role"],
            registry=r,
        )
        self.state_budget = Gauge(
            "moray_state_snapshot_budget_bytes",
            "device bytes a hybrid model's state snapshots may hold on a worker (state_cache_memory_bytes)",
            ["worker", "role"],
            registry=r,
        )
        for _, (attr, name, help_, role) in _WORKER_COUNTERS.items():
            setattr(self, attr, Counter(name, help_, _worker_label_names(name, role), registry=r))
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ["model_name", "engine", "role", "position"],
            registry=r,
        )
        self._totals: dict[str, dict[str, float]] = {}  # worker -> heartbeat field -> last total seen
        self._roles: dict[str, str] = {}
        self._forgotten: dict[str, float] = {}  # worker -> when (time.time)

    def _worker_labels(self, worker: str, role: str, name: str, only: str | None) -> tuple[str, ...]:
        if name.startswith("vllm:"):
            return (self.model_name, worker, role)
        return (worker,) if only else (worker, role)

    def observe_worker(self, hb) -> None:
        """One heartbeat (`workers.messages.WorkerHeartbeat`)."""
        w, role, e = hb.worker_id, hb.role, hb.engine
        forgotten = self._forgotten.get(w)
        if forgotten is not None:
            if hb.ts < forgotten + self.FORGET_GRACE_S:
                return  # sent before the worker was dropped: do not bring its series back
            del self._forgotten[w]
        self._roles[w] = role
        name = self.model_name
        self.queue_depth.labels(name, w, role).set(e.num_waiting)
        self.running.labels(name, w, role).set(e.num_running)
        self.kv_usage.labels(name, w, role).set(e.kv_usage)
        self.host_kv_usage.labels(w, role).set(e.host_kv_usage)
        self.kv_bytes_per_token.labels(w, role).set(e.kv_bytes_per_token)
        self.state_bytes.labels(w, role).set(e.state_snapshot_bytes)
        self.state_budget.labels(w, role).set(e.state_snapshot_budget_bytes)
        if e.expert_routed_tokens:
            self.expert_imbalance.labels(w, role).set(e.expert_rank_imbalance)
        totals = self._totals.setdefault(w, {})
        for path, (attr, metric, _, only) in _WORKER_COUNTERS.items():
            if only is not None and role != only:
                continue
            value = _field(hb, path) or 0
            last = totals.get(path, 0)
            child = getattr(self, attr).labels(*self._worker_labels(w, role, metric, only))
            # A total below the last one means the worker's counters restarted: count it from zero.
            child.inc(value - last if value >= last else value)
            totals[path] = value
        for pos, value in enumerate(e.spec_accepted_per_pos):
            key = f"spec_pos.{pos}"
            last = totals.get(key, 0)
            self.spec_accepted_per_pos.labels(name, w, role, str(pos)).inc(value - last if value >= last else value)
            totals[key] = value

    def forget_worker(self, worker_id: str) -> None:
        """Removes every series labelled with `worker_id` (it failed or its heartbeat expired)."""
        self._forgotten[worker_id] = time.time()
        role = self._roles.pop(worker_id, None)
        self._totals.pop(worker_id, None)
        if role is None:
            return
        for gauge in (self.queue_depth, self.running, self.kv_usage):
            _remove(gauge, self.model_name, worker_id, role)
        for labels in list(self.spec_accepted_per_pos._metrics):
            if labels[1] == worker_id:
                self.spec_accepted_per_pos.remove(*labels)
        for gauge in (self.host_kv_usage, self.kv_bytes_per_token, self.state_bytes, self.state_budget, self.expert_imbalance):
            _remove(gauge, worker_id, role)
        for _, (attr, metric, _, only) in _WORKER_COUNTERS.items():
            _remove(getattr(self, attr), *self._worker_labels(worker_id, role, metric, only))
        if len(self._forgotten) > 1024:  # workers never come back under the same id; keep it bounded
            horizon = time.time() - 60
            self._forgotten = {w: t for w, t in self._forgotten.items() if t > horizon}

    def workers(self) -> list[str]:
        """Workers with series now."""
        return sorted(self._roles)

    def render(self) -> bytes:
        return generate_latest(self.registry)


FAILED_OUTCOMES = frozenset({"error", "timeout", "cancelled"})


def _worker_label_names(name: str, role: str | None) -> list[str]:
    if name.startswith("vllm:"):
        return ["model_name", "engine", "role"]
    return ["worker"] if role else ["worker", "role"]


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
