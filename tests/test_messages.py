"""The messages between processes (workers/messages.py) and the typed handles (cluster/handles.py): every
message keeps its shape across a process boundary, and every method a handle calls exists on its deployment
with the arguments the handle passes."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import numpy as np
import pytest
from fakes import heartbeat

from cluster import handles
from cluster.router.types import WorkerLoad
from workers import messages as m
from workers.engine.sampling_params import SamplingParams


def examples() -> list:
    params = SamplingParams(max_tokens=4)
    delta = m.TokenDelta("r1", [5, 6], "ab", 2, 8, None, [{5: -0.1}, {6: -0.2}])
    header = m.KVChunkHeader.of("r1", 0, "kv", 0, 2, 0, 4, np.zeros((2, 4, 3), np.float16))
    handoff = m.PrefillHandoff("r1", "p0", m.TokenDelta("r1", [5], "a", 1, 8), 12, (header,), ("handle-0",), "local", 0.01, 0.002)
    return [
        delta,
        m.TokenDeltaBatch("d0", [delta, m.TokenDelta("r2", [], "", 3, 0, "abort")], closing=False),
        m.PrefillRequest("r1", [1, 2, 3], params, "s", {"traceparent": "00-x"}),
        handoff,
        m.DecodeRequest("r1", [1, 2, 3], params, "fe-1", handoff, "s", None),
        m.KVChunk.of("r1", 1, "state", 0, 0, 0, 0, np.ones((6,), np.float32)),
        header,
        m.EngineStats(num_running=2, kv_event_epoch=7),
        m.HandoffCounters(handoffs=1, bytes=10),
        heartbeat("d0", num_running=3),
        m.WorkerReport(heartbeat("d0"), [m.KVEvent("d0", 1, 0, m.KVEventKind.STORED, 11, None, 8)]),
        m.KVEvent("d0", 1, 0, m.KVEventKind.REMOVED, 11),
    ]


def test_every_message_type_has_an_example_and_survives_pickling():
    got = examples()
    assert {type(x) for x in got} == set(m.MESSAGES)
    for x in got:
        assert dataclasses.is_dataclass(x)
        back = pickle.loads(pickle.dumps(x))
        if isinstance(x, m.KVChunk):
            assert back.header == x.header and (back.data == x.data).all()
        else:
            assert back == x, type(x).__name__


def test_a_token_batch_on_the_wire_is_compact_bytes_and_decodes_to_the_same_batch():
    batch = examples()[1]
    data = batch.encode()
    assert isinstance(data, bytes) and m.TokenDeltaBatch.decode(data) == batch
    big = m.TokenDeltaBatch("d0", [m.TokenDelta(f"cmpl-{i:032x}", [i], " x", 10, 0) for i in range(64)])
    assert m.TokenDeltaBatch.decode(big.encode()) == big
    assert len(big.encode()) < len(pickle.dumps(big))  # tuples, not objects


def test_a_delta_is_finished_exactly_when_it_has_a_reason():
    assert not m.TokenDelta("r", [1], "a", 1).finished
    assert m.TokenDelta("r", [], "", 1, 0, "stop").finished


def test_the_router_reads_its_load_from_the_heartbeat():
    hb = heartbeat("d0", num_pending_prefill_tokens=40, num_total_blocks=100, num_free_blocks=70, kv_usage=0.3, num_waiting=2)
    hb = dataclasses.replace(hb, engine=dataclasses.replace(hb.engine, kv_event_epoch=5, kv_event_last_seq=9, sparse_blocks=True))
    load = WorkerLoad.from_heartbeat(hb, index_lag_s=0.2)
    assert load == WorkerLoad("d0", "decode", 40, 30, 0.3, 2, 5, 9, hb.ts, 0.2, True)


def _deployment(name: str):
    from cluster.registry import Registry
    from cluster.servers import DecodeServer, PrefillServer

    return {"PrefillServer": PrefillServer, "DecodeServer": DecodeServer, "Registry": Registry}[name]


@pytest.mark.parametrize("deployment", sorted(handles.CALLS))
def test_every_method_a_handle_calls_exists_with_its_arguments(deployment):
    cls = _deployment(deployment)
    for method in handles.CALLS[deployment]:
        fn = getattr(cls, method, None)
        assert callable(fn), f"{deployment}.{method} is called by cluster/handles.py and does not exist"
        params = inspect.signature(fn).parameters
        if deployment != "Registry":  # calls to a worker name their replica
            assert handles.TARGET_KWARG in params, f"{deployment}.{method} takes no {handles.TARGET_KWARG}"


class _Recorder:
    """A handle that records each call's method, arguments and keywords."""

    def __init__(self):
        self.calls = []

    def options(self, **_):
        return self

    def __getattr__(self, method):
        recorder = self

        class Method:
            @staticmethod
            def remote(*args, **kwargs):
                recorder.calls.append((method, args, kwargs))

                async def done():
                    return [None] * len(args[0]) if method == "start_batch" else None  # each request started

                return _Awaitable(done())

        return Method()


class _Awaitable:
    def __init__(self, coro):
        self.coro = coro

    def __await__(self):
        return self.coro.__await__()

    def cancel(self):
        pass

    def result(self, timeout_s=None):
        self.coro.close()


def test_the_wrappers_call_the_deployments_as_their_signatures_say():
    import asyncio

    ex = {type(x).__name__: x for x in examples()}
    rec = _Recorder()
    prefill, decode, registry = handles.PrefillPool(rec), handles.DecodePool(rec), handles.RegistryClient(rec)

    async def calls():
        await prefill.prefill("p0", ex["PrefillRequest"])
        await prefill.release("p0", "r1")
        decode.channel("d0", "fe-1")
        await decode.start("d0", ex["DecodeRequest"])
        await decode.abort("d0", "r1")
        await registry.report(ex["WorkerReport"])
        registry.report_sync(ex["WorkerReport"])
        await registry.worker_failed("d0", 1.0)
        await registry.changes(None, 0.5)
        registry.follow(None, 0.1)
        await registry.metrics()

    asyncio.run(calls())
    owner = {"prefill": "PrefillServer", "release": "PrefillServer", "channel": "DecodeServer"}
    owner |= {"start_batch": "DecodeServer", "abort": "DecodeServer"}
    for method, args, kwargs in rec.calls:
        cls = _deployment(owner.get(method, "Registry"))
        assert method in handles.CALLS[cls.__name__]
        inspect.signature(getattr(cls, method)).bind(None, *args, **kwargs)  # raises TypeError on a mismatch


# ============================================================================ decode starts travel in batches


class _SlowStarts:
    """A decode handle whose `start_batch` calls wait until the test lets them return (`release()`), then
    answer per request from `refuse` (request id -> exception), or fail whole with `fail`."""

    def __init__(self):
        import asyncio

        self.batches: list[list[str]] = []
        self.gate = asyncio.Event()
        self.refuse: dict[str, BaseException] = {}
        self.fail: BaseException | None = None
        self.aborts: list[tuple[str, int]] = []  # (request id, batches returned when the abort arrived)
        self.returned = 0

    def options(self, **_):
        return self

    @property
    def start_batch(self):
        return _Remote(self._start_batch)

    @property
    def abort(self):
        return _Remote(self._abort)

    async def _start_batch(self, requests, target_replica=None):
        self.batches.append([r.request_id for r in requests])
        await self.gate.wait()
        self.gate.clear()
        self.returned += 1
        if self.fail is not None:
            raise self.fail
        return [self.refuse.get(r.request_id) for r in requests]

    async def _abort(self, request_id, target_replica=None):
        self.aborts.append((request_id, self.returned))


class _Remote:
    def __init__(self, fn):
        self.remote = fn


def _decode_request(rid: str) -> m.DecodeRequest:
    return m.DecodeRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4), "fe-1")


def test_starts_that_arrive_while_a_call_is_on_its_way_go_together_in_the_next():
    import asyncio

    handle = _SlowStarts()
    handle.refuse["r3"] = ValueError("prompt too long")
    pool = handles.DecodePool(handle)

    async def main():
        first = asyncio.create_task(pool.start("d0", _decode_request("r0")))
        await asyncio.sleep(0)
        rest = [asyncio.create_task(pool.start("d0", _decode_request(f"r{i}"))) for i in range(1, 5)]
        while len(handle.batches) < 1:
            await asyncio.sleep(0)
        handle.gate.set()  # the first call returns; the four that waited leave as one
        await first
        while len(handle.batches) < 2:
            await asyncio.sleep(0)
        handle.gate.set()
        return await asyncio.gather(*rest, return_exceptions=True)

    results = asyncio.run(main())
    assert handle.batches == [["r0"], ["r1", "r2", "r3", "r4"]]
    assert results[:2] == [None, None] and isinstance(results[2], ValueError) and results[3] is None


def test_over_a_direct_channel_several_start_batches_travel_at_once_up_to_a_limit():
    """A frame costs little, so a direct channel does not hold starts behind a batch on its way (one start
    waited ~50 ms there for its answer while the front end parsed the next wave, and ran alone on the
    engine meanwhile): each turn of the event loop sends what it brought, up to `max_in_flight` batches; the
    rest goes with the first batch back. A request still waiting is dropped when its client leaves."""
    import asyncio

    async def main():
        loop = asyncio.get_running_loop()
        sent: list[tuple[list[str], asyncio.Future]] = []

        async def send(requests):
            answer = loop.create_future()
            sent.append(([r.request_id for r in requests], answer))
            return await answer

        starts = handles._StartBatches(send, max_in_flight=2)
        begin = lambda *ids: [asyncio.ensure_future(starts.start(_decode_request(i))) for i in ids]  # noqa: E731
        first = begin("r0")
        await asyncio.sleep(0)
        second = begin("r1", "r2")  # r0's batch is on its way: these leave at once all the same
        await asyncio.sleep(0)
        waiting = begin("r3", "r4", "r5")  # two batches in flight: these wait
        await asyncio.sleep(0.01)
        assert [ids for ids, _ in sent] == [["r0"], ["r1", "r2"]]
        waiting[2].cancel()  # its client left before it was sent
        await asyncio.sleep(0)
        sent[1][1].set_result([None, ValueError("too long")])
        await asyncio.sleep(0.01)
        assert [ids for ids, _ in sent] == [["r0"], ["r1", "r2"], ["r3", "r4"]]
        settled = asyncio.ensure_future(starts.settled("r3"))  # an abort waits for the call that carries it
        await asyncio.sleep(0.01)
        assert not settled.done()
        sent[0][1].set_result([None])
        sent[2][1].set_result([None, None])
        results = await asyncio.gather(*first, *second, *waiting[:2], return_exceptions=True)
        return results, await settled

    results, settled = asyncio.run(main())
    assert results[:2] == [None, None] and isinstance(results[2], ValueError) and results[3:] == [None, None]
    assert settled is True


def test_a_start_given_up_before_it_left_is_never_sent_and_an_abort_never_overtakes_its_start():
    import asyncio

    handle = _SlowStarts()
    pool = handles.DecodePool(handle)

    async def main():
        sent = asyncio.create_task(pool.start("d0", _decode_request("r0")))
        while not handle.batches:
            await asyncio.sleep(0)
        waiting = asyncio.create_task(pool.start("d0", _decode_request("r1")))
        await asyncio.sleep(0)
        waiting.cancel()  # its client left before its batch went
        sent.cancel()  # this one left with its batch on the way: the abort must wait for the start
        await pool.abort("d0", "r1")
        abort = asyncio.create_task(pool.abort("d0", "r0"))
        await asyncio.sleep(0.01)
        assert not handle.aborts  # still waiting for r0's start to return
        handle.gate.set()
        await abort
        await asyncio.sleep(0.01)
        return sent.cancelled(), waiting.cancelled()

    assert asyncio.run(main()) == (True, True)
    assert handle.batches == [["r0"]]  # r1 never left
    assert handle.aborts == [("r0", 1)]  # after the call that carried r0 returned


def test_a_failed_start_call_fails_every_request_it_carried():
    import asyncio

    from ray.exceptions import ActorDiedError

    handle = _SlowStarts()
    handle.fail = ActorDiedError()
    pool = handles.DecodePool(handle)

    async def main():
        tasks = [asyncio.create_task(pool.start("d0", _decode_request(f"r{i}"))) for i in range(3)]
        await asyncio.sleep(0)
        for _ in range(2):
            while handle.gate.is_set():
                await asyncio.sleep(0)
            handle.gate.set()
            await asyncio.sleep(0.01)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, ActorDiedError) for r in results) and sum(map(len, handle.batches)) == 3


def test_a_start_cancelled_on_its_own_inside_a_batch_does_not_read_as_started():
    import asyncio

    from cluster.servers import _start_outcome

    assert _start_outcome(None) is None
    refused = ValueError("too long")
    assert _start_outcome(refused) is refused
    assert isinstance(_start_outcome(asyncio.CancelledError()), RuntimeError)


def test_a_stream_interval_holds_back_a_requests_middle_tokens_but_not_its_first_or_its_end():
    """Deltas wait for the channel's interval (`stream_interval_ms`) to go together, except a request's first
    token (its TTFT) and its end (a closed-loop client's next request waits for it, with an engine slot free).
    Before, a wave of requests finishing at once reached the front end up to an interval late."""
    import asyncio
    import time

    from workers.outbox import Outbox

    def delta(rid: str, n: int, new: int = 1, end: str | None = None) -> m.TokenDelta:
        return m.TokenDelta(rid, list(range(new)), "x" * new, n, finish_reason=end)

    async def main():
        box = Outbox("d0", linger_s=60, has_requests=lambda: True, min_interval_s=30.0)
        batches = box.batches()
        assert (await anext(batches)).deltas == []  # the handshake
        got = []

        async def batch_within(seconds: float):
            return await asyncio.wait_for(anext(batches), seconds)

        box.put(delta("z", 5))  # a middle token, the first batch: nothing to wait for yet
        assert [d.request_id for d in (await batch_within(2)).deltas] == ["z"]
        box.put(delta("a", 1))  # a's first token: at once, though the last batch went less than an interval ago
        got.append([d.request_id for d in (await batch_within(2)).deltas])
        box.put(delta("a", 2))  # a middle token: held back
        pending = asyncio.ensure_future(anext(batches))
        await asyncio.sleep(0.2)
        assert not pending.done()
        box.put(delta("b", 3, new=3))  # b's first delta, of 3 tokens: at once, with a's held one
        start = time.monotonic()
        got.append([d.request_id for d in (await asyncio.wait_for(pending, 2)).deltas])
        box.put(delta("a", 3))
        pending = asyncio.ensure_future(anext(batches))
        await asyncio.sleep(0.2)
        assert not pending.done()
        box.put(delta("a", 3, new=0, end="length"))  # a's end: goes at once with what waited
        got.append([(d.request_id, d.finish_reason) for d in (await asyncio.wait_for(pending, 2)).deltas])
        box.close()
        return got, time.monotonic() - start

    got, took = asyncio.run(main())
    assert got == [["a"], ["a", "b"], [("a", None), ("a", "length")]]
    assert took < 5  # nothing waited out the 30 s interval
