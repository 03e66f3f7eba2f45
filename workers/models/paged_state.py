"""The engine's cache for hybrid models: paged attention KV plus linear-attention state slots.

`PagedHybridCache` is `PagedKVCache` (full-attention layers, flat ragged batch) with two more pools per
linear-attention layer, indexed by slot: conv states [slots, K-1, conv_dim] and recurrent states
[slots, Hv, dk, dv], both float32. Per scheduled sequence the step carries its working slot and where
to write a snapshot of the state at a block boundary inside the step. Setting a slot up for a new
sequence (zeroing it, or copying a snapshot into it) is a separate small program the runner runs
before the step, only when a sequence starts: inside the step, even a skipped branch made XLA copy
every state pool (measured: ~1.6 GiB per decode step on the bench model). The slot bookkeeping is the engine's
(`workers/engine/state_cache.py`); this class only moves states on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from kernels.gated_delta import ragged_causal_conv1d, ragged_gated_delta_rule

from .layers import PagedKVCache

Array = jax.Array
KEEP, ZERO = -2, -1  # how a working slot starts, besides a snapshot slot to copy from


@jax.tree_util.register_dataclass
@dataclass
class PagedHybridCache(PagedKVCache):
    conv: list[Array]  # per linear layer [slots, K-1, conv_dim] float32
    recurrent: list[Array]  # per linear layer [slots, Hv, dk, dv] float32
    state_slots: Array  # i32[S] working slot of each sequence
    snap_slots: Array  # i32[S, K] snapshot destinations, -1 for none
    snap_lens: Array  # i32[S, K] tokens of this step before each snapshot
    # Static: every sequence has one token and sequence i owns token i (a decode-only step).
    decode_only: bool = field(default=False, metadata=dict(static=True))

    def causal_conv(self, layer: int, x: Array, weight: Array) -> Array:
        b, t, c = x.shape
        out, self.conv[layer] = ragged_conv_step(x.reshape(b * t, c), weight, self.conv[layer], self._meta())
        return out.reshape(b, t, c)

    def gated_delta(self, layer: int, q: Array, k: Array, v: Array, g: Array, beta: Array) -> Array:
        b, t = q.shape[:2]
        flat = lambda a: a.reshape(b * t, *a.shape[2:])
        out, self.recurrent[layer] = ragged_delta_step(
            flat(q), flat(k), flat(v), flat(g), flat(beta), self.recurrent[layer], self._meta(), self.decode_only
        )
        return out.reshape(b, t, *out.shape[1:])

    def _meta(self) -> tuple[Array, ...]:
        return (self.state_slots, self.snap_slots, self.snap_lens, self.cu_q_lens, self.num_seqs)


# One sequence batch's state update, shared with the data-parallel cache (which runs it per rank).
# meta = (state_slots, snap_slots, snap_lens, cu_q_lens, num_seqs).


def ragged_conv_step(x: Array, weight: Array, pool: Array, meta: tuple[Array, ...]) -> tuple[Array, Array]:
    slots, snap_slots, snap_lens, cu_q_lens, num_seqs = meta
    return ragged_causal_conv1d(x, weight, pool, slots, cu_q_lens, num_seqs, snap_lens, snap_slots)


def ragged_delta_step(q, k, v, g, beta, pool: Array, meta: tuple[Array, ...], decode_only: bool) -> tuple[Array, Array]:
    slots, snap_slots, snap_lens, cu_q_lens, num_seqs = meta
    return ragged_gated_delta_rule(q, k, v, g, beta, pool, slots, cu_q_lens, num_seqs, snap_lens, snap_slots, decode_only=decode_only)


def init_slots(pools, dst: Array, src: Array):
    """Sets working slots up before a step: slot dst[i] gets zeros (src[i] == ZERO) or a copy of slot
    src[i]; dst past the pool (padding) is dropped. `pools` is (conv list, recurrent list)."""

    def one(pool):
        fresh = jnp.where((src == ZERO).reshape(-1, *(1,) * (pool.ndim - 1)), 0, pool[jnp.maximum(src, 0)])
        return pool.at[dst].set(fresh.astype(pool.dtype), mode="drop")

    conv, rec = pools
    return [one(p) for p in conv], [one(p) for p in rec]
