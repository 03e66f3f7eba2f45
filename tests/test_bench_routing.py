"""`moray bench routing`: the workloads and the oracle on their own, and a small end-to-end run on a real
local Ray (2 decode workers, round-robin vs kv-aware, and the peer: sglang-router in front of two
single-worker `moray serve` processes) that writes the comparison as JSON."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from report_harness import check_report

from bench.routing import TextSegments, make_workload, median_of, oracle, replay_order

ROOT = Path(__file__).resolve().parent.parent


def ids_of(seed: int = 0, block_size: int = 8):
    """Token-id segments of k blocks (the workloads also take text, see TextSegments)."""
    rng = random.Random(seed)
    return lambda k: [rng.randrange(3, 500) for _ in range(k * block_size)]


def test_workloads_are_sized_in_blocks_and_conversations_grow():
    shared = make_workload("shared-prefix", 24, 0, ids_of(), 8)
    assert len(shared) == 24 and all(len(g) == 1 and len(g[0].prompt) == 14 * 8 for g in shared)
    assert len({tuple(g[0].prompt[:96]) for g in shared}) == 4  # 24 / 6 system prompts
    turns = make_workload("multi-turn", 24, 0, ids_of(), 8)
    assert len(turns) == 6 and all(len(g) == 4 for g in turns)
    for g in turns:
        assert len({i.session for i in g}) == 1
        for a, b in zip(g, g[1:]):
            assert b.prompt[: len(a.prompt)] == a.prompt  # each turn extends the previous one
    order = replay_order(turns, 4)
    assert [i.session for i in order[:4]] == [g[0].session for g in turns[:4]]  # 4 clients, turn by turn


def test_the_oracle_reaches_every_reusable_block_when_nothing_is_evicted():
    turns = make_workload("multi-turn", 16, 0, ids_of(), 8)
    # Every later turn can reuse the previous turn's prompt: (6 + 9 + 12) blocks of (6 + 9 + 12 + 15).
    best = (6 + 9 + 12) / (6 + 9 + 12 + 15)
    assert abs(oracle(turns, 4, 1000, 8, 4)["hit_rate"] - best) < 1e-9
    shared = make_workload("shared-prefix", 48, 0, ids_of(), 8)
    roomy, tight = oracle(shared, 4, 1000, 8, 8), oracle(shared, 4, 20, 8, 8)
    assert tight["hit_rate"] < roomy["hit_rate"] <= 1.0  # small pools evict


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from workers.models.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("routing") / "tiny", "qwen3_moe", "tiny", seed=0))


def test_text_workloads_share_prefixes_in_tokens_as_in_text(tiny_model):
    """Text prompts (what a text-only peer router sees) tokenise so that a conversation's next turn
    extends the previous turn's tokens and a shared system prompt is a shared token prefix."""
    seg = TextSegments(tiny_model, random.Random(0), 16)
    chat = make_workload("chat", 40, 0, seg, 16)
    assert len(chat) == 8 and all(len(g) == 5 for g in chat)  # 40 / 5 conversations of 5 turns
    for g in chat:
        assert all(isinstance(i.prompt, str) for i in g)
        for a, b in zip(g, g[1:]):
            assert b.prompt.startswith(a.prompt)
            ta, tb = seg.ids(a.prompt), seg.ids(b.prompt)
            assert tb[: len(ta)] == ta and len(tb) >= len(ta) + 3 * 16  # + a 2-block message and a 1-block reply
    systems = {g[0].prompt[: g[0].prompt.index("\n", 1)] for g in chat}
    assert len(systems) == 4  # 4 shared system prompts
    first_blocks = {tuple(seg.ids(g[0].prompt)[: 8 * 16]) for g in chat}
    assert len(first_blocks) == 4  # ... whose 8 blocks are shared in tokens too
    # The oracle reads the same token ids the servers make.
    assert 0.5 < oracle(chat, 4, 320, 16, 8, seg.ids)["hit_rate"] < 1.0


def test_hybrid_bench_workloads_share_what_issue_28_asks(tiny_model):
    """`bench routing --hybrid`'s chat traffic, rendered by the model's template: 4 system prompts with
    tools of 512-1,024 tokens before user messages of 32-128; agents fork after a tool result that no
    earlier prompt of theirs ended at; the oracle reaches most of it."""
    from bench import hybrid_reuse
    from workers.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model)
    seg = TextSegments(tiny_model, random.Random(0), 16)
    ids = hybrid_reuse.chat_ids(tok)

    def rendered(messages, tools):
        return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False, tools=tools), add_special_tokens=False))

    w = hybrid_reuse.make_workloads(36, 0, seg, rendered)
    systems = {}
    for (item,) in w["system-tools"]:
        system, user = item.messages
        systems[system["content"]] = rendered([system], item.tools)
        assert 32 <= len(tok.encode(user["content"], add_special_tokens=False)) <= 8 * 16 + 8
    assert len(systems) == 4 and all(512 <= n <= 1024 + 64 for n in systems.values())
    for agent in w["branching"]:
        task, *branches = [ids(i) for i in agent[:5]]
        fork = min(len(b) for b in branches)
        shared = next(k for k in range(fork) if any(b[k] != branches[0][k] for b in branches))
        assert len(task) < shared - 16 * 16  # the fork is past the task prompt's end, by the tool result
    for name, groups in w.items():
        rate = oracle(hybrid_reuse._with_ids(groups, ids), 4, 1024, 16, 8)["hit_rate"]
        assert 0.5 < rate < 1.0, (name, rate)


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


@pytest.mark.cluster
@pytest.mark.slow
def test_bench_routing_end_to_end(tmp_path):
    """The bench as a user runs it, in a process of its own (it starts its own local Ray)."""
    out = tmp_path / "routing.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "bench",
            "routing",
            "--workers",
            "2",
            "--kv-blocks",
            "48",
            "--requests",
            "16",
            "--concurrency",
            "4",
            "--policies",
            "round-robin",
            "kv-aware",
            "--think-time-ms",
            "100",
            # The router forgets a workload's sessions between workloads within 3x this (default 1 s here).
            "--session-idle-s",
            "0.3",
            "--repeats",
            "1",
            "--peer",
            "sglang-router",
            "--json",
            str(out),
            "--report",
            str(tmp_path / "report"),
        ],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert out.read_text().strip() in proc.stdout  # printed too (Ray may add its own lines)
    # Every worker (Moray's and the peer's) compiled its step programs before serving: TTFTs measure no compiler.
    assert result["engine"]["background_compile"] is False and result["engine"]["max_num_seqs"] == 4
    sizes = {"shared-prefix": 16, "multi-turn": 16, "chat": 15}  # chat: 16 // 5 conversations of 5 turns
    for policy in ("round-robin", "kv-aware", "sglang-router"):
        for workload, n in sizes.items():
            r = result["policies"][policy][workload]
            assert r["requests"] == n and 0.0 <= r["hit_rate"] <= 1.0
            assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and r["max_over_mean_load"] >= 1.0
            assert r["hit_rate_vs_oracle"] == r["hit_rate"] / result["oracle"][workload]["hit_rate"]
            # The peer's load split is what its two servers counted; Moray's is its router's.
            assert abs(sum(r["prompt_tokens_per_worker"].values()) - r["prompt_tokens"]) <= 0.01 * r["prompt_tokens"]
            if policy != "sglang-router":
                assert sum(r["decisions_by_branch"].values()) == n  # every request decided once, by some branch
    assert len(result["policies"]["sglang-router"]["chat"]["prompt_tokens_per_worker"]) == 2
    # Where kv-aware's hits went: the router's own account per decision, best >= chosen, reused measured.
    for workload, loss in result["kv_aware_losses"].items():
        kv_tokens = result["policies"]["kv-aware"][workload]["decision_tokens"]
        assert kv_tokens["best"] >= kv_tokens["chosen"] >= 0 and kv_tokens["reused"] > 0
        assert abs(loss["reused"] - result["policies"]["kv-aware"][workload]["hit_rate"]) < 1e-9
    kv, rr = result["policies"]["kv-aware"], result["policies"]["round-robin"]
    assert kv["shared-prefix"]["hit_rate"] > rr["shared-prefix"]["hit_rate"]
    assert set(rr["shared-prefix"]["decisions_by_branch"]) == {"round-robin"}
    assert kv["shared-prefix"]["decisions_by_branch"].get("cache-hit", 0) > 0
    assert set(result["verdict"]) == {"shared-prefix", "multi-turn", "chat"}
    assert {"hit_rate_vs_peer", "ttft_p99_vs_round_robin"} <= set(result["verdict"]["chat"])
    plots = check_report(tmp_path / "report", min_plots=2)
    assert {"hit_rate.png", "load_per_worker.png"} <= set(plots)
    assert "policies.kv-aware.shared-prefix.hit_rate" in (tmp_path / "report" / "index.html").read_text()
