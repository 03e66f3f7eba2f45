"""An engine keeps freed host memory in its process (workers/engine/host_memory.py): large buffers allocated
again and again (a KV export's 6 MiB staging copies, 11 of them per 66 MiB handoff) reuse warm pages instead
of faulting fresh ones in. Each case runs in its own process: the allocator's settings are process-wide."""

import subprocess
import sys
from pathlib import Path

import pytest

from workers.models.make_model import make_model

ROOT = Path(__file__).resolve().parent.parent

# Builds an engine (or not), then allocates, writes and frees eleven 6 MiB buffers four times and prints the
# page faults of each round.
SCRIPT = """
import ctypes, resource, sys
sys.path.insert(0, {root!r})
from workers.engine import EngineConfig, EngineCore
model, retain = sys.argv[1], sys.argv[2]
if model != "-":
    EngineCore(EngineConfig(model=model, warmup=False, num_kv_blocks=64, max_model_len=256, retain_freed_host_memory=retain == "on"), show_progress=False)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [libc.malloc(6 << 20) for _ in range(11)]
    for b in buffers:
        ctypes.memset(b, 1, 6 << 20)
    for b in buffers:
        libc.free(b)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(*[faults() for _ in range(4)])
"""


def _faults(model: str, retain: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(root=str(ROOT)), model, retain], capture_output=True, text=True, timeout=300, check=True
    )
    return [int(x) for x in out.stdout.split()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("host-memory") / "tiny", "qwen3_moe", "tiny", seed=1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_an_engine_process_reuses_freed_host_memory_and_the_setting_turns_it_off(model_dir):
    pages = 11 * (6 << 20) // 4096
    # glibc's defaults: every round faults all 66 MiB in again (the first one also with the setting).
    assert all(f >= pages * 0.9 for f in _faults("-", "off"))
    assert all(f >= pages * 0.9 for f in _faults(str(model_dir), "off"))
    on = _faults(str(model_dir), "on")  # the default
    assert on[0] >= pages * 0.9 and max(on[1:]) < pages * 0.05, on
