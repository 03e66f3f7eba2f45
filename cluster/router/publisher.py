"""The KV event pipeline between engines and routers.

Worker side, `RedisKVEventSink`: listens to an engine's `KVEventPublisher` and writes the Redis index
directly, one pipelined Lua call per batch (flushed on size or time) that also appends the batch to the
model's stream; it keeps the worker's heartbeat fresh (`load:{model}:<worker>` with a TTL, and the
worker's deadline in `live:{model}`).

Design for late router replicas and for failures:
- The index itself lives in Redis (redis_index.py), so a replica that starts late reads the current
  cache state at once; nothing has to be replayed, and a bounded stream losing old entries loses nothing.
- The engine thread only appends to a deque (no lock, no network); a background thread does the rest.
- The sink keeps a mirror of its worker's cache (a one-worker MemoryKVIndex, as big as the engine's
  prefix cache). Whenever Redis may have missed something - a write failed past `max_pending` queued
  events, Redis restarted and lost its data, the index refused a batch because of a sequence gap, or a
  router removed the worker - the sink ships that mirror as a snapshot. Batches are idempotent (the
  index skips sequence numbers it already applied), so retrying after a timeout is safe.

Router side, `KVEventStreamConsumer`: for a router that wants a local in-memory index fed by remote
workers. It loads the Redis index atomically with the stream position (`RedisKVIndex.read_all`), then
tails the stream from there; on a sequence gap (the stream trimmed past it) it reloads.

In-process (one router and its engines in one process, tests): `attach_in_process(index, publisher)`.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Callable

import redis
from redis.exceptions import NoScriptError, RedisError

from workers.engine.kv_events import KVEvent, KVEventKind, KVEventPublisher
from workers.messages import WorkerHeartbeat

from .memory_index import MemoryKVIndex
from .redis_conn import describe
from .redis_index import (
    ALL_SCRIPTS,
    APPLY,
    SNAPSHOT,
    RedisKVIndex,
    check_worker_id,
    contiguous_runs,
    heartbeat_commands,
    model_tag,
    pack_blocks,
    pack_events,
    unpack_decision,
    unpack_records,
)
from .types import IndexUnavailable, Role, WorkerLoad

log = logging.getLogger("moray.router.events")

_KINDS = {"s": KVEventKind.STORED, "r": KVEventKind.REMOVED, "c": KVEventKind.CLEARED}


def attach_in_process(index, publisher: KVEventPublisher) -> None:
    """Feeds an in-process index straight from an engine's publisher (the listener runs on the engine
    thread; MemoryKVIndex.apply is a few dict operations)."""
    publisher.add_listener(lambda e: index.apply([e]))


def load_from_engine_stats(
    worker_id: str, role: Role, stats, inflight_prefill_tokens: int | None = None, sparse_blocks: bool = False
) -> WorkerLoad:
    """A WorkerLoad from `EngineCore.stats()` measured now (through the heartbeat's own conversion).
    `inflight_prefill_tokens` overrides the engine's pending prompt tokens; `sparse_blocks`: the engine
    publishes only reusable block boundaries (`core.cfg.is_hybrid`)."""
    load = WorkerLoad.from_heartbeat(WorkerHeartbeat(worker_id, role, time.time(), engine=stats))
    changes = {"sparse_blocks": sparse_blocks or load.sparse_blocks}
    if inflight_prefill_tokens is not None:
        changes["inflight_prefill_tokens"] = inflight_prefill_tokens
    return replace(load, **changes)


class RedisKVEventSink:
    def __init__(
        self,
        client: redis.Redis,
        model: str,
        worker_id: str,
        *,
        role: Role = "both",
        heartbeat_ttl_s: float = 10.0,
        heartbeat_interval_s: float | None = None,
        batch_size: int = 512,
        flush_interval_s: float = 0.01,
        stream_maxlen: int = 100_000,
        retry_interval_s: float = 1.0,
        max_pending: int = 100_000,
        snapshot_chunk: int = 2000,
        load_fn: Callable[[], WorkerLoad] | None = None,
        registry=None,
    ):
        self.client = client
        self.model = model
        self.tag = model_tag(model)
        self.workers_key = f"workers:{self.tag}"
        self.worker_id = check_worker_id(worker_id)
        self.role = role
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.heartbeat_interval_s = heartbeat_interval_s or heartbeat_ttl_s / 3
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.stream_maxlen = stream_maxlen
        self.retry_interval_s = retry_interval_s
        self.max_pending = max_pending
        self.snapshot_chunk = snapshot_chunk
        self.load_fn = load_fn
        self._load: WorkerLoad | None = None

        self._queue: deque[KVEvent] = deque()  # engine thread appends, sink thread pops
        self._submitted = 0  # events handed to submit() (engine thread only)
        self._mirror = MemoryKVIndex()  # this worker's cache state, as the events describe it
        self._pending: list[KVEvent] = []  # in the mirror, not yet in Redis
        self._drained = 0
        self._done = 0  # events the sink has drained and Redis has (or a snapshot covered)
        self._needs_resync = False
        self._written: tuple[int, int] | None = None  # (epoch, seq) Redis confirmed last
        self._lag_s = 0.0
        self._retry_at = 0.0
        self._next_heartbeat = 0.0
        self._down = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self.stats = {"events": 0, "batches": 0, "snapshots": 0, "errors": 0, "overflows": 0, "heartbeats": 0}
        self._metrics = _SinkMetrics(registry) if registry is not None else None
        self._resync_reason = "overflow"

    @classmethod
    def from_config(cls, kv_cfg, router_cfg, model: str, worker_id: str, role: Role = "both", **kw) -> "RedisKVEventSink":
        from .redis_conn import connect_from_config

        # Off the request path: a longer deadline than the router's lets multi-thousand-block snapshots land.
        client = connect_from_config(kv_cfg, timeout_s=max(kv_cfg.timeout_s, 2.0))
        return cls(
            client,
            model,
            worker_id,
            role=role,
            heartbeat_ttl_s=router_cfg.heartbeat_ttl_s,
            batch_size=kv_cfg.sink_batch_size,
            flush_interval_s=kv_cfg.sink_flush_interval_s,
            stream_maxlen=kv_cfg.stream_maxlen,
            retry_interval_s=kv_cfg.retry_interval_s,
            **kw,
        )

    # ---------------------------------------------------------------- engine side (never blocks)

    def attach(self, publisher: KVEventPublisher) -> "RedisKVEventSink":
        publisher.add_listener(self.submit)
        return self.start()

    def submit(self, event: KVEvent) -> None:
        self._queue.append(event)
        self._submitted += 1

    def set_load(self, load: WorkerLoad) -> None:
        """The latest load; the next heartbeat carries it (used when no load_fn was given)."""
        self._load = load

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> "RedisKVEventSink":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"moray-kv-sink-{self.worker_id}", daemon=True)
            self._thread.start()
        return self

    def flush(self, timeout: float = 5.0) -> bool:
        """Waits until every event submitted so far is in Redis; False if that did not happen in time."""
        target = self._submitted
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._done < target or self._needs_resync or self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._wake.set()
                self._cv.wait(min(remaining, 0.05))
        return True

    def close(self, timeout: float = 2.0) -> None:
        if self._thread is not None:
            self.flush(timeout)
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout)
            self._thread = None

    # ---------------------------------------------------------------- the sink thread

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            self._step()
            if self._stop.is_set():
                return

    def _step(self) -> None:
        self._drain()
        now = time.monotonic()
        if now < self._retry_at:
            return
        try:
            if self._needs_resync:
                self._snapshot(self._resync_reason)
            elif self._pending:
                self._send_pending()
            if now >= self._next_heartbeat:
                self._heartbeat()
                self._next_heartbeat = now + self.heartbeat_interval_s
        except RedisError as e:
            self._count("errors")
            self._retry_at = time.monotonic() + self.retry_interval_s
            if not self._down:
                self._down = True
                log.warning("KV event sink %s: Redis unavailable, events queue locally: %s", self.worker_id, describe(self.client, e))
            if len(self._pending) > self.max_pending:
                self._overflow()
            return
        if self._down:
            self._down = False
            log.warning("KV event sink %s: Redis reachable again", self.worker_id)
        with self._cv:
            if not self._pending and not self._needs_resync:
                self._done = self._drained
            self._cv.notify_all()

    def _drain(self) -> None:
        events = []
        while True:
            try:
                events.append(self._queue.popleft())
            except IndexError:
                break
        if not events:
            return
        self._mirror.apply(events)
        self._drained += len(events)
        if not self._needs_resync:
            self._pending += events
            if len(self._pending) > self.max_pending:
                self._overflow()

    def _overflow(self) -> None:
        """Too many events waiting for Redis: drop them; the mirror has their effect, a snapshot follows."""
        self._count("overflows")
        self._pending.clear()
        self._needs_resync = True
        self._resync_reason = "overflow"

    def _script(self, fn):
        try:
            return fn()
        except NoScriptError:  # Redis restarted and lost its script cache
            for s in ALL_SCRIPTS:
                self.client.script_load(s.source)
            return fn()

    def _send_pending(self) -> None:
        runs = []
        for run in contiguous_runs(self._pending):
            runs += [run[i : i + self.batch_size] for i in range(0, len(run), self.batch_size)]

        def send():
            pipe = self.client.pipeline(transaction=False)
            for run in runs:
                e0 = run[0]
                pipe.evalsha(
                    APPLY.sha,
                    1,
                    self.workers_key,
                    self.tag,
                    e0.worker_id,
                    str(e0.epoch),
                    e0.seq,
                    1,
                    self.stream_maxlen,
                    e0.timestamp,
                    *pack_events(run),
                )
            return pipe.execute()

        results = self._script(send)
        self._count("batches", len(runs))
        if any(result == "resync" for result, _ in results):
            # The index is not where this batch follows on: Redis lost data (restart, eviction) or a router
            # removed the worker. Batches after the refused one were refused too; the snapshot covers all.
            self._snapshot("refused")
            return
        self._count("events", len(self._pending))
        self._lag_s = max(0.0, time.time() - self._pending[0].timestamp)
        if self._metrics is not None:
            self._metrics.lag.set(self._lag_s)
        last = self._pending[-1]
        self._written = (last.epoch, last.seq)
        self._pending.clear()

    def _count(self, what: str, n: int = 1) -> None:
        self.stats[what] += n
        if self._metrics is not None:
            self._metrics.counters[what].inc(n)

    def _snapshot(self, reason: str) -> None:
        """Replaces the worker's entries in Redis with the mirror's, in parts of `snapshot_chunk` blocks.
        reason: overflow (events dropped locally), refused (the index saw a gap), lost (Redis lost them)."""
        position = self._mirror.position(self.worker_id)
        if position is None:  # no event ever: nothing to restore
            self._needs_resync = False
            self._pending.clear()
            return
        epoch, seq, blocks = self._mirror.export_worker(self.worker_id)
        parts = [blocks[i : i + self.snapshot_chunk] for i in range(0, len(blocks), self.snapshot_chunk)] or [[]]

        def send():
            pipe = self.client.pipeline(transaction=False)
            for i, part in enumerate(parts):
                pipe.evalsha(
                    SNAPSHOT.sha,
                    1,
                    self.workers_key,
                    self.tag,
                    self.worker_id,
                    str(epoch),
                    seq,
                    1 if i == 0 else 0,
                    self.stream_maxlen,
                    *pack_blocks(part),
                )
            return pipe.execute()

        self._script(send)
        self._count("snapshots")
        if self._metrics is not None:
            self._metrics.snapshots.labels(reason).inc()
        log.info(
            "KV event sink %s: shipped a snapshot of %d blocks (%s; epoch %d, seq %d)", self.worker_id, len(blocks), reason, epoch, seq
        )
        self._written = (epoch, seq)
        self._pending.clear()
        self._needs_resync = False

    def _heartbeat(self) -> None:
        try:
            load = self.load_fn() if self.load_fn is not None else self._load
        except Exception:  # a broken load function must not stop the heartbeat (or the events)
            log.exception("KV event sink %s: load_fn failed; sending the last load", self.worker_id)
            load = self._load
        self._load = load
        epoch, seq = self._mirror.position(self.worker_id) or (0, -1)
        load = replace(
            load or WorkerLoad(self.worker_id),
            worker_id=self.worker_id,
            role=self.role,
            epoch=epoch,
            last_seq=seq,
            ts=time.time(),
            index_lag_s=self._lag_s,
        )
        pipe = self.client.pipeline(transaction=False)
        heartbeat_commands(pipe, self.tag, load, self.heartbeat_ttl_s)
        pipe.hmget(f"wstate:{self.tag}:{self.worker_id}", "epoch", "seq")
        *_, (r_epoch, r_seq) = pipe.execute()
        self._count("heartbeats")
        # Does Redis still know what we wrote? Not after a restart without persistence, or remove_worker.
        if self._written is not None and (r_epoch, r_seq) != (str(self._written[0]), str(self._written[1])):
            log.warning("KV event sink %s: the Redis index lost this worker's entries; resynchronising", self.worker_id)
            self._snapshot("lost")


class _SinkMetrics:
    """The sink's counters in a Prometheus registry (the worker's /metrics)."""

    def __init__(self, registry):
        from prometheus_client import Counter, Gauge

        names = {
            "events": "KV events written to the Redis index",
            "batches": "batches (Lua calls) written",
            "snapshots": "full resynchronisations of this worker's entries",
            "errors": "failed Redis writes (retried)",
            "overflows": "times the local backlog was dropped for a snapshot",
            "heartbeats": "heartbeats written",
        }
        self.counters = {k: Counter(f"moray_kv_sink_{k}", doc, registry=registry) for k, doc in names.items()}
        self.snapshots = Counter("moray_kv_sink_resyncs", "snapshots by cause", ["reason"], registry=registry)
        self.lag = Gauge("moray_kv_sink_lag_seconds", "age of the oldest event of the last batch when it was written", registry=registry)


class KVEventStreamConsumer:
    """Keeps a local MemoryKVIndex equal to the Redis index: load it, then tail the model's stream.
    Also copies live heartbeats into it, so the local index knows loads and liveness too."""

    def __init__(
        self,
        index: MemoryKVIndex,
        client: redis.Redis,
        model: str,
        *,
        poll_interval_s: float = 0.05,
        heartbeat_refresh_s: float = 1.0,
        count: int = 1000,
        remote: RedisKVIndex | None = None,
    ):
        self.index = index
        self.client = client
        self.remote = remote or RedisKVIndex(client, model)  # shared with a MirroredKVIndex: one breaker
        self.stream = f"events:{model_tag(model)}"
        self.poll_interval_s = poll_interval_s
        self.heartbeat_refresh_s = heartbeat_refresh_s
        self.count = count
        self.last_id: str | None = None
        self._loads_at = 0.0
        self._live: set[str] = set()
        self._gap = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = False  # the last poll reached Redis (so the local copy is current)
        self.unreadable_entries = 0  # stream entries skipped because they could not be parsed
        previous = index.on_purge

        def on_purge(worker, reason):
            if reason == "gap":
                self._gap = True  # the stream lost entries we needed: reload
            if previous is not None:
                previous(worker, reason)

        index.on_purge = on_purge

    def bootstrap(self) -> None:
        last_id, rows = self.remote.read_all()
        for worker, epoch, seq, blocks in rows:
            self.index.load_snapshot(worker, epoch, seq, blocks)
        self.last_id = last_id
        self._gap = False
        self.refresh_loads()

    def refresh_loads(self) -> None:
        live = self.remote.live_workers()
        for load in live.values():
            self.index.heartbeat(load)
        for w in self._live - live.keys():
            self.index.drop_heartbeat(w)
        self._live = set(live)
        self._loads_at = time.monotonic()

    def poll_once(self) -> int:
        """Applies what the stream gained since the last call; returns the number of entries read.
        Raises IndexUnavailable if Redis cannot be reached, and keeps `available` to match. (Non-blocking:
        a blocking XREAD would have to outlast the client's socket timeout.)"""
        try:
            if self.last_id is None or self._gap:
                self.bootstrap()
            resp = self.remote.breaker.call(lambda: self.client.xread({self.stream: self.last_id}, count=self.count))
        except IndexUnavailable:
            self.available = False
            raise
        self.available = True
        n = 0
        for _, entries in resp or []:
            for entry_id, f in entries:
                self._apply_readable(entry_id, f)
                self.last_id = entry_id
                n += 1
        if time.monotonic() - self._loads_at >= self.heartbeat_refresh_s:
            self.refresh_loads()
        return n

    def _apply_readable(self, entry_id: str, f: dict) -> None:
        """Applies an entry, or skips it (counted, logged once) if it is not in a format this version
        reads, e.g. written by a newer router or worker during a rolling upgrade: one unreadable entry
        must not stop the mirror from following the rest of the stream."""
        try:
            self._apply_entry(f)
        except (KeyError, ValueError, struct.error) as e:
            if not self.unreadable_entries:
                log.warning("KV stream consumer: skipping an entry it cannot read (%s: %r); counting further ones silently", entry_id, e)
            self.unreadable_entries += 1

    def _apply_entry(self, f: dict) -> None:
        if f["t"] == "D":
            self._apply_decisions(f)
            return
        w, epoch, seq = f["w"], int(f["ep"]), int(f["s"])
        if f["t"] == "e":
            ts = float(f["ts"])
            events = [
                KVEvent(w, epoch, seq + i, _KINDS[kind], h, None, 0, tier, ts)
                for i, (kind, h, tier) in enumerate(unpack_records(f["tiers"], f["d"], 18))
            ]
            self.index.apply(events)
        else:
            blocks = [(h, tier) for _, h, tier in unpack_records(f["tiers"], f["d"], 17)]
            self.index.load_snapshot(w, epoch, seq, blocks, reset=f["r"] == "1")

    def _apply_decisions(self, f: dict) -> None:
        """Routers' decisions (this router's own ones are in the local index already)."""
        if f["r"] == self.remote.router_id:
            return
        for key, rec in f.items():
            if key not in ("t", "r"):
                width, workers, held, hashes, session = unpack_decision(rec)
                self.index.record_decision(workers, hashes, width / 1000, session, held)

    def start(self) -> "KVEventStreamConsumer":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="moray-kv-consumer", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        down = False
        while not self._stop.is_set():
            try:
                if down:
                    self.last_id = None  # Redis may have restarted: reload rather than trust our position
                n = self.poll_once()
                if down:
                    log.warning("KV stream consumer: Redis reachable again; index reloaded")
                    down = False
                if n < self.count:
                    self._stop.wait(self.poll_interval_s)
            except IndexUnavailable as e:
                if not down:
                    log.warning("KV stream consumer: %s", e)
                    down = True
                self._stop.wait(self.remote.breaker.retry_interval_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
