"""Every routed-expert implementation against a dense one-hot float32 reference, on tiny shapes."""

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpu_ffi, moe

ROOT = Path(__file__).resolve().parent.parent

IMPLS = ("gather", "sorted", "tiled", "pallas", "cpu", "take", "masked")
HIDDEN, INTER = 32, 16


def dense_reference(x, ids, weights, gate_up, down, activation="silu"):
    """Every expert on every token in float32 numpy, weighted by the dense [T, E] routing matrix."""
    x, weights, gate_up, down = (np.asarray(a, np.float32) for a in (x, weights, gate_up, down))
    num_experts = gate_up.shape[0]
    one_hot = np.asarray(ids)[..., None] == np.arange(num_experts)  # [T, k, E]
    routing = np.einsum("tk,tke->te", weights, one_hot.astype(np.float32))  # zero where unrouted
    gate, up = np.split(np.einsum("th,eih->tei", x, gate_up), 2, axis=-1)
    if activation == "silu":
        act = gate / (1.0 + np.exp(-gate)) * up
    else:  # gelu, tanh approximation
        act = 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate**3))) * up
    out = np.einsum("tei,ehi->teh", act, down)
    return np.einsum("teh,te->th", out, routing)


# Inputs come from numpy: building them with eager jax ops compiles each op per shape (seconds per case).
def make_weights(num_experts, hidden=HIDDEN, inter=INTER, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    gate_up = rng.standard_normal((num_experts, 2 * inter, hidden), np.float32) / np.sqrt(hidden)
    down = rng.standard_normal((num_experts, hidden, inter), np.float32) / np.sqrt(inter)
    return jnp.asarray(gate_up, dtype), jnp.asarray(down, dtype)


def make_tokens(tokens, num_experts, top_k, routing, hidden=HIDDEN, seed=1):
    """x [T, H] and softmax top-k routing; `routing` picks which experts can receive tokens."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden), np.float32)
    logits = rng.standard_normal((tokens, num_experts), np.float32)
    if routing == "half_idle":  # experts 1, 3, 5, ... receive no tokens
        logits[:, 1::2] = -1e9
    elif routing == "same_k":  # every token picks experts 0..k-1: each of their groups holds all T tokens
        logits[:, :top_k] += 10.0
    elif routing != "random":
        raise ValueError(routing)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    return jnp.asarray(x), jnp.asarray(ids, jnp.int32), jnp.asarray(weights)


@functools.partial(jax.jit, static_argnames="impl")
def routed_experts(x, ids, weights, gate_up, down, impl):
    """Jitted so each case compiles one program instead of dispatching every op eagerly."""
    return moe.routed_experts(x, ids, weights, gate_up, down, impl=impl)


# Every token count with every expert count, and every (experts, top_k) pair, in 12 shapes.
TOKENS, EXPERTS, TOP_KS = (1, 3, 37, 130), (4, 8, 16), (1, 2, 4)
SHAPES = [(tokens, experts, TOP_KS[(i + j) % 3]) for i, tokens in enumerate(TOKENS) for j, experts in enumerate(EXPERTS)]
ROUTINGS = ("random", "half_idle", "same_k")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tokens,experts,top_k,routing", [(*shape, ROUTINGS[i % 3]) for i, shape in enumerate(SHAPES)])
def test_matches_dense_reference(impl, tokens, experts, top_k, routing):
    x, ids, weights = make_tokens(tokens, experts, top_k, routing)
    gate_up, down = make_weights(experts)
    got = routed_experts(x, ids, weights, gate_up, down, impl=impl)
    want = dense_reference(x, ids, weights, gate_up, down)
    assert got.shape == (tokens, HIDDEN) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens,routing", [(1, "random"), (5, "half_idle"), (16, "random")])
def test_cpu_kernel_pieces_straddle_experts(tokens, routing):
    """Shapes large enough that the CPU kernel hands its gate/up rows out in many pieces (~256 KiB of weights
    each) that start and end inside an expert's rows (300 gate/up rows per expert, pieces of 128-152), and fixed
    down-projection shares that split an expert: a piece lost, repeated or misplaced changes the output."""
    experts, top_k, hidden, inter = 8, 2, 512, 150
    x, ids, weights = make_tokens(tokens, experts, top_k, routing, hidden=hidden)
    gate_up, down = make_weights(experts, hidden=hidden, inter=inter)
    got = routed_experts(x, ids, weights, gate_up, down, impl="cpu")
    np.testing.assert_allclose(got, dense_reference(x, ids, weights, gate_up, down), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (37, 2), (130, 4)])
def test_all_assignments_to_one_expert(impl, tokens, top_k):
    """Every (token, slot) names expert 2: one full group, all others empty, duplicate ids per token."""
    experts = 8
    x, _, weights = make_tokens(tokens, experts, top_k, "random")
    ids = jnp.full((tokens, top_k), 2, jnp.int32)
    gate_up, down = make_weights(experts)
    got = routed_experts(x, ids, weights, gate_up, down, impl=impl)
    np.testing.assert_allclose(got, dense_reference(x, ids, weights, gate_up, down), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 8, 64])
def test_tiled_any_tile_size(rows):
    """Groups spanning several tiles, single-row tiles and tiles larger than every group."""
    x, ids, weights = make_tokens(130, 8, 4, "half_idle")
    gate_up, down = make_weights(8)
    tiled = jax.jit(functools.partial(moe._experts_tiled, m=rows))
    got = tiled(x, ids, weights, gate_up, down)
    np.testing.assert_allclose(got, dense_reference(x, ids, weights, gate_up, down), atol=1e-5, rtol=1e-5)


def test_expert_ranges_sum_to_the_whole():
    """An expert-parallel device runs only its own range of experts (experts_in_range); the ranges'
    results add up to every expert's, and an id outside every range (the all-to-all's empty slots) adds
    nothing."""
    tokens, experts, top_k = 21, 16, 4
    gate_up, down = make_weights(experts)
    x, ids, weights = make_tokens(tokens, experts, top_k, "random")
    part = jax.jit(moe.experts_in_range, static_argnums=(5, 6))
    total = sum(part(x, ids, weights, gate_up[lo : lo + 4], down[lo : lo + 4], lo, 8) for lo in range(0, experts, 4))
    np.testing.assert_allclose(total, dense_reference(x, ids, weights, gate_up, down), atol=1e-5, rtol=1e-5)
    empty = jnp.full_like(ids, -1)
    assert not np.any(np.asarray(part(x, empty, weights, gate_up[:4], down[:4], 0, 8)))


@pytest.mark.parametrize("routing", ["random", "half_idle", "same_k"])
def test_tile_layout_tiles_never_straddle_experts(routing):
    tokens, experts, top_k, m = 37, 16, 4, 8
    _, ids, _ = make_tokens(tokens, experts, top_k, routing)
    row_of, row_token, tile_expert, tile_ends = jax.tree.map(np.asarray, jax.jit(moe._tile_layout, static_argnums=(1, 2))(ids, experts, m))
    used = tile_ends[-1]
    flat = np.asarray(ids).reshape(-1)
    sizes = np.bincount(flat, minlength=experts)
    assert used == sum(-(-s // m) for s in sizes)
    assert len(tile_expert) * m == len(row_token) >= flat.size
    assert len(set(row_of.tolist())) == flat.size  # one row per assignment
    # Each assignment sits in a tile owned by its expert, and its row names its token.
    np.testing.assert_array_equal(tile_expert[row_of // m], flat)
    np.testing.assert_array_equal(row_token[row_of], np.arange(flat.size) // top_k)
    # Within an expert, rows keep the stable (token-major) order; every other row is padding.
    for e in range(experts):
        assert np.all(np.diff(row_of[flat == e]) == 1)
    assert np.sum(row_token < tokens) == flat.size


def test_tiled_jit_compiles_once_per_shape():
    traces = 0

    def run(x, ids, weights, gate_up, down):
        nonlocal traces
        traces += 1
        return moe.routed_experts(x, ids, weights, gate_up, down, impl="tiled")

    fn = jax.jit(run)
    gate_up, down = make_weights(8)
    for routing in ("random", "half_idle", "same_k"):  # different group sizes, same shapes
        x, ids, weights = make_tokens(37, 8, 2, routing)
        fn(x, ids, weights, gate_up, down).block_until_ready()
    assert traces == 1
    x, ids, weights = make_tokens(38, 8, 2, "random")
    fn(x, ids, weights, gate_up, down).block_until_ready()
    assert traces == 2


@pytest.mark.parametrize("impl", ["tiled", "pallas", "sorted"])
def test_bfloat16_matches_gather(impl):
    x, ids, weights = make_tokens(37, 8, 2, "random")
    gate_up, down = make_weights(8, dtype=jnp.bfloat16)
    x = x.astype(jnp.bfloat16)
    want = routed_experts(x, ids, weights, gate_up, down, impl="gather")
    got = routed_experts(x, ids, weights, gate_up, down, impl=impl)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2, rtol=2e-2)


def test_moe_impl_selection(monkeypatch):
    monkeypatch.delenv(moe.IMPL_ENV_VAR, raising=False)
    limit = moe.GATHER_MAX_ASSIGNMENTS
    assert moe.moe_impl(limit, "cpu") == moe.moe_impl(limit, "tpu") == "gather"
    assert moe.moe_impl(limit + 1, "cpu") == "tiled"
    assert moe.moe_impl(limit + 1, "tpu") == "pallas"
    assert moe.moe_impl(limit + 1) == "tiled"  # tests run on CPU
    # GPUs never get the looping paths: take while assignments <= experts, masked while tokens x experts x
    # expert weights is small (512 tokens of the bench preset's experts, E=64 H=1024 I=256), then ragged_dot.
    experts, weights = 64, 3 * 1024 * 256
    assert moe.moe_impl(8, "gpu", experts, 1, weights) == moe.moe_impl(64, "gpu", experts, 8, weights) == "take"
    assert moe.moe_impl(72, "gpu", experts, 9, weights) == moe.moe_impl(8 * 512, "gpu", experts, 512, weights) == "masked"
    assert moe.moe_impl(8 * 513, "gpu", experts, 513, weights) == "sorted"
    assert moe.moe_impl(8 * 33, "gpu", 256, 33, 3 * 7168 * 2048) == "sorted"  # DeepSeek-V3's experts: never masked
    monkeypatch.setenv(moe.IMPL_ENV_VAR, "sorted")
    assert moe.moe_impl(1, "tpu") == "sorted"
    monkeypatch.setenv(moe.IMPL_ENV_VAR, "dense")
    with pytest.raises(ValueError, match=moe.IMPL_ENV_VAR):
        moe.moe_impl(1)


def test_default_impl_and_forced_impl(monkeypatch):
    monkeypatch.delenv(moe.IMPL_ENV_VAR, raising=False)
    x, ids, weights = make_tokens(37, 8, 2, "random")  # 74 assignments: tiled by default on CPU
    gate_up, down = make_weights(8)
    want = dense_reference(x, ids, weights, gate_up, down)
    # A fresh jit per call, so each traces with the environment of the moment.
    default = jax.jit(lambda *args: moe.routed_experts(*args))(x, ids, weights, gate_up, down)
    np.testing.assert_allclose(default, want, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv(moe.IMPL_ENV_VAR, "sorted")
    forced = jax.jit(lambda *args: moe.routed_experts(*args))(x, ids, weights, gate_up, down)
    np.testing.assert_allclose(forced, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown MoE impl"):
        moe.routed_experts(x, ids, weights, gate_up, down, impl="dense")


def _custom_calls(fn, *args) -> str:
    """The lowered program, traced afresh (a new function each time: jit caches traces per function)."""
    return jax.jit(lambda *a: fn(*a)).lower(*args).as_text()


def test_cpu_kernel_replaces_gather_for_float32_on_cpu(monkeypatch):
    """Decode-sized float32 batches on CPU run the C++ kernel (kernels/cpu/moe_experts.cc); bfloat16
    weights, MORAY_CPU_KERNELS=0 and large batches keep the XLA paths; forcing it where it cannot run
    is a clear error."""
    monkeypatch.delenv(moe.IMPL_ENV_VAR, raising=False)
    assert cpu_ffi.available()  # g++ is on every development and CI machine
    x, ids, weights = make_tokens(3, 8, 2, "random")
    gate_up, down = make_weights(8)
    assert cpu_ffi.MOE_TARGET in _custom_calls(moe.routed_experts, x, ids, weights, gate_up, down)
    big_x, big_ids, big_weights = make_tokens(130, 8, 2, "random")  # 260 assignments: tiled
    assert cpu_ffi.MOE_TARGET not in _custom_calls(moe.routed_experts, big_x, big_ids, big_weights, gate_up, down)
    bf16 = [a.astype(jnp.bfloat16) for a in (x, gate_up, down)]
    assert cpu_ffi.MOE_TARGET not in _custom_calls(moe.routed_experts, bf16[0], ids, weights, bf16[1], bf16[2])
    with pytest.raises(ValueError, match="dense float32"):
        moe.routed_experts(bf16[0], ids, weights, bf16[1], bf16[2], impl="cpu")
    monkeypatch.setenv(cpu_ffi.ENV_VAR, "0")
    assert cpu_ffi.MOE_TARGET not in _custom_calls(moe.routed_experts, x, ids, weights, gate_up, down)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: the kernel runs on the calling thread")
def test_the_cpu_kernel_threads_are_started_once_and_kept():
    """The expert kernel's worker threads are a pool started on its first call and reused by every later
    one (a decode step calls it once per MoE layer; starting threads per call cost more than the work at
    batch 1). In a fresh process: the first call adds the workers, later calls add and lose none."""
    code = (
        "import os, jax, jax.numpy as jnp\n"
        "from kernels import cpu_ffi\n"
        "assert cpu_ffi.available()\n"
        "f = jax.jit(cpu_ffi.moe_experts)\n"
        "args = (jnp.ones((2, 64)), jnp.array([[0, 1], [2, 3]], jnp.int32), jnp.full((2, 2), 0.5),\n"
        "        jnp.full((4, 32, 64), 0.01), jnp.full((4, 64, 16), 0.01))\n"
        "f.lower(*args).compile()\n"
        "jax.jit(lambda a: a @ a.T)(jnp.ones((256, 256))).block_until_ready()  # XLA's own threads first\n"
        "tasks = lambda: set(os.listdir('/proc/self/task'))\n"
        "before = tasks(); f(*args).block_until_ready(); first = tasks()\n"
        "for _ in range(5): f(*args).block_until_ready()\n"
        "print(len(first - before), len(tasks() ^ first))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    started, changed = map(int, out.stdout.split()[-2:])
    assert started >= len(os.sched_getaffinity(0)) - 1 and changed == 0, out.stdout


def test_loading_the_cpu_kernels_keeps_subnormal_floats():
    """A library linked with -ffast-math sets flush-to-zero for the whole process when it loads."""
    code = (
        "import numpy as np\n"
        "from kernels import cpu_ffi\n"
        "assert np.float32(1e-40) * np.float32(1) != 0\n"
        "assert cpu_ffi.available()\n"
        "assert np.float32(1e-40) * np.float32(1) != 0, 'subnormals flushed after loading the kernels'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_cpu_kernel_build_failure_falls_back_to_xla(tmp_path):
    """No working compiler: one warning naming the failure, and the XLA path gives the same result."""
    code = (
        "import numpy as np, jax.numpy as jnp\n"
        "from kernels import cpu_ffi, moe\n"
        "x = jnp.ones((2, 32)); ids = jnp.array([[0, 1], [1, 2]], jnp.int32); w = jnp.full((2, 2), 0.5)\n"
        "gu = jnp.ones((4, 32, 32)) / 32; dn = jnp.ones((4, 32, 16)) / 16\n"
        "got = moe.routed_experts(x, ids, w, gu, dn)\n"
        "want = moe.routed_experts(x, ids, w, gu, dn, impl='gather')\n"
        "assert not cpu_ffi.available() and np.allclose(got, want)\n"
    )
    env = {**os.environ, "CXX": "/bin/false", cpu_ffi.CACHE_ENV_VAR: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("CPU kernels unavailable") == 1 and "failed" in proc.stderr


def test_tile_rows():
    assert moe.tile_rows(1, 64) == moe.MIN_TILE_ROWS
    assert moe.tile_rows(512 * 8, 64) == 64
    assert moe.tile_rows(100, 2) == 64
    assert moe.tile_rows(2048 * 8, 64) == moe.MAX_TILE_ROWS


def test_benchmark_sanity():
    """Times the portable paths on a small prefill-like shape and prints them; asserts only agreement."""
    tokens, experts, top_k, hidden, inter = 128, 16, 4, 128, 64
    x, ids, weights = make_tokens(tokens, experts, top_k, "random", hidden=hidden)
    gate_up, down = make_weights(experts, hidden=hidden, inter=inter)
    results, timings = {}, {}
    for impl in ("gather", "sorted", "tiled"):
        fn = jax.jit(lambda *a, impl=impl: moe.routed_experts(*a, impl=impl))
        results[impl] = fn(x, ids, weights, gate_up, down).block_until_ready()  # compile
        start = time.perf_counter()
        for _ in range(3):
            fn(x, ids, weights, gate_up, down).block_until_ready()
        timings[impl] = (time.perf_counter() - start) / 3
    print("routed_experts ms/call:", {k: round(v * 1e3, 2) for k, v in timings.items()})
    for impl in ("sorted", "tiled"):
        np.testing.assert_allclose(results[impl], results["gather"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_gelu_tanh_experts_in_every_impl(impl):
    """Gemma 4's GeGLU experts: the activation is a parameter of every path; the C++ kernel (SiLU only)
    refuses it when forced and is skipped by the automatic choice."""
    gate_up, down = make_weights(8)
    x, ids, weights = make_tokens(6, 8, 2, "random")
    want = dense_reference(x, ids, weights, gate_up, down, "gelu_tanh")
    if impl == "cpu":
        with pytest.raises(ValueError, match="SiLU"):
            moe.routed_experts(x, ids, weights, gate_up, down, impl="cpu", activation="gelu_tanh")
        got = moe.routed_experts(x, ids, weights, gate_up, down, activation="gelu_tanh")  # automatic: gather
    else:
        got = moe.routed_experts(x, ids, weights, gate_up, down, impl=impl, activation="gelu_tanh")
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(got) - dense_reference(x, ids, weights, gate_up, down)).max() > 1e-3  # not SiLU
