"""`moray bench serve --model DIR --vs-engine`: served throughput as a fraction of the engine's own.

The same engine settings run twice on this machine, alternately:
- offline: one `EngineCore` in this process, a closed loop keeping `--concurrency` requests in flight;
- served: a local colocated app (one decode replica) behind Serve's HTTP proxy, the same closed loop from
  an HTTP client, non-streamed and streamed (SSE).

Every request has a `--prompt-tokens` random prompt and runs to `--max-tokens` (ignore_eos), so the runs are
decode throughput. Reported per run and as medians: output tokens/s of each, the served/offline ratios,
and the CPU seconds the non-engine processes spent (Serve's proxy and Moray's front-end replicas: every
replica but the engines) per 1,000 streamed tokens, read from /proc through psutil. The client runs in this
process and shares the CPUs with the server, as any load generator on one machine does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

ENGINE_ROLES = ("DecodeServer", "PrefillServer")


def engine_settings(args: argparse.Namespace) -> dict:
    """The one engine configuration both sides run."""
    seq_len = args.prompt_tokens + args.max_tokens
    buckets = [b for b in (8, 16, 32, 64, 128, 256, 512) if b < args.concurrency] + [args.concurrency]
    return {
        "model": os.path.abspath(args.model),
        "max_num_seqs": args.concurrency,
        "max_num_batched_tokens": max(256, args.concurrency),
        "max_model_len": max(64, 1 << (seq_len - 1).bit_length()),
        "token_buckets": sorted(set(buckets + [max(256, args.concurrency)])),
        "background_compile": False,  # everything compiled before either side is timed
        "compilation_cache_dir": None,
    }


def prompts(args: argparse.Namespace, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(args.prompt_tokens)] for _ in range(n)]


# ------------------------------------------------------------------------------------ offline


def offline_run(core, args: argparse.Namespace, seed: int) -> dict:
    """Closed loop on the engine itself: `concurrency` requests in flight until `requests` are done."""
    from workers.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    todo = prompts(args, args.requests, seed)
    in_flight, tokens, done = 0, 0, 0
    start = time.perf_counter()
    next_id = 0
    while done < args.requests:
        while in_flight < args.concurrency and next_id < len(todo):
            core.add_request(f"off-{seed}-{next_id}", todo[next_id], params)
            next_id += 1
            in_flight += 1
        for out in core.step():
            tokens += len(out.token_ids)
            if out.finished:
                in_flight -= 1
                done += 1
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


# ------------------------------------------------------------------------------------ served


async def _one(session, url: str, model: str, prompt: list[int], args, stream: bool, headers: dict) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        if not stream:
            return (await r.json())["usage"]["completion_tokens"]
        tokens = 0
        async for raw in r.content:
            if raw.startswith(b"data: {") and b'"usage": {' in raw:
                tokens = json.loads(raw[6:])["usage"]["completion_tokens"]
        return tokens


async def served_run(
    url: str, model: str, args: argparse.Namespace, seed: int, stream: bool, pids: dict[str, int], api_key: str | None = None
) -> dict:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    todo = prompts(args, args.requests, seed)
    sem = asyncio.Semaphore(args.concurrency)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800), connector=connector) as session:

        async def one(p):
            async with sem:
                return await _one(session, url, model, p, args, stream, headers)

        me = {"client (this process)": os.getpid()}
        before, client_before = cpu_seconds(pids), cpu_seconds(me)
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in todo))
        wall = time.perf_counter() - start
        after, client_after = cpu_seconds(pids), cpu_seconds(me)
    tokens = sum(counts)
    spent = {name: after[name] - before[name] for name in pids}
    non_engine = sum(spent.values())
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "non_engine_cpu_s": non_engine,
        "non_engine_cpu_s_per_1k_tokens": 1000 * non_engine / tokens if tokens else 0.0,
        "cpu_s_by_process": spent,
        "client_cpu_s": sum(client_after.values()) - sum(client_before.values()),
    }


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.NoSuchProcess:
            out[name] = 0.0
    return out


def non_engine_processes(app: str) -> dict[str, int]:
    """name -> pid of Serve's proxies and every replica of `app` that is not an engine, found by the process
    titles Ray gives its actors (`ray::ProxyActor`, `ray::ServeReplica:<app>:<deployment>`)."""
    import psutil

    out = {}
    for proc in psutil.process_iter(["cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        if not title.startswith("ray::"):
            continue
        name = title[5:].split(" ")[0].split(".")[0]
        if name.startswith("ProxyActor") or (name.startswith(f"ServeReplica:{app}:") and name.split(":")[-1] not in ENGINE_ROLES):
            out[f"{name}:{proc.pid}"] = proc.pid
    return out


def start_app(engine: dict, stream_interval_ms: float = 5.0, ingress: str = "serve", stream_transport: str = "direct") -> str:
    """A colocated app with one decode replica on a fresh local Ray, behind Serve's proxy or served by its front
    end itself (`ingress`: server.ingress); returns its base URL once healthy."""
    from bench.serve import _free_port, _serve_apps

    port = _free_port()
    cfg = {
        "name": "eff",
        "mode": "colocated",
        "engine": engine,
        "server": {"http_port": port, "grpc_port": _free_port(), "ingress": ingress},
        "decode": {"replicas": 1},
        "stream_interval_ms": stream_interval_ms,
        "stream_transport": stream_transport,
    }
    return _serve_apps(port, {"/": cfg}, proxy=ingress == "serve")


# ------------------------------------------------------------------------------------ the comparison


def run_vs_engine(args: argparse.Namespace) -> dict:
    if not args.model:
        raise ValueError("--vs-engine needs --model DIR")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from workers.engine import EngineConfig
    from workers.engine.engine import EngineCore

    engine = engine_settings(args)
    print(f"offline engine: compiling ({engine['token_buckets']})...", file=sys.stderr)
    core = EngineCore(EngineConfig(**engine), show_progress=False)
    # Warm-up: every program a closed loop meets (step shapes, the token merge) compiles before timing.
    offline_run(core, argparse.Namespace(**{**vars(args), "requests": 2 * args.concurrency}), seed=10_000)
    print("served app: starting...", file=sys.stderr)
    url = start_app(engine, args.stream_interval_ms, args.ingress, getattr(args, "stream_transport", "direct"))
    pids = non_engine_processes("eff")
    model = os.path.basename(os.path.normpath(args.model))
    warm = argparse.Namespace(**{**vars(args), "requests": 2 * args.concurrency})
    for stream in (False, True):
        asyncio.run(served_run(url, model, warm, 20_000, stream, pids))
    runs: dict[str, list[dict]] = {"offline": [], "served": [], "served_stream": []}
    for r in range(args.runs):
        runs["offline"].append(offline_run(core, args, seed=r))
        runs["served"].append(asyncio.run(served_run(url, model, args, r, False, pids)))
        runs["served_stream"].append(asyncio.run(served_run(url, model, args, r, True, pids)))
        print(
            f"run {r + 1}/{args.runs}: offline {runs['offline'][-1]['tokens_per_s']:.0f} tok/s, served "
            f"{runs['served'][-1]['tokens_per_s']:.0f}, streamed {runs['served_stream'][-1]['tokens_per_s']:.0f}",
            file=sys.stderr,
        )
    return summarize(runs, args, engine, sorted(pids))


def summarize(runs: dict[str, list[dict]], args: argparse.Namespace, engine: dict, processes: list[str]) -> dict:
    """The runs' medians and served/offline ratios (`runs`: offline, served, served_stream, paired by index)."""
    med = lambda kind, key: statistics.median(x[key] for x in runs[kind])  # noqa: E731
    offline = med("offline", "tokens_per_s")

    def paired(kind: str) -> float:
        return statistics.median(s["tokens_per_s"] / o["tokens_per_s"] for s, o in zip(runs[kind], runs["offline"]))

    out = {
        "workload": "vs-engine",
        "engine": engine,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "stream_interval_ms": args.stream_interval_ms,
        "stream_transport": getattr(args, "stream_transport", "direct"),
        "ingress": args.ingress,
        "non_engine_processes": processes,
        "offline_tokens_per_s": offline,
        "served_tokens_per_s": med("served", "tokens_per_s"),
        "served_stream_tokens_per_s": med("served_stream", "tokens_per_s"),
        "ratios_served_over_offline": {
            "non_streamed": med("served", "tokens_per_s") / offline,
            "streamed": med("served_stream", "tokens_per_s") / offline,
        },
        # Each run's served figure over the offline run beside it: the machine's speed drifts between runs
        # (noisy neighbours), and a ratio of two medians taken at different moments carries that drift.
        "paired_ratios_served_over_offline": {
            "non_streamed": paired("served"),
            "streamed": paired("served_stream"),
        },
        "non_engine_cpu_s_per_1k_streamed_tokens": med("served_stream", "non_engine_cpu_s_per_1k_tokens"),
        "non_engine_cpu_s_per_1k_tokens": med("served", "non_engine_cpu_s_per_1k_tokens"),
        "runs": runs,
    }
    return out
