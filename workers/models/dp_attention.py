"""Data-parallel attention over a paged KV cache: each data-parallel rank owns its sequences and their KV
blocks, and attends only to them.

`DataParallelPagedKVCache` is a drop-in for `layers.PagedKVCache` (same `update_and_attend`), for a batch
laid out as [dp, N]: row r holds rank r's N (padded) tokens. Per layer, the pages are one
[dp * blocks, page, 2 * Hkv, D] array split over the data-parallel mesh axes, so rank r's shard is
its own `blocks` pages; the step metadata has a leading [dp] dimension and uses rank-local page ids.
Attention runs inside `shard_map`: no collective, every rank sees only its own shard. The rest of the
forward (projections, the expert-parallel MoE, the LM head) runs on the [dp, N] batch under GSPMD.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
from jax.sharding import Mesh, PartitionSpec

from kernels.attention import ragged_paged_attention, ragged_paged_mla, write_kv, write_latent

from .paged_state import ragged_conv_step, ragged_delta_step

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclass
class DataParallelPagedKVCache:
    pages: list[Array]  # per layer [dp * blocks, page_size, 2 * Hkv, D], split over `axes`
    slot_mapping: Array  # i32[dp, N], rank-local slots, -1 for padding tokens
    kv_lens: Array  # i32[dp, S]
    page_indices: Array  # i32[dp, S, pages_per_seq], rank-local page ids
    cu_q_lens: Array  # i32[dp, S + 1]
    num_seqs: Array  # i32[dp, 1]
    mesh: Mesh = field(metadata=dict(static=True))
    axes: tuple[str, ...] = field(metadata=dict(static=True))  # the data-parallel mesh axes
    # A sliding-window cache group (as `layers.PagedKVCache`): its layers' rank-local slots and page tables.
    window_slot_mapping: Array | None = field(default=None, kw_only=True)  # i32[dp, N]
    window_page_indices: Array | None = field(default=None, kw_only=True)  # i32[dp, S, pages_per_seq]
    window_layers: tuple[int, ...] = field(default=(), kw_only=True, metadata=dict(static=True))

    def _tables(self, layer) -> tuple[Array, Array]:
        if layer in self.window_layers:
            return self.window_slot_mapping, self.window_page_indices
        return self.slot_mapping, self.page_indices

    def update_and_attend(self, layer, q, k, v, positions, sliding_window, sm_scale=None):
        """q [dp, N, Hq, D], k/v [dp, N, Hkv, D] -> [dp, N, Hq, D]; writes this step's K/V first."""
        rank = PartitionSpec(self.axes)
        scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale

        def per_rank(pages, q, k, v, slots, kv_lens, page_indices, cu_q_lens, num_seqs):
            pages = write_kv(pages, k[0], v[0], slots[0])
            out = ragged_paged_attention(
                q[0], pages, kv_lens[0], page_indices[0], cu_q_lens[0], num_seqs[0], sm_scale=scale, sliding_window=sliding_window
            )
            return out[None], pages

        # No collective inside; check_vma=False lets kernels whose loop carries start from constants
        # (the portable attention) run per rank unchanged.
        attend = jax.shard_map(per_rank, mesh=self.mesh, in_specs=(rank,) * 9, out_specs=(rank, rank), check_vma=False)
        slots, page_indices = self._tables(layer)
        out, self.pages[layer] = attend(self.pages[layer], q, k, v, slots, self.kv_lens, page_indices, self.cu_q_lens, self.num_seqs)
        return out

    def attend(self, layer, q, positions, sliding_window, sm_scale=None):
        """A layer reusing `layer`'s KV (Gemma 4's shared layers): each rank reads its pages, writes nothing."""
        rank = PartitionSpec(self.axes)
        scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale

        def per_rank(pages, q, kv_lens, page_indices, cu_q_lens, num_seqs):
            out = ragged_paged_attention(
                q[0], pages, kv_lens[0], page_indices[0], cu_q_lens[0], num_seqs[0], sm_scale=scale, sliding_window=sliding_window
            )
            return out[None]

        attend = jax.shard_map(per_rank, mesh=self.mesh, in_specs=(rank,) * 6, out_specs=rank, check_vma=False)
        return attend(self.pages[layer], q, self.kv_lens, self._tables(layer)[1], self.cu_q_lens, self.num_seqs)

    def update_and_attend_latent(self, layer, q, row, positions, sm_scale, v_dim):
        """MLA: q [dp, N, Hq, Dk] (absorbed), row [dp, N, Dk] -> [dp, N, Hq, v_dim]; each rank writes and
        reads its own latent pages."""
        rank = PartitionSpec(self.axes)

        def per_rank(pages, q, row, slots, kv_lens, page_indices, cu_q_lens, num_seqs):
            pages = write_latent(pages, row[0], slots[0])
            out = ragged_paged_mla(q[0], pages, kv_lens[0], page_indices[0], cu_q_lens[0], num_seqs[0], sm_scale=sm_scale, v_dim=v_dim)
            return out[None], pages

        attend = jax.shard_map(per_rank, mesh=self.mesh, in_specs=(rank,) * 8, out_specs=(rank, rank), check_vma=False)
        out, self.pages[layer] = attend(
            self.pages[layer], q, row, self.slot_mapping, self.kv_lens, self.page_indices, self.cu_q_lens, self.num_seqs
        )
        return out


@jax.tree_util.register_dataclass
@dataclass
class DataParallelHybridCache(DataParallelPagedKVCache):
    """Hybrid (linear-attention) models with data-parallel attention: each rank's state slots are its
    shard of the pools (rank-local slot ids), and the state update runs per rank like attention does."""

    conv: list[Array] = field(default_factory=list)  # per linear layer [dp * slots, K-1, conv_dim]
    recurrent: list[Array] = field(default_factory=list)  # per linear layer [dp * slots, Hv, dk, dv]
    state_slots: Array | None = None  # i32[dp, S] rank-local working slots
    snap_slots: Array | None = None  # i32[dp, S, K]
    snap_lens: Array | None = None  # i32[dp, S, K]
    decode_only: bool = field(default=False, metadata=dict(static=True))

    def _per_rank(self, fn, n_token_args: int, pool: Array, *token_args):
        rank = PartitionSpec(self.axes)

        def body(pool, *args):
            tokens, meta = args[:n_token_args], args[n_token_args:]
            out, pool = fn([t[0] for t in tokens], pool, tuple(m[0] for m in meta))
            return out[None], pool

        meta = (self.state_slots, self.snap_slots, self.snap_lens, self.cu_q_lens, self.num_seqs)
        specs = (rank,) * (1 + n_token_args + len(meta))
        run = jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=(rank, rank), check_vma=False)
        return run(pool, *token_args, *meta)

    def causal_conv(self, layer: int, x: Array, weight: Array) -> Array:
        # The conv weight is replicated: closed over, not split per rank.
        out, self.conv[layer] = self._per_rank(lambda t, pool, meta: ragged_conv_step(t[0], weight, pool, meta), 1, self.conv[layer], x)
        return out

    def gated_delta(self, layer: int, q: Array, k: Array, v: Array, g: Array, beta: Array) -> Array:
        decode_only = self.decode_only
        out, self.recurrent[layer] = self._per_rank(
            lambda t, pool, meta: ragged_delta_step(*t, pool, meta, decode_only), 5, self.recurrent[layer], q, k, v, g, beta
        )
        return out
