"""A host-memory tier below the device KV cache (issue #15; single-rank engines).

A cached device block chosen for eviction is copied here instead of being dropped; a request whose
prefix continues past the device cache finds the following blocks here and gets them copied back into
fresh device blocks before its first step, instead of recomputing them. Blocks are keyed by their chained
hash (`block_hash`), so a block is reusable exactly when the device cache would have reused it.

Storage is one numpy array [num_blocks, layers, block_size, *kv_transport_dims] in the model's dtype,
allocated up front (untouched pages cost no RSS). Eviction follows the same session-aware order as the
device cache (`retention.py`): sessionless and ended conversations first, then live sessions.
Every block kept or dropped here is published as a KV event with `tier="host"`, so the router's index
knows which worker holds which prefix in which tier; a CLEARED event covers both tiers.
Hybrid models keep a second instance for their linear-attention state snapshots (one packed float32
state per block boundary, `state_cache.py`); it publishes the boundaries, their attention tier nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kv_events import KVEventKind, KVEventPublisher
from .retention import SessionAwareLRU

HOST_TIER = "host"


@dataclass
class HostTierStats:
    blocks_saved: int = 0  # device blocks copied to the host on eviction
    blocks_loaded: int = 0  # host blocks copied back to the device for a request
    blocks_evicted: int = 0  # host blocks dropped for room


class HostKVTier:
    def __init__(
        self,
        num_blocks: int,
        block_shape: tuple[int, ...],
        dtype,
        events: KVEventPublisher | None = None,
        retention: SessionAwareLRU | None = None,
        block_size: int | None = None,
    ):
        if num_blocks < 1:
            raise ValueError("a host KV tier needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size if block_size is not None else block_shape[1]  # tokens an event covers
        self.data = np.zeros((num_blocks, *block_shape), dtype)
        self.events = events
        self.slot_of: dict[int, int] = {}  # block hash -> slot
        self.hash_of: list[int | None] = [None] * num_blocks
        self.parent_of: list[int | None] = [None] * num_blocks
        self.order = retention if retention is not None else SessionAwareLRU()  # every occupied slot, in eviction order
        self._free = list(range(num_blocks - 1, -1, -1))
        self.stats = HostTierStats()

    @property
    def num_used(self) -> int:
        return len(self.slot_of)

    @property
    def block_nbytes(self) -> int:
        return self.data[0].nbytes

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.slot_of

    def lookup(self, hashes: list[int], session: str | None = None) -> list[int]:
        """Slots of the longest run of `hashes` held here (from the first); each found one is touched
        (most recently used, now belonging to `session`)."""
        self.order.touch(session)
        slots = []
        for h in hashes:
            s = self.slot_of.get(h)
            if s is None:
                break
            self.order.add(s, session)
            slots.append(s)
        return slots

    def read(self, slots: list[int]) -> np.ndarray:
        """A copy of those blocks [n, layers, ...]: later saves may reuse the slots before it is loaded."""
        return self.data[slots].copy()

    def put(self, block_hash: int, parent: int | None, block: np.ndarray, session: str | None = None) -> None:
        """Keeps one block (a copy of its device pages [layers, ...]); the same hash twice keeps the first."""
        self.order.touch(session)
        s = self.slot_of.get(block_hash)
        if s is not None:
            self.order.add(s, session)
            return
        if not self._free:
            self._drop(self.order.pop()[0])
        s = self._free.pop()
        self.data[s] = block
        self.slot_of[block_hash] = s
        self.hash_of[s], self.parent_of[s] = block_hash, parent
        self.order.add(s, session)
        self.stats.blocks_saved += 1
        self._emit(KVEventKind.STORED, block_hash, parent)

    def _drop(self, slot: int) -> None:
        h, parent = self.hash_of[slot], self.parent_of[slot]
        del self.slot_of[h]
        self.hash_of[slot] = self.parent_of[slot] = None
        self._free.append(slot)
        self.stats.blocks_evicted += 1
        self._emit(KVEventKind.REMOVED, h, parent)

    def _emit(self, kind: KVEventKind, block_hash: int, parent: int | None) -> None:
        if self.events is not None:
            self.events.emit(kind, block_hash, parent, self.block_size, tier=HOST_TIER)

    def clear(self) -> None:
        """Forgets every block without events (the caller publishes one CLEARED for all tiers)."""
        self.slot_of.clear()
        self.order.clear()
        self.hash_of = [None] * self.num_blocks
        self.parent_of = [None] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))
