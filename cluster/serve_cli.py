"""`moray serve`: start local Ray (unless one is running), deploy, print how to call it, block until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from .config import ClusterConfig, ConfigError, load_cluster_config, parse_cluster_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="cluster config YAML")
    p.add_argument("--model", type=Path, help="model directory (when no --config)")
    p.add_argument("--http-port", type=int)
    p.add_argument("--grpc-port", type=int)
    p.add_argument("--mode", choices=["disaggregated", "colocated"])
    p.add_argument("--address", help="Ray address of an existing cluster (default: auto-detect, else start one)")


def resolve_config(args: argparse.Namespace) -> ClusterConfig:
    if args.config is not None:
        data = load_cluster_config(args.config).model_dump(exclude_unset=True)
        if args.model is not None:
            data["engine"]["model"] = str(args.model)
    elif args.model is not None:
        data = {"engine": {"model": str(args.model)}}
    else:
        raise ConfigError("give --config FILE or --model DIR")
    if args.http_port:
        data.setdefault("server", {})["http_port"] = args.http_port
    if args.grpc_port:
        data.setdefault("server", {})["grpc_port"] = args.grpc_port
    if getattr(args, "mode", None):
        data["mode"] = args.mode
    # Workers may run in another directory: pin the model to an absolute path.
    data["engine"]["model"] = str(Path(data["engine"]["model"]).expanduser().resolve())
    return parse_cluster_config(data)


def connect_ray(address: str | None, verbose: bool) -> None:
    import ray

    # Quiet by default: replica logs stay in Ray's log directory unless -v.
    opts = {"logging_level": "INFO" if verbose else "WARNING", "log_to_driver": verbose}
    if address:
        ray.init(address=address, **opts)
        return
    try:
        ray.init(address="auto", **opts)
    except (ConnectionError, RuntimeError):
        ray.init(**opts)  # none running: start a local one


def run(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    from .launch import ensure_local_env, how_to_call, start_serve, wait_until_healthy

    ensure_local_env()
    connect_ray(args.address, getattr(args, "verbose", False))
    import ray
    from ray import serve

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        print(f"deploying '{cfg.name}' (model {cfg.engine.model}, {cfg.mode})...", file=sys.stderr, flush=True)
        start_serve(cfg, detached=False)
        wait_until_healthy(cfg)
        print(how_to_call(cfg), flush=True)
        stop.wait()
        print("shutting down...", file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
