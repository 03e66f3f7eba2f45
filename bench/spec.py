"""`moray bench spec`: speculative decoding on trained checkpoints, against the same engine without it.

Models: the trained target MoE and draft of `workers/models/train_tiny.py` (trained once on the Python
standard library's source, ~8 minutes on 2 cores, then cached); `--quick` takes the test-sized pair
(seconds). With `--methods mtp` the target is instead train_tiny's DeepSeek-V3 MoE trained with its
multi-token-prediction head (no draft model shares its tokenizer: `draft` cannot run beside it unless
--target and --draft are given). Random weights accept nothing, so they are never used here.

Workloads (greedy, `--max-tokens` each, EOS ignored so every run decodes the same number of tokens):
- code: continuations of Python files the models never saw (standard-library modules outside the
  training corpus), `--prompt-len` tokens each;
- chat: ChatML-templated questions in English (the models know code, not chat: the hard case).

Per workload, batch (`--batches`) and engine (no speculation, then each `--methods` x `--k`), runs
alternating engines (`--runs`, medians):
- decode tokens/s: tokens generated after each request's first, over the wall time of the engine steps
  that made them (each engine in its default mode: asynchronous scheduling for the baseline; a
  speculating engine plans each step from the last one's tokens). A run decodes the batch again until
  its steps took `--min-run-s`: at batch 1 one pass of 64 tokens is ~60 ms here, and in windows that
  short the same two engines measured 0.90x and 1.02x in two processes. Repeating passes also lets the speed
  gate settle: over single passes it was still measuring both modes;
- speed-up: the median of each run's tokens/s over the baseline run beside it (paired: the machine's
  speed drifts between runs, and a ratio of two medians taken at different moments carries the drift);
- acceptance rate (accepted / draft tokens) and mean acceptance length (1 + accepted / verify runs);
- the verify step's cost against a one-token step at that batch (`verify_cost`): both timed on one
  synchronous engine, B sequences with k drafts each vs none;
- the bound the issue sets: mean acceptance length x t(1-token step) / t(verify step) (on an MoE the
  verify step reads the union of the k + 1 tokens' experts), and measured speed-up / max(1, bound) (an
  engine that turns speculation off where it cannot pay is at 1.0 there);
- the same bound against the baseline engine's own step (`engine_step_bound`): its decode step is
  asynchronous (the host's work hidden behind the device's), a verify step is not (its drafts follow the
  last step's tokens), so t(1-token step) is B / its tokens/s. The gap between the two bounds is the
  overlap a speculating step gives up; the gap from this one to the measured figure is the rest
  (proposing, the gate's probes, the verify step's host work).

JSON to `--json`, plots with `--report DIR`. No jax at import time (registered in `cluster.cli`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.report import add_report_argument, int_list, write_result

# Modules of the standard library outside the training corpus (workers/models/tokenizer.py's list).
HELD_OUT = (
    "fileinput",
    "glob",
    "zipfile/__init__",
    "sched",
    "netrc",
    "filecmp",
    "graphlib",
    "numbers",
    "operator",
    "queue",
    "quopri",
    "reprlib",
)
QUESTIONS = [
    "How do I read a file line by line in Python?",
    "What is the difference between a list and a tuple?",
    "Explain what a context manager does.",
    "How can I sort a dictionary by its values?",
    "Write a function that checks whether a number is prime.",
    "Why does my recursive function hit the recursion limit?",
    "How do I parse command line arguments?",
    "What does the yield keyword do?",
]
TARGETS = {"fraction_of_bound": 0.85, "speedup_batch_1": 1.3, "never_below": 0.95}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, help="where to write the results")
    p.add_argument("--target", type=Path, help="target checkpoint (default: the trained target, trained if not cached)")
    p.add_argument("--draft", type=Path, help="draft checkpoint for --methods draft (default: the trained draft)")
    p.add_argument("--quick", action="store_true", help="the test-sized trained pair (trains in seconds): a smoke run")
    p.add_argument(
        "--methods",
        default="ngram,draft",
        help="comma-separated: ngram, draft, mtp (default ngram,draft; mtp runs on the trained MTP target)",
    )
    p.add_argument("--k", type=int_list, default=[1, 3], help="num_speculative_tokens values (default 1,3)")
    p.add_argument("--batches", type=int_list, default=[1, 4, 8, 16, 32], help="decode batch sizes (default 1,4,8,16,32)")
    p.add_argument("--workloads", default="code,chat", help="comma-separated: code, chat (default both)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--prompt-len", type=int, default=128, help="code prompt length in tokens (default 128)")
    p.add_argument("--runs", type=int, default=3, help="alternating timed runs per figure (default 3)")
    p.add_argument(
        "--min-run-s",
        type=float,
        default=0.5,
        help="a timed run decodes its batch again until its steps took this long (default 0.5)",
    )
    p.add_argument("--dtype", default="float32", help="compute dtype (default float32: bf16 is slow on CPU)")
    add_report_argument(p)


def _progress(msg: str) -> None:
    print(f"[bench spec] {msg}", file=sys.stderr, flush=True)


def workload_prompts(tokenizer, name: str, n: int, prompt_len: int) -> list[list[int]]:
    """`n` prompts of the workload (repeated cyclically if it has fewer)."""
    import sysconfig

    if name == "code":
        root = Path(sysconfig.get_paths()["stdlib"])
        out = []
        for mod in HELD_OUT:
            path = root / f"{mod}.py"
            if not path.is_file():
                continue
            ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
            out += [ids[i : i + prompt_len] for i in range(0, len(ids) - prompt_len, 4 * prompt_len)][:4]
    elif name == "chat":
        out = [
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True) for q in QUESTIONS
        ]
    else:
        raise SystemExit(f"unknown workload {name!r} (code, chat)")
    if not out:
        raise SystemExit(f"workload {name}: no prompts")
    return [list(out[i % len(out)]) for i in range(n)]


def _engine(model: Path, args, speculative: dict | None, **overrides):
    from workers.engine import EngineConfig, EngineCore

    max_b = max(args.batches)
    cfg = EngineConfig(
        model=str(model),
        dtype=args.dtype,
        max_num_seqs=max_b,
        max_num_batched_tokens=max(512, max_b * 8),
        max_model_len=1024,
        # Few shapes: a run keeps several engines (and their compiled programs) alive at once, and XLA:CPU
        # ran out of memory maps compiling the default grid for all of them.
        token_buckets=[8, 32, 128, max(512, max_b * 8)],
        page_buckets=[4, 16, 64],
        kv_cache_memory_bytes=64 << 20,
        # Every program compiled before timing, here and not on a background thread: a proposer's shapes
        # (a head catching up after the speed gate kept speculation off) first met in a timed run, or
        # compiled beside it, cost that run a compile.
        warmup=True,
        background_compile=False,
        speculative=speculative,
        compilation_cache_dir=None,
        **overrides,
    )
    return EngineCore(cfg, show_progress=False)


def timed_run(engine, prompts: list[list[int]], max_tokens: int, min_s: float = 0.0) -> dict:
    """`decode_run` repeated until the decode steps took `min_s` in all: tokens/s over all of them, and the
    counters summed (a window of a few tens of milliseconds says little on a noisy machine)."""
    passes = [decode_run(engine, prompts, max_tokens)]
    while sum(p["seconds"] for p in passes) < min_s:
        passes.append(decode_run(engine, prompts, max_tokens))
    total = {k: sum(p[k] for p in passes) for k in passes[0] if k != "tokens_per_s"}
    return {**total, "tokens_per_s": total["tokens"] / total["seconds"], "passes": len(passes)}


def decode_run(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Prefill (untimed) then decode to the end; tokens/s over the decode steps, and the spec counters."""
    from workers.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    got = {rid: 0 for rid in ids}
    while any(v == 0 for v in got.values()):
        for d in engine.step():
            got[d.request_id] += len(d.token_ids)
    before = _spec_counts(engine)
    first = sum(got.values())
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        for d in engine.step():
            got[d.request_id] += len(d.token_ids)
        steps += 1
    elapsed = time.perf_counter() - start
    after = _spec_counts(engine)
    tokens = sum(got.values()) - first
    counts = {k: after[k] - before[k] for k in after}
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed, "steps": steps, "tokens": tokens, **counts}


def _spec_counts(engine) -> dict:
    s = engine.speculator.stats if engine.speculator is not None else None
    return {
        "drafts": s.num_drafts if s else 0,
        "draft_tokens": s.num_draft_tokens if s else 0,
        "accepted": s.num_accepted_tokens if s else 0,
    }


class _Fixed:
    """Always proposes `limit` copies of the last token: a verify step of full size, whatever it accepts."""

    def propose(self, request, limit):
        return [request.all_token_ids[-1]] * limit


class _Nothing:
    def propose(self, request, limit):
        return []


def verify_cost(engine, prompts: list[list[int]], k: int, steps: int = 12) -> dict:
    """Median wall time of a synchronous step with B sequences x (1 + k) tokens, and x 1 token."""
    from workers.engine import SamplingParams

    out = {}
    for label, proposer in (("one_token_ms", _Nothing()), ("verify_ms", _Fixed())) * 2:  # the first pass compiles
        engine.speculator.proposer = proposer
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"c{label}{i}-{time.monotonic_ns()}", p, params)
        engine.step()  # prefill
        times = []
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        out[label] = statistics.median(times[1:-2] or times) * 1e3
    out["ratio"] = out["verify_ms"] / out["one_token_ms"]
    return out


def run(args) -> int:
    from workers.models import train_tiny
    from workers.models.tokenizer import Tokenizer

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in ("ngram", "draft", "mtp"):
            raise SystemExit(f"unknown method {m!r} (ngram, draft, mtp)")
    if {"draft", "mtp"} <= set(methods) and not (args.target and args.draft):
        raise SystemExit("--methods with both draft and mtp needs --target (with a head) and --draft (same tokenizer)")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    _progress("models (training them once if not cached)")
    if "mtp" in methods:
        default_target = train_tiny.TEST_MTP_TARGET if args.quick else train_tiny.MTP_TARGET
    else:
        default_target = train_tiny.TEST_TARGET if args.quick else train_tiny.TARGET
    target = args.target or train_tiny.trained_model(default_target)
    draft_spec = train_tiny.TEST_DRAFT if args.quick else train_tiny.DRAFT
    draft = args.draft or (train_tiny.trained_model(draft_spec) if "draft" in methods else None)
    tokenizer = Tokenizer.from_dir(target)
    configs = {"none": None}
    for m in methods:
        for k in args.k:
            spec = {"method": m, "num_speculative_tokens": k}
            if m == "draft":
                spec["model"] = str(draft)
            configs[f"{m}-k{k}"] = spec
    engines = {name: _engine(target, args, spec) for name, spec in configs.items()}
    result = {"target": str(target), "draft": str(draft) if draft else None, "targets": TARGETS, "workloads": {}}
    for wl in workloads:
        per = result["workloads"][wl] = {}
        for b in args.batches:
            prompts = workload_prompts(tokenizer, wl, b, args.prompt_len)
            samples = {name: [] for name in engines}
            for engine in engines.values():  # untimed: compiles the shapes this batch needs
                decode_run(engine, prompts, args.max_tokens)
            for r in range(args.runs):
                for name, engine in engines.items():
                    samples[name].append(timed_run(engine, prompts, args.max_tokens, args.min_run_s))
                _progress(f"{wl} B={b} run {r + 1}/{args.runs}")
            per[str(b)] = summarise(samples, engines, prompts)
            if args.json:  # what is measured so far survives a run that dies later
                args.json.write_text(json.dumps(result, indent=2) + "\n")
    result["summary"] = summary(result)
    write_result(args, "spec", result)
    return 0


def summarise(samples: dict, engines: dict, prompts) -> dict:
    base = statistics.median(s["tokens_per_s"] for s in samples["none"])
    out = {"none": {"tokens_per_s": base}}
    costs: dict[int, dict] = {}
    for name, runs in samples.items():
        if name == "none":
            continue
        k = engines[name].config.speculative.num_speculative_tokens
        drafts = sum(s["drafts"] for s in runs)
        draft_tokens = sum(s["draft_tokens"] for s in runs)
        accepted = sum(s["accepted"] for s in runs)
        tps = statistics.median(s["tokens_per_s"] for s in runs)
        speedup = paired_speedup(runs, samples["none"])
        if k not in costs:  # one synchronous measurement per k (the step's shape does not depend on the method)
            costs[k] = verify_cost(_cost_engine(engines[name]), prompts, k)
        mean_len = 1 + accepted / drafts if drafts else 1.0
        bound = mean_len / costs[k]["ratio"]
        engine_step_ms = len(prompts) / base * 1e3
        engine_bound = mean_len * engine_step_ms / costs[k]["verify_ms"]
        out[name] = {
            "tokens_per_s": tps,
            "speedup": speedup,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_acceptance_length": mean_len,
            "drafts_per_run": drafts / len(runs),
            "passes_per_run": statistics.median(s["passes"] for s in runs),
            "verify_cost": costs[k],
            "bound": bound,
            # Against max(1, bound): where speculating cannot pay, the best an engine can do is not to.
            "fraction_of_bound": speedup / max(1.0, bound),
            "engine_step_ms": engine_step_ms,
            "engine_step_bound": engine_bound,
            "fraction_of_engine_step_bound": speedup / max(1.0, engine_bound),
        }
    return out


def paired_speedup(runs: list[dict], baseline: list[dict]) -> float:
    """The median of each run's tokens/s over the baseline run beside it (runs alternate engines)."""
    return statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, baseline, strict=True))


_COST_ENGINES: dict[int, object] = {}


def _cost_engine(engine):
    """A synchronous twin of a speculating engine (same model and k) whose proposer the cost timing sets."""
    k = engine.config.speculative.num_speculative_tokens
    if k not in _COST_ENGINES:
        from workers.engine import EngineCore

        # No back-off: the fixed drafts are rejected, and the step must keep its full size.
        spec = {"method": "ngram", "num_speculative_tokens": k, "min_acceptance": 0.0}
        data = {**engine.config.model_dump(), "async_scheduling": False, "speculative": spec}
        _COST_ENGINES[k] = EngineCore(type(engine.config).model_validate(data), show_progress=False)
    return _COST_ENGINES[k]


def summary(result: dict) -> dict:
    """Best method at batch 1 per workload, the lowest speed-up anywhere, and the mean fraction of bound."""
    out = {}
    for wl, per in result["workloads"].items():
        rows = {(b, name): f for b, engines in per.items() for name, f in engines.items() if name != "none"}
        if not rows:
            continue
        best1 = max((f["speedup"], name) for (b, name), f in rows.items() if b == "1") if "1" in per else (None, None)
        out[wl] = {
            "best_at_batch_1": {"engine": best1[1], "speedup": best1[0]},
            "lowest_speedup": min(f["speedup"] for f in rows.values()),
            "median_fraction_of_bound": statistics.median(f["fraction_of_bound"] for f in rows.values()),
            "median_fraction_of_engine_step_bound": statistics.median(f["fraction_of_engine_step_bound"] for f in rows.values()),
        }
    return out
