"""The dense projections' CPU kernel (kernels/cpu/dense.cc) against XLA's matmul, its selection
(kernels.dense), and the engine with it on and off."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_harness import ENGINE_ARGS

from kernels import cpu_ffi, dense
from workers.engine import LLM, SamplingParams
from workers.models.make_model import make_model

# Odd sizes on purpose: rows not a multiple of the kernel's row groups, widths not a multiple of its vectors
# (tails), one row, one column, more rows than one thread's minimum share (several threads).
SHAPES = [
    (1, 1, 1),
    (1, 7, 5),
    (2, 8, 3),
    (3, 37, 29),
    (4, 64, 67),
    (5, 129, 1),
    (7, 300, 33),
    (16, 1024, 1000),
    (9, 33, 4099),
    (13, 520, 1003),
    (2, 70001, 9),  # rows so long that a piece's row floor (256 KiB / row) is 0: pieces must still advance
]


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    assert cpu_ffi.available(), "g++ is on every development and CI machine"


def _random(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape, np.float32)


@pytest.mark.parametrize("tokens,width,rows", SHAPES)
def test_the_kernel_equals_xla(tokens, width, rows):
    x, w = _random((tokens, width), 0), _random((rows, width), 1)
    got = jax.jit(cpu_ffi.dense)(x, w)
    want = jax.jit(lambda x, w: jnp.einsum("ti,oi->to", x, w, preferred_element_type=jnp.float32))(x, w)
    assert got.shape == (tokens, rows) and got.dtype == jnp.float32
    # Summation order differs (vector lanes, then a tail): float32 rounding of a width-long dot.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(width))


def test_every_token_of_a_step_gets_its_own_row():
    """One-hot tokens pick out single weight columns: a mix-up of tokens, rows or the output stride would
    put a value in the wrong place, which a random comparison could only blur."""
    width, rows = 12, 10
    x = np.eye(width, dtype=np.float32)[[3, 0, 11, 5, 7]]
    w = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
    np.testing.assert_array_equal(jax.jit(cpu_ffi.dense)(x, w), w.T[[3, 0, 11, 5, 7]])


def _uses_kernel(fn, *args) -> bool:
    return cpu_ffi.DENSE_TARGET in jax.jit(lambda *a: fn(*a)).lower(*args).as_text()


def _in_scope(x, w):
    with dense.single_device():
        return dense.matmul(x, w)


def test_selection(monkeypatch):
    """Inside `single_device()`, float32 decode-sized rows run the kernel; outside it (a partitioned
    program), in bfloat16, past CPU_MAX_ROWS rows, with MORAY_DENSE_IMPL=xla or MORAY_CPU_KERNELS=0 they
    keep XLA's matmul, with the same result; a bad MORAY_DENSE_IMPL is a clear error."""
    monkeypatch.delenv(dense.IMPL_ENV_VAR, raising=False)
    x, w = jnp.asarray(_random((2, 3, 16), 0)), jnp.asarray(_random((24, 16), 1))
    assert _uses_kernel(_in_scope, x, w)
    np.testing.assert_allclose(jax.jit(_in_scope)(x, w), jnp.einsum("bti,oi->bto", x, w), rtol=1e-5, atol=1e-5)
    assert not _uses_kernel(dense.matmul, x, w)
    assert not _uses_kernel(_in_scope, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    big = jnp.asarray(_random((dense.CPU_MAX_ROWS + 1, 16), 2))
    assert not _uses_kernel(_in_scope, big, w)
    assert _uses_kernel(_in_scope, big[: dense.CPU_MAX_ROWS], w)
    monkeypatch.setenv(dense.IMPL_ENV_VAR, "xla")
    assert not _uses_kernel(_in_scope, x, w)
    monkeypatch.setenv(dense.IMPL_ENV_VAR, "fast")
    with pytest.raises(ValueError, match="MORAY_DENSE_IMPL"):
        _in_scope(x, w)
    monkeypatch.delenv(dense.IMPL_ENV_VAR)
    monkeypatch.setenv(cpu_ffi.ENV_VAR, "0")
    assert not _uses_kernel(_in_scope, x, w)


def test_the_engine_gives_the_same_tokens_with_the_kernel_on_and_off(tmp_path, monkeypatch):
    """A one-device engine's step programs run its projections and LM head through the kernel; greedy
    tokens and logprobs equal those of the XLA matmul's engine."""
    model = make_model(tmp_path / "m", "qwen3_moe", "tiny", seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    prompts = [[5, 17, 300, 42, 8], list(range(3, 40)), [9] * 12]

    def run():
        llm = LLM(str(model), **ENGINE_ARGS)
        outs = llm.generate(prompts, params)
        programs = llm.engine.runner._programs.values()
        return outs, any(cpu_ffi.DENSE_TARGET in p.as_text() for p in programs)

    monkeypatch.delenv(dense.IMPL_ENV_VAR, raising=False)
    on, used = run()
    assert used
    monkeypatch.setenv(dense.IMPL_ENV_VAR, "xla")
    off, used = run()
    assert not used
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        chosen = [[lp[t] for lp, t in zip(out.logprobs, out.token_ids)] for out in (a, b)]
        np.testing.assert_allclose(*chosen, atol=1e-4)
