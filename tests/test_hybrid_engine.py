"""The engine on hybrid linear-attention models (Qwen3.5-MoE, Qwen3-Next): greedy parity with
transformers, chunking/batching/preemption invariance, prefix caching through state snapshots (and
never without one), KV events that predict the engine's reuse to the block, and the KV + state handoff."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import transformers
from engine_harness import move_kv, prompts, run_to_end, small_engine_args

from cluster.router.memory_index import MemoryKVIndex
from cluster.router.types import WorkerLoad
from workers.engine import LLM, EngineConfig, EngineCore, SamplingParams
from workers.engine.block_hash import block_hashes
from workers.engine.engine import KVImport
from workers.engine.kv_events import KVEventKind
from workers.models.make_model import make_model

# One persistent XLA cache for the engines of this module (the ragged state kernels compile slowly on CPU).
ARGS = small_engine_args("hybrid")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("qwen3_5_moe") / "m", "qwen3_5_moe", "tiny", seed=5)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("qwen3_next") / "m", "qwen3_next", "tiny", seed=5)


# Each family runs the parity, chunking and handoff tests; the cache-behaviour tests, which do not
# depend on the family's math, run on Qwen3.5 (the model Moray serves first).
@pytest.fixture(params=["qwen3_5_moe", "qwen3_next"])
def family_dir(request):
    return request.getfixturevalue({"qwen3_5_moe": "qwen35", "qwen3_next": "qwen3_next"}[request.param])


@pytest.fixture
def model_dir(qwen35):
    return qwen35


@pytest.fixture(scope="module")
def llm(qwen35) -> LLM:
    return LLM(str(qwen35), **ARGS)


def test_greedy_generate_equals_transformers(family_dir):
    model_dir, llm = family_dir, LLM(str(family_dir), **ARGS)
    batch = [[3, 17, 42, 5, 88, 61, 9, 23, 70, 11], [8, 2, 77, 45, 1, 90, 33], list(range(1, 30))]
    ours = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, out in zip(batch, ours):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_chunk(family_dir, chunk):
    model_dir = family_dir
    prompt = prompts(1, seed=2, lo=100, hi=101)[0]
    whole = LLM(str(model_dir), **{**ARGS, "max_num_batched_tokens": 128, "token_buckets": [8, 128], "enable_prefix_caching": False})
    expected = whole.generate([prompt], GREEDY)[0]
    buckets = [chunk] if chunk < 8 else [8, chunk]
    chunked = LLM(str(model_dir), **{**ARGS, "max_num_batched_tokens": chunk, "token_buckets": buckets, "enable_prefix_caching": False})
    assert chunked.generate([prompt], GREEDY)[0].token_ids == expected.token_ids


def test_concurrent_requests_equal_alone(llm):
    batch = prompts(16, seed=1)
    together = llm.generate(batch, GREEDY)
    for prompt, out in zip(batch[:6], together[:6]):
        assert llm.generate([prompt], GREEDY)[0].token_ids == out.token_ids
    assert len({tuple(o.token_ids) for o in together}) > 1


def test_preemption_gives_identical_outputs(model_dir, llm):
    batch = prompts(8, seed=5, lo=20, hi=50)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = llm.generate(batch, params)
    small = LLM(str(model_dir), **{**ARGS, "num_kv_blocks": 24, "enable_prefix_caching": False})
    got = small.generate(batch, params)
    assert small.engine.preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    _assert_all_free(small.engine)


def _assert_all_free(engine: EngineCore) -> None:
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert not engine.kv.slots.working and not engine.kv.slots.pending


def test_second_turn_reuses_the_first_turns_blocks(model_dir, llm):
    turn1 = prompts(1, seed=7, lo=37, hi=38)[0]  # 4 full blocks of 8 + 5 tokens
    first = llm.generate([turn1], GREEDY)[0]  # 12 more tokens: 49 in all, 6 full blocks computed
    turn2 = turn1 + first.token_ids + [7, 8, 9, 10, 11]
    second = llm.generate([turn2], GREEDY)[0]
    assert second.num_cached_tokens == 48
    uncached = LLM(str(model_dir), **{**ARGS, "enable_prefix_caching": False}).generate([turn2], GREEDY)[0]
    assert second.token_ids == uncached.token_ids


def test_prefix_without_a_snapshot_is_recomputed_not_reused(model_dir):
    """One snapshot slot: a second prompt's snapshot evicts the first's, whose attention blocks stay
    cached. The first prompt again must be recomputed (hit 0), giving the same tokens."""
    engine = LLM(str(model_dir), **{**ARGS, "state_snapshots": 1})
    a, b = prompts(2, seed=8, lo=30, hi=40)
    first = engine.generate([a], GREEDY)[0]
    engine.generate([b], GREEDY)
    hashes = block_hashes(a, 8, engine.engine.config.model_name)
    assert engine.engine.kv.attn.pool.longest_cached_prefix(hashes)  # its KV blocks are still there
    again = engine.generate([a], GREEDY)[0]
    assert again.num_cached_tokens == 0
    assert again.token_ids == first.token_ids


def test_the_routers_prediction_equals_the_engines_reuse(model_dir):
    """The router, over an index fed the engine's events, predicts exactly the tokens the engine reuses,
    on probes that branch off earlier prompts inside their blocks (the engine then keeps a state at the
    branch point, and later probes reuse it), and on block-aligned prompts fully cached (the engine
    resumes a block before the end: the last token is computed)."""
    from cluster.config import RouterConfig
    from cluster.router import Router, RouteRequest

    llm = LLM(str(model_dir), **ARGS)
    engine = llm.engine
    index = MemoryKVIndex(heartbeat_ttl_s=1e9)
    index.heartbeat(WorkerLoad(engine.config.worker_id, ts=0.0))
    engine.events.add_listener(lambda e: index.apply([e]))
    router = Router(index, RouterConfig(policy="kv-aware"), block_size=8, clock=lambda: 0.0, state_boundaries=True)
    rng = random.Random(9)
    base = prompts(3, seed=9, lo=20, hi=45)
    for p in base:
        llm.generate([p], GREEDY)
    assert engine.kv.num_snapshots > 0
    pairs = []
    for i in range(8):
        p = base[i % 3]
        # Two probes cut from p at the same point: block-aligned (p's prefix alone) or branching off p
        # anywhere, inner boundaries included, with different continuations.
        cut = 8 * rng.randrange(1, len(p) // 8 + 1) if i % 4 == 3 else rng.randrange(1, len(p) + 1)
        pair = []
        for _ in range(2):
            probe = p[:cut] + ([] if i % 4 == 3 else [rng.randrange(3, 500) for _ in range(rng.randrange(1, 12))])
            hashes = block_hashes(probe, 8, engine.config.model_name)
            predicted = router.route(RouteRequest(f"probe{i}-{len(pair)}", hashes, len(probe))).expected_cached_tokens
            out = llm.generate([probe], SamplingParams(temperature=0.0, max_tokens=1))[0]
            assert out.num_cached_tokens == predicted, (i, len(pair), cut, len(probe))
            pair.append(out.num_cached_tokens)
        # The first kept a state at the branch point (or had one): the second resumes there (an aligned
        # probe, p's prefix alone, one block before its end).
        pairs.append((pair[1], ((cut - 1) // 8 if i % 4 == 3 else cut // 8) * 8))
    assert all(second >= branch for second, branch in pairs), pairs


def test_events_announce_only_reusable_boundaries(model_dir):
    llm = LLM(str(model_dir), **ARGS)
    sub = llm.engine.events.subscribe()
    prompt = prompts(1, seed=10, lo=37, hi=38)[0]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    stored = [e for e in sub.drain() if e.kind is KVEventKind.STORED]
    # One prefill step over 37 tokens crosses boundaries 8..32: only the last one gets a snapshot.
    assert [e.block_hash for e in stored] == [block_hashes(prompt, 8, llm.engine.config.model_name)[3]]


def _engine(model_dir, worker):
    return EngineCore(EngineConfig(model=str(model_dir), worker_id=worker, **ARGS), show_progress=False)


def _run(engine, rid):
    return [run_to_end(engine, rid)]


def test_handoff_carries_kv_and_state(family_dir):
    model_dir = family_dir
    prefill, decode, single = _engine(model_dir, "p0"), _engine(model_dir, "d0"), _engine(model_dir, "s0")
    for i, prompt in enumerate(prompts(3, seed=11, lo=5, hi=60)):
        rid = f"r{i}"
        prefill.add_request(rid, prompt, GREEDY.model_copy(update={"max_tokens": 1}), hold_kv=True)
        first = _run(prefill, rid)[-1]
        decode.add_request(rid, prompt, GREEDY, kv_import=KVImport(first.token_ids[0], first.num_cached_tokens))
        chunks = move_kv(prefill, decode, rid, reverse=True)  # written in any order: here the state first
        state = chunks[-1].data
        assert chunks[-1].header.kind == "state" and len(chunks) == prefill.kv.blocks_needed(len(prompt)) + 1
        assert state.dtype == np.float32 and state.nbytes == prefill.runner.state_bytes_per_slot
        got = _run(decode, rid)[-1]  # what follows the first token (streamed by the prefill side)
        single.add_request(rid, prompt, GREEDY)
        assert first.token_ids + got.token_ids == _run(single, rid)[-1].token_ids
    for e in (prefill, decode):
        _assert_all_free(e)


@pytest.mark.parametrize("parallel", [{"mesh": "2x4", "dp": 2, "tp": 4, "moe": {"dispatch": "hierarchical"}}], ids=["dp2-tp4"])
def test_data_parallel_ranks_keep_their_states(qwen35, llm, parallel):
    """Data-parallel attention on 8 virtual devices: each rank owns its sequences' state slots; greedy
    tokens equal one device's, also with a small pool that preempts and a prefix hit on a rank."""
    from workers.engine.data_parallel import DataParallelRunner

    batch = prompts(8, seed=12, lo=20, hi=50)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(batch, params)]
    dp = LLM(str(qwen35), parallel=parallel, num_kv_blocks=20, **ARGS)
    assert isinstance(dp.engine.runner, DataParallelRunner)
    assert [o.token_ids for o in dp.generate(batch, params)] == expected
    assert dp.engine.preemptions > 0
    prompt = prompts(1, seed=13, lo=37, hi=38)[0]
    first, again = dp.generate([prompt], params)[0], dp.generate([prompt], params)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == first.token_ids
    assert dp.engine.kv.num_free_blocks == dp.engine.kv.pool.num_blocks
    assert all(not m.slots.working for m in dp.engine.kv.ranks)


@pytest.mark.parametrize("parallel", [{"mesh": "2x4"}, {"mesh": "2x4", "dp": 2, "tp": 4}], ids=["dp8", "dp2-tp4"])
def test_a_slot_split_over_ranks_is_copied_out_bit_for_bit_in_one_collective(qwen35, parallel):
    """A handoff's (or host save's) copy of one slot's state out of pools split by slot over data-parallel
    ranks. Indexing the split pools made XLA gather each pool whole: every slot, one all-gather per layer,
    independent of each other, which hangs two hosts over gloo (`hlo_collectives`)."""
    import jax
    from hlo_collectives import count_collectives, unordered_collectives

    dp = LLM(str(qwen35), parallel=parallel, **{**ARGS, "warmup": False})
    dp.generate(prompts(2, seed=3, lo=5, hi=9), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    runner = dp.engine.runner
    rng = np.random.default_rng(0)

    def noise(a):
        x = rng.standard_normal(a.shape).astype(np.float32)
        x.reshape(x.shape[0], -1)[:, :2] = [np.nan, -0.0]  # bits, not values (XLA's own gather lost -0.0)
        return jax.device_put(x, a.sharding)

    runner.state_pools = jax.tree.map(noise, runner.state_pools)
    slots = runner.state_pools[0][0].shape[0]
    assert runner.state_pools[0][0].sharding.spec[0] is not None  # split by slot, or there is nothing to test
    for slot in (0, 1, slots // 2 + 1, slots - 1):
        got, want = jax.tree.leaves(runner._gather_state(slot)), [np.asarray(a)[slot] for a in jax.tree.leaves(runner.state_pools)]
        assert all(g.sharding.is_fully_replicated for g in got)
        assert [np.asarray(g).tobytes() for g in got] == [np.asarray(w).tobytes() for w in want]
    (program,) = runner._state_gathers.values()
    hlo = program.lower(runner.state_pools, np.int32(0)).compile().as_text()
    assert count_collectives(hlo) == 1 and not unordered_collectives(hlo)


def test_aborts_return_every_block_and_state_slot(qwen35):
    engine = _engine(qwen35, "abort")
    rng = random.Random(14)
    for i, p in enumerate(prompts(12, seed=14, lo=5, hi=70)):
        engine.add_request(f"a{i}", p, SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 20), ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps % 2 == 0:
            for rid in list(engine.scheduler.requests)[:1]:
                engine.abort(rid)
    _assert_all_free(engine)
    held = engine.kv.slots
    assert len(held.free) + len(held.snapshots) == held.num_slots  # every slot is free or a snapshot


def _shared_prefix_prompts(seed: int, shared_len: int = 50, n: int = 4) -> list[list[int]]:
    """n prompts sharing their first `shared_len` tokens (6 full blocks of 8 for 50), each under one
    64-token prefill step, so no step of the first one ends at the shared boundary by itself."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(shared_len)]
    return [shared + [rng.randrange(3, 500) for _ in range(rng.randrange(8, 14))] for _ in range(n)]


@pytest.mark.parametrize("hint", [False, True])
def test_prompts_sharing_a_prefix_inside_a_step_reuse_it(model_dir, llm, hint):
    """Four prompts share 50 tokens and differ after them. Without a hint the second one finds the first's
    attention blocks but no state at their end: it keeps one there (a branch point), and the third and
    fourth reuse the 48 tokens. With the end of the shared part as a hint (`prefix_boundaries`, as the
    chat path sets for a system prompt) the first keeps it, and the second reuses it already. Greedy
    tokens equal an uncached run's."""
    engine = LLM(str(model_dir), **ARGS)
    batch = _shared_prefix_prompts(seed=21 + hint)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prefix_boundaries=[50] if hint else [])
    outs = [engine.generate([p], params)[0] for p in batch]
    assert [o.num_cached_tokens for o in outs] == ([0, 48, 48, 48] if hint else [0, 0, 48, 48])
    uncached = llm.generate(batch, GREEDY.model_copy(update={"max_tokens": 6}))
    assert [o.token_ids for o in outs] == [o.token_ids for o in uncached]


def test_a_forked_conversation_reuses_up_to_the_fork_on_every_branch(model_dir, llm):
    """A conversation (system prompt + turns: 43 tokens) forked into four continuations, each sent with the
    fork point as a hint (the chat path marks the conversation before its last message): every branch
    after the first resumes at the fork's block boundary (40 tokens); greedy tokens equal an uncached run."""
    engine = LLM(str(model_dir), **ARGS)
    rng = random.Random(31)
    conversation = [rng.randrange(3, 500) for _ in range(43)]
    branches = [conversation + [rng.randrange(3, 500) for _ in range(rng.randrange(5, 15))] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prefix_boundaries=[len(conversation)])
    outs = [engine.generate([b], params)[0] for b in branches]
    assert [o.num_cached_tokens for o in outs] == [0, 40, 40, 40]
    uncached = llm.generate(branches, GREEDY.model_copy(update={"max_tokens": 6}))
    assert [o.token_ids for o in outs] == [o.token_ids for o in uncached]


@pytest.mark.parametrize(
    "hints,chunks",
    [([17, 33, 50], [(0, 60)]), ([9, 17, 25, 33, 41], [(0, 32), (32, 28)])],
    ids=["three-hints-one-step", "five-hints-two-steps"],
)
def test_one_prefill_step_keeps_states_at_several_hints(model_dir, llm, monkeypatch, hints, chunks):
    """A 60-token prompt with several hints (keep points at their block boundaries, blocks of 8): one prefill
    step keeps a state at up to SNAPSHOTS_PER_STEP boundaries (its last one included), so three hints cost no
    extra step and five cost one (a step kept a single state before: each hint ended a chunk, 4 and 6 steps).
    Prompts sharing each hinted prefix then resume at it; greedy tokens equal an uncached run's."""
    engine = LLM(str(model_dir), **ARGS)
    core = engine.engine
    planned = []
    plan_step = core.kv.plan_step

    def recording(request, start, num_new_tokens, num_spec=0):
        planned.append((start, num_new_tokens))
        return plan_step(request, start, num_new_tokens, num_spec)

    monkeypatch.setattr(core.kv, "plan_step", recording)
    rng = random.Random(71)
    prompt = [rng.randrange(3, 500) for _ in range(60)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prefix_boundaries=hints)
    outs = [engine.generate([prompt], params)[0]]
    assert [c for c in planned if c[1] > 1] == chunks  # decode steps plan one token
    branches = [prompt[:h] + [rng.randrange(3, 500) for _ in range(6)] for h in hints]
    outs += [engine.generate([b], GREEDY.model_copy(update={"max_tokens": 4}))[0] for b in branches]
    assert [o.num_cached_tokens for o in outs[1:]] == [h - h % 8 for h in hints]
    uncached = llm.generate([prompt, *branches], GREEDY.model_copy(update={"max_tokens": 4}))
    assert [o.token_ids for o in outs] == [o.token_ids for o in uncached]


def test_state_memory_stays_within_its_budget(model_dir):
    """state_cache_memory_bytes: as many snapshots as fit, taken out of the KV pool's memory; under more
    distinct prefixes than fit, the snapshots' bytes never pass the budget (the engine's stats say so)."""
    from workers.engine.runner import state_bytes_per_sequence

    state = state_bytes_per_sequence(LLM(str(model_dir), **ARGS).engine.cfg)
    kv_bytes = 8 << 20
    plain = LLM(str(model_dir), **{**ARGS, "kv_cache_memory_bytes": kv_bytes}).engine
    engine = LLM(str(model_dir), **{**ARGS, "kv_cache_memory_bytes": kv_bytes, "state_cache_memory_bytes": 3 * state + state // 2})
    core = engine.engine
    assert core.max_snapshots == 3 and core.stats().state_snapshot_budget_bytes == 3 * state
    per_block = core.runner.kv_bytes_per_block
    assert core.kv.pool.num_blocks == (kv_bytes - 3 * state) // per_block < plain.kv.pool.num_blocks
    held = []
    for p in prompts(10, seed=41, lo=20, hi=60):
        engine.generate([p], GREEDY)
        held.append(core.stats().state_snapshot_bytes)
        assert core.kv.num_snapshots <= 3
    assert max(held) == 3 * state and all(h <= 3 * state for h in held)
    with pytest.raises(ValueError, match="state_cache_memory_bytes"):
        EngineConfig(model=str(model_dir), kv_cache_memory_bytes=kv_bytes, state_cache_memory_bytes=kv_bytes)


def test_a_state_many_prompts_resume_from_outlives_recent_one_off_ones(model_dir):
    """Room for 4 snapshots. A system prompt's state (kept at its end: a hint) that three requests resumed
    from stays while one-off prompts' states come and go: eviction weighs use and depth (GDSF), not
    recency alone (least recently used, it went with the third one-off prompt)."""
    engine = LLM(str(model_dir), **{**ARGS, "state_snapshots": 4})
    rng = random.Random(51)
    system = [rng.randrange(3, 500) for _ in range(42)]

    def ask(user_len: int, params=None):
        prompt = system + [rng.randrange(3, 500) for _ in range(user_len)]
        p = params or SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prefix_boundaries=[len(system)])
        return engine.generate([prompt], p)[0].num_cached_tokens

    assert [ask(9) for _ in range(3)] == [0, 40, 40]
    for p in prompts(5, seed=52, lo=30, hi=60):  # one-off prompts, each leaving a state at its end
        engine.generate([p], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert ask(11) == 40


@pytest.mark.parametrize("points,every,expected", [("step-ends", 0, [0, 0, 0, 0]), ("shared", 2, [0, 48, 48, 48])])
def test_where_states_are_kept_is_configurable(model_dir, llm, points, every, expected):
    """state_keep_points: step-ends keeps only each step's last boundary (the rule before branch points and
    hints: four prompts sharing 50 tokens inside one step reuse nothing, whatever the hint says);
    state_snapshot_every_blocks keeps one every N blocks, so the second prompt resumes without a hint."""
    engine = LLM(str(model_dir), **{**ARGS, "state_keep_points": points, "state_snapshot_every_blocks": every})
    batch = _shared_prefix_prompts(seed=61)
    hint = [50] if points == "step-ends" else []
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prefix_boundaries=hint)
    outs = [engine.generate([p], params)[0] for p in batch]
    assert [o.num_cached_tokens for o in outs] == expected
    uncached = llm.generate(batch, GREEDY.model_copy(update={"max_tokens": 6}))
    assert [o.token_ids for o in outs] == [o.token_ids for o in uncached]
