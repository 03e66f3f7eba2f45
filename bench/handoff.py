"""`moray bench handoff --model DIR --json OUT`: the KV transfer layer, measured (workers/kv_transfer.py).

A prefill worker and a decode worker (the real `workers.worker` classes, each with its own engine, both in
this process, sharing its CPUs) hand requests over through Ray's object store (`cluster/kv_transport.py`,
a local Ray started here), as a cluster's replicas do (`--transport shared_memory`: through a shared-memory
arena instead; `both`: the transfer part with each). Three parts, each in the JSON and the --report:

- `transfer`, per handoff of a fresh `--prompt-tokens` prompt (no prefix anywhere): KV bytes; the prefill
  side's export (engine dispatch of the copy -> chunks published: host copy, chunking, XXH3, ray.put);
  the decode side's import (first fetch -> every chunk verified and written), and from its first chunk
  written to the KV ready for the first decode step; the sum as GB/s, against this machine's memcpy
  bandwidth measured in the same run (numpy, a buffer the size of the KV, median of 5); and the prefill
  engine thread's own time per handoff (dispatching the staged copy: the only export work on it).
- `prefill_rate`: prefill-only requests (`--rate-prompt-tokens` each, fresh ones every run, `--rate-requests` of them,
  `--concurrency` in flight, one output token) through the prefill worker with the KV exported (staged,
  chunked, checksummed, published) vs as many whose KV is discarded: requests/s of each and
  the ratio (target >= 0.9).
- `second_token`: time to the second token (the first decode step after the handoff; the first token comes
  from the prefill worker before any KV moves) and output tokens/s, disaggregated (prefill worker ->
  handoff -> decode worker) vs colocated (the decode worker alone), at each `--ttst-concurrency`, same
  model, same run (target at concurrency 1: disaggregated <= 1.2x colocated).

Medians over the repetitions; machines are noisy, so the ratios are taken within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from bench.report import add_report_argument, report_if_asked


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    p.add_argument("--json", "--out", dest="json", required=True, type=Path, help="where to write the results")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length of the transfer handoffs")
    p.add_argument("--handoffs", type=int, default=5, help="transfer handoffs measured (after one warm-up)")
    p.add_argument("--chunk-mib", type=float, default=8.0, help="KV chunk size (kv_transfer.chunk_mib)")
    p.add_argument(
        "--transport",
        choices=["object_store", "shared_memory", "both"],
        default="object_store",
        help="kv_transfer.transport; both: the transfer part with each, alternating handoffs, in this run (the other "
        "parts with object_store)",
    )
    p.add_argument("--rate-prompt-tokens", type=int, default=256, help="prompt length of the prefill-rate requests")
    p.add_argument("--rate-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="prefill-rate requests in flight")
    p.add_argument("--ttst-concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--ttst-prompt-tokens", type=int, default=256)
    p.add_argument("--ttst-output-tokens", type=int, default=16)
    p.add_argument("--ttst-rounds", type=int, default=3, help="rounds of --ttst-concurrency requests per mode")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    add_report_argument(p)


def engine_config(args: argparse.Namespace, worker_id: str):
    from workers.engine import EngineConfig

    longest = max(args.prompt_tokens, args.rate_prompt_tokens, args.ttst_prompt_tokens + args.ttst_output_tokens)
    max_len = 1 << longest.bit_length()
    seqs = max(max(args.ttst_concurrency), args.concurrency)
    return EngineConfig(
        model=str(args.model),
        worker_id=worker_id,
        dtype=args.dtype,
        max_model_len=max_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(512, seqs),
        num_kv_blocks=max(64, 2 * seqs * max_len // 16 + 64),
        block_size=16,
        warmup=False,
        background_compile=False,
        compilation_cache_dir=None,
    )


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def memcpy_gbps(nbytes: int) -> float:
    import numpy as np

    src = np.ones(max(nbytes, 1 << 20) // 4, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return src.nbytes / statistics.median(times) / 1e9


# ------------------------------------------------------------------------------------------ parts


async def transfer_each(args, prefill, decode, transports: dict, rng, vocab) -> dict:
    """The transfer part over each transport, a handoff with each in turn (the machine's drift shared)."""
    rows: dict[str, list[dict]] = {name: [] for name in transports}
    for i in range(args.handoffs + 1):  # the first compiles what the rest reuse
        for name, transport in transports.items():
            prefill.transport = decode.transport = transport
            row = await transfer_one(prefill, decode, f"{name}-t{i}", random_prompt(rng, args.prompt_tokens, vocab))
            if i > 0:
                rows[name].append(row)
    copy = memcpy_gbps(int(statistics.median(r["bytes"] for r in next(iter(rows.values())))))
    out = {}
    for name, got in rows.items():
        summary = {k: statistics.median(r[k] for r in got) for k in got[0]}
        out[name] = {
            "transport": name,
            "prompt_tokens": args.prompt_tokens,
            "chunk_mib": args.chunk_mib,
            "handoffs": got,
            "median": summary,
            "memcpy_gbps": copy,
            "fraction_of_memcpy": summary["gbps"] / copy,
            "import_failures": sum(r["import_failures"] for r in got),
        }
    return out


async def transfer_one(prefill, decode, rid: str, prompt: list[int]) -> dict:
    """One handoff of `prompt` (fresh: no prefix anywhere), timed on both sides."""
    from workers.engine import SamplingParams
    from workers.messages import DecodeRequest, PrefillRequest

    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    dispatch_before, failures_before = prefill.engine.core.export_dispatch_seconds, decode.counters.import_failures
    import_before = decode.engine.core.import_seconds
    handoff = await prefill.prefill(PrefillRequest(rid, prompt, params))
    dispatch = prefill.engine.core.export_dispatch_seconds - dispatch_before
    outs = [o async for o in decode.stream(DecodeRequest(rid, prompt, params, "bench", handoff), None, lambda: prefill.release(rid))]
    assert outs[-1].finished, outs[-1]
    moved = decode.counters.history[-1]
    total = handoff.export_time_s + moved["seconds"]
    return {
        "bytes": moved["bytes"],
        "chunks": moved["chunks"],
        "export_s": handoff.export_time_s,
        "import_s": moved["seconds"],
        "first_chunk_to_ready_s": moved["seconds"] - (moved["first_chunk_seconds"] or 0.0),
        "handoff_s": total,
        "gbps": moved["bytes"] / total / 1e9,
        "prefill_engine_thread_s": dispatch,
        # The decode engine's thread in the import (dispatching the writes, waiting for the last): it steps
        # no other request meanwhile.
        "decode_engine_thread_s": decode.engine.core.import_seconds - import_before,
        "import_failures": decode.counters.import_failures - failures_before,
    }


async def prefill_rate(args, prefill, rng, vocab) -> dict:
    from workers.engine import SamplingParams
    from workers.messages import PrefillRequest

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    async def exported(i, prompt):
        rid = f"x{i}-{time.monotonic_ns()}"
        await prefill.prefill(PrefillRequest(rid, prompt, params))
        await prefill.release(rid)

    async def discarded(i, prompt):
        async for _ in prefill._deltas(f"d{i}-{time.monotonic_ns()}", prompt, params):
            pass

    async def closed_loop(one) -> float:
        # Fresh prompts every run: repeated ones would hit the prefix cache and measure no prefill at all.
        prompts = [random_prompt(rng, args.rate_prompt_tokens, vocab) for _ in range(args.rate_requests)]
        slots = asyncio.Semaphore(args.concurrency)

        async def run(i, prompt):
            async with slots:
                await one(i, prompt)

        start = time.perf_counter()
        await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
        return len(prompts) / (time.perf_counter() - start)

    for _ in range(2):  # warm-up: compiles the shapes both modes reach (batch compositions vary run to run)
        await closed_loop(discarded)
        await closed_loop(exported)
    runs = {"exported": [], "discarded": []}
    for _ in range(3):  # alternated: the machine's speed drifts
        runs["discarded"].append(await closed_loop(discarded))
        runs["exported"].append(await closed_loop(exported))
    ratios = [e / d for e, d in zip(runs["exported"], runs["discarded"])]
    return {
        "prompt_tokens": args.rate_prompt_tokens,
        "requests": args.rate_requests,
        "concurrency": args.concurrency,
        "requests_per_s": {k: statistics.median(v) for k, v in runs.items()},
        "runs": runs,
        "exported_over_discarded": statistics.median(ratios),
    }


async def second_token(args, prefill, decode, rng, vocab) -> dict:
    from workers.engine import SamplingParams
    from workers.messages import DecodeRequest, PrefillRequest

    params = SamplingParams(temperature=0.0, max_tokens=args.ttst_output_tokens, ignore_eos=True)

    async def disaggregated(rid, prompt) -> tuple[float, int]:
        start = time.perf_counter()
        handoff = await prefill.prefill(PrefillRequest(rid, prompt, params))
        second, n = None, len(handoff.first.token_ids)
        async for out in decode.stream(DecodeRequest(rid, prompt, params, "bench", handoff), None, lambda: prefill.release(rid)):
            n += len(out.token_ids)
            if second is None and n >= 2:
                second = time.perf_counter() - start
        return second, n

    async def colocated(rid, prompt) -> tuple[float, int]:
        start = time.perf_counter()
        second, n = None, 0
        async for out in decode.stream(DecodeRequest(rid, prompt, params, "bench")):
            n += len(out.token_ids)
            if second is None and n >= 2:
                second = time.perf_counter() - start
        return second, n

    out = {}
    for c in args.ttst_concurrency:
        modes = {"disaggregated": disaggregated, "colocated": colocated}
        got = {m: {"ttst": [], "tokens_per_s": []} for m in modes}
        for r in range(args.ttst_rounds + 1):  # the first round compiles
            for name, fn in modes.items():
                prompts = [random_prompt(rng, args.ttst_prompt_tokens, vocab) for _ in range(c)]
                start = time.perf_counter()
                results = await asyncio.gather(*(fn(f"{name}-{c}-{r}-{i}", p) for i, p in enumerate(prompts)))
                if r:
                    got[name]["ttst"].append(statistics.median(t for t, _ in results))
                    got[name]["tokens_per_s"].append(sum(n for _, n in results) / (time.perf_counter() - start))
        med = {m: {k: statistics.median(v) for k, v in g.items()} for m, g in got.items()}
        out[str(c)] = {**med, "ttst_disaggregated_over_colocated": med["disaggregated"]["ttst"] / med["colocated"]["ttst"]}
    return out


# ------------------------------------------------------------------------------------------ run


async def measure(args) -> dict:
    from cluster.kv_transport import build_transport
    from workers.worker import DecodeWorker, PrefillWorker

    chunk_bytes = int(args.chunk_mib * (1 << 20))
    names = ["object_store", "shared_memory"] if args.transport == "both" else [args.transport]
    transports = {name: build_transport(name, shared_memory_bytes=1 << 30) for name in names}
    prefill = PrefillWorker(engine_config(args, "p0"), transport=transports[names[0]], chunk_bytes=chunk_bytes)
    decode = DecodeWorker(engine_config(args, "d0"), transport=transports[names[0]])
    vocab = prefill.engine.core.cfg.vocab_size
    rng = random.Random(args.seed)
    try:
        print(f"transfer: {args.handoffs} handoffs of {args.prompt_tokens}-token prompts over {', '.join(names)}", flush=True)
        by_transport = await transfer_each(args, prefill, decode, transports, rng, vocab)
        results = {"transfer": by_transport[names[0]]}
        if len(names) > 1:
            results["transfer_by_transport"] = by_transport
        prefill.transport = decode.transport = transports[names[0]]
        print("prefill rate: exported vs discarded", flush=True)
        results["prefill_rate"] = await prefill_rate(args, prefill, rng, vocab)
        print(f"time to the second token at concurrency {args.ttst_concurrency}", flush=True)
        results["second_token"] = await second_token(args, prefill, decode, rng, vocab)
        return results
    finally:
        prefill.engine.shutdown()
        decode.engine.shutdown()


def run(args: argparse.Namespace) -> int:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        results = asyncio.run(measure(args))
    finally:
        if started:
            ray.shutdown()
    results["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("fn", "report")}
    t = results["transfer"]
    results["targets"] = {
        "bandwidth_fraction_of_memcpy": {"value": t["fraction_of_memcpy"], "target": 0.3, "kv_bytes": t["median"]["bytes"]},
        "prefill_rate_exported_over_discarded": {"value": results["prefill_rate"]["exported_over_discarded"], "target": 0.9},
    }
    for name, other in results.get("transfer_by_transport", {}).items():
        if other is not t:
            results["targets"][f"bandwidth_fraction_of_memcpy_{name}"] = {"value": other["fraction_of_memcpy"], "target": 0.3}
    if "1" in results["second_token"]:
        results["targets"]["ttst_disaggregated_over_colocated_c1"] = {
            "value": results["second_token"]["1"]["ttst_disaggregated_over_colocated"],
            "target_at_most": 1.2,
        }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    for name, tr in results.get("transfer_by_transport", {"": t}).items():
        m = tr["median"]
        print(
            f"handoff{' over ' + name if name else ''}: {m['bytes'] / (1 << 20):.1f} MiB in {m['handoff_s'] * 1e3:.1f} ms "
            f"(export {m['export_s'] * 1e3:.1f}, import {m['import_s'] * 1e3:.1f}; {m['gbps']:.2f} GB/s, "
            f"{tr['fraction_of_memcpy']:.0%} of memcpy {tr['memcpy_gbps']:.1f} GB/s); prefill engine thread "
            f"{m['prefill_engine_thread_s'] * 1e3:.2f} ms, decode engine thread {m['decode_engine_thread_s'] * 1e3:.2f} ms per handoff"
        )
    print(f"prefill rate exported/discarded: {results['prefill_rate']['exported_over_discarded']:.2f}")
    for c, r in results["second_token"].items():
        print(
            f"concurrency {c}: time to 2nd token disaggregated {r['disaggregated']['ttst'] * 1e3:.1f} ms, "
            f"colocated {r['colocated']['ttst'] * 1e3:.1f} ms ({r['ttst_disaggregated_over_colocated']:.2f}x)"
        )
    report_if_asked(args, "handoff", results)
    print(f"wrote {args.json}")
    return 0
