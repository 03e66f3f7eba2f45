"""Logs and tracing (issue #18): OpenTelemetry spans for each hop of a request (ingress, router, prefill,
KV handoff, decode) in one trace with correct parents; JSON log lines with the request id; a server-side
failure as one line on `moray serve`'s console, client errors kept off it.

The first part runs in process: the propagation helpers, and the real ingress, orchestrator and worker
servers over in-process handles, with an in-memory span exporter. The second part is one real `moray
serve` (disaggregated, JSON logs, spans to a file) shared by the tests at the end of the module."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from cluster_harness import API_KEY, cluster_config, http_json
from fakes import FakeEngineWorker, http_request, serving, until

from cluster import logs, tracing
from cluster.config import ConfigError, ObservabilityConfig, parse_cluster_config

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

TRACED = ObservabilityConfig(tracing=True)


@pytest.fixture
def spans():
    """Tracing on in this process, spans kept in memory; off again afterwards."""
    exporter = InMemorySpanExporter()
    tracing.configure(TRACED, "test", exporter=exporter)
    yield exporter
    tracing.configure(ObservabilityConfig(), "test")


def by_name(finished) -> dict:
    return {s.name: s for s in finished}


def sampled(traceparent: str) -> bool:
    return bool(int(traceparent.rsplit("-", 1)[1], 16) & 1)  # W3C trace flags: bit 0


# ============================================================================ the helpers


def test_propagation_helpers_parent_a_remote_span_in_the_same_trace(spans):
    ingress = tracing.start_span("ingress", None, {"moray.request_id": "cmpl-1"}, server=True)
    context = tracing.inject(ingress)  # what a request message's trace_context carries
    assert set(context) == {"traceparent"} and sampled(context["traceparent"])
    # The worker side: another process would receive only the dict.
    carrier = json.loads(json.dumps(context))
    with tracing.span("prefill", tracing.extract(carrier), {"moray.request_id": "cmpl-1"}):
        pass
    decode = tracing.start_span("decode", tracing.extract(carrier))
    tracing.handoff_span(decode, 0.01, nbytes=3 * 64, chunks=2, skipped_bytes=64)  # an import that just ended
    tracing.end_span(decode, {"moray.completion_tokens": 5, "moray.finish_reason": "length"})
    tracing.end_span(ingress)

    got = by_name(spans.get_finished_spans())
    assert set(got) == {"ingress", "prefill", "decode", "kv_handoff"}
    assert len({s.context.trace_id for s in got.values()}) == 1
    assert got["ingress"].parent is None
    for name in ("prefill", "decode"):
        assert got[name].parent.span_id == got["ingress"].context.span_id and got[name].parent.is_remote
    assert got["kv_handoff"].parent.span_id == got["decode"].context.span_id
    assert got["kv_handoff"].attributes["moray.handoff_bytes"] == 3 * 64
    assert got["kv_handoff"].attributes["moray.handoff_seconds"] == 0.01 and got["kv_handoff"].attributes["moray.skipped_bytes"] == 64
    assert got["kv_handoff"].end_time - got["kv_handoff"].start_time == 10_000_000
    assert got["decode"].attributes["moray.finish_reason"] == "length"


def test_tracing_off_costs_nothing():
    tracing.configure(ObservabilityConfig(), "test")
    assert tracing.start_span("ingress") is None and tracing.inject(None) is None
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    assert tracing.span("router") is tracing.span("prefill")  # one shared no-op, no allocation per request
    tracing.handoff_span(None, 0.01, 64, 1, 0)  # no parent: nothing to do


def test_a_sample_ratio_of_zero_records_nothing_and_tells_the_workers():
    exporter = InMemorySpanExporter()
    tracing.configure(ObservabilityConfig(tracing=True, trace_sample_ratio=0.0), "test", exporter=exporter)
    try:
        ingress = tracing.start_span("ingress")
        carrier = tracing.inject(ingress)
        assert not sampled(carrier["traceparent"])  # the workers do not record either
        with tracing.span("decode", tracing.extract(carrier)):
            pass
        tracing.end_span(ingress)
        assert exporter.get_finished_spans() == ()
    finally:
        tracing.configure(ObservabilityConfig(), "test")


def test_an_otlp_endpoint_needs_the_exporter(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http", None)  # as if not installed
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError) as e:
        parse_cluster_config(
            {"engine": {"model": str(tmp_path / "m")}, "observability": {"otlp_endpoint": "http://collector:4318/v1/traces"}}
        )
    assert "observability.otlp_endpoint" in str(e.value) and "moray[tracing]" in str(e.value)


def test_spans_reach_an_otlp_http_endpoint():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append((self.path, self.headers["Content-Type"], self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
        tracing.configure(ObservabilityConfig(tracing=True, otlp_endpoint=endpoint), "test")
        tracing.end_span(tracing.start_span("ingress", None, {"moray.request_id": "cmpl-otlp"}))
        assert tracing.flush(10)
    finally:
        tracing.configure(ObservabilityConfig(), "test")
        server.shutdown()
    assert [(path, kind) for path, kind, _ in received] == [("/v1/traces", "application/x-protobuf")]
    request = ExportTraceServiceRequest.FromString(received[0][2])
    sent = [s for r in request.resource_spans for scope in r.scope_spans for s in scope.spans]
    assert [s.name for s in sent] == ["ingress"]


# ============================================================================ logs


def _record(message: str, level=logging.ERROR, exc: BaseException | None = None, **extra) -> logging.LogRecord:
    record = logging.LogRecord("moray.cluster", level, __file__, 1, message, (), (type(exc), exc, exc.__traceback__) if exc else None)
    record.__dict__.update(extra)
    return record


def test_json_log_lines_carry_the_request_id_and_the_replica():
    where = {"application": "moray", "deployment": "Frontend", "replica": "abc"}
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError as e:
        error = e
    line = logs.formatter("json", where).format(_record("request cmpl-1 failed", exc=error, request_id="cmpl-1", stage="decode"))
    record = json.loads(line)
    assert "\n" not in line
    assert {k: record[k] for k in ("level", "logger", "message", "request_id", "stage", "deployment", "replica")} == {
        "level": "ERROR",
        "logger": "moray.cluster",
        "message": "request cmpl-1 failed",
        "request_id": "cmpl-1",
        "stage": "decode",
        "deployment": "Frontend",
        "replica": "abc",
    }
    assert record["timestamp"].endswith("Z") and record["exception"] == "RuntimeError: boom" and "Traceback" in record["traceback"]
    one_line = json.loads(logs.formatter("json", where, one_line=True).format(_record("x", exc=error)))
    assert "traceback" not in one_line
    # Without an explicit id: the request the current task serves.
    token = logs.current_request_id.set("chatcmpl-9")
    try:
        assert json.loads(logs.formatter("json", {}).format(_record("worker side", logging.WARNING)))["request_id"] == "chatcmpl-9"
    finally:
        logs.current_request_id.reset(token)
    text = logs.formatter("text", where, one_line=True).format(_record("request cmpl-1 failed during decode", exc=error))
    assert "\n" not in text and "ERROR moray.cluster [moray Frontend abc] request cmpl-1 failed during decode (RuntimeError: boom)" in text


def test_configuring_logs_again_replaces_the_handler():
    logger = logging.getLogger("moray")
    before = list(logger.handlers)
    try:
        logs.configure(ObservabilityConfig(log_format="json"))
        logs.configure(ObservabilityConfig())
        ours = [h for h in logger.handlers if h not in before]
        assert len(ours) == 1 and isinstance(ours[0].formatter, logs.TextFormatter)
        assert logger.propagate  # pytest's caplog (on the root logger) still sees the records
    finally:
        logger.handlers[:] = before


# ============================================================================ in process: ingress -> workers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from workers.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("tracing") / "tiny", "qwen3_moe", "tiny", seed=3)


async def _serving(model_dir, observability: dict, fail_decode: bool = False):
    """The real front end and worker servers in process (fake engines: tokens on a timer, KV chunks of
    2 units x 32 float32), one prefill and one decode worker."""
    prefill = FakeEngineWorker("p0", "prefill")
    decode = FakeEngineWorker("d0", "decode", fail_decode=fail_decode)
    return await serving(model_dir, [prefill], [decode], name="traced", observability=observability), prefill, decode


def _http(body: dict, headers: dict | None = None):
    return http_request(body, headers=headers, stay=False)


COMPLETION = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "ignore_eos": True}


def test_a_request_through_ingress_and_worker_servers_is_one_trace(model_dir, spans):
    client_trace = "0af7651916cd43dd8448eb211c80319c"

    async def main():
        s, prefill, decode = await _serving(model_dir, {"tracing": True})
        tracing.configure(TRACED, "test", exporter=spans)  # the front end set up its own; keep the test's
        headers = {"traceparent": f"00-{client_trace}-b7ad6b7169203331-01"}
        response = await s.frontend.completions(_http(COMPLETION, headers))
        await until(lambda: "decode" in by_name(spans.get_finished_spans()))
        return response, prefill, decode

    response, prefill, decode = asyncio.run(main())
    assert response.status_code == 200
    request_id = json.loads(response.body)["id"]
    got = by_name(spans.get_finished_spans())
    assert set(got) == {"ingress", "router", "prefill", "decode", "kv_handoff"}, list(got)
    assert {format(s.context.trace_id, "032x") for s in got.values()} == {client_trace}  # the client's trace
    ingress_id = got["ingress"].context.span_id
    assert got["ingress"].parent.span_id == 0xB7AD6B7169203331
    assert all(got[name].parent.span_id == ingress_id for name in ("router", "prefill", "decode"))
    assert got["kv_handoff"].parent.span_id == got["decode"].context.span_id
    assert got["ingress"].attributes["moray.request_id"] == request_id and got["ingress"].attributes["moray.prompt_tokens"] > 0
    assert got["ingress"].attributes["moray.outcome"] == "length" and got["ingress"].attributes["moray.completion_tokens"] == 4
    assert got["router"].attributes["moray.decode_worker"] == "d0" and got["router"].attributes["moray.prefill_worker"] == "p0"
    assert got["prefill"].attributes["moray.worker"] == "p0"
    assert got["decode"].attributes["moray.completion_tokens"] == 4 and got["decode"].attributes["moray.finish_reason"] == "length"
    assert got["kv_handoff"].attributes["moray.handoff_bytes"] == 2 * 32 * 4
    # Every request sent to a worker carried the front-end span's traceparent.
    traceparents = [r.trace_context["traceparent"] for r in prefill.requests + decode.requests]
    assert len(traceparents) == 2 and all(tp.split("-")[2] == format(ingress_id, "016x") for tp in traceparents)


def test_tracing_off_sends_nothing_extra_to_the_workers(model_dir):
    async def main():
        s, prefill, decode = await _serving(model_dir, {})
        return await s.frontend.completions(_http(COMPLETION)), s, prefill, decode

    response, s, prefill, decode = asyncio.run(main())
    assert response.status_code == 200
    assert [type(r).__name__ for r in prefill.requests + decode.requests] == ["PrefillRequest", "DecodeRequest"]
    assert all(r.trace_context is None for r in prefill.requests + decode.requests)
    calls = s.prefill_handle.calls + s.decode_handle.calls
    assert {name for name, _, _ in calls} == {"prefill", "release", "channel", "start_batch"}
    assert all(set(kw) <= {"target_replica"} for _, _, kw in calls)


def test_a_server_side_failure_is_one_error_record_with_the_request_id_and_stage(model_dir, spans, caplog):
    async def main():
        s, _, _ = await _serving(model_dir, {"tracing": True}, fail_decode=True)
        tracing.configure(TRACED, "test", exporter=spans)
        bad = await s.frontend.completions(_http({**COMPLETION, "max_tokens": "4"}))  # a client error
        failed = await s.frontend.completions(_http(COMPLETION))
        return bad, failed

    with caplog.at_level(logging.INFO, logger="moray"):
        bad, failed = asyncio.run(main())
    # The decode worker's channel broke: the worker failed, and with no other the request is a 503.
    assert bad.status_code == 400 and failed.status_code == 503 and json.loads(failed.body)["error"]["code"] == "worker_failed"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    request_id = errors[0].request_id
    assert request_id.startswith("cmpl-") and errors[0].stage == "decode"
    assert f"request {request_id} failed during decode" in errors[0].getMessage() and "the decode step broke" in errors[0].getMessage()
    got = by_name(spans.get_finished_spans())
    assert got["decode"].status.status_code.name == "ERROR" and got["ingress"].status.status_code.name == "ERROR"
    assert got["ingress"].attributes["moray.request_id"] == request_id


# ============================================================================ one real `moray serve`

APP = "traced"


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """`moray serve` of 1 prefill + 1 decode replica, JSON logs, every span appended to a file."""
    from process_harness import Output, assert_all_gone, caused_processes, env, kill_all, start_moray_serve

    tmp = tmp_path_factory.mktemp("served")
    ray_tmp = Path(tempfile.mkdtemp(prefix="mt", dir="/tmp"))  # Ray's socket paths must stay short
    trace_file = tmp / "spans.jsonl"
    cfg = cluster_config(model_dir, name=APP, observability={"log_format": "json", "tracing": True, "trace_file": str(trace_file)})
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = start_moray_serve(["--config", str(path), "--num-cpus", "2"], env(str(ray_tmp)))
    output = Output(proc)
    try:
        output.wait_for("Moray is serving", timeout=600)
        yield SimpleNamespace(
            base=f"http://127.0.0.1:{cfg['server']['http_port']}", output=output, proc=proc, ray_tmp=str(ray_tmp), trace_file=trace_file
        )
    finally:
        pids = caused_processes({proc.pid}, str(ray_tmp))
        proc.send_signal(signal.SIGINT)
        try:
            out = output.finish(timeout=180)
            assert proc.returncode == 0, out
            assert_all_gone(pids)
        finally:
            kill_all(pids)  # what a failure above left behind
            shutil.rmtree(ray_tmp, ignore_errors=True)


def _spans_of(trace_file: Path, request_id: str, timeout: float = 20.0) -> dict:
    """The spans of one request's trace in the file, by name, once all five are there."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [json.loads(line) for line in trace_file.read_text().splitlines()] if trace_file.exists() else []
        ingress = [s for s in spans if s["name"] == "ingress" and s["attributes"].get("moray.request_id") == request_id]
        if ingress:
            trace_id = ingress[0]["context"]["trace_id"]
            mine = {s["name"]: s for s in spans if s["context"]["trace_id"] == trace_id}
            if len(mine) == 5 or time.monotonic() > deadline:
                return mine
        elif time.monotonic() > deadline:
            return {}
        time.sleep(0.2)


def test_served_request_spans_every_hop_in_one_trace(served):
    status, body = http_json(served.base + "/v1/completions", {**COMPLETION, "prompt": "tell me about the sea", "max_tokens": 6})
    assert status == 200, body
    got = _spans_of(served.trace_file, body["id"])
    assert set(got) == {"ingress", "router", "prefill", "kv_handoff", "decode"}, list(got)
    ids = {name: s["context"]["span_id"] for name, s in got.items()}
    assert got["ingress"]["parent_id"] is None
    assert {name: got[name]["parent_id"] for name in ("router", "prefill", "decode")} == dict.fromkeys(
        ("router", "prefill", "decode"), ids["ingress"]
    )
    assert got["kv_handoff"]["parent_id"] == ids["decode"]
    # Each hop ran in its own replica process.
    components = {name: s["resource"]["attributes"]["moray.component"] for name, s in got.items()}
    assert components == {"ingress": "ingress", "router": "ingress", "prefill": "prefill", "kv_handoff": "decode", "decode": "decode"}
    assert len({s["resource"]["attributes"]["process.pid"] for s in got.values()}) == 3
    assert got["kv_handoff"]["attributes"]["moray.handoff_bytes"] > 0
    assert got["decode"]["attributes"]["moray.completion_tokens"] == 6
    assert got["router"]["attributes"]["moray.prefill_worker"] == got["prefill"]["attributes"]["moray.worker"]


def test_served_failure_is_one_json_line_on_the_console_and_client_errors_are_not(served):
    """A client error prints nothing; killing the decode replica under a stream prints one JSON line
    with that stream's request id and stage."""
    import aiohttp
    from process_harness import caused_processes

    start = len(served.output.lines)
    status, body = http_json(served.base + "/v1/completions", {**COMPLETION, "max_tokens": "4"})
    assert status == 400, body
    time.sleep(1.0)
    assert served.output.lines[start:] == []  # a client's mistake is not the operator's business
    replicas = {p: _cmdline(p) for p in caused_processes({served.proc.pid}, served.ray_tmp)}
    decode_pids = [p for p, cmd in replicas.items() if "DecodeServer" in cmd]
    assert len(decode_pids) == 1, replicas

    async def stream_and_kill():
        body = {**COMPLETION, "max_tokens": 200, "stream": True}
        events = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async with session.post(served.base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                assert r.status == 200
                async for raw in r.content:
                    line = raw.decode().strip()
                    if line.startswith("data: "):
                        events.append(line[6:])
                        # The prefill's token, then the decode replica's first: it dies while running the
                        # request (killed earlier, Serve would hold the call for a new replica and run it there).
                        if len(events) == 2:
                            os.kill(decode_pids[0], signal.SIGKILL)
        return events

    events = asyncio.run(stream_and_kill())
    request_id = json.loads(events[0])["id"]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "worker_failed", events[-3:]
    deadline = time.monotonic() + 20
    while not any(request_id in line for line in served.output.lines[start:]):
        assert time.monotonic() < deadline, "".join(served.output.lines[start:])
        time.sleep(0.2)
    time.sleep(1.0)  # anything else it was going to print about it
    # (Ray itself may add a line of its own about the dead worker process.)
    ours = [json.loads(line) for line in served.output.lines[start:] if line.startswith("{")]
    mine = [r for r in ours if r.get("request_id") == request_id]
    assert len(mine) == 1, ours
    assert mine[0]["level"] == "ERROR" and mine[0]["stage"] == "decode" and mine[0]["deployment"] == "Frontend", mine
    assert "decode worker" in mine[0]["message"] and "traceback" not in mine[0]
    assert all(r["level"] == "ERROR" for r in ours), ours
    # The replicas' own logs (their stderr, in Ray's log files): JSON lines, the request's id on each
    # record about it (the error once), also where the message does not name it.
    logged = [
        json.loads(line)
        for f in Path(served.ray_tmp).glob("ray/session_latest/logs/worker-*.err")
        for line in f.read_text(errors="replace").splitlines()
        if request_id in line
    ]
    assert all(r["request_id"] == request_id for r in logged), logged
    assert [r["message"] for r in logged if r["level"] == "ERROR"] == [mine[0]["message"]], logged
    assert any(request_id not in r["message"] for r in logged), logged  # the worker-gone warning, from the context


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
