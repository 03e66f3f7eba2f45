"""`--report DIR` for every `moray bench` command: PNG plots and one self-contained `index.html`.

    write_report(kind, result, out_dir, config) -> list[Path]   # kind: a BENCH_COMMANDS name, or "compare"

writes, into `out_dir`, the plots of `PLOTS[kind]` (one PNG each), `result.json` (the result itself, so
the directory stands on its own and `moray bench compare` can read it) and `index.html`: the headline
numbers (`HEADLINES[kind]`), the run's config, every plot by relative path, and the list of the files.
Each bench's `run()` calls `report_if_asked(args, kind, result)` after writing its JSON.

matplotlib is imported inside the functions that draw (`cluster/cli.py` imports every bench module to
build its parser, and `moray --help` must not pay for it), and drawn through `Figure` and the Agg canvas
directly, never `pyplot`, so a report leaves no global figure state in the process that wrote it.
"""

from __future__ import annotations

import argparse
import fnmatch
import html
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Which bench wrote a result, by keys only its JSON has (only `bench engine` names itself in its output;
# files written before this module existed have to be recognised too). First match wins.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "engine": ("kv_bytes_per_token",),  # also `--sizes-only`
    "collectives": ("modes", "summary", "mesh"),
    "routing": ("policies", "oracle"),
    "hybrid-reuse": ("engines", "oracle"),
    "route": ("cached_sequences", "hash_us_per_block"),
    "memory": ("results", "memory_dtype"),
    "fuzz": ("cases_run", "http"),
    "soak": ("per_minute", "rss_timeline"),
    "serve": ("workload",),
    "handoff": ("transfer", "prefill_rate", "second_token"),
    "spec": ("workloads", "draft"),
    "eplb": ("redundant_slots", "without", "with"),
}

# The figures a reader looks at first, as glob patterns over dotted leaf paths (list items by index).
# Shown at the top of the HTML report and marked in `moray bench compare`'s table.
HEADLINES: dict[str, tuple[str, ...]] = {
    "serve": (
        "*.throughput_tokens_per_s",
        "*.ttft_p50_s",
        "*.ttft_p99_s",
        "*.tpot_p50_s",
        "*.e2e_p50_s",
        "*.e2e_p99_s",
        "*.cache_hit_rate",
        "*.fraction_of_oracle",
        "*.ttft_turns_3plus_p50_s",
        "ratios_*.*",
        "*.ratio_structured_over_free.*",
    ),
    "routing": (
        "policies.*.*.hit_rate",
        "policies.*.*.ttft_p50_s",
        "policies.*.*.ttft_p99_s",
        "policies.*.*.max_over_mean_load",
        "policies.*.*.hit_rate_vs_oracle",
        "oracle.*.hit_rate",
        "verdict.*.*",
    ),
    "hybrid-reuse": (
        "engines.*.*.hit_rate",
        "engines.*.*.hit_rate_vs_oracle",
        "engines.*.*.ttft_p50_s",
        "engines.*.*.ttft_p99_s",
        "engines.*.*.state_bytes",
        "verdict.*.*",
    ),
    "engine": (
        "decode.*.tokens_per_s",
        "prefill.tokens_per_s",
        "roofline.*.ratio",
        "roofline.*.measured_step_ms",
        "roofline.*.roofline_step_ms",
        "transformers.ratio.*",
        "llama_cpp.ratio.*",
        "bandwidth.gb_per_s",
        "host_overhead.*.host_not_hidden_ms",
        "kv_bytes_per_token",
        "state_bytes_per_sequence",
    ),
    "collectives": (
        "summary.*.dispatch_ms",
        "summary.*.combine_ms",
        "summary.*.layer_ms",
        "summary.*.dispatch_bytes.*",
        "summary.*.combine_bytes.*",
        "summary.*.dispatch_*_bytes_vs_flat",
    ),
    "route": ("*.p50_ms", "*.p99_ms", "*.decisions_per_s", "*.decisions_per_s_*_threads", "*.meets_targets"),
    "memory": (
        "results.*.weight_bytes",
        "results.*.weight_ratio",
        "results.*.linear_ratio",
        "results.*.decode_tokens_per_s",
        "results.*.decode_speed_ratio",
        "results.*.top1_agreement",
        "results.*.mean_kl",
    ),
    "fuzz": (
        "cases_run.*",
        "*.server_errors",
        "*.timeouts",
        "*.malformed_responses",
        "*.slow_rejections",
        "*.rejection_latency_p50_s",
        "*.rejection_latency_p99_s",
        "*.accepted_invalid",
        "*.rejected_valid",
        "passed",
    ),
    "handoff": (
        "transfer.median.gbps",
        "transfer.median.handoff_s",
        "transfer.median.prefill_engine_thread_s",
        "transfer.fraction_of_memcpy",
        "prefill_rate.exported_over_discarded",
        "second_token.*.ttst_disaggregated_over_colocated",
        "targets.*.value",
    ),
    "soak": (
        "requests",
        "ok",
        "failures",
        "cancelled",
        "e2e_p50_s",
        "e2e_p99_s",
        "rss_growth_from_minute_2.total_growth_bytes",
        "kv_after_drain.drained",
        "kv_after_drain.drain_s",
        "passed",
    ),
}
HEADLINES["spec"] = (
    "workloads.*.*.*.speedup",
    "workloads.*.*.*.acceptance_rate",
    "workloads.*.*.*.mean_acceptance_length",
    "workloads.*.*.*.fraction_of_bound",
    "workloads.*.*.*.fraction_of_engine_step_bound",
    "summary.*.*",
)
HEADLINES["eplb"] = ("summary.*", "summary.*.*")
# Path parts under which nothing is a headline: per-run figures (the medians above them are), and the
# targets the bench compares itself with (inputs, not measurements).
_NOT_HEADLINE_PARTS = {"runs", "targets"}


# ---------------------------------------------------------------------------------------- results


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers, sorted and deduplicated (`--batches 1,8,16`)."""
    try:
        values = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def write_result(args: argparse.Namespace, kind: str, result: dict) -> None:
    """A bench's result: printed as JSON, written to `--json` if given, and reported with `--report`."""
    text = json.dumps(result, indent=2)
    print(text)
    if getattr(args, "json", None):
        Path(args.json).write_text(text + "\n")
    report_if_asked(args, kind, result)


def add_report_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", type=Path, metavar="DIR", help="also write PNG plots and an index.html report into DIR")


def report_if_asked(args: argparse.Namespace, kind: str, result: dict) -> list[Path]:
    """`write_report` into `args.report` when the command was given `--report DIR`; one progress line."""
    out_dir = getattr(args, "report", None)
    if out_dir is None:
        return []
    paths = write_report(kind, result, out_dir, run_config(args))
    plots = sum(p.suffix == ".png" for p in paths)
    print(f"[bench {kind}] report: {plots} plots and {Path(out_dir) / 'index.html'}", file=sys.stderr, flush=True)
    return paths


def run_config(args: argparse.Namespace) -> dict:
    """The command's arguments as JSON-safe values, secrets hidden: the report is meant to be shared."""
    out = {}
    for name, value in sorted(vars(args).items()):
        if name in ("fn", "report") or callable(value):
            continue
        if value is not None and re.search(r"key|secret|password|token$", name):
            value = "(set)"
        elif isinstance(value, str):
            value = re.sub(r"://[^@/]+@", "://***@", value)  # credentials in a Redis or HTTP URL
        elif not isinstance(value, (int, float, bool, list, type(None))):
            value = str(value)
        out[name] = value
    return out


def detect_bench(result: object) -> str | None:
    """The bench that wrote `result` (a BENCH_COMMANDS name), or None when nothing matches."""
    if not isinstance(result, dict):
        return None
    if isinstance(result.get("benchmark"), str):
        return result["benchmark"]
    return next((kind for kind, keys in SIGNATURES.items() if all(k in result for k in keys)), None)


def leaves(tree, prefix: str = ""):
    """(dotted path, value) of every scalar in nested dicts and lists; list items by index."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list):
        items = enumerate(tree)
    else:
        yield prefix, tree
        return
    for key, value in items:
        yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_raw_samples(key: str) -> bool:
    """Keys holding raw per-request or per-run samples (their summaries sit beside them)."""
    return key == "samples" or key.startswith("samples_") or key.endswith(("_samples", "_per_run"))


def is_headline(kind: str, path: str) -> bool:
    parts = path.split(".")
    if any(p in _NOT_HEADLINE_PARTS or is_raw_samples(p) for p in parts):
        return False
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in HEADLINES.get(kind, ()))


def headline_rows(kind: str, result: dict) -> list[tuple[str, object]]:
    return [(path, value) for path, value in leaves(result) if is_headline(kind, path)]


# ---------------------------------------------------------------------------------------- drawing


@dataclass
class Plot:
    path: Path
    caption: str


@dataclass
class Report:
    """What a bench's plot function produces: figures saved as PNG, notes, and extra tables."""

    out_dir: Path
    plots: list[Plot] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tables: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)

    def figure(self, panels: int = 1, width: float = 6.0, height: float = 4.0, rows: int = 1):
        """A constrained-layout figure and a flat list of its `panels` axes (a grid of `rows` rows)."""
        from matplotlib.figure import Figure

        cols = math.ceil(panels / rows)
        fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
        axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
        for ax in axes[panels:]:
            ax.set_visible(False)
        return fig, axes[:panels]

    def save(self, fig, name: str, caption: str) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
        path = self.out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        self.plots.append(Plot(path, caption))

    def note(self, text: str) -> None:
        self.notes.append(text)


def grouped_bars(ax, groups: list[str], series: dict[str, list], fmt: str = "{:.3g}", **bar_kwargs) -> None:
    """One cluster of bars per group, one bar per series, each labelled with its value (None: no bar)."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, values) in enumerate(series.items()):
        x = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        heights = [math.nan if v is None else v for v in values]
        bars = ax.bar(x, heights, width, label=label, **bar_kwargs)
        ax.bar_label(bars, labels=["" if v is None else fmt.format(v) for v in values], fontsize=7)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)


def byte_unit(largest: float) -> tuple[float, str]:
    for divisor, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= divisor:
            return divisor, unit
    return 1, "B"


# ---------------------------------------------------------------------------------------- serve

SERVE_SAMPLES = {"ttft_s": "TTFT", "tpot_s": "TPOT (inter-token)", "e2e_s": "end to end"}


def serve_variants(result: dict) -> dict[str, dict]:
    """Label -> summary of each measured variant: the plain run, `--compare`'s two apps, `--tier-compare`'s
    two tiers, `--structured`'s two kinds (their runs' samples pooled)."""
    out = {}
    if isinstance(result.get("result"), dict):
        out[result.get("workload", "run")] = result["result"]
    for name in ("disaggregated", "colocated", "without_tier", "with_tier"):
        if isinstance(result.get(name), dict):
            out[name.replace("_", " ")] = result[name]
    structured = result.get("structured")
    for kind in ("free", "structured") if isinstance(structured, dict) else ():
        runs = structured[kind].get("runs", [])
        pooled = {k: [x for r in runs for x in r.get("samples", {}).get(k, [])] for k in SERVE_SAMPLES}
        out[kind] = {**structured[kind], "samples": pooled}
    return out


def plot_serve(result: dict, rep: Report) -> None:
    variants = serve_variants(result)
    if not variants:
        rep.note("no measured variant in this result")
        return
    _serve_cdfs(variants, rep)
    _serve_throughput(variants, result.get("concurrency"), rep)
    _serve_hit_rates(variants, rep)


def _serve_cdfs(variants: dict[str, dict], rep: Report) -> None:
    with_samples = {name: v["samples"] for name, v in variants.items() if any(v.get("samples", {}).get(k) for k in SERVE_SAMPLES)}
    if not with_samples:
        rep.note("latency CDFs skipped: the result has no per-request samples (written before they were recorded)")
        return
    fig, axes = rep.figure(len(SERVE_SAMPLES), width=4.5)
    for ax, (key, title) in zip(axes, SERVE_SAMPLES.items()):
        for name, samples in with_samples.items():
            xs = sorted(samples.get(key, []))
            if xs:  # a step up at each request, from 0 at the fastest one
                fractions = [0.0] + [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step([xs[0], *xs], fractions, where="post", label=f"{name} (n={len(xs)})")
        ax.set(title=title, xlabel="seconds", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.locator_params(axis="x", nbins=5)  # long tick labels (0.00245) run into each other otherwise
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    rep.save(fig, "latency_cdf", "Latency CDFs per request: time to first token, time per output token after the first, end to end.")


def _serve_throughput(variants: dict[str, dict], concurrency, rep: Report) -> None:
    """Output tokens/s per variant; a line over concurrency when the variants ran at several levels."""
    points = [(name, v.get("concurrency", concurrency), v.get("throughput_tokens_per_s")) for name, v in variants.items()]
    points = [p for p in points if is_number(p[2])]
    if not points:
        return
    fig, (ax,) = rep.figure()
    levels = {c for _, c, _ in points}
    if len(levels) > 1 and all(is_number(c) for c in levels):
        pts = sorted(points, key=lambda p: p[1])
        ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o")
        for name, c, t in pts:
            ax.annotate(name, (c, t), fontsize=7, textcoords="offset points", xytext=(3, 3))
        ax.set(xlabel="concurrency", title="throughput vs concurrency")
    else:
        grouped_bars(ax, [p[0] for p in points], {"output tokens/s": [p[2] for p in points]}, fmt="{:.1f}")
        ax.set(title=f"throughput at concurrency {concurrency}")
    ax.set(ylabel="output tokens/s")
    ax.grid(alpha=0.3, axis="y")
    rep.save(fig, "throughput", "Output tokens per second of each variant, at the concurrency it ran with.")


def _serve_hit_rates(variants: dict[str, dict], rep: Report) -> None:
    keys = {"cache_hit_rate": "hit rate", "device_hit_rate": "device", "host_hit_rate": "host", "oracle_hit_rate": "oracle"}
    present = {k: label for k, label in keys.items() if any(is_number(v.get(k)) for v in variants.values())}
    if not any(v.get("cache_hit_rate") for v in variants.values()):
        return  # nothing cached anywhere: an empty chart says nothing
    fig, (ax,) = rep.figure()
    grouped_bars(ax, list(variants), {label: [v.get(k) for v in variants.values()] for k, label in present.items()}, fmt="{:.2f}")
    ax.set(ylabel="share of prompt tokens", ylim=(0, 1.1), title="prefix-cache hit rate")
    ax.legend(fontsize=8)
    rep.save(fig, "hit_rate", "Prompt tokens served from the prefix cache (by tier, and an unlimited cache's, where measured).")


# ---------------------------------------------------------------------------------------- routing


def plot_routing(result: dict, rep: Report) -> None:
    policies = result.get("policies", {})
    workloads = sorted({wl for per in policies.values() for wl in per})
    if not workloads:
        rep.note("no policy ran")
        return
    _routing_hit_rates(result, policies, workloads, rep)
    _routing_loads(policies, workloads, rep)
    _routing_ttft(policies, workloads, rep)


def _routing_hit_rates(result: dict, policies: dict, workloads: list[str], rep: Report) -> None:
    fig, axes = rep.figure(len(workloads), width=5.0)
    for ax, wl in zip(axes, workloads):
        oracle = result.get("oracle", {}).get(wl, {}).get("hit_rate")
        names = [p for p in policies if wl in policies[p]]
        rates = [policies[p][wl]["hit_rate"] for p in names]
        bars = ax.bar(names + ["oracle"], rates + [oracle or 0.0], color=["C0"] * len(names) + ["0.6"])
        labels = [f"{r:.2f}" + (f"\n{r / oracle:.0%} of oracle" if oracle else "") for r in rates] + [f"{oracle or 0:.2f}"]
        ax.bar_label(bars, labels=labels, fontsize=7)
        ax.set(title=wl, ylabel="prefix-cache hit rate", ylim=(0, 1.15))
        ax.tick_params(axis="x", labelsize=8)
    rep.save(fig, "hit_rate", "Prompt tokens the engines served from cache, per policy, against the oracle that sees every cache.")


def _routing_loads(policies: dict, workloads: list[str], rep: Report) -> None:
    """Per policy, the prompt tokens each worker was sent, most loaded first (worker names differ
    between policies: each ran on a fresh app)."""
    fig, axes = rep.figure(len(workloads), width=5.0)
    for ax, wl in zip(axes, workloads):
        names = [p for p in policies if wl in policies[p]]
        loads = {p: sorted(policies[p][wl].get("prompt_tokens_per_worker", {}).values(), reverse=True) for p in names}
        workers = max((len(v) for v in loads.values()), default=0)
        series = {
            f"{p} (max/mean {policies[p][wl]['max_over_mean_load']:.2f})": [v[i] if i < len(v) else None for i in range(workers)]
            for p, v in loads.items()
        }
        grouped_bars(ax, [f"#{i + 1}" for i in range(workers)], series, fmt="{:.0f}")
        ax.set(title=wl, xlabel="worker (most loaded first)", ylabel="prompt tokens sent")
        ax.legend(fontsize=7)
    rep.save(fig, "load_per_worker", "Load balance: prompt tokens the router sent each worker, per policy.")


def _routing_ttft(policies: dict, workloads: list[str], rep: Report) -> None:
    fig, axes = rep.figure(len(workloads), width=5.0)
    for ax, wl in zip(axes, workloads):
        names = [p for p in policies if wl in policies[p]]
        series = {q: [policies[p][wl][f"ttft_{q}_s"] for p in names] for q in ("p50", "p99")}
        grouped_bars(ax, names, series, fmt="{:.3f}")
        ax.set(title=wl, ylabel="TTFT (s)")
        ax.legend(fontsize=8)
    rep.save(fig, "ttft", "Time to first token per policy, p50 and p99.")


def plot_hybrid_reuse(result: dict, rep: Report) -> None:
    """`bench routing --hybrid`: the engines (attention-only, hybrid, hybrid with the old snapshot rule) side
    by side, drawn like routing policies."""
    engines = result.get("engines", {})
    workloads = sorted({wl for per in engines.values() for wl in per})
    if not workloads:
        rep.note("no engine ran")
        return
    _routing_hit_rates(result, engines, workloads, rep)
    _routing_ttft(engines, workloads, rep)


# ---------------------------------------------------------------------------------------- engine

ENGINE_PEERS = ("transformers", "llama_cpp")


def plot_engine(result: dict, rep: Report) -> None:
    if "decode" not in result:
        rep.note("sizes only (--sizes-only): nothing was timed, so there is nothing to plot")
        return
    _engine_roofline(result, rep)
    _engine_peers(result, rep)


def _engine_roofline(result: dict, rep: Report) -> None:
    roofline = result.get("roofline", {})
    if not roofline:
        rep.note("no roofline batches in this run")
        return
    batches = list(roofline)
    fig, (ax, ax_ratio) = rep.figure(2)
    series = {k: [roofline[b][f"{k}_step_ms"] for b in batches] for k in ("measured", "roofline")}
    grouped_bars(ax, [f"B={b}" for b in batches], series, fmt="{:.2f}")
    ax.set(ylabel="decode step (ms)", title="measured step vs bytes / bandwidth")
    ax.legend(fontsize=8)
    targets = result.get("targets", {}).get("roofline_ratio_max", {})
    grouped_bars(ax_ratio, [f"B={b}" for b in batches], {"measured / roofline": [roofline[b]["ratio"] for b in batches]}, fmt="{:.2f}x")
    for i, b in enumerate(batches):
        if b in targets:
            ax_ratio.hlines(targets[b], i - 0.4, i + 0.4, colors="C3", linestyles="--", label="target (max)" if i == 0 else None)
    ax_ratio.set(ylabel="ratio", title="roofline ratio (1 = at the memory-bandwidth bound)")
    ax_ratio.legend(fontsize=8)
    rep.save(fig, "roofline", "Decode step time against the memory-bandwidth roofline (weights, experts used, KV, state) per batch.")


def _engine_peers(result: dict, rep: Report) -> None:
    batches = list(result["decode"])
    peers = [p for p in ENGINE_PEERS if isinstance(result.get(p), dict) and "decode" in result[p]]
    for p in ENGINE_PEERS:
        if p not in peers and isinstance(result.get(p), dict):
            rep.note(f"{p}: {result[p].get('reason', 'not run')}")
    fig, axes = rep.figure(2 if peers else 1)
    series = {"moray": [result["decode"][b]["tokens_per_s"] for b in batches]}
    for p in peers:
        series[p] = [result[p]["decode"].get(b, {}).get("tokens_per_s") for b in batches]
    grouped_bars(axes[0], [f"B={b}" for b in batches], series, fmt="{:.0f}")
    axes[0].set(ylabel="decode tokens/s", title="decode throughput vs peers")
    axes[0].legend(fontsize=8)
    if peers:
        ratios = {f"moray / {p}": [result[p].get("ratio", {}).get(b) for b in batches] for p in peers}
        grouped_bars(axes[1], [f"B={b}" for b in batches], ratios, fmt="{:.2f}x")
        axes[1].axhline(1.0, color="0.5", lw=0.8)
        axes[1].set(ylabel="ratio", title="moray's tokens/s over each peer's")
        axes[1].legend(fontsize=8)
    rep.save(fig, "tokens_per_s", "Decode tokens/s per batch, Moray's engine and the peers on the same checkpoint and prompts.")


# ---------------------------------------------------------------------------------------- collectives


def plot_collectives(result: dict, rep: Report) -> None:
    summary = result.get("summary", {})
    if not summary:
        rep.note("no mode ran")
        return
    _collective_bytes(result, summary, rep)
    _collective_times(result.get("modes", {}), rep)


def _collective_bytes(result: dict, summary: dict, rep: Report) -> None:
    modes, levels = list(summary), result.get("axes") or list(next(iter(summary.values()))["dispatch_bytes"])
    largest = max(max(s[f"{p}_bytes"].values(), default=0) for s in summary.values() for p in ("dispatch", "combine"))
    divisor, unit = byte_unit(largest)
    fig, axes = rep.figure(2, width=7.0)
    for ax, program in zip(axes, ("dispatch", "combine")):
        series = {lvl: [summary[m][f"{program}_bytes"].get(lvl, 0) / divisor for m in modes] for lvl in levels}
        grouped_bars(ax, modes, series, fmt="{:.1f}")
        ax.set(title=f"{program}: bytes received per mesh level", ylabel=f"{unit} (all devices)")
        ax.tick_params(axis="x", labelrotation=20)
        ax.legend(title="level", fontsize=8)
    rep.save(
        fig, "bytes_per_level", f"Bytes devices receive per mesh level ({levels[0]} = the slowest), from the compiled HLO, per EP mode."
    )


def _collective_times(modes: dict, rep: Report) -> None:
    timed = {m: r["samples_ms"] for m, r in modes.items() if r.get("samples_ms")}
    if not timed:
        return
    fig, axes = rep.figure(3, width=4.5)
    for ax, program in zip(axes, ("dispatch", "combine", "layer")):
        ax.boxplot([timed[m][program] for m in timed], showfliers=False)
        ax.set_xticks(range(1, len(timed) + 1), list(timed), rotation=30, ha="right", fontsize=7)
        ax.set(title=program, ylabel="ms (process 0)")
        ax.grid(alpha=0.3, axis="y")
    rep.save(
        fig,
        "times",
        "Measured wall times per call (box: quartiles, whiskers: 1.5 IQR) of the dispatch, the combine and the whole MoE layer.",
    )


# ---------------------------------------------------------------------------------------- route


def plot_route(result: dict, rep: Report) -> None:
    backends = {b: r for b, r in result.items() if isinstance(r, dict) and "p50_ms" in r}
    for b, r in result.items():
        if isinstance(r, dict) and "skipped" in r:
            rep.note(f"{b}: skipped ({r['skipped']})")
    if not backends:
        return
    targets = result.get("targets", {})
    fig, (ax_lat, ax_rate) = rep.figure(2)
    quantiles = ("p50", "p90", "p99", "max")
    grouped_bars(ax_lat, list(backends), {q: [r.get(f"{q}_ms") for r in backends.values()] for q in quantiles}, fmt="{:.2f}")
    ax_lat.set(yscale="log", ylabel="decision latency (ms)", title="routing decision latency")
    ax_lat.legend(fontsize=8)
    threads = {k for r in backends.values() for k in r if k.startswith("decisions_per_s_")}
    series = {"1 caller": [r["decisions_per_s"] for r in backends.values()]}
    for key in sorted(threads):
        series[key.removeprefix("decisions_per_s_").replace("_", " ")] = [r.get(key) for r in backends.values()]
    grouped_bars(ax_rate, list(backends), series, fmt="{:.0f}")
    target = min((t.get("decisions_per_s", math.inf) for t in targets.values()), default=math.inf)
    if math.isfinite(target):
        ax_rate.axhline(target, color="C3", ls="--", label=f"target {target:,.0f}/s")
    ax_rate.set(ylabel="decisions/s", title="throughput")
    ax_rate.legend(fontsize=8)
    rep.save(fig, "decisions", "Routing decision latency percentiles (log scale) and decisions per second, per index backend.")


# ---------------------------------------------------------------------------------------- memory


def plot_memory(result: dict, rep: Report) -> None:
    rows = result.get("results", {})
    if not rows:
        rep.note("no format measured")
        return
    names = list(rows)
    divisor, unit = byte_unit(max(r["weight_bytes"] for r in rows.values()))
    fig, axes = rep.figure(4, width=5.0, rows=2)
    quantised = lambda key: [r[key] / divisor if r["quantized_leaves"] else None for r in rows.values()]  # noqa: E731
    series = {
        "all weights": [r["weight_bytes"] / divisor for r in rows.values()],
        "quantised layers": quantised("linear_bytes"),
        "the same layers unquantised": quantised("linear_bytes_bf16"),
    }
    grouped_bars(axes[0], names, series, fmt="{:.2f}")
    axes[0].set(ylabel=unit, title=f"device bytes ({result.get('memory_dtype', '')} weights)")
    axes[0].legend(fontsize=8)
    grouped_bars(axes[1], names, {"tokens/s": [r["decode_tokens_per_s"] for r in rows.values()]}, fmt="{:.0f}")
    axes[1].set(ylabel="decode tokens/s", title=f"decode speed ({result.get('compute_dtype', '')} compute)")
    grouped_bars(axes[2], names, {"top-1": [r["top1_agreement"] for r in rows.values()]}, fmt="{:.2f}")
    axes[2].set(ylabel="top-1 agreement", ylim=(0, 1.1), title="next token vs the unquantised model")
    grouped_bars(axes[3], names, {"KL": [r["mean_kl"] for r in rows.values()]}, fmt="{:.2g}")
    axes[3].set(ylabel="mean KL(unquantised || format)", title="distribution distance")
    rep.save(fig, "formats", "Per weight format: device bytes, decode throughput, and quality against the unquantised model.")


# ---------------------------------------------------------------------------------------- fuzz


def _status_colour(status: str) -> str:
    if status in ("200", "OK"):
        return "C2"
    if (status.isdigit() and int(status) >= 500) or status in ("UNKNOWN", "INTERNAL", "DATA_LOSS", "UNAVAILABLE", "timeout"):
        return "C3"
    return "C1"


def plot_fuzz(result: dict, rep: Report) -> None:
    protocols = [p for p in ("http", "grpc") if result.get(p, {}).get("cases")]
    if not protocols:
        rep.note("no case ran")
        return
    fig, axes = rep.figure(len(protocols) + 1, width=5.0)
    for ax, proto in zip(axes, protocols):
        counts = result[proto]["by_status"]
        bars = ax.bar(list(counts), list(counts.values()), color=[_status_colour(s) for s in counts])
        ax.bar_label(bars, fontsize=7)
        ax.set(title=f"{proto}: {result[proto]['cases']} cases by answer", ylabel="cases")
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    findings = ("server_errors", "timeouts", "malformed_responses", "slow_rejections", "accepted_invalid", "rejected_valid")
    grouped_bars(axes[-1], [f.replace("_", " ") for f in findings], {p: [result[p][f] for f in findings] for p in protocols}, fmt="{:.0f}")
    axes[-1].tick_params(axis="x", labelrotation=45)
    axes[-1].set(title="findings (the first four fail the run)", ylabel="cases")
    axes[-1].set_ylim(bottom=0)
    axes[-1].legend(fontsize=8)
    rep.save(
        fig,
        "answers",
        "Fuzz cases by HTTP status / gRPC code (green: answered, orange: refused, red: server error or hang), and the findings.",
    )
    _fuzz_by_kind(result, protocols, rep)


def _fuzz_by_kind(result: dict, protocols: list[str], rep: Report) -> None:
    fig, axes = rep.figure(len(protocols), width=6.0, height=5.0)
    for ax, proto in zip(axes, protocols):
        by_kind = result[proto]["by_kind"]
        kinds = list(by_kind)
        left = [0] * len(kinds)
        for status in sorted({s for v in by_kind.values() for s in v}):
            widths = [by_kind[k].get(status, 0) for k in kinds]
            ax.barh(kinds, widths, left=left, label=status)
            left = [a + b for a, b in zip(left, widths)]
        ax.set(title=f"{proto}: answers per kind of case", xlabel="cases")
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(fontsize=7, ncols=2)
    rep.save(fig, "by_kind", "Answers per kind of case (valid, each mutation family, malformed bodies, framing).")


# ---------------------------------------------------------------------------------------- soak


def plot_soak(result: dict, rep: Report) -> None:
    minutes = result.get("per_minute", [])
    if minutes:
        _soak_minutes(minutes, rep)
    timeline = result.get("rss_timeline", [])
    if timeline:
        _soak_rss(timeline, rep)


def _soak_minutes(minutes: list[dict], rep: Report) -> None:
    xs = [m["minute"] for m in minutes]
    fig, (ax_lat, ax_n) = rep.figure(2)
    for key, style in (("e2e_p50_s", "-o"), ("e2e_p99_s", "--o"), ("ttft_p50_s", "-s"), ("ttft_p99_s", "--s")):
        ax_lat.plot(xs, [m[key] for m in minutes], style, label=key.removesuffix("_s").replace("_", " "))
    ax_lat.set(xlabel="minute", ylabel="seconds", title="latency per minute")
    ax_lat.legend(fontsize=8)
    bottom = [0] * len(xs)
    for outcome, colour in (("ok", "C2"), ("cancelled", "C1"), ("failed", "C3")):
        values = [m[outcome] for m in minutes]
        ax_n.bar(xs, values, bottom=bottom, color=colour, label=outcome)
        bottom = [a + b for a, b in zip(bottom, values)]
    ax_n.set(xlabel="minute", ylabel="requests", title="requests per minute")
    ax_n.legend(fontsize=8)
    for ax in (ax_lat, ax_n):
        ax.set_xticks(xs)  # whole minutes
    rep.save(fig, "per_minute", "End-to-end latency and TTFT per minute of load (p50, p99), and the requests each minute by outcome.")


def _soak_rss(timeline: list[dict], rep: Report) -> None:
    ts = [s["t_s"] for s in timeline]
    divisor, unit = byte_unit(max(s["total_bytes"] for s in timeline))
    fig, (ax_total, ax_each) = rep.figure(2)
    ax_total.plot(ts, [s["total_bytes"] / divisor for s in timeline], "-o")
    ax_total.set(xlabel="seconds", ylabel=unit, title="RSS of every Moray process together")
    names = sorted({name for s in timeline for name in s["by_process"]})
    for name in names:
        ax_each.plot(ts, [s["by_process"].get(name, math.nan) / divisor for s in timeline], label=name)
    ax_each.set(xlabel="seconds", ylabel=unit, title="RSS per process")
    ax_each.legend(fontsize=6)
    rep.save(fig, "rss", "Resident memory over the soak, in total and per process (a steady climb after warm-up is a leak).")


# ---------------------------------------------------------------------------------------- compare


def plot_compare(result: dict, rep: Report, most: int = 60) -> None:
    """B/A of the numeric leaves that differ, sorted; at most `most` of them, the farthest from 1."""
    rows = [r for r in result["differences"] if is_number(r["ratio"]) and 0 < r["ratio"] < math.inf]
    rows = sorted(rows, key=lambda r: -abs(math.log(r["ratio"])))[:most]
    rows.sort(key=lambda r: r["ratio"])
    header = ["path", "A", "B", "B/A", "headline"]
    rep.tables.append(("every numeric leaf that differs", header, [_compare_cells(r) for r in result["differences"]]))
    if not rows:
        rep.note("no numeric leaf differs with a positive ratio: nothing to plot")
        return
    fig, (ax,) = rep.figure(width=9.0, height=max(3.0, 0.22 * len(rows) + 1.2))
    labels = [r["path"] if len(r["path"]) <= 70 else "…" + r["path"][-69:] for r in rows]
    # Bars from 1 to B/A, so a drop points left and a rise right, alike on the log scale.
    ax.barh(labels, [r["ratio"] - 1 for r in rows], left=1, color=["C3" if r["headline"] else "C0" for r in rows])
    ax.set_xscale("log")
    ax.axvline(1.0, color="0.3", lw=0.8)
    ax.tick_params(axis="y", labelsize=7)
    ax.set(xlabel="B / A (log scale)", title=f"{result['bench']}: B / A of the leaves that differ (red: headline)")
    shown = "" if len(rows) == len(result["differences"]) else f" The {len(rows)} farthest from 1 of {len(result['differences'])}."
    rep.save(fig, "ratios", f"B / A for every numeric leaf that differs, sorted.{shown}")


def _compare_cells(row: dict) -> list[str]:
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.4g}"
    return [row["path"], _fmt(row["a"]), _fmt(row["b"]), ratio, "*" if row["headline"] else ""]


def _compare_headlines(result: dict) -> list[tuple[str, object]]:
    return [(r["path"], f"{_fmt(r['a'])} -> {_fmt(r['b'])} (B/A {_compare_cells(r)[3]})") for r in result["differences"] if r["headline"]]


# ---------------------------------------------------------------------------------------- handoff


def plot_handoff(result: dict, rep: Report) -> None:
    t = result["transfer"]
    fig, axes = rep.figure(3, width=5.0)
    parts = {
        "export (prefill side)": [h["export_s"] * 1e3 for h in t["handoffs"]],
        "import (decode side)": [h["import_s"] * 1e3 for h in t["handoffs"]],
    }
    grouped_bars(axes[0], [str(i + 1) for i in range(len(t["handoffs"]))], parts, fmt="{:.1f}")
    axes[0].set(xlabel="handoff", ylabel="ms", title=f"{t['median']['bytes'] / (1 << 20):.1f} MiB per handoff")
    axes[0].legend(fontsize=8)
    grouped_bars(axes[1], ["handoff", "memcpy"], {"GB/s": [t["median"]["gbps"], t["memcpy_gbps"]]}, fmt="{:.2f}")
    axes[1].set(ylabel="GB/s", title=f"bandwidth: {t['fraction_of_memcpy']:.0%} of memcpy")
    st = result["second_token"]
    grouped_bars(
        axes[2],
        [f"c={c}" for c in st],
        {m: [st[c][m]["ttst"] * 1e3 for c in st] for m in ("disaggregated", "colocated")},
        fmt="{:.0f}",
    )
    axes[2].set(ylabel="ms", title="time to the second token")
    axes[2].legend(fontsize=8)
    rep.save(fig, "handoff", "KV handoff time per handoff, its bandwidth against memcpy, and the time to the second token.")


PLOTS = {
    "handoff": plot_handoff,
    "serve": plot_serve,
    "routing": plot_routing,
    "hybrid-reuse": plot_hybrid_reuse,
    "engine": plot_engine,
    "collectives": plot_collectives,
    "route": plot_route,
    "memory": plot_memory,
    "fuzz": plot_fuzz,
    "soak": plot_soak,
    "compare": plot_compare,
    "spec": None,  # set below (plot_spec)
}


# ---------------------------------------------------------------------------------------- the page


def write_report(kind: str, result: dict, out_dir: Path | str, config: dict | None = None) -> list[Path]:
    """Plots, `result.json` and `index.html` for one bench result, into `out_dir`; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rep = Report(out_dir)
    PLOTS[kind](result, rep)
    data = out_dir / "result.json"
    data.write_text(json.dumps(result, indent=2, default=str) + "\n")
    page = out_dir / "index.html"
    files = [p.path for p in rep.plots] + [data, page]
    headlines = _compare_headlines(result) if kind == "compare" else headline_rows(kind, result)
    page.write_text(render_html(kind, headlines, config or {}, rep, [f.name for f in files]))
    return files


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0 2em; } img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; } .note { color: #8a5a00; }
"""


def render_html(kind: str, headlines: list[tuple[str, object]], config: dict, rep: Report, files: list[str]) -> str:
    title = f"moray bench {kind}"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title><style>{_CSS}</style></head><body>"]
    parts.append(f"<h1>{_e(title)}</h1>")
    parts += [f"<p class='note'>{_e(n)}</p>" for n in rep.notes]
    parts.append("<h2>Headline numbers</h2>" + _table(["figure", "value"], [[path, _fmt(v)] for path, v in headlines]))
    for plot in rep.plots:
        name = plot.path.name
        parts.append(f"<figure><img src='{_e(name)}' alt='{_e(plot.caption)}'><figcaption>{_e(plot.caption)}</figcaption></figure>")
    for heading, header, rows in rep.tables:
        parts.append(f"<h2>{_e(heading)}</h2>" + _table(header, rows))
    parts.append("<h2>Config</h2>" + _table(["setting", "value"], [[k, _fmt(v)] for k, v in config.items()]))
    links = "".join(f"<li><a href='{_e(f)}'>{_e(f)}</a></li>" for f in files)
    parts.append(f"<h2>Files in this directory</h2><ul>{links}</ul>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _table(header: list[str], rows: list[list[str]]) -> str:
    if not rows:
        return "<p>(none)</p>"
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(text: str) -> str:
    numeric = bool(re.fullmatch(r"[-+0-9.,e%x]+", text))
    return f"<td class='num'>{_e(text)}</td>" if numeric else f"<td>{_e(text)}</td>"


def _fmt(value) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, default=str)
    return str(value)


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def plot_spec(result: dict, rep: Report) -> None:
    """`bench spec`: per workload, each engine's decode speed-up over no speculation by batch, and the bound."""
    for wl, per in result.get("workloads", {}).items():
        batches = list(per)
        names = [n for n in per[batches[0]] if n != "none"]
        if not names:
            continue
        fig, (ax,) = rep.figure(1)
        grouped_bars(ax, [f"B={b}" for b in batches], {n: [per[b][n]["speedup"] for b in batches] for n in names}, fmt="{:.2f}x")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(ylabel="decode tokens/s vs no speculation", title=f"{wl}: speed-up by batch")
        ax.legend(fontsize=8)
        rep.save(fig, f"spec_{wl}", f"{wl}: speed-up of each method and k over the same engine without speculation")


PLOTS["spec"] = plot_spec


def plot_eplb(result: dict, rep: Report) -> None:
    """`bench eplb`: the busiest EP rank over the mean, per window, without and with rebalancing."""
    fig, (ax,) = rep.figure(1)
    for name in ("without", "with"):
        ys = [w["rank_max_over_mean"] for w in result.get(name, {}).get("windows", [])]
        ax.plot(range(len(ys)), ys, marker="o", label=name)
    if result.get("drift_at_window"):
        ax.axvline(result["drift_at_window"] - 0.5, color="grey", linestyle="--", linewidth=0.8)
    ax.axhline(1.15, color="grey", linewidth=0.8)
    ax.set(xlabel="window", ylabel="max / mean tokens per EP rank", title="expert load balance")
    ax.legend(fontsize=8)
    rep.save(fig, "eplb", "Busiest EP rank over the mean per window (worst MoE layer); dashed: the hot experts move.")


PLOTS["eplb"] = plot_eplb
