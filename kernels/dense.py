"""Dense projections `x @ w.T` over [out, in] weights (linear layers, LM heads): the one place choosing how.

Two implementations, agreeing within float32 rounding:
- `xla`: `jnp.einsum` with float32 accumulation; every backend, every dtype, every sharding. The reference.
- `cpu`: a C++ kernel through XLA's FFI (kernels/cpu/dense.cc, built by kernels/cpu_ffi.py) for decode-sized
  float32 batches on CPU: the weight rows are split between the CPU kernels' shared worker pool and each is
  streamed once for all of a step's tokens. XLA:CPU's GEMVs read the weights below the memory bandwidth
  (#16's profile: ~25 GB/s for the LM head and attention projections).

The kernel sees whole arrays, so it is used only inside `single_device()` (the engine's runner opens it for
programs of a one-device mesh): in a partitioned program XLA would gather a sharded weight to every device
first. `MORAY_DENSE_IMPL=xla|cpu` forces one (`cpu` still only where it applies); `MORAY_CPU_KERNELS=0`
turns every C++ kernel off.

This module imports nothing else from Moray.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax
import jax.numpy as jnp

from . import cpu_ffi

IMPLS = ("xla", "cpu")
IMPL_ENV_VAR = "MORAY_DENSE_IMPL"
# Rows (tokens) up to which the kernel replaces XLA's matmul. Past ~16 rows a step is compute-bound and
# XLA's blocked GEMM wins; a decode step has one row per sequence.
CPU_MAX_ROWS = 16

_single_device = contextvars.ContextVar("moray_dense_single_device", default=False)


@contextlib.contextmanager
def single_device(on: bool = True):
    """While tracing inside this scope, the program being built runs on one device (its arrays are whole):
    the FFI kernel may replace XLA's matmul. The scope is read at trace time, so open it inside the traced
    function, where it holds for every trace of that function."""
    token = _single_device.set(on)
    try:
        yield
    finally:
        _single_device.reset(token)


def cpu_kernel_applies(x: jax.Array, w: jax.Array) -> bool:
    """The `cpu` kernel takes float32 activations and dense float32 weights, at most CPU_MAX_ROWS rows, on
    the CPU backend inside `single_device()` (and needs to build)."""
    rows = x.size // max(1, x.shape[-1])
    return (
        _single_device.get()
        and isinstance(w, jax.Array | jax.core.Tracer)
        and w.ndim == 2
        and x.dtype == jnp.float32
        and w.dtype == jnp.float32
        and 0 < rows <= CPU_MAX_ROWS
        and jax.default_backend() == "cpu"
        and cpu_ffi.available()
    )


def select_impl(x: jax.Array, w: jax.Array) -> str:
    forced = os.environ.get(IMPL_ENV_VAR)
    if forced is not None and forced not in IMPLS:
        raise ValueError(f"{IMPL_ENV_VAR}={forced!r}: expected one of {IMPLS}")
    if forced == "xla":
        return "xla"
    return "cpu" if cpu_kernel_applies(x, w) else "xla"


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., I] @ w[O, I]^T -> float32 [..., O] (accumulated in float32)."""
    if select_impl(x, w) == "cpu":
        flat = x.reshape(-1, x.shape[-1])
        return cpu_ffi.dense(flat, w).reshape(*x.shape[:-1], w.shape[0])
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)
