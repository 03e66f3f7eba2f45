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
  it crossed into a fresh snapshot slot (`StateStep.snaps`). So a prompt's last full block always gets
  one (the next turn of a conversation hits it), and every block boundary a step ends on does. Snapshots
  have their own LRU and a configured maximum.
- A prefix is reusable only up to a boundary whose snapshot exists: the hit is the deepest such
  boundary within the run of cached attention blocks (never the whole prompt: its last token is always
  computed, and the state before it is only known at a boundary).
- Snapshots where prompts are likely to be shared, not only where steps happen to end: a step also writes
  the states at the keep points it crosses (the kernels write up to SNAPSHOTS_PER_STEP per sequence in one
  pass, each segment between them chunked from its own start):
  - branch points: a prompt whose cached attention blocks run deeper than its deepest snapshot shares a
    prefix with an earlier prompt up to there; it keeps a state at that boundary, so every later prompt
    with the prefix resumes from it (Marconi, MLSys 2025, admits states at such points);
  - hints: `SamplingParams.prefix_boundaries` (the chat path sets the end of the system prompt and tools,
    and of the conversation before its last message): the boundary at or before each.
  They cost no extra prefill step unless a chunk crosses more than SNAPSHOTS_PER_STEP - 1 of them
  (`chunk_tokens` then ends it at the last it can keep); a boundary with a snapshot wants nothing.
- Which snapshot goes when room is needed: not the least recently used, but the one worth least, by
  Greedy-Dual-Size-Frequency (Cao & Irani's GDS with Cherkasova's frequency): a snapshot's value is
  L + hits x (prompt tokens a hit skips) / (its bytes), L being the value of the last one evicted (so
  what is not used ages out). Every state has the same bytes, so this weighs depth and use: a system
  prompt's state that many requests resume from outlives the ends of one-off prompts, however recent.

KV events: a hybrid engine publishes a block as STORED only when the prefix through it is reusable
(attention blocks cached and a snapshot at its end) and REMOVED when that stops being true, so the
router's prediction (the deepest published block along a request's chain) equals what the engine
reuses, to the block. The attention pool's own per-block events are not published for these models.

Host tier (`host_tier.py`): evicted attention blocks go to a host KV tier as for attention-only models,
and every evicted snapshot (its block evicted, or pushed out of the snapshot LRU) to a host state tier
keyed by the same boundary hash, which publishes the boundary as `stored`/`removed` on the host. A prefix
then continues to the deepest boundary whose snapshot is on the device or the host and whose attention
blocks are on the device or the host: the host blocks are copied back (the request waits a step), the
host snapshot is written into the request's working slot before it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_hash import ROOT_PARENT
from .host_tier import HostKVTier
from .kv_cache_manager import BlockCopy, KVCacheManager
from .kv_events import KVEventKind, KVEventPublisher
from .request import Request

KEEP = -2  # StateStep.init: the working slot already holds the sequence's state
ZERO = -1  # StateStep.init: a fresh sequence starts from zeros
# States one step may keep per sequence (the kernels take them as [S, K]): a prefill chunk that crosses more
# keep points than this ends at the last one it can keep (`chunk_tokens`), so hints and branch points cost a
# prefill step only past that many.
SNAPSHOTS_PER_STEP = 4


@dataclass(frozen=True)
class StateStep:
    """What the runner needs per scheduled sequence of a hybrid model."""

    slot: int  # the working slot
    init: int = KEEP  # KEEP, ZERO, or a snapshot slot to copy into `slot` before the step
    # (slot, n): write the state after this step's first n tokens to slot; up to SNAPSHOTS_PER_STEP of them.
    snaps: tuple[tuple[int, int], ...] = ()
    # Speculative decoding: a slot that gets a copy of the state the step starts from (before the step), to
    # restore when drafts are rejected (-1: none).
    backup: int = -1


@dataclass(frozen=True)
class KeepPoints:
    """Where a prefill keeps states beyond the last boundary of each step (EngineConfig.state_keep_points,
    state_snapshot_every_blocks): at shared prefixes (branch points and hints), and every N blocks (0: not)."""

    shared: bool = True
    every_blocks: int = 0


class HybridPrefix(list):
    """The attention blocks of a prefix hit (a list, as the scheduler sees every cache's prefix) plus where
    the state at its end is: a device snapshot slot, or a host state-tier slot."""

    snapshot_slot: int | None = None
    host_state: int | None = None


class StateSlotPool:
    """Slot bookkeeping: free slots, working slots by request, snapshots by block hash with their value
    (GDSF: see the module's docstring)."""

    def __init__(self, num_slots: int, max_snapshots: int):
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.num_slots = num_slots
        self.max_snapshots = max_snapshots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot first
        self.working: dict[str, int] = {}
        self.snapshots: dict[int, int] = {}  # block hash -> slot
        self.pending: dict[str, list[tuple[int, int, int, int]]] = {}  # request -> (hash, parent, slot, depth) written this step
        self._saves: dict[int, int] = {}  # block hash -> prompt tokens a hit on it skips (its depth)
        self._hits: dict[int, int] = {}
        self._value: dict[int, float] = {}
        self._floor = 0.0  # L: the value of the last snapshot evicted for room

    def keep(self, h: int, slot: int, saves: int) -> None:
        self.snapshots[h] = slot
        self._saves[h], self._hits[h] = saves, 1
        self._value[h] = self._floor + saves

    def touch(self, h: int) -> None:
        """A request resumes from the snapshot: its value grows."""
        self._hits[h] += 1
        self._value[h] = self._floor + self._hits[h] * self._saves[h]

    def forget(self, h: int) -> int:
        """Drops the snapshot from the books; returns its slot."""
        del self._saves[h], self._hits[h], self._value[h]
        return self.snapshots.pop(h)

    def least_valuable(self, keep_slot: int | None = None) -> int | None:
        """The snapshot to evict for room (never the one in `keep_slot`), raising L to its value."""
        victim = min((h for h, slot in self.snapshots.items() if slot != keep_slot), key=self._value.__getitem__, default=None)
        if victim is not None:
            self._floor = self._value[victim]
        return victim

    @property
    def num_free(self) -> int:
        """Slots a working allocation could get (free, or held by an evictable snapshot)."""
        return len(self.free) + len(self.snapshots)

    def take(self, evict) -> int | None:
        if not self.free and self.snapshots:
            evict(self.least_valuable())
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
        host: HostKVTier | None = None,
        host_states: HostKVTier | None = None,
        session_idle_s: float = 600.0,
        keep_points: KeepPoints = KeepPoints(),
    ):
        self.attn = KVCacheManager(num_blocks, block_size, enable_prefix_caching, extra_keys, None, host, session_idle_s)
        self.attn.pool.on_evict = self._attention_block_evicted
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.keep_points = keep_points
        self.events = events
        self.slots = StateSlotPool(num_state_slots, max_snapshots if enable_prefix_caching else 0)
        self._init: dict[str, int] = {}  # request -> how its working slot starts (ZERO or a snapshot)
        self._backup: dict[str, int] = {}  # speculating request -> its backup slot (see `can_speculate`)
        self._verify_start: dict[str, int] = {}  # speculating request -> where its verify step started
        self._snap_parent: dict[int, int] = {}  # snapshot hash -> its parent hash (for host-tier events)
        # The host state tier: evicted snapshots wait in `pending_state_saves` (slot, hash, parent, session)
        # until the engine starts their copy (before the slot is written again), then in
        # `inflight_state_saves`; host snapshots a request reuses wait in `pending_state_loads`
        # (working slot, packed state) until the engine writes them.
        self.host_states = host_states
        self.pending_state_saves: list[tuple[int, int, int | None, str | None]] = []
        self.inflight_state_saves: list[tuple[tuple[int, int | None, str | None], object]] = []
        self.pending_state_loads: list[tuple[int, object]] = []
        self.pending_state_copies: list[tuple[int, int]] = []  # (working slot, device snapshot slot)
        self._host_plan: dict[str, list[int]] = {}  # request -> host attention slots its prefix continues into
        self._keep: dict[str, list[int]] = {}  # request -> boundaries (tokens) its prefill keeps states at

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

    # ---------------------------------------------------------------- the host tier (the engine's copies)

    @property
    def host(self) -> HostKVTier | None:
        return self.attn.host

    @property
    def host_hit_tokens(self) -> int:
        return self.attn.host_hit_tokens

    def host_channels(self) -> list:
        return self.attn.host_channels()

    def take_pending_state_saves(self) -> list[tuple[int, int, int | None, str | None]]:
        saves, self.pending_state_saves = self.pending_state_saves, []
        return saves

    def take_inflight_state_saves(self) -> list:
        saves, self.inflight_state_saves = self.inflight_state_saves, []
        return saves

    def take_pending_state_loads(self) -> tuple[list[tuple[int, object]], list[tuple[int, int]]]:
        """(host states to write into working slots, device snapshots to copy into working slots)."""
        loads, self.pending_state_loads = self.pending_state_loads, []
        copies, self.pending_state_copies = self.pending_state_copies, []
        return loads, copies

    def blocks_needed(self, num_tokens: int) -> int:
        return self.attn.blocks_needed(num_tokens)

    def update_hashes(self, request: Request) -> None:
        self.attn.update_hashes(request)

    def working_slot(self, request_id: str) -> int | None:
        return self.slots.working.get(request_id)

    # ---------------------------------------------------------------- the scheduler's interface

    def host_prefix(self, request: Request, num_device_blocks: int) -> list[int]:
        """Host attention slots the prefix `cached_prefix` just chose continues into (the request waits
        for them a step)."""
        return self._host_plan.pop(request.request_id, [])

    def cached_prefix(self, request: Request, max_blocks: int | None = None) -> HybridPrefix:
        """The deepest reusable boundary: within the cached attention blocks (device, then host), with a
        snapshot (device or host), and before the last token (which is always computed); at most `max_blocks`."""
        prefix = HybridPrefix()
        self._host_plan.pop(request.request_id, None)
        blocks = self.attn.cached_prefix(request, max_blocks)
        host_slots = self.attn.host_prefix(request, len(blocks)) if self.host_states is not None else []
        limit = min(len(blocks) + len(host_slots), (request.num_tokens - 1) // self.block_size)
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        for i in range(limit, 0, -1):
            h = request.block_hashes[i - 1]
            slot = self.slots.snapshots.get(h)
            if slot is not None:
                prefix.snapshot_slot = slot
                self.slots.touch(h)
            elif self.host_states is not None and h in self.host_states:
                (prefix.host_state,) = self.host_states.lookup([h], request.session_id)
            else:
                continue
            prefix.extend(blocks[:i])
            if i > len(blocks):
                self._host_plan[request.request_id] = host_slots[: i - len(blocks)]
            break
        self._plan_keeps(request, len(prefix), limit)
        return prefix

    def _plan_keeps(self, request: Request, hit_blocks: int, shared_blocks: int) -> None:
        """The boundaries the request's prefill should keep a state at (beyond the last one of each step):
        the branch point where its cached attention blocks end (`shared_blocks`, deeper than the hit:
        another prompt computed this prefix without a state at its end), and its hints."""
        if not self.enable_prefix_caching or self.slots.max_snapshots == 0:
            return
        bs = self.block_size
        wanted = set()
        if self.keep_points.shared:
            wanted = {p - p % bs for p in request.sampling_params.prefix_boundaries if p < request.num_tokens}
            if shared_blocks > hit_blocks:
                wanted.add(shared_blocks * bs)
        if self.keep_points.every_blocks:
            step = self.keep_points.every_blocks * bs
            wanted.update(range(step, request.num_tokens, step))
        self.attn.update_hashes(request)
        keep = sorted(
            b
            for b in wanted
            if hit_blocks * bs < b <= len(request.block_hashes) * bs and request.block_hashes[b // bs - 1] not in self.slots.snapshots
        )
        if keep:
            self._keep[request.request_id] = keep
        else:
            self._keep.pop(request.request_id, None)

    def chunk_tokens(self, request: Request, start: int, num_new_tokens: int) -> int:
        """Ends the chunk at a boundary the request should keep a state at when the chunk crosses more of
        them than one step keeps: the step's last boundary is kept anyway, so it may have
        SNAPSHOTS_PER_STEP - 1 inside."""
        keep = self._keep.get(request.request_id)
        if not keep:
            return num_new_tokens
        end = start + num_new_tokens
        inside = [b for b in keep if start < b < end]
        if len(inside) >= SNAPSHOTS_PER_STEP:
            return inside[SNAPSHOTS_PER_STEP - 1] - start
        return num_new_tokens

    def import_lacks_window(self, request: Request, window_start_block: int) -> None:
        """Hybrid models have no sliding-window layers."""

    def allocate_import(self, request: Request, prefix_blocks: list[int]) -> list[BlockCopy] | None:
        return self.allocate(request, request.num_prompt_tokens - request.num_computed_tokens, prefix_blocks)

    def allocate(self, request: Request, num_new_tokens: int, prefix_blocks=(), host_slots=()) -> list[BlockCopy] | None:
        rid = request.request_id
        needs_slot = rid not in self.slots.working
        if needs_slot and self.slots.num_free - self._protected(prefix_blocks) < 1:
            return None
        copies = self.attn.allocate(request, num_new_tokens, list(prefix_blocks), host_slots)
        if copies is None or not needs_slot:
            return copies
        self.slots.working[rid] = self.slots.take(self._evict_snapshot)
        snapshot = getattr(prefix_blocks, "snapshot_slot", None)
        host_state = getattr(prefix_blocks, "host_state", None)
        working = self.slots.working[rid]
        if host_state is not None:  # the state comes back from the host, before the request runs (KEEP)
            self.pending_state_loads.append((working, self.host_states.read([host_state])[0]))
            self.host_states.stats.blocks_loaded += 1
        elif snapshot is not None and host_slots:
            # It runs a step later (its blocks come back first), when the snapshot may be gone: copy now.
            self.pending_state_copies.append((working, snapshot))
        else:
            self._init[rid] = ZERO if snapshot is None or not (prefix_blocks or host_slots) else snapshot
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

    def plan_needs_pending_token(self, request: Request) -> bool:
        """Asynchronous scheduling: a decode step that fills a block snapshots the state there, named by the
        block's hash, which needs the token a step in flight is still sampling (once per block)."""
        if not self.enable_prefix_caching or self.slots.max_snapshots == 0:
            return False
        return (request.num_computed_tokens + 1) % self.block_size == 0

    def can_speculate(self, request: Request) -> bool:
        """Drafts need a backup slot for the request (kept until it ends): the state a verify step starts
        from, restored when a draft is rejected. None free (snapshots evictable count): no drafts."""
        rid = request.request_id
        if rid not in self._backup:
            slot = self.slots.take(self._evict_snapshot)
            if slot is None:
                return False
            self._backup[rid] = slot
        return True

    def verified(self, request: Request, num_accepted: int, num_drafted: int) -> None:
        """Rollback by recompute: the recurrent state ran through every draft, and a state cannot be
        unwound. All accepted: it is exact as it is. Else the working slot gets the backup (the state at the
        step's start) back before the next step, which recomputes the step's tokens up to the first
        rejected one (their KV again, identically); the attention KV is kept as for attention-only models."""
        rid = request.request_id
        if num_accepted == num_drafted:
            request.num_computed_tokens += num_accepted
        else:
            request.num_computed_tokens = self._verify_start.pop(rid)
            self._init[rid] = self._backup[rid]
        self.attn.cache_full_blocks(request)
        self.attn.trim(request)

    def plan_step(self, request: Request, start: int, num_new_tokens: int, num_spec: int = 0) -> StateStep:
        """The working slot, how it starts, and the snapshots this step writes (the keep points it crosses
        and its last block boundary, where those prefixes have no state yet); with drafts, the backup it
        fills."""
        rid = request.request_id
        slot = self.slots.working[rid]
        init = self._init.pop(rid, KEEP)
        backup = -1
        if num_spec:
            backup = self._backup[rid]
            self._verify_start[rid] = start
        end = start + num_new_tokens - num_spec  # no snapshot inside the drafts: their block hashes are unknown
        boundaries = self._boundaries(rid, start, end)
        if not boundaries:
            return StateStep(slot, init, backup=backup)
        self.attn.update_hashes(request)
        snaps, pending = [], []
        for boundary in boundaries:
            block = boundary // self.block_size - 1
            if block >= len(request.block_hashes):
                continue
            h = request.block_hashes[block]
            if h in self.slots.snapshots:
                continue
            snap = self._snapshot_slot(protect=init)
            if snap is None:
                break
            parent = request.block_hashes[block - 1] if block else ROOT_PARENT
            pending.append((h, parent, snap, boundary))
            snaps.append((snap, boundary - start))
        if pending:
            self.slots.pending[rid] = pending
        return StateStep(slot, init, tuple(snaps), backup)

    def _boundaries(self, rid: str, start: int, end: int) -> list[int]:
        """Where the step over tokens [start, end) keeps states: its keep points (`_plan_keeps`) and its last
        block boundary, at most SNAPSHOTS_PER_STEP (the last ones: a deeper state serves more prompts)."""
        if not self.enable_prefix_caching or self.slots.max_snapshots == 0:
            return []
        last = end - end % self.block_size
        points = {last} if last > start else set()
        keep = self._keep.get(rid)
        if keep:
            points.update(b for b in keep if start < b <= end)
            if keep[-1] <= end:
                del self._keep[rid]  # all passed
        return sorted(points)[-SNAPSHOTS_PER_STEP:]

    def _snapshot_slot(self, protect: int) -> int | None:
        """A slot for a new snapshot: a free one, else the least recently used snapshot's (never the
        one this step copies from). Working allocations keep priority: a free slot is used only while
        the snapshot count is under its maximum."""
        s = self.slots
        if len(s.snapshots) < s.max_snapshots and s.free:
            return s.free.pop()
        victim = s.least_valuable(keep_slot=protect)
        if victim is None:
            return None
        self._evict_snapshot(victim)
        return s.free.pop()

    def cache_full_blocks(self, request: Request) -> None:
        """After a step: attention blocks that became full enter the prefix cache, then this step's
        snapshots are committed where their blocks are cached (and published as reusable boundaries)."""
        self.attn.cache_full_blocks(request)
        for h, parent, slot, depth in self.slots.pending.pop(request.request_id, ()):
            if h not in self.attn.pool.cached or h in self.slots.snapshots:
                self.slots.give_back(slot)
                continue
            self.slots.keep(h, slot, depth)
            self._snap_parent[h] = parent
            self._emit(KVEventKind.STORED, h, parent)

    def free(self, request: Request) -> None:
        rid = request.request_id
        self.attn.free(request)
        self._init.pop(rid, None)
        self._host_plan.pop(rid, None)
        self._keep.pop(rid, None)
        for _, _, slot, _ in self.slots.pending.pop(rid, ()):
            self.slots.give_back(slot)
        slot = self.slots.working.pop(rid, None)
        if slot is not None:
            self.slots.give_back(slot)
        backup = self._backup.pop(rid, None)
        self._verify_start.pop(rid, None)
        if backup is not None:
            self.slots.give_back(backup)

    def clear_prefix_cache(self) -> None:
        for h in list(self.slots.snapshots):
            self.slots.give_back(self.slots.forget(h))
        self._snap_parent.clear()
        self.attn.clear_prefix_cache()
        self.pending_state_saves, self.inflight_state_saves = [], []
        if self.host_states is not None:
            self.host_states.clear()
        self._emit(KVEventKind.CLEARED)

    # ---------------------------------------------------------------- snapshots leaving

    def _evict_snapshot(self, h: int, session: str | None = None) -> None:
        slot = self.slots.forget(h)
        parent = self._snap_parent.pop(h, None)
        if self.host_states is not None:  # copied out before the slot is written again (the engine)
            self.pending_state_saves.append((slot, h, parent, session))
        self.slots.give_back(slot)
        self._emit(KVEventKind.REMOVED, h, parent)

    def _attention_block_evicted(self, block: int, h: int, parent: int | None, session: str | None) -> None:
        """The KV of the block ending at a snapshot is gone from the device: that prefix is no longer
        reusable there (with a host tier, block and snapshot both go to the host)."""
        if self.attn.host is not None:
            self.attn.host_channel.save(block, h, parent, session)
        if h in self.slots.snapshots:
            self._evict_snapshot(h, session)

    def _emit(self, kind: KVEventKind, h: int | None = None, parent: int | None = None) -> None:
        if self.events is not None:
            self.events.emit(kind, h, parent, self.block_size if h is not None else 0)
