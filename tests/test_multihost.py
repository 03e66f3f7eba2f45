"""Replicas that span hosts: the leader's engine calls replayed on follower engines.

- In one process: a follower core fed the leader's recorded calls ends in the same state and produces
  the same outputs (the determinism a multi-host replica relies on).
- On a real local Ray: a colocated app whose one decode replica covers 2 "hosts" (2 Ray actors x 4
  virtual CPU devices, one `jax.distributed` cluster over loopback, expert parallel across both) serves
  the same greedy tokens as a single-process engine.
"""

from __future__ import annotations

import time

import pytest
from cluster_harness import XLA_CACHE, cluster_config, http_json, served_app, wait_until

from workers.engine import LLM, EngineConfig, EngineCore, SamplingParams
from workers.models.make_model import make_model
from workers.multihost import EngineFollower, ReplicatedCore

ENGINE = {
    "block_size": 8,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "max_model_len": 128,
    "token_buckets": [8, 32],
    "page_buckets": [4, 16],
    "compilation_cache_dir": XLA_CACHE,
}
PROMPTS = [[3, 17, 42, 5, 88, 61, 9, 23, 70, 11, 4, 4, 90], [8, 2, 77, 45], [5, 5, 5, 60, 21, 33, 94, 100, 7]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("multihost") / "tiny", "qwen3_moe", "tiny", seed=5)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("multihost-hybrid") / "tiny", "qwen3_5_moe", "tiny", seed=5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_a_follower_replaying_the_leaders_calls_stays_identical(request, arch):
    """Also for a hybrid model: its state slots and snapshots follow the same calls deterministically."""
    model_dir = request.getfixturevalue("model_dir" if arch == "qwen3_moe" else "hybrid_dir")
    cfg = EngineConfig(model=str(model_dir), worker_id="lead", seed=3, warmup=False, **ENGINE)
    follower = EngineFollower(cfg.model_copy(update={"worker_id": "follow"}))
    sent = []
    leader = ReplicatedCore(EngineCore(cfg, show_progress=False), sent.append)
    sampled = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)  # unseeded: step seeds must agree
    for i, p in enumerate(PROMPTS):
        leader.add_request(f"r{i}", p, sampled)
    leader.step()
    leader.abort("r1")
    outs = []
    while leader.has_unfinished():
        outs += leader.step()
    assert {name for name, _, _ in sent} == {"add_request", "step", "abort"}
    follower.apply(sent)
    assert follower.ops == len(sent)
    assert follower.core.kv.num_free_blocks == leader.kv.num_free_blocks
    if arch == "qwen3_5_moe":
        assert follower.core.kv.slots.snapshots == leader.kv.slots.snapshots and leader.kv.num_snapshots > 0
    # The follower's own outputs for the same calls: replay them one by one and compare the finals.
    replay = EngineFollower(cfg.model_copy(update={"worker_id": "again"}))
    finals: dict[str, list[int]] = {}
    for name, args, kwargs in sent:
        out = getattr(replay.core, name)(*args, **kwargs)
        for o in out or []:
            finals.setdefault(o.request_id, []).extend(o.token_ids)
    leader_tokens: dict[str, list[int]] = {}
    for o in outs:
        leader_tokens.setdefault(o.request_id, []).extend(o.token_ids)
    assert finals == leader_tokens and any(finals.values())
    with pytest.raises(ValueError, match="not a replicated engine call"):
        follower.apply([("warmup", (), {})])


def test_a_follower_runs_the_leaders_calls_in_the_order_sent_whatever_order_they_arrive_in(model_dir):
    """Ray does not promise to run calls to an actor with concurrency groups (the follower's) in the order they
    were sent. A follower that ran a step before the request it should hold would compute another program
    than the leader's, and the hosts' collectives would wait on each other forever."""
    import random

    cfg = EngineConfig(model=str(model_dir), worker_id="lead", seed=3, warmup=False, **ENGINE)
    sent = []
    leader = ReplicatedCore(EngineCore(cfg, show_progress=False), sent.append)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    leader.add_request("r0", PROMPTS[0], greedy)
    leader.step()
    leader.add_request("r1", PROMPTS[1], greedy)
    while leader.has_unfinished():
        leader.step()
    follower = EngineFollower(cfg.model_copy(update={"worker_id": "follow"}))
    order = list(range(len(sent)))
    random.Random(0).shuffle(order)
    assert order[0] != 0
    ran = [follower.apply([sent[i]], i) for i in order]
    assert ran[0] == 0 and ran[-1] == len(sent)  # the first to arrive waited for the ones before it
    # The same state: every request done, the same blocks cached, announced by the same events.
    assert not follower.core.has_unfinished() and not follower.core.scheduler.requests
    assert follower.core.kv.num_free_blocks == leader.kv.num_free_blocks
    assert (follower.core.events.last_seq, follower.core._step_counter) == (leader.events.last_seq, leader._step_counter)
    with pytest.raises(ValueError, match="arrived twice"):
        follower.apply([sent[0]], 0)


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "gemma4"])
def test_a_multi_host_exports_copy_is_the_gather_in_one_collective(tmp_path, arch):
    """The copy a multi-host prefill engine exports from (`_gather_over_ranks`), built here on 8 devices of one
    process as it is for 2 x 4: equal to the plain gather of the blocks, split by blocks over the first mesh
    axis, one collective. XLA's partitioning of the plain gather made one all-gather of block ids per cache
    group's layer (Gemma 4: 4 of the same size, in flight together): over gloo, hosts that match each
    other's messages (`hlo_collectives`)."""
    import jax
    import numpy as np
    from hlo_collectives import count_collectives, unordered_collectives
    from jax.sharding import NamedSharding, PartitionSpec

    from kernels import block_copy
    from workers.engine.runner import _gather_over_ranks, _row_axes

    model_dir = make_model(tmp_path / "m", arch, "tiny", seed=5)
    llm = LLM(str(model_dir), parallel={"mesh": "2x4"}, num_kv_blocks=64, **{**EXPORT_ENGINE, "compilation_cache_dir": None})
    runner = llm.engine.runner
    rng = np.random.default_rng(0)
    runner.kv_pages = [jax.device_put(rng.standard_normal(p.shape).astype(p.dtype), p.sharding) for p in runner.kv_pages]
    mesh = runner.model.mesh
    axes = _row_axes(runner.kv_pages)
    assert axes  # blocks split over the data-parallel ranks, or there is nothing to gather across devices
    blocks = [3, 60, 17, 41, 9]  # on several ranks
    ids = runner._layer_ids(blocks, [5, 33, -1, 2, 50] if runner.window_layers else None, 0, 0)
    assert isinstance(ids, list) == (arch == "gemma4")
    split = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
    copy = _gather_over_ranks(mesh, axes, split)
    got = copy(runner.kv_pages, ids, runner.transport_width)
    want = block_copy.gather_blocks_first_jit(runner.kv_pages, ids, width=runner.transport_width)
    assert got.sharding.is_equivalent_to(split, got.ndim)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    hlo = copy.lower(runner.kv_pages, ids, runner.transport_width).compile().as_text()
    assert count_collectives(hlo) == 1 and not unordered_collectives(hlo)


@pytest.fixture(scope="module")
def multihost_app(model_dir, ray_serve):
    cfg = cluster_config(
        model_dir,
        name="multihost",
        mode="colocated",
        # Expert load balancing on: a placement every 4 steps, swapped in on both hosts at the same step.
        # No warmup: a multi-host engine would compile every step program (4 buckets x the sampler's variants)
        # in both processes before serving; the test's requests compile the few they use.
        engine={
            **ENGINE,
            "warmup": False,
            "parallel": {"mesh": "2x4", "moe": {"dispatch": "hierarchical"}},
            "eplb": {"num_redundant_experts": 8, "period_steps": 4},
        },
        decode={
            "resources": {"cpus": 1},
            "hosts_per_replica": 2,
            "placement_strategy": "PACK",
            "env": {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"},
        },
    )
    with served_app(ray_serve, cfg) as app:
        yield app.base


@pytest.mark.cluster
def test_a_followers_liveness_probe_does_not_wait_behind_its_steps(model_dir, ray_serve):
    """Serve's health check of a multi-host replica asks each follower; a follower busy with a long step
    (a compile takes seconds on a loaded machine) must still answer, or Serve replaces a healthy replica
    (seen: a prefill replica restarted mid-test)."""
    import ray

    from cluster.multihost import EngineFollowerActor, FollowerChannel

    cfg = EngineConfig(model=str(model_dir), worker_id="follow", seed=3, warmup=False, **ENGINE)
    actor = EngineFollowerActor.remote(cfg)
    channel = FollowerChannel([actor])
    channel.check(timeout_s=300)  # built
    ops = [("add_request", ("r", PROMPTS[0] * 6, SamplingParams(max_tokens=60, ignore_eos=True)), {})] + [("step", (), {})] * 80
    busy = actor.apply.remote(ops, 0)  # compiles its step programs, then steps
    try:
        time.sleep(1.0)  # compiling or stepping by now
        assert not ray.wait([busy], timeout=0)[0], "the batch of steps ended before the probe: make it longer"
        channel.check(timeout_s=1.0)  # answered while the steps run
        assert not ray.wait([busy], timeout=0)[0]
        assert ray.get(busy, timeout=300) == len(ops)
    finally:
        ray.kill(actor)


@pytest.mark.cluster
def test_a_replica_over_two_hosts_equals_a_single_process(multihost_app, model_dir):
    """Also while its experts are re-placed every few steps (and once on request): both hosts swap each
    placement in at the same step, or their collectives would stop meeting."""
    from ray import serve

    # One engine over two processes: the replica (leader) and its follower actor, 4 devices each.
    decode = serve.get_deployment_handle("DecodeServer", "multihost")
    hb = decode.heartbeat.remote().result(timeout_s=60)
    assert hb.num_processes == 2
    llm = LLM(str(model_dir), warmup=False, **ENGINE)
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for prompt, want in zip(PROMPTS, expected):
        status, body = http_json(
            multihost_app + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        )
        assert status == 200, body
        assert body["choices"][0]["text"] == want.text
    status, out = http_json(multihost_app + "/admin/rebalance_experts", {"wait": True})  # the operator's trigger
    assert status == 200 and list(out["workers"].values()) == [True], out
    status, body = http_json(
        multihost_app + "/v1/completions", {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    )
    assert status == 200 and body["choices"][0]["text"] == expected[0].text, body
    rebalances = wait_until(
        lambda: decode.heartbeat.remote().result(timeout_s=60).engine.expert_rebalances, 30, what="a rebalance reported"
    )
    assert rebalances >= 3  # ~30 steps: a request every 4 to 8 (a placement goes in 4 steps after its request)
    status, health = http_json(multihost_app + "/health", key=None)
    assert status == 200 and health["decode_workers"] == 1


# ------------------------------------------------------------------ a multi-host prefill replica's export

# Prompts whose padded copies split over the prefill replica's 2 hosts with blocks on both: 4 blocks (page
# bucket 4: 2 per host) and 7 blocks (bucket 8: 4 on the first host, 3 on the second). Small buckets and
# short prompts: each engine compiles few step programs.
EXPORT_ENGINE = {**ENGINE, "max_model_len": 64, "page_buckets": [4, 8], "warmup": False}
EXPORT_PROMPTS = [[(7 * i + k) % 97 + 3 for i in range(n)] for k, n in enumerate([30, 50])]


# One model of each cache layout: hybrid (paged KV + Gated DeltaNet state), attention-only (Gemma 4: full and
# sliding-window layers; a plain attention model such as qwen3_moe would add ~45 s for no other code path),
# and MLA (DeepSeek-V3's latent pages; ~2 min on 2 cores).
@pytest.fixture(scope="module", params=["qwen3_5_moe", "gemma4", "deepseek_v3"])
def multihost_prefill_app(request, tmp_path_factory, ray_serve):
    """A disaggregated app whose prefill replica is one engine over 2 processes x 4 devices (mesh 2x4)
    and whose decode replica another layout: 1 process, 4 devices (2x2), tp 2. Gemma 4 (16-token window):
    both sides keep the sliding layers in a cache group of their own, the 50-token prompt's first blocks let
    go of on the prefill side before it is exported."""
    arch = request.param
    model_dir = make_model(tmp_path_factory.mktemp(f"mh-export-{arch}") / "tiny", arch, "tiny", seed=5)
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"}
    cfg = cluster_config(
        model_dir,
        name=f"mhexport-{arch.replace('_', '')}",
        # No warmup: a multi-host engine would compile every step program before serving.
        engine=EXPORT_ENGINE,
        prefill={
            "resources": {"cpus": 1},
            "hosts_per_replica": 2,
            "placement_strategy": "PACK",
            "env": env,
            "engine_overrides": {"parallel": {"mesh": "2x4"}},
        },
        decode={"resources": {"cpus": 1}, "env": env, "engine_overrides": {"parallel": {"mesh": "2x2", "tp": 2}}},
    )
    with served_app(ray_serve, cfg) as app:
        yield arch, model_dir, app


def _num_kv_layers(model_dir) -> int:
    from workers.models import load_model

    return load_model(model_dir, load_format="dummy", show_progress=False).cfg.num_kv_layers


def _layer_blocks_sent(model_dir, prompt_len: int) -> int:
    """(block, cache layer) pairs a handoff of a prompt sends, prefilled in chunks of the step budget."""
    from workers.engine.runner import window_layers
    from workers.models import load_model

    cfg = load_model(model_dir, load_format="dummy", show_progress=False).cfg
    blocks, sliding = -(-prompt_len // ENGINE["block_size"]), window_layers(cfg)
    if not sliding:
        return blocks * cfg.num_kv_layers
    window = cfg.sliding_windows[cfg.kv_layer_ids[sliding[0]]]
    last_chunk = (prompt_len - 1) // EXPORT_ENGINE["max_num_batched_tokens"] * EXPORT_ENGINE["max_num_batched_tokens"]
    let_go = max(0, last_chunk - window + 1) // ENGINE["block_size"]
    return blocks * cfg.num_kv_layers - let_go * len(sliding)


@pytest.mark.cluster
def test_a_prefill_replica_over_two_hosts_hands_off_to_another_layout(multihost_prefill_app):
    """Each host exports the blocks it holds, the decode replica writes them into its own layout: greedy
    tokens equal a single-process run, every request's whole KV moved, none prefilled again locally."""
    from ray import serve

    arch, model_dir, app = multihost_prefill_app
    prefill = serve.get_deployment_handle("PrefillServer", app.name)
    decode = serve.get_deployment_handle("DecodeServer", app.name)
    assert prefill.heartbeat.remote().result(timeout_s=60).num_processes == 2
    llm = LLM(str(model_dir), **EXPORT_ENGINE)
    expected = llm.generate(EXPORT_PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    before = decode.heartbeat.remote().result(timeout_s=60)
    for prompt, want in zip(EXPORT_PROMPTS, expected):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        # Without warmup, the first requests compile both replicas' step programs (the prefill one over two
        # processes): on a slow 2-core machine with the other xdist worker busy that took more than 120 s.
        status, out = http_json(app.base + "/v1/completions", body, timeout=420)
        assert status == 200, out
        assert out["choices"][0]["text"] == want.text, arch
    after = decode.heartbeat.remote().result(timeout_s=60)
    moved = after.handoff.bytes - before.handoff.bytes - (after.handoff.state_bytes - before.handoff.state_bytes)
    assert after.handoff.handoffs - before.handoff.handoffs == len(EXPORT_PROMPTS)
    assert after.handoff.import_failures == before.handoff.import_failures  # no local re-prefill
    block = ENGINE["block_size"]
    # Every block from both hosts; with a sliding-window group, not the sliding layers of the blocks the
    # prefill side let go of before its last chunk (out of the window of every query after it).
    layer_blocks = sum(_layer_blocks_sent(model_dir, len(p)) for p in EXPORT_PROMPTS)
    assert moved == layer_blocks * block * after.engine.kv_bytes_per_token // _num_kv_layers(model_dir)
    if arch == "qwen3_5_moe":
        assert after.handoff.state_bytes > before.handoff.state_bytes
    exports = prefill.heartbeat.remote().result(timeout_s=60).handoff
    assert exports.exports >= len(EXPORT_PROMPTS) and exports.export_bytes >= moved
