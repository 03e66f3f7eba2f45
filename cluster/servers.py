"""Serve deployments for the worker pools: each replica is one engine (a `workers.worker` class).

A replica's worker id is its Serve replica id, so the router's choice can be honoured by
`targeting.TargetedRequestRouter`. Every replica reports its heartbeat and KV events to the membership
registry (`cluster/registry.py`) a few times a second (and its events straight to Redis when the cluster
uses a Redis index). What the methods take and return are the messages of `workers/messages.py`; the front
end calls them through `cluster/handles.py`.
"""

from __future__ import annotations

import asyncio
import logging

import ray
from ray import serve

from workers.messages import DecodeRequest, PrefillHandoff, PrefillRequest, TokenDelta
from workers.worker import DecodeWorker, EngineWorker, PrefillWorker

from . import logs, tracing
from .config import ClusterConfig, parse_cluster_config
from .direct_stream import StreamServer
from .handles import PrefillPool, WrongReplica, detached
from .reporting import WorkerReporter

log = logging.getLogger("moray.cluster")


class _WorkerServer:
    pool: str

    def _start(self, cluster_config: dict, make_worker):
        self.config: ClusterConfig = parse_cluster_config(cluster_config)
        logs.configure(self.config.observability)
        tracing.configure(self.config.observability, self.pool)
        context = serve.get_replica_context()
        self.worker_id = context.replica_id.unique_id
        engine_config = self.config.engine_for(self.pool, self.worker_id)
        pool = getattr(self.config, self.pool)
        log.info("%s replica %s: loading %s", self.pool, self.worker_id, engine_config.model)
        self.followers = None
        engine = None
        if pool.hosts_per_replica > 1:
            from .multihost import start_multihost_engine

            kv_transfer = self.config.kv_transfer if self.pool == "prefill" else None
            engine, self.followers = start_multihost_engine(engine_config, pool, kv_transfer)
        self.worker: EngineWorker = make_worker(engine_config, engine)
        self.reporter = WorkerReporter(self.config, self.worker, context.app_name)
        self.reporter.start()

    async def check_health(self) -> None:
        """Serve's health probe: a dead engine thread marks the replica unhealthy (it is replaced)."""
        self.worker.engine.check_health()
        if self.followers is not None:
            await self.followers.acheck()  # every host of a multi-host replica must be alive

    async def heartbeat(self, target_replica: str | None = None):
        """This replica's heartbeat now (what it reports to the registry; for operators and tests)."""
        return self.worker.heartbeat()

    async def drain(self, target_replica: str | None = None) -> None:
        """Takes no new requests from now on: its heartbeats say `draining`, the registry tells the front ends,
        and they move the streams it runs to other replicas (those that may not move finish here). Serve's
        own stops (scale-down, redeploy) drain a replica the same way: the registry sees them (registry.py)."""
        if not self._arrived(target_replica):
            raise WrongReplica(f"drain for {target_replica} reached {self.worker_id}")
        self.worker.drain()

    async def rebalance_experts(self, wait: bool = False, target_replica: str | None = None) -> bool:
        """The manual trigger of expert load balancing (`engine.eplb`): a placement from the loads since the
        last one, swapped in between two steps (before returning with `wait`), on every host of a multi-host
        replica at the same step. False when balancing is off or a placement is already being computed."""
        if not self._arrived(target_replica):
            raise WrongReplica(f"rebalance_experts for {target_replica} reached {self.worker_id}")
        return await self.worker.engine.call(lambda core: core.rebalance_experts(wait))

    def _arrived(self, target_replica: str | None) -> bool:
        """Counts calls meant for another replica (Serve fell back: the target was gone or full)."""
        if target_replica and target_replica != self.worker_id:
            self.worker.counters.misrouted += 1
            return False
        return True

    def __del__(self):
        try:
            streams = getattr(self, "streams", None)
            if streams is not None:
                streams.close()
            self.reporter.stop()
            self.worker.engine.shutdown()
            if self.followers is not None:
                self.followers.shutdown()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass


class PrefillServer(_WorkerServer):
    pool = "prefill"

    def __init__(self, cluster_config: dict):
        self._start(cluster_config, self._make_worker)

    def _make_worker(self, engine_config, engine) -> PrefillWorker:
        t = self.config.kv_transfer
        return PrefillWorker(
            engine_config,
            hold_timeout_s=t.hold_timeout_s,
            transport=t.build_transport(),
            chunk_bytes=int(t.chunk_mib * (1 << 20)),
            peers=self.followers,  # a replica over several hosts: each host exports its part
            engine=engine,
        )

    async def prefill(self, request: PrefillRequest, target_replica: str | None = None) -> PrefillHandoff:
        self._arrived(target_replica)
        logs.current_request_id.set(request.request_id)
        attributes = {"moray.request_id": request.request_id, "moray.worker": self.worker_id, "moray.prompt_tokens": len(request.prompt)}
        with tracing.span("prefill", tracing.extract(request.trace_context), attributes) as span:
            handoff = await self.worker.prefill(request)
            tracing.set_attributes(span, {"moray.cached_tokens": handoff.first.num_cached_tokens, "moray.finished": handoff.first.finished})
        return handoff

    async def release(self, request_id: str, target_replica: str | None = None) -> bool:
        if not self._arrived(target_replica):  # another replica's hold (a retried prefill may be held here)
            return False
        return await self.worker.release(request_id)


class DecodeServer(_WorkerServer):
    pool = "decode"

    def __init__(self, cluster_config: dict, prefill_handle=None):
        self.prefill = PrefillPool(prefill_handle) if prefill_handle is not None else None
        self._start(
            cluster_config,
            lambda cfg, engine: DecodeWorker(
                cfg,
                stream_interval_s=self.config.stream_interval_ms / 1000,
                transport=self.config.kv_transfer.build_transport(),
                chunks_in_flight=self.config.kv_transfer.chunks_in_flight,
                handoff_timeout_s=self.config.kv_transfer.timeout_s,
                engine=engine,
            ),
        )
        if self.config.stream_transport == "direct":
            self.serve_direct(ray.util.get_node_ip_address())

    async def channel(self, channel_id: str, direct: bool = False, target_replica: str | None = None):
        """The front end `channel_id`'s stream of `TokenDeltaBatch`es, encoded (workers/outbox.py). `direct`:
        the front end would rather take them over a connection of its own; a replica with a stream server
        then yields one `StreamOffer` and holds the call open, as the channel's lease, until the channel ends
        (cluster/direct_stream.py)."""
        if not self._arrived(target_replica):
            raise WrongReplica(f"channel for {target_replica} reached {self.worker_id}")
        streams: StreamServer | None = getattr(self, "streams", None)
        if direct and streams is not None:
            offer, held = await streams.offer(channel_id)
            try:
                yield offer
                await streams.hold(held)
            finally:
                streams.withdraw(held)
            return
        async for batch in self.worker.channel(channel_id):
            yield batch.encode()

    def serve_direct(self, host: str) -> None:
        """Offers direct channels from a socket on `host` (the node's address; started on first use)."""
        self.streams = StreamServer(host, self.worker.channel, self._start_all, self.worker.abort)

    async def start_batch(self, requests: list[DecodeRequest], target_replica: str | None = None) -> list[BaseException | None]:
        """Starts requests (one front end's, sent together); their deltas go out on their channel. Returns,
        once the engine took them, what each came to: None, or why it did not start (a `ValueError` for a
        request the engine refuses, `ChannelClosed` when its channel is not open here)."""
        if not self._arrived(target_replica):
            raise WrongReplica(f"request for {target_replica} reached {self.worker_id}")
        return await self._start_all(requests)

    async def _start_all(self, requests: list[DecodeRequest]) -> list[BaseException | None]:
        results = await asyncio.gather(*(self._start_one(request) for request in requests), return_exceptions=True)
        return [_start_outcome(r) for r in results]

    async def _start_one(self, request: DecodeRequest) -> None:
        logs.current_request_id.set(request.request_id)
        span = self._decode_span(request)
        release = None
        if request.handoff is not None:
            release = self._release_for(request.request_id, request.handoff)
        await self.worker.start(
            request,
            release=release,
            on_end=lambda last, error: _end_decode_span(span, last, error),
            on_import=lambda stats, seconds, error: tracing.handoff_span(
                span, seconds, stats.bytes, stats.chunks, stats.skipped_bytes, error
            ),
        )

    async def abort(self, request_id: str, target_replica: str | None = None) -> None:
        # Only on the replica it was meant for: Serve sends a call for a replica it is stopping to another
        # one, where the same request may run now (it moved there when this one began draining).
        if self._arrived(target_replica):
            self.worker.abort(request_id)

    def _release_for(self, request_id: str, handoff: PrefillHandoff):
        source = handoff.worker_id

        def release():
            # Outside this request's context: it runs exactly when this request is being cancelled, and
            # Serve cancels a cancelled request's child calls (the prefill side would keep the KV).
            return detached(lambda: self.prefill.release(source, request_id))

        return release

    def _decode_span(self, request: DecodeRequest):
        attributes = {
            "moray.request_id": request.request_id,
            "moray.worker": self.worker_id,
            "moray.prompt_tokens": len(request.prompt),
            "moray.remote_prefill": request.handoff is not None,
        }
        return tracing.start_span("decode", tracing.extract(request.trace_context), attributes)


def _start_outcome(result) -> Exception | None:
    """What one start of a batch came to, as the front end gets it: None (started) or an exception. A start
    cancelled on its own (not the whole call) did not start either: it must not read as started."""
    if isinstance(result, Exception):
        return result
    if isinstance(result, BaseException):
        return RuntimeError(f"the start was interrupted: {type(result).__name__}")
    return None


def _end_decode_span(span, last: TokenDelta | None, error: BaseException | None) -> None:
    """The decode span (None: tracing off) ends with the request: tokens generated and finish reason."""
    if span is None:
        return
    done = {} if last is None else {"moray.completion_tokens": last.num_output_tokens, "moray.cached_tokens": last.num_cached_tokens}
    tracing.end_span(span, {**done, "moray.finish_reason": last.finish_reason if last else None}, error=error)
