"""One engine over 2 processes x 4 virtual CPU devices (`jax.distributed`, gloo over loopback): the full
model forward under three parallel configurations and a greedy generation equal the single-process
results, with every collective of its step programs ordered. Also `moray logits --num-processes 2` from the
command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ep_multiprocess_worker import CONFIGS, ENGINE, PROMPTS
from hf_checkpoints import qwen2_ep_checkpoint
from late_compile_worker import GREEDY_TOKENS

from workers.engine import LLM, SamplingParams
from workers.models import load_model, prompt_logits
from workers.parallel import free_port, launch_local_processes

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "ep_multiprocess_worker.py"
LATE_WORKER = Path(__file__).resolve().parent / "late_compile_worker.py"
WARM_WORKER = Path(__file__).resolve().parent / "warm_cache_worker.py"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return qwen2_ep_checkpoint(tmp_path_factory.mktemp("ep-mp"))


def test_two_processes_match_one(ckpt, tmp_path):
    out = tmp_path / "results.npz"
    rc = launch_local_processes([sys.executable, str(WORKER), str(ckpt), str(out)], 2, 4, timeout=900)
    assert rc == 0
    got = np.load(out)
    assert (int(got["process_count"]), int(got["device_count"])) == (2, 8)
    want = prompt_logits(load_model(ckpt, dtype="float32", show_progress=False), PROMPTS)
    for name in CONFIGS:
        np.testing.assert_allclose(got[name], want, atol=1e-5, rtol=0, err_msg=name)
    llm = LLM(str(ckpt), dtype="float32", **ENGINE)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert got["generated"].tolist() == [o.token_ids for o in greedy]
    assert got["generated-flat"].tolist() == got["generated-hierarchical-dispatch"].tolist() == got["generated"].tolist()
    # No two collectives of a step program may be in flight at once over gloo (`hlo_collectives`): with the load
    # count left unordered, these programs held 10 such pairs.
    assert got["step_programs"] >= 2 and got["collectives"] > 0
    assert got["unordered_collectives"] == 0
    # Nor any collective of JAX's own between them: device_put's cross-process check of host data (one per
    # step argument; two hosts hung in one, in CI), which the engine's placements skip (`place_host`).
    assert got["device_put_checks"] == 0


FINGERPRINTS = """
import functools, sys
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
from workers.parallel import same_programs_on_every_process
if sys.argv[1] == "same":
    same_programs_on_every_process()
sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
spec = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)
def step(a):
    return jnp.sum(a * 2)
def compile_here():  # a fresh trace each time (a new partial), as each process makes its own
    return jax.jit(functools.partial(step), in_shardings=sharding).lower(spec).compile()
def from_another_caller():
    return compile_here()
a, b = compile_here(), from_another_caller()
print(a._executable.xla_executable.fingerprint == b._executable.xla_executable.fingerprint)
"""


@pytest.mark.parametrize("setting", ["default", "same"])
def test_a_program_traced_from_another_call_path_gets_the_same_launch_ids(setting):
    """JAX matches a multi-process program's collectives across processes by launch id, derived from the
    executable's fingerprint, which hashes the HLO's source locations: by default the whole traceback,
    callers included. So the same program traced from two call paths (leader and follower, or a test
    wrapping the compile) got two fingerprints, and two processes waited in its first all-gather under
    different launch ids forever. `init_distributed` keeps the callers out (`same_programs_on_every_process`)."""
    run = subprocess.run(
        [sys.executable, "-c", FINGERPRINTS, setting],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == ("True" if setting == "same" else "False")


def test_a_process_that_compiles_late_does_not_hang_the_others_first_step(ckpt, tmp_path):
    """Process 1 compiles the step program 35 s after process 0 (`late_compile_worker`): over gloo the first
    collective of a device group fails on the process that came first when they arrive more than 30 s apart,
    and the other then waits forever (a two-host replica hung so in the full suite). The engine starts each new
    program's first run on every process together: the generation completes and equals one process's.
    Process 1 also traces through another call path (the wrapper that delays it): without
    `same_programs_on_every_process` its program got another launch id and both hung in the first all-gather,
    alone or under load."""
    out = tmp_path / "tokens.npy"
    rc = launch_local_processes([sys.executable, str(LATE_WORKER), str(ckpt), str(out)], 2, 4, timeout=300)
    assert rc == 0
    llm = LLM(str(ckpt), dtype="float32", **ENGINE)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    assert np.load(out).tolist() == [o.token_ids for o in greedy]


def test_a_warm_compilation_cache_does_not_hang_a_two_process_engine(ckpt, tmp_path):
    """Two runs of one two-process engine over one compilation cache directory. Only process 0 writes the cache
    (the other's keys differ), and an executable loaded from it has another fingerprint, so another launch id,
    than the same program compiled: the second run hung every time, both processes in the first all-gather.
    A multi-process engine on CPU compiles without the cache: nothing is written, and both runs finish with
    the same tokens."""
    cache = tmp_path / "xla-cache"
    tokens = []
    for run in range(2):
        out = tmp_path / f"tokens-{run}.npy"
        command = [sys.executable, str(WARM_WORKER), str(ckpt), str(out), str(cache)]
        # The directory the suite sets for every process (tests/conftest.py) would win over the engine's.
        rc = launch_local_processes(command, 2, 4, env={"JAX_COMPILATION_CACHE_DIR": str(cache)}, timeout=300)
        assert rc == 0, f"run {run}"
        tokens.append(np.load(out).tolist())
    assert tokens[0] == tokens[1]
    assert not [p for p in cache.rglob("*") if p.is_file()]


def test_cli_logits_over_two_processes(ckpt, tmp_path):
    args = ["--model", str(ckpt), "--token-ids", "1,2,3,4,5", "--token-ids", "9,8"]
    moray = [sys.executable, "-m", "cluster.cli", "logits"]
    subprocess.run([*moray, *args, "--out", str(tmp_path / "one.npy")], cwd=ROOT, check=True, capture_output=True)
    run = subprocess.run(
        [*moray, *args, "--out", str(tmp_path / "two.npy"), "--mesh", "2x4", "--num-processes", "2", "--moe-dispatch", "hierarchical"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("wrote logits") == 1  # process 0 only
    np.testing.assert_allclose(np.load(tmp_path / "two.npy"), np.load(tmp_path / "one.npy"), atol=1e-5, rtol=0)


def test_cli_rejects_bad_parallel_configurations(ckpt, tmp_path):
    moray = [sys.executable, "-m", "cluster.cli", "logits", "--model", str(ckpt), "--token-ids", "1,2", "--out", str(tmp_path / "x.npy")]
    cases = {
        ("--mesh", "2x4", "--ep", "3"): "ep=3 must divide the mesh size 8",
        ("--mesh", "2x2"): "mesh 2x2 has 4 devices but 8 are available",
        ("--mesh", "2x4", "--dp", "2"): "dp x tp must equal the mesh size: 2 x 1 != 8",
        ("--num-processes", "2"): "--num-processes needs --mesh",
    }
    for extra, message in cases.items():
        run = subprocess.run([*moray, *extra], cwd=ROOT, capture_output=True, text=True)
        assert run.returncode == 2 and message in run.stderr, (extra, run.stderr[-500:])


def test_free_port_never_gives_a_port_twice():
    """Probing with a socket closed at once, the kernel gave the same port again: 7-11 repeats in 500 probes
    here, and once a test cluster's HTTP and gRPC ports (two probes in a row) were the same port, which
    failed every gRPC test of the run. 500 ports in a row are all different."""
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
