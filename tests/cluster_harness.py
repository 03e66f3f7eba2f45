"""A real local Ray cluster with Moray deployed, for the cluster tests."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench import scratch_dir
from workers.parallel import free_port

# One persistent XLA cache for every replica the session starts: the cluster tests' apps run the same few tiny
# models on the same shapes, so only the first replica of each compiles (measured: the hybrid cluster module
# 77 s without, 38 s once warm). A fresh directory per session: nothing carries over between runs.
XLA_CACHE = scratch_dir("moray-tests-xla-")

TEST_ENGINE = {
    "block_size": 8,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "max_model_len": 256,
    # One bucket of each: a replica compiles one step program (two for a hybrid), not four (the tiny models
    # are compile-bound; bucket selection is the engine tests' own, tests/test_engine.py).
    "token_buckets": [64],
    "page_buckets": [32],
    "compilation_cache_dir": XLA_CACHE,
}
API_KEY = "test-key"


def cluster_config(model_dir: Path, **overrides) -> dict:
    cfg = {
        "engine": {"model": str(model_dir), **TEST_ENGINE},
        "server": {"http_port": free_port(), "grpc_port": free_port(), "api_keys": [API_KEY]},
        # Every prompt goes through remote prefill + KV handoff unless a test says otherwise.
        "router": {"remote_prefill_min_tokens": 0},
        # Small chunks (a block of the tiny model is a few KiB), so handoffs move several of them, through the
        # object store (not inline in the handoff, as a tiny model's KV would go by default).
        "kv_transfer": {"chunk_mib": 1 / 256, "inline_kib": 0},
        "prefill": {"resources": {"cpus": 1}},
        "decode": {"resources": {"cpus": 1}},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def openai_client(base: str):
    """The openai client against a served app's base URL (no retries: a failure is the test's to see)."""
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def metric_total(base: str, name: str) -> float:
    """The sum of a metric's samples over all its labels on the app's /metrics."""
    status, text = http_json(base + "/metrics", key=None)
    assert status == 200
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def http_json(url: str, body: dict | None = None, key: str | None = API_KEY, timeout: float = 120, raw: bytes | None = None, headers=None):
    """(status, parsed JSON body) of a request; never raises on HTTP errors."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=h, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            return r.status, (json.loads(text) if r.headers.get_content_type() == "application/json" else text)
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        try:
            return e.code, json.loads(text)
        except json.JSONDecodeError:
            return e.code, text


def wait_until(predicate, timeout: float = 60.0, every: float = 0.05, what: str = "the condition"):
    """Polls `predicate()` until it returns something true (returned) or `timeout` passes (TimeoutError):
    what tests wait with instead of sleeping a fixed time."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:g}s")
        time.sleep(every)


def wait_healthy(base: str, timeout: float = 600) -> None:
    def healthy():
        try:
            return http_json(base + "/health", key=None, timeout=5)[0] == 200
        except OSError:
            return False

    wait_until(healthy, timeout, every=0.25, what=f"{base}/health answering 200")


def init_ray():
    import ray

    # One CPU device per worker process is enough here; set for Ray's workers only, so this test
    # process (and the subprocesses later tests start) keep conftest's 8 virtual devices.
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    ray.init(
        address="local", num_cpus=8, include_dashboard=False, logging_level="ERROR", log_to_driver=False, runtime_env={"env_vars": env}
    )


@dataclass
class ServeCluster:
    """The session's one local Ray cluster and Serve instance (conftest's `ray_serve` fixture)."""

    http_port: int
    grpc_port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def start_serve_cluster() -> ServeCluster:
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from cluster.app import GRPC_SERVICERS

    init_ray()
    cluster = ServeCluster(free_port(), free_port())
    serve.start(
        http_options=HTTPOptions(host="127.0.0.1", port=cluster.http_port),
        grpc_options=gRPCOptions(port=cluster.grpc_port, grpc_servicer_functions=GRPC_SERVICERS, enable_reflection=True),
    )
    return cluster


@dataclass
class ServedApp:
    name: str
    base: str  # the app's URL, route prefix included
    config: dict


def wait_app_running(name: str, timeout: float) -> None:
    """Until Serve reports the app RUNNING: an error with Serve's status of it if it failed to deploy or did
    not start in time. (`serve.run` waits without a limit: a replica that never came up, or came up and was
    replaced again and again, held the whole suite until CI's limit.)"""
    from ray import serve

    seen = {}

    def running():
        app = seen["app"] = serve.status().applications.get(name)
        if app is not None and app.status == "DEPLOY_FAILED":
            raise RuntimeError(f"Serve app {name!r} failed to deploy: {app.message}")
        return app is not None and app.status == "RUNNING"

    try:
        wait_until(running, timeout, every=0.5, what=f"Serve app {name!r} running")
    except TimeoutError as e:
        app = seen.get("app")
        deployments = {d: (s.status, s.message) for d, s in app.deployments.items()} if app else {}
        raise TimeoutError(f"{e}: {app.status if app else 'not known to Serve'} {deployments}") from None


@contextmanager
def served_app(cluster: ServeCluster, config: dict, route_prefix: str | None = None, start_timeout: float = 600):
    """Deploys the cluster config (`cluster_config(...)`) as one Serve app of the session's Serve instance at
    `route_prefix` (default /<name>), waits until it is healthy, and deletes it afterwards. The config's
    server ports become the shared instance's, except for an app with `server.ingress: direct`, whose front end
    listens on the config's own ports (at /)."""
    with served_apps(cluster, (config, route_prefix), start_timeout=start_timeout) as (app,):
        yield app


@contextmanager
def served_apps(cluster: ServeCluster, *apps: tuple[dict, str | None], start_timeout: float = 600):
    """`served_app` for several (config, route prefix) pairs at once: every app is deployed before any is
    waited for, so their replicas start together (one after another, a module's three apps took ~3 minutes
    to start on a loaded 2-core machine), and they are deleted together."""
    from ray import serve

    from cluster.app import build_app

    served = []
    for config, route_prefix in apps:
        server = config.get("server", {})
        direct = server.get("ingress") == "direct"
        if not direct:
            config = {**config, "server": {**server, "http_port": cluster.http_port, "grpc_port": cluster.grpc_port}}
        name = config.get("name", "moray")
        prefix = route_prefix if route_prefix is not None else f"/{name}"
        base = f"http://127.0.0.1:{server['http_port']}" if direct else cluster.base + ("" if prefix == "/" else prefix)
        served.append((ServedApp(name, base, config), prefix))
    try:
        for app, prefix in served:
            serve._run(build_app(app.config), name=app.name, route_prefix=prefix, _blocking=False)  # deployed, not yet started
        for app, _ in served:
            wait_app_running(app.name, start_timeout)
            wait_healthy(app.base)
        yield tuple(app for app, _ in served)
    finally:
        for app, _ in served:
            serve.delete(app.name, _blocking=False)
        wait_until(lambda: not {app.name for app, _ in served} & set(serve.status().applications), 300, every=0.25, what="the apps deleted")


def worker_stats(app: str) -> dict:
    """pool -> its (one) worker's engine figures, asked of the worker itself."""
    from ray import serve

    stats = {}
    for name in ("PrefillServer", "DecodeServer"):
        try:
            handle = serve.get_deployment_handle(name, app)
        except Exception:  # noqa: BLE001 - colocated apps have no prefill pool
            continue
        stats[name] = handle.heartbeat.remote().result(timeout_s=30).engine
    return stats


def idle(stats: dict) -> bool:
    return all(e.num_free_blocks == e.num_total_blocks and e.num_running == 0 and e.num_held == 0 for e in stats.values())


def wait_for_idle_workers(app: str, timeout: float = 30) -> dict:
    """Waits until every worker of `app` holds no request and no KV block; returns the last figures."""
    last = {}

    def check():
        last.update(worker_stats(app))
        return idle(last)

    try:
        wait_until(check, timeout, 0.25)
    except TimeoutError:
        pass
    return last
