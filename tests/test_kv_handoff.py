"""Prefill -> decode KV handoff between two engines: the decode side continues exactly as one engine would."""

from __future__ import annotations

import pytest
from test_engine import ENGINE_ARGS, prompts

from workers.engine import EngineConfig, EngineCore, SamplingParams
from workers.engine.engine import KVImport
from workers.models.make_model import make_model

ARGS = {**ENGINE_ARGS, "warmup": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("handoff") / "m", "mixtral", "tiny", seed=4)


def engine(model_dir, worker, **kw):
    return EngineCore(EngineConfig(model=str(model_dir), worker_id=worker, **{**ARGS, **kw}), show_progress=False)


def run(engine_, request_id):
    outs = []
    while engine_.has_unfinished():
        outs += [o for o in engine_.step() if o.request_id == request_id]
    return outs


def handoff(prefill, decode, rid, prompt, params, chunk_layers=1, reverse=False):
    prefill.add_request(rid, prompt, params.model_copy(update={"max_tokens": 1}), hold_kv=True)
    first = run(prefill, rid)[-1]
    decode.add_request(rid, prompt, params, kv_import=KVImport(first.token_ids[0], first.num_cached_tokens))
    layers = prefill.cfg.num_layers
    chunks = [(l, prefill.export_kv(rid, l, min(l + chunk_layers, layers))) for l in range(0, layers, chunk_layers)]
    assert prefill.release_kv(rid)
    for start, data in reversed(chunks) if reverse else chunks:
        assert decode.import_kv(rid, start, data)
    return first, run(decode, rid)


@pytest.mark.parametrize("reverse", [False, True])
def test_handoff_in_layer_chunks_equals_single_engine(model_dir, reverse):
    prefill, decode, single = engine(model_dir, "p0"), engine(model_dir, "d0"), engine(model_dir, "s0")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(prompts(3, seed=20, lo=5, hi=60)):
        first, outs = handoff(prefill, decode, f"r{i}", prompt, params, reverse=reverse)
        single.add_request(f"r{i}", prompt, params)
        expected = run(single, f"r{i}")[-1]
        assert outs[-1].token_ids == expected.token_ids
        assert outs[-1].text == expected.text
        # The first token's text was streamed by the prefill side; the decode side sends the rest.
        assert first.text + "".join(o.delta_text for o in outs) == expected.text
    assert prefill.kv.num_free_blocks == prefill.kv.pool.num_blocks
    assert decode.kv.num_free_blocks == decode.kv.pool.num_blocks


def test_seeded_sampling_continues_across_the_handoff(model_dir):
    prefill, decode, single = engine(model_dir, "p0"), engine(model_dir, "d0"), engine(model_dir, "s0")
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    prompt = prompts(1, seed=21)[0]
    _, outs = handoff(prefill, decode, "r", prompt, params, chunk_layers=2)
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
    assert run(decode, "r")[-1].token_ids == run(single, "r")[-1].token_ids


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
            result = await prefill.prefill("r", prompt, params)

            request_done = asyncio.Event()

            async def slow_release():
                with contextlib.suppress(TimeoutError):  # a loaded machine: the release RPC outlives the request
                    await asyncio.wait_for(request_done.wait(), 3.0)
                return await prefill.release("r")

            outs = [
                o
                async for o in decode.generate_from_prefill(
                    "r", prompt, params, result, lambda a, b: prefill.kv_chunk("r", a, b), slow_release
                )
            ]
            request_done.set()
            assert outs[-1].finished and len(outs[-1].token_ids) == 2
            assert decode.counters.handoffs == 1 and decode.counters.handoff_bytes > 0
            for _ in range(50):  # the shielded release still completes
                if prefill.engine.core.kv.num_free_blocks == prefill.engine.core.kv.pool.num_blocks:
                    break
                await asyncio.sleep(0.1)
            assert prefill.engine.core.kv.num_free_blocks == prefill.engine.core.kv.pool.num_blocks
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
            result = await prefill.prefill("r", prompt, params, session_id="conv-1")
            fetch = lambda a, b: prefill.kv_chunk("r", a, b)  # noqa: E731
            release = lambda: prefill.release("r")  # noqa: E731
            outs = [o async for o in decode.generate_from_prefill("r", prompt, params, result, fetch, release, session_id="conv-1")]
            assert outs[-1].finished
            local = [o async for o in decode.generate("q", prompts(1, seed=27, lo=40, hi=41)[0], params, session_id="conv-2")]
            assert local[-1].finished
            assert sessions_of_cached_blocks(prefill) == {"conv-1"}
            assert sessions_of_cached_blocks(decode) == {"conv-1", "conv-2"}
        finally:
            prefill.engine.shutdown()
            decode.engine.shutdown()

    asyncio.run(scenario())
