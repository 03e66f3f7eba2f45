"""A decode worker's channel to a front end over its own TCP connection, off Serve's per-call path.

Over Serve, every token batch of a channel is one item of a streaming call and every batch of starts is a
call of its own: each costs both sides milliseconds of CPU in Ray's threads, and a start waits ~15-40 ms for
its round trip under load (measured at concurrency 64 on the tiny model, where the device step is ~3 ms).
vLLM's API server talks to its engine core over a socket for the same reason.

What stays on Serve is what Serve is good at: finding the replica and owning its lifetime. The front end
opens a channel with the same Serve streaming call as before, asking for a direct stream; a worker that has
one answers with a `StreamOffer` (its address and a one-time token) and keeps the call open, without
sending anything more, until the channel ends. That call is the channel's lease: a replica Serve stops
waits for it as it waits for any call (so draining moves streams exactly as before), and a replica that dies
fails it. The token batches, starts, their answers and aborts then go over the connection, in order, as
frames. A worker without a direct stream (or a front end that cannot connect) uses the Serve stream itself:
nothing else changes.

Frames: a 4-byte length, a 1-byte kind, the payload. The connection's first frame must be the offer's token;
nothing from a peer is unpickled before that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import secrets
import struct
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from workers.messages import DecodeRequest, StreamOffer
from workers.outbox import ChannelClosed

log = logging.getLogger("moray.cluster")

HELLO, BATCH, STARTS, RESULTS, ABORT, ERROR = b"H", b"B", b"S", b"R", b"A", b"E"
_HEADER = struct.Struct("!Ic")
_MAX_FRAME = 256 << 20  # a batch of deltas or starts is far smaller: anything larger is not our peer
_HELLO_TIMEOUT_S = 10.0
_OFFER_TTL_S = 30.0  # an offer the front end did not take within this (it died meanwhile) ends its lease


class ConnectionLost(ConnectionError):
    """A channel's connection broke (the worker's process died, or the network between): the worker is gone
    for this front end, as a Serve call's `RayActorError` says."""

    def __init__(self, worker: str, cause: BaseException | str):
        super().__init__(f"the connection to {worker} broke: {cause}")
        self.worker = worker


def write_frame(writer: asyncio.StreamWriter, kind: bytes, payload: bytes) -> None:
    writer.write(_HEADER.pack(len(payload), kind) + payload)


async def read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """The next frame, or None at a clean end of the stream (EOF between frames)."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ConnectionError("the peer closed the connection inside a frame") from None
        return None
    size, kind = _HEADER.unpack(header)
    if size > _MAX_FRAME:
        raise ConnectionError(f"a frame of {size} bytes: not a Moray peer")
    try:
        return kind, await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ConnectionError("the peer closed the connection inside a frame") from None


# ============================================================================ the decode worker's side


@dataclass
class _Offer:
    channel_id: str
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    connection: asyncio.Task | None = None


class StreamServer:
    """A decode replica's listening socket (started on first use, on the replica's event loop) and the
    connections of its channels. `channel(channel_id)` is the worker's batch stream of one channel,
    `start_batch(requests)` its starts (what each came to), `abort(request_id)` its aborts."""

    def __init__(self, host: str, channel, start_batch: Callable[[list[DecodeRequest]], Awaitable[list]], abort: Callable[[str], None]):
        self.host = host
        self._channel = channel
        self._start_batch = start_batch
        self._abort = abort
        self._server: asyncio.Server | None = None
        self._offers: dict[bytes, _Offer] = {}
        self._starting: asyncio.Future | None = None

    async def offer(self, channel_id: str) -> tuple[StreamOffer, _Offer]:
        """An offer for the channel (for the front end), and what its lease holds on to."""
        await self._ensure_started()
        token = secrets.token_bytes(16)
        offer = self._offers[token] = _Offer(channel_id)
        port = self._server.sockets[0].getsockname()[1]
        return StreamOffer(self.host, port, token), offer

    async def hold(self, offer: _Offer) -> None:
        """The lease: returns when the channel's connection ended, or at once if the front end did not
        connect within `_OFFER_TTL_S` (it died meanwhile: a lease must not hold a stopping replica forever)."""
        try:
            await asyncio.wait_for(offer.connected.wait(), _OFFER_TTL_S)
        except TimeoutError:
            self.withdraw(offer)
        await offer.ended.wait()

    def withdraw(self, offer: _Offer) -> None:
        """The lease is gone (the front end cancelled it, or the replica stops): end its connection too."""
        if offer.connection is not None:
            offer.connection.cancel()
            return
        self._offers = {t: o for t, o in self._offers.items() if o is not offer}
        offer.ended.set()

    async def _ensure_started(self) -> None:
        if self._server is not None:
            return
        if self._starting is None:
            self._starting = asyncio.ensure_future(asyncio.start_server(self._serve, self.host, 0))
        self._server = await asyncio.shield(self._starting)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        offer = None
        try:
            try:
                hello = await asyncio.wait_for(read_frame(reader), _HELLO_TIMEOUT_S)
            except (TimeoutError, ConnectionError, OSError):
                return
            if hello is None or hello[0] != HELLO:
                return
            offer = self._offers.get(hello[1])
            if offer is None or offer.connection is not None:
                return  # an unknown or used token: not the front end the offer went to
            offer.connection = asyncio.current_task()
            offer.connected.set()
            await self._run(offer.channel_id, reader, writer)
        except asyncio.CancelledError:
            pass  # the lease ended: close the connection
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)  # the last frames are out before the lease ends
            if offer is not None and offer.connection is asyncio.current_task():
                self._offers = {t: o for t, o in self._offers.items() if o is not offer}
                offer.ended.set()

    async def _run(self, channel_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Sends the channel's batches and serves the front end's starts and aborts until either side ends.
        The front end going away ends the channel, which aborts its requests (as a cancelled Serve stream
        does)."""
        sender = asyncio.ensure_future(self._send(channel_id, writer))
        receiver = asyncio.ensure_future(self._receive(reader, writer))
        try:
            await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (receiver, sender):
                task.cancel()
            await asyncio.gather(sender, receiver, return_exceptions=True)

    async def _send(self, channel_id: str, writer: asyncio.StreamWriter) -> None:
        batches = self._channel(channel_id)
        try:
            async for batch in batches:
                write_frame(writer, BATCH, batch.encode())
                await writer.drain()
        except asyncio.CancelledError:
            raise
        except (ConnectionError, OSError):
            return  # the front end went away
        except Exception as e:  # noqa: BLE001 - the engine died: the front end fails the channel with it
            with contextlib.suppress(Exception):
                write_frame(writer, ERROR, _pickled_error(e))
                await writer.drain()
        finally:
            await batches.aclose()

    async def _receive(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        starts: set[asyncio.Task] = set()
        try:
            while True:
                frame = await read_frame(reader)
                if frame is None:
                    return
                kind, payload = frame
                if kind == STARTS:
                    seq, requests = pickle.loads(payload)
                    task = asyncio.ensure_future(self._answer(seq, requests, writer))
                    starts.add(task)
                    task.add_done_callback(starts.discard)
                elif kind == ABORT:
                    self._abort(payload.decode())
        except (ConnectionError, OSError):
            return  # the front end went away
        except Exception:  # noqa: BLE001 - a frame that does not parse: end the channel, keep the replica
            log.warning("a direct channel's frame did not parse: closing the channel", exc_info=True)
            return
        finally:
            for task in starts:
                task.cancel()

    async def _answer(self, seq: int, requests: list[DecodeRequest], writer: asyncio.StreamWriter) -> None:
        try:
            results = await self._start_batch(requests)
        except Exception as e:  # noqa: BLE001 - the whole batch failed: every request did
            results = [e] * len(requests)
        with contextlib.suppress(ConnectionError, OSError):
            write_frame(writer, RESULTS, pickle.dumps((seq, [_picklable(r) for r in results]), protocol=pickle.HIGHEST_PROTOCOL))
            await writer.drain()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


def _picklable(error: BaseException | None) -> BaseException | None:
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - an exception that does not travel: its type and text do
        return RuntimeError(f"{type(error).__name__}: {error}")


def _pickled_error(error: BaseException) -> bytes:
    return pickle.dumps(_picklable(error), protocol=pickle.HIGHEST_PROTOCOL)


# ============================================================================ the front end's side


_END = object()  # queued after a channel's last batch


class DirectChannel:
    """The front end's end of one channel's connection: an async iterator of encoded token batches, as a
    Serve stream is (it ends at EOF; a batch with `closing` comes first when the worker ended it cleanly),
    plus the channel's starts and aborts. `lease` is the Serve call that made the offer. The connection is
    read by a task of its own, to its end: answers to starts still arrive after the consumer stopped at the
    `closing` batch."""

    def __init__(
        self, worker: str, name: str, lease, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_close: Callable[[], None]
    ):
        self.worker, self.name = worker, name
        self._lease = lease
        self._reader, self._writer = reader, writer
        self._batches: asyncio.Queue = asyncio.Queue()
        self._answers: dict[int, asyncio.Future] = {}
        self._seq = 0
        self._on_close = on_close
        self.starts = None  # the pool's batches of starts over `start_batch` (cluster/handles.py)
        self._error: BaseException | None = None
        self.closed = False
        self._reading = asyncio.ensure_future(self._read())
        # The lease's end: a replica that died fails it (its socket may take longer to say so).
        self._watch = asyncio.ensure_future(self._watch_lease())

    @classmethod
    async def connect(cls, worker: str, name: str, lease, offer: StreamOffer, on_close: Callable[[], None]) -> DirectChannel:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(offer.host, offer.port), _HELLO_TIMEOUT_S)
        write_frame(writer, HELLO, offer.token)
        return cls(worker, name, lease, reader, writer, on_close)

    async def _watch_lease(self) -> None:
        try:
            async for _ in self._lease:
                pass
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the replica's death as Serve reports it
            self._error = self._error or e
            self._writer.close()  # its socket may not say so for a while

    async def _read(self) -> None:
        error = None
        try:
            while True:
                frame = await read_frame(self._reader)
                if frame is None:
                    return
                kind, payload = frame
                if kind == BATCH:
                    self._batches.put_nowait(payload)
                elif kind == RESULTS:
                    seq, results = pickle.loads(payload)
                    answer = self._answers.pop(seq, None)
                    if answer is not None and not answer.done():
                        answer.set_result(results)
                elif kind == ERROR:
                    error = pickle.loads(payload)
                    return
        except (ConnectionError, OSError) as e:
            error = ConnectionLost(self.worker, e)
        finally:
            self._end(error)

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        item = await self._batches.get()
        if item is _END:
            self._batches.put_nowait(_END)  # for any later call too
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        return item

    async def start_batch(self, requests: list[DecodeRequest]) -> list[BaseException | None]:
        """What each start came to (None: started), as `DecodeServer.start_batch` answers over Serve."""
        if self.closed:
            raise self._refusal()
        self._seq += 1
        answer = self._answers[self._seq] = asyncio.get_running_loop().create_future()
        write_frame(self._writer, STARTS, pickle.dumps((self._seq, requests), protocol=pickle.HIGHEST_PROTOCOL))
        return await answer

    def abort(self, request_id: str) -> None:
        if not self.closed:
            write_frame(self._writer, ABORT, request_id.encode())

    def _refusal(self) -> BaseException:
        """What a start the channel can no longer take gets. A channel the worker ended itself (idle: its
        `closing` batch came) refuses it as the worker refuses a start on a closed channel, so the front end
        opens the channel again; a broken one with why it broke (the worker is gone)."""
        if self._error is not None:
            return self._error
        return ChannelClosed(f"channel {self.name!r} to {self.worker} is closed")

    def _end(self, error: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._error = self._error or error
        for answer in self._answers.values():
            if not answer.done():
                answer.set_exception(self._refusal())
                answer.exception()  # retrieved: its caller may have left
        self._answers.clear()
        self._batches.put_nowait(_END)
        self._writer.close()
        self._on_close()

    def cancel(self) -> None:
        """This front end closes the channel (as cancelling a Serve stream does): the worker aborts its
        requests."""
        self._end(None)
        self._reading.cancel()
        self._watch.cancel()
        self._lease.cancel()
