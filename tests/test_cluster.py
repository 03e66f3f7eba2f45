"""The serving cluster on a real local Ray: OpenAI client, gRPC, disaggregated == colocated == offline,
KV handoff in chunks, cancellation freeing KV on both workers, and a table of bad inputs."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
from cluster_harness import API_KEY, cluster_config, http_json, idle, served_app, served_apps, wait_for_idle_workers, wait_until

from protos.moray.v1 import moray_pb2, moray_pb2_grpc
from workers.models.make_model import make_model

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.cluster

pytest.importorskip("openai")
import openai  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("cluster") / "tiny", "qwen3_moe", "tiny", seed=11)


@pytest.fixture(scope="module")
def cluster(model_dir, ray_serve):
    """Three applications on the session's Ray cluster: disaggregated at /, colocated at /colo, and a colocated
    one with a longer context at /tools."""
    disagg = cluster_config(model_dir, name="disagg")
    colo = cluster_config(model_dir, name="colo", mode="colocated")
    # Tool prompts rendered by the tiny byte-level tokenizer need a longer context than the other tests.
    tools = cluster_config(
        model_dir, name="tools", mode="colocated", engine={"max_model_len": 1024, "page_buckets": [4, 32, 128], "num_kv_blocks": 512}
    )
    with served_apps(ray_serve, (disagg, "/"), (colo, None), (tools, None)) as (app, _, _):
        yield {"base": app.base, "grpc": ray_serve.grpc, "config": app.config}


def client(cluster, prefix: str = "") -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster["base"] + prefix + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


PROMPT = "The quick brown fox jumps over the lazy dog and keeps running"


def test_openai_client_completions_and_chat(cluster):
    c = client(cluster)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens > 8
    streamed = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in streamed) == out.choices[0].text

    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []


def test_prefix_cache_hit_is_reported_as_cached_tokens(cluster):
    c = client(cluster)
    long_prompt = PROMPT * 4
    c.completions.create(model="tiny", prompt=long_prompt, max_tokens=2, temperature=0)
    again = c.completions.create(model="tiny", prompt=long_prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 8 * (again.usage.prompt_tokens // 8) - 8


def test_logprobs_and_seed(cluster):
    c = client(cluster)
    out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    a = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=42, extra_body={"ignore_eos": True})
    b = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=42, extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text


def test_disaggregated_equals_colocated_equals_offline(cluster, model_dir):
    from workers.engine import LLM, SamplingParams

    prompts = [PROMPT, "Hello", PROMPT * 3]
    disagg, colo = client(cluster), client(cluster, "/colo")
    llm = LLM(str(model_dir), **{k: v for k, v in cluster["config"]["engine"].items() if k != "model"}, warmup=False)
    offline = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, expected in zip(prompts, offline):
        for c in (disagg, colo):
            out = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
            assert out.choices[0].text == expected.text


def metric(cluster, name: str, prefix: str = "") -> float:
    status, text = http_json(cluster["base"] + prefix + "/metrics", key=None)
    assert status == 200
    total = 0.0
    for line in text.splitlines():
        for exposed in (name, name + "_total"):  # a running total may be exposed as a gauge or a counter
            if line.startswith(exposed + "{") or line.startswith(exposed + " "):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_handoff_moves_kv_in_several_chunks_through_the_object_store(cluster):
    before = metric(cluster, "moray_kv_handoff_bytes_total")
    failures = metric(cluster, "moray_kv_handoff_import_failures_total")
    # Fresh prompts (nothing cached anywhere) go through remote prefill whenever the prefill worker's
    # heartbeat is current; a few tries absorb a heartbeat delayed by a loaded machine.
    for attempt in range(3):
        fresh = f"Prompt {attempt} that no worker has seen yet, long enough to span several KV blocks of eight tokens."
        client(cluster).completions.create(model="tiny", prompt=fresh, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        try:
            wait_until(lambda: metric(cluster, "moray_kv_handoff_bytes_total") > before, 10, 0.2)
            break
        except TimeoutError:
            continue
    moved = metric(cluster, "moray_kv_handoff_bytes_total") - before
    chunk_bytes = cluster["config"]["kv_transfer"]["chunk_mib"] * (1 << 20)
    assert moved > chunk_bytes  # several chunks (the prompt spans several blocks)
    assert metric(cluster, "moray_kv_export_bytes_total") > 0
    assert metric(cluster, "moray_kv_handoff_import_failures_total") == failures  # none prefilled locally instead
    text = http_json(cluster["base"] + "/metrics", key=None)[1]
    assert "vllm:time_to_first_token_seconds_bucket" in text and 'path="disaggregated"' in text


# vLLM's names, as dashboards, alerts and autoscalers built for vLLM read them: name -> Prometheus type.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:request_success": "counter",
    # Issue #29: the phases and the requested lengths vLLM's dashboard queries.
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
}


def test_metrics_carry_vllm_names_types_labels_and_buckets(cluster):
    from prometheus_client.parser import text_string_to_metric_families

    from cluster.metrics import VLLM_REQUEST_LATENCY_BUCKETS, VLLM_TOKEN_LATENCY_BUCKETS, VLLM_TTFT_BUCKETS

    client(cluster).completions.create(
        model="tiny", prompt="Metrics, please.", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    stream = client(cluster).completions.create(
        model="tiny", prompt="Metrics, streamed.", max_tokens=4, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert sum(1 for _ in stream) >= 1

    def scrape():
        families = {f.name: f for f in text_string_to_metric_families(http_json(cluster["base"] + "/metrics", key=None)[1])}
        return families if "vllm:num_requests_running" in families and families["vllm:num_requests_running"].samples else None

    families = wait_until(scrape, 10, 0.2, "the workers' series on /metrics")  # they arrive with their next report
    for name, kind in VLLM_METRICS.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name].type == kind, (name, families[name].type)
        assert families[name].samples, f"{name} has no samples"
        assert all(s.labels.get("model_name") == "tiny" for s in families[name].samples), name
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples if s.name.endswith("_total")}
    assert success.get("length", 0) >= 2
    workers = {s.labels["engine"] for s in families["vllm:num_requests_running"].samples}
    assert workers and {s.labels["role"] for s in families["vllm:kv_cache_usage_perc"].samples} == {"prefill", "decode"}
    for name, buckets in (
        ("vllm:time_to_first_token_seconds", VLLM_TTFT_BUCKETS),
        ("vllm:inter_token_latency_seconds", VLLM_TOKEN_LATENCY_BUCKETS),
        ("vllm:e2e_request_latency_seconds", VLLM_REQUEST_LATENCY_BUCKETS),
    ):
        bounds = sorted({float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")})
        assert bounds == [*map(float, buckets), float("inf")], name
    # Moray's own additions keep moray_ names; no vLLM-named value is computed twice under another name.
    assert "moray_router_decisions" in families or any(n.startswith("moray_router_") for n in families)
    for old in ("moray_requests", "moray_running_requests", "moray_queue_depth", "moray_kv_cache_usage_ratio", "moray_prompt_tokens"):
        assert old not in families, old


@pytest.fixture(autouse=True)
def no_leaked_blocks(request):
    """After every test that used the cluster, both apps' workers are back to an empty KV pool."""
    yield
    if "cluster" not in request.fixturenames:
        return
    for app in ("disagg", "colo"):
        for name, e in wait_for_idle_workers(app).items():
            assert e.num_free_blocks == e.num_total_blocks and e.num_held == 0, f"{request.node.name} {app} {name} {e}"


def test_cancelled_stream_frees_kv_on_both_workers(cluster):
    async def start_and_cancel():
        c = openai.AsyncOpenAI(base_url=cluster["base"] + "/v1", api_key=API_KEY, max_retries=0)
        stream = await c.completions.create(
            model="tiny", prompt=PROMPT * 5, max_tokens=50, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.close()
        await c.close()
        return got

    assert asyncio.run(start_and_cancel()) == 3
    stats = wait_for_idle_workers("disagg")
    assert len(stats) == 2 and idle(stats), stats


def test_a_cut_stream_of_several_choices_stops_every_choice(cluster):
    """A client that leaves a stream of 2 prompts x n=2 after its first chunks: all four engine requests
    end, and both pools give back every block (the merged stream cancels each choice's stream)."""

    async def start_and_cancel():
        c = openai.AsyncOpenAI(base_url=cluster["base"] + "/v1", api_key=API_KEY, max_retries=0)
        stream = await c.completions.create(
            model="tiny", prompt=[PROMPT * 3, PROMPT * 4], n=2, max_tokens=60, temperature=1.0, stream=True, extra_body={"ignore_eos": True}
        )
        got = 0
        async for _ in stream:
            got += 1
            if got == 4:
                break
        await stream.close()
        await c.close()
        return got

    assert asyncio.run(start_and_cancel()) == 4
    stats = wait_for_idle_workers("disagg")
    assert len(stats) == 2 and idle(stats), stats


# ---------------------------------------------------------------------------------------- gRPC


def grpc_channel(cluster):
    return grpc.insecure_channel(cluster["grpc"])


AUTH = (("authorization", f"Bearer {API_KEY}"), ("application", "disagg"))


def test_grpc_generate_stream_complete_models_health(cluster):
    with grpc_channel(cluster) as ch:
        stub = moray_pb2_grpc.MorayStub(ch)
        req = moray_pb2.GenerateRequest(
            model="tiny", prompt=PROMPT, sampling=moray_pb2.SamplingOptions(temperature=0, max_tokens=6, ignore_eos=True)
        )
        parts = list(stub.Generate(req, metadata=AUTH, timeout=120))
        assert parts[-1].finished and parts[-1].usage.completion_tokens == 6
        assert sum(len(p.token_ids) for p in parts) == 6
        full = stub.Complete(req, metadata=AUTH, timeout=120)
        assert full.text == "".join(p.text for p in parts) and full.finish_reason == "length"
        assert [m.id for m in stub.ListModels(moray_pb2.ListModelsRequest(), metadata=AUTH).models] == ["tiny"]
        assert stub.Health(moray_pb2.HealthRequest(), metadata=AUTH).status == "ok"


CLUSTER_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}


def test_structured_outputs_with_the_openai_client(cluster):
    """20 json_schema requests (half streamed, disaggregated and colocated) in flight together with free
    ones: every output parses and validates; guided_choice and guided_regex hold too."""
    import json
    import re
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": CLUSTER_SCHEMA, "strict": True}}

    def constrained(i: int) -> str:
        c = client(cluster, "/colo" if i % 4 == 3 else "")
        kw = dict(model="tiny", messages=[{"role": "user", "content": f"person {i}"}], max_tokens=200, temperature=1.0, seed=i)
        if i % 2:
            chunks = c.chat.completions.create(**kw, response_format=fmt, stream=True)
            return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        out = c.chat.completions.create(**kw, response_format=fmt)
        assert out.choices[0].finish_reason == "stop"
        return out.choices[0].message.content

    def free(i: int) -> str:
        out = client(cluster).completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=i)
        return out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(constrained, range(20)))
        free_texts = list(pool.map(free, range(4)))
    for text in texts:
        jsonschema.validate(json.loads(text), CLUSTER_SCHEMA)
    assert all(isinstance(t, str) for t in free_texts)

    c = client(cluster)
    for i in range(3):
        choice = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, seed=i, extra_body={"guided_choice": ["north", "south"]})
        assert choice.choices[0].text in ("north", "south")
        regex = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, seed=i, extra_body={"guided_regex": "[0-9]{3}-[a-z]{3}"})
        assert re.fullmatch("[0-9]{3}-[a-z]{3}", regex.choices[0].text), regex.choices[0].text
    obj = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=200, seed=1, response_format={"type": "json_object"}
    )
    assert obj.choices[0].finish_reason in ("stop", "length")


def test_bench_serve_structured_against_the_cluster(cluster, tmp_path):
    """`moray bench serve --structured` end to end on a few requests: both kinds run without errors and
    every figure is there; its report has the latency CDFs of the real requests."""
    import argparse

    from report_harness import check_report

    from bench import serve as bench_serve
    from bench.report import write_report

    args = argparse.Namespace(
        url=cluster["base"], model=None, api_key=API_KEY, workload="short-in-long-out", requests=4, concurrency=2, seed=0, runs=1
    )
    out = bench_serve.run_structured(args, bench_serve.make_workload(args.workload, args.requests, args.seed))
    for kind in ("free", "structured"):
        (run,) = out[kind]["runs"]
        assert run["errors"] == 0 and run["requests"] == 4 and out[kind]["throughput_tokens_per_s"] > 0
    assert out["ratio_structured_over_free"]["throughput"] > 0 and "met" in out["target"]
    assert len(out["free"]["runs"][0]["samples"]["ttft_s"]) == 4
    write_report("serve", {"workload": args.workload, "concurrency": 2, "requests": 4, "structured": out}, tmp_path)
    assert {"latency_cdf.png", "throughput.png"} <= set(check_report(tmp_path, min_plots=2))


def test_bench_serve_vs_engine_against_the_cluster(cluster, model_dir):
    """`moray bench serve --vs-engine`'s parts on a few requests: the offline closed loop and the served one
    (non-streamed and streamed, on the colocated app) count every token; the processes whose CPU it charges
    are the proxy and the front-end replicas, never an engine; the summary pairs each run with its offline one."""
    import argparse

    from bench import serve_efficiency as eff
    from workers.engine import EngineConfig
    from workers.engine.engine import EngineCore

    args = argparse.Namespace(
        model=str(model_dir), concurrency=2, requests=4, prompt_tokens=8, max_tokens=4, runs=1, stream_interval_ms=5.0, ingress="serve"
    )
    pids = eff.non_engine_processes("colo")
    names = {name.split(":")[0] if name.startswith("Proxy") else name.split(":")[2] for name in pids}
    assert names == {"ProxyActor", "Frontend", "Registry"}, pids
    offline = eff.offline_run(EngineCore(EngineConfig(**eff.engine_settings(args)), show_progress=False), args, seed=0)
    served = [asyncio.run(eff.served_run(cluster["base"] + "/colo", "tiny", args, 0, s, pids, api_key=API_KEY)) for s in (False, True)]
    assert offline["tokens"] == 16 and [r["tokens"] for r in served] == [16, 16]
    assert all(r["non_engine_cpu_s"] > 0 and set(r["cpu_s_by_process"]) == set(pids) for r in served)
    out = eff.summarize({"offline": [offline], "served": served[:1], "served_stream": served[1:]}, args, {}, sorted(pids))
    ratio = served[0]["tokens_per_s"] / offline["tokens_per_s"]
    assert out["paired_ratios_served_over_offline"]["non_streamed"] == pytest.approx(ratio)
    assert out["ratios_served_over_offline"]["non_streamed"] == pytest.approx(ratio)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]


def test_tool_calls_with_the_openai_client(cluster):
    """tool_choice required and named: every call parses and validates against its function; streamed
    deltas reassemble into the call the non-streaming response gives; a tool result turn is accepted."""
    import json

    import jsonschema

    c = client(cluster, "/tools")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "add"}}
    for i, choice in enumerate(["required"] * 4 + [named] * 2):
        out = c.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=300,
            temperature=1.0,
            seed=i,
            parallel_tool_calls=False,
        )
        assert out.choices[0].finish_reason == "tool_calls", out.choices[0].message
        (call,) = out.choices[0].message.tool_calls
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if choice is named:
            assert call.function.name == "add"

    kw = dict(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0, parallel_tool_calls=False
    )
    whole = c.chat.completions.create(**kw).choices[0].message.tool_calls
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(**kw, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(streamed.items())] == [
        (t.function.name, json.loads(t.function.arguments)) for t in whole
    ]

    call = whole[0]
    follow_up = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = c.chat.completions.create(model="tiny", messages=follow_up, tools=TOOLS, max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_grpc_structured_outputs(cluster):
    import re

    with grpc_channel(cluster) as ch:
        stub = moray_pb2_grpc.MorayStub(ch)
        sampling = moray_pb2.SamplingOptions(temperature=1.0, seed=3, max_tokens=20, regex="[a-z]{2}[0-9]{2}")
        full = stub.Complete(moray_pb2.GenerateRequest(model="tiny", prompt=PROMPT, sampling=sampling), metadata=AUTH, timeout=120)
        assert re.fullmatch("[a-z]{2}[0-9]{2}", full.text) and full.finish_reason == "stop"
        choice = moray_pb2.SamplingOptions(max_tokens=20, choice=moray_pb2.ChoiceList(choices=["up", "down"]))
        parts = list(stub.Generate(moray_pb2.GenerateRequest(model="tiny", prompt=PROMPT, sampling=choice), metadata=AUTH, timeout=120))
        assert "".join(p.text for p in parts) in ("up", "down")
        bad = moray_pb2.SamplingOptions(max_tokens=5, regex="(")
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(moray_pb2.GenerateRequest(model="tiny", prompt=PROMPT, sampling=bad), metadata=AUTH, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot be compiled" in e.value.details()


def test_grpc_health_and_reflection(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc_channel(cluster) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), metadata=(("application", "disagg"),), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        responses = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert "moray.v1.Moray" in names and "grpc.health.v1.Health" in names


# ---------------------------------------------------------------------------------------- bad input

GOOD = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
BAD_HTTP = [
    ("invalid JSON", "/v1/completions", b"{not json", API_KEY, 400, "not valid JSON"),
    ("JSON array body", "/v1/completions", b"[1, 2]", API_KEY, 400, "JSON object"),
    ("missing model", "/v1/completions", {"prompt": "hi"}, API_KEY, 400, "model"),
    ("missing prompt", "/v1/completions", {"model": "tiny"}, API_KEY, 400, "prompt"),
    ("wrong type max_tokens", "/v1/completions", {**GOOD, "max_tokens": "lots"}, API_KEY, 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions", {**GOOD, "max_tokens": -3}, API_KEY, 400, "max_tokens"),
    ("temperature < 0", "/v1/completions", {**GOOD, "temperature": -1}, API_KEY, 400, "temperature"),
    ("top_p > 1", "/v1/completions", {**GOOD, "top_p": 1.5}, API_KEY, 400, "top_p"),
    ("n > 128", "/v1/completions", {**GOOD, "n": 129}, API_KEY, 400, "n"),
    ("n x prompts > 128", "/v1/completions", {**GOOD, "prompt": ["a", "b"], "n": 65}, API_KEY, 400, "choices"),
    ("unknown field", "/v1/completions", {**GOOD, "temprature": 0.1}, API_KEY, 400, "unknown field 'temprature'"),
    ("max_tokens 0 without echo", "/v1/completions", {**GOOD, "max_tokens": 0}, API_KEY, 400, "echo"),
    ("bad stop type", "/v1/completions", {**GOOD, "stop": 5}, API_KEY, 400, "stop"),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-5"}, API_KEY, 404, "gpt-5"),
    ("prompt over the limit", "/v1/completions", {**GOOD, "prompt": list(range(1, 300))}, API_KEY, 400, "limit"),
    ("token id outside vocab", "/v1/completions", {**GOOD, "prompt": [1, 2, 100000]}, API_KEY, 400, "vocabulary"),
    ("empty prompt", "/v1/completions", {**GOOD, "prompt": ""}, API_KEY, 400, "prompt"),
    ("an empty prompt in a batch", "/v1/completions", {**GOOD, "prompt": ["a", ""]}, API_KEY, 400, "prompt[1]"),
    ("missing API key", "/v1/completions", GOOD, None, 401, "API key"),
    ("wrong API key", "/v1/completions", GOOD, "nope", 401, "invalid API key"),
    ("oversized body", "/v1/completions", {**GOOD, "padding": "x" * (2 << 20)}, API_KEY, 413, "larger than"),
    ("empty messages", "/v1/chat/completions", {"model": "tiny", "messages": []}, API_KEY, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, API_KEY, 400, "role"),
    ("messages not a list", "/v1/chat/completions", {"model": "tiny", "messages": "hi"}, API_KEY, 400, "messages"),
    (
        "non-text content part",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        API_KEY,
        400,
        "text",
    ),
    (
        "top_logprobs too large",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99},
        API_KEY,
        400,
        "top_logprobs",
    ),
    # issue #13: each of these was a 500 (a traceback) or silently accepted
    (
        "max_tokens with 5000 digits",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        API_KEY,
        400,
        "digits",
    ),
    ("stop_token_ids outside vocab", "/v1/completions", {**GOOD, "stop_token_ids": [100000]}, API_KEY, 400, "vocabulary"),
    ("lone surrogate", "/v1/completions", b'{"model": "tiny", "prompt": "ab\\ud800cd", "max_tokens": 2}', API_KEY, 400, "unicode"),
    (
        "deeply nested JSON",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "hi", "metadata": ' + b"[" * 100000 + b"]" * 100000 + b"}",
        API_KEY,
        400,
        "nested",
    ),
    (
        "junk tool_calls",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": "junk"}]},
        API_KEY,
        400,
        "tool_calls",
    ),
    ("max_tokens as a string", "/v1/completions", {**GOOD, "max_tokens": "16"}, API_KEY, 400, "max_tokens"),
    ("max_tokens true", "/v1/completions", {**GOOD, "max_tokens": True}, API_KEY, 400, "max_tokens"),
    ("stream as a string", "/v1/completions", {**GOOD, "stream": "yes"}, API_KEY, 400, "stream"),
    (
        "stream_options without stream",
        "/v1/completions",
        {**GOOD, "stream_options": {"include_usage": True}},
        API_KEY,
        400,
        "stream_options",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        API_KEY,
        400,
        "top_logprobs",
    ),
    ("max_tokens past the context", "/v1/completions", {**GOOD, "max_tokens": 100000}, API_KEY, 400, "maximum context length is 256"),
    (
        "response_format",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {}}},
        API_KEY,
        400,
        'must be an object with a "schema"',
    ),
    ("uncompilable regex", "/v1/completions", {**GOOD, "guided_regex": "(unclosed"}, API_KEY, 400, "cannot be compiled"),
    (
        "tools",
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        API_KEY,
        400,
        "not in tools",
    ),
    (
        "tool_choice",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
        API_KEY,
        400,
        "tool_choice needs tools",
    ),
    ("bad_words empty", "/v1/completions", {**GOOD, "bad_words": [" "]}, API_KEY, 400, "non-empty strings"),
    ("logit_bias out of range", "/v1/completions", {**GOOD, "logit_bias": {"5": 500}}, API_KEY, 400, "[-100, 100]"),
    ("suffix", "/v1/completions", {**GOOD, "suffix": "tail"}, API_KEY, 400, "suffix is not supported"),
    ("best_of > 1", "/v1/completions", {**GOOD, "best_of": 2}, API_KEY, 400, "best_of is not supported"),
]


@pytest.mark.parametrize("case", BAD_HTTP, ids=[c[0] for c in BAD_HTTP])
def test_bad_http_input(cluster, case):
    _, path, body, key, status, words = case
    raw = body if isinstance(body, bytes) else None
    got_status, got = http_json(cluster["base"] + path, None if raw else body, key=key, raw=raw)
    assert got_status == status, got
    assert words.lower() in got["error"]["message"].lower(), got
    assert "traceback" not in got["error"]["message"].lower()


BAD_GRPC = [
    ("no input", moray_pb2.GenerateRequest(model="tiny"), AUTH, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (
        "temperature < 0",
        moray_pb2.GenerateRequest(model="tiny", prompt="hi", sampling=moray_pb2.SamplingOptions(temperature=-1)),
        AUTH,
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    (
        "max_tokens 0",
        moray_pb2.GenerateRequest(model="tiny", prompt="hi", sampling=moray_pb2.SamplingOptions(max_tokens=0)),
        AUTH,
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens",
    ),
    (
        "token id outside vocab",
        moray_pb2.GenerateRequest(model="tiny", token_ids=moray_pb2.TokenIds(ids=[5, 99999])),
        AUTH,
        grpc.StatusCode.INVALID_ARGUMENT,
        "vocabulary",
    ),
    ("unknown model", moray_pb2.GenerateRequest(model="nope", prompt="hi"), AUTH, grpc.StatusCode.NOT_FOUND, "nope"),
    (
        "bad role",
        moray_pb2.GenerateRequest(
            model="tiny", messages=moray_pb2.ChatMessages(messages=[moray_pb2.ChatMessage(role="wizard", content="x")])
        ),
        AUTH,
        grpc.StatusCode.INVALID_ARGUMENT,
        "role",
    ),
    (
        "missing API key",
        moray_pb2.GenerateRequest(model="tiny", prompt="hi"),
        (("application", "disagg"),),
        grpc.StatusCode.UNAUTHENTICATED,
        "API key",
    ),
    (
        "wrong API key",
        moray_pb2.GenerateRequest(model="tiny", prompt="hi"),
        (("authorization", "Bearer bad"), ("application", "disagg")),
        grpc.StatusCode.UNAUTHENTICATED,
        "invalid API key",
    ),
    # issue #13: INTERNAL with a Ray traceback in the details, or silently clamped
    (
        "stop token id outside vocab",
        moray_pb2.GenerateRequest(model="tiny", prompt="hi", sampling=moray_pb2.SamplingOptions(stop_token_ids=[99999])),
        AUTH,
        grpc.StatusCode.INVALID_ARGUMENT,
        "vocabulary",
    ),
    (
        "max_tokens past the context",
        moray_pb2.GenerateRequest(model="tiny", prompt="hi", sampling=moray_pb2.SamplingOptions(max_tokens=100000)),
        AUTH,
        grpc.StatusCode.INVALID_ARGUMENT,
        "maximum context length",
    ),
    (
        "oversized request",
        moray_pb2.GenerateRequest(model="tiny", prompt="x" * (2 << 20)),
        AUTH,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "larger than",
    ),
]


@pytest.mark.parametrize("case", BAD_GRPC, ids=[c[0] for c in BAD_GRPC])
def test_bad_grpc_input(cluster, case):
    _, request, metadata, code, words = case
    with grpc_channel(cluster) as ch:
        stub = moray_pb2_grpc.MorayStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, metadata=metadata, timeout=60))
        assert e.value.code() == code
        assert words.lower() in e.value.details().lower()
        assert "traceback" not in e.value.details().lower() and "\n" not in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(request, metadata=metadata, timeout=60)
        assert e.value.code() == code
        assert words.lower() in e.value.details().lower()


@pytest.mark.parametrize("method", ["Generate", "Complete"])
def test_grpc_undecodable_request_is_invalid_argument(cluster, method):
    with grpc_channel(cluster) as ch:
        call = (ch.unary_stream if method == "Generate" else ch.unary_unary)(f"/moray.v1.Moray/{method}")
        with pytest.raises(grpc.RpcError) as e:
            result = call(b"\xff\xff\xff not a protobuf", metadata=AUTH, timeout=60)
            list(result) if method == "Generate" else result
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "GenerateRequest" in e.value.details()


def test_grpc_oversized_prompt_is_refused_at_once_and_health_stays_fast(cluster):
    # A 5 MB prompt used to be tokenised (~10 s, on the event loop) before its rejection; /health stalled.
    health_latency = []

    def probe():
        time.sleep(0.3)
        start = time.monotonic()
        status, _ = http_json(cluster["base"] + "/health", key=None, timeout=60)
        health_latency.append((status, time.monotonic() - start))

    thread = threading.Thread(target=probe)
    thread.start()
    start = time.monotonic()
    with grpc_channel(cluster) as ch, pytest.raises(grpc.RpcError) as e:
        list(
            moray_pb2_grpc.MorayStub(ch).Generate(
                moray_pb2.GenerateRequest(model="tiny", prompt="y" * (5 << 20)), metadata=AUTH, timeout=60
            )
        )
    elapsed = time.monotonic() - start
    thread.join()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert elapsed < 5, elapsed
    assert health_latency[0][0] == 200 and health_latency[0][1] < 3, health_latency


def test_grpc_same_request_id_twice_at_once(cluster):
    # The second call used to get INTERNAL and the first to hang: client ids now never reach a worker.
    request = moray_pb2.GenerateRequest(
        model="tiny", prompt=PROMPT, request_id="my-id", sampling=moray_pb2.SamplingOptions(temperature=0, max_tokens=24, ignore_eos=True)
    )
    results: list = [None, None]

    def generate(i):
        with grpc_channel(cluster) as ch:
            try:
                results[i] = list(moray_pb2_grpc.MorayStub(ch).Generate(request, metadata=AUTH, timeout=60))
            except grpc.RpcError as e:
                results[i] = e

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for parts in results:
        assert isinstance(parts, list), f"{parts.code()}: {parts.details()}"
        assert parts[-1].finished and parts[-1].usage.completion_tokens == 24
        assert {p.request_id for p in parts} == {"my-id"}
    tokens = [[t for p in parts for t in p.token_ids] for parts in results]
    assert tokens[0] == tokens[1]  # greedy: the same prompt gives the same tokens


def serve_log_lines(marker: str) -> list[str]:
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return [line for path in logs.glob("*.log") for line in path.read_text(errors="replace").splitlines() if marker in line]


def test_grpc_client_errors_are_not_logged_as_errors_with_tracebacks(cluster):
    marker = f"nope-{uuid.uuid4().hex[:12]}"
    request = moray_pb2.GenerateRequest(model=marker, prompt="hi")
    with grpc_channel(cluster) as ch:
        stub = moray_pb2_grpc.MorayStub(ch)
        for call in (
            lambda: list(stub.Generate(request, metadata=AUTH, timeout=60)),
            lambda: stub.Complete(request, metadata=AUTH, timeout=60),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # Log files are flushed per record: wait for the refusal's INFO line, then look at everything logged.
    wait_until(lambda: any(f"client error 404: the model '{marker}'" in line for line in serve_log_lines(marker)), 10, 0.2)
    lines = serve_log_lines(marker)
    assert not [line for line in lines if "ERROR" in line or "APIError" in line or "Traceback" in line], "\n".join(lines)
    # Not silent either: the streaming call's refusal is one INFO line (the unary one logs nothing).
    assert any("INFO" in line and f"client error 404: the model '{marker}'" in line for line in lines), "\n".join(lines)


def test_unknown_route_through_serve_is_an_openai_error(cluster):
    status, body = http_json(cluster["base"] + "/v1/embeddings", {"input": "x"})
    assert status == 404 and body["error"]["message"] == "unknown route: POST /v1/embeddings", body


def test_still_serving_after_bad_input(cluster):
    out = client(cluster).completions.create(
        model="tiny", prompt="still alive?", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 3


def test_every_dashboard_query_reads_a_metric_this_server_exports(cluster):
    """The chart's Grafana dashboard (helm/gen_dashboard.py) against a real scrape: each series a query
    names exists, with the suffix its type gives it (a counter's `_total`, a histogram's `_bucket`)."""
    sys.path.insert(0, str(ROOT / "helm"))
    import gen_dashboard
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f.type for f in text_string_to_metric_families(http_json(cluster["base"] + "/metrics", key=None)[1])}
    exported = set()
    for name, kind in families.items():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}.get(kind, [""])
        exported.update(name + s for s in suffixes)
    board = json.loads((ROOT / "helm/moray/dashboards/moray.json").read_text())
    queried = gen_dashboard.queried_metrics(board)
    assert len(queried) >= 25, sorted(queried)
    missing = sorted(queried - exported)
    assert not missing, f"dashboard queries name series /metrics does not export: {missing}"


# ------------------------------------------------------------------ the API as the ecosystem's tools call it (#29)


def sse_events(base: str, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed response (raw HTTP: what a tool's own client parses)."""
    import requests

    with requests.post(base + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        lines = [line.decode() for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_streaming_requests_get_usage_on_every_chunk(cluster, path):
    """The body guidellm 0.8.1 sends (its OpenAI backend: stream_options with continuous_usage_stats, a
    fixed output length through ignore_eos and stop None): refused with a 400 before; now every chunk
    carries the usage so far (vLLM's meaning), and the last one the totals."""
    body = {
        "model": "tiny",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": 6,
        "stop": None,
        "ignore_eos": True,
        **({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}),
    }
    events = sse_events(cluster["base"], path, body)
    chunks = [e for e in events if e["choices"]]
    assert chunks and all("usage" in e for e in chunks)
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    plain = sse_events(cluster["base"], path, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": False}})
    assert all("usage" not in e for e in plain if e["choices"]) and plain[-1]["usage"]["completion_tokens"] == 6


REPORT_S = 1.0  # ten times a worker's report interval (cluster/reporting.py)


def _log_softmax(logits):
    import numpy as np

    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_lm_eval_loglikelihood_requests_score_prompts_as_transformers_does(cluster, model_dir):
    """lm-eval 0.4.13 `local-completions` loglikelihood with batch size 2: a list of token-id prompts, echo,
    logprobs 1, max_tokens 1 (its exact body), and the same with max_tokens 0. Each choice's token
    logprobs over the prompt (None for the first token) equal transformers' log-softmax to 1e-4; max_tokens
    0 generates nothing; vLLM's prompt_logprobs field gives the same numbers. Through the disaggregated
    app: a scoring request ends on the prefill worker (no handoff)."""
    from hf_checkpoints import hf_logits_many

    tok = [[5, 17, 200, 33, 90, 41], [7, 7, 300, 12]]
    expected = [_log_softmax(lg) for lg in hf_logits_many(model_dir, tok)]
    time.sleep(REPORT_S)  # the workers' counters arrive with their reports
    handoffs = metric(cluster, "moray_kv_handoffs")
    body = {"model": "tiny", "prompt": tok, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    for max_tokens in (1, 0):
        status, out = http_json(cluster["base"] + "/v1/completions", {**body, "max_tokens": max_tokens})
        assert status == 200, out
        choices = sorted(out["choices"], key=lambda ch: ch["index"])
        assert [ch["index"] for ch in choices] == [0, 1]
        for ids, ch, ref in zip(tok, choices, expected):
            lps = ch["logprobs"]["token_logprobs"]
            assert len(lps) == len(ids) + max_tokens and lps[0] is None
            want = [float(ref[i - 1, t]) for i, t in enumerate(ids) if i]
            assert max(abs(a - b) for a, b in zip(lps[1 : len(ids)], want)) < 1e-4
            offsets = ch["logprobs"]["text_offset"]
            assert offsets[0] == 0 and offsets == sorted(offsets) and len(offsets) == len(lps)
            assert all(top is None or max(top.values()) >= lp for lp, top in zip(lps[1:], ch["logprobs"]["top_logprobs"][1:]))
        assert out["usage"]["completion_tokens"] == 2 * max_tokens
    time.sleep(REPORT_S)
    assert metric(cluster, "moray_kv_handoffs") == handoffs  # one-token requests never reach a decode worker
    status, out = http_json(cluster["base"] + "/v1/completions", {"model": "tiny", "prompt": tok[0], "max_tokens": 1, "prompt_logprobs": 0})
    plp = out["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(tok[0])
    got = [plp[i][str(t)]["logprob"] for i, t in enumerate(tok[0]) if i]
    assert max(abs(a - float(expected[0][i, t])) for i, (a, t) in enumerate(zip(got, tok[0][1:]))) < 1e-4


def test_lm_eval_generate_until_with_batched_prompts_and_n(cluster):
    """lm-eval's generate_until with batch size 3 (a list of text prompts, stop sequences, a seed): one choice
    per prompt, numbered as OpenAI numbers them, each equal to the prompt sent alone; n samples per prompt
    (index = prompt * n + sample), seeded ones reproducible; usage summed with each prompt counted once."""
    prompts = [PROMPT, "Hello there", "One two three"]
    body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "stop": ["\n\n"], "seed": 1234, "ignore_eos": True}
    status, out = http_json(cluster["base"] + "/v1/completions", {**body, "prompt": prompts})
    assert status == 200, out
    alone = [http_json(cluster["base"] + "/v1/completions", {**body, "prompt": p})[1] for p in prompts]
    assert [ch["index"] for ch in out["choices"]] == [0, 1, 2]
    assert [ch["text"] for ch in out["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert out["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    sampled = {**body, "prompt": prompts[:2], "n": 3, "temperature": 1.0}
    a, b = (http_json(cluster["base"] + "/v1/completions", sampled)[1] for _ in range(2))
    assert [ch["index"] for ch in a["choices"]] == list(range(6))
    assert [ch["text"] for ch in a["choices"]] == [ch["text"] for ch in b["choices"]]
    assert len({ch["text"] for ch in a["choices"][:3]}) > 1  # the samples differ
    assert (
        a["usage"]["completion_tokens"] == 30
        and a["usage"]["prompt_tokens"] == out["usage"]["prompt_tokens"] - alone[2]["usage"]["prompt_tokens"]
    )
    chat = sse_events(
        cluster["base"],
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2, "stream": True, "ignore_eos": True},
    )
    roles = [ch["index"] for e in chat for ch in e["choices"] if ch["delta"].get("role")]
    assert sorted(roles) == [0, 1]


def test_tokenize_and_detokenize_as_vllm_serves_them(cluster):
    status, out = http_json(cluster["base"] + "/tokenize", {"model": "tiny", "prompt": PROMPT, "return_token_strs": True})
    assert status == 200 and out["count"] == len(out["tokens"]) == len(out["token_strs"]) and out["max_model_len"] > 0
    usage = client(cluster).completions.create(model="tiny", prompt=PROMPT, max_tokens=1).usage
    assert usage.prompt_tokens == out["count"]
    status, back = http_json(cluster["base"] + "/detokenize", {"model": "tiny", "tokens": out["tokens"]})
    assert status == 200 and back["prompt"].endswith(PROMPT)
    status, chat = http_json(cluster["base"] + "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert (
        status == 200
        and chat["count"]
        == client(cluster)
        .chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        .usage.prompt_tokens
    )
    for bad in ({"prompt": "x", "messages": []}, {"tokens": [1]}, {"prompt": "x", "bogus": 1}):
        path = "/tokenize" if "tokens" not in bad else "/detokenize"
        status, err = http_json(cluster["base"] + path, {**bad, "tokens": [10**9]} if path == "/detokenize" else bad)
        assert status == 400 and err["error"]["message"], err


def test_rebalance_experts_trigger_answers_per_worker_and_refuses_bad_input(cluster):
    """POST /admin/rebalance_experts reaches every live worker (balancing is off in this app: each says
    false); it needs the API key, and a body it does not understand is a 400 naming the field."""
    url = cluster["base"] + "/admin/rebalance_experts"
    status, out = http_json(url, raw=b"")
    assert status == 200 and out["workers"] and set(out["workers"].values()) == {False}, out
    status, health = http_json(cluster["base"] + "/health", key=None)
    assert len(out["workers"]) == health["decode_workers"] + health["prefill_workers"]
    assert http_json(url, {"wait": True})[0] == 200
    assert http_json(url, {}, key=None)[0] == 401
    for bad in ({"wait": "yes"}, {"period": 3}):
        status, err = http_json(url, bad)
        assert status == 400 and list(bad)[0] in err["error"]["message"], err


def test_grpc_returns_prompt_logprobs_and_logprobs_like_http(cluster):
    """SamplingOptions.prompt_logprobs: the first Generate message and the Complete response carry the
    prompt tokens' logprobs (from the second token), equal to the HTTP API's; Complete carries the output
    tokens' logprobs too."""
    ids = [5, 17, 200, 33, 90]
    _, http = http_json(cluster["base"] + "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 1})
    want = [http["choices"][0]["prompt_logprobs"][i][str(t)]["logprob"] for i, t in enumerate(ids) if i]
    sampling = moray_pb2.SamplingOptions(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    req = moray_pb2.GenerateRequest(model="tiny", token_ids=moray_pb2.TokenIds(ids=ids), sampling=sampling)
    with grpc_channel(cluster) as ch:
        stub = moray_pb2_grpc.MorayStub(ch)
        parts = list(stub.Generate(req, metadata=AUTH, timeout=120))
        full = stub.Complete(req, metadata=AUTH, timeout=120)
    for got in (parts[0].prompt_logprobs, full.prompt_logprobs):
        assert [e.token_id for e in got] == ids[1:]
        assert max(abs(e.logprob - w) for e, w in zip(got, want)) < 1e-5
    assert all(not p.prompt_logprobs for p in parts[1:])
    assert [e.token_id for e in full.logprobs] == list(full.token_ids) and len(full.logprobs) == 3


@pytest.mark.cluster
def test_an_app_whose_replica_never_starts_fails_its_fixture_in_time(model_dir, ray_serve):
    """`served_app` gives up on an app that does not start (here: a replica asking for more CPUs than the
    cluster has, so it is never scheduled) with Serve's word on it, and deletes it. It waited forever before:
    a multi-host replica that hung at start-up held the whole suite until CI's limit."""
    from ray import serve

    cfg = cluster_config(model_dir, name="never-starts", mode="colocated", decode={"resources": {"cpus": 64}})
    result = {}

    def start():
        try:
            with served_app(ray_serve, cfg, start_timeout=10):
                result["started"] = True
        except Exception as e:  # noqa: BLE001 - the test reads it
            result["error"] = e

    t0 = time.monotonic()
    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    starter.join(120)
    assert not starter.is_alive(), "served_app still waiting on a replica that cannot be scheduled"
    assert isinstance(result.get("error"), TimeoutError), result
    message = str(result["error"])
    assert "never-starts" in message and "DEPLOYING" in message and "DecodeServer" in message, message
    assert time.monotonic() - t0 < 90
    assert "never-starts" not in serve.status().applications
