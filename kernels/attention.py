"""Attention over a contiguous per-sequence KV cache (portable jnp path).

The paged, ragged variant for the engine lives beside it once the engine needs it; this one is the
reference both are checked against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # large negative rather than -inf so fully masked padding rows stay finite


def causal_attention(
    q: jax.Array,  # [B, T, Hq, D]
    k_cache: jax.Array,  # [B, S, Hkv, D]
    v_cache: jax.Array,  # [B, S, Hkv, D]
    q_positions: jax.Array,  # [B, T] absolute position of each query
    sliding_window: int | None = None,
) -> jax.Array:
    """Grouped-query attention where query at position p sees cache slots 0..p.

    Slot j of the cache holds the key of position j. Slots beyond a sequence's written length are
    never visible: a query at position p only sees slots <= p, and slots are written in order.
    With a sliding window w a query sees the w most recent positions including itself.
    """
    b, t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    qg = q.reshape(b, t, hkv, group, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache.astype(jnp.float32)) * (d**-0.5)
    k_pos = jnp.arange(k_cache.shape[1])
    visible = k_pos[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        visible &= q_positions[:, :, None] - k_pos[None, None, :] < sliding_window
    scores = jnp.where(visible[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache.astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q.dtype)
