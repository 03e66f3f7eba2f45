"""`moray serve-config --config FILE > serve.yaml`: a Serve config usable with `serve deploy`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import load_cluster_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, required=True)


def run(args: argparse.Namespace) -> int:
    import yaml

    from .app import serve_config

    cfg = load_cluster_config(args.config)
    sys.stdout.write(yaml.safe_dump(serve_config(cfg), sort_keys=False))
    return 0
