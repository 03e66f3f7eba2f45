"""Prefill -> decode KV handoff between two engines: the decode side continues exactly as one engine would."""

from __future__ import annotations

import pytest
from engine_harness import ENGINE_ARGS, kv_handoff, prompts, run_to_end
from fakes import until

from workers.engine import EngineConfig, EngineCore, SamplingParams
from workers.engine.engine import KVImport
from workers.messages import DecodeRequest, PrefillRequest
from workers.models.make_model import make_model

ARGS = {**ENGINE_ARGS, "warmup": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("handoff") / "m", "mixtral", "tiny", seed=4)


def engine(model_dir, worker, **kw):
    return EngineCore(EngineConfig(model=str(model_dir), worker_id=worker, **{**ARGS, **kw}), show_progress=False)


def run(engine_, request_id):
    """`request_id`'s whole output (in a list: `run(...)[-1]`)."""
    return [run_to_end(engine_, request_id)]


@pytest.mark.parametrize("reverse", [False, True])
def test_handoff_in_layer_chunks_equals_single_engine(model_dir, reverse):
    prefill, decode, single = engine(model_dir, "p0"), engine(model_dir, "d0"), engine(model_dir, "s0")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(prompts(3, seed=20, lo=5, hi=60)):
        first, outs, rest = kv_handoff(prefill, decode, f"r{i}", prompt, params, reverse=reverse)
        single.add_request(f"r{i}", prompt, params)
        expected = run(single, f"r{i}")[-1]
        assert outs[-1].token_ids == expected.token_ids
        assert outs[-1].text == expected.text
        # The first token's text was streamed by the prefill side; the decode side sends the rest.
        assert rest.text == expected.text[len(first.text) :] and len(rest.token_ids) == len(expected.token_ids) - 1
    assert prefill.kv.num_free_blocks == prefill.kv.pool.num_blocks
    assert decode.kv.num_free_blocks == decode.kv.pool.num_blocks


def test_seeded_sampling_continues_across_the_handoff(model_dir):
    prefill, decode, single = engine(model_dir, "p0"), engine(model_dir, "d0"), engine(model_dir, "s0")
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    prompt = prompts(1, seed=21)[0]
    _, outs, _ = kv_handoff(prefill, decode, "r", prompt, params, chunk_layers=2)
    single.add_request("r", prompt, params)
    assert outs[-1].token_ids == run(single, "r")[-1].token_ids


def test_abort_while_importing_frees_blocks(model_dir):
    prefill, decode = engine(model_dir, "p0"), engine(model_dir, "d0")
    prompt = prompts(1, seed=22, lo=40, hi=41)[0]
    prefill.add_request("r", prompt, SamplingParams(max_tokens=1), hold_kv=True)
    first = run(prefill, "r")[-1]
    decode.add_request("r", prompt, SamplingParams(max_tokens=5), kv_import=KVImport(first.token_ids[0]))
    assert decode.kv.num_free_blocks < decode.kv.pool.num_blocks
    decode.import_kv("r", 0, prefill.export_kv("r", 0, 1))
    decode.abort("r")
    assert decode.kv.num_free_blocks == decode.kv.pool.num_blocks
    assert not decode.import_kv("r", 1, prefill.export_kv("r", 1, 2))
    prefill.abort("r")  # abandoning a held handoff releases it too
    assert prefill.kv.num_free_blocks == prefill.kv.pool.num_blocks


def test_full_decode_pool_falls_back_to_local_prefill(model_dir):
    prefill = engine(model_dir, "p0")
    decode = engine(model_dir, "d0", num_kv_blocks=17)
    single = engine(model_dir, "s0")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    big = prompts(1, seed=23, lo=100, hi=101)[0]
    decode.add_request("busy", big, SamplingParams(max_tokens=5, ignore_eos=True))
    decode.step()
    decode.step()  # the big prompt (13 of 17 blocks) is prefilled and decoding
    prompt = prompts(1, seed=24, lo=60, hi=61)[0]
    prefill.add_request("r", prompt, params.model_copy(update={"max_tokens": 1}), hold_kv=True)
    first = run(prefill, "r")[-1]
    decode.add_request("r", prompt, params, kv_import=KVImport(first.token_ids[0]))
    assert "r" not in decode.scheduler.importing  # recomputes locally instead
    single.add_request("r", prompt, params)
    assert first.token_ids + run(decode, "r")[-1].token_ids == run(single, "r")[-1].token_ids  # decode sends what follows the first


def test_worker_counts_a_handoff_whose_release_outlives_the_request(model_dir):
    """A short request can finish while the decode worker is still telling the prefill worker to let go;
    the moved bytes must still be counted and the prefill side must still be released."""
    import asyncio
    import contextlib

    from workers.worker import DecodeWorker, PrefillWorker

    def config(worker):
        return EngineConfig(model=str(model_dir), worker_id=worker, **ARGS)

    async def scenario():
        prefill, decode = PrefillWorker(config("p0")), DecodeWorker(config("d0"))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            prompt = prompts(1, seed=25, lo=30, hi=31)[0]
            handoff = await prefill.prefill(PrefillRequest("r", prompt, params))

            request_done = asyncio.Event()

            async def slow_release():
                with contextlib.suppress(TimeoutError):  # a loaded machine: the release RPC outlives the request
                    await asyncio.wait_for(request_done.wait(), 3.0)
                return await prefill.release("r")

            request = DecodeRequest("r", prompt, params, "local", handoff)
            outs = [o async for o in decode.stream(request, lambda a, b: prefill.kv_chunk("r", a, b), slow_release)]
            request_done.set()
            assert outs[-1].finished and outs[-1].num_output_tokens == 2 and sum(len(o.token_ids) for o in outs) == 1
            assert decode.counters.handoffs == 1 and decode.counters.handoff_bytes > 0
            kv = prefill.engine.core.kv
            await until(lambda: kv.num_free_blocks == kv.pool.num_blocks, timeout=5)  # the shielded release still completes
        finally:
            prefill.engine.shutdown()
            decode.engine.shutdown()

    asyncio.run(scenario())


def test_workers_pass_the_session_hint_to_both_engines(model_dir):
    """The session hint reaches the engine on both sides of a handoff (and locally), so the blocks a live
    conversation cached are kept in its retention class (workers/engine/retention.py)."""
    import asyncio

    from workers.worker import DecodeWorker, PrefillWorker

    def config(worker):
        return EngineConfig(model=str(model_dir), worker_id=worker, **ARGS)

    def sessions_of_cached_blocks(worker) -> set:
        pool = worker.engine.core.kv.pool
        return {pool._free_cached.session_of(b) for b in pool.cached.values()}

    async def scenario():
        prefill, decode = PrefillWorker(config("p0")), DecodeWorker(config("d0"))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            prompt = prompts(1, seed=26, lo=40, hi=41)[0]
            handoff = await prefill.prefill(PrefillRequest("r", prompt, params, session_id="conv-1"))
            fetch = lambda a, b: prefill.kv_chunk("r", a, b)  # noqa: E731
            release = lambda: prefill.release("r")  # noqa: E731
            outs = [
                o async for o in decode.stream(DecodeRequest("r", prompt, params, "local", handoff, session_id="conv-1"), fetch, release)
            ]
            assert outs[-1].finished
            other = prompts(1, seed=27, lo=40, hi=41)[0]
            local = [o async for o in decode.stream(DecodeRequest("q", other, params, "local", session_id="conv-2"))]
            assert local[-1].finished
            assert sessions_of_cached_blocks(prefill) == {"conv-1"}
            assert sessions_of_cached_blocks(decode) == {"conv-1", "conv-2"}
        finally:
            prefill.engine.shutdown()
            decode.engine.shutdown()

    asyncio.run(scenario())


def test_a_damaged_kv_chunk_is_refused_and_the_request_recomputed(model_dir):
    """A chunk whose bytes changed on the way (or that is not the chunk asked for) fails its header check:
    nothing of it is written, it is counted, and the decode worker prefills the prompt itself: the output is
    still exactly one engine's."""
    import asyncio

    import numpy as np

    from workers.messages import KVChunk
    from workers.worker import DecodeWorker, PrefillWorker

    def config(worker):
        return EngineConfig(model=str(model_dir), worker_id=worker, **ARGS)

    async def scenario():
        prefill, decode = PrefillWorker(config("p0")), DecodeWorker(config("d0"))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            prompt = prompts(1, seed=28, lo=30, hi=31)[0]
            handoff = await prefill.prefill(PrefillRequest("r", prompt, params))

            async def damaged(a, b):
                chunk = await prefill.kv_chunk("r", a, b)
                data = chunk.data.copy()
                data.reshape(-1)[0] += np.float32(1.0)  # one value changed in transit
                return KVChunk(chunk.header, data)

            outs = [
                o async for o in decode.stream(DecodeRequest("r", prompt, params, "local", handoff), damaged, lambda: prefill.release("r"))
            ]
            single = [o async for o in decode.stream(DecodeRequest("s", prompt, params, "local"))]
            return handoff, outs, single, decode.counters
        finally:
            prefill.engine.shutdown()
            decode.engine.shutdown()

    handoff, outs, single, counters = asyncio.run(scenario())
    assert counters.corrupt_chunks >= 1 and counters.import_failures == 1 and counters.handoffs == 0
    tokens = handoff.first.token_ids + [t for o in outs for t in o.token_ids]
    assert tokens == [t for o in single for t in o.token_ids]


def test_a_chunk_header_names_what_it_carries():
    import numpy as np
    import pytest as _pytest

    from workers.messages import KVChunk, KVChunkCorrupt

    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    chunk = KVChunk.of("r", 0, 2, data)
    assert (chunk.verified("r", 0, 2) == data).all()
    with _pytest.raises(KVChunkCorrupt, match="asked for"):
        chunk.verified("r", 2, 4)  # not the layers asked for
    with _pytest.raises(KVChunkCorrupt, match="arrived as"):
        KVChunk(chunk.header, data.astype(np.float16)).verified("r", 0, 2)
    with _pytest.raises(KVChunkCorrupt, match="checksum"):
        KVChunk(chunk.header, data[::-1].copy()).verified("r", 0, 2)


def test_a_decode_channel_sends_one_batch_per_step_for_all_its_requests(model_dir):
    """Eight requests on one channel: every batch after the handshake carries the deltas of the requests that
    stepped together (so far fewer messages than deltas), each request's deltas arrive in order and end with
    its finish reason, and the channel closes itself (a `closing` batch) once nothing runs on it."""
    import asyncio

    from workers.worker import DecodeWorker

    async def scenario():
        decode = DecodeWorker(EngineConfig(model=str(model_dir), worker_id="d0", **ARGS), channel_linger_s=0.3)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            batches = []
            channel = decode.channel("fe-1")
            batches.append(await anext(channel))  # the handshake: open now
            requests = [DecodeRequest(f"r{i}", p, params, "fe-1") for i, p in enumerate(prompts(8, seed=29))]
            for r in requests:
                await decode.start(r)
            async for batch in channel:
                batches.append(batch)
            return batches, requests
        finally:
            decode.engine.shutdown()

    batches, requests = asyncio.run(scenario())
    assert batches[0].deltas == [] and not batches[0].closing
    assert batches[-1].closing and batches[-1].deltas == []
    deltas = [d for b in batches for d in b.deltas]
    assert len(deltas) == 8 * 8 and len(batches) - 2 < len(deltas) / 4  # one message carries many requests' tokens
    for r in requests:
        mine = [d for d in deltas if d.request_id == r.request_id]
        assert [d.num_output_tokens for d in mine] == list(range(1, 9)) and mine[-1].finish_reason == "length"
        assert all(d.finish_reason is None for d in mine[:-1])
