"""Front-end and router metrics (issue #13): workers' running totals are counters (`_total`), a worker that
leaves (failed call, expired heartbeat) takes its series with it, router load gauges follow heartbeats
between decisions, and finished requests (`vllm:request_success_total`) are told from errors and cancellations
(`moray_request_failures_total`). Issue #18: what vLLM also measures carries vLLM's names, types and buckets."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from cluster.config import parse_cluster_config
from cluster.metrics import FrontendMetrics
from cluster.orchestrator import Chunk
from cluster.router.types import RouteRequest
from cluster.routing import ClusterRouter

sys.path.insert(0, str(Path(__file__).parent))
from cluster_harness import cluster_config  # noqa: E402


def report(worker: str, role: str = "decode", ts: float | None = None, **kw) -> dict:
    """A worker's load report (`workers.worker.EngineWorker.load`)."""
    load = {
        "worker_id": worker,
        "role": role,
        "num_running": 1,
        "num_waiting": 0,
        "kv_usage": 0.25,
        "num_free_blocks": 90,
        "num_total_blocks": 100,
        "pending_prefill_tokens": 0,
        "prefix_cache_queries": 100,
        "prefix_cache_hits": 40,
        "num_held": 0,
        "epoch": 1,
        "last_seq": -1,
        "handoffs": 2,
        "handoff_bytes": 1000,
        "handoff_state_bytes": 0,
        "handoff_seconds": 0.5,
        "misrouted": 1,
        "healthy": True,
        "ts": time.time() if ts is None else ts,
    }
    return {**load, **kw}


def samples(registry, worker: str | None = None) -> list[str]:
    lines = [l for l in generate_latest(registry).decode().splitlines() if l and not l.startswith("#")]
    return [l for l in lines if worker is None or f'worker="{worker}"' in l or f'engine="{worker}"' in l]


VLLM = {"model_name": "moray"}  # FrontendMetrics' default model name


def test_worker_running_totals_are_counters_named_total():
    m = FrontendMetrics()
    m.observe_worker(report("d0"))
    m.observe_worker(report("d0", prefix_cache_hits=70, handoff_bytes=1500, misrouted=1))
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


def test_forgotten_worker_takes_every_series_with_it():
    m = FrontendMetrics()
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


def cluster_router(**router) -> ClusterRouter:
    cfg = parse_cluster_config({"engine": {"model": "/nonexistent", "block_size": 8}, "router": {"policy": "round-robin", **router}})
    return ClusterRouter(cfg)


def route(r: ClusterRouter, rid: str):
    return r.route(RouteRequest(rid, [], 4))


def test_failed_worker_is_dropped_at_once_and_comes_back_only_with_a_later_heartbeat():
    r = cluster_router()
    gone = []
    r.on_worker_gone(gone.append)
    r.report(report("d0"), [])
    r.report(report("d1"), [])
    assert {route(r, f"a{i}").decode_worker for i in range(4)} == {"d0", "d1"}
    before_failure = time.time()
    r.worker_failed("d0")
    assert gone == ["d0"] and r.is_failed("d0")
    assert {route(r, f"b{i}").decode_worker for i in range(4)} == {"d1"}  # no TTL wait
    r.report(report("d0", ts=before_failure), [])  # a report that was in flight when it died
    assert r.is_failed("d0") and {route(r, f"c{i}").decode_worker for i in range(4)} == {"d1"}
    r.worker_failed("d0")
    assert gone == ["d0"]  # told once
    r.report(report("d0", ts=time.time() + 1), [])  # measured after the failure: wrongly suspected
    assert not r.is_failed("d0") and {route(r, f"d{i}").decode_worker for i in range(4)} == {"d0", "d1"}


def test_expired_worker_leaves_and_router_gauges_follow_heartbeats():
    r = cluster_router(heartbeat_ttl_s=0.3)
    r.router.metrics._gauge_interval_s = 0.0
    gone = []
    r.on_worker_gone(gone.append)
    value = r.router.metrics.registry.get_sample_value
    r.report(report("d0", num_waiting=3), [])
    r.report(report("d1"), [])
    # No decision was made: the load gauges still show the heartbeats.
    assert value("moray_router_worker_load", {"worker": "d0", "field": "num_waiting"}) == 3
    r.report(report("d0", num_waiting=5), [])
    assert value("moray_router_worker_load", {"worker": "d0", "field": "num_waiting"}) == 5
    route(r, "x")
    assert any('worker="d' in l for l in samples(r.router.metrics.registry) if l.startswith("moray_router_routed_prompt_tokens"))
    time.sleep(0.4)
    r.report(report("d1"), [])  # d0 stopped reporting
    r.registries()  # a scrape
    assert gone == ["d0"]
    assert samples(r.router.metrics.registry, "d0") == []
    assert value("moray_router_worker_load", {"worker": "d1", "field": "num_waiting"}) == 0
    r.worker_failed("d1")
    assert samples(r.router.metrics.registry, "d1") == [] and gone == ["d0", "d1"]


# ------------------------------------------------------------------ finished vs failed requests


class ScriptedOrchestrator:
    def __init__(self, script):
        self.script = script

    async def route(self, request_id, prompt, session_id):
        return None

    async def stream(self, request_id, prompt, params, decision, trace, session_id=None):
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            await asyncio.sleep(0)
            yield item


@pytest.fixture(scope="module")
def ingress(tmp_path_factory):
    from cluster.ingress import Ingress
    from workers.models.make_model import make_model

    model = make_model(tmp_path_factory.mktemp("metrics") / "tiny", "qwen3_moe", "tiny", seed=11)
    cls = Ingress.func_or_class.__bases__[0]  # the class under Serve's ASGI wrapper
    return cls(cluster_config(model, name="metrics"), None, None)


def test_requests_total_tells_finished_from_error_from_cancelled(ingress, monkeypatch):
    from cluster.ingress import PreparedRequest
    from workers.engine.sampling_params import SamplingParams

    def request():
        return PreparedRequest("r", [1, 2, 3], SamplingParams(max_tokens=2), None)

    tok = Chunk([7], "x", False, None, 0, 1)
    done = Chunk([8], "y", True, "length", 0, 2)

    async def consume(script, stop_after=None):
        monkeypatch.setattr(ingress, "orchestrator", ScriptedOrchestrator(script))
        gen = ingress.run(request(), "completions")
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
    value = ingress.metrics.registry.get_sample_value
    assert value("vllm:request_success_total", {"model_name": "tiny", "finished_reason": "length"}) == 1
    assert value("moray_request_failures_total", {"api": "completions", "outcome": "error"}) == 1
    assert value("moray_request_failures_total", {"api": "completions", "outcome": "cancelled"}) == 1
    assert value("vllm:request_success_total", {"model_name": "tiny", "finished_reason": "error"}) is None
    # Tokens and latencies of all three (the cancelled one got one token, its stream closed after it).
    assert value("vllm:generation_tokens_total", {"model_name": "tiny"}) == 2 + 1 + 1
    assert value("vllm:prompt_tokens_total", {"model_name": "tiny"}) == 3 * 3
    assert value("vllm:e2e_request_latency_seconds_count", {"model_name": "tiny"}) == 3
