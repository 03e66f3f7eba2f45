"""The Serve application, built from one `ClusterConfig`.

    Frontend (HTTP + gRPC; the request pipeline) --> PrefillServer pool --KV chunks--> DecodeServer pool
        ^---------------- TokenDeltaBatch per step, one channel per front end ----------------/
    Registry (membership, worker metrics, the in-memory KV index) <-- every worker's reports

`build_app(args)` is the application builder used by `moray serve`, `cluster.deploy` and the Serve
config `moray serve-config` prints (import path `cluster.app:build_app`, args = the cluster config).
In `colocated` mode there is no prefill pool: decode replicas prefill locally.
"""

from __future__ import annotations

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


def build_app(args: dict[str, Any]) -> serve.Application:
    cfg = parse_cluster_config(args)
    cfg_dict = cfg.model_dump(mode="json")
    decode_deployment = serve.deployment(DecodeServer).options(name="DecodeServer", **pool_options(cfg, cfg.decode))
    if cfg.mode == "colocated":
        prefill = None
        decode = decode_deployment.bind(cfg_dict, None)
    else:
        prefill_deployment = serve.deployment(PrefillServer).options(name="PrefillServer", **pool_options(cfg, cfg.prefill))
        prefill = prefill_deployment.bind(cfg_dict)
        decode = decode_deployment.bind(cfg_dict, prefill)
    registry = (
        serve.deployment(Registry)
        .options(
            name=REGISTRY_DEPLOYMENT,
            num_replicas=1,  # the one owner of liveness
            ray_actor_options={"num_cpus": 0},
            max_ongoing_requests=10_000,  # reports are short; none may wait behind another
            logging_config=serve_logging(cfg),
            graceful_shutdown_timeout_s=1,  # nothing to drain: its state is rebuilt from the next reports
        )
        .bind(cfg_dict)
    )
    frontend = Frontend.options(
        name="Frontend",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1000,
        logging_config=serve_logging(cfg),
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
    )
    return frontend.bind(cfg_dict, prefill, decode, registry)


def serve_config(cfg: ClusterConfig) -> dict[str, Any]:
    """A Serve config (for `serve deploy` / KubeRay's serveConfigV2) running this cluster."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": cfg.server.host, "port": cfg.server.http_port, "request_timeout_s": cfg.server.request_timeout_s},
        "grpc_options": {"port": cfg.server.grpc_port, "grpc_servicer_functions": GRPC_SERVICERS},
        "applications": [{"name": cfg.name, "route_prefix": "/", "import_path": APP_IMPORT_PATH, "args": cfg.model_dump(mode="json")}],
    }
