"""Typed wrappers for the Serve handles: every call one process of the cluster makes on another.

A deployment method is named in exactly one place, here, with the message types it takes and returns
(`workers/messages.py`); `tests/test_messages.py` checks every name and keyword against the deployment
classes, so a renamed method or argument fails a test instead of a request.

    PrefillPool   front end -> PrefillServer   prefill, release; decode worker -> PrefillServer: kv_chunk
    DecodePool    front end -> DecodeServer    channel (stream), start, abort
    RegistryClient workers, front ends -> Registry   report, worker_failed, changes, follow (stream), metrics

Calls to a worker carry `target_replica` (the router's choice, honoured by `cluster.targeting`).
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Awaitable, Callable, TypeVar

from workers.messages import DecodeRequest, KVChunk, PrefillHandoff, PrefillRequest, TokenDeltaBatch, WorkerReport

from .targeting import TARGET_KWARG

T = TypeVar("T")

# deployment -> the methods called on it (checked against the classes by tests/test_messages.py)
CALLS = {
    "PrefillServer": ("prefill", "kv_chunk", "release"),
    "DecodeServer": ("channel", "start", "abort"),
    "Registry": ("report", "worker_failed", "changes", "follow", "metrics"),
}


class WrongReplica(RuntimeError):
    """A call meant for another replica reached this one (Serve fell back because the target is gone): for a
    channel or a decode request that is the target's failure, not a request this replica may take."""


async def _cancellable(response) -> Any:
    """Awaits a Serve response; if our caller is cancelled, the replica-side call is cancelled too."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise


def detached(call: Callable[[], Awaitable[T]]) -> asyncio.Future:
    """Makes a Serve call in a fresh context, so that it is no child of the request being served (Serve
    cancels those when that request is cancelled: a release or abort sent while a client leaves must get
    through); kept alive and shielded from our own caller's cancellation."""

    async def run() -> T:
        return await call()

    task = asyncio.get_running_loop().create_task(run(), context=contextvars.Context())
    _detached_tasks.add(task)
    task.add_done_callback(_detached_tasks.discard)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure here is not worth a warning
    return asyncio.shield(task)


_detached_tasks: set[asyncio.Task] = set()


class PrefillPool:
    def __init__(self, handle):
        self._handle = handle

    async def prefill(self, worker: str, request: PrefillRequest) -> PrefillHandoff:
        return await _cancellable(self._handle.prefill.remote(request, **{TARGET_KWARG: worker}))

    async def kv_chunk(self, worker: str, request_id: str, unit_start: int, unit_end: int) -> KVChunk:
        return await self._handle.kv_chunk.remote(request_id, unit_start, unit_end, **{TARGET_KWARG: worker})

    async def release(self, worker: str, request_id: str) -> bool:
        return await self._handle.release.remote(request_id, **{TARGET_KWARG: worker})


class DecodePool:
    def __init__(self, handle):
        self._handle = handle

    def channel(self, worker: str, channel_id: str):
        """The worker's stream of encoded `TokenDeltaBatch`es for this front end (async iterator; `.cancel()`)."""
        return self._handle.options(stream=True).channel.remote(channel_id, **{TARGET_KWARG: worker})

    async def start(self, worker: str, request: DecodeRequest) -> None:
        await _cancellable(self._handle.start.remote(request, **{TARGET_KWARG: worker}))

    async def abort(self, worker: str, request_id: str) -> None:
        await self._handle.abort.remote(request_id, **{TARGET_KWARG: worker})


class RegistryClient:
    """The membership registry's methods. Async ones for event-loop callers; `report_sync` blocks (the
    workers' reporter thread)."""

    def __init__(self, handle):
        self._handle = handle

    async def report(self, report: WorkerReport) -> None:
        await self._handle.report.remote(report)

    def report_sync(self, report: WorkerReport, timeout_s: float = 5.0) -> None:
        self._handle.report.remote(report).result(timeout_s=timeout_s)

    async def worker_failed(self, worker: str, at: float) -> None:
        await self._handle.worker_failed.remote(worker, at)

    async def changes(self, cursor: tuple[str, int] | None, wait_s: float):
        """What changed since `cursor` (`registry.RegistryChanges`), waiting up to `wait_s` for something."""
        return await self._handle.changes.remote(cursor, wait_s)

    def follow(self, cursor: tuple[str, int] | None, min_interval_s: float):
        """The changes as they happen (an async iterator of `registry.RegistryChanges`; `.cancel()`)."""
        return self._handle.options(stream=True).follow.remote(cursor, min_interval_s)

    async def metrics(self) -> bytes:
        return await self._handle.metrics.remote()


__all__ = ["CALLS", "DecodePool", "PrefillPool", "RegistryClient", "TokenDeltaBatch", "WrongReplica", "detached"]
