"""Direct channels (cluster/direct_stream.py): a decode worker's token batches, starts and aborts over a
connection of their own, with Serve's call kept as the lease. The real front end and the real
`DecodeServer` over fake workers, on real loopback sockets; the failure cases run over both transports in
test_failover.py, and every real-Ray test runs on direct channels (the default)."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest
from fakes import FakeEngineWorker as FakeWorker
from fakes import body_of, http_request, run, serving, sse_events, until

from cluster.direct_stream import BATCH, HELLO, StreamServer, read_frame, write_frame
from workers.messages import StreamOffer, TokenDeltaBatch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from workers.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("direct") / "tiny", "qwen3_moe", "tiny", seed=11)


def calls(s, method: str) -> list:
    return [c for c in s.decode_handle.calls if c[0] == method]


def test_a_direct_channel_carries_the_batches_starts_and_aborts_off_serve(model_dir):
    """Streamed and whole requests on two workers at once: every text complete and in order, and the only
    Serve calls the decode side got were the channels' opening (one per worker, asking for a direct channel).
    A client that leaves mid-stream has its request aborted on the worker, over the connection."""
    d0, d1 = FakeWorker("d0", delay=0.002), FakeWorker("d1", delay=0.002)

    async def main():
        s = await serving(model_dir, [], [d0, d1], direct=True)
        streamed = [
            s.frontend.completions(http_request({"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": 20})) for _ in range(6)
        ]
        whole = [s.frontend.completions(http_request({"model": "tiny", "prompt": "hi", "max_tokens": 12})) for _ in range(6)]
        responses = await asyncio.gather(*streamed, *whole)
        events = [await sse_events(r) for r in responses[:6]]
        leaving = await s.frontend.completions(http_request({"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": 200}))
        await sse_events(leaving, stop_after=3)  # the client reads three chunks and goes
        await until(lambda: len(d0.aborted) + len(d1.aborted) == 1)
        return s, responses[6:], events, set(s.pipeline.channels.pool._connections)

    s, whole, events, connected = run(main())
    for e in events:
        assert e[-1] == "[DONE]" and "".join(x["choices"][0]["text"] for x in e[:-1]) == "".join(f"t{i} " for i in range(20))
    for r in whole:
        assert r.status_code == 200 and body_of(r)["choices"][0]["text"] == "".join(f"t{i} " for i in range(12))
    assert sorted(c[2]["target_replica"] for c in calls(s, "channel")) == ["d0", "d1"]
    assert all(c[2]["direct"] is True for c in calls(s, "channel"))
    assert calls(s, "start_batch") == [] and calls(s, "abort") == []
    assert len(d0.started) + len(d1.started) == 13
    assert connected == {"d0", "d1"}


def test_an_offer_the_front_end_cannot_reach_falls_back_to_the_serve_stream(model_dir):
    """The worker's address is not reachable from the front end (another network): the channel opens as a
    Serve stream instead, and the worker is not offered a direct channel again."""
    d0 = FakeWorker("d0", delay=0.002)

    async def main():
        s = await serving(model_dir, [], [d0], direct=True)
        server = s.decode_handle.replicas["d0"]
        real_offer = server.streams.offer

        async def unreachable(channel_id):
            offer, held = await real_offer(channel_id)
            with socket.socket() as sock:  # a port nothing listens on
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            return StreamOffer(offer.host, port, offer.token), held

        server.streams.offer = unreachable
        first = await s.frontend.completions(http_request({"model": "tiny", "prompt": "hi", "max_tokens": 5}))
        second = await s.frontend.completions(http_request({"model": "tiny", "prompt": "hi", "max_tokens": 5}))
        return s, first, second

    s, first, second = run(main())
    assert body_of(first)["choices"][0]["text"] == body_of(second)["choices"][0]["text"] == "t0 t1 t2 t3 t4 "
    assert [c[2].get("direct", False) for c in calls(s, "channel")] == [True, False]
    assert len(calls(s, "start_batch")) == 2
    assert s.pipeline.channels.pool._unreachable == {"d0"}


def test_a_connection_must_present_its_offers_token_first_and_only_once():
    """Nothing a peer sends is read as data before it names a live offer: a wrong token, a frame that is not
    a hello, or a length no peer would send closes the connection; an offer's token works once."""
    opened: list[str] = []

    async def channel(channel_id):
        opened.append(channel_id)
        yield TokenDeltaBatch("w", [])
        await asyncio.Event().wait()

    async def start_batch(requests):
        return [None] * len(requests)

    async def closed_unread(port: int, frame: bytes) -> bool:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(frame)
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        return data == b""

    async def main():
        server = StreamServer("127.0.0.1", channel, start_batch, lambda rid: None)
        offer, held = await server.offer("fe.1")
        hello = struct.pack("!Ic", len(offer.token), HELLO)
        refusals = [
            await closed_unread(offer.port, hello + b"x" * len(offer.token)),  # wrong token
            await closed_unread(offer.port, struct.pack("!Ic", len(offer.token), BATCH) + offer.token),  # not a hello
            await closed_unread(offer.port, struct.pack("!Ic", 1 << 30, HELLO)),  # no peer sends 1 GiB
        ]
        assert opened == []
        reader, writer = await asyncio.open_connection("127.0.0.1", offer.port)
        write_frame(writer, HELLO, offer.token)
        kind, payload = await read_frame(reader)
        reused = await closed_unread(offer.port, hello + offer.token)
        writer.close()
        await asyncio.wait_for(server.hold(held), 5)  # the front end left: the lease ends
        server.close()
        return refusals, kind, TokenDeltaBatch.decode(payload), reused

    refusals, kind, batch, reused = run(main())
    assert refusals == [True, True, True]
    assert kind == BATCH and batch.worker_id == "w" and batch.deltas == []
    assert reused and opened == ["fe.1"]


def test_a_lease_whose_offer_is_never_taken_ends(monkeypatch):
    """The front end died between the offer and its connection: the lease (the Serve call a stopping replica
    waits for) ends after the offer's time, and the token no longer opens the channel."""
    import cluster.direct_stream as ds

    monkeypatch.setattr(ds, "_OFFER_TTL_S", 0.2)

    async def channel(channel_id):
        raise AssertionError("no channel may open")
        yield

    async def main():
        server = StreamServer("127.0.0.1", channel, None, lambda rid: None)
        offer, held = await server.offer("fe.1")
        await asyncio.wait_for(server.hold(held), 5)
        reader, writer = await asyncio.open_connection("127.0.0.1", offer.port)
        write_frame(writer, HELLO, offer.token)
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        server.close()
        return data

    assert run(main()) == b""


def test_a_frame_cut_off_by_the_peer_is_a_broken_connection_wherever_it_stops():
    """A peer that dies inside a frame (its header, or its payload) broke the connection: `ConnectionError`,
    which the front end reads as the worker gone. A cut inside the payload used to raise EOFError, which the
    front end's reader took for a clean end."""

    async def read(data: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader)

    async def main():
        whole = struct.pack("!Ic", 4, BATCH) + b"abcd"
        assert await read(whole) == (BATCH, b"abcd") and await read(b"") is None
        for cut in (whole[:3], whole[:7]):
            with pytest.raises(ConnectionError):
                await read(cut)

    run(main())
