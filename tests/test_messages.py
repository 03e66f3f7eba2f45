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
    handoff = m.PrefillHandoff("r1", "p0", m.TokenDelta("r1", [5], "a", 1, 8), 12, 3, 0.01)
    return [
        delta,
        m.TokenDeltaBatch("d0", [delta, m.TokenDelta("r2", [], "", 3, 0, "abort")], closing=False),
        m.PrefillRequest("r1", [1, 2, 3], params, "s", {"traceparent": "00-x"}),
        handoff,
        m.DecodeRequest("r1", [1, 2, 3], params, "fe-1", handoff, "s", None),
        m.KVChunk.of("r1", 0, 2, np.ones((2, 3), np.float32)),
        m.KVChunkHeader.of("r1", 2, 3, np.zeros((1, 3), np.float16)),
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
                    return None

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
        await prefill.kv_chunk("p0", "r1", 0, 2)
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
    owner = {"prefill": "PrefillServer", "kv_chunk": "PrefillServer", "release": "PrefillServer", "channel": "DecodeServer"}
    owner |= {"start": "DecodeServer", "abort": "DecodeServer"}
    for method, args, kwargs in rec.calls:
        cls = _deployment(owner.get(method, "Registry"))
        assert method in handles.CALLS[cls.__name__]
        inspect.signature(getattr(cls, method)).bind(None, *args, **kwargs)  # raises TypeError on a mismatch
