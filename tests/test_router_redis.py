"""The KV index backends against a real redis-server (started here on a free port, killed at the end):
index semantics on both backends, the worker-side event sink, replicas, restarts, dead workers,
degradation, the stream consumer, AUTH/ACL and TLS."""

from __future__ import annotations

import datetime
import ipaddress
import random
import socket
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from router_harness import BS, MODEL, REDIS_SERVER, RedisServer, SimWorker, redis_index, stored, tokens

from cluster.config import KVIndexConfig, RouterConfig
from cluster.router import (
    IndexUnavailable,
    KVEventStreamConsumer,
    MemoryKVIndex,
    MirroredKVIndex,
    PrefixMatch,
    RedisKVEventSink,
    RedisKVIndex,
    Router,
    RouteRequest,
    WorkerLoad,
)
from cluster.router.redis_conn import connect, connect_from_config
from cluster.router.redis_index import pack_decision, unpack_decision
from workers.engine.block_hash import block_hashes
from workers.engine.kv_events import KVEvent, KVEventKind, KVEventPublisher

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)")

CHAIN = list(range(1, 41))  # stand-in block hashes: the index only compares them


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield s
    s.stop()


@pytest.fixture
def client(server):
    c = connect(server.url(), 2.0)
    c.flushall()
    return c


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = predicate()
        if out:
            return out
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


# ---------------------------------------------------------------- both backends, same semantics


class Backend:
    """One index backend plus how to let time pass for it (a fake clock, or real seconds for Redis)."""

    def __init__(self, kind: str, server=None, heartbeat_ttl_s: float = 10.0, speculative_ttl_s: float = 2.0):
        self.kind = kind
        if kind == "memory":
            self.t = 1000.0
            self.index = MemoryKVIndex(heartbeat_ttl_s=heartbeat_ttl_s, clock=lambda: self.t)
        else:
            self.index = redis_index(server, heartbeat_ttl_s=heartbeat_ttl_s, speculative_ttl_s=speculative_ttl_s)

    def advance(self, seconds: float) -> None:
        if self.kind == "memory":
            self.t += seconds
        else:
            time.sleep(seconds)

    def live(self, *workers: str, role: str = "decode", sparse: bool = False) -> None:
        for w in workers:
            self.index.heartbeat(WorkerLoad(w, role, ts=time.time(), sparse_blocks=sparse))


@pytest.fixture(params=["memory", "redis"])
def backend(request):
    if request.param == "redis":
        server = request.getfixturevalue("server")
        connect(server.url(), 2.0).flushall()
        return lambda **kw: Backend("redis", server, **kw)
    return lambda **kw: Backend("memory", **kw)


def test_longest_prefix_for_every_worker_at_once(backend):
    b = backend()
    b.live("w0", "w1")
    b.live("w2", sparse=True)  # may lack a chain's first block: a hybrid engine (Redis looks only for those)
    b.index.apply(stored("w0", CHAIN[:10]))
    # Holes no longer end a match: hashes are chained, so holding block i means holding the prefix through
    # block i (hybrid engines publish only the blocks they can resume from). The match is the deepest
    # held block + 1. (Under the old consecutive rule w1 matched 5 and w2 nothing.)
    b.index.apply(stored("w1", CHAIN[:5] + CHAIN[6:9]))  # a hole at block 5: deepest block 8
    b.index.apply(stored("w2", CHAIN[5:10]))  # no first block, deepest block 9
    assert b.index.longest_prefix(CHAIN[:10]) == {"w0": 10, "w1": 9, "w2": 10}
    assert b.index.longest_prefix(CHAIN[:3]) == {"w0": 3, "w1": 3}
    # A different first block changes every chained hash after it: nothing of the chain is held.
    assert b.index.longest_prefix([999, 998, 997]) == {}
    assert b.index.longest_prefix([]) == {}


def test_slower_tiers_count_as_offloaded_and_removals_end_the_prefix(backend):
    b = backend()
    b.live("w0")
    b.index.apply(stored("w0", CHAIN[:4]) + stored("w0", CHAIN[4:8], start_seq=4, tier="host"))
    b.index.apply(stored("w0", CHAIN[2:3], start_seq=8, tier="host"))  # block 2 also offloaded: still device
    assert b.index.lookup(CHAIN[:10]).matches == {"w0": PrefixMatch(8, 4)}
    b.index.apply([KVEvent("w0", 1, 9, KVEventKind.REMOVED, CHAIN[2], 0, BS, "device")])  # block 2: host only now
    assert b.index.lookup(CHAIN[:10]).matches == {"w0": PrefixMatch(8, 5)}
    # A hole in the middle does not end the match (the deepest held block does; the old consecutive rule
    # gave PrefixMatch(5, 2) here): blocks 2, 4, 6 and 7 are offloaded, block 5 is not held at all.
    b.index.apply([KVEvent("w0", 1, 10, KVEventKind.REMOVED, CHAIN[5], 0, BS, "host")])
    assert b.index.lookup(CHAIN[:10]).matches == {"w0": PrefixMatch(8, 4)}
    # Removing the tail (how engines evict) ends it.
    b.index.apply([KVEvent("w0", 1, 11 + i, KVEventKind.REMOVED, CHAIN[7 - i], 0, BS, "host") for i in range(2)])
    assert b.index.lookup(CHAIN[:10]).matches == {"w0": PrefixMatch(5, 2)}  # blocks 2 and 4 offloaded


def test_sequence_gap_purges_the_worker_then_applies_what_follows(backend):
    b = backend()
    b.live("w0", "w1")
    b.index.apply(stored("w0", CHAIN[:5]))  # seq 0-4
    b.index.apply(stored("w1", CHAIN[:5]))
    b.index.apply(stored("w0", [CHAIN[20]], start_seq=7))  # seq 5 and 6 were lost
    assert b.index.longest_prefix(CHAIN[:5]) == {"w1": 5}
    b.index.apply(stored("w0", CHAIN[:2], start_seq=8))  # what follows the gap counts again
    assert b.index.longest_prefix(CHAIN[:5]) == {"w0": 2, "w1": 5}
    assert b.index.longest_prefix([CHAIN[20]]) == {"w0": 1}


def test_a_new_epoch_or_a_cleared_event_purges_the_worker(backend):
    b = backend()
    b.live("w0")
    b.index.apply(stored("w0", CHAIN[:5], epoch=1))
    b.index.apply(stored("w0", CHAIN[10:12], epoch=2))  # the engine restarted
    assert b.index.longest_prefix(CHAIN[:5]) == {}
    assert b.index.longest_prefix(CHAIN[10:12]) == {"w0": 2}
    b.index.apply([KVEvent("w0", 2, 2, KVEventKind.CLEARED)] + stored("w0", CHAIN[30:31], epoch=2, start_seq=3))
    assert b.index.longest_prefix(CHAIN[10:12]) == {}
    assert b.index.longest_prefix(CHAIN[30:31]) == {"w0": 1}


def test_replayed_events_are_applied_once(backend):
    b = backend()
    b.live("w0")
    events = stored("w0", CHAIN[:5])
    b.index.apply(events)
    b.index.apply(events)  # a replay of the same batch
    b.index.apply(events[3:] + stored("w0", CHAIN[5:7], start_seq=5))  # overlapping: only seq 5, 6 are new
    b.index.apply([KVEvent("w0", 1, 2, KVEventKind.REMOVED, CHAIN[2], 0, BS)])  # old seq: ignored, not a gap
    assert b.index.longest_prefix(CHAIN[:10]) == {"w0": 7}


def test_a_worker_whose_heartbeat_stops_is_ignored_within_the_ttl(backend):
    b = backend(heartbeat_ttl_s=1.0)
    b.live("w0", "w1")
    b.index.apply(stored("w0", CHAIN[:10]) + stored("w1", CHAIN[:2]))
    router = Router(b.index, RouterConfig(speculative_ttl_s=0), block_size=BS)
    assert router.route(RouteRequest("a", CHAIN[:10], 10 * BS)).decode_worker == "w0"
    for _ in range(4):  # w1 keeps beating, w0 went silent
        b.advance(0.3)
        b.live("w1")
    assert set(b.index.live_workers()) == {"w1"}
    assert b.index.longest_prefix(CHAIN[:10]) == {"w1": 2}
    decisions = [router.route(RouteRequest(f"r{i}", CHAIN[:10], 10 * BS)) for i in range(20)]
    assert {d.decode_worker for d in decisions} == {"w1"}
    b.live("w0")  # back, same epoch: its entries count again
    assert b.index.longest_prefix(CHAIN[:10]) == {"w0": 10, "w1": 2}
    b.advance(1.1)  # both silent now: housekeeping forgets them
    assert sorted(router.maintain()) == ["w0", "w1"]
    b.live("w0")
    assert b.index.longest_prefix(CHAIN[:10]) == {}


def test_speculative_entries_count_until_they_expire(backend):
    b = backend(speculative_ttl_s=0.5)
    b.live("w0", "w1")
    b.index.apply(stored("w0", CHAIN[:4]))
    b.index.record_decision(["w0", "w1"], CHAIN[:8], 0.5, None, held=[4, 0])
    b.index.flush()
    assert b.index.longest_prefix(CHAIN[:8]) == {"w0": 8, "w1": 8}
    b.advance(1.05)  # Redis buckets: an entry lives one to two ttl
    assert b.index.longest_prefix(CHAIN[:8]) == {"w0": 4}


def test_a_decision_carries_only_the_blocks_its_workers_lack(backend):
    b = backend(speculative_ttl_s=0.5)
    b.live("w0", "w1")
    b.index.apply(stored("w0", CHAIN[:4]))
    b.index.apply(stored("w1", CHAIN[:6]))
    b.index.record_decision(["w0", "w1"], CHAIN[:10], 0.5, None, held=[4, 6])
    b.index.flush()
    assert b.index.longest_prefix(CHAIN[:10]) == {"w0": 10, "w1": 10}
    # On the wire (Redis, and the stream mirrors read): hashes from block 4 on; held relative to them.
    rec = pack_decision(500, 1000, ["w0", "w1"], [4, 6], CHAIN[:10], "chat|1")
    assert unpack_decision(rec) == (500, ["w0", "w1"], [0, 2], CHAIN[4:10], "chat|1")
    assert unpack_decision(pack_decision(0, 1000, ["w0"], [0], CHAIN[:10], "s"))[3] == []  # session only


def test_sessions_remove_worker_and_snapshots(backend):
    b = backend()
    b.live("w0", "w1")
    b.index.record_session("chat-1", "w1")
    b.index.record_session("chat-1", "w0")
    b.index.flush()
    assert b.index.session_workers("chat-1") == ["w0", "w1"]
    assert b.index.lookup([], "chat-1").session_workers == ["w0", "w1"]
    b.index.apply(stored("w0", CHAIN[:6]))
    b.index.remove_worker("w0")
    assert b.index.longest_prefix(CHAIN[:6]) == {}
    b.live("w0")
    b.index.load_snapshot("w0", 1, 5, [(h, "device") for h in CHAIN[:3]] + [(CHAIN[3], "host")])
    assert b.index.lookup(CHAIN[:6]).matches == {"w0": PrefixMatch(4, 1)}
    b.index.apply(stored("w0", CHAIN[4:5], start_seq=6))  # continues from the snapshot's position
    assert b.index.longest_prefix(CHAIN[:6]) == {"w0": 5}


# ---------------------------------------------------------------- replicas, late starters, restarts


def sink(server, worker: str, role: str = "decode", **kw) -> RedisKVEventSink:
    kw.setdefault("flush_interval_s", 0.005)
    kw.setdefault("heartbeat_interval_s", 0.1)
    kw.setdefault("retry_interval_s", 0.1)
    return RedisKVEventSink(connect(server.url(), 2.0), MODEL, worker, role=role, **kw)


def serve_cluster(server, n: int = 4, sessions: int = 16, seed: int = 0, **sink_kw):
    """Real KV cache managers behind real sinks: conversations served on them, their events in Redis."""
    rng = random.Random(seed)
    workers = {f"d{i}": SimWorker(f"d{i}") for i in range(n)}
    sinks = {w: sink(server, w, **sink_kw).attach(sw.events) for w, sw in workers.items()}
    system = tokens(rng, 128)
    prompts = []
    for i in range(sessions):
        prompt = system + tokens(rng, rng.randint(64, 400))
        w = workers[f"d{i % n}"]
        w.admit(f"s{i}", prompt, tokens(rng, 40))
        while w.running:
            w.tick()
        prompts.append((f"d{i % n}", prompt))
    for w, s in sinks.items():
        s.set_load(workers[w].load(time.time()))
        assert s.flush(5)
    return workers, sinks, prompts


def test_two_replicas_make_the_same_decisions(server, client):
    workers, sinks, prompts = serve_cluster(server)
    for s in sinks.values():
        s.close()  # loads stay as they are (their keys outlive this test): one state for both replicas
    cfg = RouterConfig(speculative_ttl_s=0)  # no speculative writes either
    r1 = Router(redis_index(server), cfg, block_size=BS)
    r2 = Router(redis_index(server), cfg, block_size=BS)
    rng = random.Random(3)
    for i in range(40):
        home, prompt = rng.choice(prompts)
        follow_up = prompt + tokens(rng, rng.randint(0, 200))
        request = RouteRequest(f"q{i}", block_hashes(follow_up, BS, MODEL), len(follow_up))
        d1, d2 = r1.route(request), r2.route(request)
        assert (d1.decode_worker, d1.prefill_worker, d1.expected_cached_tokens, d1.reason) == (
            d2.decode_worker,
            d2.prefill_worker,
            d2.expected_cached_tokens,
            d2.reason,
        )
        assert d1.best_cached_tokens == d2.best_cached_tokens >= len(prompt) // BS * BS  # both saw the conversation


def test_a_replica_started_later_routes_by_the_existing_cache_at_once(server, client):
    workers, sinks, prompts = serve_cluster(server)
    late = Router(redis_index(server), RouterConfig(), block_size=BS)  # created after everything was cached
    rng = random.Random(4)
    for i, (home, prompt) in enumerate(prompts):
        follow_up = prompt + tokens(rng, 50)
        d = late.route(RouteRequest(f"late-{i}", block_hashes(follow_up, BS, MODEL), len(follow_up)))
        assert d.decode_worker == home and d.reason == "cache-hit"
        assert d.expected_cached_tokens == len(prompt) // BS * BS  # the engine cached the prompt's full blocks
    for s in sinks.values():
        s.close()


@pytest.mark.parametrize("lookups", ["redis", "mirror"])
def test_redis_restart_degrades_to_load_routing_then_kv_routing_resumes(tmp_path, lookups):
    server = RedisServer(tmp_path).start()
    try:
        workers, sinks, prompts = serve_cluster(server)
        index = RedisKVIndex(connect(server.url(), 0.05), MODEL, retry_interval_s=0.1, load_cache_s=0)
        if lookups == "mirror":
            index = MirroredKVIndex(index).start()
        router = Router(index, RouterConfig(), block_size=BS)
        home, prompt = prompts[5]
        request = RouteRequest("x", block_hashes(prompt, BS, MODEL), len(prompt))
        assert router.route(request).decode_worker == home

        server.stop()
        if lookups == "mirror":  # the copy notices at its next poll of the stream
            wait_for(lambda: not index.consumer.available, timeout=5)
        started = time.perf_counter()
        decisions = [router.route(RouteRequest(f"down{i}", request.block_hashes, request.prompt_len)) for i in range(50)]
        elapsed = time.perf_counter() - started
        assert all(d.degraded and d.reason == "degraded" for d in decisions)
        assert {d.decode_worker for d in decisions} == set(workers)  # by load, spread over the last known workers
        assert elapsed < 1.0  # one timed-out call at most; the breaker answers the rest at once
        value = router.metrics.registry.get_sample_value
        assert value("moray_router_redis_degraded_total") == 50 and value("moray_router_index_up") == 0

        server.start()  # same port, empty: everything Redis knew is gone

        # The sinks notice (their heartbeat finds the index lost their position) and ship snapshots;
        # the router's breaker probe sees Redis answer. KV-aware routing resumes on its own.
        def kv_aware_again():
            d = router.route(RouteRequest("back", request.block_hashes, request.prompt_len))
            return not d.degraded and d.decode_worker == home and d.expected_cached_tokens == len(prompt) // BS * BS

        wait_for(kv_aware_again, timeout=10)
        assert value("moray_router_index_up") == 1
        assert all(s.stats["snapshots"] >= 1 for s in sinks.values())
        for s in sinks.values():
            s.close()
        router.close()
    finally:
        server.stop()


# ---------------------------------------------------------------- mirrored lookups


def mirror(server, **kw) -> MirroredKVIndex:
    return MirroredKVIndex(redis_index(server, **kw)).start()


def test_mirrors_share_decisions_through_the_stream_and_decide_alike(server, client):
    """Two replicas answering from local copies: after reading the stream to the same entry their copies
    agree, including the speculative entries and sessions the other replica wrote, and so do their
    decisions for the same request."""
    workers, sinks, prompts = serve_cluster(server)
    r1 = Router(mirror(server), RouterConfig(), block_size=BS)
    r2 = Router(mirror(server), RouterConfig(), block_size=BS)
    rng = random.Random(5)
    for i in range(30):
        home, prompt = rng.choice(prompts)
        follow_up = prompt + tokens(rng, rng.randint(20, 200))
        hashes = block_hashes(follow_up, BS, MODEL)
        session = f"s{i % 3}"
        decider, other = (r1, r2) if i % 2 else (r2, r1)
        first = decider.route(RouteRequest(f"q{i}", hashes, len(follow_up), session))
        assert decider.flush(5)
        other.index.catch_up()
        # The other replica sees the first decision: the chosen worker holds the whole prompt (speculatively).
        assert other.index.lookup(hashes).matches[first.decode_worker].blocks == len(hashes)
        assert first.decode_worker in other.index.session_workers(session)
        decider.index.catch_up()
        a, b = r1.index.lookup(hashes, session), r2.index.lookup(hashes, session)
        assert (a.matches, sorted(a.loads), a.session_workers) == (b.matches, sorted(b.loads), b.session_workers)
    for r in (r1, r2):
        r.close()
    # Decisions: two fresh replicas route every request in lockstep (so their own pending-load bumps are
    # alike too), each reading the other's previous decisions from the stream in between.
    r3 = Router(mirror(server), RouterConfig(), block_size=BS)
    r4 = Router(mirror(server), RouterConfig(), block_size=BS)
    for i in range(30):
        home, prompt = rng.choice(prompts)
        follow_up = prompt + tokens(rng, rng.randint(0, 200))
        hashes = block_hashes(follow_up, BS, MODEL)
        d3 = r3.route(RouteRequest(f"c{i}", hashes, len(follow_up), f"s{i % 3}"))
        d4 = r4.route(RouteRequest(f"d{i}", hashes, len(follow_up), f"s{i % 3}"))
        assert (d3.decode_worker, d3.expected_cached_tokens, d3.reason) == (d4.decode_worker, d4.expected_cached_tokens, d4.reason)
        for r in (r3, r4):
            assert r.flush(5)
        for r in (r3, r4):
            r.index.catch_up()
    for r in (r3, r4):
        r.close()
    for s in sinks.values():
        s.close()


def test_a_mirror_started_later_routes_by_the_existing_cache_and_follows_new_events(server, client):
    workers, sinks, prompts = serve_cluster(server)
    late = Router(mirror(server), RouterConfig(), block_size=BS)  # its copy is loaded at start
    rng = random.Random(6)
    for i, (home, prompt) in enumerate(prompts):
        follow_up = prompt + tokens(rng, 50)
        d = late.route(RouteRequest(f"late-{i}", block_hashes(follow_up, BS, MODEL), len(follow_up)))
        assert d.decode_worker == home and d.reason == "cache-hit"
        assert d.expected_cached_tokens == len(prompt) // BS * BS
    # New traffic after it started reaches the copy through the stream (the background consumer).
    w = workers["d2"]
    fresh = tokens(rng, 300)
    w.admit("fresh", fresh, tokens(rng, 20))
    while w.running:
        w.tick()
    assert sinks["d2"].flush(5)
    hashes = block_hashes(fresh + tokens(rng, 10), BS, MODEL)
    assert wait_for(lambda: late.index.longest_prefix(hashes).get("d2", 0) == len(fresh) // BS)
    late.close()
    for s in sinks.values():
        s.close()


def test_a_mirror_skips_stream_entries_it_cannot_read_and_follows_the_rest(server, client):
    connect(server.url(), 2.0).flushall()
    writer = redis_index(server)
    writer.heartbeat(WorkerLoad("w0", "decode", ts=time.time()))
    reader = mirror(server)
    stream = reader.consumer.stream
    # What a router or worker of another version might write (rolling upgrade), and plain garbage.
    client.xadd(stream, {"t": "D", "r": "other-router", "0": "500|1000|w0|0|not-hex|s"})
    client.xadd(stream, {"t": "e", "w": "w0"})
    writer.record_decision(["w0"], CHAIN[:6], 5.0, "chat-9")
    assert writer.flush(5)
    reader.catch_up()
    assert reader.consumer.unreadable_entries == 2 and reader.consumer.available
    assert reader.lookup(CHAIN[:6]).matches["w0"].blocks == 6  # the entry after them arrived
    assert reader.session_workers("chat-9") == ["w0"]
    reader.close()
    writer.close()


def test_a_dead_worker_leaves_the_mirror_within_the_ttl(server, client):
    workers, sinks, prompts = serve_cluster(server, n=2, sessions=4, heartbeat_ttl_s=1.0)
    index = MirroredKVIndex(redis_index(server, heartbeat_ttl_s=1.0), heartbeat_refresh_s=0.1).start()
    router = Router(index, RouterConfig(), block_size=BS)
    assert set(index.live_workers()) == {"d0", "d1"}
    sinks["d0"].close()  # d0 dies: no more heartbeats
    started = time.monotonic()
    wait_for(lambda: set(index.live_workers()) == {"d1"}, timeout=5)
    assert time.monotonic() - started < 1.0 + 0.5  # the TTL, plus a refresh
    for i, (_, prompt) in enumerate(prompts):
        d = router.route(RouteRequest(f"after-{i}", block_hashes(prompt, BS, MODEL), len(prompt)))
        assert d.decode_worker == "d1"
    router.close()
    sinks["d1"].close()


# ---------------------------------------------------------------- the worker-side sink


def test_the_sink_never_blocks_the_engine_and_catches_up_when_redis_appears(tmp_path):
    server = RedisServer(tmp_path)  # not started yet: the worker comes up before Redis
    pub = KVEventPublisher("w0", epoch=5)
    registry = CollectorRegistry()
    s = sink(server, "w0", max_pending=500, registry=registry)
    s.attach(pub)
    started = time.perf_counter()
    for h in range(1, 3001):
        pub.emit(KVEventKind.STORED, h, h - 1, BS)
    assert time.perf_counter() - started < 0.5  # 3,000 events: the engine thread only appended to a deque
    wait_for(lambda: s.stats["errors"] >= 1 and s.stats["overflows"] >= 1)
    try:
        server.start()
        assert s.flush(10)
        index = redis_index(server)
        index.heartbeat(WorkerLoad("w0"))
        assert index.longest_prefix(list(range(1, 3001))) == {"w0": 3000}
        assert registry.get_sample_value("moray_kv_sink_resyncs_total", {"reason": "overflow"}) >= 1  # as a snapshot
        assert registry.get_sample_value("moray_kv_sink_errors_total") >= 1
        pub.emit(KVEventKind.REMOVED, 3000, 2999, BS)  # and ordinary batches follow it (a tail eviction:
        assert s.flush(5)  # a hole in the middle would not shorten the match, which is the deepest held block)
        assert index.longest_prefix(list(range(1, 3001))) == {"w0": 2999}
    finally:
        s.close()
        server.stop()


def test_the_sink_restores_a_worker_a_router_removed(server, client):
    pub = KVEventPublisher("w0", epoch=1)
    s = sink(server, "w0").attach(pub)
    for h in CHAIN[:8]:
        pub.emit(KVEventKind.STORED, h, 0, BS)
    assert s.flush(5)
    index = redis_index(server)
    assert index.longest_prefix(CHAIN[:8]) == {"w0": 8}
    index.remove_worker("w0")  # e.g. a router's dead-worker cleanup during a long GC pause
    assert index.longest_prefix(CHAIN[:8]) == {}
    wait_for(lambda: index.longest_prefix(CHAIN[:8]) == {"w0": 8})  # the next heartbeat resynchronises
    pub.emit(KVEventKind.STORED, CHAIN[8], 0, BS)
    assert s.flush(5)
    assert index.longest_prefix(CHAIN[:9]) == {"w0": 9}
    s.close()


def test_superseded_entries_are_swept_after_an_o1_purge(server, client):
    index = redis_index(server)
    index.heartbeat(WorkerLoad("w0"))
    many = list(range(10_000, 12_000))
    index.apply(stored("w0", many, epoch=1))
    started = time.perf_counter()
    index.apply(stored("w0", CHAIN[:3], epoch=2))  # a restart: 2,000 entries invalid in one step
    assert time.perf_counter() - started < 0.2  # does not delete 2,000 entries first
    assert index.longest_prefix(many[:10]) == {} and index.longest_prefix(CHAIN[:3]) == {"w0": 3}
    while index.sweep() > 0:
        pass
    kv_keys = list(client.scan_iter(match=f"kv:{{{MODEL}}}:*", count=1000))
    assert len(kv_keys) == 3


def test_every_key_carries_the_model_hash_tag(server, client):
    workers, sinks, prompts = serve_cluster(server, n=2, sessions=4)
    router = Router(redis_index(server), RouterConfig(), block_size=BS)
    router.route(RouteRequest("r", block_hashes(prompts[0][1], BS, MODEL), len(prompts[0][1]), "sess"))
    router.flush()
    keys = list(client.scan_iter(count=1000))
    assert len(keys) > 20 and all(f"{{{MODEL}}}" in k for k in keys), [k for k in keys if f"{{{MODEL}}}" not in k]
    for s in sinks.values():
        s.close()


def test_the_stream_consumer_keeps_a_local_index_equal_to_redis(server, client):
    workers, sinks, prompts = serve_cluster(server, n=3, sessions=6)
    local = MemoryKVIndex()
    consumer = KVEventStreamConsumer(local, client, MODEL)
    consumer.poll_once()  # bootstrap: the whole index as it is now
    remote = redis_index(server)
    # More traffic after the consumer started: it arrives through the stream.
    rng = random.Random(9)
    for i, (home, prompt) in enumerate(prompts):
        w = workers[home]
        w.admit(f"more{i}", prompt + tokens(rng, 100), tokens(rng, 30))
        while w.running:
            w.tick()
    workers["d1"].kv.clear_prefix_cache()  # a reset, too
    for s in sinks.values():
        assert s.flush(5)
    consumer.poll_once()
    for _, prompt in prompts:
        hashes = block_hashes(prompt + tokens(rng, 100), BS, MODEL)
        assert local.longest_prefix(hashes) == remote.longest_prefix(hashes)
    assert "d1" not in remote.longest_prefix(block_hashes(prompts[1][1], BS, MODEL))
    for s in sinks.values():
        s.close()


# ---------------------------------------------------------------- failures: timeouts, credentials, TLS


def test_a_redis_that_never_answers_costs_one_timeout_then_nothing():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # accepts connections into the backlog, never answers
    try:
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        index = RedisKVIndex.from_config(KVIndexConfig(backend=url, timeout_s=0.05, retry_interval_s=5), MODEL)
        router = Router(index, RouterConfig(), block_size=BS, fallback_workers={"d0": "decode", "d1": "decode"})
        t0 = time.perf_counter()
        first = router.route(RouteRequest("a", CHAIN, len(CHAIN) * BS))
        t1 = time.perf_counter()
        rest = [router.route(RouteRequest(f"r{i}", CHAIN, len(CHAIN) * BS)) for i in range(100)]
        t2 = time.perf_counter()
        assert first.degraded and all(d.degraded for d in rest)
        assert t1 - t0 < 0.5  # bounded by timeout_s (connect + read), not redis-py's default retries
        assert (t2 - t1) / 100 < 0.005
        assert {d.decode_worker for d in rest} == {"d0", "d1"}
    finally:
        listener.close()


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    s = RedisServer(
        tmp_path_factory.mktemp("redis-auth"),
        "--requirepass",
        "s3cret-default",
        "--user",
        "router",
        "on",
        ">router-pw",
        "~*",
        "&*",
        "+@all",
        "--user",
        "readonly",
        "on",
        ">ro-pw",
        "~*",
        "&*",
        "+@read",
        "+ping",
    ).start()
    yield s
    s.stop()


def test_auth_with_password_acl_user_and_password_from_env(auth_server, monkeypatch):
    for url in (auth_server.url(":s3cret-default"), auth_server.url("router:router-pw")):
        index = RedisKVIndex.from_config(KVIndexConfig(backend=url), MODEL)
        index.check()
        index.heartbeat(WorkerLoad("w0"))
        index.apply(stored("w0", CHAIN[:4]))
        assert index.longest_prefix(CHAIN[:4]) == {"w0": 4}
    monkeypatch.setenv("MORAY_TEST_REDIS_PW", "router-pw")
    cfg = KVIndexConfig(backend=auth_server.url("router"), password_env="MORAY_TEST_REDIS_PW")
    assert connect_from_config(cfg).ping()


@pytest.mark.parametrize(
    "userinfo, expected",
    [
        (":wrong-password", "rejected the credentials of the default user"),
        ("router:wrong-password", "rejected the credentials of user 'router'"),
        ("", "rejected the credentials"),  # no password at all: NOAUTH
        ("readonly:ro-pw", "lacks a permission"),
    ],
)
def test_bad_credentials_give_a_clear_error_and_degraded_routing(auth_server, userinfo, expected):
    index = RedisKVIndex.from_config(KVIndexConfig(backend=auth_server.url(userinfo), retry_interval_s=30), MODEL)
    with pytest.raises(IndexUnavailable) as err:
        index.check() if "readonly" not in userinfo else index.lookup(CHAIN[:3])
    message = str(err.value)
    assert expected in message and "wrong-password" not in message and f"127.0.0.1:{auth_server.port}" in message
    router = Router(index, RouterConfig(), block_size=BS, fallback_workers={"d0": "decode"})
    d = router.route(RouteRequest("r", CHAIN[:3], 3 * BS))
    assert d.degraded and d.decode_worker == "d0"


def test_a_missing_password_env_is_a_config_error():
    cfg = KVIndexConfig(backend="redis://127.0.0.1:1/0", password_env="MORAY_TEST_UNSET_VARIABLE")
    with pytest.raises(ValueError, match="MORAY_TEST_UNSET_VARIABLE"):
        connect_from_config(cfg)


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 (cryptography, no openssl binary needed)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject, issuer, key, signer, ca: bool, san=None):
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            # Key identifiers: Python 3.13's strict X.509 verification requires them.
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), critical=False)
        )
        if ca:
            b = b.add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "moray test CA")])
    ca = cert(ca_name, ca_name, ca_key, ca_key, True)
    server = cert(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]),
        ca_name,
        key,
        ca_key,
        False,
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )
    paths = d / "ca.pem", d / "server.pem", d / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths


def test_tls_with_a_private_ca(tmp_path):
    ca, cert, key = make_certs(tmp_path)
    server = RedisServer(
        tmp_path,
        "--tls-cert-file",
        str(cert),
        "--tls-key-file",
        str(key),
        "--tls-ca-cert-file",
        str(ca),
        "--tls-auth-clients",
        "no",
        "--requirepass",
        "tls-pw",
        tls=True,
    )
    try:
        server.start()
    except RuntimeError as e:
        if "tls" in str(e).lower():
            pytest.skip(f"this redis-server was built without TLS: {e}")
        raise
    try:
        good = KVIndexConfig(backend=server.url(":tls-pw"), tls_ca_file=str(ca), timeout_s=2)
        index = RedisKVIndex.from_config(good, MODEL)
        index.heartbeat(WorkerLoad("w0"))
        index.apply(stored("w0", CHAIN[:4]))
        assert index.longest_prefix(CHAIN[:4]) == {"w0": 4}
        # Without our CA the server's certificate is not trusted: a clear error, not a hang or a crash.
        untrusted = RedisKVIndex.from_config(KVIndexConfig(backend=server.url(":tls-pw"), timeout_s=2), MODEL)
        with pytest.raises(IndexUnavailable, match="certificate verify failed"):
            untrusted.check()
        # Plain TCP against the TLS port fails too.
        plain = RedisKVIndex.from_config(KVIndexConfig(backend=f"redis://:tls-pw@127.0.0.1:{server.port}/0", timeout_s=0.5), MODEL)
        with pytest.raises(IndexUnavailable):
            plain.check()
    finally:
        server.stop()


# ---------------------------------------------------------------- a real engine's host KV tier


def test_host_tier_events_reach_redis_replicas_started_later_see_both_tiers_and_a_dead_worker_leaves_both(server, client, tmp_path):
    """A real engine with a host KV tier behind a real sink: blocks it moved to the host are offloaded
    entries in Redis; a Redis replica and a mirror created afterwards see both tiers; once the worker's
    heartbeat stops, housekeeping removes its entries of both tiers (and its reverse sets)."""
    from engine_harness import prompts, small_engine_args

    from workers.engine import SamplingParams

    GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    from workers.engine import LLM
    from workers.models.make_model import make_model

    model = make_model(tmp_path / "tiny", "qwen3_moe", "tiny", seed=5)
    llm = LLM(str(model), num_kv_blocks=24, host_kv={"blocks": 12}, worker_id="w0", **{**small_engine_args("host-tier"), "max_num_seqs": 4})
    s = sink(server, "w0", heartbeat_ttl_s=1.0).attach(llm.engine.events)
    s.set_load(WorkerLoad("w0", "decode", ts=time.time()))
    for seed in range(1, 6):
        llm.generate([prompts(1, seed, 72, 73)[0]], GREEDY, session_id=f"chat-{seed}")
    llm.generate([prompts(1, 9, 8, 9)[0]], GREEDY)  # one more step: the last evictions reach the tier
    assert s.flush(5)
    kv = llm.engine.kv
    host_only = [h for h in kv.host.slot_of if h not in kv.pool.cached]
    on_device = list(kv.pool.cached)
    assert host_only and on_device and kv.host.stats.blocks_evicted > 0
    late = redis_index(server, heartbeat_ttl_s=1.0)
    copy = MirroredKVIndex(redis_index(server, heartbeat_ttl_s=1.0)).start()
    try:
        for index in (late, copy):
            for h in host_only:
                assert index.lookup([h]).matches["w0"] == PrefixMatch(1, 1), "held on the host only"
            for h in on_device:
                assert index.lookup([h]).matches["w0"] == PrefixMatch(1, 0)
        s.close()  # the worker dies: no heartbeat from now on
        wait_for(lambda: "w0" in late.remove_dead_workers(), timeout=5)
        everything = host_only + on_device
        assert all(late.lookup([h]).matches == {} for h in everything)
        assert not list(client.scan_iter(match=f"wblocks:{{{MODEL}}}:w0:*", count=1000))
        assert not any(client.hexists(f"kv:{{{MODEL}}}:{h}", "w0") for h in everything)
    finally:
        copy.close()


def test_breaker_notifications_follow_its_state_when_threads_race():
    """A close whose notification is delayed (its thread lost the CPU) and an open in between: the last
    notification must be the open, as the breaker's state is. Notified outside the lock, the close's "up"
    came last and the up gauge read 1 while the breaker was open (seen in the suite under load)."""
    import threading

    import redis

    from cluster.router.redis_conn import CircuitBreaker

    seen, gate = [], threading.Event()

    def on_change(up: bool) -> None:
        if up:
            gate.wait(5)  # the closing thread stalls inside its notification
        seen.append(up)

    breaker = CircuitBreaker(redis.Redis(host="127.0.0.1", port=1), on_change=on_change)
    breaker.failure(ConnectionError("down"))
    closer = threading.Thread(target=breaker.success)
    closer.start()
    time.sleep(0.1)
    opener = threading.Thread(target=lambda: breaker.failure(ConnectionError("down again")))
    opener.start()
    time.sleep(0.1)
    gate.set()
    closer.join(5)
    opener.join(5)
    assert breaker.is_open and seen[-1] is False, seen
