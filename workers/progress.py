"""Progress for long steps (weight loading, compile warm-up): a bar on a terminal, sparse log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("moray")


class Progress:
    def __init__(self, total: int, what: str, enabled: bool = True):
        self.total, self.what, self.done = max(total, 1), what, 0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self._last_decile = -1

    def __call__(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        frac = self.done / self.total
        if self.tty:
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r{self.what}: [{bar:<30}] {self.done}/{self.total}")
            if self.done >= self.total:
                sys.stderr.write(f" ({time.perf_counter() - self.start:.1f}s)\n")
            sys.stderr.flush()
        elif int(frac * 10) > self._last_decile:
            self._last_decile = int(frac * 10)
            log.info("%s: %d/%d (%.0f%%)", self.what, self.done, self.total, 100 * frac)
