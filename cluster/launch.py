"""Starting the application on Ray: shared by `moray serve` (local) and `cluster.deploy` (existing cluster)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request

from .config import ClusterConfig, PoolConfig

log = logging.getLogger("moray.cluster")


class StartupError(RuntimeError):
    """The application cannot start, or did not within the time allowed; the message is one line naming the cause."""


def start_serve(cfg: ClusterConfig, detached: bool) -> None:
    """Starts Serve's HTTP and gRPC proxies on the configured ports (none with `server.ingress: direct`) and submits the app; returns without
    waiting for the replicas (`wait_until_ready` does, with a time limit and a reason when they do not start)."""
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from .app import GRPC_SERVICERS, build_app

    serve.start(
        detached=detached,
        # direct: the front-end replicas listen on the ports themselves (cluster/direct_ingress.py)
        proxy_location="Disabled" if cfg.server.ingress == "direct" else "EveryNode",
        http_options=HTTPOptions(host=cfg.server.host, port=cfg.server.http_port, request_timeout_s=cfg.server.request_timeout_s),
        grpc_options=gRPCOptions(port=cfg.server.grpc_port, grpc_servicer_functions=GRPC_SERVICERS, enable_reflection=True),
    )
    # serve.run would wait for the replicas, with no time limit, even for ones that cannot be scheduled.
    serve.run_many(
        [serve.RunTarget(build_app(cfg.model_dump(mode="json")), name=cfg.name, route_prefix="/")],
        wait_for_ingress_deployment_creation=False,
        wait_for_applications_running=False,
    )


def wait_until_healthy(cfg: ClusterConfig, timeout_s: float = 1800.0, quiet: bool = False, route_prefix: str = "") -> None:
    """Polls /health (under `route_prefix`) until the workers have registered; model load and compile can take minutes."""
    host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::") else cfg.server.host
    url = f"http://{host}:{cfg.server.http_port}{route_prefix}/health"
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            try:
                status = json.loads(e.read() or b"{}")
            except ValueError:  # not our answer (nothing routed there yet): keep waiting
                status = {}
            msg = f"waiting for workers: {status.get('decode_workers', 0)} decode, {status.get('prefill_workers', 0)} prefill"
            if msg != last and not quiet:
                print(msg, file=sys.stderr, flush=True)
                last = msg
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the cluster did not become healthy within {timeout_s:.0f}s ({url})")


# ---- Can the pools be placed? -------------------------------------------------------------------------
# Serve's own actors (controller, proxies), the Frontend and the Registry ask for no CPU: only the worker pools need room.


def pool_demands(cfg: ClusterConfig) -> list[tuple[str, PoolConfig, int]]:
    """(pool name, pool, replicas Serve starts with) for each pool the cluster's mode runs."""
    pools = [("decode", cfg.decode)] if cfg.mode == "colocated" else [("prefill", cfg.prefill), ("decode", cfg.decode)]
    return [(name, pool, pool.autoscaling.min_replicas if pool.autoscaling is not None else pool.replicas) for name, pool in pools]


def replica_bundles(pool: PoolConfig) -> list[dict[str, float]]:
    """What one replica reserves: one bundle per host (cluster/app.py's pool_options and multihost.placement_options)."""
    bundle = {"CPU": float(pool.resources.cpus)}
    if pool.resources.tpu is not None:
        bundle["TPU"] = float(pool.resources.tpu.chips_per_host)
    if pool.resources.memory_gb and pool.hosts_per_replica == 1:
        bundle["memory"] = pool.resources.memory_gb * 2**30
    return [{k: v for k, v in bundle.items() if v > 0} for _ in range(pool.hosts_per_replica)]


def _amount(resource: str, value: float) -> str:
    if resource == "CPU":
        return f"{value:g} CPU" + ("" if value == 1 else "s")
    if resource == "TPU":
        return f"{value:g} TPU chip" + ("" if value == 1 else "s")
    if resource == "memory":
        return f"{value / 2**30:g} GiB of memory"
    return f"{value:g} {resource}"


def _fits(free: dict[str, float], need: dict[str, float]) -> bool:
    return all(free.get(r, 0.0) + 1e-9 >= v for r, v in need.items())


def _take(free: dict[str, float], need: dict[str, float]) -> None:
    for r, v in need.items():
        free[r] = free.get(r, 0.0) - v


def _place_replica(free: list[dict[str, float]], bundles: list[dict[str, float]], strategy: str) -> bool:
    """First fit of one replica's bundles onto the nodes' free resources (taken only when all fit)."""
    trial = [dict(f) for f in free]
    if len(bundles) > 1 and strategy == "STRICT_PACK":
        total: dict[str, float] = {}
        for b in bundles:
            for r, v in b.items():
                total[r] = total.get(r, 0.0) + v
        bundles, strategy = [total], "PACK"
    used: set[int] = set()
    for b in bundles:
        for i, f in enumerate(trial):
            if (strategy != "STRICT_SPREAD" or i not in used) and _fits(f, b):
                _take(f, b)
                used.add(i)
                break
        else:
            return False
    free[:] = trial
    return True


def placement_problems(cfg: ClusterConfig, nodes: list[dict[str, float]]) -> list[str]:
    """Why the pools' replicas cannot all be placed on nodes with these resources (empty: they fit).

    A first-fit estimate, exact for one node (a local Ray): each problem names the pool, what it needs
    and what the cluster has, e.g. "the decode pool cannot be placed: 4 replicas x 1 CPU = 4 CPUs needed,
    1 CPU available (the Ray cluster has 2 CPUs, the prefill pool takes 1 CPU)".
    """
    free = [dict(n) for n in nodes]
    totals: dict[str, float] = {}
    for n in nodes:
        for r, v in n.items():
            totals[r] = totals.get(r, 0.0) + v
    problems: list[str] = []
    taken: list[tuple[str, dict[str, float]]] = []  # pools placed so far and what they took
    for name, pool, n in pool_demands(cfg):
        bundles = replica_bundles(pool)
        per_replica: dict[str, float] = {}
        for b in bundles:
            for r, v in b.items():
                per_replica[r] = per_replica.get(r, 0.0) + v
        before = [dict(f) for f in free]
        placed = 0
        while placed < n and _place_replica(free, bundles, pool.placement_strategy):
            placed += 1
        if placed < n:
            problems.append(
                f"the {name} pool cannot be placed: "
                + _shortfall(name, n, placed, per_replica, bundles, pool, before, nodes, totals, taken)
            )
        got = {r: sum(b.get(r, 0.0) for b in before) - sum(f.get(r, 0.0) for f in free) for r in per_replica}
        taken.append((name, got))
    return problems


def _shortfall(name, n, placed, per_replica, bundles, pool, before, nodes, totals, taken) -> str:
    fix = f"lower {name}.replicas or {name}.resources, or give Ray more resources"
    for r, v in per_replica.items():
        needed, available = n * v, sum(f.get(r, 0.0) for f in before)
        if needed > available + 1e-9:
            others = [f"the {other} pool takes {_amount(r, got[r])}" for other, got in taken if got.get(r, 0.0) > 0]
            has = f"the Ray cluster has {_amount(r, totals.get(r, 0.0))}" + "".join(", " + o for o in others)
            return (
                f"{n} replica{'s' if n != 1 else ''} x {_amount(r, v)} = {_amount(r, needed)} needed, "
                f"{_amount(r, available)} available ({has}); {fix}"
            )
    # Enough in all, but not in the shape one replica needs.
    if len(bundles) > 1:
        shape = (
            f"each replica needs {len(bundles)} bundles of {', '.join(_amount(r, v) for r, v in bundles[0].items())}"
            f" ({pool.placement_strategy}{': on different nodes' if pool.placement_strategy == 'STRICT_SPREAD' else ''})"
        )
    else:
        shape = f"each replica needs {', '.join(_amount(r, v) for r, v in bundles[0].items())} on one node"
    largest = max(nodes, key=lambda node: node.get("CPU", 0.0), default={})
    return (
        f"{f'only {placed} of {n} replicas fit' if placed else 'no replica fits'}: {shape}, the Ray cluster has {len(nodes)} node{'s' if len(nodes) != 1 else ''}"
        f" (largest: {_amount('CPU', largest.get('CPU', 0.0))}); {fix}"
    )


def cluster_nodes() -> list[dict[str, float]]:
    """Total resources of each live node of the connected Ray cluster."""
    import ray

    return [dict(node.get("Resources", {})) for node in ray.nodes() if node.get("Alive")]


# ---- Waiting for the application -------------------------------------------------------------------------
POOL_OF_DEPLOYMENT = {"DecodeServer": "decode", "PrefillServer": "prefill", "Frontend": "frontend", "Registry": "registry"}


def _summary(message: str, limit: int = 400) -> str:
    """One line of a Serve status message: the message, or a traceback's last line (the error itself)."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    text = lines[-1] if len(lines) > 1 else (lines[0] if lines else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def serve_app_state(app_name: str) -> tuple[str | None, dict[str, tuple[str, str]], str]:
    """(application status, {pool: (deployment status, message)}, application message) from Serve."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None:
        return None, {}, ""
    pools = {
        POOL_OF_DEPLOYMENT.get(name, name): (str(getattr(d.status, "value", d.status)), d.message or "")
        for name, d in app.deployments.items()
    }
    return str(getattr(app.status, "value", app.status)), pools, app.message or ""


def wait_until_ready(
    cfg: ClusterConfig,
    timeout_s: float,
    known_problems: list[str] | None = None,
    poll_s: float = 1.0,
    say=lambda msg: print(msg, file=sys.stderr, flush=True),
) -> None:
    """Waits until /health answers 200 (every pool has a registered worker).

    Raises StartupError at once when Serve gives up on the application (a replica's constructor keeps
    failing), and after `timeout_s` with what is still missing: pools Serve cannot schedule (Serve's
    message names the resources each replica needs and what is available), `known_problems` from
    `placement_problems`, or replicas still loading. Never swallows signals: the caller's handlers run.
    """
    http, _ = addresses(cfg)
    url = f"{http}/health"
    deadline = time.monotonic() + timeout_s
    next_status = 0.0
    said: set[str] = set()
    health = "the HTTP proxy does not answer yet"
    pools: dict[str, tuple[str, str]] = {}
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            try:
                status = json.loads(e.read() or b"{}")
            except ValueError:
                status = {}
            health = f"workers registered: {status.get('decode_workers', 0)} decode, {status.get('prefill_workers', 0)} prefill"
            if health not in said:
                say(f"waiting for workers: {status.get('decode_workers', 0)} decode, {status.get('prefill_workers', 0)} prefill")
                said.add(health)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        now = time.monotonic()
        if now >= next_status:
            next_status = now + 2.0
            try:
                app_status, pools, app_message = serve_app_state(cfg.name)
            except Exception as e:  # noqa: BLE001 - a status probe must not end the wait
                log.debug("serve.status() failed: %s", e)
                app_status, app_message = None, ""
            if app_status == "DEPLOY_FAILED":
                failed = [f"{pool}: {_summary(msg)}" for pool, (st, msg) in pools.items() if st == "DEPLOY_FAILED" and msg]
                raise StartupError(
                    "the application failed to deploy (Serve gave up on it): " + ("; ".join(failed) or _summary(app_message))
                )
            for pool, (_, msg) in pools.items():
                if "to be scheduled" in msg and pool not in said:
                    said.add(pool)
                    say(f"the {pool} pool cannot be placed yet: {_summary(msg)}")
        if now >= deadline:
            break
        time.sleep(poll_s)
    reasons = list(known_problems or [])
    for pool, (st, msg) in pools.items():
        if st not in ("HEALTHY", "RUNNING") and msg:
            reasons.append(f"{pool} ({st}): {_summary(msg)}")
    if not reasons:
        reasons.append(f"{health}; replicas may still be loading the model (raise the start-up timeout)")
    raise StartupError(f"the application was not ready within {timeout_s:g}s: " + "; ".join(reasons))


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
        f'       -d \'{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}\'\n'
        f"  .venv/bin/python -m cluster.grpc_client --address {grpc_addr} --prompt Hello\n"
    )


def ensure_local_env() -> None:
    # Worker processes inherit the driver's environment: pin JAX to CPU where there is no TPU.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
