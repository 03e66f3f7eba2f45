"""Worker -> membership registry reporting: each replica's heartbeat and KV events, a few times a second.

A worker looks every `REPORT_INTERVAL_S` but sends only when something changed (KV events, or its heartbeat
other than its timestamp), and otherwise one keep-alive per `keepalive_s` (at most a quarter of the
heartbeat TTL). An idle cluster therefore costs the registry a report per worker per second, not ten:
with 4 idle tiny workers on 2 cores, the registry took 0.135 of a core and each worker 0.05 answering
and sending 40 reports a second that said nothing new.

Reports go to the `Registry` deployment (cluster/registry.py), never through the front end that serves
clients. With a Redis index the worker also writes its events and heartbeat to Redis itself (any number of
routers read them there) and its reports to the registry carry the heartbeat only.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from ray import serve

from workers.messages import KVEvent

from .config import ClusterConfig
from .handles import RegistryClient
from .registry import REGISTRY_DEPLOYMENT
from .router.types import WorkerLoad

log = logging.getLogger("moray.cluster")

REPORT_INTERVAL_S = 0.1
KEEPALIVE_S = 1.0  # an unchanged heartbeat is sent at least this often (and at least 4 times per TTL)
MAX_PENDING_EVENTS = 200_000


class WorkerReporter:
    def __init__(self, config: ClusterConfig, worker, app_name: str):
        self.config = config
        self.worker = worker
        self.app_name = app_name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moray-reporter", daemon=True)
        self._registry: RegistryClient | None = None
        self._pending: list[KVEvent] = []
        self._warned = False
        self._sink = None
        self.keepalive_s = min(KEEPALIVE_S, config.router.heartbeat_ttl_s / 4)
        self._last_sent: tuple | None = None  # (the heartbeat without its timestamp, when it was sent)
        if config.kv_index.backend != "memory":
            from .router.publisher import RedisKVEventSink

            self._sink = RedisKVEventSink.from_config(
                config.kv_index, config.router, config.engine.model_name, worker.worker_id, role=worker.role
            )
            self._sink.attach(worker.kv_events()).start()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._sink is not None:
            self._sink.close()

    def _run(self) -> None:
        while not self._stop.wait(REPORT_INTERVAL_S):
            try:
                self.report_once()
            except Exception as e:  # noqa: BLE001 - the registry may be (re)starting; keep trying
                if not self._warned:
                    log.warning("worker %s cannot report to the membership registry yet: %s", self.worker.worker_id, e)
                    self._warned = True

    def report_once(self) -> bool:
        """Sends the worker's report if it says something new or the keep-alive is due; True if it sent."""
        report = self.worker.report(with_events=self._sink is None)
        if self._sink is not None:
            self._sink.set_load(WorkerLoad.from_heartbeat(report.heartbeat))
        else:
            self._pending += report.events
            if len(self._pending) > MAX_PENDING_EVENTS:
                # The registry is unreachable for long: drop the backlog; the sequence gap makes the index
                # purge this worker's entries and rebuild from the events that follow.
                self._pending = []
            report.events = self._pending
        state = dataclasses.replace(report.heartbeat, ts=0.0)
        now = time.monotonic()
        if not report.events and self._last_sent is not None:
            last_state, sent_at = self._last_sent
            if state == last_state and now - sent_at < self.keepalive_s:
                return False
        if self._registry is None:
            self._registry = RegistryClient(serve.get_deployment_handle(REGISTRY_DEPLOYMENT, self.app_name))
        self._registry.report_sync(report, timeout_s=5)
        self._last_sent = (state, now)
        self._pending = []  # delivered; on failure they are resent with the next report
        self._warned = False
        return True
