"""`moray bench routing`: the workloads and the oracle on their own, and a small end-to-end run on a real
local Ray (2 decode workers, round-robin vs kv-aware) that writes the comparison as JSON."""

from __future__ import annotations

import json

from bench.routing import make_workload, median_of, oracle, replay_order
from cluster.cli import main as moray_main


def test_workloads_are_sized_in_blocks_and_conversations_grow():
    shared = make_workload("shared-prefix", 24, 0, 500, 8)
    assert len(shared) == 24 and all(len(g) == 1 and len(g[0].prompt) == 14 * 8 for g in shared)
    assert len({tuple(g[0].prompt[:96]) for g in shared}) == 4  # 24 / 6 system prompts
    turns = make_workload("multi-turn", 24, 0, 500, 8)
    assert len(turns) == 6 and all(len(g) == 4 for g in turns)
    for g in turns:
        assert len({i.session for i in g}) == 1
        for a, b in zip(g, g[1:]):
            assert b.prompt[: len(a.prompt)] == a.prompt  # each turn extends the previous one
    order = replay_order(turns, 4)
    assert [i.session for i in order[:4]] == [g[0].session for g in turns[:4]]  # 4 clients, turn by turn


def test_the_oracle_reaches_every_reusable_block_when_nothing_is_evicted():
    turns = make_workload("multi-turn", 16, 0, 500, 8)
    # Every later turn can reuse the previous turn's prompt: (6 + 9 + 12) blocks of (6 + 9 + 12 + 15).
    best = (6 + 9 + 12) / (6 + 9 + 12 + 15)
    assert abs(oracle(turns, 4, 1000, 8, 4)["hit_rate"] - best) < 1e-9
    shared = make_workload("shared-prefix", 48, 0, 500, 8)
    roomy, tight = oracle(shared, 4, 1000, 8, 8), oracle(shared, 4, 20, 8, 8)
    assert tight["hit_rate"] < roomy["hit_rate"] <= 1.0  # small pools evict


def test_repeated_runs_report_medians_with_the_same_fields_as_one_run():
    runs = [
        dict(
            requests=8,
            hit_rate=h,
            ttft_p50_s=0.1,
            ttft_p99_s=0.2,
            max_over_mean_load=l,
            wall_s=1.0,
            prompt_tokens_per_worker={"a": 1.0},
            decisions_by_branch={"cache-hit": 8},
        )
        for h, l in ((0.5, 1.2), (0.7, 1.0), (0.6, 1.1))
    ]
    m = median_of(runs)
    assert (m["hit_rate"], m["max_over_mean_load"]) == (0.6, 1.1)
    assert set(runs[0]) <= set(m) and len(m["runs"]) == 3


def test_bench_routing_end_to_end(tmp_path, capsys):
    out = tmp_path / "routing.json"
    rc = moray_main(
        [
            "bench",
            "routing",
            "--workers",
            "2",
            "--kv-blocks",
            "48",
            "--requests",
            "24",
            "--concurrency",
            "4",
            "--policies",
            "round-robin",
            "kv-aware",
            "--think-time-ms",
            "100",
            "--repeats",
            "1",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert out.read_text().strip() in capsys.readouterr().out  # printed too (Ray may add its own lines)
    for policy in ("round-robin", "kv-aware"):
        for workload in ("shared-prefix", "multi-turn"):
            r = result["policies"][policy][workload]
            assert r["requests"] == 24 and 0.0 <= r["hit_rate"] <= 1.0
            assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and r["max_over_mean_load"] >= 1.0
            assert sum(r["prompt_tokens_per_worker"].values()) > 0
            assert sum(r["decisions_by_branch"].values()) == 24  # every request decided once, by some branch
    kv, rr = result["policies"]["kv-aware"], result["policies"]["round-robin"]
    assert kv["shared-prefix"]["hit_rate"] > rr["shared-prefix"]["hit_rate"]
    assert set(rr["shared-prefix"]["decisions_by_branch"]) == {"round-robin"}
    assert kv["shared-prefix"]["decisions_by_branch"].get("cache-hit", 0) > 0
    assert set(result["verdict"]) == {"shared-prefix", "multi-turn"}
