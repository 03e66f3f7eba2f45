"""`moray bench routing`: routing policies side by side, end to end on a local cluster.

For each policy (round-robin, least-loaded, kv-aware) a fresh colocated app with `--workers` decode
workers, each with a KV pool small enough (`--kv-blocks`) that the workload's prefixes do not all fit,
serves the same shared-prefix and multi-turn workloads over HTTP, one after the other, with a pause
between them long enough for the router's memory of the previous one to fade (3 x session_idle_s).
Reported per policy and workload:

- hit rate: prompt tokens the engines reported as cached (usage.prompt_tokens_details) / prompt tokens;
- TTFT p50/p99 (streamed);
- load balance: max/mean over workers of the prompt tokens the router sent each one (its per-worker
  counter in /metrics, before and after the workload).

The oracle is the same request sequence replayed against real `KVCacheManager`s of the same size, each
request sent to the worker whose cache holds its longest prefix at that moment (ties: the least loaded):
routing that sees every cache exactly. The last `--concurrency` requests keep their blocks allocated, as
requests in flight do; nothing else (queueing, timing, load) limits it. Targets: kv-aware's hit rate >= 2x round-robin's
and >= 90% of the oracle's; kv-aware's max/mean load <= 1.3.

    moray bench routing --json routing.json                # builds a tiny demo model if --model is not given
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

from bench import scratch_dir
from bench.report import add_report_argument, report_if_asked
from bench.serve import Item, Result, conversation, one_request, pct

POLICIES = ("round-robin", "least-loaded", "kv-aware")
WORKLOADS = ("shared-prefix", "multi-turn", "chat")
TARGETS = {"hit_rate_vs_round_robin": 2.0, "hit_rate_vs_oracle": 0.9, "max_over_mean_load": 1.3}
# Against the peer router (issue #19): reuse at least as much, balance within 1.2, TTFT p99 no worse than round-robin's.
PEER_TARGETS = {"hit_rate_vs_peer": 1.0, "max_over_mean_load": 1.2, "ttft_p99_vs_round_robin": 1.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: a tiny demo model built in a temp dir)")
    p.add_argument("--workers", type=int, default=4, help="decode workers per policy")
    p.add_argument("--kv-blocks", type=int, default=64, help="KV blocks per worker (small: forces eviction)")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--requests", type=int, default=96, help="requests per workload")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--think-time-ms", type=float, default=1000.0, help="a user's pause before the next turn (uniform 0..N)")
    p.add_argument(
        "--slack-divisor",
        type=float,
        default=2.0,
        help="router.load_slack_blocks = min(64, kv_blocks / this): the production default, or a share of pools too small for it",
    )
    p.add_argument(
        "--session-idle-s", type=float, help="router.session_idle_s (default: 3x the think time; the 60 s default is sized for human users)"
    )
    p.add_argument("--repeats", type=int, default=3, help="fresh apps per policy; figures are medians over them (machines are noisy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--peer",
        choices=["sglang-router"],
        help="also run a peer router over the same workloads: sglang-router (cache_aware) in front of --workers "
        "single-worker `moray serve` processes (bench extra: pip install sglang-router==0.3.2)",
    )
    p.add_argument(
        "--hybrid",
        action="store_true",
        help="instead: prefix reuse of a hybrid model against an attention-only one and its old snapshot rule, "
        "kv-aware, on system-prompt, branching-agent and multi-turn chat traffic (bench/hybrid_reuse.py)",
    )
    p.add_argument("--engines", nargs="+", help="with --hybrid: which of attention, hybrid, hybrid-step-ends (default all)")
    p.add_argument("--state-snapshots", type=int, default=64, help="with --hybrid: state snapshots per hybrid worker")
    p.add_argument("--hybrid-workloads", nargs="+", help="with --hybrid: which of system-tools, branching, multi-turn (default all)")
    p.add_argument(
        "--ingress",
        choices=("serve", "direct"),
        default="serve",
        help="with --hybrid: the apps' server.ingress (Serve's proxy, or the front end listening itself: one hop less)",
    )
    p.add_argument(
        "--preset",
        choices=["tiny", "small", "bench"],
        default="tiny",
        help="with --hybrid: the models' size (workers/models/make_model.py); a bigger one makes prefill, not the "
        "server around it, the larger part of TTFT, as on an accelerator with a real model",
    )
    p.add_argument("--json", help="also write the JSON result here")
    add_report_argument(p)


# ---------------------------------------------------------------- workloads


class TextSegments:
    """Random text segments sized in KV blocks of the model's own tokenizer, so that routers that only see
    request text (the peer) and Moray's (which sees token blocks) get the same requests.

    Each segment starts with a newline: the tokenizer's pre-tokenizer splits there, so a conversation's
    next prompt (history + new segment) tokenises to the previous prompt's tokens plus the segment's, and
    a prefix shared in text is shared in tokens (checked by `prompt_ids` users: the oracle reads the ids).
    """

    def __init__(self, model: str, rng: random.Random, block_size: int):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
        self.rng, self.block_size = rng, block_size

    def __call__(self, blocks: int) -> str:
        want = blocks * self.block_size
        words = []
        text = "\n"
        while len(self.tokenizer.encode(text, add_special_tokens=False).ids) < want:
            words.append("".join(self.rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(self.rng.randint(2, 7))))
            text = "\n" + " ".join(words)
        return text

    def ids(self, text: str) -> list[int]:
        """The prompt's token ids as the server's tokenizer makes them (a completions prompt: special tokens added)."""
        return self.tokenizer.encode(text).ids


def make_workload(name: str, n: int, seed: int, seg, block_size: int) -> list[list[Item]]:
    """Groups of items; a group's items run in order (the turns of a conversation). `seg(k)` makes a
    k-block piece of prompt (text, see TextSegments; or token ids), so the pressure on the KV pools does
    not depend on --block-size."""
    if name == "shared-prefix":
        # n/6 system prompts of 12 blocks, each used by ~6 requests with a 2-block question, in random order.
        prefixes = [seg(12) for _ in range(max(1, n // 6))]
        items = [[Item(prefixes[i % len(prefixes)] + seg(2), 4)] for i in range(n)]
        random.Random(f"{name}-{seed}-order").shuffle(items)
        return items
    if name == "multi-turn":
        # n/4 conversations of 4 turns: each turn adds a 2-block user message to the history, plus a
        # 1-block stand-in for the previous reply.
        return [conversation(seg, f"{seed}-s{s}", opening=4, user=2, reply=1, turns=4, max_tokens=4) for s in range(max(1, n // 4))]
    if name == "chat":
        # Chat traffic (issue #19): n/5 conversations of 5 turns over 4 shared 8-block system prompts; each
        # turn adds a 2-block user message after a 1-block reply stand-in. Users think between turns.
        systems = [seg(8) for _ in range(4)]
        groups = []
        for c in range(max(1, n // 5)):
            start = systems[c % len(systems)]
            groups.append(conversation(seg, f"{seed}-chat{c}", opening=0, user=2, reply=1, turns=5, max_tokens=4, start=start))
        random.Random(f"{name}-{seed}-order").shuffle(groups)
        return groups
    raise ValueError(f"unknown workload {name!r}")


def replay_order(groups: list[list[Item]], concurrency: int) -> list[Item]:
    """The order a run with `concurrency` clients roughly sends items in: each client runs one group
    (conversation) at a time, so `concurrency` groups at a time, turn by turn."""
    order = []
    for start in range(0, len(groups), concurrency):
        window = groups[start : start + concurrency]
        for turn in range(max(len(g) for g in window)):
            order += [g[turn] for g in window if turn < len(g)]
    return order


# ---------------------------------------------------------------- oracle


def oracle(groups: list[list[Item]], workers: int, kv_blocks: int, block_size: int, concurrency: int, ids=lambda p: p) -> dict:
    """Hit rate and load balance of routing that sees every cache exactly (see the module docstring)."""
    from collections import deque

    from workers.engine.kv_cache_manager import KVCacheManager
    from workers.engine.request import Request
    from workers.engine.sampling_params import SamplingParams

    caches = [KVCacheManager(kv_blocks, block_size) for _ in range(workers)]
    tokens_given = [0] * workers
    in_flight: deque = deque()  # (cache, request): the last `concurrency` requests still hold their blocks
    cached = prompt = 0
    for i, item in enumerate(replay_order(groups, concurrency)):
        if len(in_flight) >= concurrency:
            kv, r = in_flight.popleft()
            kv.free(r)
        tokens = ids(item.prompt)
        requests = [Request(f"o{i}", list(tokens), SamplingParams()) for _ in caches]
        hits = [len(kv.cached_prefix(r)) for kv, r in zip(caches, requests)]
        w = max(range(workers), key=lambda k: (hits[k], -tokens_given[k]))
        kv, r = caches[w], requests[w]
        prefix = kv.cached_prefix(r)
        r.num_computed_tokens = min(len(prefix) * block_size, len(tokens) - 1)
        while kv.allocate(r, len(tokens) - r.num_computed_tokens, prefix) is None:
            if not in_flight:
                raise ValueError(f"a {len(tokens)}-token prompt does not fit in {kv_blocks} KV blocks")
            old_kv, old = in_flight.popleft()  # the engine would wait for a running request to finish
            old_kv.free(old)
        cached += r.num_computed_tokens
        prompt += len(tokens)
        tokens_given[w] += len(tokens)
        r.num_computed_tokens = len(tokens)
        kv.cache_full_blocks(r)
        in_flight.append((kv, r))
    return {
        "hit_rate": cached / prompt,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "max_over_mean_load": _max_over_mean(tokens_given),
    }


def _max_over_mean(values) -> float:
    values = list(values)
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 0.0


# ---------------------------------------------------------------- the live runs


# The router's own account of each decision's cached prefix tokens (cluster/router/metrics.py): on the
# best live candidate, on the worker it chose, and what the engine then reported reusing.
DECISION_TOKENS = {
    "moray_router_cached_tokens_best_total": "best",
    "moray_router_cached_tokens_chosen_total": "chosen",
    "moray_router_reused_tokens_total": "reused",
}


def _router_counters(url: str) -> dict[str, dict[str, float]]:
    """From /metrics (cumulative): "worker" -> {worker: prompt tokens the router sent it}, "branch" ->
    {deciding branch: decisions}, "tokens" -> {best, chosen, reused: cached prefix tokens}."""
    import urllib.request

    out: dict[str, dict[str, float]] = {"worker": {}, "branch": {}, "tokens": {}}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            for prefix, label in (("moray_router_routed_prompt_tokens_total{", "worker"), ("moray_router_decisions_total{", "branch")):
                if line.startswith(prefix):
                    key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                    out[label][key] = out[label].get(key, 0.0) + float(line.rsplit(" ", 1)[1])
            name = line.split(" ", 1)[0]
            if name in DECISION_TOKENS:
                out["tokens"][DECISION_TOKENS[name]] = float(line.rsplit(" ", 1)[1])
    return out


def _wait_for_workers(url: str, n: int, timeout_s: float = 900) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if json.loads(r.read()).get("decode_workers", 0) >= n:
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url}: {n} decode workers did not register within {timeout_s:.0f}s")


async def _run_items(
    url: str, groups: list[list[Item]], concurrency: int, think_time_s: float = 0.0, seed: int = 0, models_url: str | None = None
) -> list[Result]:
    """Runs the groups against `url`; the model name comes from `models_url` (default `url`)/v1/models."""
    import aiohttp

    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    results: list[Result] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        async with session.get((models_url or url) + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def group(g: list[Item]) -> None:
            async with sem:  # a client holds its slot for a whole conversation, turn after turn
                for turn, item in enumerate(g):
                    if turn and think_time_s:
                        await asyncio.sleep(rng.uniform(0, think_time_s))  # the user reads, then types
                    result = await one_request(session, url, model, item, None)
                    if not result.ok:
                        raise RuntimeError(result.error)
                    results.append(result)

        await asyncio.gather(*(group(g) for g in groups))
    return results


def summarise(results: list[Result], before: dict, after: dict, workers: int) -> dict:
    given = {w: n - before["worker"].get(w, 0.0) for w, n in after["worker"].items()}
    given.update({f"(idle {i})": 0.0 for i in range(workers - len(given))})  # a worker given nothing at all
    ttft = [r.ttft for r in results]
    return {
        "requests": len(results),
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "hit_rate": sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "max_over_mean_load": _max_over_mean(given.values()),
        "prompt_tokens_per_worker": dict(sorted(given.items())),
        "decisions_by_branch": {b: int(n - before["branch"].get(b, 0.0)) for b, n in sorted(after["branch"].items())},
        "decision_tokens": {
            k: after.get("tokens", {}).get(k, 0.0) - before.get("tokens", {}).get(k, 0.0) for k in DECISION_TOKENS.values()
        },
        "samples": {"ttft_s": [round(t, 6) for t in ttft]},
    }


def start_ray() -> int:
    """A local Ray with Serve's HTTP proxy on a free port; returns the port."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import ray
    from ray import serve

    from workers.parallel import free_port

    ray.init(
        address="local",
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,  # its own, always
        runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}},
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def router_settings(args) -> dict:
    """Router settings scaled to the benchmark: its pools are tiny and its users think for a second. The
    load slack is the production default (64 blocks) or, in pools too small for that, a share of a pool:
    at half of a 320-block pool a worker could run ~11 requests above the mean before load counted, and
    the hot system prompts' workers did (issue #19: max/mean 1.28, and their queues set TTFT p99)."""
    idle = args.session_idle_s if args.session_idle_s is not None else max(1.0, 3 * args.think_time_ms / 1000)
    return {"load_slack_blocks": min(64.0, args.kv_blocks / args.slack_divisor), "session_idle_s": idle}


def measure(label: str, workload: str, url: str, groups: list[list[Item]], args, counters, models_url: str | None = None) -> dict:
    """One workload through `url`: its summary, `counters()` (cumulative per-worker prompt tokens and
    deciding branches) read before and after to get this workload's share."""
    before = counters()
    t0 = time.perf_counter()
    results = asyncio.run(_run_items(url, groups, args.concurrency, args.think_time_ms / 1000, args.seed, models_url))
    out = summarise(results, before, counters(), args.workers)
    out["wall_s"] = time.perf_counter() - t0
    print(
        f"[{label}] {workload}: hit rate {out['hit_rate']:.3f}, max/mean load {out['max_over_mean_load']:.2f}", file=sys.stderr, flush=True
    )
    return out


def run_policy(policy: str, model: str, port: int, args, workloads: dict[str, list[list[Item]]]) -> dict:
    cfg = {
        "name": f"routing-{policy}",
        "mode": "colocated",
        "engine": engine_settings(model, args),
        "decode": {"replicas": args.workers, "resources": {"cpus": 0.1}},
        # Load above the mean is free up to load_slack_blocks; the default (64) is sized for production
        # pools of thousands of blocks, so it is scaled to these small pools (half a pool by default:
        # measured on shared-prefix, kv_blocks/8 reached 0.82 of the oracle, /4 0.87, /2 0.93).
        "router": {"policy": policy, "seed": args.seed, **router_settings(args)},
    }
    return run_app(policy, cfg, port, args, workloads)


def run_app(label: str, cfg: dict, port: int, args, workloads: dict[str, list[list[Item]]], after=None) -> dict:
    """Deploys the cluster config `cfg` at /<label>, runs each workload through it (`after(url, figures)`
    adds to a workload's figures), and deletes it. A config with `server.ingress: direct` is reached on
    its front end's own port instead of Serve's proxy."""
    from ray import serve

    from cluster.app import build_app

    server = cfg.get("server", {})
    direct = server.get("ingress") == "direct"
    url = f"http://127.0.0.1:{server['http_port']}" if direct else f"http://127.0.0.1:{port}/{label}"
    t0 = time.perf_counter()
    serve.run(build_app(cfg), name=cfg["name"], route_prefix=f"/{label}", blocking=False)
    _wait_for_workers(url, args.workers)
    print(f"[{label}] {args.workers} workers up in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    out = {}
    try:
        for i, (wl, groups) in enumerate(workloads.items()):
            if i:
                # Each workload starts from a quiet router: its memory of the last one (work a worker was
                # attracting, live conversations; see cluster/router/policy.py) is let fade first.
                time.sleep(3 * router_settings(args)["session_idle_s"])
            out[wl] = measure(label, wl, url, groups, args, lambda: _router_counters(url))
            if after is not None:
                after(url, out[wl])
    finally:
        serve.delete(cfg["name"])
    return out


def run(args: argparse.Namespace) -> int:
    if args.hybrid:
        from bench import hybrid_reuse

        return hybrid_reuse.run(args)
    model = args.model
    tmp = None
    if model is None:
        from workers.models.make_model import make_model

        tmp = scratch_dir("moray-bench-routing-")
        model = str(make_model(os.path.join(tmp, "tiny"), "qwen3_moe", "tiny", seed=0))
    seg = TextSegments(model, random.Random(args.seed), args.block_size)
    workloads = {w: make_workload(w, args.requests, args.seed, seg, args.block_size) for w in args.workloads}
    longest = max(len(seg.ids(item.prompt)) + item.max_tokens for groups in workloads.values() for g in groups for item in g)
    args.max_model_len = -(-longest // args.block_size) * args.block_size
    if args.max_model_len > args.kv_blocks * args.block_size:
        print(f"moray bench routing: a {longest}-token request does not fit in --kv-blocks {args.kv_blocks}", file=sys.stderr)
        return 2
    if args.peer:
        from bench.routing_peer import peer_available

        why = peer_available(args.peer)
        if why:
            print(f"moray bench routing: --peer {args.peer}: {why}", file=sys.stderr)
            return 2
    result: dict = {
        "workers": args.workers,
        "kv_blocks_per_worker": args.kv_blocks,
        "block_size": args.block_size,
        "requests_per_workload": args.requests,
        "concurrency": args.concurrency,
        "targets": TARGETS,
        "peer_targets": PEER_TARGETS if args.peer else None,
        "router": router_settings(args),
        "engine": {k: v for k, v in engine_settings(model, args).items() if k != "model"},
        "think_time_ms": args.think_time_ms,
        "repeats": args.repeats,
        "oracle": {w: oracle(g, args.workers, args.kv_blocks, args.block_size, args.concurrency, seg.ids) for w, g in workloads.items()},
        "policies": {},
    }
    port = start_ray()
    try:
        for policy in args.policies:
            runs = [run_policy(policy, os.path.abspath(model), port, args, workloads) for _ in range(args.repeats)]
            result["policies"][policy] = {wl: median_of([r[wl] for r in runs]) for wl in workloads}
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    rc = 0
    if args.peer:
        try:
            runs = [run_peer(args.peer, os.path.abspath(model), args, workloads) for _ in range(args.repeats)]
            result["policies"][args.peer] = {wl: median_of([r[wl] for r in runs]) for wl in workloads}
        except (RuntimeError, TimeoutError, OSError) as e:  # keep the policies' figures: they took minutes
            print(f"moray bench routing: the peer run failed: {e}", file=sys.stderr)
            result["peer_error"] = str(e)
            rc = 1
    for per_workload in result["policies"].values():
        for wl, figures in per_workload.items():
            orc = result["oracle"][wl]["hit_rate"]
            figures["hit_rate_vs_oracle"] = figures["hit_rate"] / orc if orc else None
    if "kv-aware" in result["policies"]:
        result["kv_aware_losses"] = {wl: losses(result, wl) for wl in workloads}
    result["verdict"] = verdict(result)
    print(table(result), file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    report_if_asked(args, "routing", result)
    return rc


MEDIAN_FIELDS = ("hit_rate", "ttft_p50_s", "ttft_p99_s", "max_over_mean_load", "wall_s")


def engine_settings(model: str, args) -> dict:
    """The workers' engine settings: the same for Moray's policies and the peer's servers. max_model_len:
    the longest request of the workloads (a pool must hold one sequence of it)."""
    return {
        "model": model,
        "block_size": args.block_size,
        "num_kv_blocks": args.kv_blocks,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 128,
        "max_model_len": args.max_model_len,
        "token_buckets": [8, 32, 128],
        "page_buckets": [4, 16, 64],
        # Every step program compiled before a worker serves: otherwise the first workload's first requests
        # wait for compiles (TTFT p99 4.5 s on shared-prefix against ~0.2 s after), on Moray's policies and
        # the peer's servers alike, and its TTFT figures measure the compiler.
        "background_compile": False,
    }


def run_peer(peer: str, model: str, args, workloads: dict[str, list[list[Item]]]) -> dict:
    """The workloads through the peer router over fresh single-worker servers (see bench/routing_peer.py)."""
    from bench import routing_peer

    t0 = time.perf_counter()
    cluster = routing_peer.start(model, args.workers, engine_settings(model, args))
    print(f"[{peer}] {args.workers} servers and the router up in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)

    def counters() -> dict:  # the peer's load split: what each single-worker server counted
        return {"worker": routing_peer.prompt_tokens_per_worker(cluster), "branch": {}}

    out = {}
    try:
        for wl, groups in workloads.items():
            # The servers name the model: sglang-router's /v1/models says "unknown" without a tokenizer path.
            out[wl] = measure(peer, wl, cluster.url, groups, args, counters, models_url=cluster.worker_urls[0])
    finally:
        cluster.stop()
    return out


def losses(result: dict, workload: str) -> dict:
    """Where kv-aware's prefix hits went, per workload, as fractions of the prompt tokens: the oracle's
    reachable hits; what the index said the best live worker held (below the oracle: the history of
    placements, evictions the index had not seen); what the chosen worker held (below best: the load term
    or a session hint moved the request); what the engine reused (below chosen: blocks evicted between
    decision and prefill, or speculative entries that never materialised)."""
    kv = result["policies"]["kv-aware"][workload]
    tokens = kv.get("decision_tokens") or {}
    prompt = kv.get("prompt_tokens") or 0
    if not prompt or not tokens:
        return {}
    frac = {k: v / prompt for k, v in tokens.items()}
    orc = result["oracle"][workload]["hit_rate"]
    return {
        "oracle": orc,
        **frac,
        "lost_before_decision": orc - frac.get("best", 0.0),
        "lost_to_choice": frac.get("best", 0.0) - frac.get("chosen", 0.0),
        "lost_after_decision": frac.get("chosen", 0.0) - frac.get("reused", 0.0),
    }


def table(result: dict, rows: str = "policies", last: tuple = ("max/mean", lambda f: f["max_over_mean_load"])) -> str:
    """The side-by-side table, one line per workload and `rows` entry (policy, or engine); `last`: the
    last column's title and value."""
    title, value = last
    lines = [f"{'workload':<14} {rows[:-1]:<18} {'hit':>6} {'/oracle':>8} {'ttft p50':>9} {'ttft p99':>9} {title:>10}"]
    for wl in result["oracle"]:
        lines.append(f"{wl:<14} {'oracle':<18} {result['oracle'][wl]['hit_rate']:>6.3f} {1.0:>8.2f}")
        for name, per in result[rows].items():
            f = per[wl]
            lines.append(
                f"{'':<14} {name:<18} {f['hit_rate']:>6.3f} {f.get('hit_rate_vs_oracle') or 0:>8.2f} "
                f"{f['ttft_p50_s']:>9.3f} {f['ttft_p99_s']:>9.3f} {value(f):>10.2f}"
            )
    return "\n".join(lines)


def median_of(runs: list[dict]) -> dict:
    """One workload's figures over repeated runs: the medians, plus each run's own figures."""
    import statistics

    if len(runs) == 1:
        return runs[0]
    out = {k: statistics.median(r[k] for r in runs) for k in MEDIAN_FIELDS}
    out["requests"] = runs[0]["requests"]
    out["prompt_tokens"] = statistics.median(r.get("prompt_tokens", 0) for r in runs)
    keys = runs[0].get("decision_tokens", {})
    out["decision_tokens"] = {k: statistics.median(r["decision_tokens"][k] for r in runs) for k in keys}
    out["prompt_tokens_per_worker"] = runs[-1]["prompt_tokens_per_worker"]  # the last run's, for a look
    out["decisions_by_branch"] = runs[-1]["decisions_by_branch"]
    out["runs"] = [{k: r[k] for k in (*MEDIAN_FIELDS, "decisions_by_branch")} for r in runs]
    return out


def verdict(result: dict) -> dict:
    """kv-aware against the targets, per workload (only when kv-aware and round-robin both ran)."""
    pol = result["policies"]
    if "kv-aware" not in pol:
        return {}
    out = {}
    for wl, kv in pol["kv-aware"].items():
        rr = pol.get("round-robin", {}).get(wl)
        orc = result["oracle"][wl]["hit_rate"]
        v = {
            "hit_rate_vs_oracle": kv["hit_rate"] / orc if orc else None,
            "max_over_mean_load": kv["max_over_mean_load"],
        }
        if rr is not None:
            v["hit_rate_vs_round_robin"] = kv["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
            v["ttft_p99_vs_round_robin"] = kv["ttft_p99_s"] / rr["ttft_p99_s"] if rr["ttft_p99_s"] else float("inf")
        peer = next((pol[p][wl] for p in pol if p not in POLICIES), None)
        if peer is not None:
            v["hit_rate_vs_peer"] = kv["hit_rate"] / peer["hit_rate"] if peer["hit_rate"] else float("inf")
            v["meets_peer_targets"] = (
                v["hit_rate_vs_peer"] >= PEER_TARGETS["hit_rate_vs_peer"]
                and kv["max_over_mean_load"] <= PEER_TARGETS["max_over_mean_load"]
                and v.get("ttft_p99_vs_round_robin", 0.0) <= PEER_TARGETS["ttft_p99_vs_round_robin"]
            )
        v["meets_targets"] = (
            (v["hit_rate_vs_oracle"] or 0) >= TARGETS["hit_rate_vs_oracle"]
            and v["max_over_mean_load"] <= TARGETS["max_over_mean_load"]
            and v.get("hit_rate_vs_round_robin", float("inf")) >= TARGETS["hit_rate_vs_round_robin"]
        )
        out[wl] = v
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
