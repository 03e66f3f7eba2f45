"""Faults and load (issue #13): a dead worker's requests fail over or end with a clear error, held KV is
freed when a client leaves at any point, overload is refused with 429 / RESOURCE_EXHAUSTED, and requests
past `server.request_timeout_s` are aborted with 504 / DEADLINE_EXCEEDED.

The first part runs the real front end (pipeline, orchestrator, registry) in process over fake workers (deterministic,
no Ray); the second part is the acceptance test on a real local Ray cluster (one cluster for the module:
1 prefill + 2 decode replicas)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time

import grpc
import pytest
from cluster_harness import API_KEY, cluster_config, http_json, served_app, wait_until
from fakes import FakeContext, FakeEngineWorker, body_of, http_request, run, serving, sse_events, until

from cluster import openai_api as oa
from cluster.config import ClusterConfig
from protos.moray.v1 import moray_pb2


def FakeWorker(wid: str, slots: int = 8, delay: float = 0.005) -> FakeEngineWorker:  # noqa: N802 - reads as a class
    return FakeEngineWorker(wid, "prefill" if wid.startswith("p") else "decode", slots=slots, delay=delay)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from workers.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("failover") / "tiny", "qwen3_moe", "tiny", seed=11)


async def make_serving(model_dir, prefill: list[FakeEngineWorker], decode: list[FakeEngineWorker], transport: str = "serve", **server):
    """The real front end (pipeline, orchestrator, router, registry) over fake workers, all registered.
    `transport`: how the channels travel (Serve streams, or direct connections: cluster/direct_stream.py)."""
    return await serving(model_dir, prefill, decode, direct=transport == "direct", server=server)


@pytest.fixture(params=["serve", "direct"])
def transport(request) -> str:
    """The failures below behave the same whichever way a channel travels."""
    return request.param


def metric(s, name: str, labels: dict | None = None) -> float | None:
    return s.metric(name, labels)


async def health(s) -> dict:
    return await s.frontend.health_status()


STREAM = {"model": "tiny", "prompt": "hello there", "stream": True, "ignore_eos": True}


# ============================================================================ in process: failover


@pytest.mark.parametrize("max_migrations", [2, 0])
def test_dead_decode_worker_retries_waiting_requests_and_migrates_streams(model_dir, max_migrations, transport):
    """d0 dies with a stream that has tokens out and a request still waiting for its first token. The
    waiting one is retried on d1; the stream migrates to d1, which resumes after the tokens sent: the
    client sees every token once, in order, and a normal end. Without migrations the stream ends with
    an error event instead."""
    d0, d1 = FakeWorker("d0", slots=1, delay=0.01), FakeWorker("d1", slots=8, delay=0.002)

    async def main():
        s = await make_serving(model_dir, [], [d0, d1], transport, max_migrations=max_migrations)
        # Round-robin: a -> d0 (streams), b -> d1, c -> d0 (waits for d0's only slot: no token yet).
        a = await s.frontend.completions(http_request({**STREAM, "max_tokens": 200}))
        a_events = asyncio.create_task(sse_events(a))
        b = await s.frontend.completions(http_request({**STREAM, "max_tokens": 4}))
        c = asyncio.create_task(s.frontend.completions(http_request({**STREAM, "max_tokens": 4})))
        await until(lambda: len(d0.requests) == 2)  # a and c reached d0; c waits for its only slot
        assert not c.done() and d0.started == [d0.started[0]]  # c is waiting
        assert (await health(s))["decode_workers"] == 2
        d0.kill()
        killed = time.monotonic()
        new = await s.frontend.completions(http_request({"model": "tiny", "prompt": "new", "max_tokens": 3}))
        assert new.status_code == 200 and body_of(new)["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - killed < 2
        assert (await health(s))["decode_workers"] == 1  # at once, not at the heartbeat TTL
        c_response = await c
        assert c_response.status_code == 200
        c_events = await sse_events(c_response)
        assert c_events[-1] == "[DONE]" and c_events[-2]["choices"][0]["finish_reason"] == "length"
        assert await sse_events(b) and True
        return s, await a_events

    s, a_events = run(main())
    assert metric(s, "moray_failovers_total", {"result": "retried"}) == 1
    assert metric(s, "vllm:num_requests_running", {"engine": "d0", "role": "decode"}) is None  # its series left
    assert metric(s, "vllm:num_requests_running", {"engine": "d1", "role": "decode"}) == 0
    if max_migrations:
        assert a_events[-1] == "[DONE]" and all("error" not in e for e in a_events[:-1])
        assert a_events[-2]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in a_events[:-1]) == "".join(f"t{i} " for i in range(200))
        (moved,) = [r for r in d1.requests if r.resume]
        assert list(moved.resume) == [100 + i for i in range(len(moved.resume))] and 0 < len(moved.resume) < 200
        assert metric(s, "moray_failovers_total", {"result": "migrated"}) == 1
        assert metric(s, "moray_failovers_total", {"result": "failed"}) in (None, 0)
        return
    # The stream that had tokens: a final chunk with finish_reason "error", then an error event.
    assert len(a_events) >= 4 and a_events[-1] == "[DONE]"
    assert a_events[-3]["choices"][0]["finish_reason"] == "error"
    error = a_events[-2]["error"]
    assert error["code"] == "worker_failed" and "decode worker" in error["message"] and "Traceback" not in error["message"]
    assert metric(s, "moray_failovers_total", {"result": "failed"}) == 1
    assert metric(s, "moray_request_failures_total", {"api": "completions", "outcome": "error"}) == 1


def test_a_stream_that_ends_unfinished_is_a_failed_worker(model_dir, transport):
    """A killed replica's Serve stream may end as if complete. A stream that ends without a finished
    output is a failure: a request without tokens is retried elsewhere, one with tokens migrates (here:
    may not, and ends with an error event; never a [DONE] after an unfinished chunk)."""
    d0, d1 = FakeWorker("d0", slots=1, delay=0.01), FakeWorker("d1", slots=8, delay=0.002)

    async def main():
        s = await make_serving(model_dir, [], [d0, d1], transport, max_migrations=0)
        a = await s.frontend.completions(http_request({**STREAM, "max_tokens": 200}))  # -> d0, streams
        a_events = asyncio.create_task(sse_events(a))
        await s.frontend.completions(http_request({**STREAM, "max_tokens": 1}))  # -> d1
        c = asyncio.create_task(s.frontend.completions(http_request({**STREAM, "max_tokens": 4})))  # -> d0, waits
        await until(lambda: len(d0.requests) == 2 and d0.started)  # a streams on d0, c waits there
        d0.kill(quietly=True)
        c_events = await sse_events(await c)
        assert c_events[-1] == "[DONE]" and c_events[-2]["choices"][0]["finish_reason"] == "length", c_events[-3:]
        assert (await health(s))["decode_workers"] == 1
        return await a_events

    a_events = run(main())
    assert a_events[-1] == "[DONE]" and a_events[-3]["choices"][0]["finish_reason"] == "error", a_events[-3:]
    assert a_events[-2]["error"]["code"] == "worker_failed"


async def served_until_the_idle_close(model_dir, d0, closing_delay_s: float, transport: str = "serve"):
    """The front end over `d0` after one request, once d0 closed its idle channel (its `closing` batch
    takes `closing_delay_s` to reach the front end)."""
    d0.linger_s, d0.closing_delay_s = 0.05, closing_delay_s
    s = await make_serving(model_dir, [], [d0], transport)
    first = await s.frontend.completions(http_request({"model": "tiny", "prompt": "hi", "max_tokens": 2}))
    assert first.status_code == 200, first.body
    await until(lambda: d0.channels and all(o.closed for o in d0.channels.values()))  # closed, not yet told
    return s


def test_a_request_started_while_the_idle_close_is_on_its_way_opens_a_new_channel(model_dir, transport):
    """The worker closed its idle channel and its `closing` batch is still on the way (a loaded machine):
    the next request's starts are refused. It waits for that batch and opens a new channel; it used to
    subscribe to the stale channel again at once and fail after three refusals (a 503 with
    "failed (ChannelIdleClosed)" in test_cluster's structured outputs, in a full run)."""
    d0 = FakeWorker("d0")

    async def main():
        s = await served_until_the_idle_close(model_dir, d0, 0.5, transport)
        (old,) = d0.channels.values()
        second = await s.frontend.completions(http_request({"model": "tiny", "prompt": "hi", "max_tokens": 3}))
        return second, old, list(d0.channels.values())

    second, old, now = run(main())
    assert second.status_code == 200, second.body
    assert body_of(second)["usage"]["completion_tokens"] == 3
    assert len(now) == 2 and now[0] is old and not now[1].closed  # it ran on a new channel


def test_a_start_sent_before_its_channel_closed_never_begins_on_the_channel_opened_after(model_dir, transport):
    """A request listens on a channel whose idle close is on its way, and its start is slower still (a
    loaded machine): by the time the start arrives, the next request opened a new channel. The start must be
    refused (its request was told its channel closed and opens the new one itself); it used to begin on
    the new channel, the request then started again on the same worker, and the client got a 400 "request id
    ... is already in use" (a full run's bench routing, bench serve and scale-down tests, all at once)."""
    d0 = FakeWorker("d0")

    async def main():
        s = await served_until_the_idle_close(model_dir, d0, 0.2, transport)
        d0.start_delay_s, d0.linger_s = 0.4, 2.0  # the next channel stays open while the start is on its way
        late = asyncio.create_task(s.frontend.completions(http_request({"model": "tiny", "prompt": "hi", "max_tokens": 40})))
        await until(lambda: len(d0.requests) == 2)  # its start is on its way
        await until(lambda: not s.frontend.pipeline.channels.open_workers())  # the front end knows it closed
        d0.start_delay_s = 0.0
        other = await s.frontend.completions(http_request({"model": "tiny", "prompt": "hi", "max_tokens": 4}))
        return await late, other

    late, other = run(main())
    assert late.status_code == 200 and other.status_code == 200, (late.body, other.body)
    assert body_of(late)["choices"][0]["text"] == "".join(f"t{i} " for i in range(40))
    assert body_of(other)["usage"]["completion_tokens"] == 4
    assert len(d0.started) == len(set(d0.started)) == 3 and d0.aborted == [], (d0.started, d0.aborted)  # each ran once


def test_a_request_lost_by_a_live_worker_moves_without_marking_the_worker_failed(model_dir, transport):
    """The worker stops running a request without a last delta (here: dropped on the worker's side), so its
    channel goes idle and closes while the front end still waits for tokens. The worker answered, so it is
    alive: it stays in routing and /health, and the stream migrates (onto it again, the only one) and ends
    normally. It used to be marked failed: with no decode worker left the stream ended with an error and,
    in a full run's fuzz test, the requests after it got 503s for a heartbeat's time."""
    d0 = FakeWorker("d0", delay=0.02)
    d0.linger_s = 0.05

    async def main():
        s = await make_serving(model_dir, [], [d0], transport, max_migrations=1)
        response = await s.frontend.completions(http_request({**STREAM, "max_tokens": 12}))
        events = asyncio.create_task(sse_events(response))
        await until(lambda: d0.tokens_out >= 3)
        (rid,) = list(d0._running)
        task, outbox, _ = d0._running.pop(rid)  # lost on the worker: no final delta, no error
        task.cancel()
        outbox.request_ended()
        out = await events
        return out, await health(s)

    events, status = run(main())
    assert events[-1] == "[DONE]" and events[-2].get("choices", [{}])[0].get("finish_reason") == "length", events[-3:]
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices"))
    assert text == "".join(f"t{i} " for i in range(12)), text  # resumed where it stopped: no token lost or repeated
    assert status["decode_workers"] == 1, status


def test_a_stream_migrates_at_most_max_migrations_times(model_dir, transport):
    """Every decode worker it moves to dies too: after `max_migrations` moves the stream ends with an
    error that says so."""
    workers = [FakeWorker(f"d{i}", slots=1, delay=0.01) for i in range(3)]

    async def main():
        s = await make_serving(model_dir, [], workers, transport, max_migrations=1)
        a = await s.frontend.completions(http_request({**STREAM, "max_tokens": 200}))
        events = asyncio.create_task(sse_events(a))
        for _ in range(2):
            await until(lambda: any(w.started and not w.dead.is_set() for w in workers))
            (serving_one,) = [w for w in workers if w.started and not w.dead.is_set()]
            await until(lambda: serving_one.tokens_out >= 3, timeout=10)  # a few tokens out from this one
            serving_one.kill()
        return s, await events

    s, events = run(main())
    assert events[-1] == "[DONE]" and events[-3]["choices"][0]["finish_reason"] == "error"
    assert "moved 1 times already" in events[-2]["error"]["message"]
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == "".join(f"t{i} " for i in range(len(text.split())))  # what did go out: in order, once
    assert metric(s, "moray_failovers_total", {"result": "migrated"}) == 1


@pytest.mark.parametrize("max_migrations", [2, 0])
def test_a_replica_serve_stops_hands_its_streams_over(model_dir, max_migrations, transport):
    """Serve stops d0 (scale-down, redeploy) while it streams: the registry hears it from Serve's controller
    (here: a scripted answer), d0 drains, and the stream moves to d1 after the tokens already sent: every
    token once, in order; d0 is aborted, not failed. With no moves allowed the stream finishes on d0."""
    d0, d1 = FakeWorker("d0", slots=8, delay=0.01), FakeWorker("d1", slots=8, delay=0.002)

    async def main():
        s = await make_serving(model_dir, [], [d0, d1], transport, max_migrations=max_migrations)
        a = await s.frontend.completions(http_request({**STREAM, "max_tokens": 200}))  # -> d0
        events = asyncio.create_task(sse_events(a))
        await until(lambda: d0.tokens_out >= 5)
        s.registry.replicas_source = lambda: {"d1", "d2"}  # Serve keeps d1 (d2 is starting), stops d0
        assert await s.registry.watch_stopping_once() == ["d0"]
        await s.report()  # d0's own heartbeat says alive: Serve's word stands
        assert s.pipeline.membership.live("decode") == ["d1"] and s.pipeline.membership.draining() == ["d0"]
        new = await s.frontend.completions(http_request({"model": "tiny", "prompt": "new", "max_tokens": 3}))
        assert new.status_code == 200
        return s, await events

    s, events = run(main())
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "".join(f"t{i} " for i in range(200))
    assert [r.request_id for r in d0.requests] == [d0.requests[0].request_id]  # the new request went to d1
    assert metric(s, "moray_failovers_total", {"result": "failed"}) in (None, 0)
    assert not s.pipeline.membership.is_failed("d0")
    if max_migrations:
        (moved,) = [r for r in d1.requests if r.resume]
        assert 5 <= len(moved.resume) < 200 and d0.aborted == [moved.request_id]
        assert metric(s, "moray_failovers_total", {"result": "drained"}) == 1
    else:
        assert not d0.aborted and d0.tokens_out == 200 and not any(r.resume for r in d1.requests)


def test_a_call_meant_for_another_replica_does_nothing_here():
    """Serve sends a call whose target replica it is stopping to another replica. An abort (or a release)
    meant for the stopping one must not stop the same request here, where it runs after moving (found by
    the scale-down test: every moved stream was aborted on its new replica)."""
    from fakes import decode_server, prefill_server

    d1, p1 = FakeWorker("d1"), FakeWorker("p1")

    async def main():
        decode, prefill = decode_server(d1), prefill_server(p1)
        d1.abort = lambda request_id: d1.aborted.append(request_id)
        await decode.abort("r1", target_replica="d0")
        released = await prefill.release("r1", target_replica="p0")
        await decode.abort("r2", target_replica="d1")
        return released

    assert run(main()) is False and p1.released == []
    assert d1.aborted == ["r2"] and d1.counters.misrouted == 1 and p1.counters.misrouted == 1


@pytest.mark.cluster
def test_the_replicas_serve_keeps_are_read_from_the_controller(ray_serve):
    """The registry's question to Serve, on a real Serve instance: a redeploy from 2 replicas to 1 while
    both hold streams. The stopped replica runs on (its streams hold it) but is no longer among the app's
    replicas, named by the ids the workers report (ReplicaContext.replica_id.unique_id)."""
    from ray import serve

    from cluster.registry import serve_replicas

    # max_ongoing_requests above the (at most 24) held streams: Serve's default (5) let one replica take 5 of them, and a
    # call to that replica then queued behind streams that last a minute (CI timed out on `whoami` once).
    @serve.deployment(
        graceful_shutdown_timeout_s=60, graceful_shutdown_wait_loop_s=0.2, max_ongoing_requests=32, ray_actor_options={"num_cpus": 0}
    )
    class Probe:
        async def hold(self):
            yield serve.get_replica_context().replica_id.unique_id
            await asyncio.sleep(60)

        async def whoami(self) -> str:
            return serve.get_replica_context().replica_id.unique_id

    app = "replicas_probe"
    redeploy = None
    handle = serve.run(Probe.options(num_replicas=2).bind(), name=app, route_prefix=None)
    streams, holding = [], set()
    try:
        # Streams until both replicas hold some: Serve's router places by queue lengths it asks the replicas
        # for, and on a loaded machine those answers time out and it may place every stream on one replica
        # (CI: 8 of 8 on one). 24 streams stay under max_ongoing_requests, so none waits in a queue.
        while len(holding) < 2 and len(streams) < 24:
            streams.append(handle.options(stream=True).hold.remote())
            holding.add(next(iter(streams[-1])))
        assert len(holding) == 2 and serve_replicas(app) == holding
        assert serve_replicas("no_such_app") is None
        # serve.run returns once the old replicas are gone (their streams hold them for a minute): meanwhile
        redeploy = threading.Thread(
            target=serve.run, args=(Probe.options(num_replicas=1).bind(),), kwargs={"name": app, "route_prefix": None}
        )
        redeploy.start()
        wait_until(lambda: len(serve_replicas(app) or ()) == 1, 30, 0.2, "the scale-down")
        (kept,) = serve_replicas(app)  # one of the two (a scale-down), or a new one (Serve replaced both)
        assert handle.whoami.remote().result(timeout_s=60) == kept
        import ray

        stopped = holding - {kept}
        alive = {a["name"].rsplit("#", 1)[1] for a in ray.util.list_named_actors(all_namespaces=True) if f"::{app}#Probe#" in a["name"]}
        assert stopped and stopped <= alive  # still running (their streams hold them): being stopped, not gone
    finally:
        for s in streams:
            s.cancel()
        if redeploy is not None:
            redeploy.join(60)
        serve.delete(app)


def test_decode_failure_after_remote_prefill_retries_decode_with_the_same_handoff(model_dir):
    p0, d0, d1 = FakeWorker("p0"), FakeWorker("d0", slots=0), FakeWorker("d1")

    async def main():
        s = await make_serving(model_dir, [p0], [d0, d1])
        a = await s.frontend.completions(http_request({**STREAM, "max_tokens": 5}))  # first token from p0; decode on d0 never starts
        events = asyncio.create_task(sse_events(a))
        await until(lambda: d0.requests)  # the decode request reached d0
        d0.kill()
        return await events

    events = run(main())
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert texts[0] == "first " and len(texts) == 5 and events[-2]["choices"][0]["finish_reason"] == "length"
    assert d1.started and not any("error" in e for e in events[:-1])


def test_stream_ending_in_an_error_after_the_handoff_frees_the_prefill_hold(model_dir):
    p0, d0 = FakeWorker("p0"), FakeWorker("d0", slots=0)  # the only decode worker dies: nowhere to retry

    async def main():
        s = await make_serving(model_dir, [p0], [d0])
        a = await s.frontend.completions(http_request({**STREAM, "max_tokens": 5}))
        events = asyncio.create_task(sse_events(a))
        await until(lambda: d0.requests)
        d0.kill()
        got = await events
        await until(lambda: p0.released)  # the release goes out in the background
        return got

    events = run(main())
    assert events[0]["choices"][0]["text"] == "first " and events[1]["choices"][0]["finish_reason"] == "error"
    assert events[2]["error"]["code"] == "worker_failed" and events[3] == "[DONE]"
    assert set(p0.released) == set(p0.prefilled)  # not left to the hold timeout


def test_no_live_worker_left_is_a_503_before_any_token(model_dir):
    d0 = FakeWorker("d0", slots=0)

    async def main():
        s = await make_serving(model_dir, [], [d0])
        request = asyncio.create_task(s.frontend.completions(http_request({**STREAM, "max_tokens": 4})))
        await until(lambda: d0.requests)
        d0.kill()
        return await request

    response = run(main())
    assert response.status_code == 503 and body_of(response)["error"]["code"] == "worker_failed"


def test_a_front_ends_first_requests_wait_for_its_view_of_the_workers_not_a_503(model_dir):
    """A second front end replica (a scale-up, a restart, or one that no health check reached) takes its
    first requests before it has followed the registry: it asks the registry then (one call for all of
    them), and serves them."""
    from fakes import LocalHandle

    from cluster.frontend import Frontend

    d0 = FakeWorker("d0")

    class DistantRegistry:
        """The real registry, its answers a network hop away (the first requests arrive meanwhile)."""

        def __init__(self, registry):
            self.registry = registry

        async def changes(self, *args, **kwargs):
            await asyncio.sleep(0.05)
            return await self.registry.changes(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.registry, name)

    async def main():
        s = await make_serving(model_dir, [], [d0])
        registry = LocalHandle(DistantRegistry(s.registry))
        fresh = Frontend.func_or_class.__bases__[0](s.pipeline.config.model_dump(mode="json"), None, s.decode_handle, registry)
        assert not fresh.pipeline.membership.snapshot.taken_at
        body = {**STREAM, "stream": False, "max_tokens": 3}
        responses = await asyncio.gather(*(fresh.completions(http_request(body)) for _ in range(8)))
        return responses, [method for method, _, _ in registry.calls]

    responses, calls = run(main())
    assert [r.status_code for r in responses] == [200] * 8, body_of(responses[0])
    assert all(body_of(r)["usage"]["completion_tokens"] == 3 for r in responses)
    assert calls.count("changes") == 1, calls  # the first requests shared one call for the registry's view


def test_a_dead_workers_entries_leave_the_front_ends_copy_of_the_index(model_dir):
    """The registry's feed carries stores, not departures: the front end forgets a worker whose heartbeat
    expired by itself, or its copy of the index keeps every block the worker ever held."""
    from workers.messages import KVEvent, KVEventKind, WorkerReport

    d0, d1 = FakeWorker("d0"), FakeWorker("d1")
    ttl = 0.3

    async def main():
        s = await serving(model_dir, [], [d0, d1], router={"heartbeat_ttl_s": ttl})
        stored = [KVEvent("d0", 1, i + 1, KVEventKind.STORED, block_hash=1000 + i, num_tokens=16) for i in range(4)]
        await s.registry.report(WorkerReport(d0.heartbeat(), events=stored))
        await s.report(d1)
        index = s.pipeline.feed.index
        assert set(index.export_worker("d0")[2]) == {(1000 + i, "device") for i in range(4)}
        held_while_alive = len(index.export_worker("d0")[2])
        deadline = time.monotonic() + ttl + 0.2
        while time.monotonic() < deadline:  # d1 stays alive, d0 says nothing more
            await s.report(d1)
            await asyncio.sleep(0.05)
        await s.report(d1)
        return held_while_alive, index.export_worker("d0")[2], set(index.live_workers())

    held, left, live = run(main())
    assert held == 4 and left == [] and live == {"d1"}


# ============================================================================ in process: held KV


@pytest.mark.parametrize("leave_after", [1, 2])
def test_client_leaving_after_the_first_chunk_frees_the_prefill_hold_at_once(model_dir, leave_after, transport):
    p0, d0 = FakeWorker("p0"), FakeWorker("d0", delay=0.05)

    async def main():
        s = await make_serving(model_dir, [p0], [d0], transport)
        response = await s.frontend.completions(http_request({**STREAM, "max_tokens": 50}))
        events = await sse_events(response, stop_after=leave_after)
        await until(lambda: p0.released, timeout=2)  # at once, not at the 60 s hold timeout
        return events

    events = run(main())
    assert events[0]["choices"][0]["text"] == "first "
    assert len(p0.prefilled) == 1 and set(p0.released) == set(p0.prefilled)  # not left to the 60 s hold timeout (release is idempotent)


# ============================================================================ in process: overload


def test_overload_is_refused_with_429_retry_after_and_resource_exhausted(model_dir):
    d0 = FakeWorker("d0", slots=0)  # nothing ever gets a first token

    async def main():
        s = await make_serving(model_dir, [], [d0], max_queued_requests=2)
        waiting = [asyncio.create_task(s.frontend.completions(http_request({**STREAM, "max_tokens": 4}))) for _ in range(2)]
        await until(lambda: metric(s, "moray_ingress_queued_requests") == 2)
        refused = await s.frontend.completions(http_request({"model": "tiny", "prompt": "x", "max_tokens": 2}))
        ctx = FakeContext()
        request = moray_pb2.GenerateRequest(model="tiny", prompt="hi").SerializeToString()
        await s.frontend.Complete(request, grpc_context=ctx)
        ctx2 = FakeContext()
        with pytest.raises(oa.APIError):
            async for _ in s.frontend.Generate(request, grpc_context=ctx2):
                pass
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await until(lambda: s.pipeline.orchestrator.queued == 0)
        return s, refused, ctx, ctx2

    s, refused, ctx, ctx2 = run(main())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert body_of(refused)["error"]["code"] == "overloaded"
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in ctx.details
    assert ctx2.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert metric(s, "moray_rejected_requests_total", {"reason": "overloaded"}) == 3
    assert metric(s, "moray_ingress_queued_requests") == 0 and s.pipeline.orchestrator.queued == 0


def test_queue_slots_are_given_back_at_the_first_token(model_dir):
    d0 = FakeWorker("d0", slots=8, delay=0.002)

    async def main():
        s = await make_serving(model_dir, [], [d0], max_queued_requests=1)
        statuses = []
        for _ in range(5):  # one at a time: never more than one waiting
            response = await s.frontend.completions(http_request({"model": "tiny", "prompt": "x", "max_tokens": 3}))
            statuses.append(response.status_code)
        return s, statuses

    s, statuses = run(main())
    assert statuses == [200] * 5 and s.pipeline.orchestrator.queued == 0


# ============================================================================ in process: timeouts


def test_request_past_the_timeout_is_aborted_with_504_and_deadline_exceeded(model_dir, transport):
    stuck = FakeWorker("d0", slots=0)

    async def main():
        s = await make_serving(model_dir, [], [stuck], transport, request_timeout_s=0.3)
        t0 = time.monotonic()
        full = await s.frontend.completions(http_request({"model": "tiny", "prompt": "x", "max_tokens": 3}))
        elapsed = time.monotonic() - t0
        ctx = FakeContext()
        await s.frontend.Complete(moray_pb2.GenerateRequest(model="tiny", prompt="hi").SerializeToString(), grpc_context=ctx)
        await until(lambda: len(stuck.aborted) == 2)  # the aborts are sent in the background
        return s, full, elapsed, ctx

    s, full, elapsed, ctx = run(main())
    assert full.status_code == 504 and body_of(full)["error"]["code"] == "request_timeout", body_of(full)
    assert 0.2 < elapsed < 1.0
    assert len(stuck.aborted) == 2  # the decode replica was told to abort them: it frees the KV
    assert ctx.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert metric(s, "moray_request_timeouts_total", {"stage": "decode"}) == 2
    assert s.pipeline.orchestrator.queued == 0


def test_stream_past_the_timeout_ends_with_a_timeout_chunk_and_an_error_event(model_dir, transport):
    slow = FakeWorker("d0", delay=0.05)

    async def main():
        s = await make_serving(model_dir, [], [slow], transport, request_timeout_s=0.4)
        response = await s.frontend.completions(http_request({**STREAM, "max_tokens": 200}))
        events = await sse_events(response)
        await until(lambda: slow.aborted == slow.started)
        return s, events

    s, events = run(main())
    assert 3 <= len(events) < 15 and events[-1] == "[DONE]"
    assert events[-3]["choices"][0]["finish_reason"] == "timeout"
    assert events[-2]["error"]["code"] == "request_timeout"
    assert slow.aborted == slow.started
    assert metric(s, "moray_request_failures_total", {"api": "completions", "outcome": "timeout"}) == 1


# ============================================================================ a real local Ray cluster

APP = "failover"
REMOTE_PREFILL_MIN_TOKENS = 32  # longer prompts go through the prefill worker and a KV handoff


@pytest.fixture(scope="module")
def cluster(model_dir, ray_serve):
    """1 prefill + 2 decode replicas. Prompts shorter than REMOTE_PREFILL_MIN_TOKENS are prefilled on the
    decode worker (so a decode replica's own queue is where a request waits for its first token)."""
    cfg = cluster_config(
        model_dir,
        name=APP,
        decode={"replicas": 2},
        router={"policy": "round-robin", "remote_prefill_min_tokens": REMOTE_PREFILL_MIN_TOKENS},
        # The queueing test needs its long streams to outlast the waiting requests' arrival; with
        # asynchronous scheduling the tiny model decodes them faster than the model length allows for.
        # (Its timings were also tuned with every program compiled before serving.)
        engine={"async_scheduling": False, "background_compile": False},
    )
    with served_app(ray_serve, cfg, "/") as app:
        # Both decode replicas reported.
        wait_until(lambda: http_json(app.base + "/health", key=None)[1].get("decode_workers") == 2, 300, 0.25, "2 decode workers")
        yield {"base": app.base, "config": app.config}


def replicas(deployment: str) -> dict[str, object]:
    """Replica id -> actor handle of one deployment of the app."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(prefix):
            try:
                out[a["name"].removeprefix(prefix)] = ray.get_actor(a["name"], namespace=a["namespace"])
            except ValueError:  # gone in the meantime
                pass
    return out


def worker_loads(skip: set[str] = frozenset()) -> dict:
    """Every live replica's heartbeat, asked of that replica itself (the router honours target_replica)."""
    from ray import serve

    loads = {}
    for deployment in ("PrefillServer", "DecodeServer"):
        handle = serve.get_deployment_handle(deployment, APP)
        for rid in replicas(deployment):
            if rid not in skip:
                try:
                    hb = handle.heartbeat.remote(target_replica=rid).result(timeout_s=10)
                except Exception:  # noqa: BLE001 - a replica that just died (or is starting)
                    continue
                if hb.worker_id == rid:
                    loads[rid] = hb
    return loads


def kv_in_use(hb) -> int:
    e = hb.engine
    return e.num_total_blocks - e.num_free_blocks + e.num_held + e.num_running


def token_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


async def sse_stream(session, base: str, body: dict, leave_after: int | None = None, log: dict | None = None):
    """POSTs a streaming completion; returns (status, events). `leave_after`: disconnect after that many
    events. `log` gets the events so far ("n") and the monotonic times of the first one and the end; setting
    its "leave" makes the client disconnect at the next event."""
    events = []
    try:
        return await _sse_stream(session, base, body, events, leave_after, log)
    finally:
        if log is not None:
            log["done"] = time.monotonic()


async def _sse_stream(session, base, body, events, leave_after, log):
    async with session.post(base + "/v1/completions", json={**body, "stream": True}, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        if r.status != 200:
            return r.status, [await r.text()]
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
            if log is not None:
                log["n"] = len(events)
                log.setdefault("first", time.monotonic())
            if (leave_after is not None and len(events) >= leave_after) or (log is not None and log.get("leave")):
                r.close()  # the client goes away
                break
    return 200, events


STREAM_TOKENS = 240  # with 6 prompt tokens, near the test engine's max_model_len (256)


@pytest.mark.cluster
@pytest.mark.slow
def test_killed_decode_replica_fails_over_and_its_streams_migrate(cluster):
    """(First on the module's cluster: when a replica dies within seconds of 200 cancelled streams, the
    whole HTTP path stalls for about 2 s, /health included, while the ingress's event loop keeps running;
    15 s later it does not. Outside this request path, and not what this test measures.)

    16 greedy streams with tokens and 16 requests waiting for their first token when a decode replica is
    SIGKILLed: none of the waiting ones fails; the victim's 8 streams migrate to the live replica and every
    stream completes with exactly the text the same request gets on the undisturbed cluster (nothing
    missing, nothing twice); new requests succeed; /health and /metrics drop the replica at once."""
    import aiohttp
    import ray

    base = cluster["base"]
    ttl = ClusterConfig.model_validate(cluster["config"]).router.heartbeat_ttl_s
    rng = random.Random(7)
    decode = replicas("DecodeServer")
    assert len(decode) == 2
    victim = sorted(decode)[0]
    victim_pid = ray.get(decode[victim].__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    bodies = [
        {"model": "tiny", "prompt": token_prompt(rng, 6), "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True}
        for _ in range(16)
    ]

    async def undisturbed(session):
        results = await asyncio.gather(*(sse_stream(session, base, body) for body in bodies))
        return [_stream_text(events) for _, events in results]

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            expected = await undisturbed(session)
            metrics_before = http_json(base + "/metrics", key=None)[1]
            failovers_before = _metric_value(metrics_before, "moray_failovers_total", 'result="migrated"')
            dropped_before = _metric_value(metrics_before, "moray_router_worker_failures_total")
            # max_num_seqs is 8 per replica; round-robin puts 8 streams on each, filling both.
            stream_logs = [{} for _ in range(16)]
            streams = [asyncio.create_task(sse_stream(session, base, body, log=log)) for body, log in zip(bodies, stream_logs)]
            deadline = time.monotonic() + 120
            while sum("first" in log for log in stream_logs) < 16:
                assert time.monotonic() < deadline, f"{sum('first' in log for log in stream_logs)} of 16 streams started"
                await asyncio.sleep(0.01)
            wait_logs = [{} for _ in range(16)]
            waiting = [
                asyncio.create_task(
                    sse_stream(
                        session, base, {"model": "tiny", "prompt": token_prompt(rng, 6), "max_tokens": 4, "ignore_eos": True}, log=log
                    )
                )
                for log in wait_logs
            ]
            # The streams fill every slot for a while yet: the new requests wait in the decode engines'
            # queues (as the workers report: vllm:num_requests_waiting). The streams are long, so that they outlast
            # the time the waiting requests need to reach those queues on a loaded machine.
            deadline = time.monotonic() + 30
            while True:
                text = (await asyncio.to_thread(http_json, base + "/metrics", None, None))[1]
                queued = sum(
                    float(l.rsplit(" ", 1)[1])
                    for l in text.splitlines()
                    if l.startswith("vllm:num_requests_waiting{") and 'role="decode"' in l
                )
                if queued >= 16:
                    break
                assert time.monotonic() < deadline and not any(t.done() for t in streams), (queued, [log["n"] for log in stream_logs])
                await asyncio.sleep(0.01)
            assert not any(t.done() for t in streams), [log["n"] for log in stream_logs]
            # SIGKILL, as an OOM kill or a crash does: the process is gone when os.kill returns
            # (ray.kill only asks Ray to kill it, which took over 2 s on a loaded machine).
            os.kill(victim_pid, signal.SIGKILL)
            killed = time.monotonic()
            waiting_at_kill = [i for i, log in enumerate(wait_logs) if "first" not in log]
            sent_at_kill = [log.get("n", 0) for log in stream_logs]

            async def new_request(i):
                status, body = await asyncio.to_thread(
                    http_json, base + "/v1/completions", {"model": "tiny", "prompt": token_prompt(random.Random(i), 5), "max_tokens": 4}
                )
                return status, body, time.monotonic() - killed

            async def poll_health():
                polls = []
                # Until the heartbeat TTL would have dropped it anyway: a drop before then is the failed
                # call's doing (the counter below says so).
                while time.monotonic() - killed < ttl - 1:
                    polls.append(
                        (round(time.monotonic() - killed, 2), (await asyncio.to_thread(http_json, base + "/health", None, None))[1])
                    )
                    if polls[-1][1].get("decode_workers") == 1:
                        break
                    await asyncio.sleep(0.05)
                return polls

            health_task = asyncio.create_task(poll_health())
            new = await asyncio.gather(*(new_request(i) for i in range(4)))
            health = await health_task
            metrics = (await asyncio.to_thread(http_json, base + "/metrics", None, None))[1]
            results = await asyncio.gather(*streams), await asyncio.gather(*waiting)
            migrated = _metric_value(metrics, "moray_failovers_total", 'result="migrated"') - failovers_before
            timeline = [(log.get("n", 0), round(log["done"] - killed, 2)) for log in stream_logs + wait_logs]
            dropped = _metric_value(metrics, "moray_router_worker_failures_total") - dropped_before
            return expected, victim, dropped, waiting_at_kill, sent_at_kill, new, health, metrics, migrated, timeline, *results

    expected, victim, dropped, waiting_at_kill, sent_at_kill, new, health, metrics, migrated, timeline, stream_results, waiting_results = (
        asyncio.run(main())
    )

    assert len(waiting_at_kill) == 16, waiting_at_kill
    for i in waiting_at_kill:  # not one of them failed: they were retried on the live replica
        status, events = waiting_results[i]
        assert status == 200 and events[-1] == "[DONE]", (i, events)
        assert events[-2]["choices"][0]["finish_reason"] == "length", (i, events[-3:])
    for i, (status, events) in enumerate(stream_results):
        assert status == 200 and events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), (i, events[-3:])
        assert events[-2]["choices"][0]["finish_reason"] == "length", (i, events[-3:])
        # What went out before the kill is the undisturbed text (nothing missing or twice). After the move the
        # new replica recomputes prompt + output in one prefill: on this random tiny model a near-tie may then
        # flip a greedy token late in a 240-token stream (seen once in two runs), so only the prefix is exact.
        assert expected[i].startswith(_stream_text(events[: sent_at_kill[i]])), (i, timeline)
    assert migrated == 8, (migrated, timeline)  # round-robin put 8 streams on each replica
    assert sum(_stream_text(events) == e for (_, events), e in zip(stream_results, expected)) >= 8  # the live replica's, at least
    for status, body, _ in new:
        assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    # "At once": dropped because a call to it failed (the front end's counter), not because its heartbeat went
    # stale; the poll that saw it gone was sent well inside the TTL. (Not a 0.1 s bound: on a loaded 2-core
    # machine one /health answer took 1.7 s while 32 streams moved.)
    assert dropped >= 1, (dropped, health)
    assert health and health[-1][1]["decode_workers"] == 1 and health[-1][0] < ttl / 2, health
    assert f'worker="{victim}"' not in metrics


def _stream_text(events) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and "choices" in e)


def _metric_value(text: str, name: str, label: str = "") -> float:
    """The sum of `name`'s series whose line holds `label` (every series, labelled or not, without one)."""
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.split("{", 1)[0].split(" ", 1)[0] == name and label in l)


@pytest.mark.cluster
def test_aborted_streams_free_every_workers_kv_at_once(cluster):
    """200 streams through remote prefill + KV handoff, each left at a random point (before its first chunk,
    right after it, or later): every worker's KV is free within seconds, none waits for the 60 s hold timeout."""
    import aiohttp

    rng = random.Random(13)
    plan = [rng.choice([0, 1, 1, 1, 2, 3, 5, 8]) for _ in range(200)]

    async def one(session, leave_after: int):
        body = {"model": "tiny", "prompt": token_prompt(rng, 40), "max_tokens": 24, "ignore_eos": True}
        if leave_after == 0:  # before the first chunk: the request is cancelled while being prefilled
            try:
                await asyncio.wait_for(sse_stream(session, cluster["base"], body), timeout=rng.uniform(0.0, 0.3))
            except asyncio.TimeoutError:
                pass
            return
        status, events = await sse_stream(session, cluster["base"], body, leave_after=leave_after)
        assert status == 200, events

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            for start in range(0, len(plan), 25):
                await asyncio.gather(*(one(session, k) for k in plan[start : start + 25]))

    asyncio.run(main())
    seen: dict = {}

    # Within 10 s of the last client leaving (free in well under 1 s when idle; one round of heartbeat calls
    # alone can take a second on a loaded 2-core machine): none waits for the 60 s hold timeout.
    def all_free() -> bool:
        seen["loads"] = worker_loads()
        seen["busy"] = {w: hb for w, hb in seen["loads"].items() if kv_in_use(hb)}
        return not seen["busy"]

    try:
        wait_until(all_free, 10.0, 0.1)
    except TimeoutError:
        pass
    loads, busy = seen["loads"], seen["busy"]
    # (after the failover test one decode replica is new, or still starting: every live one counts)
    assert any(hb.role == "prefill" for hb in loads.values()) and any(hb.role == "decode" for hb in loads.values()), loads
    assert not busy, {w: (hb.role, hb.engine) for w, hb in busy.items()}


@pytest.mark.cluster
@pytest.mark.slow
def test_a_scale_down_moves_the_stopped_replicas_streams_and_lets_it_stop(cluster):
    """(Last on the module's cluster: it leaves one decode replica.) 16 greedy streams over both decode
    replicas when the decode pool scales from 2 replicas to 1: the registry sees Serve stop one, its 8
    streams move to the other after the tokens already sent, the stopped replica is gone long before its
    streams (or graceful_shutdown_timeout_s) would have ended, and every stream completes: the text sent
    before the move is the undisturbed text, nothing missing or twice; no other replica restarted."""
    import threading

    import aiohttp
    from ray import serve

    from cluster.app import build_app
    from cluster.registry import serve_replicas

    base = cluster["base"]
    wait_until(lambda: http_json(base + "/health", key=None)[1].get("decode_workers") == 2, 300, 0.25, "2 decode workers")
    decode = set(replicas("DecodeServer"))
    others = set(replicas("PrefillServer")) | set(replicas("Frontend")) | set(replicas("Registry"))
    rng = random.Random(17)
    bodies = [
        {"model": "tiny", "prompt": token_prompt(rng, 6), "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True}
        for _ in range(16)
    ]
    config = cluster["config"]
    smaller = build_app({**config, "decode": {**config.get("decode", {}), "replicas": 1}})

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            expected = [_stream_text(events) for _, events in await asyncio.gather(*(sse_stream(session, base, b) for b in bodies))]
            before = _metric_value(http_json(base + "/metrics", key=None)[1], "moray_failovers_total", 'result="drained"')
            logs = [{} for _ in bodies]
            streams = [asyncio.create_task(sse_stream(session, base, b, log=log)) for b, log in zip(bodies, logs)]
            while sum("first" in log for log in logs) < 16 or min(log["n"] for log in logs) < 10:
                assert not any(t.done() for t in streams)
                await asyncio.sleep(0.01)
            scaled = time.monotonic()
            redeploy = threading.Thread(target=serve.run, args=(smaller,), kwargs={"name": APP, "route_prefix": "/"}, daemon=True)
            redeploy.start()
            await asyncio.to_thread(wait_until, lambda: len((serve_replicas(APP) or set()) & decode) == 1, 60, 0.1, "the scale-down")
            (stopped,) = decode - serve_replicas(APP)
            sent_at_stop = [log.get("n", 0) for log in logs]
            await asyncio.to_thread(wait_until, lambda: stopped not in replicas("DecodeServer"), 60, 0.1, "the stopped replica gone")
            gone_after = time.monotonic() - scaled
            running_when_gone = sum(not t.done() for t in streams)
            results = await asyncio.gather(*streams)
            await asyncio.to_thread(redeploy.join, 60)
            drained = _metric_value(http_json(base + "/metrics", key=None)[1], "moray_failovers_total", 'result="drained"') - before
            return expected, stopped, sent_at_stop, gone_after, running_when_gone, results, drained

    expected, stopped, sent_at_stop, gone_after, running_when_gone, results, drained = asyncio.run(main())
    assert drained == 8, (drained, gone_after, running_when_gone, sent_at_stop)  # round-robin: 8 streams on each replica
    # Gone while streams still ran (its own would have, had they stayed), well before the 30 s graceful timeout.
    assert running_when_gone > 0 and gone_after < 20, (running_when_gone, gone_after)
    for i, (status, events) in enumerate(results):
        assert status == 200 and events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), (i, events[-3:])
        assert events[-2]["choices"][0]["finish_reason"] == "length", (i, events[-3:])
        # As after a kill: the moved streams recompute prompt + output in one prefill, where a near-tie of this
        # random tiny model may flip a later greedy token; what went out before the move is exact.
        assert expected[i].startswith(_stream_text(events[: sent_at_stop[i]])), i
    assert sum(_stream_text(events) == e for (_, events), e in zip(results, expected)) >= 8  # the kept replica's, at least
    assert set(replicas("DecodeServer")) == decode - {stopped}
    assert set(replicas("PrefillServer")) | set(replicas("Frontend")) | set(replicas("Registry")) == others  # none restarted
