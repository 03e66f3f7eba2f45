"""Worker -> router reporting: each replica's load and KV events, a few times a second.

With the in-memory index (one router), reports go to the router's `Ingress.report`; with a Redis index
the worker writes its events and heartbeat straight to Redis, so any number of routers share them.
"""

from __future__ import annotations

import logging
import threading

from ray import serve

from workers.engine.kv_events import KVEvent

from .config import ClusterConfig

log = logging.getLogger("moray.cluster")

REPORT_INTERVAL_S = 0.1
MAX_PENDING_EVENTS = 200_000
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
        self._sink = None
        if config.kv_index.backend != "memory":
            from .router.publisher import RedisKVEventSink

            self._sink = RedisKVEventSink.from_config(
                config.kv_index, config.router, config.engine.model_name, worker.worker_id, role=worker.role
            )
            self._sink.attach(worker.engine.core.events).start()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._sink is not None:
            self._sink.close()

    def _run(self) -> None:
        while not self._stop.wait(REPORT_INTERVAL_S):
            try:
                self._report_once()
            except Exception as e:  # noqa: BLE001 - the router may be (re)starting; keep trying
                if not self._warned:
                    log.warning("worker %s cannot report to the router yet: %s", self.worker.worker_id, e)
                    self._warned = True

    def _report_once(self) -> None:
        if self._sink is not None:
            from .routing import worker_load

            self._sink.set_load(worker_load(self.worker.load()))
            self._subscription.drain()  # events travel through the sink; only health goes to the router
        else:
            self._pending += self._subscription.drain()
            if len(self._pending) > MAX_PENDING_EVENTS:
                # The router is unreachable for long: drop the backlog; the sequence gap makes the
                # router purge this worker's entries and rebuild from the events that follow.
                self._pending = []
        if self._handle is None:
            self._handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT, self.app_name)
        events = [e.to_dict() for e in self._pending] if self._sink is None else []
        self._handle.report.remote(self.worker.load(), events).result(timeout_s=5)
        self._pending = []  # delivered; on failure they are resent with the next report
        self._warned = False
