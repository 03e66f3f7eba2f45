"""Sliding-window layers as a cache group of their own (window_cache.py): a long sequence holds only its
window's blocks, prefix hits need only the window before the hit, KV events publish exactly the reusable
boundaries (the router's deepest-published match equals the engine's hit), speculative trims give blocks
back; through the engine (Gemma 4, tiny): the same tokens as one pool, with and without prefix hits across
the window, a handoff into and out of the other layout."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bench import scratch_dir
from workers.engine.host_tier import HOST_TIER, HostKVTier
from workers.engine.kv_events import KVEventKind, KVEventPublisher
from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams
from workers.engine.window_cache import NO_BLOCK, WindowedKVCacheManager, window_blocks_per_sequence

BS, WINDOW = 4, 10  # a query sees its 10 latest positions: at most 3 blocks back, plus the one it is in
PARAMS = SamplingParams(max_tokens=1000)


def manager(full=64, window=16, prefix=True, events=None, host=None) -> WindowedKVCacheManager:
    """`host`: (full-group, window-group) host tier sizes in blocks."""
    tiers = (None, None)
    if host is not None:
        tiers = tuple(HostKVTier(n, (1,), np.float32, block_size=BS) for n in host)
    return WindowedKVCacheManager(full, window, BS, WINDOW, prefix, "", events, 600.0, *tiers)


def carry_host_copies(kv: WindowedKVCacheManager) -> list[tuple[int, str, list[int], np.ndarray]]:
    """What the engine does with the host tiers around a step: evicted blocks stored (their "pages" are their
    hash), queued loads taken; returns the loads as (group, request, device blocks, host pages)."""
    loads = []
    for channel in kv.host_channels():
        for _, h, parent, session in channel.take_pending_saves():
            channel.tier.put(h, parent, np.array([h % 1000], np.float32), session)
        loads += [(channel.group, *load) for load in channel.take_pending_loads()]
    return loads


def run(kv: WindowedKVCacheManager, request: Request, chunk: int = 8, decode: int = 0, check=None) -> int:
    """Prefills `request` in chunks (after its prefix hit) and decodes `decode` tokens, as the scheduler does;
    returns how many blocks of the hit came back from the host tiers."""
    hit = kv.cached_prefix(request)
    host = kv.host_prefix(request, len(hit))
    request.num_computed_tokens = min((len(hit) + len(host)) * BS, request.num_tokens - 1)
    first, loaded = True, 0
    while request.num_computed_tokens < request.num_tokens:
        n = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate(request, n, hit if first else (), host if first else ()) is not None
        if first:
            loaded = sum(len(blocks) for *_, blocks, _ in carry_host_copies(kv))
        first = False
        request.num_computed_tokens += n
        kv.cache_full_blocks(request)
        if check:
            check(request, n)
        if request.num_computed_tokens == request.num_tokens and decode:
            request.output_token_ids.append(7 + decode % 50)
            decode -= 1
        carry_host_copies(kv)
    return loaded


def test_a_long_sequence_holds_only_its_windows_blocks():
    kv = manager(full=64, window=8)
    request = Request("r", list(range(100, 140)), PARAMS)
    held = []

    def check(req, n):
        live = kv.live_window_blocks(req)
        held.append(live)
        assert live <= window_blocks_per_sequence(WINDOW, BS) + -(-n // BS), (req.num_computed_tokens, req.window_block_ids)
        assert len(req.window_block_ids) == len(req.block_ids) == -(-req.num_computed_tokens // BS)

    run(kv, request, chunk=8, decode=150, check=check)
    assert len(request.block_ids) == -(-190 // BS)  # the full group keeps every block
    assert max(held) <= 5 and request.window_block_ids[:40] == [NO_BLOCK] * 40
    # Its 48 blocks' window KV took at most 5 of the window pool's 8 blocks.
    kv.free(request)
    assert kv.window_pool.num_free == 8 and kv.pool.num_free == 64


def test_prefix_hits_need_only_the_window_before_the_hit():
    kv = manager(full=64, window=12)
    prompt = list(range(200, 248))  # 12 blocks
    a = Request("a", prompt, PARAMS)
    run(kv, a)
    kv.free(a)
    b = Request("b", prompt + [5, 6, 7, 8, 9], PARAMS)
    hit = kv.cached_prefix(b)
    assert len(hit) == 12 and hit.window_start == 9  # a hit at the end needs blocks 9..11 only
    # Another prompt takes 8 window blocks: the first ones "a" let go are evicted, the hit stays whole.
    run(kv, c := Request("c", list(range(500, 532)), PARAMS))
    kv.free(c)
    assert kv.window_pool.cached.get(a.block_hashes[0]) is None
    assert len(kv.cached_prefix(b)) == 12
    # More: the blocks at its end go too, and the hit falls back to a boundary whose window is cached.
    run(kv, d := Request("d", list(range(600, 632)), PARAMS))
    kv.free(d)
    assert len(kv.cached_prefix(b)) < 12
    run(kv, b)
    assert b.num_cached_tokens == -1 and len(b.block_ids) == len(b.window_block_ids) == 14


def test_a_hit_reuses_only_blocks_whose_window_is_cached():
    kv = manager(full=64, window=32)
    prompt = list(range(300, 348))  # 12 blocks
    a = Request("a", prompt, PARAMS)
    run(kv, a)
    kv.free(a)
    # Evict one window block in the middle (block 5): hits through blocks 5..8 need it, later ones do not.
    h5 = a.block_hashes[5]
    block = kv.window_pool.cached[h5]
    kv.window_pool._free_cached.discard(block)
    kv.window_pool.ref_cnt[block] = 1
    kv.window_pool._evict(block, None)
    for cut, want in [(12, 12), (9, 9), (8, 5), (6, 5), (5, 5)]:
        hit = kv.cached_prefix(Request(f"p{cut}", prompt[: cut * BS] + [1], PARAMS))
        assert len(hit) == want, (cut, len(hit))


def _deepest_published(published: set[int], hashes: list[int]) -> int:
    """The router's match: the deepest published block along the chain (cluster/router/memory_index.py)."""
    return max((i + 1 for i, h in enumerate(hashes) if h in published), default=0)


@pytest.mark.parametrize("seed", range(6))
def test_events_publish_exactly_what_a_hit_reuses(seed):
    """Random conversations sharing prefixes through small pools (evictions in both groups): after every
    request, for every prompt seen, the deepest published block equals the engine's hit."""
    rng = random.Random(seed)
    events = KVEventPublisher("w")
    sub = events.subscribe()
    kv = manager(full=40, window=14, events=events)
    published: set[int] = set()
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    prompts = []
    for n in range(40):
        prompt = rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randrange(0, 24))]
        if prompts and rng.random() < 0.3:  # the next turn of an earlier conversation
            prompt = rng.choice(prompts) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        prompt = prompt[:60]
        request = Request(f"r{n}", prompt, PARAMS)
        run(kv, request, chunk=rng.choice([4, 8, 12]))
        kv.free(request)
        prompts.append(prompt)
        for e in sub.drain():
            if e.kind is KVEventKind.STORED:
                assert e.block_hash not in published
                published.add(e.block_hash)
            elif e.kind is KVEventKind.REMOVED:
                published.remove(e.block_hash)
        for i, p in enumerate(prompts):
            probe = Request(f"probe{i}", p + [1], PARAMS)
            hit = kv.cached_prefix(probe)
            assert len(hit) == _deepest_published(published, probe.block_hashes), (n, i)


@pytest.mark.parametrize("seed", range(6))
def test_host_tiers_events_publish_exactly_what_a_hit_reuses(seed):
    """As above with host tiers behind both groups (small enough to drop blocks too): the deepest published block
    (either tier) equals the engine's hit, published on the device tier exactly when the hit needs no host
    block, and a hit that loads from the host gets the blocks it names (their pages are their hashes)."""
    rng = random.Random(100 + seed)
    events = KVEventPublisher("w")
    sub = events.subscribe()
    kv = manager(full=30, window=12, events=events, host=(40, 14))
    published: dict[int, set[str]] = {}
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    prompts, loaded = [], 0
    for n in range(50):
        prompt = rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randrange(0, 24))]
        if prompts and rng.random() < 0.4:
            prompt = rng.choice(prompts) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        prompt = prompt[:60]
        request = Request(f"r{n}", prompt, PARAMS)
        loaded += run(kv, request, chunk=rng.choice([4, 8, 12]))
        kv.free(request)
        carry_host_copies(kv)
        prompts.append(prompt)
        for e in sub.drain():
            tiers = published.setdefault(e.block_hash, set())
            if e.kind is KVEventKind.STORED:
                assert e.tier not in tiers
                tiers.add(e.tier)
            elif e.kind is KVEventKind.REMOVED:
                tiers.remove(e.tier)
            assert len(tiers) <= 1 or e.kind is KVEventKind.STORED  # moving: STORED in the new tier first
        held = {h: t for h, ts in published.items() for t in ts}
        for i, p in enumerate(prompts):
            probe = Request(f"probe{i}", p + [1], PARAMS)
            hit = kv.cached_prefix(probe)
            host = kv.host_prefix(probe, len(hit))
            deepest = _deepest_published(set(held), probe.block_hashes)
            assert len(hit) + len(host) == deepest, (n, i)
            if deepest:
                from_host = bool(host) or any(s != NO_BLOCK for s in hit.window_host)
                assert (held[probe.block_hashes[deepest - 1]] == HOST_TIER) == from_host, (n, i)
    assert loaded > 0 and kv.host.stats.blocks_evicted > 0 and kv.host_window.stats.blocks_evicted > 0


def test_a_hit_loads_window_blocks_from_the_host_into_fresh_blocks():
    kv = manager(full=64, window=8, host=(16, 16))
    prompt = list(range(300, 348))  # 12 blocks: its window blocks go to the host as other prompts pass
    run(kv, a := Request("a", prompt, PARAMS))
    kv.free(a)
    run(kv, c := Request("c", list(range(500, 532)), PARAMS))
    kv.free(c)
    carry_host_copies(kv)
    assert all(h in kv.host_window for h in a.block_hashes[9:12]) and a.block_hashes[11] not in kv.window_pool.cached
    b = Request("b", prompt + [5, 6, 7], PARAMS)
    hit = kv.cached_prefix(b)
    assert len(hit) == 12 and kv.host_prefix(b, 12) == [] and hit.window_start == 9
    b.num_computed_tokens = 48
    assert kv.allocate(b, 3, hit) is not None
    ((group, rid, blocks, pages),) = [
        load for channel in kv.host_channels() for load in ((channel.group, *x) for x in channel.take_pending_loads())
    ]
    assert (group, rid) == (1, "b") and blocks == b.window_block_ids[9:12]
    assert [int(p[0]) for p in pages] == [h % 1000 for h in a.block_hashes[9:12]]
    assert kv.host_window.stats.blocks_loaded == 3


def test_a_whole_prompt_hit_from_the_host_still_copies_its_last_window_block():
    """The hit's last full block comes back from the host while its window block is still on the device: the
    recomputed last token writes into a private copy of that window block, and the copy is part of the step's
    plan even though the request waits for its host blocks (it was dropped with it: the copy never ran)."""
    from workers.engine.scheduler import Scheduler
    from workers.engine.window_cache import WINDOW_GROUP

    kv = manager(full=17, window=40, host=(32, 32))
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add(other := Request("other", [1, 2, 3], PARAMS))  # running: its next token needs no new block
    for item in scheduler.schedule().scheduled:
        scheduler.advance(item)
    other.output_token_ids.append(5)
    prompt = list(range(300, 348))  # 12 blocks
    run(kv, a := Request("a", prompt, PARAMS))
    kv.free(a)
    run(kv, c := Request("c", list(range(500, 540)), PARAMS))  # 10 blocks: a's tail goes to the host
    kv.free(c)
    carry_host_copies(kv)
    assert a.block_hashes[11] in kv.host and a.block_hashes[11] in kv.window_pool.cached
    scheduler.add(b := Request("b", prompt, PARAMS))
    out = scheduler.schedule()
    assert "b" in scheduler.loading and b.num_computed_tokens == 47  # the whole prompt but its last token
    window_copies = [copy for copy in out.block_copies if copy.group == WINDOW_GROUP]
    assert [(copy.src, copy.dst) for copy in window_copies] == [(kv.window_pool.cached[a.block_hashes[11]], b.window_block_ids[11])]


def test_speculative_trim_gives_back_blocks_of_both_groups():
    kv = manager()
    request = Request("r", list(range(10, 30)), PARAMS)
    run(kv, request)
    free_full, free_window = kv.pool.num_free, kv.window_pool.num_free
    assert kv.allocate(request, 1 + 7) is not None  # a decode token plus 7 drafts: two more blocks
    assert kv.pool.num_free < free_full and kv.window_pool.num_free < free_window
    request.output_token_ids.append(3)
    kv.verified(request, 0, 7)  # every draft rejected: the blocks past its 21 tokens go back
    assert len(request.window_block_ids) == len(request.block_ids) == 6
    assert kv.pool.num_free == free_full - 1  # the block its next token goes in
    assert kv.live_window_blocks(request) == 4  # blocks 2..5: what a query at position 20 reads, no more
    kv.free(request)
    assert (kv.pool.num_free, kv.window_pool.num_free) == (64, 16)


def test_an_import_gets_window_blocks_only_for_what_its_decode_reads():
    kv = manager(full=64, window=6)
    request = Request("r", list(range(10, 70)), PARAMS)  # 60 tokens: 15 blocks; 4 would not fit the window pool
    assert kv.allocate_import(request, []) is not None
    assert len(request.block_ids) == 15 and request.window_block_ids[:12] == [NO_BLOCK] * 12
    assert kv.live_window_blocks(request) == 3


def test_a_step_short_of_window_blocks_changes_nothing():
    kv = manager(full=64, window=3)
    a = Request("a", list(range(10, 22)), PARAMS)
    assert kv.allocate(a, 12) is not None  # 3 window blocks: all of them
    b = Request("b", list(range(50, 54)), PARAMS)
    before = (kv.pool.num_free, kv.window_pool.num_free)
    assert kv.allocate(b, 4) is None
    assert (kv.pool.num_free, kv.window_pool.num_free) == before and b.block_ids == b.window_block_ids == []


# ---------------------------------------------------------------------------------------------------- engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Tiny Gemma 4 (sliding window 5 tokens, blocks of 8): full layers, sliding ones, KV-shared ones, MoE."""
    from hf_checkpoints import GEMMA4_MOE, save_gemma4_checkpoint

    return save_gemma4_checkpoint(tmp_path_factory.mktemp("g4w") / "moe", attention_k_eq_v=True, num_kv_shared_layers=2, **GEMMA4_MOE)


# One persistent XLA cache for the module: engines of the same layout load the programs the first compiled.
XLA_CACHE = scratch_dir("moray-window-xla-")


def engine_args(**extra):
    from engine_harness import ENGINE_ARGS

    # A 16-token step budget: long prompts are prefilled in chunks.
    args = {**ENGINE_ARGS, "warmup": False, "max_num_batched_tokens": 16, "token_buckets": [8, 16]}
    return {**args, "compilation_cache_dir": XLA_CACHE, **extra}


@pytest.fixture(scope="module")
def windowed(gemma):
    from workers.engine import LLM

    llm = LLM(str(gemma), **engine_args())
    assert llm.engine.runner.window_layers == (0, 2, 3)  # the sliding cache layers (layer 4 reuses 3)
    assert llm.engine.kv.window_pool.num_blocks < llm.engine.kv.pool.num_blocks
    return llm


@pytest.fixture(scope="module")
def one_pool(gemma):
    from workers.engine import LLM

    llm = LLM(str(gemma), **engine_args(sliding_window_group=False, enable_prefix_caching=False))
    assert llm.engine.runner.window_layers == ()
    return llm


def test_the_engine_gives_one_pools_tokens_and_holds_only_the_window(windowed, one_pool):
    batch = [list(range(1, 40)), [8, 2, 77, 45, 1, 90, 33], list(range(40, 61))]
    want = [o.token_ids for o in one_pool.generate(batch, GREEDY)]
    engine = windowed.engine
    for i, prompt in enumerate(batch):
        engine.add_request(f"w{i}", prompt, GREEDY)
    held, out = [], {}
    while engine.has_unfinished():
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.token_ids)
        for request in engine.scheduler.running:
            held.append(engine.kv.live_window_blocks(request))
            assert len(request.window_block_ids) == len(request.block_ids)
    assert max(held) <= window_blocks_per_sequence(5, 8) + 2  # its window, plus a 16-token chunk's blocks
    got = [out[f"w{i}"] for i in range(len(batch))]
    assert got == want
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks and engine.kv.window_pool.num_free == engine.kv.window_pool.num_blocks


def test_prefix_hits_across_the_window_give_the_uncached_tokens(windowed, one_pool):
    prompt = list(range(5, 45))  # 40 tokens: 5 blocks, hits far past the 5-token window
    first = windowed.generate([prompt], SHORT)[0]
    turn2 = prompt + first.token_ids + [7, 8]
    branch = prompt[:27] + [91, 92, 93, 94, 95]  # shares 3 whole blocks, then branches
    again, other = windowed.generate([turn2], SHORT)[0], windowed.generate([branch], SHORT)[0]
    assert again.num_cached_tokens >= 40 and other.num_cached_tokens == 24
    assert [again.token_ids, other.token_ids] == [o.token_ids for o in one_pool.generate([turn2, branch], SHORT)]


@pytest.mark.parametrize("direction", ["windowed-to-one-pool", "one-pool-to-windowed"])
def test_a_handoff_between_the_layouts(gemma, one_pool, direction):
    from engine_harness import kv_handoff, run_to_end

    from workers.engine import EngineConfig, EngineCore

    groups = [True, False] if direction == "windowed-to-one-pool" else [False, True]
    prefill, decode = (
        EngineCore(EngineConfig(model=str(gemma), worker_id=w, **engine_args(sliding_window_group=g)), show_progress=False)
        for w, g in zip("pd", groups)
    )
    prompt = list(range(3, 40))
    _, outs, _ = kv_handoff(prefill, decode, "r", prompt, SHORT, chunk_bytes=4096)
    assert outs[-1].token_ids == one_pool.generate([prompt], SHORT)[0].token_ids
    if groups[1]:  # the importing side allocated window blocks only for what its decode reads
        assert decode.kv.window_pool.num_free == decode.kv.window_pool.num_blocks
    # A prompt branching off early: the sender had let go of the sliding KV its window needs (filler came in
    # its place), so neither layout may resume from the imported blocks there.
    branch = prompt[:16] + [50, 51, 52, 53]
    decode.add_request("b", branch, SHORT)
    out = run_to_end(decode, "b")
    assert out.num_cached_tokens == 0 and out.token_ids == one_pool.generate([branch], SHORT)[0].token_ids


def test_host_tiers_behind_both_groups_give_the_uncached_tokens(gemma, one_pool):
    """Small device pools with host tiers behind both groups: conversations come back for a second turn after
    others pushed their blocks off the device; both groups' blocks come back from the host, and every answer
    equals the uncached one-pool engine's. The KV events then describe the hits exactly (tier included)."""
    from workers.engine import LLM

    llm = LLM(str(gemma), **engine_args(num_kv_blocks=16, host_kv={"blocks": 48}))
    kv = llm.engine.kv
    assert kv.window_pool.num_blocks == 16 and kv.host_window.num_blocks == 48  # the device pools' proportion
    sub = llm.engine.events.subscribe()
    firsts = [[(7 * c + i) % 97 + 3 for i in range(40)] for c in range(8)]
    outs = llm.generate(firsts, SHORT)
    turn2 = [p + o.token_ids + [11, 12] for p, o in zip(firsts, outs)]
    again = [llm.generate([p], SHORT)[0] for p in turn2]  # one at a time: each pushes the next one's blocks out
    assert all(a.num_cached_tokens >= 40 for a in again), [a.num_cached_tokens for a in again]
    assert kv.host.stats.blocks_loaded > 0 and kv.host_window.stats.blocks_loaded > 0
    assert [a.token_ids for a in again] == [o.token_ids for o in one_pool.generate(turn2, SHORT)]
    held: dict[int, str] = {}
    for e in sub.drain():
        if e.kind is KVEventKind.STORED:
            held[e.block_hash] = e.tier
        elif e.kind is KVEventKind.REMOVED and held.get(e.block_hash) == e.tier:
            del held[e.block_hash]
    for p, o in zip(turn2, again):
        probe = Request("probe", p + o.token_ids + [1], PARAMS)
        hit = kv.cached_prefix(probe)
        assert len(hit) + len(kv.host_prefix(probe, len(hit))) == _deepest_published(set(held), probe.block_hashes)
