"""A front end's token channels: one stream per decode worker, fanned out to the requests it carries.

Each decode worker sends this front end one `TokenDeltaBatch` per engine step on the channel (see
workers/outbox.py); the channel's reader puts each delta on its request's queue. A request subscribes
before it is started, so no delta can arrive before its queue exists.

A channel opens on first use and ends by itself when the worker had nothing of ours to run for a while
(its `closing` batch); the next request opens it again, under a new name (the front end's id and the
channel's number): a start names the channel its request listens on, and a worker refuses one whose
channel has ended, so a request is never started on a newer channel than the one it listens on. A channel that fails (the worker died: its
stream raised, or ended without the `closing` batch) fails every request on it with `ChannelFailed`,
which the pipeline treats as that worker's failure (failover, or a clean error). A channel to a worker
that drains gives each of its requests a `Draining` marker: the request moves to another worker.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import deque
from typing import Callable

from workers.messages import TokenDelta, TokenDeltaBatch

from .handles import DecodePool

log = logging.getLogger("moray.cluster")


class ChannelFailed(Exception):
    """The channel to a decode worker broke; `cause` is why (the worker's death, as Serve reported it)."""

    def __init__(self, worker: str, cause: BaseException):
        super().__init__(f"channel to {worker} failed: {type(cause).__name__}: {cause}")
        self.worker, self.cause = worker, cause


class ChannelIdleClosed(Exception):
    """The worker closed the channel (it had nothing of ours to run) just as a request was about to start on
    it: not a failure, the request opens it again."""


class StreamEndedEarly(Exception):
    """A worker's stream ended before its requests finished (a killed replica's Serve stream sometimes
    just ends instead of raising)."""


class Draining:
    """Queued on a request whose decode worker drains (Serve stops its replica): move the request elsewhere."""

    __slots__ = ("worker",)

    def __init__(self, worker: str):
        self.worker = worker


class RequestTokens:
    """One request's deltas as its channel delivers them, and whatever ends it early (a failure marker)."""

    __slots__ = ("_items", "_waiter", "channel", "until_done")

    def __init__(self, channel: str):
        self.channel = channel  # the name of the channel that delivers them: the request's start names it
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        # Set for a consumer that wants only the whole output (a non-streamed request): deltas then pile up
        # without waking it until the last one, so it costs one wake-up per request, not one per step.
        self.until_done = False

    def put_nowait(self, item) -> None:
        self._items.append(item)
        if self.until_done and isinstance(item, TokenDelta) and not item.finished:
            return
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def take_deltas(self) -> list[TokenDelta]:
        """The deltas queued now, up to anything else (which stays queued)."""
        out = []
        while self._items and isinstance(self._items[0], TokenDelta):
            out.append(self._items.popleft())
        return out


class _Channel:
    def __init__(self, pool: DecodePool, worker: str, name: str, on_end: Callable[["_Channel"], None]):
        self.worker = worker
        self.name = name
        self.subscribers: dict[str, RequestTokens] = {}
        self.opened: asyncio.Future = asyncio.get_running_loop().create_future()
        self.done = False
        self.draining = False  # its requests were told to move: so is every request that subscribes later
        self._on_end = on_end
        self._pool = pool
        self._stream = None
        # A fresh context: opened while serving a request, the channel would be that request's child call,
        # and Serve cancels a request's children when the request ends early (a client that leaves would
        # take the channel, and every other request on it, down).
        self.reader = asyncio.get_running_loop().create_task(self._read(), context=contextvars.Context())

    async def _read(self) -> None:
        error: BaseException = StreamEndedEarly("the channel ended before its requests finished")
        idle = False
        try:
            self._stream = self._pool.channel(self.worker, self.name)
            async for data in self._stream:
                batch = TokenDeltaBatch.decode(data)
                if not self.opened.done():
                    self.opened.set_result(None)
                for delta in batch.deltas:
                    q = self.subscribers.get(delta.request_id)
                    if q is not None:
                        q.put_nowait(delta)
                if batch.closing:
                    idle = True
                    break
        except asyncio.CancelledError:
            error = StreamEndedEarly("the channel was closed by this front end")
            raise
        except Exception as e:  # noqa: BLE001 - the worker's death as Serve reports it
            error = e
        finally:
            self.done = True
            self._on_end(self)
            if not self.opened.done():
                self.opened.set_exception(ChannelFailed(self.worker, error))
                self.opened.exception()  # retrieved: nobody may be waiting any more
            # After `closing` only requests still starting can be here: they open the channel again.
            failure = ChannelIdleClosed() if idle else ChannelFailed(self.worker, error)
            for q in self.subscribers.values():
                q.put_nowait(failure)

    def drain(self) -> None:
        """Tells every request on the channel (once each) to move to another worker."""
        if self.draining:
            return
        self.draining = True
        for q in self.subscribers.values():
            q.put_nowait(Draining(self.worker))

    def close(self) -> None:
        self.reader.cancel()
        if self._stream is not None:
            self._stream.cancel()


class DecodeChannels:
    def __init__(self, pool: DecodePool, channel_id: str):
        self.pool = pool
        self.channel_id = channel_id  # this front-end replica: what the workers know it by
        self._channels: dict[str, _Channel] = {}
        self._opened = 0  # channels opened so far: the next one's number

    async def subscribe(self, worker: str, request_id: str) -> RequestTokens:
        """A queue that gets the request's deltas (and a `ChannelFailed` if the channel breaks), once the
        channel to `worker` is open. Raises `ChannelFailed` when it cannot be opened."""
        while True:
            channel = self._channels.get(worker)
            if channel is None or channel.done:
                # A new name for each: a start sent for the channel that ended must not begin on this one
                # (its request listens on the old one, which told it the channel closed: it would start again).
                self._opened += 1
                name = f"{self.channel_id}.{self._opened}"
                channel = self._channels[worker] = _Channel(self.pool, worker, name, self._ended)
            await asyncio.shield(channel.opened)
            if not channel.done:  # it may have ended (idle) in the meantime: then open it again
                tokens = channel.subscribers[request_id] = RequestTokens(channel.name)
                if channel.draining:  # routed here just before the drain was known
                    tokens.put_nowait(Draining(worker))
                return tokens

    async def refused(self, worker: str, name: str, timeout_s: float = 5.0) -> None:
        """The worker refused a start on the channel `name`: it closed it (idle), its `closing` batch on the
        way. Waits for that batch so that the next `subscribe` opens a new channel; without the wait every
        retry subscribed to the stale one, was refused at once, and the request failed after a few (seen in a
        full run under load). A batch that does not come within `timeout_s` ends the channel from this side.
        A newer channel to the worker (opened meanwhile by another request) is left alone."""
        channel = self._channels.get(worker)
        if channel is None or channel.done or channel.name != name:
            return
        await asyncio.wait({channel.reader}, timeout=timeout_s)  # not cancelled on a timeout
        if not channel.done:
            channel.close()
            await asyncio.wait({channel.reader})

    def unsubscribe(self, worker: str, request_id: str) -> None:
        channel = self._channels.get(worker)
        if channel is not None:
            channel.subscribers.pop(request_id, None)
            if channel.draining and not channel.subscribers:
                # The last request moved off a draining worker: end the channel now (a replica Serve stops
                # waits for its open calls), not at the worker's idle close.
                channel.close()

    def drain(self, worker: str) -> None:
        """The worker drains: the requests this front end runs on it move elsewhere."""
        channel = self._channels.get(worker)
        if channel is not None and not channel.done:
            channel.drain()

    def _ended(self, channel: _Channel) -> None:
        if self._channels.get(channel.worker) is channel:
            del self._channels[channel.worker]

    def close(self) -> None:
        for channel in list(self._channels.values()):
            channel.close()

    def open_workers(self) -> list[str]:
        return sorted(self._channels)
