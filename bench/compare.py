"""`moray bench compare A.json B.json [--report DIR]`: what changed between two results of the same bench.

Walks both files (nested objects and lists, list items by index) and prints every numeric leaf present in
both whose value differs: its path, A, B and B/A, headline figures (`bench.report.HEADLINES`) marked `*`.
Raw samples (keys `samples`, `samples_*`, `*_samples`, `*_per_run`) are left out unless `--samples`: they
differ on every run and their medians are compared anyway. Leaves found in only one file are counted and
listed after the table. Exit 2 when a file is unreadable, is not a result of a known bench, or the two are
results of different benches. With `--report DIR`, a bar chart of the B/A ratios (sorted) and an HTML page.

    moray bench compare before.json after.json --report /tmp/diff
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from bench.report import add_report_argument, detect_bench, is_headline, is_number, is_raw_samples, leaves, report_if_asked


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", type=Path, metavar="A.json", help="the baseline result (or a report directory's result.json)")
    p.add_argument("b", type=Path, metavar="B.json", help="the result compared with it")
    p.add_argument("--samples", action="store_true", help="also compare raw per-request / per-run samples")
    add_report_argument(p)


def load_result(path: Path) -> tuple[dict, str]:
    """(result, bench name); ValueError (exit 2) with the reason when it is not a readable bench result."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    kind = detect_bench(result)
    if kind is None:
        raise ValueError(f"{path} is not the JSON result of a known `moray bench` command")
    return result, kind


def numeric_leaves(result: dict, samples: bool = False) -> dict[str, float]:
    """Dotted path -> value of every number (not bool) in the result, raw samples left out unless asked."""
    out = {}
    for path, value in leaves(result):
        if is_number(value) and (samples or not any(is_raw_samples(part) for part in path.split("."))):
            out[path] = value
    return out


def compare(a: dict, b: dict, kind: str, samples: bool = False) -> dict:
    """The comparison as a JSON-able dict: differing leaves in A's order, and the leaves only one side has."""
    left, right = numeric_leaves(a, samples), numeric_leaves(b, samples)
    differences = [
        {
            "path": path,
            "a": va,
            "b": right[path],
            "ratio": right[path] / va if va else None,
            "headline": is_headline(kind, path),
        }
        for path, va in left.items()
        if path in right and not _same(va, right[path])
    ]
    return {
        "bench": kind,
        "compared_leaves": sum(path in right for path in left),
        "differences": differences,
        "only_in_a": [p for p in left if p not in right],
        "only_in_b": [p for p in right if p not in left],
    }


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))  # JSON may hold NaN (a median of nothing)


def format_table(comparison: dict) -> list[str]:
    rows = [
        (("*" if d["headline"] else " ") + " " + d["path"], _num(d["a"]), _num(d["b"]), _ratio(d["ratio"]))
        for d in comparison["differences"]
    ]
    header = ("  path", "A", "B", "B/A")
    width = max([len(r[0]) for r in rows] + [len(header[0])])
    cols = [max([len(r[i]) for r in rows] + [len(header[i])]) for i in (1, 2, 3)]
    line = lambda r: f"{r[0]:<{width}}  {r[1]:>{cols[0]}}  {r[2]:>{cols[1]}}  {r[3]:>{cols[2]}}"
    return [line(header)] + [line(r) for r in rows]


def _num(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:.6g}"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.4f}"


def run(args: argparse.Namespace) -> int:
    a, kind_a = load_result(args.a)
    b, kind_b = load_result(args.b)
    if kind_a != kind_b:
        raise ValueError(f"{args.a} is a `bench {kind_a}` result but {args.b} is a `bench {kind_b}` one: compare results of one bench")
    comparison = compare(a, b, kind_a, args.samples)
    comparison.update(a_file=str(args.a), b_file=str(args.b))
    diffs = comparison["differences"]
    print(
        f"bench {kind_a}: {len(diffs)} of {comparison['compared_leaves']} numeric leaves differ (A = {args.a}, B = {args.b}; * = headline)"
    )
    if diffs:
        print("\n".join(format_table(comparison)))
    for side in ("a", "b"):
        only = comparison[f"only_in_{side}"]
        if only:
            shown = ", ".join(only[:10]) + (f", ... ({len(only) - 10} more)" if len(only) > 10 else "")
            print(f"only in {side.upper()} ({len(only)}): {shown}")
    sys.stdout.flush()
    report_if_asked(args, "compare", comparison)
    return 0
