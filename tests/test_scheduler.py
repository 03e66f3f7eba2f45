"""The scheduler on its own (real KV cache managers, no model): requests that share a prefix another
running request is computing wait a step for it, on one pool and across data-parallel ranks, and a burst
of such requests costs each step a bounded scan of the waiting queue."""

from __future__ import annotations

from workers.engine.data_parallel import DataParallelKVCacheManager
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler

BS = 4
SHARED = list(range(100, 100 + 4 * BS))  # a 4-block prefix nobody has cached yet


def request(rid: str, tail: int) -> Request:
    return Request(rid, SHARED + [500 + tail, 600 + tail], SamplingParams())


def step(s: Scheduler) -> dict[str, tuple[int, int]]:
    """Runs one schedule + advance (+ a stand-in sampled token where the engine would sample one);
    returns request -> (first position computed, tokens computed)."""
    out = s.schedule()
    for sr in out.scheduled:
        sampled = sr.completes_known_tokens
        s.advance(sr)
        if sampled:
            sr.request.output_token_ids.append(7)
    return {sr.request.request_id: (sr.start, sr.num_new_tokens) for sr in out.scheduled}


def test_requests_sharing_a_prefix_being_computed_wait_a_step_and_reuse_it():
    s = Scheduler(KVCacheManager(64, BS), max_num_seqs=8, max_num_batched_tokens=256)
    for i in range(3):
        s.add(request(f"r{i}", i))
    assert step(s) == {"r0": (0, 18)}  # r1 and r2 would compute the same 4 blocks again
    assert s.num_prefix_waits == 2
    assert step(s) == {"r0": (18, 1), "r1": (16, 2), "r2": (16, 2)}  # decode; prefix reused
    assert [r.num_cached_tokens for r in s.running] == [0, 16, 16]


def test_a_burst_waiting_for_one_prefix_costs_each_step_a_bounded_scan():
    s = Scheduler(KVCacheManager(256, BS), max_num_seqs=4, max_num_batched_tokens=24)
    for i in range(200):
        s.add(request(f"r{i}", i))
    assert step(s) == {"r0": (0, 18)}
    assert s.num_prefix_waits == 4  # max_num_seqs requests looked at and passed over, not all 199
    assert step(s) == {"r0": (18, 1), "r1": (16, 2), "r2": (16, 2), "r3": (16, 2)}
    assert s.num_prefix_waits == 4 and len(s.waiting) == 196


def test_data_parallel_ranks_wait_only_for_a_prefix_computed_in_their_own_pool():
    kv = DataParallelKVCacheManager(dp=2, blocks_per_rank=32, block_size=BS)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=256)
    ranks = {"a": 1, "b": 0, "c": 0, "d": 1}
    for rid, rank in ranks.items():
        kv._rank_of[rid] = rank  # placed as the rank choice would place them under other load
    s.add(Request("a", SHARED + [1, 2], SamplingParams()))  # rank 1 computes the prefix
    s.add(Request("b", SHARED + [3, 4], SamplingParams()))  # rank 0 must compute it too (another pool)
    s.add(Request("c", SHARED + [5, 6], SamplingParams()))  # rank 0: waits for b, not a
    s.add(Request("d", SHARED + [7, 8], SamplingParams()))  # rank 1: waits for a
    assert set(step(s)) == {"a", "b"}
    assert s.num_prefix_waits == 2
    second = step(s)
    assert second["c"] == (16, 2) and second["d"] == (16, 2)
