"""`MirroredKVIndex`: Redis stays the shared index; each router replica answers lookups from a local copy.

Why: a Lua lookup costs a round trip plus ~130-270 us of Redis time per decision, and Redis is one
thread shared by every replica; a local `MemoryKVIndex` answers in ~100 us of this process's CPU with no
network at all. The copy is kept equal to Redis by `KVEventStreamConsumer`: a snapshot of the whole index
when it starts (so a late or restarted replica routes by the existing cache at once), then the model's
event stream, which carries the workers' KV events and every router's decisions (speculative entries and
sessions), so replicas that have read the stream to the same entry make the same decisions.

The price is staleness of one poll interval (default 10 ms) for what *other* replicas and workers did;
this replica's own decisions count locally at once. If the consumer cannot reach Redis, lookups raise
`IndexUnavailable` and the router routes by load alone until the copy is reloaded, as with plain Redis.
"""

from __future__ import annotations

import logging
from typing import Iterable

from workers.engine.kv_events import KVEvent

from .memory_index import MemoryKVIndex
from .publisher import KVEventStreamConsumer
from .redis_index import SWEEP_BUDGET, RedisKVIndex
from .types import IndexUnavailable, Lookup, WorkerLoad

log = logging.getLogger("moray.router")


class MirroredKVIndex:
    blocking_lookups = False  # answered from memory: no need to leave the event loop

    def __init__(self, remote: RedisKVIndex, *, poll_interval_s: float = 0.01, heartbeat_refresh_s: float = 0.5):
        self.remote = remote
        remote.write_linger_s = 0.002  # this replica's decisions count locally at once; others' can wait 2 ms
        self.breaker = remote.breaker  # the router's index-up metric follows Redis itself
        self.local = MemoryKVIndex(heartbeat_ttl_s=remote.heartbeat_ttl_s, session_ttl_s=remote.session_ttl_s)
        self.consumer = KVEventStreamConsumer(
            self.local,
            remote.client,
            remote.model,
            poll_interval_s=poll_interval_s,
            heartbeat_refresh_s=heartbeat_refresh_s,
            remote=remote,
        )
        self.on_purge = None  # set by the router; forwarded from the local copy
        self.on_event_lag = None
        self.local.on_event_lag = lambda w, s: self.on_event_lag and self.on_event_lag(w, s)
        self._chain_purge()

    def _chain_purge(self) -> None:
        consumer_hook = self.local.on_purge  # the consumer's gap detection

        def on_purge(worker: str, reason: str) -> None:
            consumer_hook(worker, reason)
            if self.on_purge is not None:
                self.on_purge(worker, reason)

        self.local.on_purge = on_purge

    def start(self) -> "MirroredKVIndex":
        """Loads the copy now (so the first request already sees the cache), then follows the stream."""
        try:
            self.consumer.poll_once()
        except IndexUnavailable as e:
            log.warning("KV index mirror: Redis unreachable at start (%s); routing by load until it answers", e)
        self.consumer.start()
        return self

    def catch_up(self) -> int:
        """Reads what the stream gained since the last poll, now (tests; a replica that must be current)."""
        return self.consumer.poll_once()

    # ---------------------------------------------------------------- lookups: local

    def _check(self) -> None:
        if not self.consumer.available:
            raise IndexUnavailable("KV index mirror is not current: Redis unreachable")

    def lookup(self, block_hashes: list[int], session_id: str | None = None) -> Lookup:
        self._check()
        return self.local.lookup(block_hashes, session_id)

    def longest_prefix(self, block_hashes: list[int]) -> dict[str, int]:
        self._check()
        return self.local.longest_prefix(block_hashes)

    def live_workers(self) -> dict[str, WorkerLoad]:
        return self.local.live_workers()

    def session_workers(self, session_id: str) -> list[str]:
        return self.local.session_workers(session_id)

    # ---------------------------------------------------------------- writes: Redis (and the copy at once)

    def record_decision(
        self, workers: list[str], block_hashes: list[int], ttl_s: float, session_id: str | None, held: list[int] | None = None
    ) -> None:
        self.local.record_decision(workers, block_hashes, ttl_s, session_id, held)
        self.remote.record_decision(workers, block_hashes, ttl_s, session_id, held)

    def note_speculative(self, worker_id: str, block_hashes: list[int], ttl_s: float) -> None:
        self.record_decision([worker_id], block_hashes, ttl_s, None)

    def record_session(self, session_id: str, worker_id: str) -> None:
        self.record_decision([worker_id], [], 0, session_id)

    def apply(self, events: Iterable[KVEvent]) -> None:
        self.remote.apply(events)  # the copy gets them back through the stream

    def heartbeat(self, load: WorkerLoad) -> None:
        self.remote.heartbeat(load)
        self.local.heartbeat(load)

    def load_snapshot(self, worker_id: str, epoch: int, last_seq: int, blocks: list[tuple[int, str]], reset: bool = True) -> None:
        self.remote.load_snapshot(worker_id, epoch, last_seq, blocks, reset)

    def remove_worker(self, worker_id: str) -> None:
        self.remote.remove_worker(worker_id)
        self.local.remove_worker(worker_id)

    def remove_dead_workers(self) -> list[str]:
        removed = self.remote.remove_dead_workers()
        for w in removed:
            self.local.remove_worker(w)
        return removed

    def sweep(self, budget: int = SWEEP_BUDGET) -> int:
        return self.remote.sweep(budget)

    def flush(self, timeout: float = 2.0) -> bool:
        return self.remote.flush(timeout)

    def close(self) -> None:
        self.consumer.close()
        self.remote.close()
