"""Deploy onto an existing Ray cluster from a Ray job, and return once the application is healthy (Serve
keeps running it, detached). The README's "Running on an existing Ray cluster" has the whole recipe:

    ray job submit --address http://HEAD:8265 --working-dir . -- "$PWD/.venv/bin/python" -m cluster.deploy \\
        --config cluster/configs/ray-job-example.yaml --model /models/your-checkpoint

The job runs on the cluster, in a temporary copy of --working-dir (without .gitignored files such as
.cache/): the model path must exist on the cluster's nodes, so give an absolute one.

Exit codes: 0 healthy; 1 not healthy within --timeout, or the deployment failed; 2 a bad config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import ConfigError, load_cluster_config, parse_cluster_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.deploy")
    parser.add_argument("--config", required=True)
    parser.add_argument(
        "--model", help="checkpoint directory on the cluster's nodes, an absolute path (overrides the config's engine.model)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the workers")
    args = parser.parse_args(argv)

    def fail(message: str, code: int) -> int:
        print(f"cluster.deploy: error: {message}", file=sys.stderr, flush=True)
        return code

    try:
        data = load_cluster_config(args.config).model_dump(mode="json", exclude_unset=True)
        if args.model:
            data["engine"]["model"] = args.model
        model = Path(data["engine"]["model"]).expanduser()
        if not model.is_absolute():
            if not model.is_dir():
                return fail(
                    f"engine.model {str(model)!r} is a relative path and not a directory here ({Path.cwd()}): the job runs in a "
                    "temporary copy of --working-dir without .gitignored files such as .cache/; give the checkpoint's absolute "
                    "path on the cluster's nodes (--model /path/to/checkpoint)",
                    2,
                )
            model = model.resolve()
        elif not model.is_dir():
            print(
                f"cluster.deploy: warning: engine.model {model} is not a directory on this node; the workers' nodes need it",
                file=sys.stderr,
                flush=True,
            )
        data["engine"]["model"] = str(model)
        cfg = parse_cluster_config(data)
    except ConfigError as e:
        return fail(str(e), 2)
    import ray

    from .launch import StartupError, cluster_nodes, how_to_call, placement_problems, start_serve, wait_until_ready

    ray.init(address="auto", logging_level="WARNING")
    problems = placement_problems(cfg, cluster_nodes())
    for problem in problems:
        print(
            f"cluster.deploy: warning: {problem} (waiting up to {args.timeout:g}s for the cluster to scale up)", file=sys.stderr, flush=True
        )
    start_serve(cfg, detached=True)
    try:
        wait_until_ready(cfg, timeout_s=args.timeout, known_problems=problems)
    except StartupError as e:
        return fail(f"{e} (the application stays deployed; `serve shutdown` removes it)", 1)
    print(how_to_call(cfg), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
