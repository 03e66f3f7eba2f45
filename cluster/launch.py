"""Starting the application on Ray: shared by `moray serve` (local) and `cluster.deploy` (existing cluster)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request

from .config import ClusterConfig

log = logging.getLogger("moray.cluster")


def start_serve(cfg: ClusterConfig, detached: bool) -> None:
    """Starts Serve's HTTP and gRPC proxies on the configured ports and deploys the app (non-blocking)."""
    from ray import serve
    from ray.serve.config import gRPCOptions, HTTPOptions

    from .app import GRPC_SERVICERS, build_app

    serve.start(
        detached=detached,
        http_options=HTTPOptions(host=cfg.server.host, port=cfg.server.http_port, request_timeout_s=cfg.server.request_timeout_s),
        grpc_options=gRPCOptions(port=cfg.server.grpc_port, grpc_servicer_functions=GRPC_SERVICERS, enable_reflection=True),
    )
    serve.run(build_app(cfg.model_dump(mode="json")), name=cfg.name, route_prefix="/", blocking=False)


def wait_until_healthy(cfg: ClusterConfig, timeout_s: float = 1800.0, quiet: bool = False) -> None:
    """Polls /health until the workers have registered; model load and compile can take minutes."""
    host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::") else cfg.server.host
    url = f"http://{host}:{cfg.server.http_port}/health"
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            status = json.loads(e.read() or b"{}")
            msg = f"waiting for workers: {status.get('decode_workers', 0)} decode, {status.get('prefill_workers', 0)} prefill"
            if msg != last and not quiet:
                print(msg, file=sys.stderr, flush=True)
                last = msg
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the cluster did not become healthy within {timeout_s:.0f}s ({url})")


def addresses(cfg: ClusterConfig) -> tuple[str, str]:
    host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::") else cfg.server.host
    return f"http://{host}:{cfg.server.http_port}", f"{host}:{cfg.server.grpc_port}"


def how_to_call(cfg: ClusterConfig) -> str:
    http, grpc_addr = addresses(cfg)
    model = cfg.engine.model_name
    auth = ' -H "Authorization: Bearer $MORAY_API_KEY"' if cfg.server.api_keys or cfg.server.api_keys_env else ""
    return (
        f"Moray is serving '{model}'\n"
        f"  HTTP (OpenAI-compatible): {http}/v1\n"
        f"  gRPC (moray.v1.Moray):    {grpc_addr}\n\n"
        f"  curl {http}/v1/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"       -d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'\n"
        f"  .venv/bin/python -m cluster.grpc_client --address {grpc_addr} --prompt Hello\n"
    )


def ensure_local_env() -> None:
    # Worker processes inherit the driver's environment: pin JAX to CPU where there is no TPU.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
