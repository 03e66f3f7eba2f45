"""The host-memory KV tier below the device cache (issue #15, engine part): evicted cached blocks are
saved to host memory and copied back on a later prefix hit, giving exactly the uncached run's tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest
from engine_harness import run_to_end, small_engine_args

from workers.engine import LLM, SamplingParams
from workers.engine.host_tier import HostKVTier
from workers.engine.output_processor import RequestOutput
from workers.models.make_model import make_model

ARGS = {**small_engine_args("host-tier"), "max_num_seqs": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("host-tier") / "tiny", "qwen3_moe", "tiny", seed=5)


def test_lru_keeps_the_most_recent_blocks():
    tier = HostKVTier(3, (2, 4), np.float32)
    for h in range(4):
        tier.put(h, h - 1 if h else None, np.full((2, 4), h, np.float32))
    assert 0 not in tier and all(h in tier for h in (1, 2, 3)) and tier.stats.blocks_evicted == 1
    assert tier.lookup([1, 2, 9, 3]) == [tier.slot_of[1], tier.slot_of[2]]  # a run from the first hash
    tier.put(4, 3, np.full((2, 4), 4, np.float32))  # 3 was least recently used (1 and 2 were touched)
    assert 3 not in tier and float(tier.read([tier.slot_of[4]])[0, 0, 0]) == 4.0
    tier.clear()
    assert tier.num_used == 0 and tier.lookup([1]) == []


def test_a_prefix_evicted_from_the_device_is_reloaded_from_the_host(tiny):
    # 24 device blocks of 8 tokens: four more 72-token prompts push the first one's blocks out.
    llm = LLM(str(tiny), num_kv_blocks=24, host_kv={"blocks": 64}, **ARGS)
    first = prompt(1, 72)
    out = llm.generate([first], GREEDY)[0]
    for seed in range(2, 6):
        llm.generate([prompt(seed, 72)], GREEDY)
    kv = llm.engine.kv
    assert kv.host.stats.blocks_saved >= 9
    turn2 = first + out.token_ids + [7, 8, 9]
    again = llm.generate([turn2], GREEDY)[0]
    assert kv.host.stats.blocks_loaded >= 9 and again.num_cached_tokens >= 72
    uncached = LLM(str(tiny), num_kv_blocks=24, enable_prefix_caching=False, **ARGS).generate([turn2], GREEDY)[0]
    assert again.token_ids == uncached.token_ids
    without_tier = LLM(str(tiny), num_kv_blocks=24, **ARGS)
    without_tier.generate([first], GREEDY)
    for seed in range(2, 6):
        without_tier.generate([prompt(seed, 72)], GREEDY)
    assert without_tier.generate([turn2], GREEDY)[0].num_cached_tokens < 72  # the device alone lost it


def test_concurrent_requests_with_host_hits_equal_alone(tiny):
    llm = LLM(str(tiny), num_kv_blocks=24, host_kv={"blocks": 64}, **ARGS)
    prompts = [prompt(10 + i, 40) for i in range(6)]
    first = llm.generate(prompts, GREEDY)
    again = llm.generate([p + o.token_ids for p, o in zip(prompts, first)], GREEDY)
    assert llm.engine.kv.host.stats.blocks_loaded > 0
    alone = LLM(str(tiny), num_kv_blocks=24, enable_prefix_caching=False, **ARGS)
    for p, o, a in zip(prompts, first, again):
        assert alone.generate([p + o.token_ids], GREEDY)[0].token_ids == a.token_ids
    assert llm.engine.kv.num_free_blocks == 24  # nothing left referenced on the device


def test_host_tier_refused_where_it_does_not_work_yet(tiny):
    with pytest.raises(ValueError, match="not supported yet with data-parallel attention"):
        LLM(str(tiny), host_kv={"blocks": 8}, parallel={"mesh": "8"}, **ARGS)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(str(tiny), host_kv={"blocks": 8}, enable_prefix_caching=False, **ARGS)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("host-tier-hybrid") / "qwen35", "qwen3_5_moe", "tiny", seed=1)


def test_a_hybrid_prefix_reloaded_from_the_host_equals_the_uncached_run(hybrid):
    """Qwen3.5 (Gated DeltaNet + gated attention): the evicted attention blocks and the state snapshot at
    their end both come back from the host; the next turn resumes there with the uncached run's tokens."""
    args = {**ARGS, "max_num_seqs": 4, "state_snapshots": 4}
    llm = LLM(str(hybrid), num_kv_blocks=24, host_kv={"blocks": 64}, **args)
    kv = llm.engine.kv
    first = prompt(1, 72)
    out = _evict_into_host(llm, first)
    assert kv.host.stats.blocks_saved >= 9 and kv.host_states.stats.blocks_saved >= 1
    turn2 = first + out.token_ids + [7, 8, 9]
    again = llm.generate([turn2], GREEDY)[0]
    assert kv.host.stats.blocks_loaded >= 9 and again.num_cached_tokens >= 72
    assert kv.host_states.stats.blocks_loaded == 1, "the state at the boundary came from the host"
    uncached = LLM(str(hybrid), num_kv_blocks=24, enable_prefix_caching=False, **args).generate([turn2], GREEDY)[0]
    assert again.token_ids == uncached.token_ids
    # The boundaries went to the host as events of their own (the attention tier publishes nothing).
    sub = llm.engine.events.subscribe()
    for seed in range(30, 34):
        llm.generate([prompt(seed, 72)], GREEDY)
    llm.generate([prompt(9, 8)], GREEDY)
    host_events = [e for e in sub.drain() if e.tier == "host"]
    assert host_events and {e.block_hash for e in host_events} <= set(kv.host_states.slot_of) | {
        e.block_hash for e in host_events if e.kind.value == "removed"
    }


def test_tier_events_tell_the_index_what_moved_to_the_host(tiny):
    """Evicted blocks are published as stored on the host, host evictions as removed from the host: the
    router's index then knows the worker holds the first prompt only in its host tier."""
    from cluster.router import MemoryKVIndex, WorkerLoad
    from workers.engine.kv_events import KVEventKind

    llm = LLM(str(tiny), num_kv_blocks=24, host_kv={"blocks": 12}, worker_id="w0", **ARGS)
    sub = llm.engine.events.subscribe()
    first = prompt(1, 72)
    llm.generate([first], GREEDY)
    for seed in range(2, 6):
        llm.generate([prompt(seed, 72)], GREEDY)
    llm.generate([prompt(9, 8)], GREEDY)  # one more step: the last evictions reach the tier
    events = sub.drain()
    host = [e for e in events if e.tier == "host"]
    assert {e.kind for e in host} == {KVEventKind.STORED, KVEventKind.REMOVED}  # 12 slots overflowed
    assert sum(e.kind == KVEventKind.STORED for e in host) == llm.engine.kv.host.stats.blocks_saved
    assert sum(e.kind == KVEventKind.REMOVED for e in host) == llm.engine.kv.host.stats.blocks_evicted
    index = MemoryKVIndex(heartbeat_ttl_s=60)
    index.heartbeat(WorkerLoad("w0", "both"))
    index.apply(events)
    tier = llm.engine.kv.host
    held = [h for h in tier.slot_of]  # exactly what the host holds now
    assert held and all(h not in llm.engine.kv.pool.cached for h in held)
    for h in held:
        match = index.lookup([h]).matches["w0"]
        assert match.blocks == 1 and match.offloaded == 1, "a host-only block counts as offloaded"
    llm.engine.kv.clear_prefix_cache()
    index.apply(sub.drain())
    assert index.lookup(held).matches == {}


def _evict_into_host(llm, first):
    """Runs `first`, then enough other prompts that its blocks leave the device for the host tier."""
    out = llm.generate([first], GREEDY)[0]
    for seed in range(2, 6):
        llm.generate([prompt(seed, 72)], GREEDY)
    llm.generate([prompt(9, 8)], GREEDY)
    return out


def test_a_host_reload_makes_the_request_wait_not_the_batch(tiny):
    """The step that starts a request's copy back from the host still runs the other requests; the
    request itself joins at the next step, with exactly the uncached run's tokens."""
    llm = LLM(str(tiny), num_kv_blocks=24, host_kv={"blocks": 64}, **ARGS)
    core = llm.engine
    first = prompt(1, 72)
    out = _evict_into_host(llm, first)
    core.add_request("busy", prompt(20, 8), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    core.step()  # "busy" prefills
    turn2 = first + out.token_ids + [7, 8, 9]
    core.add_request("again", turn2, GREEDY)
    outputs = core.step()
    assert "again" in core.scheduler.loading and [o.request_id for o in outputs] == ["busy"]
    core.step()
    assert not core.scheduler.loading and core.scheduler.requests["again"] in core.scheduler.running
    final: dict = {}
    run_to_end(core, "again", final)
    alone = LLM(str(tiny), num_kv_blocks=24, enable_prefix_caching=False, **ARGS).generate([turn2], GREEDY)[0]
    assert final["again"].token_ids == alone.token_ids and final["again"].num_cached_tokens >= 72


def test_aborting_a_request_while_its_blocks_come_back_frees_them(tiny):
    llm = LLM(str(tiny), num_kv_blocks=24, host_kv={"blocks": 64}, **ARGS)
    core = llm.engine
    first = prompt(1, 72)
    out = _evict_into_host(llm, first)
    core.add_request("busy", prompt(20, 8), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    core.step()
    core.add_request("again", first + out.token_ids + [7], GREEDY)
    core.step()
    assert "again" in core.scheduler.loading
    core.abort("again")
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    assert [o.finish_reason for o in outputs if o.request_id == "again"] == ["abort"]
    assert not core.scheduler.loading and not core._staged_loads
    assert core.kv.num_free_blocks == 24
    # The engine goes on serving, the host copy intact: the same turn now hits it again.
    again = llm.generate([first + out.token_ids + [7]], GREEDY)[0]
    assert again.num_cached_tokens >= 72


def test_blocks_evicted_for_a_kv_import_reach_the_host_before_the_import_overwrites_them(tiny):
    """A handoff's import allocates outside a step and writes its blocks at once: the evicted blocks it
    reuses must be copied to the host first, or the host would keep the import's KV under their hashes."""
    from workers.engine.engine import KVImport

    llm = LLM(str(tiny), num_kv_blocks=24, host_kv={"blocks": 64}, **ARGS)
    core = llm.engine
    first = prompt(1, 72)
    llm.generate([first], GREEDY)
    cached = dict(core.kv.pool.cached)  # hash -> device block, idle now
    before = {h: core.runner.gather_blocks([b], 0, core.cfg.num_kv_layers)[:, 0] for h, b in cached.items()}
    other = prompt(2, 159)
    core.add_request("imp", other, GREEDY, kv_import=KVImport(first_token=5))
    evicted = [h for h in cached if h not in core.kv.pool.cached]
    assert evicted, "the import should have taken some of the idle cached blocks"
    n = core.kv.blocks_needed(len(other))
    data = np.full((n, core.cfg.num_kv_layers, 8, *core.cfg.kv_page_dims), 7.0, np.float32)
    assert core.import_kv("imp", 0, 0, data) and core.finish_import("imp")
    while core.has_unfinished():
        core.step()
    core.step()  # idle: stores what the last step copied out
    for h in evicted:
        (slot,) = core.kv.host.lookup([h])
        np.testing.assert_array_equal(core.kv.host.read([slot])[0], before[h])


def test_a_host_reload_alone_in_its_step_runs_at_once(tiny):
    llm = LLM(str(tiny), num_kv_blocks=24, host_kv={"blocks": 64}, **ARGS)
    core = llm.engine
    first = prompt(1, 72)
    out = _evict_into_host(llm, first)
    turn2 = first + out.token_ids + [7, 8, 9]
    core.add_request("again", turn2, GREEDY)
    outputs = core.step()  # no other request to protect: loaded and run in the same step
    assert not core.scheduler.loading and [r.request_id for r in core.scheduler.running] == ["again"]
    assert core.scheduler.running[0].num_computed_tokens > 72  # its first step ran (its output may come next call)
    whole = {}
    for o in outputs:
        whole.setdefault(o.request_id, RequestOutput(o.request_id, [])).add(o)
    again = run_to_end(core, "again", whole)
    assert again.num_cached_tokens >= 72
    alone = LLM(str(tiny), num_kv_blocks=24, enable_prefix_caching=False, **ARGS).generate([turn2], GREEDY)[0]
    assert again.token_ids == alone.token_ids
