"""The peer router for `moray bench routing --peer sglang-router`: sglang-router (PyPI `sglang-router`, a
bench extra) in front of N single-worker Moray servers.

Each worker is its own `moray serve` process with its own local Ray and ports, serving one colocated
decode replica with the same engine settings as the Moray policies' workers; sglang-router's
`cache_aware` policy (an approximate radix tree per worker over request text, with a load-balance
fallback) picks among them. Moray's router is not involved: each server has one worker, so its own
decision is trivial. Per-worker load is what each server's /metrics counts (`vllm:prompt_tokens_total`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bench import scratch_dir

PEERS = ("sglang-router",)


def peer_available(name: str) -> str | None:
    """None when the peer can run here, else why not."""
    if name != "sglang-router":
        return f"unknown peer {name!r}"
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return "sglang-router is not installed (pip install 'sglang-router==0.3.2', or the project's `bench` extra)"
    return None


@dataclass
class PeerCluster:
    """N `moray serve` processes and a router in front; `url` is the router's."""

    url: str
    worker_urls: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def stop(self) -> None:
        import signal

        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)  # moray serve stops its local Ray on SIGINT
        deadline = time.monotonic() + 60
        for p in self.procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _free_port() -> int:
    from workers.parallel import free_port

    return free_port()


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def _wait(url: str, procs: list[subprocess.Popen], logs: list[Path], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _get(url)[0] == 200:
            return
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited with {p.returncode}; its log ({log}):\n{log.read_text()[-2000:]}")
        time.sleep(1.0)
    raise TimeoutError(f"{what}: {url} did not answer within {timeout_s:.0f}s")


PORT_TAKEN = ("Failed to bind", "Address already in use", "address already in use")


def _launch_worker(i: int, model: str, engine: dict, tmp: Path, env: dict, attempt: int) -> tuple[subprocess.Popen, str, Path]:
    """One single-worker `moray serve` on fresh ports: (process, its URL, its log)."""
    cfg = {
        "name": f"peer{i}",
        "mode": "colocated",
        "engine": {**engine, "model": model},
        "decode": {"replicas": 1, "resources": {"cpus": 0.1}},
        "server": {"http_port": _free_port(), "grpc_port": _free_port(), "host": "127.0.0.1"},
    }
    path = tmp / f"worker{i}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp / f"worker{i}.{attempt}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--config", str(path), "--num-cpus", "1"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**env, "RAY_TMPDIR": str(tmp / f"ray{i}")},
        cwd=Path(__file__).resolve().parent.parent,
        start_new_session=True,
    )
    return proc, f"http://127.0.0.1:{cfg['server']['http_port']}", log


def _start_workers(cluster: "PeerCluster", model: str, workers: int, engine: dict, tmp: Path, env: dict, timeout_s: float) -> None:
    """Starts the servers together; one whose port was taken meanwhile (free ports are picked before the
    servers and their local Rays bind theirs, so several starting at once can collide) starts again."""
    slots = [_launch_worker(i, model, engine, tmp, env, 0) for i in range(workers)]
    attempts = [0] * workers
    deadline = time.monotonic() + timeout_s
    ready = [False] * workers
    while not all(ready):
        if time.monotonic() > deadline:
            raise TimeoutError(f"peer workers did not answer within {timeout_s:.0f}s; logs in {tmp}")
        for i, (proc, url, log) in enumerate(slots):
            if ready[i]:
                continue
            if _get(url + "/health")[0] == 200:
                ready[i] = True
            elif proc.poll() is not None:
                text = log.read_text()
                if attempts[i] < 3 and any(m in text for m in PORT_TAKEN):
                    attempts[i] += 1
                    slots[i] = _launch_worker(i, model, engine, tmp, env, attempts[i])
                    continue
                cluster.procs = [p for p, _, _ in slots]
                raise RuntimeError(f"a peer worker exited with {proc.returncode}; its log ({log}):\n{text[-2000:]}")
        time.sleep(1.0)
    cluster.procs = [p for p, _, _ in slots]
    cluster.worker_urls = [u for _, u, _ in slots]
    cluster.logs = [log for _, _, log in slots]


def start(model: str, workers: int, engine: dict, policy: str = "cache_aware", timeout_s: float = 900) -> PeerCluster:
    """Starts `workers` single-worker Moray servers (concurrently) and sglang-router over them."""
    tmp = Path(scratch_dir("moray-bench-peer-"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    env.pop("RAY_ADDRESS", None)
    cluster = PeerCluster(url="", worker_urls=[])
    try:
        _start_workers(cluster, model, workers, engine, tmp, env, timeout_s)
        port = _free_port()
        log = tmp / "router.log"
        cluster.logs.append(log)
        cluster.procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sglang_router.launch_router",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--policy",
                    policy,
                    "--log-level",
                    "warn",
                    "--prometheus-host",
                    "127.0.0.1",
                    "--prometheus-port",  # its default (29000) may be taken
                    str(_free_port()),
                    "--worker-urls",
                    *cluster.worker_urls,
                ],
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )
        cluster.url = f"http://127.0.0.1:{port}"
        _wait(cluster.url + "/v1/models", cluster.procs, cluster.logs, 120, "sglang-router")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def prompt_tokens_per_worker(cluster: PeerCluster) -> dict[str, float]:
    """Each server's cumulative prompt tokens (`vllm:prompt_tokens_total`): the peer router's load split."""
    out = {}
    for i, url in enumerate(cluster.worker_urls):
        status, text = _get(url + "/metrics", timeout=30)
        total = 0.0
        for line in text.splitlines() if status == 200 else []:
            if line.startswith("vllm:prompt_tokens_total"):
                total += float(line.rsplit(" ", 1)[1])
        out[f"peer{i}"] = total
    return out
