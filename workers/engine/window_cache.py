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

Speculative decoding: rejected drafts' blocks go back in both groups (`trim`); drafts never move the point
blocks are let go from (the step's first position, which verification never rolls back past).
"""

from __future__ import annotations

from .block_hash import ROOT_PARENT
from .kv_cache_manager import BlockCopy, BlockPool, KVCacheManager
from .kv_events import KVEventKind, KVEventPublisher
from .request import Request
from .retention import SessionAwareLRU

NO_BLOCK = -1  # a window-table entry whose block was let go (never read: out of every query's window)
FULL_GROUP, WINDOW_GROUP = 0, 1  # BlockCopy.group


def window_blocks_per_sequence(window: int, block_size: int) -> int:
    """The most window-group blocks one sequence holds between steps: those covering its last `window - 1`
    positions plus the block its next token goes in."""
    return -(-(window - 1) // block_size) + 1


class WindowPrefix(list):
    """A prefix hit (the full group's blocks, the list the scheduler sees) plus the window group's cached
    blocks for it: `window_blocks` cover blocks [window_start, len(self))."""

    window_start: int = 0
    window_blocks: tuple[int, ...] = ()


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
    ):
        super().__init__(num_blocks, block_size, enable_prefix_caching, extra_keys, None, None, session_idle_s)
        if window < 1:
            raise ValueError(f"the sliding window must be positive, got {window}")
        self.window = window
        self.events = events
        self.window_pool = BlockPool(num_window_blocks, block_size, None, SessionAwareLRU(session_idle_s))
        self.pool.on_evict = self._full_block_evicted
        self.window_pool.on_evict = self._window_block_evicted
        self._num_cached_window: dict[str, int] = {}
        self._published: set[int] = set()
        # window block hash -> published blocks whose hit needs it (REMOVED when it is evicted)
        self._dependents: dict[int, list[int]] = {}
        # The full group's cached chains, both ways: a window block cached again (recomputed by a request
        # whose prompt ends there) can make deeper boundaries reusable that no running request passes.
        self._depth: dict[int, int] = {}  # full-cached block hash -> its index in the chain
        self._children: dict[int, set[int]] = {}  # block hash -> full-cached blocks whose parent it is

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

    def cached_prefix(self, request: Request) -> list[int]:
        full = super().cached_prefix(request)
        if not full:
            return full
        cached = self.window_pool.cached
        hashes = request.block_hashes
        run = 0  # window blocks cached consecutively through block i
        best = -1
        for i in range(len(full)):
            run = run + 1 if hashes[i] in cached else 0
            if run >= i - self._hit_window_start(i) + 1:
                best = i
        hit = WindowPrefix(full[: best + 1])
        if best >= 0:
            hit.window_start = self._hit_window_start(best)
            hit.window_blocks = tuple(cached[h] for h in hashes[hit.window_start : best + 1])
        return hit

    # ---------------------------------------------------------------- allocation

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        prefix_blocks: list[int] = (),
        host_slots: list[int] = (),
        reads_from: int | None = None,
    ) -> list[BlockCopy] | None:
        """`KVCacheManager.allocate` for both groups. `reads_from`: the first position a query will be computed
        at (default: the step's first); an imported prompt's is its end, so the window group gets only the
        blocks its decode reads."""
        if host_slots:
            raise ValueError("the host KV tier is not supported with a sliding-window cache group")
        start = request.num_computed_tokens
        first_needed = self.first_needed(start if reads_from is None else reads_from)
        self._let_go(request, first_needed)
        first, window_hit = self._window_prefix(request, prefix_blocks)
        table_len = len(request.window_block_ids) + len(prefix_blocks)
        skipped = max(0, first_needed - table_len)  # new blocks no query will read: never allocated
        needed = max(0, self.blocks_needed(start + num_new_tokens) - table_len - skipped)
        cow = bool(prefix_blocks) and start < len(prefix_blocks) * self.block_size
        # Both groups must have room before either changes: the scheduler preempts when one is short.
        if needed + cow > self.window_pool.num_free - self.window_pool.num_free_among(list(window_hit)):
            return None
        copies = super().allocate(request, num_new_tokens, prefix_blocks)
        if copies is None:
            return None
        table = self._take_window_prefix(first, window_hit, cow, copies)
        request.window_block_ids += table + [NO_BLOCK] * skipped + self.window_pool.allocate(needed)
        if prefix_blocks:
            self._num_cached_window[request.request_id] = len(prefix_blocks) - cow
        self._let_go(request, first_needed)  # a hit reaching back past what is read from now on
        return copies

    def import_lacks_window(self, request: Request, window_start_block: int) -> None:
        """Nothing to do: the window table gets blocks only from where the decode reads (`allocate_import`),
        never before the sender's first sliding block; those blocks' windows are never cached."""

    def allocate_import(self, request: Request, prefix_blocks: list[int]) -> list[BlockCopy] | None:
        return self.allocate(
            request, request.num_prompt_tokens - request.num_computed_tokens, prefix_blocks, reads_from=request.num_prompt_tokens
        )

    def _window_prefix(self, request: Request, prefix_blocks: list[int]) -> tuple[int, tuple[int, ...]]:
        """(first block, window blocks) of a prefix hit: from the hit itself, or looked up again when the
        caller passed a copy of the list (the blocks are the same: nothing was evicted in between)."""
        if not prefix_blocks:
            return 0, ()
        if isinstance(prefix_blocks, WindowPrefix):
            return prefix_blocks.window_start, prefix_blocks.window_blocks
        last = len(prefix_blocks) - 1
        first = self._hit_window_start(last)
        blocks = tuple(self.window_pool.cached.get(h, NO_BLOCK) for h in request.block_hashes[first : last + 1])
        if NO_BLOCK in blocks:
            raise RuntimeError(f"prefix hit of {len(prefix_blocks)} blocks without its window blocks cached")
        return first, blocks

    def _take_window_prefix(self, first: int, blocks: tuple[int, ...], cow: bool, copies: list[BlockCopy]) -> list[int]:
        if not blocks:
            return []
        blocks = list(blocks)
        self.window_pool.take(blocks)
        if cow:  # the last token of a whole-prompt hit is recomputed into the last block: a private copy
            (private,) = self.window_pool.allocate(1)
            self.window_pool.release([blocks[-1]])
            copies.append(BlockCopy(blocks[-1], private, WINDOW_GROUP))
            blocks[-1] = private
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
            parent = hashes[i - 1] if i else ROOT_PARENT
            if hashes[i] not in self._depth and hashes[i] in self.pool.cached:
                self._depth[hashes[i]] = i
                self._children.setdefault(parent, set()).add(hashes[i])
        recached = []  # window blocks cached anew: boundaries past this request's may become reusable
        for i in range(self._num_cached_window.get(rid, 0), full):
            if table[i] != NO_BLOCK:
                known = hashes[i] in self.window_pool.cached
                self.window_pool.cache_block(table[i], hashes[i], hashes[i - 1] if i else ROOT_PARENT, True)
                if not known:
                    recached.append(hashes[i])
        self._num_cached_window[rid] = max(full, self._num_cached_window.get(rid, 0))
        for h in self._boundaries_after(hashes[done:full], recached):
            self._publish_if_reusable(h)

    def _boundaries_after(self, new: list[int], recached: list[int]) -> list[int]:
        """The request's newly full blocks, then the cached descendants of each window block cached anew
        within a window's reach (a boundary that far below needs it), each once."""
        out = list(new)
        frontier = list(recached)
        for _ in range(window_blocks_per_sequence(self.window, self.block_size)):
            frontier = [c for h in frontier for c in self._children.get(h, ())]
            out += frontier
        return list(dict.fromkeys(out))

    def _window_hashes(self, h: int) -> list[int] | None:
        """The window block hashes a hit through cached block `h` needs (walking its parents), None if the
        full group's chain is not known that far."""
        depth = self._depth.get(h)
        if depth is None:
            return None
        chain = [h]
        for _ in range(depth - self._hit_window_start(depth)):
            b = self.pool.cached.get(chain[-1])
            if b is None:
                return None
            chain.append(self.pool.parent_of[b])
        return chain

    def _publish_if_reusable(self, h: int) -> None:
        if h in self._published or h not in self.pool.cached:
            return
        window = self._window_hashes(h)
        if window is None or not all(w in self.window_pool.cached for w in window):
            return
        self._published.add(h)
        for w in window:
            self._dependents.setdefault(w, []).append(h)
        self._emit(KVEventKind.STORED, h, self.pool.parent_of[self.pool.cached[h]])

    def _unpublish(self, h: int, parent: int | None) -> None:
        if h in self._published:
            self._published.discard(h)
            self._emit(KVEventKind.REMOVED, h, parent)

    def _full_block_evicted(self, block: int, h: int, parent: int | None, session: str | None) -> None:
        self._unpublish(h, parent)
        if self._depth.pop(h, None) is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.discard(h)
                if not siblings:
                    del self._children[parent]

    def _window_block_evicted(self, block: int, h: int, parent: int | None, session: str | None) -> None:
        for dependent in self._dependents.pop(h, ()):
            b = self.pool.cached.get(dependent)
            self._unpublish(dependent, None if b is None else self.pool.parent_of[b])

    def _emit(self, kind: KVEventKind, h: int | None = None, parent: int | None = None) -> None:
        if self.events is not None:
            self.events.emit(kind, h, parent, self.block_size if h is not None else 0)

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
        super().free(request)

    def clear_prefix_cache(self) -> None:
        self.window_pool.clear_cache()
        super().clear_prefix_cache()
        self._published.clear()
        self._dependents.clear()
        self._depth.clear()
        self._children.clear()
        self._emit(KVEventKind.CLEARED)
