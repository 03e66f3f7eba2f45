"""Sliding-window layers as a cache group of their own (Gemma 4: five sliding layers to each full one).

The cache is two groups behind the scheduler's one cache interface (`KVCacheManager`'s methods):

- the full group: the full-attention layers' paged pool, one block table per request (`Request.block_ids`),
  exactly as an attention-only model's;
- the window group: the sliding layers' pool, a block table of its own (`Request.window_block_ids`, the same
  logical length, NO_BLOCK where a block was let go). A block whose last position is out of the window of
  every query a request will still compute goes back to the pool before each step, so a long sequence holds
  at most `ceil((window - 1) / block_size) + 1` blocks of it plus the step's new ones, however long it runs.

Prefix caching, per group: a hit through block i needs the full group's blocks 0..i (as ever) and only the
window group's blocks covering the `window` positions before the point computation resumes from
(`first_needed`); earlier window blocks may long be gone. The hit is the deepest block i along the request's
chain for which both hold. Blocks let go by the window enter the window pool's prefix cache as idle blocks
(they are full and computed), so branch points keep their window while the pool has room.

KV events describe what the engine can reuse: block i is published STORED when a hit through it is possible
(its full block cached and its window's blocks cached) and REMOVED when that stops (its full block evicted,
or one of its window's blocks). The router's match, the deepest published block along the chain, then
equals the engine's hit; holdings have gaps (a window block evicted under a deeper live boundary), as a
hybrid model's do (`sparse_blocks`).

Host tier (`host_tier.py`): each group saves the cached blocks it evicts to a host tier of its own (its layers
only) and a hit continues there: the full group's device run, then its host run (as one pool's), each window
block from either tier; host blocks come back into fresh device blocks before the request reads them. A
boundary reusable only with host blocks is published with `tier="host"`, one reusable from the device alone
with the device tier; it moves between the two (STORED in the new tier before REMOVED in the old) as its
blocks move.

Speculative decoding: rejected drafts' blocks go back in both groups (`trim`); drafts never move the point
blocks are let go from (the step's first position, which verification never rolls back past).
"""

from __future__ import annotations

from .block_hash import ROOT_PARENT
from .host_tier import HOST_TIER, HostChannel, HostKVTier
from .kv_cache_manager import BlockCopy, BlockPool, KVCacheManager
from .kv_events import KVEventKind, KVEventPublisher
from .request import Request
from .retention import SessionAwareLRU

NO_BLOCK = -1  # a window-table entry whose block was let go (never read: out of every query's window)
FULL_GROUP, WINDOW_GROUP = 0, 1  # BlockCopy.group, HostChannel.group
DEVICE_TIER = "device"


def window_blocks_per_sequence(window: int, block_size: int) -> int:
    """The most window-group blocks one sequence holds between steps: those covering its last `window - 1`
    positions plus the block its next token goes in."""
    return -(-(window - 1) // block_size) + 1


class WindowPrefix(list):
    """A prefix hit (the full group's device blocks, the list the scheduler sees; the hit may continue in the
    full group's host tier, `host_prefix`) plus the window group's blocks for it, covering blocks
    [window_start, end of the hit): `window_blocks` (a device block, or NO_BLOCK where `window_host` has the
    host slot to load)."""

    window_start: int = 0
    window_blocks: tuple[int, ...] = ()
    window_host: tuple[int, ...] = ()


class WindowedKVCacheManager(KVCacheManager):
    take_over_idle = True  # a hit stopped short of the full group's run recomputes blocks it holds

    def __init__(
        self,
        num_blocks: int,
        num_window_blocks: int,
        block_size: int,
        window: int,
        enable_prefix_caching: bool = True,
        extra_keys: str = "",
        events: KVEventPublisher | None = None,
        session_idle_s: float = 600.0,
        host: HostKVTier | None = None,
        host_window: HostKVTier | None = None,
    ):
        if (host is None) != (host_window is None):
            raise ValueError("a host tier for one cache group needs one for the other")
        super().__init__(num_blocks, block_size, enable_prefix_caching, extra_keys, None, host, session_idle_s)
        if window < 1:
            raise ValueError(f"the sliding window must be positive, got {window}")
        self.window = window
        self.events = events
        self.window_pool = BlockPool(num_window_blocks, block_size, None, SessionAwareLRU(session_idle_s))
        self.pool.on_evict = self._full_block_evicted
        self.window_pool.on_evict = self._window_block_evicted
        self.host_window = host_window
        self.window_channel = HostChannel(host_window, WINDOW_GROUP) if host_window is not None else None
        if host is not None:
            host.on_change = self._full_host_changed
            host_window.on_change = self._window_host_changed
        self._num_cached_window: dict[str, int] = {}
        self._host_plan: dict[str, list[int]] = {}  # request -> full-group host slots its hit continues into
        self._published: dict[int, tuple[str, int | None]] = {}  # boundary hash -> (tier, parent)
        # The full group's known chains (blocks on the device or the host), both ways: a boundary's window is
        # found by walking parents, and a window block that comes or goes changes the boundaries below it.
        self._chain: dict[int, tuple[int, int | None]] = {}  # block hash -> (its index in the chain, parent)
        self._children: dict[int, set[int]] = {}  # block hash -> known blocks whose parent it is
        # Full-group blocks evicted from the device, on their way to the host: kept in the chains meanwhile
        # (their host copy may be dropped before the new one is stored).
        self._saving: dict[int, tuple[int, int | None]] = {}  # block hash -> (index, parent)

    def host_channels(self) -> list[HostChannel]:
        return [self.host_channel, self.window_channel] if self.host_channel is not None else []

    # ---------------------------------------------------------------- where the window starts

    def first_needed(self, position: int) -> int:
        """The first block a query at `position` (or any later one) reads in the window group."""
        return max(0, position - self.window + 1) // self.block_size

    def _hit_window_start(self, i: int) -> int:
        """The first window block a hit through block i needs: computation resumes at its end, or one token
        earlier (a hit on a whole prompt recomputes its last token)."""
        return self.first_needed((i + 1) * self.block_size - 1)

    @property
    def usage(self) -> float:
        return max(super().usage, 1.0 - self.window_pool.num_free / self.window_pool.num_blocks)

    def live_window_blocks(self, request: Request) -> int:
        return sum(1 for b in request.window_block_ids if b != NO_BLOCK)

    # ---------------------------------------------------------------- prefix hits

    def cached_prefix(self, request: Request, max_blocks: int | None = None) -> list[int]:
        self._host_plan.pop(request.request_id, None)
        full = super().cached_prefix(request, max_blocks)
        if not self.enable_prefix_caching:
            return full
        hashes = request.block_hashes[:max_blocks]
        host_full = []  # the full group's host run after its device run
        if self.host is not None:
            for h in hashes[len(full) :]:
                slot = self.host.find(h)
                if slot is None:
                    break
                host_full.append(slot)
        run = 0  # window blocks available (either tier) consecutively through block i
        best = -1
        for i in range(len(full) + len(host_full)):
            run = run + 1 if self._window_available(hashes[i]) else 0
            if run >= i - self._hit_window_start(i) + 1:
                best = i
        hit = WindowPrefix(full[: best + 1])
        if best < 0:
            return hit
        hit.window_start = self._hit_window_start(best)
        hit.window_blocks, hit.window_host = self._window_sources(hashes[hit.window_start : best + 1])
        if best >= len(full):
            self._host_plan[request.request_id] = host_full[: best + 1 - len(full)]
            self.host.touch(self._host_plan[request.request_id], request.session_id)
        if self.host_window is not None:
            self.host_window.touch([s for s in hit.window_host if s != NO_BLOCK], request.session_id)
        return hit

    def host_prefix(self, request: Request, num_device_blocks: int) -> list[int]:
        """The full group's host slots the last `cached_prefix` hit continues into."""
        return self._host_plan.pop(request.request_id, [])

    def _window_available(self, h: int) -> bool:
        return h in self.window_pool.cached or (self.host_window is not None and h in self.host_window)

    def _full_available(self, h: int) -> bool:
        return h in self.pool.cached or (self.host is not None and h in self.host)

    def _window_sources(self, hashes: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Where each window block of a hit comes from: (device blocks, host slots), NO_BLOCK where not that tier."""
        device, host = [], []
        for h in hashes:
            b = self.window_pool.cached.get(h, NO_BLOCK)
            slot = self.host_window.find(h) if b == NO_BLOCK and self.host_window is not None else None
            if b == NO_BLOCK and slot is None:
                raise RuntimeError("a prefix hit without its window blocks cached")
            device.append(b)
            host.append(NO_BLOCK if slot is None else slot)
        return tuple(device), tuple(host)

    # ---------------------------------------------------------------- allocation

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        prefix_blocks: list[int] = (),
        host_slots: list[int] = (),
        reads_from: int | None = None,
    ) -> list[BlockCopy] | None:
        """`KVCacheManager.allocate` for both groups (window blocks of the hit that are on the host come back into
        fresh blocks). `reads_from`: the first position a query will be computed at (default: the step's first);
        an imported prompt's is its end, so the window group gets only the blocks its decode reads."""
        start = request.num_computed_tokens
        first_needed = self.first_needed(start if reads_from is None else reads_from)
        self._let_go(request, first_needed)
        hit_len = len(prefix_blocks) + len(host_slots)
        first, window_hit, window_host = self._window_prefix(request, prefix_blocks, hit_len)
        table_len = len(request.window_block_ids) + hit_len
        skipped = max(0, first_needed - table_len)  # new blocks no query will read: never allocated
        needed = max(0, self.blocks_needed(start + num_new_tokens) - table_len - skipped)
        # A hit on a whole prompt recomputes its last token into the hit's last block: a private copy of it.
        cow = bool(window_hit) and window_hit[-1] != NO_BLOCK and start < hit_len * self.block_size
        loads = sum(1 for s in window_host if s != NO_BLOCK)
        taken = [b for b in window_hit if b != NO_BLOCK]
        # Both groups must have room before either changes: the scheduler preempts when one is short.
        if needed + cow + loads > self.window_pool.num_free - self.window_pool.num_free_among(taken):
            return None
        copies = super().allocate(request, num_new_tokens, prefix_blocks, host_slots)
        if copies is None:
            return None
        table = self._take_window_prefix(request, first, window_hit, window_host, cow, copies)
        request.window_block_ids += table + [NO_BLOCK] * skipped + self.window_pool.allocate(needed)
        if hit_len:
            # Blocks loaded from the host enter the cache once they are computed (`cache_full_blocks`).
            self._num_cached_window[request.request_id] = first if loads else len(prefix_blocks) - cow
        self._let_go(request, first_needed)  # a hit reaching back past what is read from now on
        return copies

    def import_lacks_window(self, request: Request, window_start_block: int) -> None:
        """Nothing to do: the window table gets blocks only from where the decode reads (`allocate_import`),
        never before the sender's first sliding block; those blocks' windows are never cached."""

    def allocate_import(self, request: Request, prefix_blocks: list[int]) -> list[BlockCopy] | None:
        return self.allocate(
            request, request.num_prompt_tokens - request.num_computed_tokens, prefix_blocks, reads_from=request.num_prompt_tokens
        )

    def _window_prefix(self, request: Request, prefix_blocks: list[int], hit_len: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(first block, device blocks, host slots) of a hit's window: from the hit itself, or looked up again
        when the caller passed a copy of the list (nothing was evicted in between)."""
        if not hit_len:
            return 0, (), ()
        if isinstance(prefix_blocks, WindowPrefix) and len(prefix_blocks.window_blocks) == hit_len - prefix_blocks.window_start:
            return (
                prefix_blocks.window_start,
                prefix_blocks.window_blocks,
                prefix_blocks.window_host or (NO_BLOCK,) * len(prefix_blocks.window_blocks),
            )
        first = self._hit_window_start(hit_len - 1)
        return first, *self._window_sources(request.block_hashes[first:hit_len])

    def _take_window_prefix(
        self, request: Request, first: int, blocks: tuple[int, ...], host: tuple[int, ...], cow: bool, copies: list[BlockCopy]
    ) -> list[int]:
        if not blocks:
            return []
        blocks = list(blocks)
        self.window_pool.take([b for b in blocks if b != NO_BLOCK])
        if cow:
            (private,) = self.window_pool.allocate(1)
            self.window_pool.release([blocks[-1]])
            copies.append(BlockCopy(blocks[-1], private, WINDOW_GROUP))
            blocks[-1] = private
        at = [i for i, s in enumerate(host) if s != NO_BLOCK]
        if at:
            fresh = self.window_pool.allocate(len(at))
            for i, b in zip(at, fresh):
                blocks[i] = b
            self.window_channel.load(request.request_id, fresh, [host[i] for i in at])
        return [NO_BLOCK] * first + blocks

    def _let_go(self, request: Request, first_needed: int) -> None:
        """Returns the window blocks before `first_needed` to the pool (cached ones stay reusable until evicted)."""
        table = request.window_block_ids
        gone = [b for b in table[:first_needed] if b != NO_BLOCK]
        if gone:
            self.window_pool.release(gone[::-1], request.session_id)  # earliest first: evicted first
            table[: min(first_needed, len(table))] = [NO_BLOCK] * min(first_needed, len(table))

    # ---------------------------------------------------------------- caching and events

    def cache_full_blocks(self, request: Request) -> None:
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        done = self._num_cached_blocks.get(rid, 0)
        super().cache_full_blocks(request)
        full = self._num_cached_blocks.get(rid, 0)
        hashes, table = request.block_hashes, request.window_block_ids
        for i in range(done, full):
            if hashes[i] in self.pool.cached:
                self._remember(hashes[i], hashes[i - 1] if i else ROOT_PARENT, i)
        recached = []  # window blocks cached anew: boundaries past this request's may become reusable
        for i in range(self._num_cached_window.get(rid, 0), full):
            if table[i] != NO_BLOCK:
                known = hashes[i] in self.window_pool.cached
                self.window_pool.cache_block(table[i], hashes[i], hashes[i - 1] if i else ROOT_PARENT, True)
                if not known:
                    recached.append(hashes[i])
        self._num_cached_window[rid] = max(full, self._num_cached_window.get(rid, 0))
        for h in dict.fromkeys(self._within_reach([*hashes[done:full], *recached])):
            self._evaluate(h)

    def _within_reach(self, hashes: list[int]) -> list[int]:
        """The known boundaries whose hit needs one of these blocks (of either group: a hit needs the window's
        blocks of both): each block itself, then its descendants a window's reach below."""
        out = list(hashes)
        frontier = list(hashes)
        for _ in range(window_blocks_per_sequence(self.window, self.block_size)):
            frontier = [c for h in frontier for c in self._children.get(h, ())]
            out += frontier
        return out

    def _remember(self, h: int, parent: int | None, depth: int | None = None) -> None:
        """Records a full-group block on the device or the host in the known chains (its depth from its parent's
        when not given; unknown parents leave it out: no hit can reach it)."""
        if h in self._chain:
            return
        if depth is None:
            if parent == ROOT_PARENT:
                depth = 0
            elif parent in self._chain:
                depth = self._chain[parent][0] + 1
            else:
                return
        self._chain[h] = (depth, parent)
        self._children.setdefault(parent, set()).add(h)

    def _forget(self, h: int) -> None:
        """A full-group block gone from both tiers: out of the chains (the boundaries below it lose their walk)."""
        info = self._chain.pop(h, None)
        if info is None:
            return
        siblings = self._children.get(info[1])
        if siblings is not None:
            siblings.discard(h)
            if not siblings:
                del self._children[info[1]]

    def _window_hashes(self, h: int) -> list[int] | None:
        """The window block hashes a hit through block `h` needs (walking its parents), None if the full
        group's chain is not known that far."""
        info = self._chain.get(h)
        if info is None:
            return None
        depth = info[0]
        chain = [h]
        for _ in range(depth - self._hit_window_start(depth)):
            info = self._chain.get(chain[-1])
            if info is None:
                return None
            chain.append(info[1])
        return chain

    def _tier_of(self, h: int) -> str | None:
        """Where a hit through block `h` can come from: the device alone, with the host's help, or nowhere.
        The device needs the window's full blocks there too (its run cannot resume from the host's)."""
        window = self._window_hashes(h)
        if window is None:
            return None
        if all(w in self.pool.cached and w in self.window_pool.cached for w in window):
            return DEVICE_TIER
        if self.host is not None and all(self._full_available(w) and self._window_available(w) for w in window):
            return HOST_TIER
        return None

    def _evaluate(self, h: int) -> None:
        """Publishes the boundary's change of tier: STORED in the new one before REMOVED from the old."""
        tier = self._tier_of(h)
        old = self._published.get(h)
        if tier == (old and old[0]):
            return
        if tier is not None:
            parent = self._chain[h][1]
            self._published[h] = (tier, parent)
            self._emit(KVEventKind.STORED, h, parent, tier)
        else:
            del self._published[h]
        if old is not None:
            self._emit(KVEventKind.REMOVED, h, old[1], old[0])

    def _full_block_evicted(self, block: int, h: int, parent: int | None, session: str | None) -> None:
        if self.host_channel is not None:
            self.host_channel.save(block, h, parent, session)  # stays in the chains: on its way to the host
            if h in self._chain:
                self._saving[h] = self._chain[h]
        else:
            self._forget(h)
        for d in self._within_reach([h]):
            self._evaluate(d)

    def _full_host_changed(self, h: int, held: bool) -> None:
        if held:
            depth, parent = self._saving.pop(h, (None, self.host.parent_of[self.host.slot_of[h]]))
            self._remember(h, parent, depth)
        elif h not in self.pool.cached and h not in self._saving:
            self._forget(h)
        for d in self._within_reach([h]):
            self._evaluate(d)

    def _window_block_evicted(self, block: int, h: int, parent: int | None, session: str | None) -> None:
        if self.window_channel is not None:
            self.window_channel.save(block, h, parent, session)
        for d in self._within_reach([h]):
            self._evaluate(d)

    def _window_host_changed(self, h: int, held: bool) -> None:
        for d in self._within_reach([h]):
            self._evaluate(d)

    def _emit(self, kind: KVEventKind, h: int | None = None, parent: int | None = None, tier: str = DEVICE_TIER) -> None:
        if self.events is not None:
            self.events.emit(kind, h, parent, self.block_size if h is not None else 0, tier=tier)

    # ---------------------------------------------------------------- giving blocks back

    def trim(self, request: Request) -> None:
        super().trim(request)
        keep = self.blocks_needed(request.num_tokens)
        table = request.window_block_ids
        if len(table) > keep:
            self.window_pool.release([b for b in table[keep:] if b != NO_BLOCK])
            del table[keep:]

    def free(self, request: Request) -> None:
        # Head first, unlike the full group's tail first: a hit at the end needs the last window's blocks,
        # and the earlier ones serve only shallower hits.
        self.window_pool.release([b for b in reversed(request.window_block_ids) if b != NO_BLOCK], request.session_id)
        request.window_block_ids = []
        self._num_cached_window.pop(request.request_id, None)
        self._host_plan.pop(request.request_id, None)
        super().free(request)

    def clear_prefix_cache(self) -> None:
        self.window_pool.clear_cache()
        super().clear_prefix_cache()
        self._published.clear()
        self._chain.clear()
        self._children.clear()
        self._saving.clear()
        self._host_plan.clear()
        self._emit(KVEventKind.CLEARED)
