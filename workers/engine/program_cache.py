"""Step programs shared by the runners of one process.

A runner's step closes over its model and settings, so `jax.jit` keeps its traces per runner: a second
engine with the same settings traced, lowered and compiled (or loaded from the persistent cache) every
step program again. Tests and benchmarks build many such engines in one process (ten of the suite's engine
modules built 224 step programs, 82 of them distinct), and a server that rebuilds its engine does the same.
Here a runner looks its programs up by a key that names everything the trace reads (the runner's
`program_key`) and the program's shape, and builds only what no runner of the process has built.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
from typing import Callable, Hashable

# Programs are kept up to this many (least recently used dropped first); a live runner keeps its own
# programs in any case. Few: XLA:CPU maps each program's code in many pieces, and the kernel caps a process
# at 65530 maps (vm.max_map_count). With 256, a test worker reached 42,652 maps where it held ~1,500 without
# sharing. 0 turns sharing off.
CAPACITY_ENV_VAR = "MORAY_STEP_PROGRAM_CACHE"
DEFAULT_CAPACITY = 32


class StepProgramCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: collections.OrderedDict[Hashable, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get_or_build(self, key: Hashable, build: Callable[[], object]) -> tuple[object, bool]:
        """(the program of `key`, whether it was built now). A key another thread is building is awaited,
        not built twice; a build that fails is not kept (the next caller tries again)."""
        if self.capacity <= 0:
            return build(), True
        with self._lock:
            future = self._entries.get(key)
            mine = future is None
            if mine:
                future = self._entries[key] = concurrent.futures.Future()
                self._evict()
            else:
                self._entries.move_to_end(key)
        if not mine:
            return future.result(), False
        try:
            program = build()
        except BaseException as e:
            with self._lock:
                if self._entries.get(key) is future:
                    del self._entries[key]
            future.set_exception(e)
            raise
        future.set_result(program)
        return program, True

    def _evict(self) -> None:
        # Only finished entries go: a waiter holds an unfinished one's future anyway.
        while len(self._entries) > self.capacity:
            old = next((k for k, f in self._entries.items() if f.done()), None)
            if old is None:
                return
            del self._entries[old]

    def __len__(self) -> int:
        return len(self._entries)


def _capacity() -> int:
    raw = os.environ.get(CAPACITY_ENV_VAR, "").strip()
    if not raw:
        return DEFAULT_CAPACITY
    try:
        return max(int(raw), 0)
    except ValueError:
        raise ValueError(f"{CAPACITY_ENV_VAR}={raw!r}: expected a number of programs (0 turns sharing off)") from None


STEP_PROGRAMS = StepProgramCache(_capacity())
