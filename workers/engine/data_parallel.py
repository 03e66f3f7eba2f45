"""Data-parallel attention in the engine: each DP rank owns its sequences and their KV blocks.

- `DataParallelKVCacheManager` is one `KVCacheManager` per rank behind the interface the scheduler and
  the engine already use. Block ids are global: rank r owns ids [r * B, (r + 1) * B), so the runner,
  block copies and KV export/import see one id space, and a request's rank is
  `block_ids[0] // B`. A new (or preempted) sequence goes to the rank with the most blocks it could
  use: free blocks plus the blocks of its cached prefix there (ties: the lower rank).
- `DataParallelRunner` lays a step out as [dp, N]: row r holds rank r's tokens, padded to one token
  bucket (the largest rank's count decides it), with rank-local page ids; the KV pages of each layer
  are one [dp * B, ...] array split over the DP mesh axes. Attention runs per rank
  (`workers.models.dp_attention`); the MoE is expert-parallel over the whole mesh. Logits come back in
  the scheduler's order, so the engine samples exactly as on one device.

The KV budget (`num_kv_blocks` / `kv_cache_memory_bytes`) is per rank: every device holds B blocks.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kernels.collectives import place_host
from workers.models import LoadedModel
from workers.models.dp_attention import DataParallelHybridCache, DataParallelPagedKVCache

from .config import EngineConfig
from .kv_cache_manager import BlockCopy, KVCacheManager
from .kv_events import KVEventPublisher
from .request import Request
from .runner import KEEP, ModelRunner, RoutingCounter, StepInputs, pick_bucket
from .scheduler import SchedulerOutput
from .state_cache import SNAPSHOTS_PER_STEP, HybridCacheManager, HybridPrefix, KeepPoints
from .window_cache import NO_BLOCK, WindowedKVCacheManager


@dataclass(frozen=True)
class _PoolTotals:
    num_blocks: int
    num_free: int


def _shifted(prefix, delta: int):
    """A prefix's block ids moved between rank-local and global, keeping what else it carries (a hybrid
    prefix's rank-local snapshot slot)."""
    out = type(prefix)(b + delta for b in prefix) if isinstance(prefix, HybridPrefix) else [b + delta for b in prefix]
    if isinstance(prefix, HybridPrefix):
        out.snapshot_slot = prefix.snapshot_slot
    return out


class DataParallelKVCacheManager:
    """One cache manager per rank (a `KVCacheManager`, or a `HybridCacheManager` when
    `slots_per_rank` is given: each rank then also owns state slots [r * slots, (r + 1) * slots))."""

    def __init__(
        self,
        dp: int,
        blocks_per_rank: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_keys: str = "",
        events: KVEventPublisher | None = None,
        slots_per_rank: int = 0,
        snapshots_per_rank: int = 0,
        keep_points: KeepPoints = KeepPoints(),
        window: int | None = None,
        window_blocks_per_rank: int = 0,
    ):
        """`window`: the sliding-window layers' cache group (window_cache.py), `window_blocks_per_rank` blocks
        per rank (rank r's: [r * that, (r + 1) * that) of its pages)."""
        if window is not None:
            self.ranks = [
                WindowedKVCacheManager(
                    blocks_per_rank, window_blocks_per_rank, block_size, window, enable_prefix_caching, extra_keys, events
                )
                for _ in range(dp)
            ]
        elif slots_per_rank:
            self.ranks = [
                HybridCacheManager(
                    blocks_per_rank,
                    block_size,
                    slots_per_rank,
                    snapshots_per_rank,
                    enable_prefix_caching,
                    extra_keys,
                    events,
                    keep_points=keep_points,
                )
                for _ in range(dp)
            ]
        else:
            self.ranks = [KVCacheManager(blocks_per_rank, block_size, enable_prefix_caching, extra_keys, events) for _ in range(dp)]
        self.slots_per_rank = slots_per_rank
        self.blocks_per_rank = blocks_per_rank
        self.window_blocks_per_rank = window_blocks_per_rank
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._rank_of: dict[str, int] = {}

    # ---------------------------------------------------------------- totals

    @property
    def num_free_blocks(self) -> int:
        return sum(r.num_free_blocks for r in self.ranks)

    @property
    def pool(self) -> _PoolTotals:
        return _PoolTotals(self.blocks_per_rank * len(self.ranks), self.num_free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- ranks

    def rank(self, request: Request) -> int:
        """The request's rank, chosen on first use: most free + prefix-cached blocks, then lowest rank."""
        r = self._rank_of.get(request.request_id)
        if r is None:
            r = max(range(len(self.ranks)), key=lambda i: (self._room(i, request), -i))
            self._rank_of[request.request_id] = r
        return r

    def _room(self, i: int, request: Request) -> int:
        manager = self.ranks[i]
        return manager.num_free_blocks + len(manager.cached_prefix(request))

    def host_channels(self) -> list:
        """None: the host KV tier is not supported with data-parallel attention (the engine refuses it)."""
        return []

    def shares_pool(self, a: Request, b: Request) -> bool:
        """Whether freeing `a`'s blocks can make room for `b` (the scheduler's preemption choice)."""
        return self.rank(a) == self.rank(b)

    @contextmanager
    def _on_rank(self, request: Request):
        """The request's manager, with its block ids rank-local for the duration (global outside)."""
        r = self.rank(request)
        offset, window_offset = r * self.blocks_per_rank, r * self.window_blocks_per_rank
        request.block_ids = [b - offset for b in request.block_ids]
        request.window_block_ids = [b if b == NO_BLOCK else b - window_offset for b in request.window_block_ids]
        try:
            yield self.ranks[r], offset
        finally:
            request.block_ids = [b + offset for b in request.block_ids]
            request.window_block_ids = [b if b == NO_BLOCK else b + window_offset for b in request.window_block_ids]

    # ---------------------------------------------------------------- the KVCacheManager interface

    def update_hashes(self, request: Request) -> None:
        self.ranks[0].update_hashes(request)  # hashes depend on the tokens only

    def plan_needs_pending_token(self, request: Request) -> bool:
        return self.ranks[0].plan_needs_pending_token(request)  # depends on the position only

    def host_prefix(self, request: Request, num_device_blocks: int) -> list[int]:
        """No host tier under data-parallel attention yet."""
        return []

    def cached_prefix(self, request: Request, max_blocks: int | None = None) -> list[int]:
        with self._on_rank(request) as (manager, offset):
            return _shifted(manager.cached_prefix(request, max_blocks), offset)

    def allocate(self, request: Request, num_new_tokens: int, prefix_blocks=()) -> list[BlockCopy] | None:
        with self._on_rank(request) as (manager, offset):
            copies = manager.allocate(request, num_new_tokens, _shifted(prefix_blocks, -offset))
        return self._global_copies(request, copies, offset)

    def _global_copies(self, request: Request, copies: list[BlockCopy] | None, offset: int) -> list[BlockCopy] | None:
        if copies is None:
            return None
        window_offset = self.rank(request) * self.window_blocks_per_rank
        return [
            BlockCopy(c.src + (window_offset if c.group else offset), c.dst + (window_offset if c.group else offset), c.group)
            for c in copies
        ]

    def import_lacks_window(self, request: Request, window_start_block: int) -> None:
        with self._on_rank(request) as (manager, _):
            manager.import_lacks_window(request, window_start_block)

    def allocate_import(self, request: Request, prefix_blocks: list[int]) -> list[BlockCopy] | None:
        with self._on_rank(request) as (manager, offset):
            copies = manager.allocate_import(request, _shifted(prefix_blocks, -offset))
        return self._global_copies(request, copies, offset)

    def plan_step(self, request: Request, start: int, num_new_tokens: int, num_spec: int = 0):
        """Rank-local directions (hybrid: rank-local state slots, as the runner lays each rank out)."""
        with self._on_rank(request) as (manager, _):
            return manager.plan_step(request, start, num_new_tokens, num_spec)

    def can_speculate(self, request: Request) -> bool:
        with self._on_rank(request) as (manager, _):
            return manager.can_speculate(request)

    def verified(self, request: Request, num_accepted: int, num_drafted: int) -> None:
        with self._on_rank(request) as (manager, _):
            manager.verified(request, num_accepted, num_drafted)

    def chunk_tokens(self, request: Request, start: int, num_new_tokens: int) -> int:
        with self._on_rank(request) as (manager, _):
            return manager.chunk_tokens(request, start, num_new_tokens)

    def working_slot(self, request_id: str) -> int | None:
        """A hybrid request's working slot as a global id (rank r's slots follow rank r - 1's)."""
        r = self._rank_of.get(request_id)
        slot = None if r is None else self.ranks[r].working_slot(request_id)
        return None if slot is None else r * self.slots_per_rank + slot

    def state_written(self, request_id: str) -> None:
        r = self._rank_of.get(request_id)
        if r is not None:
            self.ranks[r].state_written(request_id)

    @property
    def num_snapshots(self) -> int:
        return sum(getattr(m, "num_snapshots", 0) for m in self.ranks)

    def cache_full_blocks(self, request: Request) -> None:
        with self._on_rank(request) as (manager, _):
            manager.cache_full_blocks(request)

    def free(self, request: Request) -> None:
        with self._on_rank(request) as (manager, _):
            manager.free(request)
        self._rank_of.pop(request.request_id, None)  # a restarted (preempted) request may move

    def clear_prefix_cache(self) -> None:
        for manager in self.ranks:
            manager.clear_prefix_cache()


class DataParallelRunner(ModelRunner):
    prompt_rows_in_step = False  # a prompt's logprobs come from a forward of their own (ranks lay rows out apart)

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig,
        blocks_per_rank: int,
        max_model_len: int,
        slots_per_rank: int = 0,
        window_blocks_per_rank: int = 0,
    ):
        self.dp = model.data_parallel_size
        self.blocks_per_rank = blocks_per_rank
        self.slots_per_rank = slots_per_rank
        self.window_blocks_per_rank = window_blocks_per_rank
        self.rank_sharding = NamedSharding(model.mesh, PartitionSpec(model.data_axes))
        super().__init__(
            model,
            config,
            blocks_per_rank * self.dp,
            max_model_len,
            slots_per_rank * self.dp,
            num_window_blocks=window_blocks_per_rank * self.dp,
        )
        self.token_sharding = self.rank_sharding
        replicated = NamedSharding(model.mesh, PartitionSpec())
        pages = [self.rank_sharding] * self.cfg.num_kv_layers
        pools = None
        if self.num_state_slots:
            pools = ([self.rank_sharding] * self.cfg.num_state_layers,) * 2
        # Logits replicated: every process of a multi-host engine samples the same tokens.
        self._step = jax.jit(
            self._step_impl,
            donate_argnums=(1, 2),
            out_shardings=(replicated, pages, pools, replicated, replicated),
            static_argnames=("decode_only",),
        )

    def program_key(self) -> tuple | None:
        key = super().program_key()
        if key is None:
            return None
        per_rank = (self.dp, self.blocks_per_rank, self.slots_per_rank, self.window_blocks_per_rank)
        return (*key, per_rank, tuple(self.token_buckets), tuple(self.page_buckets))

    def _new_pages(self, page_shapes):
        zeros = lambda shape: jax.jit(lambda: jnp.zeros(shape, self.model.dtype), out_shardings=self.rank_sharding)()
        return [zeros(shape) for shape in page_shapes]

    def _new_state_pools(self):
        """Rank r's slots are rows [r * slots, (r + 1) * slots) of each pool, on rank r's devices."""
        n, cfg = self.num_state_slots, self.cfg
        zeros = lambda shape: jax.jit(lambda: jnp.zeros((n, *shape), jnp.float32), out_shardings=self.rank_sharding)()
        return [zeros(cfg.conv_state_shape) for _ in range(cfg.num_state_layers)], [
            zeros(cfg.recurrent_state_shape) for _ in range(cfg.num_state_layers)
        ]

    def _step_impl(
        self,
        weights,
        kv_pages,
        state_pools,
        tokens,
        positions,
        slot_mapping,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        logits_indices,
        states,
        window=None,
        hidden=None,
        decode_only=False,
    ):
        self.num_traces += 1
        meta = (list(kv_pages), slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs, self.model.mesh, self.model.data_axes)
        if window is not None:
            cache = DataParallelPagedKVCache(
                *meta, window_slot_mapping=window[0], window_page_indices=window[1], window_layers=self.window_layers
            )
        elif state_pools is None:
            cache = DataParallelPagedKVCache(*meta)
        else:
            conv, rec = state_pools
            cache = DataParallelHybridCache(*meta, list(conv), list(rec), *states, decode_only=decode_only)
        counter = RoutingCounter(self.model.experts, slot_mapping >= 0, self.cfg.num_experts)
        logits, cache = self.model.family.forward(weights, self.cfg, tokens, positions, cache, logits_indices, experts=counter)
        # No hidden states out: a multi-token-prediction head runs on one device only (mtp_proposer.py).
        return logits, cache.pages, None if state_pools is None else (cache.conv, cache.recurrent), counter.loads(), None

    def rank_of(self, block_ids: list[int]) -> int:
        return block_ids[0] // self.blocks_per_rank

    def logits_rows_for(self, token_bucket: int, drafts: bool = True) -> int:
        """Every rank's logits rows, flattened: what the step's programs are keyed and compiled by (warm-up
        compiled one rank's count, so each step program compiled again at its first real step)."""
        return self.dp * super().logits_rows_for(token_bucket, drafts)

    def prepare(self, out: SchedulerOutput, prev_tokens: jax.Array | None = None) -> StepInputs:
        """Per-rank rows padded to one token bucket; logits rows in the scheduler's order."""
        ranks = [self.rank_of(item.request.block_ids) for item in out.scheduled]
        tokens_per_rank = np.bincount(ranks, [item.num_new_tokens for item in out.scheduled], minlength=self.dp)
        seqs_per_rank = np.bincount(ranks, minlength=self.dp)
        n = pick_bucket(self.token_buckets, int(tokens_per_rank.max()))
        s = self.seqs_for(n)
        if seqs_per_rank.max() > s:
            raise ValueError(f"{seqs_per_rank.max()} sequences on one rank exceed the bucket's {s} slots")
        p = pick_bucket(self.page_buckets, max(len(x.request.block_ids) for x in out.scheduled))
        inputs = self.dummy_inputs(n, p)
        inputs.logits_indices = np.zeros((self.logits_rows_for(n, any(item.num_spec for item in out.scheduled)),), np.int32)
        offset, seq = np.zeros(self.dp, np.int64), np.zeros(self.dp, np.int64)
        row = 0
        for item, r in zip(out.scheduled, ranks):
            req, k, start = item.request, item.num_new_tokens, item.start
            i, o = seq[r], offset[r]
            pos = np.arange(start, start + k, dtype=np.int32)
            blocks = np.asarray(req.block_ids, np.int32) - r * self.blocks_per_rank
            inputs.put_tokens(r, o, req, start, k - item.num_spec, prev_tokens)
            if item.num_spec:  # drafts after the known tokens (speculative decoding)
                inputs.tokens[r, o + k - item.num_spec : o + k] = item.drafts
            inputs.positions[r, o : o + k] = pos
            inputs.slot_mapping[r, o : o + k] = blocks[pos // self.block_size] * self.block_size + pos % self.block_size
            inputs.kv_lens[r, i] = start + k
            inputs.page_indices[r, i, : len(blocks)] = blocks
            if self.window_layers:  # rank-local window blocks; those let go read as page 0 (never seen)
                ids = np.asarray(req.window_block_ids, np.int32)
                table = np.where(ids == NO_BLOCK, 0, ids - r * self.window_blocks_per_rank)
                inputs.window_slot_mapping[r, o : o + k] = table[pos // self.block_size] * self.block_size + pos % self.block_size
                inputs.window_page_indices[r, i, : len(table)] = table
            inputs.cu_q_lens[r, i + 1 :] = o + k
            # Rows of the flattened [dp * n] batch: the last token's, and each draft's before it.
            inputs.logits_rows.append(row)
            inputs.logits_indices[row : row + item.num_spec + 1] = r * n + o + k - 1 - np.arange(item.num_spec, -1, -1)
            row += item.num_spec + 1
            if self.num_state_slots:  # rank-local slots (the DP manager plans each rank locally)
                st = item.cache_step
                inputs.state_slots[r, i] = st.slot
                offset_slots = r * self.slots_per_rank
                if st.init != KEEP:  # set up before the step, by global slot id
                    src = st.init if st.init < 0 else st.init + offset_slots
                    inputs.state_inits.append((st.slot + offset_slots, src))
                if st.backup >= 0:  # speculative decoding's backup, from the init's source if any
                    src = st.slot + offset_slots if st.init == KEEP else (st.init if st.init < 0 else st.init + offset_slots)
                    inputs.state_inits.append((st.backup + offset_slots, src))
                for j, (snap, length) in enumerate(st.snaps):
                    inputs.snap_slots[r, i, j], inputs.snap_lens[r, i, j] = snap, length
            offset[r], seq[r] = o + k, i + 1
        inputs.num_seqs[:, 0] = seq
        inputs.decode_only = bool(self.num_state_slots) and all(item.num_new_tokens == 1 for item in out.scheduled)
        return inputs

    def dummy_inputs(self, n: int, p: int, decode_only: bool = False, rows: int | None = None) -> StepInputs:
        s, dp = self.seqs_for(n), self.dp
        inputs = StepInputs(
            tokens=np.zeros((dp, n), np.int32),
            positions=np.zeros((dp, n), np.int32),
            slot_mapping=np.full((dp, n), -1, np.int32),
            kv_lens=np.zeros((dp, s), np.int32),
            page_indices=np.zeros((dp, s, p), np.int32),
            cu_q_lens=np.zeros((dp, s + 1), np.int32),
            num_seqs=np.zeros((dp, 1), np.int32),
            logits_indices=np.zeros((self.logits_rows_for(n) if rows is None else rows,), np.int32),
        )
        if self.num_state_slots:
            inputs.state_slots = np.zeros((dp, s), np.int32)
            inputs.snap_slots = np.full((dp, s, SNAPSHOTS_PER_STEP), -1, np.int32)
            inputs.snap_lens = np.zeros((dp, s, SNAPSHOTS_PER_STEP), np.int32)
            inputs.decode_only = decode_only
        if self.window_layers:
            self._empty_window(inputs)
        return inputs

    def _step_args(self, inputs: StepInputs) -> tuple:
        """Each rank's rows placed on its devices."""
        per_rank = ["positions", "slot_mapping", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"]
        if self.num_state_slots:
            per_rank += ["state_slots", "snap_slots", "snap_lens"]
        if self.window_layers:
            per_rank += ["window_slot_mapping", "window_page_indices"]
        placed = {name: place_host(getattr(inputs, name), self.rank_sharding) for name in per_rank}
        placed["tokens"] = self.input_tokens(inputs)  # placed by the base (token_sharding)
        return super()._step_args(StepInputs(**placed, logits_indices=inputs.logits_indices, decode_only=inputs.decode_only))
