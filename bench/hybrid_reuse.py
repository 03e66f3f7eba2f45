"""`moray bench routing --hybrid`: prefix reuse of a hybrid model against an attention-only one (issue #28).

Three engines serve the same chat traffic, one after the other, on a local colocated app with `--workers`
decode workers behind the kv-aware router (same engine settings for all):

- attention: a qwen3_moe (attention only) with the hybrid's dimensions (vocabulary, width, layers, heads,
  experts);
- hybrid: a qwen3_5_moe (Gated DeltaNet + attention) at `--preset` (tiny by default), keeping states where
  prompts are shared (branch points, the chat path's message boundaries);
- hybrid-step-ends: the same hybrid keeping states only at each step's last boundary (the rule before).

Workloads (chat requests, tools rendered by the model's chat template):

- system-tools: 4 system prompts of 512-1,024 tokens with their tools, each followed by many different user
  messages of 32-128 tokens, in random order;
- branching: agents' conversations (system prompt and tools, a task, a reply, then a long tool result) forked
  after the tool result into 4 continuations the agent explores one after another, two turns each (the fork
  is where no earlier prompt ended: only a branch point or the chat path's hint keeps a state there);
- multi-turn: conversations of 4 turns over a short system prompt (the reuse that worked before).

`engine_only`: the system-tools and multi-turn requests through each engine in-process, one at a time, with
the chat path's hints: TTFT and engine steps without the server (on a small CPU machine the served TTFT is
mostly the front end's and the other workers' time).
Reported per engine and workload: prefix hit rate (the engines' cached tokens / prompt tokens) and against
the oracle (`bench.routing.oracle`: routing that sees every cache exactly, on attention-only caches of the
same size), TTFT p50/p99 (streamed), and the state bytes the workers held at the end (metrics). Targets:
the hybrid's hit rate >= 0.9 of the attention-only model's, its TTFT p50 >= 2x better than step-ends on
the shared-prefix workloads, and multi-turn reuse no worse than step-ends'.

    moray bench routing --hybrid --workers 4 --json hybrid.json --report
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
import urllib.request

from bench import scratch_dir
from bench.serve import Item

WORKLOADS = ("system-tools", "branching", "multi-turn")
ENGINES = {
    "attention": ("qwen3_moe", {}),
    "hybrid": ("qwen3_5_moe", {}),
    "hybrid-step-ends": ("qwen3_5_moe", {"state_keep_points": "step-ends"}),
}
TARGETS = {"hit_rate_vs_attention": 0.9, "ttft_p50_speedup_vs_step_ends": 2.0, "multi_turn_hit_rate_vs_step_ends": 1.0}


# ---------------------------------------------------------------- workloads


def _tools(seg, rng: random.Random, n: int = 3) -> list[dict]:
    """n function tools with random names, descriptions and two parameters each (as an agent framework sends)."""
    out = []
    for i in range(n):
        name = f"tool_{rng.randrange(10**6)}_{i}"
        params = {f"arg{j}": {"type": "string", "description": seg(1).strip()} for j in range(2)}
        out.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": seg(2).strip(),
                    "parameters": {"type": "object", "properties": params, "required": list(params)},
                },
            }
        )
    return out


def make_workloads(n: int, seed: int, seg, render_len) -> dict[str, list[list[Item]]]:
    """Each workload's groups (a group's items run in order). `seg(k)` makes k blocks of text;
    `render_len(messages, tools)` counts the rendered prompt's tokens (to size the system prompts)."""
    rng = random.Random(f"hybrid-{seed}")
    out: dict[str, list[list[Item]]] = {}

    def system_prompt(lo: int, hi: int):
        """A system message and tools rendering to lo..hi tokens."""
        tools = _tools(seg, rng)
        target = rng.randint(lo, hi)
        text = seg(2)
        while render_len([{"role": "system", "content": text + seg(2)}], tools) < target:
            text += seg(2)
        return {"role": "system", "content": text.strip()}, tools

    def user(lo_blocks: int = 2, hi_blocks: int = 8) -> dict:
        return {"role": "user", "content": seg(rng.randint(lo_blocks, hi_blocks)).strip()}

    def reply() -> dict:  # a stand-in for the assistant's reply (a random model's own is not worth feeding back)
        return {"role": "assistant", "content": seg(rng.randint(1, 2)).strip()}

    systems = [system_prompt(512, 1024) for _ in range(4)]
    items = []
    for i in range(n):
        system, tools = systems[i % 4]
        items.append([Item("", 4, messages=[system, user()], tools=tools)])
    rng.shuffle(items)
    out["system-tools"] = items

    groups = []
    for a in range(max(1, n // 9)):  # 9 requests per agent: the task, 4 branches, a second turn on each
        system, tools = system_prompt(256, 512)
        task = [system, user()]
        # The agent's reply and a long tool result (a document, a search's output) that the agent then
        # explores in 4 directions: the fork is after the tool result, which no earlier prompt ended at.
        trunk = task + [reply(), {"role": "user", "content": seg(rng.randint(16, 32)).strip()}]
        branches = [trunk + [user()] for _ in range(4)]
        turns = [task] + [b[:] for b in branches]
        for b in branches:
            b += [reply(), user(2, 4)]
        turns += [b[:] for b in branches]
        groups.append([Item("", 4, session=f"agent{a}", turn=t, messages=m, tools=tools) for t, m in enumerate(turns)])
    out["branching"] = groups

    groups = []
    for c in range(max(1, n // 4)):
        history = [{"role": "system", "content": seg(8).strip()}]
        turns = []
        for _ in range(4):
            history += [user(2, 4)]
            turns.append(history[:])
            history += [reply()]
        groups.append([Item("", 4, session=f"conv{c}", turn=t, messages=m) for t, m in enumerate(turns)])
    out["multi-turn"] = groups
    return out


def chat_ids(tokenizer):
    """The prompt's token ids as the server renders and tokenises a chat request."""

    def ids(item: Item) -> list[int]:
        text = tokenizer.apply_chat_template(item.messages, add_generation_prompt=True, tools=item.tools)
        return tokenizer.encode(text, add_special_tokens=False)

    return ids


# ---------------------------------------------------------------- runs


def engine_settings(model: str, args, overrides: dict) -> dict:
    return {
        "model": model,
        "block_size": args.block_size,
        "num_kv_blocks": args.kv_blocks,
        "max_num_seqs": 4,
        # A whole prompt in one step, as production settings do (8,192 by default): smaller chunks would
        # leave states at their ends, which the old rule reused by chance.
        "max_num_batched_tokens": 2048,
        "max_model_len": args.max_model_len,
        "token_buckets": [16, 64, 256, 1024, 2048],
        "page_buckets": [8, 32, 128],
        "background_compile": False,  # every step program compiled before a worker serves: TTFT without compiles
        # Room for what the traffic shares (4 system prompts; 8 agents' trunks and branches at once);
        # the bytes held are reported. Attention-only engines ignore it.
        "state_snapshots": args.state_snapshots,
        **overrides,
    }


ENGINE_ONLY_WORKLOADS = ("system-tools", "multi-turn")


def chat_hints(item: Item, render_len) -> list[int]:
    """The boundaries the chat path marks (cluster/validation.py `message_boundaries`): the end of the leading
    system messages with the tools, and the conversation before its last message."""
    messages = item.messages
    system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    return sorted({render_len(messages[:k], item.tools) for k in {system, len(messages) - 1} if 0 < k < len(messages)})


def engine_ttft(models: dict, workloads: dict, ids, render_len, args) -> dict:
    """The system-tools and multi-turn requests through one engine in this process, one at a time in their
    groups' order (max_tokens 1, the chat path's hints): time to the first token and prefill steps per
    request without the server around it (on a small CPU machine the served TTFT is mostly the front end's
    and the other workers' time), per engine and workload."""
    import statistics

    from workers.engine import LLM, SamplingParams

    requests = {w: [(ids(i), chat_hints(i, render_len)) for g in workloads[w] for i in g] for w in ENGINE_ONLY_WORKLOADS if w in workloads}
    if not requests:
        return {}
    out: dict = {}
    for name, (arch, overrides) in ENGINES.items():
        settings = {k: v for k, v in engine_settings(models[arch], args, overrides).items() if k != "model"}
        llm = LLM(models[arch], **settings)
        steps = [0]
        step = llm.engine.step

        def counted():
            steps[0] += 1
            return step()

        llm.engine.step = counted
        out[name] = {}
        for workload, prompts in requests.items():
            latencies, cached, taken = [], 0, []
            for prompt, hints in prompts:
                steps[0] = 0
                t0 = time.perf_counter()
                params = SamplingParams(temperature=0.0, max_tokens=1, prefix_boundaries=hints)
                cached += llm.generate([prompt], params)[0].num_cached_tokens
                latencies.append(time.perf_counter() - t0)
                taken.append(steps[0])
            latencies.sort()
            out[name][workload] = {
                "ttft_p50_s": statistics.median(latencies),
                "ttft_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                "hit_rate": cached / sum(len(p) for p, _ in prompts),
                "engine_steps_p50": statistics.median(taken),  # a one-token request: its prefill steps (+ 1 with async scheduling)
            }
            f = out[name][workload]
            print(
                f"[engine {name}] {workload} TTFT p50 {f['ttft_p50_s'] * 1000:.1f} ms, steps p50 {f['engine_steps_p50']}",
                file=sys.stderr,
                flush=True,
            )
        del llm
    if "hybrid" in out and "hybrid-step-ends" in out:
        out["ttft_p50_speedup_vs_step_ends"] = {
            w: out["hybrid-step-ends"][w]["ttft_p50_s"] / out["hybrid"][w]["ttft_p50_s"] for w in requests
        }
    return out


def state_bytes(url: str) -> float:
    """The state bytes every worker's snapshots hold (moray_state_snapshot_bytes, summed)."""
    total = 0.0
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("moray_state_snapshot_bytes{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def run_engine(name: str, model: str, overrides: dict, port: int, args, workloads) -> dict:
    from bench.routing import router_settings, run_app

    cfg = {
        "name": f"hybrid-{name}",
        "mode": "colocated",
        "engine": engine_settings(model, args, overrides),
        "decode": {"replicas": args.workers, "resources": {"cpus": 0.1}},
        "router": {"policy": "kv-aware", "seed": args.seed, **router_settings(args)},
    }
    if args.ingress == "direct":
        from workers.parallel import free_port

        cfg["server"] = {"ingress": "direct", "http_port": free_port(), "grpc_port": free_port()}

    def after(url: str, figures: dict) -> None:
        time.sleep(1.5)  # a heartbeat after the last request: the workers' state gauges are current
        figures["state_bytes"] = state_bytes(url)
        figures.pop("samples", None)

    return run_app(name, cfg, port, args, workloads, after)


def run(args) -> int:
    from bench.report import report_if_asked
    from bench.routing import TextSegments, oracle, start_ray
    from bench.routing import table as routing_table
    from workers.models.make_model import HYBRID_PRESETS, make_model
    from workers.models.tokenizer import Tokenizer

    args.block_size = args.block_size if args.block_size != 8 else 16  # the routing bench's default is for its tiny pools
    args.kv_blocks = args.kv_blocks if args.kv_blocks != 64 else 1024  # 8 agents' conversations at once
    tmp = scratch_dir("moray-bench-hybrid-")
    # The attention-only model takes the hybrid's own dimensions (vocabulary, width, layers, heads, experts),
    # its linear-attention layers full attention instead: the same size, so the same prefill work per token.
    presets = {"qwen3_5_moe": args.preset, "qwen3_moe": HYBRID_PRESETS[args.preset][0]}
    models = {arch: str(make_model(os.path.join(tmp, arch), arch, presets[arch], seed=0)) for arch in presets}
    tokenizers = {arch: Tokenizer.from_dir(m) for arch, m in models.items()}
    ref = tokenizers["qwen3_5_moe"]
    seg = TextSegments(models["qwen3_5_moe"], random.Random(args.seed), args.block_size)

    def render_len(messages, tools):
        return len(ref.encode(ref.apply_chat_template(messages, add_generation_prompt=False, tools=tools), add_special_tokens=False))

    workloads = make_workloads(args.requests, args.seed, seg, render_len)
    workloads = {w: g for w, g in workloads.items() if w in (args.hybrid_workloads or WORKLOADS)}
    ids = {arch: chat_ids(t) for arch, t in tokenizers.items()}
    longest = max(len(ids["qwen3_5_moe"](item)) + item.max_tokens for groups in workloads.values() for g in groups for item in g)
    args.max_model_len = -(-longest // args.block_size) * args.block_size
    if args.max_model_len > args.kv_blocks * args.block_size:
        print(f"moray bench routing --hybrid: a {longest}-token request does not fit in --kv-blocks {args.kv_blocks}", file=sys.stderr)
        return 2
    result: dict = {
        "workers": args.workers,
        "kv_blocks_per_worker": args.kv_blocks,
        "block_size": args.block_size,
        "requests_per_workload": {w: sum(len(g) for g in groups) for w, groups in workloads.items()},
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "targets": TARGETS,
        "prompt_tokens": {w: statistics.median(len(ids["qwen3_5_moe"](i)) for g in groups for i in g) for w, groups in workloads.items()},
        "oracle": {
            w: oracle(_with_ids(g, ids["qwen3_5_moe"]), args.workers, args.kv_blocks, args.block_size, args.concurrency)
            for w, g in workloads.items()
        },
        "engines": {},
    }
    result["engine_only"] = engine_ttft(models, workloads, ids["qwen3_5_moe"], render_len, args)
    port = start_ray()
    try:
        for name, (arch, overrides) in ENGINES.items():
            if name not in (args.engines or ENGINES):
                continue
            runs = [run_engine(name, os.path.abspath(models[arch]), overrides, port, args, workloads) for _ in range(args.repeats)]
            result["engines"][name] = {wl: _median([r[wl] for r in runs]) for wl in workloads}
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    for per in result["engines"].values():
        for wl, f in per.items():
            orc = result["oracle"][wl]["hit_rate"]
            f["hit_rate_vs_oracle"] = f["hit_rate"] / orc if orc else None
    result["verdict"] = verdict(result)
    print(routing_table(result, "engines", ("state MiB", lambda f: f["state_bytes"] / 2**20)), file=sys.stderr)
    import json

    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    report_if_asked(args, "hybrid-reuse", result)
    return 0


def _with_ids(groups: list[list[Item]], ids) -> list[list[Item]]:
    """The groups with each item's prompt as its token ids (what the oracle replays)."""
    return [[Item(ids(i), i.max_tokens, i.session, i.turn) for i in g] for g in groups]


FIELDS = ("hit_rate", "ttft_p50_s", "ttft_p99_s", "state_bytes", "wall_s", "max_over_mean_load")


def _median(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k in FIELDS}
    out["requests"] = runs[0]["requests"]
    out["prompt_tokens"] = runs[0]["prompt_tokens"]
    if len(runs) > 1:
        out["runs"] = [{k: r[k] for k in FIELDS} for r in runs]
    return out


def verdict(result: dict) -> dict:
    """The hybrid against the attention-only model and against its old snapshot rule, per workload."""
    e = result["engines"]
    hybrid, attention, old = e.get("hybrid"), e.get("attention"), e.get("hybrid-step-ends")
    if hybrid is None:
        return {}
    out = {}
    for wl, h in hybrid.items():
        v = {}
        if attention is not None:
            a = attention[wl]["hit_rate"]
            v["hit_rate_vs_attention"] = h["hit_rate"] / a if a else None
        if old is not None:
            v["hit_rate_vs_step_ends"] = h["hit_rate"] / old[wl]["hit_rate"] if old[wl]["hit_rate"] else float("inf")
            v["ttft_p50_speedup_vs_step_ends"] = old[wl]["ttft_p50_s"] / h["ttft_p50_s"] if h["ttft_p50_s"] else None
            v["ttft_p99_speedup_vs_step_ends"] = old[wl]["ttft_p99_s"] / h["ttft_p99_s"] if h["ttft_p99_s"] else None
        out[wl] = v
    return out
