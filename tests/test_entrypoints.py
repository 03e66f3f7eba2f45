"""The ways users start Moray, end to end: `moray serve` (what `make serve` runs) and
`ray start` + `ray job submit ... cluster.deploy` on an existing cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cluster_harness import API_KEY, cluster_config, free_port, http_json, wait_healthy
from workers.models.make_model import make_model

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("entry") / "tiny", "qwen3_moe", "tiny", seed=5)


def env() -> dict:
    e = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "token"}
    e.pop("JAX_NUM_CPU_DEVICES", None)
    # The job's `python` is whatever the raylet finds first: this venv's, as on a real cluster's image.
    e["PATH"] = f"{BIN}{os.pathsep}{e.get('PATH', '')}"
    return e


def complete(base: str) -> dict:
    status, body = http_json(base + "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
    assert status == 200, body
    return body


def test_moray_serve_serves_and_shuts_down_cleanly(model_dir, tmp_path):
    cfg = cluster_config(model_dir, mode="colocated")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [str(BIN / "moray"), "serve", "--config", str(path)], cwd=ROOT, env=env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    base = f"http://127.0.0.1:{cfg['server']['http_port']}"
    try:
        wait_healthy(base, timeout=600)
        assert complete(base)["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert f"HTTP (OpenAI-compatible): {base}/v1" in out
    with pytest.raises(OSError):
        http_json(base + "/health", key=None, timeout=5)


def test_ray_job_submit_deploys_onto_an_existing_cluster(model_dir, tmp_path):
    gcs, dashboard = free_port(), free_port()
    cfg = cluster_config(model_dir)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ray = str(BIN / "ray")
    start = subprocess.run(
        [ray, "start", "--head", f"--port={gcs}", f"--dashboard-port={dashboard}", "--num-cpus=8", "--include-dashboard=true",
         f"--ray-client-server-port={free_port()}", "--disable-usage-stats"],
        env=env(), capture_output=True, text=True, timeout=180,
    )
    assert start.returncode == 0, start.stderr
    try:
        job = subprocess.run(
            [ray, "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--working-dir", str(ROOT), "--",
             "python", "-m", "cluster.deploy", "--config", str(path), "--timeout", "600"],
            env=env(), capture_output=True, text=True, timeout=900,
        )
        assert job.returncode == 0, job.stdout + job.stderr
        assert "Moray is serving" in job.stdout
        base = f"http://127.0.0.1:{cfg['server']['http_port']}"
        assert complete(base)["choices"][0]["finish_reason"] == "length"
    finally:
        subprocess.run([ray, "stop", "--force"], env=env(), capture_output=True, timeout=120)
