"""Shared settings of the engine tests that run small random models through `LLM` on CPU."""

from __future__ import annotations

import random
from dataclasses import replace

from bench import scratch_dir


def small_engine_args(cache_name: str) -> dict:
    """Small static shapes (block 8, up to 8 sequences, 64-token steps, 160-token context, one bucket of
    each: see ENGINE_ARGS) and one persistent XLA cache per test module, so each module's later engines
    reuse its first one's binaries; warmup off: only the programs a test uses are compiled."""
    return dict(
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=160,
        token_buckets=[64],
        page_buckets=[20],
        compilation_cache_dir=scratch_dir(f"moray-{cache_name}-xla-"),
        warmup=False,
    )


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    """n random token-id prompts of lengths in [lo, hi)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


# One token bucket and one page bucket: each engine compiles one step program (two with a sliding window
# or a hybrid's decode-only steps). The tiny models are compile-bound: a step of 64 padded tokens runs in
# milliseconds, a program takes ~1.2 s to compile, and most engines live for one test.
ENGINE_ARGS = dict(
    block_size=8,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    token_buckets=[64],
    page_buckets=[16],
    compilation_cache_dir=None,
)
# Two of each, for the tests of bucket selection and compilation: 4 step programs per engine.
BUCKETED_ENGINE_ARGS = {**ENGINE_ARGS, "token_buckets": [8, 64], "page_buckets": [4, 16]}


def run_to_end(engine, request_id: str, outputs: dict | None = None):
    """Steps `engine` (an EngineCore) until it has nothing left to do; returns `request_id`'s whole output
    (a `RequestOutput` accumulated from its deltas). `outputs`: accumulate every request's there too."""
    from workers.engine.output_processor import RequestOutput

    outputs = {} if outputs is None else outputs
    while engine.has_unfinished():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, RequestOutput(delta.request_id, [])).add(delta)
    return outputs.get(request_id)


def kv_handoff(prefill, decode, rid, prompt, params, chunk_bytes=1, reverse=False):
    """Prefill `prompt` on one engine, move its KV to the other through the transfer layer's chunks (the
    smallest: one block each by default; in reverse order if asked), decode there. Returns (the prefill's
    output: the first token, the whole output as one engine would give it in a list, the decode side's
    own output)."""
    from workers.engine.engine import KVImport

    prefill.add_request(rid, prompt, params.model_copy(update={"max_tokens": 1}), hold_kv=True)
    first = run_to_end(prefill, rid)
    window_start = prefill.staged[rid].window_start_block  # as the prefill worker's handoff carries it
    decode.add_request(rid, prompt, params, kv_import=KVImport(first.token_ids[0], first.num_cached_tokens, window_start))
    move_kv(prefill, decode, rid, chunk_bytes, reverse)
    rest = run_to_end(decode, rid)  # the decode side's deltas: everything after the first token
    whole = replace(rest, token_ids=first.token_ids + rest.token_ids, text=first.text + rest.text)
    return first, [whole], rest


def move_kv(prefill, decode, rid, chunk_bytes=1, reverse=False) -> list:
    """The transfer layer's two halves between two engines in this process, synchronously: the staged
    copy cut into checksummed chunks, each written unless the decode side's prefix cache has it. Returns
    the chunks written."""
    from workers.kv_transfer import KVExport, needed

    staged = prefill.take_staged(rid)
    assert staged is not None and prefill.stats().num_held == 0, "the prefill engine stages the KV and frees the blocks"
    export = KVExport.build(staged, chunk_bytes)
    from_block = decode.import_from_block(rid)
    chunks = [export.chunks[i] for i in needed(export.headers, from_block)]
    for chunk in reversed(chunks) if reverse else chunks:
        h, data = chunk.header, chunk.verified(chunk.header)
        assert decode.import_state(rid, data) if h.kind == "state" else decode.import_kv(rid, h.block_start, h.layer_start, data)
    assert decode.finish_import(rid)
    return chunks
