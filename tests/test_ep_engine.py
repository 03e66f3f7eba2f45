"""The engine over a mesh of 8 virtual CPU devices: data-parallel attention (each rank its own sequences
and KV blocks) with the expert-parallel MoE in the configured mode gives the single-device engine's
greedy tokens, also through prefix-cache hits, preemption and a KV handoff; ranks are chosen by free
blocks; a step's rows are padded per rank."""

from __future__ import annotations

import numpy as np
import pytest
from engine_harness import ENGINE_ARGS, kv_handoff, prompts, run_to_end

from workers.engine import LLM, EngineConfig, EngineCore, SamplingParams
from workers.engine.data_parallel import DataParallelKVCacheManager, DataParallelRunner
from workers.engine.request import Request
from workers.engine.scheduler import ScheduledRequest, SchedulerOutput
from workers.models.make_model import make_model

ARGS = {**ENGINE_ARGS, "warmup": False, "dtype": "float32"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("ep-engine") / "m", "qwen3_moe", "tiny", seed=3)


@pytest.fixture(scope="module")
def expected(tiny):
    """Single-device greedy tokens for `prompts(10)` and for the preemption batch."""
    llm = LLM(str(tiny), **ARGS)
    return {
        "batch": [o.token_ids for o in llm.generate(prompts(10, seed=11), GREEDY)],
        "long": [o.token_ids for o in llm.generate(prompts(8, seed=5, lo=20, hi=50), GREEDY)],
    }


@pytest.mark.parametrize(
    "parallel",
    [
        {"mesh": "1x8"},
        {"mesh": "2x4", "moe": {"dispatch": "hierarchical"}},
        {"mesh": "2x4", "dp": 2, "tp": 4, "moe": {"dispatch": "hierarchical-dispatch"}},
    ],
    ids=["dp8-flat", "dp8-hierarchical", "dp2-tp4-hierarchical-dispatch"],
)
def test_greedy_tokens_equal_one_device(tiny, expected, parallel):
    llm = LLM(str(tiny), parallel=parallel, **ARGS)
    assert isinstance(llm.engine.runner, DataParallelRunner)
    assert [o.token_ids for o in llm.generate(prompts(10, seed=11), GREEDY)] == expected["batch"]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks  # nothing leaked


def test_prefix_hits_and_preemption_per_rank(tiny, expected):
    """A pool of 16 blocks per rank on 2 ranks forces preemptions; a repeated prompt hits its rank's cache.
    Warm-up compiles the programs the steps run (it compiled one rank's logits rows where a step has every
    rank's, so each program compiled again at its first real step)."""
    llm = LLM(
        str(tiny), parallel={"mesh": "2x4", "dp": 2, "tp": 4}, num_kv_blocks=16, **{**ARGS, "warmup": True, "background_compile": False}
    )
    warm = llm.engine.runner.compiled_shapes()
    got = llm.generate(prompts(8, seed=5, lo=20, hi=50), GREEDY)
    assert llm.engine.runner.compiled_shapes() == warm
    assert [o.token_ids for o in got] == expected["long"]
    assert llm.engine.preemptions > 0
    prompt = prompts(1, seed=3, lo=37, hi=38)[0]
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == first.token_ids


def test_kv_handoff_from_a_data_parallel_prefill_engine(tiny):
    prefill = EngineCore(EngineConfig(model=str(tiny), worker_id="p", parallel={"mesh": "1x8"}, **ARGS), show_progress=False)
    decode = EngineCore(EngineConfig(model=str(tiny), worker_id="d", **ARGS), show_progress=False)
    single = EngineCore(EngineConfig(model=str(tiny), worker_id="s", **ARGS), show_progress=False)
    for i, prompt in enumerate(prompts(3, seed=20, lo=5, hi=60)):
        _, outs, _ = kv_handoff(prefill, decode, f"r{i}", prompt, GREEDY)
        single.add_request(f"r{i}", prompt, GREEDY)
        assert outs[-1].token_ids == run_to_end(single, f"r{i}").token_ids
    assert prefill.kv.num_free_blocks == prefill.kv.pool.num_blocks


def test_new_sequences_go_to_the_rank_with_most_room():
    kv = DataParallelKVCacheManager(dp=2, blocks_per_rank=8, block_size=4)
    a, b, c = (Request(rid, list(range(1, 10)), GREEDY) for rid in "abc")
    assert kv.allocate(a, 9) == []  # 3 blocks on rank 0 (tie: the lower rank)
    assert kv.allocate(b, 9) == []  # rank 1 now has more free blocks
    assert (kv.rank(a), kv.rank(b)) == (0, 1)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [8, 9, 10]  # global ids: rank r owns [8r, 8r + 8)
    kv.free(b)
    c.prompt_token_ids = list(range(1, 20))
    assert kv.allocate(c, 19) == [] and kv.rank(c) == 1 and min(c.block_ids) >= 8
    assert kv.shares_pool(c, c) and not kv.shares_pool(a, c)
    assert kv.num_free_blocks == 16 - 3 - 5 and kv.pool.num_blocks == 16


def test_step_rows_are_padded_per_rank(tiny):
    llm = LLM(str(tiny), parallel={"mesh": "2x4", "dp": 2, "tp": 4}, **{**ARGS, "token_buckets": [4, 16, 64]})
    runner, kv = llm.engine.runner, llm.engine.kv
    reqs = [Request(f"r{i}", list(range(1, n + 1)), GREEDY) for i, n in enumerate([9, 3, 2])]
    for r in reqs:
        kv.allocate(r, r.num_tokens)
    assert [kv.rank(r) for r in reqs] == [0, 1, 1]  # 2 blocks went to rank 0, so rank 1 has more room
    inputs = runner.prepare(SchedulerOutput([ScheduledRequest(r, r.num_tokens, 0) for r in reqs]))
    assert inputs.tokens.shape == (2, 16)  # one bucket for both ranks, from the larger rank's 9 tokens
    np.testing.assert_array_equal(inputs.tokens[:, :9], [list(range(1, 10)), [1, 2, 3, 1, 2, 0, 0, 0, 0]])
    np.testing.assert_array_equal(inputs.num_seqs[:, 0], [1, 2])
    np.testing.assert_array_equal(inputs.cu_q_lens[:, :3], [[0, 9, 9], [0, 3, 5]])
    assert (inputs.page_indices[1, :2, 0] < runner.blocks_per_rank).all()  # rank-local page ids
    assert inputs.logits_indices[:3].tolist() == [8, 16 + 2, 16 + 4]  # scheduler order, flattened [dp * n]
