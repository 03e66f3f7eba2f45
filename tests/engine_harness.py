"""Shared settings of the engine tests that run small random models through `LLM` on CPU."""

from __future__ import annotations

import random
import tempfile
from dataclasses import replace


def small_engine_args(cache_name: str) -> dict:
    """Small static shapes (block 8, up to 8 sequences, 64-token steps, 160-token context) and one
    persistent XLA cache per test module, so each module's later engines reuse its first one's binaries;
    warmup off: only the programs a test uses are compiled."""
    return dict(
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=160,
        token_buckets=[8, 64],
        page_buckets=[4, 20],
        compilation_cache_dir=tempfile.mkdtemp(prefix=f"moray-{cache_name}-xla-"),
        warmup=False,
    )


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    """n random token-id prompts of lengths in [lo, hi)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


# Small static-shape grid so each engine compiles only a handful of programs (the engine tests' default).
ENGINE_ARGS = dict(
    block_size=8,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    token_buckets=[8, 64],
    page_buckets=[4, 16],
    compilation_cache_dir=None,
)


def run_to_end(engine, request_id: str, outputs: dict | None = None):
    """Steps `engine` (an EngineCore) until it has nothing left to do; returns `request_id`'s whole output
    (a `RequestOutput` accumulated from its deltas). `outputs`: accumulate every request's there too."""
    from workers.engine.output_processor import RequestOutput

    outputs = {} if outputs is None else outputs
    while engine.has_unfinished():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, RequestOutput(delta.request_id, [])).add(delta)
    return outputs.get(request_id)


def kv_handoff(prefill, decode, rid, prompt, params, chunk_layers=1, reverse=False):
    """Prefill `prompt` on one engine, move its KV to the other in chunks of layers (in reverse order if
    asked), decode there. Returns (the prefill's output: the first token, the whole output as one engine
    would give it in a list, the decode side's own output)."""
    from workers.engine.engine import KVImport

    prefill.add_request(rid, prompt, params.model_copy(update={"max_tokens": 1}), hold_kv=True)
    first = run_to_end(prefill, rid)
    decode.add_request(rid, prompt, params, kv_import=KVImport(first.token_ids[0], first.num_cached_tokens))
    layers = prefill.cfg.num_layers
    chunks = [(l, prefill.export_kv(rid, l, min(l + chunk_layers, layers))) for l in range(0, layers, chunk_layers)]
    assert prefill.release_kv(rid)
    for start, data in reversed(chunks) if reverse else chunks:
        assert decode.import_kv(rid, start, data)
    rest = run_to_end(decode, rid)  # the decode side's deltas: everything after the first token
    whole = replace(rest, token_ids=first.token_ids + rest.token_ids, text=first.text + rest.text)
    return first, [whole], rest
