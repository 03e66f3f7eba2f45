"""Test setup: JAX on CPU with 8 virtual devices, float32; the session's one Ray cluster (`ray_serve`).

Markers (pyproject.toml): `cluster` tests deploy Serve apps on the session's local Ray cluster (or start
`moray serve` processes); `slow` ones take more than about half a minute. `make test` runs everything;
`pytest -m "not cluster and not slow"` is the quick loop."""

import faulthandler
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_serve():
    """One local Ray cluster and Serve instance for every cluster test of the session: modules deploy their
    apps on it (`cluster_harness.served_app`) and delete them when done."""
    import ray
    from cluster_harness import start_serve_cluster
    from ray import serve

    cluster = start_serve_cluster()
    # ray.init put its own fatal-signal handler in this process; on an abort here (seen once in XLA's
    # executable serialisation, late in a full run) it recursed inside itself and the suite hung until CI
    # killed it. Python's handler prints every thread's stack and lets the process die: a failed run, at once.
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    yield cluster
    serve.shutdown()
    ray.shutdown()
