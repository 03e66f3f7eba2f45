"""Membership: the one answer to "who is alive, draining or dead".

`Membership` is the registry's record (cluster/registry.py keeps the only authoritative one): every worker's
last heartbeat and its verdict. Workers report to the registry a few times a second; a worker is dead when
a call to it failed because it is gone (the pipeline says so) or when its heartbeat is older than
`heartbeat_ttl_s`. A failed worker comes back only with a heartbeat measured after the failure (plus a grace
for clock skew): a report that was in flight when it died cannot revive it, one wrongly suspected comes back
by itself. Draining workers get nothing new, and front ends move the streams they run elsewhere (mid-stream
migration). A worker drains when it says so in its heartbeat, or when Serve is stopping its replica (a
scale-down, a redeploy: the registry asks Serve's controller, `Membership.stopping`).

`MembershipView` is a front end's copy (refreshed from the registry a few times a second), plus the failures
this front end saw itself and has not yet seen the registry confirm, so it routes around a dead worker at
once. The router filters every lookup through it; /health counts from it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from workers.messages import Role, WorkerHeartbeat, WorkerState

log = logging.getLogger("moray.cluster")

# A heartbeat measured this long after a failure proves a suspected worker alive (absorbs clock skew between
# the worker's host and this one; heartbeats carry the worker's own measurement time).
FAILED_GRACE_S = 0.5


@dataclass(slots=True)
class Member:
    worker_id: str
    role: Role
    state: WorkerState
    heartbeat: WorkerHeartbeat
    reported_at: float  # the registry's monotonic clock
    failed_at: float | None = None  # wall clock of the failure that made it DEAD

    @property
    def routable(self) -> bool:
        return self.state is WorkerState.ALIVE and self.heartbeat.healthy


@dataclass(frozen=True, slots=True)
class MembershipSnapshot:
    """The registry's members at one moment, as a front end receives it."""

    members: tuple[Member, ...] = ()
    taken_at: float = 0.0  # wall clock

    def by_id(self) -> dict[str, Member]:
        return {m.worker_id: m for m in self.members}


class Membership:
    def __init__(self, heartbeat_ttl_s: float, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.clock, self.wall = clock, wall
        self._members: dict[str, Member] = {}
        self._lock = threading.Lock()
        self._gone_listeners: list[Callable[[str], None]] = []
        self._stopping: set[str] = set()  # replicas Serve is stopping: draining whatever their heartbeats say

    def on_gone(self, listener: Callable[[str], None]) -> None:
        """`listener(worker_id)` is called once when a worker dies (failed, or its heartbeat expired)."""
        self._gone_listeners.append(listener)

    def report(self, hb: WorkerHeartbeat) -> bool:
        """A worker's heartbeat; False when it is ignored (measured before the failure that killed it)."""
        with self._lock:
            m = self._members.get(hb.worker_id)
            if m is not None and m.failed_at is not None and hb.ts < m.failed_at + FAILED_GRACE_S:
                return False
            state = hb.state if hb.state is not WorkerState.DEAD else WorkerState.ALIVE
            if hb.worker_id in self._stopping and state is WorkerState.ALIVE:
                state = WorkerState.DRAINING
            self._members[hb.worker_id] = Member(hb.worker_id, hb.role, state, hb, self.clock())
        return True

    def worker_failed(self, worker_id: str, at: float | None = None) -> bool:
        """A call to the worker failed because it is gone: dead from now on (until a later heartbeat).
        Returns False if it was dead already."""
        with self._lock:
            m = self._members.get(worker_id)
            if m is None or m.state is WorkerState.DEAD:
                return False
            m.state, m.failed_at = WorkerState.DEAD, at if at is not None else self.wall()
        log.warning("worker %s failed: dropped from routing and /health", worker_id)
        self._gone(worker_id)
        return True

    def stopping(self, worker_ids: set[str]) -> list[str]:
        """The replicas Serve is stopping now: draining from now on (their own heartbeats cannot undo it).
        Returns those that were routable until now."""
        with self._lock:
            self._stopping = set(worker_ids)
            newly = []
            for w in worker_ids:
                m = self._members.get(w)
                if m is not None and m.state is WorkerState.ALIVE:
                    m.state = WorkerState.DRAINING
                    newly.append(w)
        for w in newly:
            log.info("worker %s is being stopped by Serve: draining", w)
        return newly

    def expire(self) -> list[str]:
        """Forgets workers whose last heartbeat is older than the TTL; returns those that were not dead yet."""
        horizon = self.clock() - self.heartbeat_ttl_s
        with self._lock:
            expired = [m for m in self._members.values() if m.reported_at < horizon]
            for m in expired:
                del self._members[m.worker_id]
        newly = [m.worker_id for m in expired if m.state is not WorkerState.DEAD]
        for w in newly:
            self._gone(w)
        return newly

    def _gone(self, worker_id: str) -> None:
        for listener in self._gone_listeners:
            try:
                listener(worker_id)
            except Exception:  # noqa: BLE001 - bookkeeping must not break a report
                log.exception("worker-gone listener failed")

    def get(self, worker_id: str) -> Member | None:
        return self._members.get(worker_id)

    def routable(self, worker_id: str) -> bool:
        m = self._members.get(worker_id)
        return m is not None and m.routable

    def members(self, role: str | None = None, routable: bool = False) -> list[Member]:
        with self._lock:
            ms = list(self._members.values())
        return [m for m in ms if (role is None or m.role == role) and (not routable or m.routable)]

    def snapshot(self) -> MembershipSnapshot:
        with self._lock:
            return MembershipSnapshot(tuple(self._members.values()), self.wall())


@dataclass
class MembershipView:
    """A front end's copy of the registry's membership plus its own, not yet confirmed, failure marks."""

    snapshot: MembershipSnapshot = field(default_factory=MembershipSnapshot)
    _members: dict[str, Member] = field(default_factory=dict)
    _failed: dict[str, float] = field(default_factory=dict)  # worker -> when a call to it failed (wall clock)
    _gone_listeners: list[Callable[[str], None]] = field(default_factory=list)

    def update(self, snapshot: MembershipSnapshot) -> None:
        """The registry's latest; marks it confirms (dead there) or refutes (a later heartbeat) are dropped."""
        before = {w for w, m in self._members.items() if m.routable}
        self.snapshot, self._members = snapshot, snapshot.by_id()
        for w, at in list(self._failed.items()):
            m = self._members.get(w)
            if m is None or m.state is WorkerState.DEAD or m.heartbeat.ts >= at + FAILED_GRACE_S:
                del self._failed[w]
        for w in before - {w for w, m in self._members.items() if m.routable}:
            self._notify(w)

    def on_gone(self, listener: Callable[[str], None]) -> None:
        self._gone_listeners.append(listener)

    def mark_failed(self, worker_id: str, at: float | None = None) -> bool:
        """A call to the worker failed because it is gone: stop routing to it now. False if marked already."""
        if worker_id in self._failed:
            return False
        self._failed[worker_id] = at if at is not None else time.time()
        self._notify(worker_id)
        return True

    def _notify(self, worker_id: str) -> None:
        for listener in self._gone_listeners:
            try:
                listener(worker_id)
            except Exception:  # noqa: BLE001
                log.exception("worker-gone listener failed")

    def routable(self, worker_id: str, heartbeat_ts: float | None = None) -> bool:
        """Alive and taking requests, by the registry and by this front end's own failures; a load measured
        after this front end's failure mark (`heartbeat_ts`) refutes the mark."""
        m = self._members.get(worker_id)
        if m is None or not m.routable:
            return False
        at = self._failed.get(worker_id)
        return at is None or (heartbeat_ts is not None and heartbeat_ts >= at + FAILED_GRACE_S)

    def is_failed(self, worker_id: str) -> bool:
        return worker_id in self._failed or (worker_id in self._members and self._members[worker_id].state is WorkerState.DEAD)

    def role(self, worker_id: str) -> str | None:
        m = self._members.get(worker_id)
        return m.role if m is not None else None

    def live(self, role: str | None = None) -> list[str]:
        return sorted(w for w, m in self._members.items() if (role is None or m.role == role) and self.routable(w))

    def draining(self, role: str | None = None) -> list[str]:
        """Workers the registry says are draining (and not failed here)."""
        return sorted(
            w
            for w, m in self._members.items()
            if m.state is WorkerState.DRAINING and (role is None or m.role == role) and w not in self._failed
        )

    def filter(self, workers: Iterable[str]) -> set[str]:
        return {w for w in workers if self.routable(w)}
