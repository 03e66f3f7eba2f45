"""The KV-cache manager: block pool, reference counts, prefix cache and each request's block table.

Blocks are shared by reference count between requests with a common prefix. A full block gets its
chained hash (see `block_hash`) and enters the prefix cache; it stays cached after its last user lets
go, until it is evicted (least recently released first; never-cached free blocks are used before any
cached one is evicted). Every insertion, eviction and clear is published as a `KVEvent`.
Only full blocks are shared, so a request only writes into blocks it owns alone; the single exception,
a prompt that is entirely cached, is resolved by copying its last block (copy-on-write).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from .block_hash import ROOT_PARENT, block_hashes
from .host_tier import HostChannel, HostKVTier
from .kv_events import KVEventKind, KVEventPublisher
from .request import Request
from .retention import SessionAwareLRU


@dataclass(frozen=True)
class BlockCopy:
    src: int
    dst: int
    group: int = 0  # the cache group whose layers are copied (0: every layer of a one-group cache)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, events: KVEventPublisher | None = None, retention: SessionAwareLRU | None = None):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events = events
        self.ref_cnt = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.parent_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self._free_uncached: deque[int] = deque(range(num_blocks))
        # Idle cached blocks in eviction order (sessionless/ended first, then live sessions; see retention.py).
        self._free_cached = retention if retention is not None else SessionAwareLRU()
        # Told (block, hash, parent, session) of every cached block evicted, while its pages still hold it:
        # the hybrid cache drops the snapshot ending there, the host tier saves it before its new owner writes.
        self.on_evict: Callable[[int, int, int | None, str | None], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def evicted_live_session(self) -> int:
        return self._free_cached.evicted_live_session

    def touch_session(self, session: str | None) -> None:
        self._free_cached.touch(session)

    def _emit(self, kind, block_hash=None, parent=None, num_tokens=0):
        if self.events is not None:
            self.events.emit(kind, block_hash, parent, num_tokens)

    def longest_cached_prefix(self, hashes: list[int]) -> list[int]:
        blocks = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def num_free_among(self, block_ids: list[int]) -> int:
        return sum(1 for b in block_ids if self.ref_cnt[b] == 0)

    def take(self, block_ids: list[int]) -> None:
        """Adds a reference to cached blocks (a prefix hit), pulling them off the free list if idle."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                self._free_cached.discard(b)
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"need {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free_uncached:
                b = self._free_uncached.popleft()
            else:
                b, session = self._free_cached.pop()
                self._evict(b, session)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def _evict(self, b: int, session: str | None) -> None:
        h = self.hash_of[b]
        if h is not None and self.cached.get(h) == b:
            del self.cached[h]
            self._emit(KVEventKind.REMOVED, h, self.parent_of[b], self.block_size)
            if self.on_evict is not None:
                self.on_evict(b, h, self.parent_of[b], session)
        self.hash_of[b] = self.parent_of[b] = None

    def release(self, block_ids: list[int], session: str | None = None) -> None:
        """Drops one reference from each block; the tail of a sequence is released first so that
        shared prefixes outlive the blocks that only this request used. `session`: the releasing
        request's session hint, which decides the block's eviction class."""
        self._free_cached.touch(session)
        for b in reversed(block_ids):
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0, f"block {b} released twice"
            if self.ref_cnt[b] == 0:
                if self.hash_of[b] is None:
                    self._free_uncached.append(b)
                else:
                    self._free_cached.add(b, session)

    def cache_block(self, b: int, block_hash: int, parent: int, take_over_idle: bool = False) -> None:
        """`take_over_idle`: when an idle block holds the same content, `b` (just computed, in use) becomes
        the cached copy and the idle one a plain free block: the copy kept is the one its users release last."""
        other = self.cached.get(block_hash)
        if take_over_idle and other is not None and other != b and self.ref_cnt[other] == 0 and self.hash_of[b] is None:
            self._free_cached.discard(other)
            self.hash_of[other] = self.parent_of[other] = None
            self._free_uncached.append(other)
            self.cached[block_hash] = b
            self.hash_of[b], self.parent_of[b] = block_hash, parent
            return  # the same content stays cached: nothing to publish
        if block_hash in self.cached or self.hash_of[b] is not None:
            return  # same content already cached by another block (computed concurrently)
        self.cached[block_hash] = b
        self.hash_of[b], self.parent_of[b] = block_hash, parent
        self._emit(KVEventKind.STORED, block_hash, parent, self.block_size)

    def clear_cache(self) -> None:
        """Forgets every cached hash (blocks in use stay allocated) and publishes one CLEARED event."""
        for b in list(self._free_cached):
            self._free_uncached.append(b)
        self._free_cached.clear()
        for b in range(self.num_blocks):
            self.hash_of[b] = self.parent_of[b] = None
        self.cached.clear()
        self._emit(KVEventKind.CLEARED)


class KVCacheManager:
    # Whether a block computed again while an idle block holds the same content becomes the cached copy: for
    # caches whose hits can stop short of the cached run (window_cache.py), so that a recomputed run stays
    # cached in the order its users release it.
    take_over_idle = False

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_keys: str = "",
        events: KVEventPublisher | None = None,
        host: HostKVTier | None = None,
        session_idle_s: float = 600.0,
    ):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_keys = extra_keys
        self.pool = BlockPool(num_blocks, block_size, events, SessionAwareLRU(session_idle_s))
        self._num_cached_blocks: dict[str, int] = {}
        # The host tier: evicted cached blocks are saved to it and blocks a request reuses loaded from it, both
        # through its channel, which the engine empties around each step.
        self.host = host
        self.host_channel = HostChannel(host) if host is not None else None
        self.host_hit_tokens = 0
        if self.host_channel is not None:
            self.pool.on_evict = self.host_channel.save

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_hashes(self, request: Request) -> None:
        """Extends `request.block_hashes` to cover every full block of its tokens."""
        tokens = request.all_token_ids
        have = len(request.block_hashes)
        if len(tokens) // self.block_size > have:
            parent = request.block_hashes[-1] if have else ROOT_PARENT
            request.block_hashes += block_hashes(tokens, self.block_size, self.extra_keys, have, parent)

    def cached_prefix(self, request: Request, max_blocks: int | None = None) -> list[int]:
        """Blocks of the longest cached prefix of the request's tokens (none without prefix caching), of at
        most `max_blocks` (an import reuses only prompt blocks)."""
        if not self.enable_prefix_caching:
            return []
        self.pool.touch_session(request.session_id)
        self.update_hashes(request)
        return self.pool.longest_cached_prefix(request.block_hashes[:max_blocks])

    def host_prefix(self, request: Request, num_device_blocks: int) -> list[int]:
        """Host-tier slots of the blocks that continue the request's device-cached prefix."""
        if self.host is None:
            return []
        return self.host.lookup(request.block_hashes[num_device_blocks:], request.session_id)

    def allocate(
        self, request: Request, num_new_tokens: int, prefix_blocks: list[int] = (), host_slots: list[int] = ()
    ) -> list[BlockCopy] | None:
        """Gives the request blocks for `num_new_tokens` more tokens (after taking `prefix_blocks`); the
        first new blocks get the host tier's `host_slots` copied in (`pending_loads`).

        Returns the block copies the runner must do first, or None (nothing changed) if the pool is short.
        """
        prefix_blocks = list(prefix_blocks)
        total = request.num_computed_tokens + num_new_tokens
        have = len(request.block_ids) + len(prefix_blocks)
        needed = max(0, self.blocks_needed(total) - have)
        # A hit on the whole prompt still recomputes its last token, which writes into the last
        # (shared) block: that block is copied first.
        cow = bool(prefix_blocks) and request.num_computed_tokens < len(prefix_blocks) * self.block_size
        available = self.pool.num_free - self.pool.num_free_among(prefix_blocks)
        if needed + cow > available:
            return None
        self.pool.take(prefix_blocks)
        copies = []
        if cow:
            shared = prefix_blocks[-1]
            (private,) = self.pool.allocate(1)
            self.pool.release([shared])
            prefix_blocks[-1] = private
            copies.append(BlockCopy(shared, private))
        new = self.pool.allocate(needed)
        request.block_ids += prefix_blocks + new
        if prefix_blocks:
            self._num_cached_blocks[request.request_id] = len(prefix_blocks) - cow
        if host_slots:
            self.host_channel.load(request.request_id, new[: len(host_slots)], host_slots)
            self.host_hit_tokens += len(host_slots) * self.block_size
        return copies

    def allocate_import(self, request: Request, prefix_blocks: list[int]) -> list[BlockCopy] | None:
        """Blocks for an imported prompt's KV (after taking our own cached `prefix_blocks`): `allocate` for the
        rest of the prompt."""
        return self.allocate(request, request.num_prompt_tokens - request.num_computed_tokens, prefix_blocks)

    def import_lacks_window(self, request: Request, window_start_block: int) -> None:
        """An imported prompt's sliding-window layers came only from `window_start_block` on (the sender let go of
        the earlier blocks'): one pool caches a block for every layer at once, so none of this request's
        blocks enter the prefix cache (a hit ending among them would read the missing window)."""
        self._num_cached_blocks[request.request_id] = 1 << 62

    def host_channels(self) -> list[HostChannel]:
        """Each cache group's traffic with its host tier (none without a tier)."""
        return [self.host_channel] if self.host_channel is not None else []

    def shares_pool(self, a: Request, b: Request) -> bool:
        """Whether freeing `a`'s cache can make room for `b`: always, with one pool (the data-parallel
        manager answers per rank)."""
        return True

    def plan_needs_pending_token(self, request: Request) -> bool:
        """Asynchronous scheduling: whether planning the request's next step needs the token a step in
        flight is still sampling. Never for attention-only models (block tables need no token ids)."""
        return False

    def can_speculate(self, request: Request) -> bool:
        """Whether the request's next step may carry drafts: always (rejected positions need nothing undone)."""
        return True

    def verified(self, request: Request, num_accepted: int, num_drafted: int) -> None:
        """A verify step confirmed `num_accepted` of `num_drafted` drafts (already appended as output tokens):
        their KV counts as computed; blocks holding only rejected positions go back to the pool."""
        request.num_computed_tokens += num_accepted
        self.cache_full_blocks(request)
        self.trim(request)

    def plan_step(self, request: Request, start: int, num_new_tokens: int, num_spec: int = 0) -> None:
        """Nothing beyond the block table: attention-only models need no per-step cache directions."""
        return None

    def chunk_tokens(self, request: Request, start: int, num_new_tokens: int) -> int:
        """How many of the `num_new_tokens` the scheduler may give the request from `start` this step: a
        cache that wants something kept at a position inside (a hybrid model's state) ends the chunk there.
        Attention-only models keep every block anyway: all of them."""
        return num_new_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the blocks that became full and computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(request)
        done = self._num_cached_blocks.get(request.request_id, 0)
        full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(done, full):
            parent = request.block_hashes[i - 1] if i else ROOT_PARENT
            self.pool.cache_block(request.block_ids[i], request.block_hashes[i], parent, self.take_over_idle)
        self._num_cached_blocks[request.request_id] = max(done, full)

    def trim(self, request: Request) -> None:
        """Returns the blocks past the request's tokens to the pool (speculative decoding allocated them for
        drafts that were rejected); they were never hashed, so nothing is published."""
        keep = self.blocks_needed(request.num_tokens)
        if len(request.block_ids) > keep:
            self.pool.release(request.block_ids[keep:])
            del request.block_ids[keep:]

    def free(self, request: Request) -> None:
        self.pool.release(request.block_ids, request.session_id)
        request.block_ids = []
        self._num_cached_blocks.pop(request.request_id, None)

    def clear_prefix_cache(self) -> None:
        self.pool.clear_cache()
        for channel in self.host_channels():
            channel.clear()
