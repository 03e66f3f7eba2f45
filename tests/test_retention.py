"""Session-aware eviction (workers/engine/retention.py), in the policy itself and in the device block pool:
sessionless and ended conversations' blocks go first, then live sessions (least recently active first)."""

from __future__ import annotations

import numpy as np
import pytest

from workers.engine.config import EngineConfig, HostKVConfig
from workers.engine.host_tier import HostKVTier
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.request import Request
from workers.engine.retention import SessionAwareLRU
from workers.engine.sampling_params import SamplingParams


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def drain(lru: SessionAwareLRU) -> list:
    return [lru.pop()[0] for _ in range(len(lru))]


def test_order_sessionless_then_sessions_by_activity():
    clock = Clock()
    lru = SessionAwareLRU(session_idle_s=60, clock=clock)
    lru.touch("a")
    lru.add("a1", "a")
    lru.add("x1")
    clock.t += 1
    lru.touch("b")
    lru.add("b1", "b")
    lru.add("a2", "a")  # releasing touches nothing by itself: "a" stays less recently active than "b"
    lru.add("x2")
    assert len(lru) == 5 and "a2" in lru and "zz" not in lru
    assert drain(lru) == ["x1", "x2", "a1", "a2", "b1"]
    assert (lru.evicted_sessionless, lru.evicted_live_session) == (2, 3)
    with pytest.raises(KeyError):
        lru.pop()


def test_an_ended_session_is_evicted_with_the_sessionless_first():
    clock = Clock()
    lru = SessionAwareLRU(session_idle_s=60, clock=clock)
    lru.touch("old")
    lru.add("o1", "old")
    clock.t += 30
    lru.touch("new")
    lru.add("n1", "new")
    lru.add("x1")
    clock.t += 31  # "old" idle 61 s: ended; "new" idle 31 s: live
    assert lru.pop() == ("o1", None)  # ended sessions' blocks go ahead of the plain ones
    assert lru.pop() == ("x1", None)
    assert lru.pop() == ("n1", "new")
    assert lru.session_of("n1") is None


def test_a_block_taken_back_and_released_again_moves_class():
    lru = SessionAwareLRU()
    lru.touch("s")
    lru.add(1, "s")
    lru.discard(1)  # a hit takes it
    assert 1 not in lru and len(lru) == 0
    lru.add(1)  # released by a sessionless request: plain now
    lru.add(2, "s")
    assert lru.pop() == (1, None) and lru.pop() == (2, "s")


def test_unknown_session_counts_as_sessionless():
    lru = SessionAwareLRU()
    lru.add("never-touched", "ghost")  # no request of "ghost" was seen: nothing to protect
    assert lru.pop() == ("never-touched", None)


def request(rid: str, tokens: list[int], session: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), session_id=session)


def run_to_cache(kv: KVCacheManager, req: Request) -> None:
    """What the scheduler does for a request that prefills fully and finishes at once."""
    prefix = kv.cached_prefix(req)
    req.num_computed_tokens = len(prefix) * kv.block_size
    assert kv.allocate(req, req.num_prompt_tokens - req.num_computed_tokens, prefix) is not None
    req.num_computed_tokens = req.num_prompt_tokens
    kv.cache_full_blocks(req)
    kv.free(req)


def test_device_pool_keeps_a_live_conversation_through_a_flood():
    """Plain LRU would evict the conversation's 4 blocks under 8 one-off prompts of 4 blocks through a
    12-block pool; with its session live they outlive the flood, and the next turn hits all of them."""
    kv = KVCacheManager(12, 4)
    chat = list(range(100, 116))
    run_to_cache(kv, request("turn1", chat, "chat"))
    for i in range(8):
        run_to_cache(kv, request(f"flood{i}", [1000 + 16 * i + j for j in range(16)]))
    turn2 = request("turn2", chat + [7, 7, 7, 7], "chat")
    assert len(kv.cached_prefix(turn2)) == 4
    assert kv.pool.evicted_live_session == 0
    # The same without a session: the flood evicts it.
    plain = KVCacheManager(12, 4)
    run_to_cache(plain, request("turn1", chat))
    for i in range(8):
        run_to_cache(plain, request(f"flood{i}", [1000 + 16 * i + j for j in range(16)]))
    assert plain.cached_prefix(request("turn2", chat + [7, 7, 7, 7])) == []


def test_host_tier_under_pressure_drops_sessionless_blocks_first():
    clock = Clock()
    tier = HostKVTier(3, (1, 2), np.float32, retention=SessionAwareLRU(60, clock))
    block = np.zeros((1, 2), np.float32)
    tier.put(1, None, block, "live")
    tier.put(2, None, block)  # sessionless
    tier.put(3, None, block, "live")
    tier.put(4, None, block)  # full: the sessionless 2 goes, not the older 1
    assert 2 not in tier and all(h in tier for h in (1, 3, 4))
    tier.put(5, None, block)  # 4 (sessionless) again
    assert 4 not in tier and 1 in tier
    clock.t += 61  # the session ended: its blocks are now first
    tier.put(6, None, block)
    assert 1 not in tier and 3 in tier and 5 in tier
    assert tier.order.evicted_live_session == 0 and tier.stats.blocks_evicted == 3


def test_host_kv_sizes():
    nbytes = 1 << 20
    assert HostKVConfig().num_blocks(nbytes) == 0  # off by default
    assert HostKVConfig(blocks=10).num_blocks(nbytes) == 10
    assert HostKVConfig(memory_gib=1).num_blocks(nbytes) == 1024
    assert HostKVConfig(memory_gib=0).num_blocks(nbytes) == 0 and not HostKVConfig(blocks=0).enabled
    assert HostKVConfig(enabled=True, memory_fraction=0.5).num_blocks(nbytes, available_bytes=64 << 20) == 32
    assert HostKVConfig(enabled=True).num_blocks(nbytes) > 0  # a share of this machine's free memory
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineConfig(model="m", host_kv={"memory_gib": 1}, enable_prefix_caching=False)
    with pytest.raises(ValueError):
        EngineConfig(model="m", host_kv={"memory_fraction": 0})
