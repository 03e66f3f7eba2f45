"""The KV index's match rule on every backend (memory, Redis Lua, a Redis mirror answering from memory):
a worker's match is its DEEPEST held block along the request's chain of block hashes, + 1, not the end
of its first consecutive run.

Why: block hashes are chained (block i's hash covers tokens 0..i), so holding block i means holding this
very prefix through block i. Hybrid linear-attention engines can resume only where a recurrent-state
snapshot exists and publish STORED only for those boundary blocks, so their holdings have gaps by
design; attention-only engines publish every block and evict a sequence's tail first, so for them the
deepest held block is the end of the consecutive run."""

from __future__ import annotations

import random
import time

import pytest

from cluster.router import MemoryKVIndex, MirroredKVIndex, PrefixMatch, WorkerLoad
from cluster.router.redis_conn import connect
from workers.engine.kv_events import KVEvent, KVEventKind
from test_router_policy import BS, stored
from test_router_redis import REDIS_SERVER, RedisServer, redis_index

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
            self.index = redis_index(server, speculative_ttl_s=speculative_ttl_s)
        else:
            self.index = MirroredKVIndex(redis_index(server, speculative_ttl_s=speculative_ttl_s)).start()

    def live(self, *workers: str) -> None:
        for w in workers:
            self.index.heartbeat(WorkerLoad(w, "decode", ts=time.time()))

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


@pytest.fixture(params=["memory", "redis", "mirror"])
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
    b.live("hybrid", "dense", "late", "other")
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
    b.live("hybrid", "dense", "idle")
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
    reading the holders of the chain's blocks from its end (many left): both find the same."""
    b = rule()
    b.live("dense", "late")
    b.apply(stored("dense", H[:2]))
    b.apply(stored("late", [H[6]], tier="host"))
    assert b.matches(H) == {"dense": PrefixMatch(2), "late": PrefixMatch(7, 1)}
    b.live(*[f"idle{i}" for i in range(6)])
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
        b.live(*workers)
        holdings: dict[str, list[tuple[int, str]]] = {}
        for w in workers:
            style = rng.choice(["dense", "sparse", "none", "late"])
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
