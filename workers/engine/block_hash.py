"""Chained block hashes: the one function the engine (what it caches) and the router (what a request
would hit) both use, so the two can never disagree.

h_i = H(h_{i-1}, token ids of block i, extra keys), with H = the first 8 bytes of SHA-256 over a canonical
encoding (little-endian int64 parent, int32 token ids, UTF-8 extra keys). Stable across processes and
machines, unlike Python's salted `hash()`. Only full blocks are hashed: a partial trailing block is
neither cached nor indexed.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

_DOMAIN = b"moray-kv-block-v1"
ROOT_PARENT = 0  # the parent of a sequence's first block


def hash_block(parent: int, token_ids: Sequence[int], extra_keys: str = "") -> int:
    h = hashlib.sha256(_DOMAIN)
    h.update(int(parent).to_bytes(8, "little", signed=False))
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    if extra_keys:
        h.update(extra_keys.encode())
    return int.from_bytes(h.digest()[:8], "little")


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: str = "", start: int = 0, parent: int = ROOT_PARENT) -> list[int]:
    """Hashes of the full blocks of `token_ids` from block index `start` (given the hash before it)."""
    out = []
    for i in range(start, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        out.append(parent)
    return out
