"""Test setup: JAX on CPU with 8 virtual devices, float32; the session's one Ray cluster (`ray_serve`).

Markers (pyproject.toml): `cluster` tests deploy Serve apps on the session's local Ray cluster (or start
`moray serve` processes); `slow` ones take more than about half a minute. `make test` runs everything, in
two xdist workers (`pytest_xdist_make_scheduler` says how it splits the suite); `pytest -m "not cluster and
not slow"` is the quick loop."""

import faulthandler
import functools
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# XLA:CPU's LLVM passes at their lowest level for every process of the run (Ray replicas and subprocesses
# inherit the variable): the suite's programs are tiny and compiling them costs far more than running them
# (a profile of test_hybrid_engine.py: compiling 40% of its time, running 2.4%). It saves CPU time, so it
# shows where the cores are busy. Measured on a 2-core machine, alternating runs: test_hybrid_cluster.py
# 140-144 -> 122-124 CPU seconds (wall 90 -> 80 s); a two-host handoff test (4 processes) 184 -> 116 s; a
# clean-clone suite 1:21:43 -> 1:00:26; a training-heavy test 7% slower. Results move by float32 ulps against the
# default level, so every process of a run must share it (the persistent cache's key includes XLA_FLAGS).
# MORAY_TEST_XLA_OPT=default keeps XLA's level.
if os.environ.get("MORAY_TEST_XLA_OPT", "0") != "default" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

# One persistent XLA compilation cache for the whole run: the test process of each xdist worker, the Ray
# replicas and the subprocesses inherit it, so a program compiles once per run, not once per engine (the
# test models share their shapes; a profile of test_engine.py put ~45% of its CPU time in XLA's compiler).
# Measured on a 2-core machine: test_engine.py alone 221 s -> 137 s, but in the full run it gained little;
# the whole run went 51:26 -> 47:11 together with test_cluster's apps started at once. Created by the first
# process to load this file (xdist's controller, before it starts the workers), removed by it at the end.
# Tests about compiling itself turn it off (`real_compiles`); MORAY_TEST_XLA_CACHE=0 runs without it.
_SUITE_XLA_CACHE_OWNER = "MORAY_TEST_XLA_CACHE_OWNER"
if os.environ.get("MORAY_TEST_XLA_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="moray-suite-xla-")
    os.environ[_SUITE_XLA_CACHE_OWNER] = str(os.getpid())
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    # No size limit: a limit turns on JAX's eviction, which lists and reads every entry's files under a
    # lock at each write (quadratic: a full run with it was slower than one without the cache). An entry
    # read while another process still writes it fails to decompress and is compiled instead.

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


RAY_GROUP = "ray"
_RAY_FIXTURE = re.compile(r"\bray_serve\b")


# Modules that start Ray clusters of their own (`moray serve` processes, the benchmarks' local Ray): in the
# `ray` unit too, so that no two Ray clusters start at once (under that load on 2 cores, Ray's start-up timed
# out and the failover tests' streams missed their deadlines in a three-worker trial).
OWN_RAY_MODULES = {"test_entrypoints.py", "test_bench_routing.py", "test_bench_handoff.py", "test_tracing.py"}


@functools.cache
def uses_ray(module_path: str) -> bool:
    """A test module that asks for the session's Ray cluster (its source names the `ray_serve` fixture) or
    starts one of its own."""
    path = Path(module_path)
    return path.name in OWN_RAY_MODULES or bool(_RAY_FIXTURE.search(path.read_text()))


def xdist_scope(nodeid: str) -> str:
    """The work unit of a test under xdist: its module, or `ray` for every module that runs Ray."""
    module = nodeid.split("::", 1)[0]
    return RAY_GROUP if uses_ray(str(ROOT / module)) else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two xdist workers (`-n 2`): on 2 cores one pytest process kept about one core busy
    (compiles, Ray's start-ups and process spawns left the other idle). Each module is one work unit, so its
    module fixtures are built once; the modules that run Ray are one unit (`xdist_scope`), so a run has one
    Ray cluster at a time, and that unit goes first (it is the longest). xdist's own `loadgroup` cannot
    do this on pytest 9.2 (it renames a node id field that pytest no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    config.option.loadscopereorder = False  # the collection's order: the Ray unit first (below)
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The Ray modules first (xdist hands out work units in this order); a stable sort: the order within and
    among the other modules is kept."""
    items.sort(key=lambda item: not uses_ray(str(item.path)))


_SESSION_START = time.monotonic()


def _memory_line(module: str) -> str:
    """One line of what this process holds after a module: the session's seconds so far (a module's time is
    the difference to the next line), its RSS, the engines still alive, JAX's live device buffers
    (`MORAY_TEST_MEMLOG=FILE` writes one per module: a leak shows as a count that only grows)."""
    import gc

    gc.collect()
    engines = sum(1 for o in gc.get_objects() if type(o).__name__ in ("EngineCore", "LLM"))
    rss_mb = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss_mb = int(line.split()[1]) // 1024
    with open("/proc/self/maps") as maps:
        num_maps = sum(1 for _ in maps)  # against vm.max_map_count: JIT-compiled code is mapped per program
    live_mb = 0
    if "jax" in sys.modules:
        live_mb = sum(a.nbytes for a in sys.modules["jax"].live_arrays()) // 2**20
    return (
        f"{module} t={time.monotonic() - _SESSION_START:.0f}s rss_mb={rss_mb} maps={num_maps} engines={engines} live_arrays_mb={live_mb}\n"
    )


def pytest_runtest_setup(item):
    """`MORAY_TEST_MEMLOG=FILE`: before each module's first test, the state the previous modules left."""
    path = os.environ.get("MORAY_TEST_MEMLOG")
    if path and getattr(pytest_runtest_setup, "module", None) is not item.module:
        pytest_runtest_setup.module = item.module
        with open(path, "a") as log:
            log.write(_memory_line(f"before {item.module.__name__}"))


def pytest_unconfigure(config):
    if os.environ.get(_SUITE_XLA_CACHE_OWNER) == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def real_compiles():
    """This test's programs are compiled, not loaded from the suite's cache: for tests of what compiles
    when (a compile event listener sees nothing for a program it loads)."""
    import jax
    from jax._src import compilation_cache

    from workers.engine.program_cache import STEP_PROGRAMS
    from workers.parallel import no_compilation_cache

    enabled, capacity = jax.config.jax_enable_compilation_cache, STEP_PROGRAMS.capacity
    no_compilation_cache()
    STEP_PROGRAMS.capacity = 0  # nor taken from another engine of this process
    try:
        yield
    finally:
        STEP_PROGRAMS.capacity = capacity
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("MORAY_TEST_MEMLOG")
    if path:
        with open(path, "a") as log:
            log.write(_memory_line("end"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each module (its fixtures torn down): JAX's compiled-program caches dropped. Every program XLA
    compiles for the CPU maps its code into the process (about 3.5 mappings each) until its cache entry goes;
    a whole run's programs in one process reached Linux's vm.max_map_count (65530), and the next mmap
    failed inside XLA (an abort, late in the run, in whichever test compiled next)."""
    yield
    if (nextitem is None or nextitem.module is not item.module) and "jax" in sys.modules:
        import gc

        gc.collect()
        sys.modules["jax"].clear_caches()
