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

from kernels.attention import ragged_paged_attention, write_kv

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

    def update_and_attend(self, layer, q, k, v, positions, sliding_window):
        """q [dp, N, Hq, D], k/v [dp, N, Hkv, D] -> [dp, N, Hq, D]; writes this step's K/V first."""
        rank = PartitionSpec(self.axes)
        scale = q.shape[-1] ** -0.5

        def per_rank(pages, q, k, v, slots, kv_lens, page_indices, cu_q_lens, num_seqs):
            pages = write_kv(pages, k[0], v[0], slots[0])
            out = ragged_paged_attention(
                q[0], pages, kv_lens[0], page_indices[0], cu_q_lens[0], num_seqs[0], sm_scale=scale, sliding_window=sliding_window
            )
            return out[None], pages

        # No collective inside; check_vma=False lets kernels whose loop carries start from constants
        # (the portable attention) run per rank unchanged.
        attend = jax.shard_map(per_rank, mesh=self.mesh, in_specs=(rank,) * 9, out_specs=(rank, rank), check_vma=False)
        out, self.pages[layer] = attend(
            self.pages[layer], q, k, v, self.slot_mapping, self.kv_lens, self.page_indices, self.cu_q_lens, self.num_seqs
        )
        return out
