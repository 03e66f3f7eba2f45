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


def worker_pair(model_dir, dtype="float32", **prefill_kw):
    """A prefill worker and a decode worker in this process (the local transport between them)."""
    from workers.worker import DecodeWorker, PrefillWorker

    config = lambda worker: EngineConfig(model=str(model_dir), worker_id=worker, dtype=dtype, **ARGS)  # noqa: E731
    return PrefillWorker(config("p0"), **prefill_kw), DecodeWorker(config("d0"))


def run(engine_, request_id):
    """`request_id`'s whole output (in a list: `run(...)[-1]`)."""
    return [run_to_end(engine_, request_id)]


@pytest.mark.parametrize("reverse", [False, True])
def test_handoff_in_chunks_equals_single_engine(model_dir, reverse):
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


def test_an_export_copied_in_pieces_hands_off_exactly(model_dir):
    """The export's copy is dispatched in pieces (a few MiB each; 3 blocks here): each piece is cut into its
    own chunks (none straddles two), every block arrives, and the decode side continues as one engine."""
    from engine_harness import move_kv

    prefill, decode, single = engine(model_dir, "p0"), engine(model_dir, "d0"), engine(model_dir, "s0")
    prefill.runner.export_piece_blocks = 3
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = prompts(1, seed=31, lo=57, hi=58)[0]  # 8 blocks of 8: pieces of 3, 3 and 2
    prefill.add_request("r", prompt, params.model_copy(update={"max_tokens": 1}), hold_kv=True)
    first = run_to_end(prefill, "r")
    staged = prefill.staged["r"]
    assert [(start, piece.shape[0] >= min(3, 8 - start)) for start, piece in staged.pieces] == [(0, True), (3, True), (6, True)]
    decode.add_request("r", prompt, params, kv_import=KVImport(first.token_ids[0], first.num_cached_tokens, staged.window_start_block))
    chunks = move_kv(prefill, decode, "r", chunk_bytes=1 << 30)  # chunks as large as a piece allows
    assert [(c.header.block_start, c.header.block_end) for c in chunks] == [(0, 3), (3, 6), (6, 8)]
    rest = run_to_end(decode, "r")
    single.add_request("r", prompt, params)
    assert first.token_ids + rest.token_ids == run(single, "r")[-1].token_ids


def test_seeded_sampling_continues_across_the_handoff(model_dir):
    prefill, decode, single = engine(model_dir, "p0"), engine(model_dir, "d0"), engine(model_dir, "s0")
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    prompt = prompts(1, seed=21)[0]
    _, outs, _ = kv_handoff(prefill, decode, "r", prompt, params, chunk_bytes=1 << 20)  # one chunk
    single.add_request("r", prompt, params)
    assert outs[-1].token_ids == run(single, "r")[-1].token_ids


def _aligned_copy(data):
    """`data` copied into page-aligned memory: jit reads such a host array in place (no copy at dispatch), as
    it reads a chunk in a transport's buffer."""
    import mmap

    import numpy as np

    buf = mmap.mmap(-1, max(data.nbytes, 1))
    out = np.frombuffer(buf, data.dtype, data.size).reshape(data.shape)
    out[...] = data
    return out


def _busy_pages(core):
    """Puts a slow program in front of every later write to `core`'s KV pages (it passes them through), so
    that those writes are still waiting to run when the calls that dispatched them return."""
    import jax
    import jax.numpy as jnp

    def slow(pages):
        x = jnp.full((256, 256), 1e-3, jnp.float32)
        s = jax.lax.fori_loop(0, 400, lambda _, y: jnp.tanh(y @ y), x).sum()
        return [p + (s - s).astype(p.dtype) for p in pages]  # not folded away: s - s is NaN for infinite s

    core.runner.kv_pages = jax.jit(slow, donate_argnums=(0,))(core.runner.kv_pages)


def test_an_import_is_done_reading_its_chunks_when_finish_import_returns(model_dir):
    """A chunk's write runs on XLA's threads and reads the chunk in place (a transport's buffer, freed for
    another handoff once the import is reported done): `finish_import` returns only when every write has
    run. The writes here wait behind a slow program; each chunk's memory is zeroed right after the finish,
    and the decode side must still continue exactly (it decoded on zeros when the finish did not wait)."""
    from workers.kv_transfer import KVExport

    # Chunks of one block, a page bucket of the decode side: written as they are, not padded into a copy.
    prefill, decode, single = engine(model_dir, "p0"), engine(model_dir, "d0", page_buckets=[1, 16]), engine(model_dir, "s0")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = prompts(1, seed=33, lo=40, hi=41)[0]
    prefill.add_request("r", prompt, params.model_copy(update={"max_tokens": 1}), hold_kv=True)
    first = run_to_end(prefill, "r")
    decode.add_request("r", prompt, params, kv_import=KVImport(first.token_ids[0], first.num_cached_tokens))
    chunks = [(c.header, _aligned_copy(c.verified(c.header))) for c in KVExport.build(prefill.take_staged("r"), chunk_bytes=1).chunks]
    assert len(chunks) > 1
    _busy_pages(decode)
    for h, data in chunks:
        assert decode.import_kv("r", h.block_start, h.layer_start, data)
    assert decode.finish_import("r")
    for _, data in chunks:
        data[...] = 0
    rest = run_to_end(decode, "r")
    single.add_request("r", prompt, params)
    assert first.token_ids + rest.token_ids == run(single, "r")[-1].token_ids


def test_abort_while_importing_frees_blocks(model_dir):
    from workers.kv_transfer import KVExport

    prefill, decode = engine(model_dir, "p0"), engine(model_dir, "d0")
    prompt = prompts(1, seed=22, lo=40, hi=41)[0]
    prefill.add_request("r", prompt, SamplingParams(max_tokens=1), hold_kv=True)
    first = run(prefill, "r")[-1]
    assert prefill.kv.num_free_blocks == prefill.kv.pool.num_blocks  # staged: the blocks are free at once
    decode.add_request("r", prompt, SamplingParams(max_tokens=5), kv_import=KVImport(first.token_ids[0]))
    assert decode.kv.num_free_blocks < decode.kv.pool.num_blocks
    chunks = KVExport.build(prefill.take_staged("r"), chunk_bytes=1).chunks
    h = chunks[0].header
    assert decode.import_kv("r", h.block_start, h.layer_start, chunks[0].data)
    decode.abort("r")
    assert decode.kv.num_free_blocks == decode.kv.pool.num_blocks
    h = chunks[1].header
    assert not decode.import_kv("r", h.block_start, h.layer_start, chunks[1].data) and not decode.finish_import("r")
    # Abandoning a staged handoff lets go of it too.
    prefill.add_request("q", prompt, SamplingParams(max_tokens=1), hold_kv=True)
    run(prefill, "q")
    assert prefill.stats().num_held == 1 and prefill.release_kv("q") and prefill.stats().num_held == 0


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

    async def scenario():
        prefill, decode = worker_pair(model_dir)
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
            outs = [o async for o in decode.stream(request, None, slow_release)]
            request_done.set()
            assert outs[-1].finished and outs[-1].num_output_tokens == 2 and sum(len(o.token_ids) for o in outs) == 1
            assert decode.counters.handoffs == 1 and decode.counters.handoff_bytes > 0
            await until(lambda: not prefill._published, timeout=5)  # the shielded release still completes
        finally:
            prefill.engine.shutdown()
            decode.engine.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_5_moe", "deepseek_v3"])
def test_a_bfloat16_handoff_moves_its_kv(model_dir, arch, tmp_path_factory):
    """Engines in bfloat16 (the dtype on accelerators) hand their KV over like float32 ones, attention-only,
    hybrid (state chunk) and MLA: the export's checksum used to refuse bfloat16 buffers, so every such
    handoff fell back to a second prefill; and an MLA model in bfloat16 failed its first step on CPU."""
    import asyncio

    if arch != "mixtral":
        model_dir = make_model(tmp_path_factory.mktemp(f"bf16-{arch}") / "m", arch, "tiny", seed=4)

    async def scenario():
        prefill, decode = worker_pair(model_dir, dtype="bfloat16")
        try:
            params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
            prompt = prompts(1, seed=36, lo=40, hi=41)[0]
            handoff = await prefill.prefill(PrefillRequest("r", prompt, params))
            assert handoff.chunks and {h.dtype for h in handoff.chunks if h.kind == "kv"} == {"bfloat16"}
            moved = [
                o async for o in decode.stream(DecodeRequest("r", prompt, params, "local", handoff), None, lambda: prefill.release("r"))
            ]
            assert decode.counters.handoffs == 1 and decode.counters.import_failures == 0
            return prompt, params, handoff.first.token_ids + [t for o in moved for t in o.token_ids]
        finally:
            prefill.engine.shutdown()
            decode.engine.shutdown()

    prompt, params, moved = asyncio.run(scenario())
    single = engine(model_dir, "s0", dtype="bfloat16")
    single.add_request("r", prompt, params)
    assert moved == run(single, "r")[-1].token_ids


def test_workers_pass_the_session_hint_to_both_engines(model_dir):
    """The session hint reaches the engine on both sides of a handoff (and locally), so the blocks a live
    conversation cached are kept in its retention class (workers/engine/retention.py)."""
    import asyncio

    def sessions_of_cached_blocks(worker) -> set:
        pool = worker.engine.core.kv.pool
        return {pool._free_cached.session_of(b) for b in pool.cached.values()}

    async def scenario():
        prefill, decode = worker_pair(model_dir)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            prompt = prompts(1, seed=26, lo=40, hi=41)[0]
            handoff = await prefill.prefill(PrefillRequest("r", prompt, params, session_id="conv-1"))
            fetch = None  # the handoff's own transport: in-process
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


@pytest.mark.parametrize("damaged_fetches", [1, 2])
def test_a_damaged_kv_chunk_is_fetched_again_then_the_request_recomputed(model_dir, damaged_fetches):
    """A chunk whose bytes changed on the way fails its check against the header the handoff carried:
    nothing of it is written, it is counted and fetched once more. Damaged once, the second copy is used
    (no local prefill); damaged twice, the decode worker prefills the prompt itself. Either way the output
    is exactly one engine's, and the prefill side lets go of the KV."""
    import asyncio

    import numpy as np

    async def scenario():
        prefill, decode = worker_pair(model_dir, chunk_bytes=2048)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            prompt = prompts(1, seed=28, lo=30, hi=31)[0]
            handoff = await prefill.prefill(PrefillRequest("r", prompt, params))
            assert len(handoff.chunks) > 1
            bad = {"left": damaged_fetches}

            async def damaging(header, handle):  # a transport that damages chunk 1 on its first fetches
                data = await decode.transport.fetch(header, handle)
                if header.index == 1 and bad["left"] > 0:
                    bad["left"] -= 1
                    data = data.copy()
                    data.reshape(-1)[0] += np.float32(1.0)  # one value changed in transit
                return data

            outs = [
                o async for o in decode.stream(DecodeRequest("r", prompt, params, "local", handoff), damaging, lambda: prefill.release("r"))
            ]
            single = [o async for o in decode.stream(DecodeRequest("s", prompt, params, "local"))]
            await until(lambda: not prefill._published, timeout=5)
            return handoff, outs, single, decode.counters
        finally:
            prefill.engine.shutdown()
            decode.engine.shutdown()

    handoff, outs, single, counters = asyncio.run(scenario())
    assert counters.corrupt_chunks == damaged_fetches and counters.refetched_chunks == 1
    if damaged_fetches == 1:
        assert counters.import_failures == 0 and counters.handoffs == 1
    else:
        assert counters.import_failures == 1 and counters.handoffs == 0
    tokens = handoff.first.token_ids + [t for o in outs for t in o.token_ids]
    assert tokens == [t for o in single for t in o.token_ids]


def test_a_chunk_header_names_what_it_carries():
    import numpy as np
    import pytest as _pytest

    from workers.messages import KVChunk, KVChunkCorrupt

    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    chunk = KVChunk.of("r", 0, "kv", 0, 2, 0, 3, data)
    assert (chunk.verified(chunk.header) == data).all()
    other = KVChunk.of("r", 1, "kv", 2, 4, 0, 3, data).header
    with _pytest.raises(KVChunkCorrupt, match="expected"):
        chunk.verified(other)  # not the chunk the handoff announced
    with _pytest.raises(KVChunkCorrupt, match="arrived as"):
        KVChunk(chunk.header, data.astype(np.float16)).verified(chunk.header)
    with _pytest.raises(KVChunkCorrupt, match="arrived as"):
        KVChunk(chunk.header, None).verified(chunk.header)
    with _pytest.raises(KVChunkCorrupt, match="checksum"):
        KVChunk(chunk.header, data[::-1].copy()).verified(chunk.header)


def test_chunks_are_powers_of_two_of_whole_blocks_and_cover_every_block_and_layer():
    from workers.kv_transfer import plan_chunks

    for blocks, layers, per_layer, chunk in [(19, 2, 1000, 7000), (5, 3, 4096, 1 << 20), (3, 4, 1000, 1500), (1, 1, 10, 1)]:
        plan = plan_chunks(blocks, layers, per_layer, chunk)
        covered = [(b, l) for b0, b1, l0, l1 in plan for b in range(b0, b1) for l in range(l0, l1)]
        assert sorted(covered) == [(b, l) for b in range(blocks) for l in range(layers)]  # each once
        for b0, b1, l0, l1 in plan:
            assert (b1 - b0) * (l1 - l0) * per_layer <= max(chunk, per_layer)
            if b1 < blocks:  # every chunk but the last: a page bucket's worth, written without padding
                assert (b1 - b0) & (b1 - b0 - 1) == 0
    assert plan_chunks(19, 2, 1000, 7000)[0][:2] == (0, 2)  # 3 blocks fit: 2 taken


def test_a_senders_let_go_sliding_layers_are_not_sent():
    """Blocks whose sliding-window layers the sender let go of go as runs of the other layers only."""
    from workers.kv_transfer import plan_chunks

    window = (0, 1, 3, 4)  # layers 2 and 5 are full-attention layers
    for blocks, per_layer, chunk, skip in [(19, 1000, 7000, 11), (5, 4096, 1 << 20, 5), (3, 1000, 1500, 1), (4, 10, 1, 9)]:
        plan = plan_chunks(blocks, 6, per_layer, chunk, window, skip)
        covered = sorted((b, l) for b0, b1, l0, l1 in plan for b in range(b0, b1) for l in range(l0, l1))
        want = [(b, l) for b in range(blocks) for l in range(6) if b >= skip or l not in window]
        assert covered == want
        assert all((b1 - b0) * (l1 - l0) * per_layer <= max(chunk, per_layer) for b0, b1, l0, l1 in plan)


def test_the_parts_of_several_hosts_become_one_numbered_chunk_list():
    import numpy as np

    from workers.kv_transfer import merge_published
    from workers.messages import KVChunk

    data = np.ones((2, 1, 4), np.float32)
    host0 = (KVChunk.of("r", 0, "kv", 0, 2, 0, 1, data).header, KVChunk.of("r", 1, "state", 0, 0, 0, 0, data).header)
    host1 = (KVChunk.of("r", 0, "kv", 2, 4, 0, 1, data).header,)
    headers, handles = merge_published([(host0, ("a", "b")), (host1, ("c",))])
    assert [h.index for h in headers] == [0, 1, 2] and handles == ("a", "b", "c")
    assert [(h.kind, h.block_start) for h in headers] == [("kv", 0), ("state", 0), ("kv", 2)]
    assert headers[2].checksum == host1[0].checksum


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


def test_only_the_blocks_the_decode_side_lacks_move(model_dir):
    """The decode worker's own prefix cache holds the prompt's first blocks (an earlier request shared
    them): the chunks of those blocks are not fetched, and the output is still exactly one engine's."""
    import asyncio

    async def scenario():
        prefill, decode = worker_pair(model_dir, chunk_bytes=1)  # a chunk per block
        try:
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            shared = prompts(1, seed=30, lo=48, hi=49)[0]
            prompt = shared + prompts(1, seed=31, lo=24, hi=25)[0]
            earlier = [o async for o in decode.stream(DecodeRequest("e", shared + [7], params, "local"))]
            assert earlier[-1].finished
            handoff = await prefill.prefill(PrefillRequest("r", prompt, params))
            outs = [
                o async for o in decode.stream(DecodeRequest("r", prompt, params, "local", handoff), None, lambda: prefill.release("r"))
            ]
            single = [o async for o in decode.stream(DecodeRequest("s", prompt, params, "local"))]
            return handoff, outs, single, decode.counters
        finally:
            prefill.engine.shutdown()
            decode.engine.shutdown()

    handoff, outs, single, counters = asyncio.run(scenario())
    cached = sum(h.nbytes for h in handoff.chunks if h.block_end <= 6)  # the 48 shared tokens: 6 blocks of 8
    assert cached == handoff.nbytes * 6 // 9  # of the prompt's 9 blocks
    assert counters.handoffs == 1 and counters.import_failures == 0
    assert counters.skipped_bytes == cached and counters.handoff_bytes == handoff.nbytes - cached
    tokens = handoff.first.token_ids + [t for o in outs for t in o.token_ids]
    assert tokens == [t for o in single for t in o.token_ids]


@pytest.mark.parametrize("late_importer", [False, True])
def test_a_handoff_whose_whole_prompt_the_decode_side_has_cached_moves_nothing_and_completes(model_dir, late_importer):
    """Seen in the cluster suite: the same prompt twice, its length a multiple of the block size, so the
    decode worker's prefix cache held every block: no chunk was needed, the KV was never marked ready and
    the request waited forever. `late_importer`: the importer wakes up after the request's last token (seen
    in CI under load): it was cancelled then, and the handoff was missing from the counters."""
    import asyncio

    async def scenario():
        prefill, decode = worker_pair(model_dir)
        if late_importer:
            call = decode.engine.call

            async def late_call(fn):
                result = await call(fn)
                await asyncio.sleep(0.5)  # the request decodes its 4 tokens and ends meanwhile
                return result

            decode.engine.call = late_call
        try:
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            prompt = prompts(1, seed=34, lo=48, hi=49)[0]  # 6 whole blocks of 8
            first = [o async for o in decode.stream(DecodeRequest("e", prompt + [9], params, "local"))]
            handoff = await prefill.prefill(PrefillRequest("r", prompt, params))
            outs = await asyncio.wait_for(
                _collect(decode.stream(DecodeRequest("r", prompt, params, "local", handoff), None, lambda: prefill.release("r"))), 60
            )
            single = [o async for o in decode.stream(DecodeRequest("s", prompt, params, "local"))]
            await until(lambda: decode.counters.handoffs + decode.counters.import_failures > 0)  # the importer counts after the stream
            return first, handoff, outs, single, decode.counters
        finally:
            prefill.engine.shutdown()
            decode.engine.shutdown()

    first, handoff, outs, single, counters = asyncio.run(scenario())
    assert first[-1].finished and outs[-1].finished
    assert counters.handoff_bytes == 0 and counters.skipped_bytes == handoff.nbytes and counters.import_failures == 0
    tokens = handoff.first.token_ids + [t for o in outs for t in o.token_ids]
    assert tokens == [t for o in single for t in o.token_ids]


async def _collect(stream) -> list:
    return [o async for o in stream]


def test_the_prefill_engine_keeps_stepping_while_an_export_is_stuck(model_dir, monkeypatch):
    """The export (waiting for the host copy, cutting and checksumming chunks) runs off the engine thread:
    with it blocked, the same engine still runs other requests to the end; unblocked, the handoff completes."""
    import asyncio
    import threading

    from workers import worker as worker_module
    from workers.kv_transfer import KVExport
    from workers.worker import PrefillWorker

    release_export = threading.Event()
    real_build = KVExport.build

    def stuck_build(staged, chunk_bytes, reserve=None):
        assert threading.current_thread() is not threading.main_thread()
        release_export.wait(60)
        return real_build(staged, chunk_bytes, reserve)

    monkeypatch.setattr(worker_module.KVExport, "build", staticmethod(stuck_build))

    async def scenario():
        prefill = PrefillWorker(EngineConfig(model=str(model_dir), worker_id="p0", **ARGS))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            prompt, other = prompts(2, seed=32, lo=40, hi=41)
            handing_off = asyncio.create_task(prefill.prefill(PrefillRequest("r", prompt, params)))
            await until(lambda: prefill.engine.core.stats().num_held == 0 and "r" not in prefill.engine.core.scheduler.requests, timeout=60)
            outs = [d async for d in prefill._deltas("q", other, params)]  # a whole request meanwhile
            assert not handing_off.done()
            release_export.set()
            handoff = await asyncio.wait_for(handing_off, 60)
            return outs, handoff
        finally:
            release_export.set()
            prefill.engine.shutdown()

    outs, handoff = asyncio.run(scenario())
    assert outs[-1].finished and outs[-1].num_output_tokens == 8
    assert handoff.chunks and handoff.nbytes > 0


@pytest.mark.cluster
def test_object_store_handoff_and_a_prefill_process_killed_before_the_fetch(model_dir, ray_serve):
    """Real Ray: a prefill worker in its own process publishes its chunks in the object store and the handoff
    carries the references. Fetched while it lives, the KV moves (no local prefill); once the process is
    killed, its objects are gone with it: the decode worker's fetch fails (twice), it prefills locally and
    the output is still exactly one engine's."""
    import asyncio

    import ray

    from cluster.kv_transport import ObjectStoreTransport
    from workers.worker import DecodeWorker, PrefillWorker

    @ray.remote(num_cpus=0)
    class PrefillProcess:
        def __init__(self, model: str):
            self.worker = PrefillWorker(
                EngineConfig(model=model, worker_id="p0", **ARGS), transport=ObjectStoreTransport(inline_bytes=0), chunk_bytes=4096
            )

        async def prefill(self, request):
            return await self.worker.prefill(request)

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first_prompt, second_prompt = prompts(2, seed=33, lo=40, hi=41)
    prefill = PrefillProcess.remote(str(model_dir))
    live = ray.get(prefill.prefill.remote(PrefillRequest("live", first_prompt, params)), timeout=300)
    orphaned = ray.get(prefill.prefill.remote(PrefillRequest("orphaned", second_prompt, params)), timeout=120)
    assert live.transport == "object_store" and len(live.sources) == len(live.chunks) > 1
    assert all(isinstance(ref, ray.ObjectRef) for ref in live.sources)

    async def scenario():
        decode = DecodeWorker(EngineConfig(model=str(model_dir), worker_id="d0", **ARGS), transport=ObjectStoreTransport())
        try:
            outs = {}
            outs["live"] = [o async for o in decode.stream(DecodeRequest("live", first_prompt, params, "local", live))]
            assert decode.counters.handoffs == 1 and decode.counters.import_failures == 0
            ray.kill(prefill)
            await until(lambda: _object_lost(orphaned.sources[-1]), timeout=60)  # Ray frees a dead owner's objects
            outs["orphaned"] = [o async for o in decode.stream(DecodeRequest("orphaned", second_prompt, params, "local", orphaned))]
            for rid, prompt in (("live", first_prompt), ("orphaned", second_prompt)):
                outs[rid + "-single"] = [o async for o in decode.stream(DecodeRequest(rid + "-single", prompt, params, "local"))]
            return outs, decode.counters
        finally:
            decode.engine.shutdown()

    outs, counters = asyncio.run(scenario())
    assert counters.handoffs == 1 and counters.import_failures == 1 and counters.refetched_chunks >= 1
    for rid, handoff in (("live", live), ("orphaned", orphaned)):
        tokens = handoff.first.token_ids + [t for o in outs[rid] for t in o.token_ids]
        assert tokens == [t for o in outs[rid + "-single"] for t in o.token_ids], rid


def _object_lost(ref) -> bool:
    import ray

    try:
        ray.get(ref, timeout=1)
        return False
    except ray.exceptions.OwnerDiedError:
        return True
    except ray.exceptions.GetTimeoutError:
        return False


def test_shared_memory_handoff_reuses_its_arena_and_refuses_another_node(model_dir, ray_serve):
    """Real Ray, `shared_memory` transport: a prefill worker in its own process writes its chunks into its
    shared-memory arena and the handoff carries where; the decode worker (this process, the same node)
    reads them in place: no local prefill, one engine's tokens. A released handoff's region is free again.
    A handle naming another node cannot be read here: the decode worker prefills locally, same tokens. An
    export larger than the arena goes through the object store. The prefill process killed, a decode process that had not mapped its arena prefills locally."""
    import asyncio
    import dataclasses
    import os

    import ray

    from cluster import kv_transport
    from cluster.kv_transport import Arena, SharedMemoryTransport, ShmChunk
    from workers.worker import DecodeWorker, PrefillWorker

    @ray.remote(num_cpus=0)
    class PrefillProcess:
        def __init__(self, model: str):
            self.transport = SharedMemoryTransport(8 << 20, inline_bytes=0)
            self.worker = PrefillWorker(EngineConfig(model=model, worker_id="p0", **ARGS), transport=self.transport, chunk_bytes=4096)

        async def prefill(self, request):
            return await self.worker.prefill(request)

        async def release(self, request_id):
            return await self.worker.release(request_id)

        def arena(self):
            a = self.transport.arena
            return a.fd, a.nbytes, a.free_bytes

        def use_arena(self, nbytes):
            self.transport.arena = Arena(nbytes)

        def fallbacks(self):
            return self.transport.fallbacks

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    p1, p2, p3 = prompts(3, seed=34, lo=40, hi=41)
    prefill = PrefillProcess.remote(str(model_dir))
    live = ray.get(prefill.prefill.remote(PrefillRequest("live", p1, params)), timeout=300)
    assert live.transport == "shared_memory" and len(live.sources) == len(live.chunks) > 1
    assert all(isinstance(h, ShmChunk) for h in live.sources)
    fd, size, free = ray.get(prefill.arena.remote())
    assert free == size - sum(-(-h.nbytes // 64) * 64 for h in live.chunks)

    async def decode_all(pairs):
        decode = DecodeWorker(EngineConfig(model=str(model_dir), worker_id="d0", **ARGS), transport=kv_transport.ObjectStoreTransport())
        try:
            outs = {}
            for rid, prompt, handoff in pairs:
                outs[rid] = [o async for o in decode.stream(DecodeRequest(rid, prompt, params, "local", handoff))]
                outs[rid + "-single"] = [o async for o in decode.stream(DecodeRequest(rid + "-single", prompt, params, "local"))]
            return outs, decode.counters
        finally:
            decode.engine.shutdown()

    def check(outs, rid, handoff):
        tokens = handoff.first.token_ids + [t for o in outs[rid] for t in o.token_ids]
        assert tokens == [t for o in outs[rid + "-single"] for t in o.token_ids], rid

    outs, counters = asyncio.run(decode_all([("live", p1, live)]))
    assert counters.handoffs == 1 and counters.import_failures == 0
    check(outs, "live", live)
    assert ray.get(prefill.release.remote("live"))
    assert ray.get(prefill.arena.remote())[2] == size  # its region is free again
    # The next export reuses the arena from its start; its handles moved to another node fail to map here.
    second = ray.get(prefill.prefill.remote(PrefillRequest("second", p2, params)), timeout=120)
    assert second.sources[0].offset == 64 and second.sources[0].fd == fd  # after the arena's tag
    elsewhere = dataclasses.replace(second, sources=tuple(dataclasses.replace(h, node="another-node") for h in second.sources))
    outs, counters = asyncio.run(decode_all([("elsewhere", p2, elsewhere)]))
    assert counters.import_failures == 1
    check(outs, "elsewhere", elsewhere)
    # An export that does not fit the arena goes through the object store.
    ray.get(prefill.use_arena.remote(64))
    spilled = ray.get(prefill.prefill.remote(PrefillRequest("spilled", p1[::-1], params)), timeout=120)
    assert all(isinstance(h, ray.ObjectRef) for h in spilled.sources) and ray.get(prefill.fallbacks.remote()) == 1
    outs, counters = asyncio.run(decode_all([("spilled", p1[::-1], spilled)]))
    assert counters.handoffs == 1 and counters.import_failures == 0
    check(outs, "spilled", spilled)
    ray.get(prefill.use_arena.remote(8 << 20))
    # Its owner killed, the arena goes with it (no name to leave behind); unmapped here, it cannot be read.
    orphaned = ray.get(prefill.prefill.remote(PrefillRequest("orphaned", p3, params)), timeout=120)
    pid = orphaned.sources[0].pid
    ray.kill(prefill)
    asyncio.run(until(lambda: not os.path.exists(f"/proc/{pid}"), timeout=60))
    kv_transport._ARENAS._maps.clear()
    outs, counters = asyncio.run(decode_all([("orphaned", p3, orphaned)]))
    assert counters.import_failures == 1
    check(outs, "orphaned", orphaned)


def test_an_arenas_free_regions_merge_and_are_reused_first_fit():
    from cluster.kv_transport import Arena

    arena = Arena(1024)
    try:
        a, b, c = arena.allocate(100), arena.allocate(200), arena.allocate(64)
        assert (a, b, c) == (64, 192, 448)  # 64-byte aligned, after the arena's tag
        assert arena.allocate(1024) is None
        arena.free(b, 200)
        assert arena.allocate(129) == 192  # the freed region, first fit
        arena.free(192, 129)
        arena.free(a, 100)
        arena.free(c, 64)
        assert arena.free_bytes == 1024 and arena.allocate(1024) == 64  # all merged back into one
    finally:
        arena.close()


def test_a_copy_checksummed_on_the_way_equals_the_copy_and_its_checksum():
    """`copy_checksummed` hashes each tile right after copying it: the same bytes and the same XXH3 as a plain
    copy and `_checksum`, for sizes around the tile, float32 and bfloat16, and a non-contiguous layer range."""
    import ml_dtypes
    import numpy as np

    from workers.messages import CHECKSUM_TILE, _checksum, copy_checksummed

    rng = np.random.default_rng(0)
    for n in [1, 7, CHECKSUM_TILE // 4 - 1, CHECKSUM_TILE // 4, CHECKSUM_TILE // 4 + 3, 3 * CHECKSUM_TILE // 4 + 5]:
        for dtype in (np.float32, ml_dtypes.bfloat16):
            data = rng.standard_normal(n).astype(dtype)
            out = np.full(data.nbytes + 64, 7, np.uint8)  # longer than the data: the rest is left alone
            assert copy_checksummed(data, out[: data.nbytes]) == _checksum(data)
            assert (out[: data.nbytes].view(dtype) == data).all() and (out[data.nbytes :] == 7).all()
    blocks = rng.standard_normal((4, 5, 8, 16)).astype(np.float32)
    layers = blocks[1:3, 2:4]  # a layer range of whole blocks: not contiguous
    out = np.empty(layers.nbytes, np.uint8)
    assert copy_checksummed(layers, out) == _checksum(np.ascontiguousarray(layers))
    assert (out.view(np.float32).reshape(layers.shape) == layers).all()


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30])
def test_an_export_built_into_a_transports_buffers_is_the_same_export_copied_once(model_dir, chunk_bytes):
    """With `reserve`, each KV chunk is copied into the transport's buffer as its piece arrives: the headers
    (checksums included) equal those of an export built without it, and each chunk's data is its buffer
    (nothing else copies it afterwards), whole blocks and layer ranges alike."""
    import numpy as np

    from workers.kv_transfer import KVExport

    prefill = engine(model_dir, "p0")
    prefill.runner.export_piece_blocks = 2  # several pieces: each chunk copied as its own piece arrives
    prompt = prompts(1, seed=35, lo=40, hi=41)[0]
    prefill.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    run_to_end(prefill, "r")
    staged = prefill.take_staged("r")
    plain = KVExport.build(staged, chunk_bytes)
    buffers = []

    def reserve(request_id, sizes):
        assert request_id == "r" and sizes == [c.header.nbytes for c in plain.chunks]
        buffers.extend(np.zeros(n, np.uint8) for n in sizes)
        return buffers

    placed = KVExport.build(staged, chunk_bytes, reserve)
    assert placed.headers == plain.headers and len(placed.chunks) > 2
    assert any(h.layer_end - h.layer_start < prefill.cfg.num_kv_layers for h in placed.headers) == (chunk_bytes == 1)
    for chunk, buffer in zip(placed.chunks, buffers, strict=True):
        assert np.shares_memory(chunk.data, buffer)
        assert (chunk.verified(chunk.header) == plain.chunks[chunk.header.index].data).all()
    assert KVExport.build(staged, chunk_bytes, lambda rid, sizes: None).headers == plain.headers  # no buffers offered


def test_a_shared_memory_export_is_written_once_and_its_regions_are_freed_whatever_happens():
    """The shared-memory transport hands out arena buffers for the KV chunks (`reserve`); `publish` copies
    only the chunks it did not place (a state chunk) and every handle reads back the chunk's bytes. Its
    regions are freed on unpublish, also for a reservation whose export never got published, and an export
    at most `inline_bytes` is not placed at all. A bfloat16 chunk reads back as bfloat16 (it read as raw
    bytes, and failed its check)."""
    import asyncio

    import ml_dtypes
    import numpy as np

    from cluster.kv_transport import _ARENAS, SharedMemoryTransport
    from workers.kv_transfer import KVExport
    from workers.messages import KVChunk, KVChunkHeader, copy_checksummed

    transport = SharedMemoryTransport(1 << 20, inline_bytes=100)
    assert transport.reserve("small", [40, 60]) is None
    rng = np.random.default_rng(1)
    kv = [rng.standard_normal((2, 3, 5)).astype(dtype) for dtype in (np.float32, ml_dtypes.bfloat16)]
    buffers = transport.reserve("r", [a.nbytes for a in kv])
    chunks = [
        KVChunk(KVChunkHeader.of("r", i, "kv", 2 * i, 2 * i + 2, 0, 3, a, copy_checksummed(a, b)), b.view(a.dtype).reshape(a.shape))
        for i, (a, b) in enumerate(zip(kv, buffers))
    ]
    state = rng.standard_normal(33).astype(np.float32)
    chunks.append(KVChunk.of("r", 2, "state", 0, 0, 0, 0, state))
    used = transport.arena.nbytes - transport.arena.free_bytes
    handles = asyncio.run(transport.publish(KVExport("r", chunks)))
    assert [h.offset for h in handles[:2]] == [int(b.ctypes.data - transport.arena.view(0, 1).ctypes.data) for b in buffers]
    assert transport.arena.nbytes - transport.arena.free_bytes == used + 192  # the state's 132 bytes, aligned
    assert [h.dtype for h in handles] == ["float32", "bfloat16", "float32"]
    for chunk, handle in zip(chunks, handles):
        assert (_ARENAS.read(handle) == chunk.data).all()
        assert chunk.verified(chunk.header) is chunk.data
    transport.unpublish("r")
    transport.reserve("failed", [1000, 3000])  # its export failed before it was published
    transport.unpublish("failed")
    assert transport.arena.free_bytes == transport.arena.nbytes and transport.num_published == 0


def test_the_object_store_carries_a_bfloat16_chunk_as_its_bytes(ray_serve):
    """Real Ray: chunks go into the object store as raw bytes and come out as the header's dtype and shape,
    read in place (Ray pickled a bfloat16 array: 3x slower to put, and copied again on the way out)."""
    import asyncio

    import ml_dtypes
    import numpy as np

    from cluster.kv_transport import ObjectStoreTransport
    from workers.kv_transfer import KVExport
    from workers.messages import KVChunk

    rng = np.random.default_rng(2)
    data = [rng.standard_normal((4, 2, 8, 16)).astype(dtype) for dtype in (ml_dtypes.bfloat16, np.float32)]
    export = KVExport("r", [KVChunk.of("r", i, "kv", 4 * i, 4 * i + 4, 0, 2, a) for i, a in enumerate(data)])
    transport = ObjectStoreTransport(inline_bytes=0)

    async def roundtrip():
        handles = await transport.publish(export)
        return [await transport.fetch(c.header, h) for c, h in zip(export.chunks, handles)]

    for chunk, got in zip(export.chunks, asyncio.run(roundtrip())):
        assert got.dtype == chunk.data.dtype and (chunk.verified(chunk.header) == got).all()
        assert not got.flags.writeable  # the store's own buffer, not a copy
        KVChunk(chunk.header, got).verified(chunk.header)
    transport.unpublish("r")
