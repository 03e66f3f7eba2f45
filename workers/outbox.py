"""A decode worker's channel to one front end: its requests' deltas, batched per engine step.

The engine hands a step's deltas to the event loop at once (`AsyncEngine._dispatch`); each lands in its
channel's outbox, and the channel's stream takes everything that arrived since its last batch as one
`TokenDeltaBatch`. At concurrency 64 that is one message per step instead of 64: the cost of streaming
stops growing with the number of requests. Batches are at least `min_interval_s` apart (the cluster's
`stream_interval_ms`): on a device whose steps take a few milliseconds, several steps' deltas go together
and the message rate stays bounded; a step longer than the interval is one batch, sent at once. A request's
first token and its end are not held back (vLLM's stream interval spares them too): the first is its time to
first token, and the end is when a closed-loop client sends its next request, which the engine would
otherwise wait for with a slot free.

A channel is open while its stream is read. It ends by itself, after a `closing` batch, once it has had
no running request for `linger_s` (so a draining replica has nothing open and shuts down as soon as its
requests are done); the front end opens it again for its next request (`ChannelClosed` tells it to).
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable

from workers.messages import TokenDelta, TokenDeltaBatch


class ChannelClosed(RuntimeError):
    """The request names a channel that is not open on this worker: the front end opens it and retries."""


class Outbox:
    def __init__(self, worker_id: str, linger_s: float, has_requests: Callable[[], bool], min_interval_s: float = 0.0):
        self.worker_id = worker_id
        self.linger_s = linger_s
        self.min_interval_s = min_interval_s
        self._sent_at = 0.0
        self._has_requests = has_requests
        self._pending: list[TokenDelta] = []
        self._urgent = False  # a pending delta is a first token or an end: its batch leaves without waiting
        self._error: BaseException | None = None
        self._wake = asyncio.Event()
        self.closed = False

    def put(self, item: TokenDelta | BaseException) -> None:
        """A delta of one of this channel's requests, or an error that ends the channel (the engine died)."""
        if isinstance(item, BaseException):
            self._error = item
        else:
            self._pending.append(item)
            if item.finish_reason is not None or item.num_output_tokens == len(item.token_ids):
                self._urgent = True
        self._wake.set()

    def request_ended(self) -> None:
        self._wake.set()  # may start the linger

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    async def _hold_back(self) -> None:
        """Waits out the interval since the last batch (what arrives meanwhile goes in the same batch), unless
        a first token or an end arrives, or the channel closes."""
        while not self._urgent and not self.closed:
            wait = self._sent_at + self.min_interval_s - time.monotonic()
            if wait <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except TimeoutError:
                return

    async def batches(self) -> AsyncIterator[TokenDeltaBatch]:
        yield TokenDeltaBatch(self.worker_id, [])  # the handshake: open, requests may start on it
        while True:
            self._wake.clear()  # one event loop: nothing can arrive between the checks below and the wait
            if self._error is not None:
                raise self._error
            if self._pending:
                await self._hold_back()
                batch, self._pending, self._urgent = self._pending, [], False
                self._sent_at = time.monotonic()
                yield TokenDeltaBatch(self.worker_id, batch)
                continue
            if self.closed:
                return
            if self._has_requests():
                await self._wake.wait()
                continue
            try:  # idle: anything within linger_s keeps it open
                await asyncio.wait_for(self._wake.wait(), self.linger_s)
            except TimeoutError:
                if not self._pending and not self._has_requests():
                    self.closed = True  # no request can start on it from now on
                    yield TokenDeltaBatch(self.worker_id, [], closing=True)
                    return
