"""`ray job submit --working-dir . -- python -m cluster.deploy --config FILE`: deploy onto an existing
Ray cluster and return once the application is healthy (Serve keeps running it, detached)."""

from __future__ import annotations

import argparse
import sys

from .config import ConfigError, load_cluster_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.deploy")
    parser.add_argument("--config", required=True)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the workers")
    args = parser.parse_args(argv)
    try:
        cfg = load_cluster_config(args.config)
    except ConfigError as e:
        print(f"cluster.deploy: error: {e}", file=sys.stderr)
        return 2
    import ray

    from .launch import how_to_call, start_serve, wait_until_healthy

    ray.init(address="auto", logging_level="WARNING")
    start_serve(cfg, detached=True)
    wait_until_healthy(cfg, timeout_s=args.timeout)
    print(how_to_call(cfg), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
