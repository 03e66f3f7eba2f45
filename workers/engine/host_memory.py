"""The process's host allocator, set so that large host buffers reuse warm pages.

glibc serves an allocation over its mmap threshold with fresh pages from the kernel and returns them when it is
freed; each of those pages is faulted in (and zeroed) when first written. An engine allocates such buffers again
and again: a KV export's staging copies (6 MiB pieces), XLA:CPU's outputs and temporaries, the host copies of
a handoff. Measured on 2 CPU cores (a VM, where a page fault is dear): gathering a 66 MiB export in 11 pieces took
25-50 ms with glibc's defaults and 7-10 ms with the settings below, the same copies into memory freed by the
previous export.

`retain_freed_host_memory` sets, once per process: allocations up to 32 MiB from the heap (glibc's largest mmap
threshold), freed memory kept unless over 512 MiB of it sits at the heap's top, and the heap grown 64 MiB at a
time. The cost is RSS: up to that much freed memory stays with the process. A no-op where the C library is not
glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 512 << 20, M_TOP_PAD: 64 << 20}

_lock = threading.Lock()
_applied: bool | None = None  # None: not tried yet


def retain_freed_host_memory() -> bool:
    """Applies SETTINGS to this process's allocator (once); whether they are in effect."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _mallopt_all()
        return _applied


def _mallopt_all() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc: its allocator keeps its own policy
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all([mallopt(param, value) == 1 for param, value in SETTINGS.items()])  # each tried, one refused or not
    if not ok:
        log.warning("mallopt refused a setting; large host buffers keep glibc's defaults")
    return ok
