"""Worker -> router reporting: each replica's load and KV events, a few times a second.

With the in-memory index (one router), reports go to the router's `Ingress.report`; with a Redis index
the worker writes its events and heartbeat straight to Redis, so any number of routers share them.
"""

from __future__ import annotations

import logging
import threading
import time

from ray import serve

from workers.engine.kv_events import KVEvent

from .config import ClusterConfig

log = logging.getLogger("moray.cluster")

REPORT_INTERVAL_S = 0.1
INGRESS_DEPLOYMENT = "Ingress"


class WorkerReporter:
    def __init__(self, config: ClusterConfig, worker, app_name: str):
        self.config = config
        self.worker = worker
        self.app_name = app_name
        self._subscription = worker.engine.core.events.subscribe()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moray-reporter", daemon=True)
        self._handle = None
        self._pending: list[KVEvent] = []
        self._warned = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(REPORT_INTERVAL_S):
            try:
                self._report_once()
            except Exception as e:  # noqa: BLE001 - the router may be (re)starting; keep trying
                if not self._warned:
                    log.warning("worker %s cannot report to the router yet: %s", self.worker.worker_id, e)
                    self._warned = True

    def _report_once(self) -> None:
        self._pending += self._subscription.drain()
        if self._handle is None:
            self._handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT, self.app_name)
        events = [e.to_dict() for e in self._pending]
        self._handle.report.remote(self.worker.load(), events).result(timeout_s=5)
        self._pending = []  # delivered; on failure they are resent with the next report
        self._warned = False
