"""`MemoryKVIndex`: the KV index in one process (the default for a single router replica; also the
worker-side mirror `RedisKVEventSink` resynchronises Redis from, and what `KVEventStreamConsumer` fills).

Thread-safe: events may arrive from an engine thread (`KVEventPublisher.add_listener`) or a stream
consumer thread while the router looks up from another.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from functools import reduce
from itertools import accumulate, compress, islice, repeat
from operator import and_, ne, or_
from typing import Callable, Iterable

from workers.engine.kv_events import KVEvent, KVEventKind

from .types import DEVICE_TIER, Lookup, PrefixMatch, WorkerLoad

_DEVICE = 1  # tier bit of device-resident blocks; other tiers get the next bits


def _slots(mask: int):
    """The set bits of a mask, as slot numbers."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class MemoryKVIndex:
    """Blocks map to bitmasks of worker slots (a worker's slot is its bit), so a chain walk over every
    worker is one dict lookup and a few integer operations per block, and the index holds no per-block
    container objects for the garbage collector to traverse. Slots are never reused (worker ids are
    stable across restarts)."""

    blocking_lookups = False

    def __init__(
        self,
        heartbeat_ttl_s: float = 10.0,
        session_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        on_purge: Callable[[str, str], None] | None = None,
        on_event_lag: Callable[[str, float], None] | None = None,
    ):
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.session_ttl_s = session_ttl_s
        self.clock = clock
        self.on_purge = on_purge  # (worker, "gap" | "epoch" | "cleared" | "removed")
        self.on_event_lag = on_event_lag  # (worker, seconds between an event's timestamp and its arrival)
        self._lock = threading.RLock()
        self._tier_bits: dict[str, int] = {DEVICE_TIER: _DEVICE}
        self._slot: dict[str, int] = {}  # worker -> slot
        self._names: list[str] = []  # slot -> worker
        self._any: dict[int, int] = {}  # block hash -> slots holding it in any tier
        self._off: dict[int, int] = {}  # block hash -> slots holding it only in slower tiers (rare)
        self._by_worker: dict[str, dict[int, int]] = {}  # worker -> {block hash: tier bits}, for purges
        self._state: dict[str, tuple[int, int]] = {}  # worker -> (epoch, last applied seq)
        self._loads: dict[str, tuple[WorkerLoad, float]] = {}  # worker -> (load, arrival time)
        self._spec: dict[int, dict[int, float]] = {}  # block hash -> {slot: expiry}
        self._spec_masks: dict[int, int] = {}  # block hash -> slots of its unexpired speculative holders
        self._spec_expiry: deque[tuple[float, list[int]]] = deque()  # (expiry, hashes), for sweeping
        self._sessions: dict[str, dict[str, float]] = {}  # session -> {worker: expiry}
        self._session_expiry: deque[tuple[float, str]] = deque()

    # ---------------------------------------------------------------- events

    def apply(self, events: Iterable[KVEvent | dict]) -> None:
        wall, e = time.time(), None
        with self._lock:
            for e in events:
                if isinstance(e, dict):
                    e = KVEvent.from_dict(e)
                self._apply_one(e)
            # Lag is reported per batch (its newest event), not per event: cheap and what a dashboard needs.
            if self.on_event_lag is not None and e is not None and e.timestamp:
                self.on_event_lag(e.worker_id, wall - e.timestamp)

    def _apply_one(self, e: KVEvent) -> None:
        w = e.worker_id
        state = self._state.get(w)
        if state is None or state[0] != e.epoch:
            if state is not None:
                self._purge(w, "epoch")  # the engine restarted: everything it had is gone
        elif e.seq <= state[1]:
            return  # already applied (a replay overlapping what we had)
        elif e.seq != state[1] + 1:
            self._purge(w, "gap")  # lost events: what we hold for this worker may be wrong
        self._state[w] = (e.epoch, e.seq)
        if e.kind == KVEventKind.STORED:
            self._add(w, e.block_hash, e.tier)
            spec = self._spec.get(e.block_hash)
            if spec is not None and spec.pop(self._slot[w], None) is not None:
                self._set_spec_mask(e.block_hash, spec)
        elif e.kind == KVEventKind.REMOVED:
            self._remove(w, e.block_hash, e.tier)
        elif e.kind == KVEventKind.CLEARED:
            self._purge(w, "cleared")

    def _slot_bit(self, w: str) -> int:
        slot = self._slot.get(w)
        if slot is None:
            slot = self._slot[w] = len(self._names)
            self._names.append(w)
        return 1 << slot

    def _tier_bit(self, tier: str) -> int:
        bit = self._tier_bits.get(tier)
        if bit is None:
            bit = self._tier_bits[tier] = 1 << len(self._tier_bits)
        return bit

    def _set_masks(self, h: int, b: int, tiers: int) -> None:
        """Makes slot bit `b` in the block's masks agree with the worker's tier bits for it."""
        for masks, present in ((self._any, tiers), (self._off, tiers and not tiers & _DEVICE)):
            mask = masks.get(h, 0)
            mask = mask | b if present else mask & ~b
            if mask:
                masks[h] = mask
            else:
                masks.pop(h, None)

    def _add(self, w: str, h: int, tier: str) -> None:
        mine = self._by_worker.setdefault(w, {})
        tiers = mine[h] = mine.get(h, 0) | self._tier_bit(tier)
        self._set_masks(h, self._slot_bit(w), tiers)

    def _remove(self, w: str, h: int, tier: str) -> None:
        mine = self._by_worker.get(w)
        if not mine or h not in mine:
            return
        tiers = mine[h] & ~self._tier_bit(tier)
        if tiers:
            mine[h] = tiers
        else:
            del mine[h]
        self._set_masks(h, self._slot_bit(w), tiers)

    def _purge(self, w: str, reason: str | None = None) -> None:
        mine = self._by_worker.pop(w, None)
        if mine:
            b = self._slot_bit(w)
            for h in mine:
                self._set_masks(h, b, 0)
        if reason is not None and self.on_purge is not None:
            self.on_purge(w, reason)

    def load_snapshot(self, worker_id: str, epoch: int, last_seq: int, blocks: list[tuple[int, str]], reset: bool = True) -> None:
        """Replaces (or, with reset=False, extends) what a worker holds: a resync after lost events."""
        with self._lock:
            if reset:
                self._purge(worker_id)
            for h, tier in blocks:
                self._add(worker_id, h, tier)
            self._state[worker_id] = (epoch, last_seq)

    def export_worker(self, worker_id: str) -> tuple[int, int, list[tuple[int, str]]]:
        """(epoch, last seq, [(hash, tier)]) of one worker: the snapshot a resync ships."""
        with self._lock:
            epoch, seq = self._state.get(worker_id, (0, -1))
            names = {bit: tier for tier, bit in self._tier_bits.items()}
            blocks = [(h, names[bit]) for h, bits in self._by_worker.get(worker_id, {}).items() for bit in names if bits & bit]
            return epoch, seq, blocks

    def position(self, worker_id: str) -> tuple[int, int] | None:
        """(epoch, last applied seq) of a worker, or None if the index knows nothing of it."""
        with self._lock:
            return self._state.get(worker_id)

    # ---------------------------------------------------------------- liveness and load

    def heartbeat(self, load: WorkerLoad) -> None:
        with self._lock:
            self._loads[load.worker_id] = (load, self.clock())

    def live_workers(self) -> dict[str, WorkerLoad]:
        now = self.clock()
        with self._lock:
            return {w: load for w, (load, at) in self._loads.items() if now - at <= self.heartbeat_ttl_s}

    def drop_heartbeat(self, worker_id: str) -> None:
        """The worker is no longer live (its entries stay, valid if it returns in the same epoch)."""
        with self._lock:
            self._loads.pop(worker_id, None)

    def remove_worker(self, worker_id: str) -> None:
        with self._lock:
            self._purge(worker_id, "removed")
            self._state.pop(worker_id, None)
            self._loads.pop(worker_id, None)

    def remove_dead_workers(self) -> list[str]:
        """Forgets workers whose heartbeat expired (their entries are already ignored; this frees memory)."""
        with self._lock:
            live = self.live_workers()
            dead = [w for w in set(self._by_worker) | set(self._loads) if w not in live]
            for w in dead:
                self.remove_worker(w)
            return dead

    # ---------------------------------------------------------------- lookups

    def lookup(self, block_hashes: list[int], session_id: str | None = None) -> Lookup:
        with self._lock:
            live = self.live_workers()
            sessions = [w for w in self.session_workers(session_id) if w in live] if session_id else []
            return Lookup(self._match(block_hashes, live), live, sessions)

    def longest_prefix(self, block_hashes: list[int]) -> dict[str, int]:
        with self._lock:
            return {w: m.blocks for w, m in self._match(block_hashes, self.live_workers()).items()}

    def _match(self, block_hashes: list[int], live: dict) -> dict[str, PrefixMatch]:
        """Every live worker's match: its DEEPEST held block along the request's chain (matched blocks =
        that position + 1), not the end of its first consecutive run. Block hashes are chained (block i's
        hash covers tokens 0..i), so holding block i means the worker computed exactly this prefix through
        block i, whatever it holds before it. Hybrid (linear-attention) engines can resume only where a
        recurrent-state snapshot exists and publish only those boundary blocks, so their holdings have
        gaps by design; attention-only engines publish every block and evict a sequence's tail before its
        prefix, so for them the deepest held block is the end of the consecutive run: one rule serves
        both. The per-block lookups run as C loops (map/accumulate); Python code runs only where a worker
        first appears walking back from the end (and per block where offloaded entries exist)."""
        live_mask = 0
        for w in live:
            slot = self._slot.get(w)
            if slot is not None:
                live_mask |= 1 << slot
        if not block_hashes or not live_mask:
            return {}
        held = list(map(self._any.get, block_hashes, repeat(0)))
        slow = list(map(self._off.get, block_hashes, repeat(0))) if self._off else None
        self._sweep_spec(self.clock())  # from here on every mask in _spec_masks is current
        if self._spec_masks:  # speculative holders count as device-resident
            spec = list(map(self._spec_masks.get, block_hashes, repeat(0)))
            held = list(map(or_, held, spec))
            if slow is not None:
                slow = [s & ~m for s, m in zip(slow, spec)]
        if slow is not None and any(slow):
            found = self._walk_with_offloaded(held, slow, live_mask)
        else:
            found = self._walk(held, live_mask)
        return {self._names[slot]: m for slot, m in found.items()}

    @staticmethod
    def _walk(held: list[int], live_mask: int) -> dict[int, PrefixMatch]:
        """Device blocks only: a suffix OR of the holder masks, computed in C from the chain's end
        (seen[j]: the workers holding any of its last j blocks, a mask that only gains bits); Python
        looks only at the few positions where it gains a worker, which is that worker's deepest block."""
        n = len(held)
        seen = list(accumulate(reversed(held), or_, initial=0))
        found: dict[int, PrefixMatch] = {}
        for j in compress(range(1, n + 1), map(ne, islice(seen, 1, None), seen)):
            new = seen[j] & ~seen[j - 1] & live_mask
            if new:
                m = PrefixMatch(n - j + 1, 0)  # their deepest block is n - j (0-based)
                for slot in _slots(new):
                    found[slot] = m
        return found

    @staticmethod
    def _walk_with_offloaded(held: list[int], slow: list[int], live_mask: int) -> dict[int, PrefixMatch]:
        """`_walk`, plus for each worker the chain positions it holds only in a slower tier. `slow` masks
        are subsets of `held` ones, so every such position lies at or before the worker's deepest block:
        a plain count over the chain, in C, for each of the (few) workers with any."""
        found = MemoryKVIndex._walk(held, live_mask)
        for slot in _slots(reduce(or_, slow, 0) & live_mask):
            m = found.get(slot)
            if m is not None:
                found[slot] = PrefixMatch(m.blocks, sum(map(and_, slow, repeat(1 << slot))) >> slot)
        return found

    # ---------------------------------------------------------------- decisions and sessions

    def note_speculative(self, worker_id: str, block_hashes: list[int], ttl_s: float) -> None:
        """The chosen worker is about to compute these blocks: count them as cached for `ttl_s`, so the
        next request with the same prefix follows before the real events arrive."""
        if ttl_s <= 0 or not block_hashes:
            return
        now = self.clock()
        expiry = now + ttl_s
        with self._lock:
            self._sweep_spec(now)
            bit = self._slot_bit(worker_id)
            slot = bit.bit_length() - 1
            masks = self._spec_masks
            for h in block_hashes:
                self._spec.setdefault(h, {})[slot] = expiry
                masks[h] = masks.get(h, 0) | bit
            self._spec_expiry.append((expiry, block_hashes))

    def _sweep_spec(self, now: float) -> None:
        """Drops expired speculative entries (amortised: each entry is swept once), keeping the masks exact."""
        while self._spec_expiry and self._spec_expiry[0][0] <= now:
            _, hashes = self._spec_expiry.popleft()
            for h in hashes:
                spec = self._spec.get(h)
                if spec is not None:
                    for slot in [slot for slot, exp in spec.items() if exp <= now]:
                        del spec[slot]
                    self._set_spec_mask(h, spec)

    def _set_spec_mask(self, h: int, spec: dict[int, float]) -> None:
        mask = 0
        for slot in spec:
            mask |= 1 << slot
        if mask:
            self._spec_masks[h] = mask
        else:
            self._spec.pop(h, None)
            self._spec_masks.pop(h, None)

    def record_session(self, session_id: str, worker_id: str) -> None:
        now = self.clock()
        with self._lock:
            while self._session_expiry and self._session_expiry[0][0] <= now:
                _, s = self._session_expiry.popleft()
                workers = self._sessions.get(s)
                if workers is not None and max(workers.values()) <= now:
                    del self._sessions[s]
            self._sessions.setdefault(session_id, {})[worker_id] = now + self.session_ttl_s
            self._session_expiry.append((now + self.session_ttl_s, session_id))

    def session_workers(self, session_id: str) -> list[str]:
        now = self.clock()
        with self._lock:
            return sorted(w for w, exp in self._sessions.get(session_id, {}).items() if exp > now)

    def record_decision(
        self, workers: list[str], block_hashes: list[int], ttl_s: float, session_id: str | None, held: list[int] | None = None
    ) -> None:
        """A decision's bookkeeping in one call: speculative entries for the blocks past each chosen
        worker's match (`held[i]`: the blocks it matches), and the session record."""
        for i, w in enumerate(workers):
            self.note_speculative(w, block_hashes[held[i] if held else 0 :], ttl_s)
            if session_id:
                self.record_session(session_id, w)

    def flush(self, timeout: float = 0.0) -> bool:
        return True  # writes are synchronous here; the same call as RedisKVIndex.flush

    def close(self) -> None:
        pass
