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
A model with a sliding-window cache group (`window_cache.py`) keeps one tier per group, each holding its
group's layers; the manager publishes what a hit can reuse from both (the tiers publish nothing).

A `HostChannel` is one cache group's traffic with its tier: the manager queues evicted device blocks to
save and host blocks to load; the engine copies them around its steps (`engine.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

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
        # Told (hash, held) whenever a block is put (new or already held) or dropped: a manager that publishes
        # for the tier.
        self.on_change: Callable[[int, bool], None] | None = None

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

    def find(self, block_hash: int) -> int | None:
        """The block's slot, or None; touches nothing (a probe: `touch` what is then used)."""
        return self.slot_of.get(block_hash)

    def touch(self, slots: list[int], session: str | None = None) -> None:
        """Marks slots most recently used, now belonging to `session`."""
        self.order.touch(session)
        for s in slots:
            self.order.add(s, session)

    def read(self, slots: list[int]) -> np.ndarray:
        """A copy of those blocks [n, layers, ...]: later saves may reuse the slots before it is loaded."""
        return self.data[slots].copy()

    def put(self, block_hash: int, parent: int | None, block: np.ndarray, session: str | None = None) -> None:
        """Keeps one block (a copy of its device pages [layers, ...]); the same hash twice keeps the first."""
        self.order.touch(session)
        s = self.slot_of.get(block_hash)
        if s is not None:
            self.order.add(s, session)
            if self.on_change is not None:
                self.on_change(block_hash, True)
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
        if self.on_change is not None:
            self.on_change(block_hash, True)

    def _drop(self, slot: int) -> None:
        h, parent = self.hash_of[slot], self.parent_of[slot]
        del self.slot_of[h]
        self.hash_of[slot] = self.parent_of[slot] = None
        self._free.append(slot)
        self.stats.blocks_evicted += 1
        self._emit(KVEventKind.REMOVED, h, parent)
        if self.on_change is not None:
            self.on_change(h, False)

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


@dataclass
class HostChannel:
    """One cache group's copies to and from its host tier, queued by the KV-cache manager and carried out by
    the engine around its steps: evicted device blocks wait in `pending_saves` (block, hash, parent, session)
    until their copy is dispatched, then in `inflight_saves` (saves, device copy) until it is stored; host
    blocks a request reuses wait in `pending_loads` (request, device blocks, host pages)."""

    tier: HostKVTier
    group: int = 0  # the cache group (window_cache.py's FULL_GROUP / WINDOW_GROUP; 0: every layer of one pool)
    pending_saves: list[tuple[int, int, int | None, str | None]] = field(default_factory=list)
    inflight_saves: list[tuple[list, object]] = field(default_factory=list)
    pending_loads: list[tuple[str, list[int], object]] = field(default_factory=list)

    def save(self, block: int, block_hash: int, parent: int | None, session: str | None) -> None:
        self.pending_saves.append((block, block_hash, parent, session))

    def load(self, request_id: str, block_ids: list[int], slots: list[int]) -> None:
        """Queues host `slots` to be copied into device `block_ids`; read now, as later saves of this very step
        may reuse the slots before the copy runs."""
        self.pending_loads.append((request_id, list(block_ids), self.tier.read(list(slots))))
        self.tier.stats.blocks_loaded += len(slots)

    def take_pending_saves(self) -> list[tuple[int, int, int | None, str | None]]:
        saves, self.pending_saves = self.pending_saves, []
        return saves

    def take_inflight_saves(self) -> list[tuple[list, object]]:
        saves, self.inflight_saves = self.inflight_saves, []
        return saves

    def take_pending_loads(self) -> list[tuple[str, list[int], object]]:
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def clear(self) -> None:
        """Forgets queued saves and the tier's blocks (a prefix-cache reset; loads already read stay)."""
        self.pending_saves, self.inflight_saves = [], []
        self.tier.clear()
