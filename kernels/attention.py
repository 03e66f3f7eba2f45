"""Attention kernels.

`causal_attention` works on a contiguous per-sequence KV cache (the model's reference path and the
oracle the paged variant is checked against). `ragged_paged_attention` + `write_kv` serve the
engine's flat, mixed prefill/decode batches over a paged cache: JAX's Pallas TPU kernel on TPU, a
portable jnp implementation elsewhere (`attention_impl` picks).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

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


# ---------------------------------------------------------------------------------------------
# Ragged paged attention (the engine's flat, mixed prefill/decode batch over a paged KV cache).
#
# Layout follows JAX's TPU kernel (jax.experimental.pallas.ops.tpu.ragged_paged_attention) so the
# Pallas path is a drop-in: kv_pages is [num_pages, page_size, 2 * Hkv, D] with K of kv-head h at
# combined index 2h and V at 2h + 1.

_IMPLS = ("jnp", "pallas")
_IMPL_ENV = "MORAY_ATTENTION_IMPL"

# jnp path tuning. Work is split into items (up to `_CHUNK_ROWS` query tokens of one sequence) and
# units (one item against one group of consecutive pages); see `_ragged_paged_attention_jnp`.
_CHUNK_ROWS = 16  # query tokens per item for long (prefill) sequences
_PER_TOKEN_BELOW = 8  # sequences with fewer new tokens than this get one item per token
_KEYS_PER_UNIT = 128  # pages per unit = this // page_size (at least 1)
_ITER_BYTES = 8 << 20  # rough budget for the float32 temporaries of one loop iteration


def attention_impl() -> str:
    """The one place the attention implementation is chosen: "pallas" on TPU, "jnp" elsewhere.

    MORAY_ATTENTION_IMPL=jnp|pallas overrides (e.g. to run the portable path on a TPU).
    """
    override = os.environ.get(_IMPL_ENV, "").strip().lower()
    if override:
        if override not in _IMPLS:
            raise ValueError(f"{_IMPL_ENV}={override!r}; expected one of {_IMPLS}")
        return override
    return "pallas" if jax.default_backend() == "tpu" else "jnp"


def write_kv(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Write new tokens' K/V into their cache slots; returns the updated pages.

    kv_pages [P, page_size, 2*Hkv, D]; k, v [N, Hkv, D]; slot_mapping i32[N] with flat slot
    page * page_size + offset. Negative slots (padding tokens) and slots past the cache write nothing.
    """
    num_pages, page_size, combined, d = kv_pages.shape
    n, hkv, _ = k.shape
    # Interleave per head: [N, Hkv, 2, D] -> [N, 2*Hkv, D] puts K of head h at 2h and V at 2h + 1.
    kv = jnp.stack([k, v], axis=2).reshape(n, 2 * hkv, d).astype(kv_pages.dtype)
    num_slots = num_pages * page_size
    slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)  # out of range -> dropped
    flat = kv_pages.reshape(num_slots, combined, d).at[slots].set(kv, mode="drop")
    return flat.reshape(kv_pages.shape)


def ragged_paged_attention(
    q: jax.Array,  # [N, Hq, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2*Hkv, D]
    kv_lens: jax.Array,  # i32[S], KV length of each sequence including this step's tokens
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    impl: str | None = None,
) -> jax.Array:
    """Causal attention for a flat batch of sequences' new tokens against a paged KV cache.

    Tokens of sequence i are q[cu_q_lens[i]:cu_q_lens[i+1]]; token j of it sits at position
    kv_lens[i] - q_len_i + j and sees KV positions <= its own (and > pos - sliding_window). The new
    tokens' K/V must already be written (`write_kv`). Rows past cu_q_lens[num_seqs] come back as
    zeros; sequences >= num_seqs are ignored. Softmax in float32; returns q.dtype.
    """
    impl = impl or attention_impl()
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {_IMPLS}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    fn = _ragged_paged_attention_pallas if impl == "pallas" else _ragged_paged_attention_jnp
    return fn(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=float(sm_scale), sliding_window=sliding_window
    )


def _live_tokens(n: int, cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """bool[N]: rows that belong to a sequence (the rest are padding)."""
    return jnp.arange(n) < cu_q_lens[num_seqs[0]]


def _ragged_paged_attention_pallas(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as tpu_rpa

    out = tpu_rpa.ragged_paged_attention(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale, sliding_window=sliding_window
    )
    # The kernel never stores padding rows (they hold uninitialised scratch): zero them.
    return jnp.where(_live_tokens(q.shape[0], cu_q_lens, num_seqs)[:, None, None], out, 0).astype(q.dtype)


# --- jnp path --------------------------------------------------------------------------------
#
# Static shapes, dynamic work. Query tokens are grouped into *items*: up to R consecutive tokens of
# one sequence (R = 1 for decode-like sequences, so one decode token never pays for R query rows;
# R = _CHUNK_ROWS for prefill chunks, so a chunk's KV pages are gathered once per R tokens rather
# than once per token). An item needs the pages spanning its visible keys (from the sliding-window
# start, else 0, up to its last token's position); one *unit* is an item against G consecutive
# pages. All units of all items are laid out in one flat list (its length is a traced value) and a
# while loop processes B units per iteration, folding each unit's partial softmax into its item's
# running (max, sum, acc) state with scatters. Cost is therefore ~ sum over items of R x kv_span,
# i.e. ~ N x kv_len for decode and N x kv_len / R gathered KV for prefill, never N x total_pages,
# and one iteration touches B x G pages however large N is.


class _Items(NamedTuple):
    seq: jax.Array  # i32[W] sequence of the item
    start: jax.Array  # i32[W] index into q of the item's first token
    rows: jax.Array  # i32[W] real tokens in the item; 0 for unused (padding) items
    first_pos: jax.Array  # i32[W] KV position of the item's first token


def _plan_items(
    q_start: jax.Array, q_len: jax.Array, kv_lens: jax.Array, selected: jax.Array, rows: int, num_items: int
) -> _Items:
    """Cut each selected sequence's tokens into items of `rows` tokens; pad the list to `num_items`."""
    per_seq = jnp.where(selected, -(-q_len // rows), 0)
    ends = jnp.cumsum(per_seq)
    w = jnp.arange(num_items)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), q_len.shape[0] - 1)
    offset = (w - (ends[seq] - per_seq[seq])) * rows  # token offset of the item within its sequence
    n_rows = jnp.where(w < ends[-1], jnp.clip(q_len[seq] - offset, 0, rows), 0)
    return _Items(
        seq=seq.astype(jnp.int32),
        start=(q_start[seq] + offset).astype(jnp.int32),
        rows=n_rows.astype(jnp.int32),
        first_pos=(kv_lens[seq] - q_len[seq] + offset).astype(jnp.int32),
    )


def _units_per_iteration(rows: int, keys: int, hq: int, hkv: int, d: int, max_units: int) -> int:
    """How many (item, page group) units one loop iteration handles, from a memory budget."""
    floats = keys * 2 * hkv * d + 2 * rows * hq * keys + 2 * rows * hq * d  # kv, scores+probs, q+pv
    return max(1, min(max_units, _ITER_BYTES // (4 * floats)))


def _attend_items(
    q: jax.Array,  # [N, Hq, D]
    kv_pages: jax.Array,
    page_indices: jax.Array,
    items: _Items,
    rows: int,
    sm_scale: float,
    sliding_window: int | None,
) -> jax.Array:
    """Attention output [W, rows, Hq, D] (float32) for every item row; rows past items.rows are junk."""
    n, hq, d = q.shape
    _, page_size, combined, _ = kv_pages.shape
    hkv, pages_per_seq = combined // 2, page_indices.shape[1]
    group = hq // hkv
    num_items = items.seq.shape[0]
    pages_per_unit = min(pages_per_seq, max(1, _KEYS_PER_UNIT // page_size))
    keys = pages_per_unit * page_size

    # Page span of each item: from the first visible key of its first token to its last token.
    last_pos = items.first_pos + items.rows - 1
    first_key = jnp.zeros_like(items.first_pos)
    if sliding_window is not None:
        first_key = jnp.maximum(items.first_pos - sliding_window + 1, 0)
    first_page = first_key // page_size
    span = last_pos // page_size - first_page + 1
    units_per_item = jnp.where(items.rows > 0, -(-span // pages_per_unit), 0)
    unit_ends = jnp.cumsum(units_per_item)
    max_units = num_items * -(-pages_per_seq // pages_per_unit)
    per_iter = _units_per_iteration(rows, keys, hq, hkv, d, max_units)
    num_iters = -(-unit_ends[-1] // per_iter)

    token = jnp.minimum(items.start[:, None] + jnp.arange(rows), n - 1)
    q_items = (q[token].astype(jnp.float32) * sm_scale).reshape(num_items, rows, hkv, group, d)
    row_ids = jnp.arange(rows)

    def body(it, state):
        m, l, acc = state
        unit = it * per_iter + jnp.arange(per_iter)
        live = unit < unit_ends[-1]
        item = jnp.minimum(jnp.searchsorted(unit_ends, unit, side="right"), num_items - 1)
        page0 = first_page[item] + (unit - (unit_ends[item] - units_per_item[item])) * pages_per_unit

        # Gather the unit's pages; slots past the page table are clamped and masked out below.
        slots = jnp.minimum(page0[:, None] + jnp.arange(pages_per_unit), pages_per_seq - 1)
        pages = page_indices[items.seq[item][:, None], slots]
        kv = jnp.take(kv_pages, pages, axis=0, mode="clip").astype(jnp.float32)
        kv = kv.reshape(per_iter, keys, hkv, 2, d)
        k, v = kv[..., 0, :], kv[..., 1, :]

        key_pos = page0[:, None] * page_size + jnp.arange(keys)  # [B, keys]
        row_pos = items.first_pos[item][:, None] + row_ids  # [B, rows]
        visible = (key_pos[:, None, :] <= row_pos[:, :, None]) & live[:, None, None]
        if sliding_window is not None:
            visible &= key_pos[:, None, :] > row_pos[:, :, None] - sliding_window
        # Slots past the item's last token may hold anything (unwritten or recycled pages, even NaN):
        # zero V there so masked probabilities (0) times V stay 0.
        v = jnp.where((key_pos <= last_pos[item][:, None])[:, :, None, None], v, 0.0)

        visible = visible[:, :, None, None, :]  # [B, rows, 1, 1, keys]
        s = jnp.einsum("brhgd,bkhd->brhgk", q_items[item], k)
        s = jnp.where(visible, s, _MASKED)

        # Fold into the items' online-softmax state. Several units of one item can share an
        # iteration (they are adjacent in the list): max-scatter the new maxima, rescale each touched
        # item's old sums once (at its first unit), then add every unit's contribution.
        target = jnp.where(live, item, num_items)  # num_items -> dropped
        m_new = m.at[target].max(s.max(axis=-1), mode="drop")
        m_unit = m_new[item]
        p = jnp.where(visible, jnp.exp(s - m_unit[..., None]), 0.0)
        first = jnp.concatenate([jnp.ones((1,), bool), item[1:] != item[:-1]])
        rescale_target = jnp.where(first, target, num_items)
        alpha = jnp.exp(m[item] - m_unit)
        l = l.at[rescale_target].multiply(alpha, mode="drop").at[target].add(p.sum(axis=-1), mode="drop")
        acc = acc.at[rescale_target].multiply(alpha[..., None], mode="drop")
        acc = acc.at[target].add(jnp.einsum("brhgk,bkhd->brhgd", p, v), mode="drop")
        return m_new, l, acc

    state_shape = (num_items, rows, hkv, group)
    init = (
        jnp.full(state_shape, _MASKED, jnp.float32),
        jnp.zeros(state_shape, jnp.float32),
        jnp.zeros((*state_shape, d), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_iters, body, init)
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]  # rows that saw no key stay 0
    return out.reshape(num_items, rows, hq, d)


def _scatter_items(out: jax.Array, items: _Items, values: jax.Array) -> jax.Array:
    """Write each item's real rows into out [N, Hq, D]; junk rows are dropped."""
    n = out.shape[0]
    rows = values.shape[1]
    r = jnp.arange(rows)
    token = jnp.where(r < items.rows[:, None], items.start[:, None] + r, n)
    return out.at[token.reshape(-1)].set(values.reshape(-1, *out.shape[1:]).astype(out.dtype), mode="drop")


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window"))
def _ragged_paged_attention_jnp(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window):
    n, hq, _ = q.shape
    num_seqs_max = page_indices.shape[0]
    if hq % (kv_pages.shape[2] // 2):
        raise ValueError(f"{hq} query heads is not a multiple of {kv_pages.shape[2] // 2} kv heads")
    # Entries past num_seqs may be garbage: give those sequences no tokens.
    live = jnp.arange(num_seqs_max) < num_seqs[0]
    q_start = cu_q_lens[:-1]
    q_len = jnp.where(live, cu_q_lens[1:] - q_start, 0)

    out = jnp.zeros(q.shape, q.dtype)
    # Two passes with static item counts large enough for any batch of this shape:
    #  short sequences (decode): one item per token, at most min(N, S * (_PER_TOKEN_BELOW - 1)) items;
    #  long sequences (prefill chunks): sum of ceil(q_len / R) <= N // R + min(S, N // _PER_TOKEN_BELOW).
    short = q_len < _PER_TOKEN_BELOW
    passes = (
        (1, short, min(n, num_seqs_max * (_PER_TOKEN_BELOW - 1))),
        (_CHUNK_ROWS, ~short, n // _CHUNK_ROWS + min(num_seqs_max, n // _PER_TOKEN_BELOW)),
    )
    for rows, selected, num_items in passes:
        if num_items == 0:
            continue  # e.g. a batch too small to hold a long sequence
        items = _plan_items(q_start, q_len, kv_lens, selected, rows, num_items)
        values = _attend_items(q, kv_pages, page_indices, items, rows, sm_scale, sliding_window)
        out = _scatter_items(out, items, values)
    return out
