"""A host-memory tier below the device KV cache (issue #15, first part: attention-only engines).

A cached device block chosen for eviction is copied here instead of being dropped; a request whose
prefix continues past the device cache finds the following blocks here and gets them copied back into
fresh device blocks before its first step, instead of recomputing them. Blocks are keyed by their chained
hash (`block_hash`), so a block is reusable exactly when the device cache would have reused it.

Storage is one numpy array [num_blocks, layers, block_size, *kv_page_dims] in the model's dtype,
allocated up front; eviction is least recently used. The copies go through the runner's gather/scatter
(the same programs as the KV handoff) at the start of the step that needs them: a save reads the device
block before its new owner writes it, a load writes before the step reads it (dispatch order).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass
class HostTierStats:
    blocks_saved: int = 0  # device blocks copied to the host on eviction
    blocks_loaded: int = 0  # host blocks copied back to the device for a request
    blocks_evicted: int = 0  # host blocks dropped for room


class HostKVTier:
    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype):
        if num_blocks < 1:
            raise ValueError("a host KV tier needs at least one block")
        self.num_blocks = num_blocks
        self.data = np.zeros((num_blocks, *block_shape), dtype)
        self.slot_of: dict[int, int] = {}  # block hash -> slot
        self.hash_of: list[int | None] = [None] * num_blocks
        self.parent_of: list[int | None] = [None] * num_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # slots holding a block; first is evicted first
        self._free = list(range(num_blocks - 1, -1, -1))
        self.stats = HostTierStats()

    @property
    def num_used(self) -> int:
        return len(self.slot_of)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.slot_of

    def lookup(self, hashes: list[int]) -> list[int]:
        """Slots of the longest run of `hashes` held here (from the first); each found one is touched."""
        slots = []
        for h in hashes:
            s = self.slot_of.get(h)
            if s is None:
                break
            self._lru.move_to_end(s)
            slots.append(s)
        return slots

    def read(self, slots: list[int]) -> np.ndarray:
        """A copy of those blocks [n, layers, ...]: later saves may reuse the slots before it is loaded."""
        return self.data[slots].copy()

    def put(self, block_hash: int, parent: int | None, block: np.ndarray) -> None:
        """Keeps one block (a copy of its device pages [layers, ...]); the same hash twice keeps the first."""
        if block_hash in self.slot_of:
            self._lru.move_to_end(self.slot_of[block_hash])
            return
        if not self._free:
            victim, _ = self._lru.popitem(last=False)
            del self.slot_of[self.hash_of[victim]]
            self.hash_of[victim] = self.parent_of[victim] = None
            self._free.append(victim)
            self.stats.blocks_evicted += 1
        s = self._free.pop()
        self.data[s] = block
        self.slot_of[block_hash] = s
        self.hash_of[s], self.parent_of[s] = block_hash, parent
        self._lru[s] = None
        self.stats.blocks_saved += 1

    def clear(self) -> None:
        self.slot_of.clear()
        self._lru.clear()
        self.hash_of = [None] * self.num_blocks
        self.parent_of = [None] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))
