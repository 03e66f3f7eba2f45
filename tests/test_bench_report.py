"""`moray bench ... --report DIR` and `moray bench compare`, on results of real runs at tiny sizes.

Here: `bench collectives` (2 processes x 2 CPU devices), `bench route` (memory index, twice with two
seeds), `bench memory` (tiny Mixtral, W4A16), `bench serve` against a loopback stand-in server
(the bench's client, summaries, samples and report are real; a real server is in
tests/test_cluster.py's structured-outputs test), `bench engine --sizes-only`, and `bench compare` on the
route and collectives files. The other benches' end-to-end tests (engine, routing, fuzz, soak) call
`check_report` on their own runs.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from report_harness import check_report

from cluster.cli import main as moray_main
from workers.models.make_model import make_model

ROOT = Path(__file__).resolve().parent.parent


def flat_numbers(tree, prefix: str = "") -> dict[str, float]:
    """The test's own walk of a result (independent of bench.compare's): dotted path -> number."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list):
        items = enumerate(tree)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        return {prefix: tree}
    else:
        return {}
    out = {}
    for key, value in items:
        out.update(flat_numbers(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


# ------------------------------------------------------------------------------------ real runs


@pytest.fixture(scope="module")
def collectives(tmp_path_factory) -> tuple[Path, Path, str]:
    """`bench collectives` on a 2x2 mesh (2 processes), two modes, with --report: (json, report dir, stderr)."""
    tmp = tmp_path_factory.mktemp("collectives")
    out, report = tmp / "collectives.json", tmp / "report"
    argv = ["bench", "collectives", "--mesh", "2x2", "--hidden", "256", "--tokens", "16", "--runs", "20", "--warmup", "1"]
    argv += ["--modes", "flat,hierarchical-dispatch"]
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", *argv, "--json", str(out), "--report", str(report)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, report, proc.stderr


@pytest.fixture(scope="module")
def route_runs(tmp_path_factory) -> list[Path]:
    """Two small `bench route` runs (memory index) with different seeds; the first with --report."""
    tmp = tmp_path_factory.mktemp("route")
    paths = []
    for seed in (0, 1):
        out = tmp / f"route{seed}.json"
        argv = ["bench", "route", "--backend", "memory", "--workers", "4", "--sequences", "200", "--prefix-groups", "8"]
        argv += ["--prefix-tokens", "256", "--requests", "300", "--threads", "2", "--seed", str(seed), "--json", str(out)]
        assert moray_main(argv + (["--report", str(tmp / "report")] if seed == 0 else [])) == 0
        paths.append(out)
    return paths


def test_collectives_report(collectives):
    out, report, stderr = collectives
    result = json.loads(out.read_text())
    assert f"report: 2 plots and {report / 'index.html'}" in stderr
    plots = check_report(report, min_plots=2)
    assert set(plots) == {"bytes_per_level.png", "times.png"}
    assert json.loads((report / "result.json").read_text()) == result
    page = (report / "index.html").read_text()
    for mode, s in result["summary"].items():  # the headline table: every mode's times and bytes per level
        assert f"summary.{mode}.dispatch_ms" in page and f"summary.{mode}.dispatch_bytes.host" in page
        assert f"{s['dispatch_bytes']['host']:,}" in page
    assert re.search(r"<td>mesh</td><td[^>]*>2x2</td>", page)  # the run's config


def test_route_report(route_runs):
    report = route_runs[0].parent / "report"
    assert set(check_report(report)) == {"decisions.png"}
    result = json.loads(route_runs[0].read_text())
    page = (report / "index.html").read_text()
    assert f"<td>memory.p99_ms</td><td class='num'>{result['memory']['p99_ms']:.4g}</td>" in page


def test_compare_prints_every_differing_leaf_with_its_ratio(route_runs, capsys, tmp_path):
    a_path, b_path = route_runs
    a, b = (flat_numbers(json.loads(p.read_text())) for p in route_runs)
    expected = {path: a[path] for path in a if path in b and a[path] != b[path]}
    assert expected  # two seeds: the latencies, at least, differ

    assert moray_main(["bench", "compare", str(a_path), str(b_path), "--report", str(tmp_path / "diff")]) == 0
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines()[2:]:
        if line.startswith("only in"):
            break
        mark, path, va, vb, ratio = line[0], *line[2:].split()
        rows[path] = (mark, float(va.replace(",", "")), float(vb.replace(",", "")), ratio)
    assert f"{len(expected)} of " in out.splitlines()[0]
    assert set(rows) == set(expected), set(rows) ^ set(expected)
    for path, (_mark, va, vb, ratio) in rows.items():
        assert math.isclose(va, a[path], rel_tol=1e-5) and math.isclose(vb, b[path], rel_tol=1e-5)
        if a[path]:
            assert math.isclose(float(ratio), b[path] / a[path], rel_tol=1e-3, abs_tol=1e-4), (path, ratio)
        else:
            assert ratio == "-"
    assert rows["memory.p99_ms"][0] == "*" and rows.get("memory.gc_pause_ms_total", ("",))[0] != "*"  # headlines marked

    plots = check_report(tmp_path / "diff")
    assert set(plots) == {"ratios.png"}
    page = (tmp_path / "diff" / "index.html").read_text()
    assert "memory.p99_ms" in page and str(a_path) in page and str(b_path) in page


def test_compare_refuses_mismatched_missing_and_foreign_files(route_runs, collectives, tmp_path, capsys):
    route_json, coll_json = route_runs[0], collectives[0]
    assert moray_main(["bench", "compare", str(route_json), str(coll_json)]) == 2
    err = capsys.readouterr().err
    assert "`bench route`" in err and "`bench collectives`" in err
    assert moray_main(["bench", "compare", str(route_json), str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"x": 1}')
    assert moray_main(["bench", "compare", str(tmp_path / "other.json"), str(route_json)]) == 2
    assert "not the JSON result of a known" in capsys.readouterr().err
    # A report directory's result.json is a result too.
    assert moray_main(["bench", "compare", str(coll_json), str(collectives[1] / "result.json")]) == 0
    assert "0 of " in capsys.readouterr().out


def test_memory_report(tmp_path):
    tiny = make_model(tmp_path / "tiny", "mixtral", "tiny", seed=1)
    argv = ["bench", "memory", "--model", str(tiny), "--json", str(tmp_path / "m.json"), "--schemes", "w4a16"]
    argv += ["--group-size", "32", "--batch", "1", "--prompt-len", "4", "--decode-steps", "2", "--num-prompts", "1"]
    assert moray_main(argv + ["--report", str(tmp_path / "report")]) == 0
    assert set(check_report(tmp_path / "report")) == {"formats.png"}
    page = (tmp_path / "report" / "index.html").read_text()
    for name in ("bf16", "w4a16"):
        assert f"results.{name}.weight_bytes" in page and f"results.{name}.mean_kl" in page


def test_engine_sizes_only_report_has_no_plots_but_the_figures(tmp_path, capsys):
    assert moray_main(["bench", "engine", "--sizes-only", "--preset", "qwen3.5-397b", "--report", str(tmp_path / "r")]) == 0
    check_report(tmp_path / "r", min_plots=0)
    page = (tmp_path / "r" / "index.html").read_text()
    assert "kv_bytes_per_token" in page and "sizes only" in page


# ------------------------------------------------------------------------------------ bench serve


class StandInServer:
    """A loopback OpenAI-style server that streams `max_tokens` tokens, 2 ms apart, then the usage chunk:
    enough for `bench serve`'s client to measure TTFT, TPOT and e2e of each request."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self):
        from aiohttp import web

        app = web.Application()

        async def models(request):
            return web.json_response({"data": [{"id": "stand-in"}]})

        async def metrics(request):
            return web.Response(text="# no metrics\n")

        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", self._complete)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    async def _complete(self, request):
        from aiohttp import web

        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(0.002)
            await response.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
        usage = {
            "completion_tokens": body["max_tokens"],
            "prompt_tokens": len(body["prompt"]),
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_serve_report_has_real_latency_cdfs(tmp_path, capsys):
    from bench.serve import pct

    server = StandInServer()
    try:
        argv = ["bench", "serve", "--url", f"http://127.0.0.1:{server.port}", "--workload", "short-in-long-out"]
        argv += ["--requests", "12", "--concurrency", "4", "--json", str(tmp_path / "s.json"), "--report", str(tmp_path / "r")]
        assert moray_main(argv) == 0
    finally:
        server.close()
    result = json.loads((tmp_path / "s.json").read_text())["result"]
    samples = result["samples"]
    assert len(samples["ttft_s"]) == len(samples["e2e_s"]) == len(samples["tpot_s"]) == 12 and result["errors"] == 0
    # The summaries are the samples' own percentiles (samples are rounded to the microsecond).
    for key, figure in (("ttft_s", "ttft_p50_s"), ("e2e_s", "e2e_p99_s"), ("tpot_s", "tpot_p50_s")):
        assert math.isclose(pct(samples[key], int(figure[-4:-2])), result[figure], abs_tol=1e-6)
    assert all(0 < t < e for t, e in zip(sorted(samples["ttft_s"]), sorted(samples["e2e_s"])))
    assert min(samples["tpot_s"]) >= 0.0015  # tokens come 2 ms apart
    plots = check_report(tmp_path / "r", min_plots=2)
    assert set(plots) == {"latency_cdf.png", "throughput.png"}  # no hits: no hit-rate chart
    assert f"[bench serve] report: 2 plots and {tmp_path / 'r' / 'index.html'}" in capsys.readouterr().err


def test_building_the_parser_does_not_import_matplotlib():
    code = "import sys; from cluster.cli import build_parser; build_parser(); assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_every_bench_writes_its_result_with_the_same_flag():
    """One flag style across `moray bench`: --json PATH everywhere (compare reads two results instead);
    `bench route`'s first name for it, --out, still works."""
    import argparse
    import importlib

    from cluster.cli import BENCH_COMMANDS

    for name, (module_name, _) in BENCH_COMMANDS.items():
        if name == "compare":
            continue
        p = argparse.ArgumentParser()
        importlib.import_module(module_name).add_arguments(p)
        flags = {s for a in p._actions for s in a.option_strings}
        assert "--json" in flags and "--report" in flags, (name, sorted(flags))
    p = argparse.ArgumentParser()
    importlib.import_module("bench.route").add_arguments(p)
    assert p.parse_args(["--out", "x.json"]).json == p.parse_args(["--json", "x.json"]).json


def test_scratch_dirs_are_removed_when_the_process_exits():
    """Benchmarks' generated models and the engine tests' XLA caches (~80 MB a module) were left in /tmp by
    every run: 1.4 GB after a few suite runs."""
    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from bench import scratch_dir\n"
        "from engine_harness import small_engine_args\n"
        "import pathlib\n"
        "a = scratch_dir('moray-scratch-test-'); pathlib.Path(a, 'f').write_text('x')\n"
        "print(a); print(small_engine_args('scratch-test')['compilation_cache_dir'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent)
    paths = out.stdout.split()
    assert len(paths) == 2 and all(p.startswith("/") for p in paths)
    assert not [p for p in paths if Path(p).exists()]
