"""Front-end and router metrics (issue #13): workers' running totals are counters (`_total`), a worker that
leaves (failed call, expired heartbeat) takes its series with it, router load gauges follow heartbeats
between decisions, and finished requests (`vllm:request_success_total`) are told from errors and cancellations
(`moray_request_failures_total`). Issue #18: what vLLM also measures carries vLLM's names, types and buckets."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from fakes import LocalHandle, ScriptedOrchestrator, frontend_without_workers, heartbeat
from prometheus_client import generate_latest

from cluster.membership import Membership, MembershipView
from cluster.metrics import WorkerMetrics
from cluster.registry import Registry
from cluster.router.memory_index import MemoryKVIndex
from cluster.router.router import Router
from cluster.router.types import RouteRequest, WorkerLoad
from workers.messages import HandoffCounters, KVEvent, KVEventKind, TokenDelta, WorkerReport


def report(worker: str, role: str = "decode", ts: float | None = None, misrouted: int = 1, handoff: dict | None = None, **engine):
    """A busy worker's heartbeat (`workers.messages.WorkerHeartbeat`)."""
    engine = {"num_running": 1, "kv_usage": 0.25, "num_free_blocks": 90, "prefix_cache_queries": 100, "prefix_cache_hits": 40, **engine}
    counters = HandoffCounters(**{"handoffs": 2, "bytes": 1000, "seconds": 0.5, **(handoff or {})})
    return replace(heartbeat(worker, role, ts, **engine), handoff=counters, misrouted=misrouted)


def samples(registry, worker: str | None = None) -> list[str]:
    lines = [l for l in generate_latest(registry).decode().splitlines() if l and not l.startswith("#")]
    return [l for l in lines if worker is None or f'worker="{worker}"' in l or f'engine="{worker}"' in l]


VLLM = {"model_name": "moray"}  # WorkerMetrics' default model name


def test_worker_running_totals_are_counters_named_total():
    m = WorkerMetrics()
    m.observe_worker(report("d0"))
    m.observe_worker(report("d0", prefix_cache_hits=70, handoff={"bytes": 1500}, misrouted=1))
    value = m.registry.get_sample_value
    assert value("vllm:prefix_cache_hits_total", {**VLLM, "engine": "d0", "role": "decode"}) == 70
    assert value("vllm:prefix_cache_queries_total", {**VLLM, "engine": "d0", "role": "decode"}) == 100
    assert value("moray_kv_handoff_bytes_total", {"worker": "d0"}) == 1500
    assert value("moray_kv_handoff_seconds_total", {"worker": "d0"}) == 0.5
    assert value("moray_kv_handoffs_total", {"worker": "d0"}) == 2
    assert value("moray_misrouted_requests_total", {"worker": "d0", "role": "decode"}) == 1
    text = generate_latest(m.registry).decode()
    for name in (
        "vllm:prefix_cache_hits",
        "vllm:prefix_cache_queries",
        "moray_kv_handoff_bytes",
        "moray_kv_handoffs",
        "moray_misrouted_requests",
    ):
        assert f"# TYPE {name}_total counter" in text or f"# TYPE {name} counter" in text, name
        assert f"# TYPE {name} gauge" not in text
    # A worker whose totals went back (its counters restarted) counts on from there, never down.
    m.observe_worker(report("d0", prefix_cache_hits=5))
    assert value("vllm:prefix_cache_hits_total", {**VLLM, "engine": "d0", "role": "decode"}) == 75
    # Prefill workers have no handoff series.
    m.observe_worker(report("p0", role="prefill"))
    assert value("moray_kv_handoff_bytes_total", {"worker": "p0"}) is None


def test_speculative_decoding_counters_carry_vllms_names():
    m = WorkerMetrics()
    spec = dict(spec_num_drafts=10, spec_num_draft_tokens=30, spec_num_accepted_tokens=12, spec_accepted_per_pos=(7, 4, 1))
    m.observe_worker(report("d0", **spec))
    m.observe_worker(report("d0", **{**spec, "spec_num_drafts": 14, "spec_accepted_per_pos": (9, 4, 1)}))
    value = m.registry.get_sample_value
    labels = {**VLLM, "engine": "d0", "role": "decode"}
    assert value("vllm:spec_decode_num_drafts_total", labels) == 14
    assert value("vllm:spec_decode_num_draft_tokens_total", labels) == 30
    assert value("vllm:spec_decode_num_accepted_tokens_total", labels) == 12
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", {**labels, "position": "0"}) == 9
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", {**labels, "position": "2"}) == 1
    m.forget_worker("d0")
    assert samples(m.registry, "d0") == []


def test_forgotten_worker_takes_every_series_with_it():
    m = WorkerMetrics()
    m.observe_worker(report("d0", num_running=3))
    m.observe_worker(report("d1", num_running=2))
    assert samples(m.registry, "d0")
    sent_before_death = time.time()
    m.forget_worker("d0")
    assert samples(m.registry, "d0") == []
    # The cluster-wide sum counts only requests that exist.
    assert sum(float(l.rsplit(" ", 1)[1]) for l in samples(m.registry) if l.startswith("vllm:num_requests_running{")) == 2
    m.observe_worker(report("d0", ts=sent_before_death))  # a report in flight when it died
    assert samples(m.registry, "d0") == [] and m.workers() == ["d1"]
    m.observe_worker(report("d0", ts=time.time() + 1))  # measured later: it is alive after all
    assert samples(m.registry, "d0") and m.workers() == ["d0", "d1"]


def router_over(membership: Membership, view: MembershipView, index: MemoryKVIndex) -> Router:
    from cluster.config import RouterConfig

    return Router(index, RouterConfig(policy="round-robin"), block_size=8, membership=view)


def route(r: Router, rid: str):
    return r.route(RouteRequest(rid, [], 4))


def members(heartbeat_ttl_s: float = 10.0):
    """The registry's membership, a front end's view of it and a router over the view: `tell(hb)` is a
    heartbeat reaching the registry (and its index), the view following."""
    m, view, index = Membership(heartbeat_ttl_s), MembershipView(), MemoryKVIndex(heartbeat_ttl_s=heartbeat_ttl_s)

    def tell(hb=None):
        if hb is not None and m.report(hb):
            index.heartbeat(WorkerLoad.from_heartbeat(hb))
        view.update(m.snapshot())

    return m, view, router_over(m, view, index), tell


def test_failed_worker_is_dropped_at_once_and_comes_back_only_with_a_later_heartbeat():
    m, view, r, tell = members()
    gone, seen = [], []
    m.on_gone(gone.append)
    view.on_gone(seen.append)
    tell(report("d0"))
    tell(report("d1"))
    assert {route(r, f"a{i}").decode_worker for i in range(4)} == {"d0", "d1"}
    before_failure = time.time()
    assert view.mark_failed("d0", before_failure + 0.01)  # the front end saw a call fail: at once, locally
    assert seen == ["d0"] and view.is_failed("d0")
    assert {route(r, f"b{i}").decode_worker for i in range(4)} == {"d1"}  # no TTL wait, before the registry knows
    assert m.worker_failed("d0", before_failure + 0.01) and gone == ["d0"]
    tell(report("d0", ts=before_failure))  # a report that was in flight when it died
    assert view.is_failed("d0") and {route(r, f"c{i}").decode_worker for i in range(4)} == {"d1"}
    assert not m.worker_failed("d0") and gone == ["d0"]  # told once
    tell(report("d0", ts=time.time() + 1))  # measured after the failure: wrongly suspected
    assert not view.is_failed("d0") and {route(r, f"d{i}").decode_worker for i in range(4)} == {"d0", "d1"}


def test_a_draining_worker_gets_nothing_new():
    from workers.messages import WorkerState

    m, view, r, tell = members()
    tell(report("d0"))
    tell(report("d1"))
    tell(replace(report("d0"), state=WorkerState.DRAINING))
    assert {route(r, f"a{i}").decode_worker for i in range(4)} == {"d1"}
    assert view.live("decode") == ["d1"] and m.get("d0").state is WorkerState.DRAINING
    assert view.draining("decode") == ["d0"]


def test_a_replica_serve_stops_drains_whatever_its_heartbeats_say():
    from workers.messages import WorkerState

    m, view, r, tell = members()
    tell(report("d0"))
    tell(report("d1"))
    assert m.stopping({"d1"}) == ["d1"] and m.stopping({"d1"}) == []  # newly draining: once
    tell(report("d1"))  # its own heartbeat says alive: Serve's word stands
    assert m.get("d1").state is WorkerState.DRAINING and view.live("decode") == ["d0"] and view.draining() == ["d1"]
    m.stopping(set())  # Serve no longer stops it (its stop was undone): the next heartbeat counts again
    tell(report("d1"))
    assert view.live("decode") == ["d0", "d1"] and view.draining() == []


def test_expired_worker_leaves_the_registry_its_series_and_the_router_gauges():
    async def main():
        from cluster_harness import cluster_config

        cfg = cluster_config("/nonexistent", router={"heartbeat_ttl_s": 0.3})
        registry = Registry(cfg)
        await registry.report(WorkerReport(report("d0", num_waiting=3)))
        await registry.report(WorkerReport(report("d1")))
        value = registry.worker_metrics.registry.get_sample_value
        assert value("vllm:num_requests_waiting", {"model_name": "nonexistent", "engine": "d0", "role": "decode"}) == 3
        await asyncio.sleep(0.4)
        await registry.report(WorkerReport(report("d1")))  # d0 stopped reporting
        registry.remove_dead_workers_now()  # (the report may have done it already: the registry maintains itself)
        assert samples(registry.worker_metrics.registry, "d0") == [] and samples(registry.worker_metrics.registry, "d1")
        assert [mm.worker_id for mm in registry.membership.members()] == ["d1"]
        changes = await registry.changes(None, 0)  # what a front end takes: d1 only
        assert [mm.worker_id for mm in changes.membership.members] == ["d1"] and set(changes.resync) == {"d1"}

    asyncio.run(main())


class _ReportingWorker:
    """What the reporter reads from a worker: its heartbeat (these engine stats) and its KV events since."""

    def __init__(self):
        self.worker_id, self.stats, self.events = "w0", {}, []

    def report(self, with_events: bool = True) -> WorkerReport:
        events, self.events = self.events, []
        return WorkerReport(heartbeat(self.worker_id, **self.stats), events if with_events else [])


class _FlakyRegistry(Registry):
    """The real registry, unreachable for its first `down` reports."""

    down = 0

    async def report(self, report):
        if self.down:
            self.down -= 1
            raise ConnectionError("registry restarting")
        await super().report(report)


def test_a_worker_reports_what_changed_and_otherwise_a_keepalive():
    """Every 100 ms a worker looks at its heartbeat; it sends it when it changed (or KV events wait), and an
    unchanged one once per keep-alive: an idle cluster's reports cost the registry ~10x less than one every
    100 ms (each a Serve call). A report that failed is sent again even when nothing changed since."""
    from cluster_harness import cluster_config

    from cluster.config import parse_cluster_config
    from cluster.handles import RegistryClient
    from cluster.reporting import WorkerReporter

    cfg = cluster_config("/nonexistent", router={"heartbeat_ttl_s": 2.0})
    registry = _FlakyRegistry(cfg)
    handle = LocalHandle(registry)
    worker = _ReportingWorker()
    reporter = WorkerReporter(parse_cluster_config(cfg), worker, "app")
    reporter._registry = RegistryClient(handle)
    assert reporter.keepalive_s == 0.5  # a quarter of the TTL (1 s at most)

    def sent() -> int:
        return sum(1 for method, _, _ in handle.calls if method == "report")

    def seen():
        return registry.membership.get("w0").heartbeat

    assert reporter.report_once() and sent() == 1  # the first report
    assert not reporter.report_once() and not reporter.report_once() and sent() == 1  # nothing new: nothing sent
    worker.stats["num_waiting"] = 2
    assert reporter.report_once() and sent() == 2 and seen().engine.num_waiting == 2
    worker.events = [KVEvent("w0", 1, 0, KVEventKind.STORED, block_hash=7, num_tokens=16)]
    assert reporter.report_once() and sent() == 3  # KV events go at once, heartbeat unchanged or not
    assert registry.index.longest_prefix([7]) == {"w0": 1}
    at = seen().ts
    time.sleep(0.55)
    assert reporter.report_once() and sent() == 4 and seen().ts > at  # the keep-alive: still alive, same state
    registry.down = 1
    worker.stats["num_waiting"] = 0
    with pytest.raises(ConnectionError):
        reporter.report_once()
    assert reporter.report_once() and seen().engine.num_waiting == 0  # the failed report's news, sent again
    assert not reporter.report_once()


def test_router_load_gauges_follow_the_view_between_decisions():
    m, view, r, tell = members()
    r.metrics._gauge_interval_s = 0.0
    value = r.metrics.registry.get_sample_value
    tell(report("d0", num_waiting=3))
    tell(report("d1"))
    r.refresh_load_gauges()  # no decision was made: the gauges still show the heartbeats
    assert value("moray_router_worker_load", {"worker": "d0", "field": "num_waiting"}) == 3
    route(r, "x")
    view.on_gone(r.metrics.forget_worker)
    view.mark_failed("d1")
    assert samples(r.metrics.registry, "d1") == []


# ------------------------------------------------------------------ finished vs failed requests


@pytest.fixture(scope="module")
def ingress(tmp_path_factory):
    from workers.models.make_model import make_model

    model = make_model(tmp_path_factory.mktemp("metrics") / "tiny", "qwen3_moe", "tiny", seed=11)
    return frontend_without_workers(model, name="metrics")


def test_requests_total_tells_finished_from_error_from_cancelled(ingress, monkeypatch):
    from cluster.pipeline import PreparedRequest
    from workers.engine.sampling_params import SamplingParams

    def request():
        return PreparedRequest("r", [1, 2, 3], SamplingParams(max_tokens=2), None)

    tok = TokenDelta("r", [7], "x", 1)
    done = TokenDelta("r", [8], "y", 2, 0, "length")

    async def consume(script, stop_after=None):
        monkeypatch.setattr(ingress.pipeline, "orchestrator", ScriptedOrchestrator(script))
        gen = ingress.pipeline.run(request(), "completions")
        got = 0
        try:
            async for _ in gen:
                got += 1
                if got == stop_after:
                    await gen.aclose()  # the client went away
                    break
        except RuntimeError:
            pass

    asyncio.run(consume([tok, done]))
    asyncio.run(consume([tok, RuntimeError("worker crashed")]))
    asyncio.run(consume([tok, tok, done], stop_after=1))
    value = ingress.pipeline.metrics.registry.get_sample_value
    assert value("vllm:request_success_total", {"model_name": "tiny", "finished_reason": "length"}) == 1
    assert value("moray_request_failures_total", {"api": "completions", "outcome": "error"}) == 1
    assert value("moray_request_failures_total", {"api": "completions", "outcome": "cancelled"}) == 1
    assert value("vllm:request_success_total", {"model_name": "tiny", "finished_reason": "error"}) is None
    # Tokens and latencies of all three (the cancelled one got one token, its stream closed after it).
    assert value("vllm:generation_tokens_total", {"model_name": "tiny"}) == 2 + 1 + 1
    assert value("vllm:prompt_tokens_total", {"model_name": "tiny"}) == 3 * 3
    assert value("vllm:e2e_request_latency_seconds_count", {"model_name": "tiny"}) == 3


def test_a_front_end_follows_the_registry_as_one_stream_of_changes():
    """`follow` streams the registry's changes: the whole index first (a new follower), then each report's
    events and load as they arrive, and an item at least once a second when nothing changes."""
    from workers.messages import KVEvent, KVEventKind

    async def main():
        from cluster_harness import cluster_config

        registry = Registry(cluster_config("/nonexistent"))
        await registry.report(WorkerReport(report("d0"), [KVEvent("d0", 1, 0, KVEventKind.STORED, 11, None, 8)]))
        stream = registry.follow(None, min_interval_s=0.01, idle_s=0.2, lifetime_s=5)
        first = await anext(stream)
        assert first.resync is not None and first.resync["d0"][2] == [(11, "device")]
        reporter = asyncio.create_task(registry.report(WorkerReport(report("d0"), [KVEvent("d0", 1, 1, KVEventKind.STORED, 12, 11, 8)])))
        second = await asyncio.wait_for(anext(stream), 2)
        await reporter
        assert second.resync is None and [e.block_hash for e in second.events] == [12] and second.cursor[1] == first.cursor[1] + 1
        quiet = await asyncio.wait_for(anext(stream), 2)  # nothing new: still an item, empty
        assert quiet.events == [] and quiet.cursor == second.cursor
        await stream.aclose()

    asyncio.run(main())


def test_a_delta_of_n_tokens_counts_as_n_inter_token_gaps_in_one_observation():
    """`observe_token_gap` adds a delta's n tokens in one bucket search (it called prometheus_client's observe n
    times): the exposition must equal n observes of the per-token gap, whatever bucket the gap falls in, bucket
    edges and the +Inf bucket included. It reads the histogram's private fields, so this also catches a
    prometheus_client whose fields changed."""
    from prometheus_client import CollectorRegistry

    from cluster.metrics import VLLM_TOKEN_LATENCY_BUCKETS, FrontendMetrics

    fast = FrontendMetrics(CollectorRegistry(), model_name="m")
    slow = FrontendMetrics(CollectorRegistry(), model_name="m")
    gaps = [(0.004, 1), (0.03, 3), (0.2, 4), (0.05, 2), (100.0, 1), (81.0, 5)]  # 0.1 per token: a bucket's edge
    gaps += [(b * n, n) for b, n in zip(VLLM_TOKEN_LATENCY_BUCKETS, range(1, 40))]
    for seconds, n in gaps:
        fast.observe_token_gap(seconds, n)
        for _ in range(n):
            slow.itl.labels("m").observe(seconds / n)
    name = "vllm:inter_token_latency_seconds"

    def series(m):
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in m.registry.collect()
            if metric.name == name
            for s in metric.samples
            if not s.name.endswith("_created")
        }

    got, want = series(fast), series(slow)
    assert got.keys() == want.keys() and len(got) == len(VLLM_TOKEN_LATENCY_BUCKETS) + 3  # buckets, +Inf, count, sum
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key
    assert got[(name + "_count", (("model_name", "m"),))] == sum(n for _, n in gaps)
