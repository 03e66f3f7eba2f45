"""A real local Ray cluster with Moray deployed, for the cluster tests."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

TEST_ENGINE = {
    "block_size": 8,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "max_model_len": 256,
    "token_buckets": [8, 64],
    "page_buckets": [4, 32],
    "compilation_cache_dir": None,
}
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_config(model_dir: Path, **overrides) -> dict:
    cfg = {
        "engine": {"model": str(model_dir), **TEST_ENGINE},
        "server": {"http_port": free_port(), "grpc_port": free_port(), "api_keys": [API_KEY]},
        # Every prompt goes through remote prefill + KV handoff unless a test says otherwise.
        "router": {"remote_prefill_min_tokens": 0},
        "prefill": {"resources": {"cpus": 1}},
        "decode": {"resources": {"cpus": 1}},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def worker_load(worker: str, role: str = "decode", **overrides) -> dict:
    """A worker's heartbeat (`workers.worker.EngineWorker.load`), idle unless told otherwise: what the
    ingress's `report` takes from a fake worker."""
    return {
        "worker_id": worker,
        "role": role,
        "num_running": 0,
        "num_waiting": 0,
        "kv_usage": 0.0,
        "num_free_blocks": 100,
        "num_total_blocks": 100,
        "pending_prefill_tokens": 0,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
        "num_held": 0,
        "epoch": 1,
        "last_seq": -1,
        "healthy": True,
        "ts": time.time(),
        **overrides,
    }


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


def wait_healthy(base: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status, body = http_json(base + "/health", key=None, timeout=5)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{base} did not become healthy")


def init_ray():
    import ray

    # One CPU device per worker process is enough here; set for Ray's workers only, so this test
    # process (and the subprocesses later tests start) keep conftest's 8 virtual devices.
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    ray.init(
        address="local", num_cpus=8, include_dashboard=False, logging_level="ERROR", log_to_driver=False, runtime_env={"env_vars": env}
    )
