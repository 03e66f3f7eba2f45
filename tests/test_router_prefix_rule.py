"""The KV index's match rule on every backend (memory, Redis Lua, a Redis mirror answering from memory):
a worker's match is its DEEPEST held block along the request's chain of block hashes, + 1, not the end
of its first consecutive run.

Why: block hashes are chained (block i's hash covers tokens 0..i), so holding block i means holding this
very prefix through block i. Hybrid linear-attention engines can resume only where a recurrent-state
snapshot exists and publish STORED only for those boundary blocks, so their holdings have gaps by
design; attention-only engines publish every block and evict a sequence's tail first, so for them the
deepest held block is the end of the consecutive run.

The contract the Redis lookup adds: a worker that may hold later blocks of a chain without its first one
says so in its heartbeat (`WorkerLoad.sparse_blocks`, the hybrid engines); the lookup searches for such
holders only among those workers, so attention-only clusters pay nothing for the search. An unflagged
worker holding later blocks alone (which an attention-only engine never does) is not found by Redis; the
in-memory index needs no such hint and finds it anyway."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
from fakes import heartbeat
from router_harness import BS, MODEL, REDIS_SERVER, RedisServer, redis_index, stored

from cluster.router import MemoryKVIndex, MirroredKVIndex, PrefixMatch, RedisKVEventSink, WorkerLoad
from cluster.router.redis_conn import connect
from workers.engine.kv_events import KVEvent, KVEventKind

H = list(range(101, 109))  # an 8-block chain (stand-in hashes: the index only compares them)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    s = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield s
    s.stop()


class Backend:
    """An index, how to make what was written visible to its lookups, and how to let time pass."""

    def __init__(self, kind: str, server=None, speculative_ttl_s: float = 2.0):
        self.kind = kind
        if kind == "memory":
            self.t = 1000.0
            self.index = MemoryKVIndex(clock=lambda: self.t)
        elif kind == "redis":
            self.index = redis_index(server, speculative_ttl_s=speculative_ttl_s)  # loads read by every lookup
        elif kind == "redis-cached":  # loads cached between heartbeats: the sparse workers travel in ARGV
            self.index = redis_index(server, speculative_ttl_s=speculative_ttl_s, load_cache_s=3600)
        else:
            self.index = MirroredKVIndex(redis_index(server, speculative_ttl_s=speculative_ttl_s)).start()

    def live(self, *workers: str, sparse: bool = False) -> None:
        for w in workers:
            self.index.heartbeat(WorkerLoad(w, "decode", ts=time.time(), sparse_blocks=sparse))

    def apply(self, events) -> None:
        self.index.apply(events)
        self.sync()

    def decide(self, workers, hashes, ttl_s, held) -> None:
        self.index.record_decision(workers, hashes, ttl_s, None, held=held)
        self.sync()

    def sync(self) -> None:
        self.index.flush()
        if self.kind == "mirror":
            self.index.catch_up()  # the copy follows Redis through the event stream

    def matches(self, hashes) -> dict:
        return self.index.lookup(hashes).matches

    def advance(self, seconds: float) -> None:
        if self.kind == "memory":
            self.t += seconds
        else:
            time.sleep(seconds)

    def close(self) -> None:
        self.index.close()


@pytest.fixture(params=["memory", "redis", "redis-cached", "mirror"])
def rule(request):
    made = []

    def make(**kw):
        server = None
        if request.param != "memory":
            server = request.getfixturevalue("server")
            if not made:
                connect(server.url(), 2.0).flushall()
        made.append(Backend(request.param, server, **kw))
        return made[-1]

    yield make
    for b in made:
        b.close()


def test_the_deepest_held_block_is_the_match(rule):
    b = rule()
    b.live("dense", "other")
    b.live("hybrid", "late", sparse=True)
    b.apply(stored("hybrid", [H[2], H[5]]))  # recurrent-state boundaries only
    b.apply(stored("dense", H[:4]))  # an attention engine: every block
    b.apply(stored("late", [H[7]]))  # only the last block (not the first: found by the end scan)
    b.apply(stored("other", [901, 902, 903]))  # another chain only
    assert b.matches(H) == {"hybrid": PrefixMatch(6), "dense": PrefixMatch(4), "late": PrefixMatch(8)}
    assert b.index.longest_prefix(H[:5]) == {"hybrid": 3, "dense": 4}
    assert b.index.longest_prefix(H[:2]) == {"dense": 2}
    assert b.index.longest_prefix([901, 950]) == {"other": 1}
    assert b.index.longest_prefix([950, 951]) == {}
    # A removed boundary: the next deeper one left decides; the tail eviction of a dense engine shortens it.
    b.apply(stored("hybrid", [H[6]], start_seq=2) + [_removed("hybrid", H[5], 3)])
    b.apply([_removed("dense", H[3], 4)])
    assert b.matches(H) == {"hybrid": PrefixMatch(7), "dense": PrefixMatch(3), "late": PrefixMatch(8)}
    # A shorter chain: `late` holds only a block past its end.
    assert b.matches(H[:7]) == {"hybrid": PrefixMatch(7), "dense": PrefixMatch(3)}


def test_offloaded_and_speculative_blocks_under_the_deepest_rule(rule):
    b = rule(speculative_ttl_s=0.5)
    b.live("dense", "idle")
    b.live("hybrid", sparse=True)
    b.apply(stored("hybrid", [H[1]], tier="host") + stored("hybrid", [H[4]], start_seq=1))
    b.apply(stored("dense", H[:3]) + stored("dense", H[3:6], start_seq=3, tier="host"))
    assert b.matches(H) == {"hybrid": PrefixMatch(5, 1), "dense": PrefixMatch(6, 3)}
    b.apply(stored("hybrid", [H[6]], start_seq=2, tier="host"))  # the deepest boundary only on the host
    assert b.matches(H) == {"hybrid": PrefixMatch(7, 2), "dense": PrefixMatch(6, 3)}
    # Chosen workers hold the blocks from their match on speculatively (as device blocks, so a block
    # held on the host and speculatively is not offloaded); `idle` holds nothing real of the chain.
    b.decide(["hybrid", "idle", "dense"], H, 0.5, held=[7, 0, 0])
    assert b.matches(H) == {"hybrid": PrefixMatch(8, 2), "idle": PrefixMatch(8), "dense": PrefixMatch(8)}
    b.advance(1.05)  # Redis buckets: an entry lives one to two ttl
    assert b.matches(H) == {"hybrid": PrefixMatch(7, 2), "dense": PrefixMatch(6, 3)}


def test_later_block_holders_are_found_among_few_or_many_live_workers(rule):
    """Redis finds the live workers lacking the first block by checking each of them (few left) or by
    reading the holders of the chain's blocks from its end (many left): both find the same. Only the
    workers flagged sparse are looked for."""
    b = rule()
    b.live("dense")
    b.live("late", sparse=True)
    b.apply(stored("dense", H[:2]))
    b.apply(stored("late", [H[6]], tier="host"))
    assert b.matches(H) == {"dense": PrefixMatch(2), "late": PrefixMatch(7, 1)}
    b.live(*[f"idle{i}" for i in range(6)], sparse=True)
    b.apply(stored("idle0", [H[3]]))
    assert b.matches(H) == {"dense": PrefixMatch(2), "late": PrefixMatch(7, 1), "idle0": PrefixMatch(4)}
    assert b.matches(H[:5]) == {"dense": PrefixMatch(2), "idle0": PrefixMatch(4)}


def _removed(worker: str, h: int, seq: int, tier: str = "device") -> KVEvent:
    return KVEvent(worker, 1, seq, KVEventKind.REMOVED, h, 0, BS, tier, 0.0)


def _expected(chain, holdings, spec) -> dict[str, PrefixMatch]:
    """The rule, spelled out: deepest position held in any tier or speculatively; offloaded = positions
    held only in a slower tier (a speculative entry counts as a device copy)."""
    out = {}
    for w, tiers in holdings.items():
        pos = {h: i for i, h in enumerate(chain)}
        dev = {pos[h] for h, t in tiers if t == "device" and h in pos} | {i for i in range(spec.get(w, len(chain)), len(chain))}
        slow = {pos[h] for h, t in tiers if t != "device" and h in pos} - dev
        held = dev | slow
        if held:
            out[w] = PrefixMatch(max(held) + 1, len(slow))
    return out


def test_random_holdings_agree_with_the_rule(rule):
    """Sparse and dense holdings, two tiers, speculative tails: every backend answers as the rule says,
    for the whole chain and for its prefixes."""
    b = rule(speculative_ttl_s=30)
    rng = random.Random(11)
    for trial in range(12):
        chain = [10_000 * (trial + 1) + i for i in range(12)]
        workers = [f"t{trial}w{k}" for k in range(5)]
        holdings: dict[str, list[tuple[int, str]]] = {}
        for w in workers:
            style = rng.choice(["dense", "sparse", "none", "late"])
            # Workers that may lack the first block say so (hybrid); some attention-only ones do too.
            b.live(w, sparse=style in ("sparse", "late") or rng.random() < 0.3)
            if style == "dense":
                picked = chain[: rng.randint(1, len(chain))]
            elif style == "sparse":
                picked = [h for h in chain if rng.random() < 0.3]
            elif style == "late":
                picked = [chain[-1]]
            else:
                picked = []
            picked += [90_000_000 + trial * 100 + k for k in range(3)]  # blocks of other chains
            blocks = [(h, "host" if rng.random() < 0.25 else "device") for h in picked]
            blocks += [(h, "host") for h, t in blocks if t == "device" and rng.random() < 0.2]  # both tiers
            holdings[w] = blocks
            b.apply([stored(w, [h], start_seq=i, tier=t)[0] for i, (h, t) in enumerate(blocks)])
        spec: dict[str, int] = {}
        assert b.matches(chain) == _expected(chain, holdings, spec)
        # A decision as the router records it: from each chosen worker's current match on.
        now = _expected(chain, holdings, spec)
        chosen = rng.sample(workers, 2)
        held = [now[w].blocks if w in now else 0 for w in chosen]
        b.decide(chosen, chain, 30, held)
        spec.update(zip(chosen, held))
        for k in (len(chain), 9, 5, 1):
            assert b.matches(chain[:k]) == _expected(chain[:k], holdings, {w: min(s, k) for w, s in spec.items()}), (trial, k)
        for w in workers:  # a few live workers at a time (Redis then takes both ways to find candidates)
            b.index.remove_worker(w)


# ---------------------------------------------------------------- Redis: only sparse workers are searched


def _readers(server):
    """Two router replicas, one per way a Redis lookup learns which live workers are sparse: `fresh`
    reads the load hashes in every lookup (the script reads the flag there), `cached` reads them once
    and then passes the sparse workers of its cached loads to the script."""
    fresh = redis_index(server)  # load_cache_s=0: loads wanted on every lookup
    cached = redis_index(server, load_cache_s=3600)
    cached.lookup([])  # the loads, cached from now on
    return fresh, cached


def _redis_matches(server, hashes) -> dict:
    """Matches as both replicas' lookups see them (they must agree)."""
    fresh, cached = _readers(server)
    want = fresh.lookup(hashes).matches
    at = cached._loads_at
    assert cached.lookup(hashes).matches == want
    assert cached._loads_at == at  # answered from cached loads (the ARGV path)
    fresh.close()
    cached.close()
    return want


def _calls(client, hashes, index) -> dict[str, int]:
    """Redis commands one lookup runs (Lua's calls count in commandstats)."""
    client.config_resetstat()
    index.lookup(hashes)
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items() if k not in ("cmdstat_config", "cmdstat_evalsha")}


def test_attention_only_workers_holding_later_blocks_only_are_not_searched_by_redis(server):
    """The contract: an attention-only engine publishes every block and evicts a sequence's tail before
    its prefix, so whenever it holds a block of a chain it holds the chain's first block too. Redis
    therefore looks for holders of later blocks only among workers whose heartbeat says sparse_blocks;
    an unflagged worker holding only later blocks (a state attention-only engines never reach) is not
    considered, and the lookup runs exactly the calls of the first-gap rule. Flag it, and it matches."""
    client = connect(server.url(), 2.0)
    client.flushall()
    writer = redis_index(server)
    for w in ("dense", "stray", *[f"idle{i}" for i in range(6)]):
        writer.heartbeat(WorkerLoad(w, "decode", ts=time.time()))
    writer.apply(stored("dense", H[:4]))
    writer.apply(stored("stray", [H[5]]))
    for i in range(6):
        writer.apply(stored(f"idle{i}", [900 + i]))  # other chains only
    assert _redis_matches(server, H) == {"dense": PrefixMatch(4)}
    assert _redis_matches(server, H[:4]) == {"dense": PrefixMatch(4)}
    # The memory index needs no flag (its search is free): it finds `stray` anyway.
    mem = MemoryKVIndex()
    for w in ("dense", "stray"):
        mem.heartbeat(WorkerLoad(w, "decode"))
    mem.apply(stored("dense", H[:4]) + stored("stray", [H[5]]))
    assert mem.lookup(H).matches == {"dense": PrefixMatch(4), "stray": PrefixMatch(6)}

    # What an attention-only cluster's lookup costs: the generations and the first block's holders
    # (device and speculative), then one SMISMEMBER per candidate; no per-block or per-worker search.
    _, cached = _readers(server)
    calls = _calls(client, H, cached)
    assert calls.get("hgetall") == 3 and calls.get("smismember") == 1, calls

    writer.heartbeat(WorkerLoad("stray", "decode", ts=time.time(), sparse_blocks=True))
    assert _redis_matches(server, H) == {"dense": PrefixMatch(4), "stray": PrefixMatch(6)}
    assert _redis_matches(server, H[:5]) == {"dense": PrefixMatch(4)}
    _, cached = _readers(server)
    assert _calls(client, H, cached).get("smismember") == 2  # `stray` is a candidate now
    writer.heartbeat(WorkerLoad("stray", "decode", ts=time.time(), sparse_blocks=False))
    assert _redis_matches(server, H) == {"dense": PrefixMatch(4)}
    for index in (writer, cached):
        index.close()


@pytest.mark.parametrize("others", [0, 7])
def test_a_sparse_worker_holding_blocks_2_and_5_of_8_matches_6(server, others):
    """With `others` more sparse workers holding nothing of the chain, Redis finds the later-block
    holders the other way (reading the chain's holders from its end instead of checking each one)."""
    client = connect(server.url(), 2.0)
    client.flushall()
    writer = redis_index(server)
    writer.heartbeat(WorkerLoad("dense", "decode", ts=time.time()))
    writer.heartbeat(WorkerLoad("hybrid", "decode", ts=time.time(), sparse_blocks=True))
    for i in range(others):
        writer.heartbeat(WorkerLoad(f"h{i}", "decode", ts=time.time(), sparse_blocks=True))
        writer.apply(stored(f"h{i}", [900 + i]))
    writer.apply(stored("hybrid", [H[2], H[5]]))
    writer.apply(stored("dense", H[:3]))
    assert _redis_matches(server, H) == {"hybrid": PrefixMatch(6), "dense": PrefixMatch(3)}
    assert _redis_matches(server, H[:5]) == {"hybrid": PrefixMatch(3), "dense": PrefixMatch(3)}
    assert _redis_matches(server, H[:2]) == {"dense": PrefixMatch(2)}
    writer.close()


def test_worker_load_keeps_the_sparse_flag_through_redis(server):
    """Written by a router's heartbeat or a worker's sink, read back by lookups (both ways) and by a
    mirror; strings as Redis holds them parse to bools."""
    client = connect(server.url(), 2.0)
    client.flushall()
    writer = redis_index(server)
    writer.heartbeat(WorkerLoad("hybrid", "decode", ts=time.time(), sparse_blocks=True))
    writer.heartbeat(WorkerLoad("dense", "decode", ts=time.time()))
    assert client.hget(f"load:{writer.tag}:hybrid", "sparse_blocks") == "1"
    assert client.hget(f"load:{writer.tag}:dense", "sparse_blocks") == "0"
    fresh, cached = _readers(server)
    for index in (fresh, cached):
        loads = index.live_workers()
        assert loads["hybrid"].sparse_blocks is True and loads["dense"].sparse_blocks is False
        assert loads["hybrid"] == WorkerLoad.from_dict(loads["hybrid"].to_dict())

    # The worker side: its heartbeat message -> WorkerLoad.from_heartbeat -> the sink's heartbeat.
    hb = heartbeat("w9", num_pending_prefill_tokens=3, num_total_blocks=10, num_free_blocks=4, kv_usage=0.6, sparse_blocks=True)
    assert WorkerLoad.from_heartbeat(hb).sparse_blocks is True
    assert WorkerLoad.from_heartbeat(replace(hb, engine=replace(hb.engine, sparse_blocks=False))).sparse_blocks is False
    assert WorkerLoad.from_heartbeat(heartbeat("w9")).sparse_blocks is False  # attention-only: every block
    s = RedisKVEventSink(
        connect(server.url(), 2.0), MODEL, "w9", role="decode", heartbeat_interval_s=0.05, load_fn=lambda: WorkerLoad.from_heartbeat(hb)
    ).start()
    try:
        got = _wait(lambda: fresh.live_workers().get("w9"))
        assert got.sparse_blocks is True and got.active_decode_blocks == 6
        mirror = MirroredKVIndex(redis_index(server)).start()
        assert _wait(lambda: mirror.live_workers().get("w9")).sparse_blocks is True
        mirror.close()
    finally:
        s.close()

    for raw, want in (("1", True), ("0", False), ("True", True), ("False", False), (True, True), (False, False)):
        assert WorkerLoad.from_dict({"worker_id": "x", "sparse_blocks": raw}).sparse_blocks is want
    with pytest.raises(ValueError):
        WorkerLoad.from_dict({"worker_id": "x", "sparse_blocks": "maybe"})
    for index in (writer, fresh, cached):
        index.close()


def _wait(fn, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(0.02)
    raise AssertionError("timed out")
