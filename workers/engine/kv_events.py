"""KV-cache events: what a worker's prefix cache holds, as a gap-free stream per (worker, epoch).

The router's index is built from these (stored / removed / cleared). `epoch` changes whenever the
engine starts, so a consumer that sees a new epoch, or a gap in `seq`, knows to drop what it had.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from workers.messages import KVEvent, KVEventKind  # the event is a message (it crosses to the router)


class KVEventSubscription:
    """A bounded FIFO of events; `drain()` returns what arrived since the last drain."""

    def __init__(self, maxlen: int):
        self._queue: deque[KVEvent] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def _push(self, event: KVEvent) -> None:
        with self._lock:
            self._queue.append(event)

    def drain(self) -> list[KVEvent]:
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out


class KVEventPublisher:
    """Numbers events gap-free and fans them out to in-process subscribers and listeners.

    A subscriber that falls more than `maxlen` events behind loses the oldest ones; it sees the gap in
    `seq` and must resynchronise, exactly like a remote consumer would.
    """

    def __init__(self, worker_id: str, epoch: int | None = None):
        self.worker_id = worker_id
        self.epoch = epoch if epoch is not None else time.time_ns()
        self._seq = 0
        self._subscriptions: list[KVEventSubscription] = []
        self._listeners: list[Callable[[KVEvent], None]] = []

    @property
    def last_seq(self) -> int:
        """Sequence number of the last event emitted (-1 before the first)."""
        return self._seq - 1

    def subscribe(self, maxlen: int = 1_000_000) -> KVEventSubscription:
        sub = KVEventSubscription(maxlen)
        self._subscriptions.append(sub)
        return sub

    def add_listener(self, fn: Callable[[KVEvent], None]) -> None:
        self._listeners.append(fn)

    def emit(self, kind: KVEventKind, block_hash=None, parent_hash=None, num_tokens=0, tier="device") -> KVEvent:
        event = KVEvent(self.worker_id, self.epoch, self._seq, kind, block_hash, parent_hash, num_tokens, tier, time.time())
        self._seq += 1
        for sub in self._subscriptions:
            sub._push(event)
        for fn in self._listeners:
            fn(event)
        return event
