"""The hybrid cache: paged attention KV plus linear-attention state slots, behind the scheduler's one
cache interface.

Linear-attention layers (Gated DeltaNet) keep a fixed-size state per sequence instead of a growing KV
cache: a conv state [K-1, conv_dim] and a recurrent state [Hv, dk, dv] per layer, both float32. They
live in a pool of *slots* on the device (`ModelRunner.conv_states` / `rec_states`); this module decides
which slot holds what:

- Each live request (running, held for a handoff, importing) owns one *working* slot. It is
  initialised at admission: zeroed for a fresh prompt, or copied from a snapshot on a prefix hit
  (copy-on-write: the snapshot stays for the next request).
- *Snapshots*: the state at a block boundary, keyed by the chained hash of the block that ends there.
  Each step a sequence crosses a block boundary, the kernel also writes the state at the last boundary
  it crossed into a fresh snapshot slot (`StateStep.snap_*`). So a prompt's last full block always gets
  one (the next turn of a conversation hits it), and every block boundary a step ends on does. Snapshots
  have their own LRU and a configured maximum.
- A prefix is reusable only up to a boundary whose snapshot exists: the hit is the deepest such
  boundary within the run of cached attention blocks (never the whole prompt: its last token is always
  computed, and the state before it is only known at a boundary).

KV events: a hybrid engine publishes a block as STORED only when the prefix through it is reusable
(attention blocks cached and a snapshot at its end) and REMOVED when that stops being true, so the
router's prediction (the deepest published block along a request's chain) equals what the engine
reuses, to the block. The attention pool's own per-block events are not published for these models.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .block_hash import ROOT_PARENT
from .kv_cache_manager import BlockCopy, KVCacheManager
from .kv_events import KVEventKind, KVEventPublisher
from .request import Request

KEEP = -2  # StateStep.init: the working slot already holds the sequence's state
ZERO = -1  # StateStep.init: a fresh sequence starts from zeros


@dataclass(frozen=True)
class StateStep:
    """What the runner needs per scheduled sequence of a hybrid model."""

    slot: int  # the working slot
    init: int = KEEP  # KEEP, ZERO, or a snapshot slot to copy into `slot` before the step
    snap_slot: int = -1  # where to write the state after `snap_len` of this step's tokens (-1: none)
    snap_len: int = 0


class HybridPrefix(list):
    """The attention blocks of a prefix hit (a list, as the scheduler sees every cache's prefix) plus the
    snapshot slot holding the state at its end."""

    snapshot_slot: int | None = None


class StateSlotPool:
    """Slot bookkeeping: free slots, working slots by request, snapshots by block hash (LRU)."""

    def __init__(self, num_slots: int, max_snapshots: int):
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.num_slots = num_slots
        self.max_snapshots = max_snapshots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot first
        self.working: dict[str, int] = {}
        self.snapshots: OrderedDict[int, int] = OrderedDict()  # block hash -> slot; first = least recent
        self.pending: dict[str, tuple[int, int, int]] = {}  # request -> (hash, parent, slot) written this step

    @property
    def num_free(self) -> int:
        """Slots a working allocation could get (free, or held by an evictable snapshot)."""
        return len(self.free) + len(self.snapshots)

    def take(self, evict) -> int | None:
        if not self.free and self.snapshots:
            evict(next(iter(self.snapshots)))
        return self.free.pop() if self.free else None

    def give_back(self, slot: int) -> None:
        self.free.append(slot)


class HybridCacheManager:
    """The scheduler's cache for hybrid models: the attention `KVCacheManager` (one group) and the
    state slots (the other), with events describing only the reusable prefix."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        max_snapshots: int,
        enable_prefix_caching: bool = True,
        extra_keys: str = "",
        events: KVEventPublisher | None = None,
    ):
        self.attn = KVCacheManager(num_blocks, block_size, enable_prefix_caching, extra_keys, events=None)
        self.attn.pool.on_evict = self._attention_block_evicted
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events
        self.slots = StateSlotPool(num_state_slots, max_snapshots if enable_prefix_caching else 0)
        self._init: dict[str, int] = {}  # request -> how its working slot starts (ZERO or a snapshot)

    # ---------------------------------------------------------------- totals (EngineStats)

    @property
    def pool(self):
        return self.attn.pool

    @property
    def num_free_blocks(self) -> int:
        return self.attn.num_free_blocks

    @property
    def usage(self) -> float:
        return self.attn.usage

    @property
    def num_snapshots(self) -> int:
        return len(self.slots.snapshots)

    def blocks_needed(self, num_tokens: int) -> int:
        return self.attn.blocks_needed(num_tokens)

    def update_hashes(self, request: Request) -> None:
        self.attn.update_hashes(request)

    def working_slot(self, request_id: str) -> int | None:
        return self.slots.working.get(request_id)

    # ---------------------------------------------------------------- the scheduler's interface

    def host_prefix(self, request: Request, num_device_blocks: int) -> list[int]:
        """No host tier for hybrid models yet (their state snapshots would have to spill too)."""
        return []

    def cached_prefix(self, request: Request) -> HybridPrefix:
        """The deepest reusable boundary: within the cached attention blocks, with a snapshot, and before
        the last token (which is always computed)."""
        prefix = HybridPrefix()
        blocks = self.attn.cached_prefix(request)
        limit = min(len(blocks), (request.num_tokens - 1) // self.block_size)
        for i in range(limit, 0, -1):
            slot = self.slots.snapshots.get(request.block_hashes[i - 1])
            if slot is not None:
                prefix.extend(blocks[:i])
                prefix.snapshot_slot = slot
                self.slots.snapshots.move_to_end(request.block_hashes[i - 1])
                break
        return prefix

    def allocate(self, request: Request, num_new_tokens: int, prefix_blocks=()) -> list[BlockCopy] | None:
        rid = request.request_id
        needs_slot = rid not in self.slots.working
        if needs_slot and self.slots.num_free - self._protected(prefix_blocks) < 1:
            return None
        copies = self.attn.allocate(request, num_new_tokens, list(prefix_blocks))
        if copies is None or not needs_slot:
            return copies
        self.slots.working[rid] = self.slots.take(self._evict_snapshot)
        snapshot = getattr(prefix_blocks, "snapshot_slot", None)
        self._init[rid] = ZERO if snapshot is None or not prefix_blocks else snapshot
        return copies

    def state_written(self, request_id: str) -> None:
        """The working slot was filled from outside (a KV handoff): it must not be reset at admission."""
        self._init.pop(request_id, None)

    def _protected(self, prefix_blocks) -> int:
        """A snapshot about to be copied must not be evicted to make room for the copy."""
        return 1 if getattr(prefix_blocks, "snapshot_slot", None) is not None else 0

    def shares_pool(self, a: Request, b: Request) -> bool:
        """Whether freeing `a`'s cache can make room for `b`: always, with one pool (the data-parallel
        manager answers per rank)."""
        return True

    def plan_step(self, request: Request, start: int, num_new_tokens: int) -> StateStep:
        """The working slot, how it starts, and the snapshot this step writes (the last block boundary
        the step crosses, when that prefix is not snapshotted yet)."""
        rid = request.request_id
        slot = self.slots.working[rid]
        init = self._init.pop(rid, KEEP)
        end = start + num_new_tokens
        boundary = end - end % self.block_size
        if not self.enable_prefix_caching or boundary <= start or self.slots.max_snapshots == 0:
            return StateStep(slot, init)
        self.attn.update_hashes(request)
        block = boundary // self.block_size - 1
        if block >= len(request.block_hashes):
            return StateStep(slot, init)
        h = request.block_hashes[block]
        if h in self.slots.snapshots:
            self.slots.snapshots.move_to_end(h)
            return StateStep(slot, init)
        snap = self._snapshot_slot(protect=init)
        if snap is None:
            return StateStep(slot, init)
        parent = request.block_hashes[block - 1] if block else ROOT_PARENT
        self.slots.pending[rid] = (h, parent, snap)
        return StateStep(slot, init, snap, boundary - start)

    def _snapshot_slot(self, protect: int) -> int | None:
        """A slot for a new snapshot: a free one, else the least recently used snapshot's (never the
        one this step copies from). Working allocations keep priority: a free slot is used only while
        the snapshot count is under its maximum."""
        s = self.slots
        if len(s.snapshots) < s.max_snapshots and s.free:
            return s.free.pop()
        for h, slot in s.snapshots.items():
            if slot != protect:
                self._evict_snapshot(h)
                return s.free.pop()
        return None

    def cache_full_blocks(self, request: Request) -> None:
        """After a step: attention blocks that became full enter the prefix cache, then this step's
        snapshot is committed if its block is cached (and published as a reusable boundary)."""
        self.attn.cache_full_blocks(request)
        pending = self.slots.pending.pop(request.request_id, None)
        if pending is None:
            return
        h, parent, slot = pending
        if h not in self.attn.pool.cached or h in self.slots.snapshots:
            self.slots.give_back(slot)
            return
        self.slots.snapshots[h] = slot
        self._emit(KVEventKind.STORED, h, parent)

    def free(self, request: Request) -> None:
        rid = request.request_id
        self.attn.free(request)
        self._init.pop(rid, None)
        pending = self.slots.pending.pop(rid, None)
        if pending is not None:
            self.slots.give_back(pending[2])
        slot = self.slots.working.pop(rid, None)
        if slot is not None:
            self.slots.give_back(slot)

    def clear_prefix_cache(self) -> None:
        for h in list(self.slots.snapshots):
            self.slots.give_back(self.slots.snapshots.pop(h))
        self.attn.clear_prefix_cache()
        self._emit(KVEventKind.CLEARED)

    # ---------------------------------------------------------------- snapshots leaving

    def _evict_snapshot(self, h: int) -> None:
        slot = self.slots.snapshots.pop(h)
        self.slots.give_back(slot)
        self._emit(KVEventKind.REMOVED, h)

    def _attention_block_evicted(self, block: int, h: int, parent: int | None, session: str | None) -> None:
        """The KV of the block ending at a snapshot is gone: that prefix is no longer reusable."""
        if h in self.slots.snapshots:
            self._evict_snapshot(h)

    def _emit(self, kind: KVEventKind, h: int | None = None, parent: int | None = None) -> None:
        if self.events is not None:
            self.events.emit(kind, h, parent, self.block_size if h is not None else 0)
