"""Replicas that span hosts: the leader's engine calls replayed on follower engines.

- In one process: a follower core fed the leader's recorded calls ends in the same state and produces
  the same outputs (the determinism a multi-host replica relies on).
- On a real local Ray: a colocated app whose one decode replica covers 2 "hosts" (2 Ray actors x 4
  virtual CPU devices, one `jax.distributed` cluster over loopback, expert parallel across both) serves
  the same greedy tokens as a single-process engine.
"""

from __future__ import annotations

import pytest
from cluster_harness import cluster_config, http_json, served_app

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
    "compilation_cache_dir": None,
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


@pytest.fixture(scope="module")
def multihost_app(model_dir, ray_serve):
    cfg = cluster_config(
        model_dir,
        name="multihost",
        mode="colocated",
        engine={**ENGINE, "parallel": {"mesh": "2x4", "moe": {"dispatch": "hierarchical"}}},
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
def test_a_replica_over_two_hosts_equals_a_single_process(multihost_app, model_dir):
    from ray import serve

    # One engine over two processes: the replica (leader) and its follower actor, 4 devices each.
    hb = serve.get_deployment_handle("DecodeServer", "multihost").heartbeat.remote().result(timeout_s=60)
    assert hb.num_processes == 2
    llm = LLM(str(model_dir), warmup=False, **ENGINE)
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for prompt, want in zip(PROMPTS, expected):
        status, body = http_json(
            multihost_app + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        )
        assert status == 200, body
        assert body["choices"][0]["text"] == want.text
    status, health = http_json(multihost_app + "/health", key=None)
    assert status == 200 and health["decode_workers"] == 1
