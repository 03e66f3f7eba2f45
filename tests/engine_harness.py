"""Shared settings of the engine tests that run small random models through `LLM` on CPU."""

from __future__ import annotations

import random
import tempfile


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
