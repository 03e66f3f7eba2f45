"""`server.ingress: direct` on a real local Ray: the front-end replica itself serves HTTP (the openai client,
SSE, errors in the OpenAI shape) and gRPC (statuses as through Serve's proxy), a client that leaves a
non-streamed request cancels it on its worker, and the listeners' sockets share a port between replicas
and fail clearly on one taken by another program."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
from cluster_harness import (
    API_KEY,
    cluster_config,
    free_port,
    http_json,
    openai_client,
    served_app,
    wait_for_idle_workers,
    wait_until,
    worker_stats,
)

from cluster.direct_ingress import reuse_port_socket
from protos.moray.v1 import moray_pb2, moray_pb2_grpc
from workers.models.make_model import make_model

pytestmark = pytest.mark.cluster

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def app(tmp_path_factory, ray_serve):
    model_dir = make_model(tmp_path_factory.mktemp("direct") / "tiny", "qwen3_moe", "tiny", seed=11)
    config = cluster_config(model_dir, name="direct", mode="colocated", server={"ingress": "direct"})
    with served_app(ray_serve, config) as served:
        yield served


def test_the_front_end_serves_http_itself(app, ray_serve):
    assert app.base != ray_serve.base and str(app.config["server"]["http_port"]) in app.base  # not through the proxy
    c = openai_client(app.base)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
    streamed = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in streamed) == out.choices[0].text
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 5

    status, body = http_json(app.base + "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1})
    assert status == 400 and "max_tokens" in body["error"]["message"]
    status, body = http_json(app.base + "/v1/completions", {"model": "tiny", "prompt": "hi"}, key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = http_json(app.base + "/v2/nothing", key=None)
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, body = http_json(app.base + "/health", key=None)
    assert status == 200 and body["decode_workers"] == 1
    status, text = http_json(app.base + "/metrics", key=None)
    assert status == 200 and "moray_request_failures" in text
    # Serve's proxy health path, which KubeRay probes on the head pod before its Service sends traffic there
    assert http_json(app.base + "/-/healthz", key=None) == (200, "success")


def test_direct_front_ends_run_on_the_head_node(app):
    """The Helm chart's Service selects the head pod: direct front ends must be there. The resource that
    pins them is the one Ray gives its head node (a renamed one would leave them unschedulable)."""
    import ray
    from ray._private.state import actors  # the GCS's actor table (the state API needs the dashboard)

    from cluster.app import HEAD_NODE_RESOURCE, frontend_actor_options
    from cluster.config import parse_cluster_config

    (head,) = [n for n in ray.nodes() if n["Alive"] and HEAD_NODE_RESOURCE in n["Resources"]]
    alive = [a for a in actors().values() if a["State"] == "ALIVE"]
    front_ends = [a for a in alive if app.name in a["Name"] and a["Name"].split("#")[1:2] == ["Frontend"]]
    assert front_ends and {a["Address"]["NodeID"] for a in front_ends} == {head["NodeID"]}
    config = parse_cluster_config(app.config)
    assert frontend_actor_options(config) == {"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}}
    assert frontend_actor_options(config.model_copy(update={"server": config.server.model_copy(update={"ingress": "serve"})})) == {
        "num_cpus": 0
    }


def test_the_front_end_serves_grpc_itself(app):
    port = app.config["server"]["grpc_port"]
    auth = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = moray_pb2_grpc.MorayStub(ch)
        sampling = moray_pb2.SamplingOptions(max_tokens=6, temperature=0, ignore_eos=True)
        request = moray_pb2.GenerateRequest(model="tiny", prompt=PROMPT, sampling=sampling)
        chunks = list(stub.Generate(request, metadata=auth, timeout=60))
        assert chunks[-1].finished and chunks[-1].usage.completion_tokens == 6
        done = stub.Complete(request, metadata=auth, timeout=60)
        assert list(done.token_ids) == [t for c in chunks for t in c.token_ids]
        assert stub.Health(moray_pb2.HealthRequest(), timeout=10).decode_workers == 1

        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=10))  # no key
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            bad = moray_pb2.GenerateRequest(model="tiny", prompt=PROMPT, sampling=moray_pb2.SamplingOptions(max_tokens=0))
            stub.Complete(bad, metadata=auth, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details()
        raw = ch.unary_stream("/moray.v1.Moray/Generate", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            list(raw(b"\xff\xfe not a protobuf", metadata=auth, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        from grpc_health.v1 import health_pb2, health_pb2_grpc

        check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING


def _cancelled(base: str) -> float:
    status, text = http_json(base + "/metrics", key=None)
    lines = [line for line in text.splitlines() if line.startswith("moray_request_failures_total{") and 'outcome="cancelled"' in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_a_client_leaving_a_non_streamed_request_cancels_it(app):
    """Serve's proxy cancels a request whose client disconnected; without it, the front end must itself.
    Before `cancel_on_disconnect` the request ran to its last token on the worker."""
    before = _cancelled(app.base)
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 240, "ignore_eos": true}'
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    sock = socket.create_connection(("127.0.0.1", app.config["server"]["http_port"]))
    sock.sendall(head.encode() + body)
    wait_until(lambda: worker_stats(app.name)["DecodeServer"].num_running == 1, 60, what="the request running on the worker")
    sock.close()
    left = time.monotonic()
    wait_until(lambda: _cancelled(app.base) > before, 30, what="the request counted as cancelled")
    stats = wait_for_idle_workers(app.name)
    assert stats["DecodeServer"].num_running == 0 and stats["DecodeServer"].num_free_blocks == stats["DecodeServer"].num_total_blocks
    assert time.monotonic() - left < 30


def test_the_proxy_health_path_turns_503_once_the_replica_stops():
    import asyncio

    from cluster.direct_ingress import proxy_health

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def call(wrapped, path):
        sent = []

        async def send(message):
            sent.append(message)

        asyncio.run(wrapped({"type": "http", "path": path, "method": "GET"}, None, send))
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    stopping = False
    wrapped = proxy_health(app, lambda: stopping)
    assert call(wrapped, "/-/healthz") == (200, b"success") and call(wrapped, "/v1/models") == (204, b"")
    stopping = True
    assert call(wrapped, "/-/healthz") == (503, b"This node is being drained.")


def test_listeners_share_a_port_and_name_a_taken_one():
    port = free_port()
    first, second = reuse_port_socket("127.0.0.1", port), reuse_port_socket("127.0.0.1", port)  # two replicas of a node
    first.close(), second.close()
    with socket.socket() as taken:  # another program, without SO_REUSEPORT
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match=r"cannot listen on 127\.0\.0\.1:\d+ \(server\.http_port\)"):
            reuse_port_socket("127.0.0.1", taken.getsockname()[1])


def test_a_serve_config_for_direct_ingress_starts_no_proxy(tmp_path):
    from cluster.app import serve_config
    from cluster.config import parse_cluster_config

    direct = parse_cluster_config({"engine": {"model": str(tmp_path)}, "server": {"ingress": "direct"}})
    assert serve_config(direct)["proxy_location"] == "Disabled"
    assert serve_config(parse_cluster_config({"engine": {"model": str(tmp_path)}}))["proxy_location"] == "EveryNode"


def test_a_front_end_collected_outside_serve_leaves_no_coroutine(tmp_path):
    """`Frontend.__del__` is what Serve calls on a replica it stops; Python calls it too when an in-process
    front end is collected. It was a coroutine: each collection warned that it was never awaited."""
    import gc
    import warnings

    from fakes import frontend_without_workers

    model_dir = make_model(tmp_path / "tiny", "qwen3_moe", "tiny", seed=11)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        frontend = frontend_without_workers(model_dir)
        del frontend
        gc.collect()
    assert not [w for w in seen if "never awaited" in str(w.message)]
