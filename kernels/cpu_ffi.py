"""CPU kernels as XLA FFI custom calls, compiled from `kernels/cpu/*.cc` on first use on this machine.

The C++ sources ship with the package and are built with the machine's own C++ compiler (g++ or
$CXX, `-O3 -march=native`) against the FFI headers jaxlib ships, into a cache directory keyed by
the source, the flags, the jaxlib version and the CPU; nothing prebuilt is downloaded. The build takes a
few seconds once per machine and is shared by processes through a file lock. When there is no compiler
(or the build fails) `available()` is False, the reason is logged once, and callers use their XLA path.

`MORAY_CPU_KERNELS=0` turns them off.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import jax
import jax.numpy as jnp

log = logging.getLogger("moray.kernels")

SOURCE_DIR = Path(__file__).parent / "cpu"
ENV_VAR = "MORAY_CPU_KERNELS"
CACHE_ENV_VAR = "MORAY_KERNEL_CACHE"
# No -ffast-math: linking with it makes the library flush subnormals to zero for the whole process
# (hypothesis refused to run beside it). The kernels vectorise explicitly and need no fast-math.
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-pthread", "-std=c++20", "-shared", "-fPIC")
MOE_TARGET = "moray_moe_experts_f32"
DENSE_TARGET = "moray_dense_f32"
SCATTER_BLOCKS_TARGET = "moray_scatter_blocks"
GATHER_BLOCKS_TARGET = "moray_gather_blocks"

_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library, or "error": why there is none


def available() -> bool:
    """True when the CPU kernels are built (building them now if needed) and registered with XLA."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return False
    with _lock:
        if not _state:
            try:
                _state["lib"] = _load()
            except (OSError, subprocess.SubprocessError, RuntimeError) as e:
                _state["error"] = str(e)
                log.warning("CPU kernels unavailable, using the XLA paths: %s", e)
    return "lib" in _state


def moe_experts(x: jax.Array, ids: jax.Array, weights: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """kernels/cpu/moe_experts.cc: routed experts of float32 weights, each selected expert read once.
    float32 [T, H]; call only when `available()`."""
    call = jax.ffi.ffi_call(MOE_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32))
    return call(x.astype(jnp.float32), ids.astype(jnp.int32), weights.astype(jnp.float32), gate_up, down)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """kernels/cpu/dense.cc: x [T, I] @ w[O, I]^T for float32 x and w, each weight row read once.
    float32 [T, O]; call only when `available()`."""
    call = jax.ffi.ffi_call(DENSE_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))
    return call(x, w)


def scatter_blocks(pages: list[jax.Array], ids: jax.Array, data: jax.Array) -> list[jax.Array]:
    """kernels/cpu/block_copy.cc: the pages with the blocks `ids` ([1 or L, n] int32; ids outside a pool are
    dropped) written from `data` ([n, L, rows, ...], each token row's first bytes). The results alias the
    pages: donate them (jit's donate_argnums) so nothing but the blocks is written. Call only when
    `available()`."""
    n = len(pages)
    call = jax.ffi.ffi_call(
        SCATTER_BLOCKS_TARGET,
        [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pages],
        input_output_aliases={2 + i: i for i in range(n)},
    )
    return list(call(ids.astype(jnp.int32), data, *pages))


def gather_blocks(pages: list[jax.Array], ids: jax.Array, out: jax.ShapeDtypeStruct) -> jax.Array:
    """kernels/cpu/block_copy.cc: `out` ([n, L, rows, ...], the pages' dtype) with the blocks `ids` ([1 or L,
    n] int32) of every layer, each token row zero-padded to `out`'s. Call only when `available()`."""
    return jax.ffi.ffi_call(GATHER_BLOCKS_TARGET, out)(ids.astype(jnp.int32), *pages)


def _cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV_VAR) or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "moray", "kernels")
    return Path(base)


def _cpu_signature() -> str:
    """The machine's CPU model and flags: -march=native code must not run on a CPU it was not built for."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return platform.processor() or platform.machine()


def _load() -> ctypes.CDLL:
    import jaxlib

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (g++ or $CXX)")
    sources = sorted(SOURCE_DIR.glob("*.cc"))
    headers = sorted(SOURCE_DIR.glob("*.h"))
    digest = hashlib.sha256()
    for part in (*FLAGS, compiler, jaxlib.__version__, _cpu_signature(), *(s.read_text() for s in (*sources, *headers))):
        digest.update(part.encode())
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    lib_path = cache / f"moray_cpu_{digest.hexdigest()[:16]}.so"
    with open(cache / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds, the others wait and load it
        if not lib_path.exists():
            _build(compiler, sources, lib_path)
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    jax.ffi.register_ffi_target(MOE_TARGET, jax.ffi.pycapsule(lib.MorayMoeExpertsF32), platform="cpu")
    jax.ffi.register_ffi_target(DENSE_TARGET, jax.ffi.pycapsule(lib.MorayDenseF32), platform="cpu")
    jax.ffi.register_ffi_target(SCATTER_BLOCKS_TARGET, jax.ffi.pycapsule(lib.MorayScatterBlocks), platform="cpu")
    jax.ffi.register_ffi_target(GATHER_BLOCKS_TARGET, jax.ffi.pycapsule(lib.MorayGatherBlocks), platform="cpu")
    return lib


def _build(compiler: str, sources: list[Path], lib_path: Path) -> None:
    tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, sources), "-o", str(tmp)]
    log.info("building CPU kernels: %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"building {', '.join(s.name for s in sources)} failed: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, lib_path)
