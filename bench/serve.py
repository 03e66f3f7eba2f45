"""`moray bench serve`: load a running server (or a local disaggregated + colocated pair) with a workload.

Reports TTFT, TPOT and end-to-end latency (p50/p99), throughput, prefix-cache hit rate, and from the
server's /metrics the KV handoff bytes/s and the handoff's share of TTFT. Prompts are token ids, so
shared prefixes and lengths are exact whatever the tokenizer.

    moray bench serve --url http://127.0.0.1:8000 --workload shared-prefix --concurrency 8 --requests 64 --json out.json
    moray bench serve --model DIR --compare --workload shared-prefix --json out.json   # starts both modes locally
    moray bench serve --model DIR --tier-compare --json out.json   # host KV tier on/off, multi-turn "tiered" workload
    moray bench serve --model DIR --structured --json out.json   # every request JSON-schema constrained vs none

`--structured` (issue #17) runs the workload (default 64 requests at concurrency 16) alternately free and
with every request constrained by a JSON schema (`structured_outputs`), `--runs` times each, against
`--url` or a disaggregated app started locally from `--model`, and reports the medians and the ratios of
decode throughput (output tokens/s) and time per output token, constrained over free.

`--tier-compare` (issue #15) starts two colocated apps with one decode worker each, the same small device
KV pool, one with a host KV tier of `--host-ratio` times that pool; runs the "tiered" workload (64
conversations x 6 turns, growing histories, think time; a live working set of several device pools)
through both, and reports per tier the prefix-hit rate (device / host), TTFT p50/p99 (all turns and turns
>= 3), throughput, the hit rate of an oracle with unlimited cache, and the host tier's copy time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass

from bench.report import add_report_argument, report_if_asked

WORKLOADS = ("shared-prefix", "multi-turn", "long-in-short-out", "short-in-long-out", "tiered")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="with --compare: model directory to serve locally")
    p.add_argument("--compare", action="store_true", help="start disaggregated and colocated apps locally and compare")
    p.add_argument(
        "--tier-compare", action="store_true", help="start apps without and with a host KV tier locally and compare (workload: tiered)"
    )
    p.add_argument("--device-blocks", type=int, default=640, help="with --tier-compare: device KV blocks per worker")
    p.add_argument("--host-ratio", type=float, default=8.0, help="with --tier-compare: host tier size / device pool")
    p.add_argument("--conversations", type=int, default=64, help="tiered workload: conversations (6 turns each)")
    p.add_argument("--think-s", type=float, default=1.0, help="tiered workload: mean think time between turns (seconds)")
    p.add_argument("--workload", choices=WORKLOADS, default="shared-prefix")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True, help="output file")
    p.add_argument("--structured", action="store_true", help="compare JSON-schema constrained requests with free ones")
    p.add_argument("--runs", type=int, default=3, help="with --structured or --vs-engine: alternating runs of each kind (default 3)")
    p.add_argument(
        "--vs-engine",
        action="store_true",
        help="served decode throughput (streamed and not) over the offline engine's at the same concurrency and settings, "
        "and the non-engine processes' CPU per 1,000 tokens (bench/serve_efficiency.py)",
    )
    p.add_argument(
        "--ingress",
        choices=("serve", "direct"),
        default="serve",
        help="with --vs-engine: the served app's server.ingress (Serve's proxy, or its front end listening itself)",
    )
    p.add_argument("--prompt-tokens", type=int, default=16, help="with --vs-engine: prompt length (default 16)")
    p.add_argument("--max-tokens", type=int, default=64, help="with --vs-engine: output tokens per request (default 64)")
    p.add_argument(
        "--stream-interval-ms", type=float, default=5.0, help="with --vs-engine: the served app's stream_interval_ms (default 5)"
    )
    p.add_argument(
        "--stream-transport",
        choices=("direct", "serve"),
        default="direct",
        help="with --vs-engine: the served app's stream_transport (default direct)",
    )
    add_report_argument(p)


# ------------------------------------------------------------------------------------ workloads


@dataclass
class Item:
    prompt: list[int] | str  # token ids, or text the server tokenises
    max_tokens: int
    session: str | None = None
    turn: int = 0
    think_s: float = 0.0  # pause before this turn (the user reading and typing)
    messages: list[dict] | None = None  # a chat request instead (`prompt` unused): /v1/chat/completions
    tools: list[dict] | None = None


def make_workload(name: str, n: int, seed: int, vocab: int = 500) -> list[list[Item]]:
    """Returns groups of items; items in a group run in order (turns of a conversation)."""
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(3, vocab) for _ in range(k)]
    if name == "shared-prefix":
        prefixes = [tok(192) for _ in range(max(1, n // 8))]
        return [[Item(prefixes[i % len(prefixes)] + tok(24), 16)] for i in range(n)]
    if name == "multi-turn":
        return [conversation(tok, f"s{s}", opening=48, user=24, reply=12, turns=4, max_tokens=12) for s in range(max(1, n // 4))]
    if name == "tiered":
        return tiered_workload(rng, tok, conversations=max(1, n // 6))
    if name == "long-in-short-out":
        return [[Item(tok(400), 4)] for _ in range(n)]
    return [[Item(tok(16), 64)] for _ in range(n)]


def conversation(tok, session: str, *, opening: int, user: int, reply: int, turns: int, max_tokens: int, start=None) -> list[Item]:
    """One conversation's turns, in `tok`'s units: each turn adds a `user`-sized message to the history;
    a `reply`-sized stand-in for the assistant's reply follows it (outputs vary, so the real reply is not
    fed back). `tok` makes token-id lists or text (bench.routing.TextSegments); `start`, if given, opens
    the history instead of `tok(opening)` (a shared system prompt)."""
    history, items = (tok(opening) if start is None else start), []
    for t in range(turns):
        history = history + tok(user)
        items.append(Item(history[:], max_tokens, session=session, turn=t))
        history = history + tok(reply)
    return items


def tiered_workload(rng: random.Random, tok, conversations: int = 64, turns: int = 6, think_s: float = 1.0) -> list[list[Item]]:
    """Conversations whose histories outgrow the device cache: a 256-token opening, then per turn a 64-token
    message and a 32-token reply stand-in (832 tokens by turn 6), 16 tokens out, a think time (exponential,
    mean `think_s`) before every turn after the first."""
    groups = []
    for c in range(conversations):
        items = conversation(tok, f"conv{c}", opening=256, user=64, reply=32, turns=turns, max_tokens=16)
        for item in items[1:]:
            item.think_s = rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0
        groups.append(items)
    return groups


def oracle_hit_tokens(groups: list[list[Item]], block_size: int) -> list[int]:
    """Per item (in group order), the prompt tokens an unlimited prefix cache would hold when it arrives:
    full blocks shared with any earlier prompt of its conversation (turns run in order; conversations share
    nothing). Like the engine, a fully cached prompt still recomputes its last token."""
    from workers.engine.block_hash import block_hashes

    out = []
    for group in groups:
        seen: set[int] = set()
        for item in group:
            hashes = block_hashes(item.prompt, block_size)
            n = 0
            while n < len(hashes) and hashes[n] in seen:
                n += 1
            out.append(min(n * block_size, len(item.prompt) - 1))
            seen.update(hashes)
    return out


# ------------------------------------------------------------------------------------ client


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    turn: int = 0
    error: str = ""


async def one_request(session, url: str, model: str, item: Item, api_key: str | None, extra: dict | None = None) -> Result:
    chat = item.messages is not None
    body = {
        "model": model,
        **({"messages": item.messages, **({"tools": item.tools} if item.tools else {})} if chat else {"prompt": item.prompt}),
        "max_tokens": item.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if item.session:
        headers["x-session-id"] = item.session
    start = time.perf_counter()
    result = Result(ok=False)
    async with session.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, headers=headers) as r:
        if r.status != 200:
            return Result(ok=False, error=f"HTTP {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return Result(ok=False, error=event["error"]["message"])
            if event.get("choices") and result.ttft == 0.0:
                result.ttft = time.perf_counter() - start
            if event.get("usage"):
                u = event["usage"]
                result.tokens = u["completion_tokens"]
                result.prompt_tokens = u["prompt_tokens"]
                result.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
    result.e2e = time.perf_counter() - start
    result.ok = True
    result.turn = item.turn
    return result


async def run_workload(
    url: str, groups: list[list[Item]], concurrency: int, api_key: str | None, extra: dict | None = None
) -> tuple[list[Result], float]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async with session.get(url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}) as r:
            model = (await r.json())["data"][0]["id"]
        results: list[Result] = []

        async def run_group(group: list[Item]):
            for item in group:
                if item.think_s:
                    await asyncio.sleep(item.think_s)
                async with sem:
                    results.append(await one_request(session, url, model, item, api_key, extra))

        start = time.perf_counter()
        await asyncio.gather(*(run_group(g) for g in groups))
        return results, time.perf_counter() - start


def scrape(url: str) -> dict[str, float]:
    import urllib.request

    totals: dict[str, float] = {}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(("moray_kv_handoff", "moray_kv_host", "moray_prefix_cache")) and not line.startswith("#"):
                name = line.split("{")[0].split(" ")[0]
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summarise(results: list[Result], wall: float, before: dict, after: dict) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1]
    e2e = [r.e2e for r in ok]
    tokens = sum(r.tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    handoff_bytes = after.get("moray_kv_handoff_bytes_total", 0.0) - before.get("moray_kv_handoff_bytes_total", 0.0)
    handoff_s = after.get("moray_kv_handoff_seconds_total", 0.0) - before.get("moray_kv_handoff_seconds_total", 0.0)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_errors": [r.error for r in results if not r.ok][:3],
        "wall_s": wall,
        "throughput_tokens_per_s": tokens / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
        "e2e_p50_s": pct(e2e, 50),
        "e2e_p99_s": pct(e2e, 99),
        "cache_hit_rate": (sum(r.cached_tokens for r in ok) / prompt) if prompt else 0.0,
        "kv_handoff_bytes": handoff_bytes,
        "kv_handoff_seconds": handoff_s,
        "kv_handoff_bytes_per_s": handoff_bytes / handoff_s if handoff_s else 0.0,
        "kv_handoff_share_of_ttft": handoff_s / sum(ttft) if ttft else 0.0,
        # Every request's own figures, for the report's CDFs (a few KB: percentiles alone hide the shape).
        "samples": {name: [round(x, 6) for x in xs] for name, xs in (("ttft_s", ttft), ("tpot_s", tpot), ("e2e_s", e2e))},
    }


def bench_url(url: str, args, groups, extra: dict | None = None) -> dict:
    before = scrape(url)
    results, wall = asyncio.run(run_workload(url, groups, args.concurrency, args.api_key, extra))
    return summarise(results, wall, before, scrape(url))


# A JSON object around one long string: every token is constrained, and the grammar cannot complete
# before max_tokens, so constrained requests run as long as free ones (with a plain string a random
# model closed it early, and the shorter requests lowered throughput for reasons other than the masks).
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 1000}},
    "required": ["text"],
    "additionalProperties": False,
}


def run_structured(args: argparse.Namespace, groups) -> dict:
    """Free and JSON-schema constrained runs of the same workload, alternating; medians and ratios."""
    url = args.url.rstrip("/") if args.url else start_pair(args.model)[0]
    constrained = {"structured_outputs": {"json": STRUCTURED_SCHEMA}}
    print("warming up...", file=sys.stderr)
    for extra in (None, constrained):
        bench_url(url, argparse.Namespace(**{**vars(args), "concurrency": 4}), make_workload(args.workload, 8, args.seed + 1), extra)
    runs = {"free": [], "structured": []}
    for r in range(args.runs):
        order = ("free", "structured") if r % 2 == 0 else ("structured", "free")
        for kind in order:
            runs[kind].append(bench_url(url, args, groups, constrained if kind == "structured" else None))
            print(f"run {r + 1}/{args.runs} {kind}: {runs[kind][-1]['throughput_tokens_per_s']:.1f} tok/s", file=sys.stderr)

    def median(kind: str, key: str) -> float:
        values = sorted(x[key] for x in runs[kind])
        return values[len(values) // 2]

    keys = ("throughput_tokens_per_s", "tpot_p50_s", "ttft_p50_s", "e2e_p50_s")
    out = {kind: {**{k: median(kind, k) for k in keys}, "runs": runs[kind]} for kind in runs}
    out["schema"] = STRUCTURED_SCHEMA
    out["ratio_structured_over_free"] = {
        "throughput": out["structured"]["throughput_tokens_per_s"] / out["free"]["throughput_tokens_per_s"],
        "tpot_p50": out["structured"]["tpot_p50_s"] / out["free"]["tpot_p50_s"],
    }
    out["target"] = {"throughput_ratio_min": 0.9, "met": out["ratio_structured_over_free"]["throughput"] >= 0.9}
    return out


def _free_port() -> int:
    from workers.parallel import free_port

    return free_port()


def _serve_apps(port: int, apps: dict[str, dict], proxy: bool = True) -> str:
    """Runs each cluster config (route prefix -> config naming its app) as a Serve app on a local Ray whose
    HTTP proxy listens on `port` (`proxy` False: no proxy; the one app's front end listens there itself,
    `server.ingress: direct`); returns the base URL once every app is healthy."""
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from cluster.app import build_app
    from cluster.config import parse_cluster_config
    from cluster.launch import wait_until_healthy

    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port), proxy_location="EveryNode" if proxy else "Disabled")
    for prefix, cfg in apps.items():
        serve.run(build_app(cfg), name=cfg["name"], route_prefix=prefix, blocking=False)
    for prefix, cfg in apps.items():
        wait_until_healthy(parse_cluster_config(cfg), route_prefix="" if prefix == "/" else prefix)
    return f"http://127.0.0.1:{port}"


def start_pair(model: str):
    """Disaggregated app at /, colocated at /colo, on a local Ray (same machine, same engine settings)."""
    import os

    port = _free_port()
    engine = {
        "model": os.path.abspath(model),
        "max_model_len": 1024,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 512,
        "token_buckets": [8, 32, 128, 512],
        "page_buckets": [4, 16, 64],
    }
    base = {"engine": engine, "server": {"http_port": port}, "router": {"remote_prefill_min_tokens": 32}}
    url = _serve_apps(port, {"/": {**base, "name": "disagg"}, "/colo": {**base, "name": "colo", "mode": "colocated"}})
    return url, url + "/colo"


def start_tier_pair(model: str, device_blocks: int, host_blocks: int, block_size: int = 16):
    """Two colocated apps on a local Ray, one decode worker each, the same device KV pool: /notier without a
    host tier, /tier with `host_blocks` of them."""
    import os

    port = _free_port()
    engine = {
        "model": os.path.abspath(model),
        "block_size": block_size,
        "num_kv_blocks": device_blocks,
        "max_model_len": 1024,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        # Fine enough that a turn's new ~100 tokens run in a 128-token program, not a 512-token one
        # (on CPU a padded token costs as much as a real one), few enough to compile in minutes.
        "token_buckets": [8, 32, 128, 512],
        "page_buckets": [8, 64],
    }
    base = {"engine": engine, "server": {"http_port": port}, "mode": "colocated"}
    tiered = {**base, "name": "tier", "engine": {**engine, "host_kv": {"blocks": host_blocks}}}
    url = _serve_apps(port, {"/notier": {**base, "name": "notier"}, "/tier": tiered})
    return url + "/notier", url + "/tier"


def summarise_tiers(results: list[Result], wall: float, before: dict, after: dict, oracle_tokens: int) -> dict:
    """`summarise`, plus hits by tier (the workers' counters), TTFT on turns >= 3, and the oracle's share."""
    out = summarise(results, wall, before, after)
    grew = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    host_hits = grew("moray_prefix_cache_host_hit_tokens_total")
    hits = sum(r.cached_tokens for r in ok)
    late = [r.ttft for r in ok if r.turn >= 2]  # turns 3..6 (counted from 1)
    out.update(
        device_hit_rate=(hits - host_hits) / prompt if prompt else 0.0,
        host_hit_rate=host_hits / prompt if prompt else 0.0,
        oracle_hit_rate=oracle_tokens / prompt if prompt else 0.0,
        fraction_of_oracle=hits / oracle_tokens if oracle_tokens else 0.0,
        ttft_turns_3plus_p50_s=pct(late, 50),
        ttft_turns_3plus_p99_s=pct(late, 99),
        host_blocks_saved=grew("moray_kv_host_saved_blocks_total"),
        host_blocks_loaded=grew("moray_kv_host_loaded_blocks_total"),
        host_copy_seconds=grew("moray_kv_host_copy_seconds_total"),
        host_copy_share_of_wall=grew("moray_kv_host_copy_seconds_total") / wall if wall else 0.0,
    )
    return out


def copy_bandwidth(model: str, block_size: int = 16, blocks: int = 64, repeats: int = 5) -> dict:
    """Host<->device copy rate of the host tier's own programs (runner gather/scatter of `blocks` blocks),
    median of `repeats`, in GB/s, measured in this process on this machine's JAX device."""
    import jax
    import numpy as np

    from workers.engine import LLM

    llm = LLM(
        model,
        block_size=block_size,
        num_kv_blocks=blocks + 1,
        max_model_len=blocks * block_size,
        max_num_batched_tokens=8,
        page_buckets=[blocks],
        token_buckets=[8],
        warmup=False,
    )
    runner, layers = llm.engine.runner, llm.engine.cfg.num_kv_layers
    ids = list(range(blocks))
    data = runner.gather_blocks(ids, 0, layers)
    runner.scatter_blocks(ids, 0, np.moveaxis(data, 0, 1))  # compile both (it takes blocks first)
    jax.block_until_ready(runner.kv_pages)
    out, back = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        data = runner.gather_blocks(ids, 0, layers)
        out.append(time.perf_counter() - t)
        t = time.perf_counter()
        runner.scatter_blocks(ids, 0, np.moveaxis(data, 0, 1))
        jax.block_until_ready(runner.kv_pages)
        back.append(time.perf_counter() - t)
    nbytes = data.nbytes
    return {
        "blocks": blocks,
        "bytes": nbytes,
        "device_to_host_gb_per_s": nbytes / float(np.median(out)) / 1e9,
        "host_to_device_gb_per_s": nbytes / float(np.median(back)) / 1e9,
        "device": str(jax.devices()[0].platform),
    }


def run_tier_compare(args: argparse.Namespace) -> dict:
    if not args.model:
        raise ValueError("--tier-compare needs --model DIR")
    block_size = 16
    groups = tiered_workload(random.Random(args.seed), _tok(args.seed), args.conversations, think_s=args.think_s)
    oracle = sum(oracle_hit_tokens(groups, block_size))
    working_set = sum(-(-len(g[-1].prompt) // block_size) for g in groups)
    host_blocks = int(args.device_blocks * args.host_ratio)
    notier, tier = start_tier_pair(args.model, args.device_blocks, host_blocks, block_size)
    print("warming up...", file=sys.stderr)
    warm = tiered_workload(random.Random(args.seed + 1), _tok(args.seed + 1), 2, turns=2, think_s=0)
    for url in (notier, tier):
        asyncio.run(run_workload(url, warm, 2, args.api_key))
    out = {
        "workload": "tiered",
        "conversations": len(groups),
        "turns": len(groups[0]),
        "concurrency": args.concurrency,
        "think_s_mean": args.think_s,
        "device_blocks": args.device_blocks,
        "host_blocks": host_blocks,
        "working_set_blocks": working_set,
        "working_set_over_device_pool": working_set / args.device_blocks,
    }
    for name, url in (("without_tier", notier), ("with_tier", tier)):
        print(f"running {name}...", file=sys.stderr)
        before = scrape(url)
        results, wall = asyncio.run(run_workload(url, groups, args.concurrency, args.api_key))
        out[name] = summarise_tiers(results, wall, before, scrape(url), oracle)
    w, wo = out["with_tier"], out["without_tier"]
    out["ratios_with_over_without"] = {
        k: (w[k] / wo[k] if wo[k] else None) for k in ("ttft_p50_s", "ttft_turns_3plus_p50_s", "ttft_p99_s", "throughput_tokens_per_s")
    }
    out["targets"] = {
        "hit_rate_fraction_of_oracle_ge_0.9": w["fraction_of_oracle"] >= 0.9,
        "ttft_turns_3plus_p50_2x_better": bool(w["ttft_turns_3plus_p50_s"])
        and wo["ttft_turns_3plus_p50_s"] / w["ttft_turns_3plus_p50_s"] >= 2,
    }
    out["copy_bandwidth"] = copy_bandwidth(args.model, block_size)
    return out


def _tok(seed: int, vocab: int = 500):
    rng = random.Random(seed * 7919 + 1)
    return lambda k: [rng.randrange(3, vocab) for _ in range(k)]


def run(args: argparse.Namespace) -> int:
    if getattr(args, "tier_compare", False):
        out = run_tier_compare(args)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(json.dumps(out, indent=2))
        report_if_asked(args, "serve", out)
        return 0
    if getattr(args, "vs_engine", False):
        from bench.serve_efficiency import run_vs_engine

        out = run_vs_engine(args)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2))
        report_if_asked(args, "serve", out)
        return 0
    groups = make_workload(args.workload, args.requests, args.seed)
    out = {"workload": args.workload, "concurrency": args.concurrency, "requests": args.requests}
    if getattr(args, "structured", False):
        if not (args.url or args.model):
            raise ValueError("--structured needs --url URL or --model DIR")
        out["structured"] = run_structured(args, groups)
    elif args.compare:
        if not args.model:
            raise ValueError("--compare needs --model DIR")
        disagg, colo = start_pair(args.model)
        print("warming up...", file=sys.stderr)
        for url in (disagg, colo):
            bench_url(url, argparse.Namespace(**{**vars(args), "concurrency": 2}), make_workload(args.workload, 4, args.seed + 1))
        out["disaggregated"] = bench_url(disagg, args, groups)
        out["colocated"] = bench_url(colo, args, groups)
        d, c = out["disaggregated"], out["colocated"]
        out["ratios_disaggregated_over_colocated"] = {
            k: (d[k] / c[k] if c[k] else None) for k in ("ttft_p50_s", "tpot_p50_s", "e2e_p50_s", "throughput_tokens_per_s")
        }
    else:
        if not args.url:
            raise ValueError("give --url URL (or --compare --model DIR)")
        out["result"] = bench_url(args.url.rstrip("/"), args, groups)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))
    report_if_asked(args, "serve", out)
    return 0
