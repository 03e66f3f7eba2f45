"""The membership registry: one Serve deployment (one replica) that every component asks "who is alive,
draining or dead, and what does it hold".

    workers --WorkerReport every 100 ms--> Registry --follow (a stream of changes)--> every front end
                                             ^--worker_failed-- pipelines (a call found the worker gone)

It keeps the `Membership` (cluster/membership.py) and the workers' metric series (`WorkerMetrics`, served
inside every front end's /metrics). With the in-memory KV index (`kv_index.backend: memory`) it keeps the
authoritative copy of the index too, and a feed of what changed (the workers' KV events and loads): each
front end follows the feed into a local copy (`RegistryFeed`), so its router decides from memory and a
request costs the registry nothing; a front end that starts late, or falls behind the feed, gets the whole
index first. With a Redis index the workers write their KV events to Redis and the routers read it there;
the registry still owns liveness, and the routers drop whatever it says is not routable.

Draining: Serve gives a replica it stops (scale-down, redeploy) no signal before it waits for the replica's
requests to end, and a decode replica's channels are requests that last as long as their streams. So the
registry asks Serve's controller every `server.drain_watch_s` which replicas it keeps for this app; a
worker that reports but is not among them is being stopped, and drains: front ends then move their streams elsewhere (mid-stream migration), the channels
close, and the stop completes in seconds instead of at `graceful_shutdown_timeout_s`.

Worker reports used to go to the ingress, the replica that also serves every client; they no longer share
its event loop (or its CPU) with the streams.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import generate_latest

from workers.messages import KVEvent, WorkerReport

from . import logs
from .config import ClusterConfig, parse_cluster_config
from .membership import Membership, MembershipSnapshot
from .metrics import WorkerMetrics
from .router.memory_index import MemoryKVIndex
from .router.types import WorkerLoad

log = logging.getLogger("moray.cluster")

REGISTRY_DEPLOYMENT = "Registry"


FEED_LENGTH = 4096  # reports kept for front ends following the feed; one further behind gets the whole index


@dataclass(frozen=True, slots=True)
class RegistryChanges:
    """What changed since a front end's cursor: the membership now, and the KV index's changes (or the whole
    index, `resync`, when the cursor is unknown or too old)."""

    cursor: tuple[str, int]  # (registry epoch, last feed entry): the next call's cursor
    membership: MembershipSnapshot
    events: list[KVEvent] = field(default_factory=list)
    loads: list[WorkerLoad] = field(default_factory=list)
    resync: dict[str, tuple[int, int, list[tuple[int, str]]]] | None = None  # worker -> (epoch, last seq, blocks)


class Registry:
    def __init__(self, cluster_config: dict):
        self.config: ClusterConfig = parse_cluster_config(cluster_config)
        logs.configure(self.config.observability)
        router = self.config.router
        self.membership = Membership(router.heartbeat_ttl_s)
        self.worker_metrics = WorkerMetrics(model_name=self.config.engine.model_name)
        self.index = None
        self._lags: dict[str, float] = {}  # worker -> age of its last KV events when they arrived here
        if self.config.kv_index.backend == "memory":
            self.index = MemoryKVIndex(
                heartbeat_ttl_s=router.heartbeat_ttl_s,
                session_ttl_s=router.session_ttl_s,
                on_event_lag=lambda w, lag: self._lags.__setitem__(w, max(0.0, lag)),
            )
        self.membership.on_gone(self._gone)
        self.epoch = uuid.uuid4().hex[:12]  # a restarted registry has a new one: front ends take the whole index again
        self._feed: deque[tuple[int, list[KVEvent], WorkerLoad | None]] = deque(maxlen=FEED_LENGTH)
        self._feed_seq = 0
        self._changed: asyncio.Event | None = None
        self._maintain_every_s = router.heartbeat_ttl_s / 4
        self._maintained_at = time.monotonic()
        # Which replicas Serve keeps (None outside a Serve replica: nothing to ask).
        self.replicas_source: Callable[[], set[str] | None] | None = _serve_replicas_source() if self.config.server.drain_watch_s else None
        self._watcher: asyncio.Task | None = None

    def _gone(self, worker_id: str) -> None:
        self.worker_metrics.forget_worker(worker_id)
        self._lags.pop(worker_id, None)

    # ---------------------------------------------------------------- from workers and pipelines

    async def report(self, report: WorkerReport) -> None:
        self._start_watcher()
        hb = report.heartbeat
        if self.index is not None and report.events:
            self.index.apply(report.events)  # real cache changes, even from a worker believed dead
        accepted = self.membership.report(hb)
        load = WorkerLoad.from_heartbeat(hb, self._lags.get(hb.worker_id, 0.0))
        if accepted:
            self.worker_metrics.observe_worker(hb)
            if self.index is not None:
                self.index.heartbeat(load)
        self._fed(report.events, load if accepted else None)
        self._maybe_maintain()

    async def worker_failed(self, worker_id: str, at: float) -> None:
        self.membership.worker_failed(worker_id, at)

    def _maybe_maintain(self) -> None:
        if time.monotonic() - self._maintained_at >= self._maintain_every_s:
            self.remove_dead_workers_now()

    def remove_dead_workers_now(self) -> list[str]:
        """Workers whose heartbeat expired leave: membership, metric series, index entries."""
        self._maintained_at = time.monotonic()
        gone = self.membership.expire()
        if self.index is not None:
            for w in set(self.index.remove_dead_workers()) | set(gone):
                self.index.remove_worker(w)
        return gone

    # ---------------------------------------------------------------- draining (from Serve's controller)

    def _start_watcher(self) -> None:
        if self.replicas_source is None or (self._watcher is not None and not self._watcher.done()):
            return
        self._watcher = asyncio.get_running_loop().create_task(self._watch_stopping(), context=contextvars.Context())

    async def _watch_stopping(self) -> None:
        while True:
            try:
                await self.watch_stopping_once()
            except Exception as e:  # noqa: BLE001 - a controller that does not answer now may answer later
                log.warning("could not ask Serve which replicas it is stopping: %s", e)
            await asyncio.sleep(self.config.server.drain_watch_s)

    async def watch_stopping_once(self) -> list[str]:
        """Asks Serve which replicas it keeps: workers that report but are not among them are being stopped,
        and those still routable drain from now on (returned)."""
        kept = await asyncio.to_thread(self.replicas_source)
        if kept is None:  # the app is not listed (being deployed, or deleted): nothing to conclude
            return []
        newly = self.membership.stopping({m.worker_id for m in self.membership.members()} - kept)
        if newly:
            self._wake()
        return newly

    # ---------------------------------------------------------------- to front ends

    async def metrics(self) -> bytes:
        return generate_latest(self.worker_metrics.registry)

    # ---------------------------------------------------------------- the feed (in-memory KV index)

    async def changes(self, cursor: tuple[str, int] | None = None, wait_s: float = 0.0) -> RegistryChanges:
        """Everything since `cursor` (a long poll: waits up to `wait_s` for something new)."""
        if cursor is not None and cursor[0] == self.epoch and cursor[1] == self._feed_seq and wait_s > 0:
            changed = self._changed_event()
            try:
                await asyncio.wait_for(changed.wait(), wait_s)
            except TimeoutError:
                pass
        self._maybe_maintain()
        membership = self.membership.snapshot()
        now = (self.epoch, self._feed_seq)
        if self.index is None:
            return RegistryChanges(now, membership)
        first = self._feed_seq - len(self._feed) + 1
        if cursor is None or cursor[0] != self.epoch or cursor[1] < first - 1:
            workers = self.index.live_workers()
            resync = {w: self.index.export_worker(w) for w in workers}
            return RegistryChanges(now, membership, loads=list(workers.values()), resync=resync)
        events, loads = [], {}
        for seq, batch, load in self._feed:
            if seq > cursor[1]:
                events += batch
                if load is not None:
                    loads[load.worker_id] = load  # the newest of each worker is enough
        return RegistryChanges(now, membership, events, list(loads.values()))

    async def follow(
        self, cursor: tuple[str, int] | None = None, min_interval_s: float = 0.1, idle_s: float = 1.0, lifetime_s: float = 60.0
    ):
        """The feed as a stream: `changes` since the cursor whenever something changed, at most one per
        `min_interval_s`, at least one per `idle_s` (a heartbeat of the stream itself). One long call
        instead of a call per change: a Serve request costs the registry milliseconds, a streamed item much
        less. It ends after `lifetime_s` (the front end follows again), so no stream outlives a shutdown by long."""
        loop = asyncio.get_running_loop()
        end = loop.time() + lifetime_s
        while loop.time() < end:
            changes = await self.changes(cursor, idle_s)
            cursor = changes.cursor
            yield changes
            await asyncio.sleep(min_interval_s)

    def _changed_event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _fed(self, events: list[KVEvent], load: WorkerLoad | None) -> None:
        self._feed_seq += 1
        self._feed.append((self._feed_seq, events, load))
        self._wake()

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()  # wakes every waiting front end; the next wait gets a fresh event
            self._changed = None


def _serve_replicas_source() -> Callable[[], set[str] | None] | None:
    """A function returning the ids of the replicas Serve keeps for this app; None when this is not a Serve
    replica (a test's registry in process)."""
    try:
        from ray import serve

        app_name = serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - RayServeException outside a replica
        return None
    return lambda: serve_replicas(app_name)


def serve_replicas(app_name: str) -> set[str] | None:
    """The replicas (ids as `ReplicaContext.replica_id.unique_id`) Serve's controller keeps for `app_name`
    (starting, running, updating; not stopping); None when it does not list the app. A replica it is
    stopping (scale-down, redeploy) is no longer listed, although it runs until its requests end."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    app = (details.get("applications") or {}).get(app_name)
    if not app:
        return None
    return {
        r["replica_id"]
        for deployment in (app.get("deployments") or {}).values()
        for r in deployment.get("replicas") or ()
        if str(getattr(r.get("state"), "value", r.get("state"))) != "STOPPING"
    }


class RegistryFeed:
    """A front end's copy of the registry's KV index, kept by following its feed; the router's `KVIndex`
    (lookups, speculative entries and sessions are this front end's own, from memory)."""

    def __init__(self, heartbeat_ttl_s: float, session_ttl_s: float):
        self.index = MemoryKVIndex(heartbeat_ttl_s=heartbeat_ttl_s, session_ttl_s=session_ttl_s)
        self.cursor: tuple[str, int] | None = None

    def apply(self, changes: RegistryChanges) -> None:
        if changes.resync is not None:
            for w in set(self.index.live_workers()) - set(changes.resync):
                self.index.remove_worker(w)
            for w, (epoch, seq, blocks) in changes.resync.items():
                self.index.load_snapshot(w, epoch, seq, blocks)
        if changes.events:
            self.index.apply(changes.events)
        for load in changes.loads:
            self.index.heartbeat(load)
        self.cursor = changes.cursor
