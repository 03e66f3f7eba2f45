"""The Serve application, built from one `ClusterConfig`.

    Frontend (HTTP + gRPC; the request pipeline) --> PrefillServer pool --KV chunks--> DecodeServer pool
        ^---------------- TokenDeltaBatch per step, one channel per front end ----------------/
    Registry (membership, worker metrics, the in-memory KV index) <-- every worker's reports

`build_app(args)` is the application builder used by `moray serve`, `cluster.deploy` and the Serve
config `moray serve-config` prints (import path `cluster.app:build_app`, args = the cluster config).
In `colocated` mode there is no prefill pool: decode replicas prefill locally.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from .config import ClusterConfig, PoolConfig, parse_cluster_config
from .frontend import Frontend
from .multihost import placement_options
from .registry import REGISTRY_DEPLOYMENT, Registry
from .servers import DecodeServer, PrefillServer
from .targeting import REQUEST_ROUTER_CLASS

APP_IMPORT_PATH = "cluster.app:build_app"
# The resource Ray gives the head node alone (ray._common.constants.HEAD_NODE_RESOURCE_NAME).
HEAD_NODE_RESOURCE = "node:__internal_head__"
GRPC_SERVICERS = [
    # Not the generated protos.moray.v1.moray_pb2_grpc one: requests reach the ingress undecoded (see there).
    "cluster.grpc_service.add_MorayServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


def serve_logging(cfg: ClusterConfig) -> dict[str, Any]:
    """Serve's own logging of the deployments. Quiet: no per-call access log lines (workers report to the
    registry several times a second); JSON lines when the cluster's Moray records are (cluster/logs.py)."""
    encoding = "JSON" if cfg.observability.log_format == "json" else "TEXT"
    return {"enable_access_log": False, "log_level": "WARNING", "encoding": encoding}


def pool_options(cfg: ClusterConfig, pool: PoolConfig) -> dict[str, Any]:
    """Serve deployment options of a worker pool: replicas or autoscaling, resources, timeouts."""
    actor: dict[str, Any] = {"num_cpus": pool.resources.cpus}
    if pool.resources.memory_gb:
        actor["memory"] = int(pool.resources.memory_gb * 2**30)
    if pool.resources.tpu is not None:
        actor["resources"] = {"TPU": pool.resources.tpu.chips_per_host}
    if pool.label_selector:
        actor["label_selector"] = dict(pool.label_selector)
    if pool.env:
        actor["runtime_env"] = {"env_vars": dict(pool.env)}
    opts: dict[str, Any] = {
        "ray_actor_options": actor,
        "max_ongoing_requests": pool.max_ongoing_requests,
        # Model load and XLA warm-up can take minutes: probe health deliberately, not on defaults.
        "health_check_period_s": cfg.health_check_period_s,
        "health_check_timeout_s": cfg.health_check_timeout_s,
        "graceful_shutdown_timeout_s": cfg.graceful_shutdown_timeout_s,
        # How often a stopping replica checks whether its requests ended (default 2 s): a decode replica's
        # streams move away within about a second of the stop (the registry's drain), so it can go then.
        "graceful_shutdown_wait_loop_s": 0.5,
        "request_router_config": RequestRouterConfig(request_router_class=REQUEST_ROUTER_CLASS),
        "logging_config": serve_logging(cfg),
        **placement_options(pool),
    }
    if pool.autoscaling is not None:
        opts["autoscaling_config"] = {
            "min_replicas": pool.autoscaling.min_replicas,
            "max_replicas": pool.autoscaling.max_replicas,
            "target_ongoing_requests": pool.autoscaling.target_ongoing_requests,
        }
    else:
        opts["num_replicas"] = pool.replicas
    return opts


def replica_args(cfg: ClusterConfig) -> dict[str, Any]:
    """The config every replica is built with, without the pools' scaling (`replicas`, `autoscaling`): that
    is Serve's (the deployments' options) and no replica reads it. Serve restarts the replicas of a
    deployment whose arguments changed, so a change of scale alone must leave them as they are: a scale-down
    stops only the replicas it removes (whose streams move elsewhere), and no model loads again."""
    args = cfg.model_dump(mode="json")
    default = PoolConfig().model_dump(mode="json")
    for pool in ("prefill", "decode"):
        args[pool]["replicas"], args[pool]["autoscaling"] = default["replicas"], default["autoscaling"]
    return args


@functools.cache
def code_fingerprint() -> str:
    """A hash of Moray's own source (the packages its replicas run): part of every deployment's version."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for package in ("cluster", "workers", "kernels", "protos"):
        for f in sorted((root / package).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def deployment_version(args: dict[str, Any]) -> str:
    """The version of the deployments built from `args` (`replica_args`): the same config and code give the
    same version. `serve.run` otherwise gives every deployment a random one, and a deployment whose
    version changed restarts all its replicas: redeploying with a new replica count alone would reload
    every model instead of starting or stopping only the replicas that differ. (Declarative deploys,
    `serve deploy` / KubeRay, version an app by a hash of its args: the pools' scale goes into the
    deployments' options there, see `serve_config`.)"""
    return hashlib.sha256(json.dumps(args, sort_keys=True).encode() + code_fingerprint().encode()).hexdigest()[:16]


def _versioned(deployment, version: str):
    """`deployment` with `version`. Serve took `version` out of its public options (it versions deployments
    itself, randomly for `serve.run`); the internal form still takes it."""
    try:
        return deployment.options(version=version, _internal=True)
    except (TypeError, ValueError):  # a Serve without it: random versions (a redeploy restarts every replica)
        return deployment


def frontend_actor_options(cfg: ClusterConfig) -> dict[str, Any]:
    """Ray options of a front-end replica: no CPU reserved (it waits on sockets and handles). With direct
    ingress the replicas are the listeners, so they run on the head node, where clients (and the Helm
    chart's Service, which selects the head pod) find them; behind Serve's proxies any node will do."""
    options: dict[str, Any] = {"num_cpus": 0}
    if cfg.server.ingress == "direct":
        options["resources"] = {HEAD_NODE_RESOURCE: 0.001}
    return options


def build_app(args: dict[str, Any]) -> serve.Application:
    cfg = parse_cluster_config(args)
    cfg_dict = replica_args(cfg)
    version = deployment_version(cfg_dict)
    decode_deployment = _versioned(serve.deployment(DecodeServer).options(name="DecodeServer", **pool_options(cfg, cfg.decode)), version)
    if cfg.mode == "colocated":
        prefill = None
        decode = decode_deployment.bind(cfg_dict, None)
    else:
        prefill_deployment = _versioned(
            serve.deployment(PrefillServer).options(name="PrefillServer", **pool_options(cfg, cfg.prefill)), version
        )
        prefill = prefill_deployment.bind(cfg_dict)
        decode = decode_deployment.bind(cfg_dict, prefill)
    registry = _versioned(
        serve.deployment(Registry).options(
            name=REGISTRY_DEPLOYMENT,
            num_replicas=1,  # the one owner of liveness
            ray_actor_options={"num_cpus": 0},
            max_ongoing_requests=10_000,  # reports are short; none may wait behind another
            logging_config=serve_logging(cfg),
            graceful_shutdown_timeout_s=1,  # nothing to drain: its state is rebuilt from the next reports
        ),
        version,
    ).bind(cfg_dict)
    frontend = _versioned(
        Frontend.options(
            name="Frontend",
            ray_actor_options=frontend_actor_options(cfg),
            max_ongoing_requests=1000,
            logging_config=serve_logging(cfg),
            graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
        ),
        version,
    )
    return frontend.bind(cfg_dict, prefill, decode, registry)


def serve_config(cfg: ClusterConfig) -> dict[str, Any]:
    """A Serve config (for `serve deploy` / KubeRay's serveConfigV2) running this cluster."""
    return {
        "proxy_location": "Disabled" if cfg.server.ingress == "direct" else "EveryNode",
        "http_options": {"host": cfg.server.host, "port": cfg.server.http_port, "request_timeout_s": cfg.server.request_timeout_s},
        "grpc_options": {"port": cfg.server.grpc_port, "grpc_servicer_functions": GRPC_SERVICERS},
        "applications": [{"name": cfg.name, "route_prefix": "/", "import_path": APP_IMPORT_PATH, "args": cfg.model_dump(mode="json")}],
    }
