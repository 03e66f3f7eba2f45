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
    sm_scale: float | None = None,
) -> jax.Array:
    """Grouped-query attention where query at position p sees cache slots 0..p.

    V may be narrower than K (MLA's latent: K is [latent | rope key], V its latent part); the output has
    V's width. `sm_scale` defaults to D ** -0.5.

    Slot j of the cache holds the key of position j. Slots beyond a sequence's written length are
    never visible: a query at position p only sees slots <= p, and slots are written in order.
    With a sliding window w a query sees the w most recent positions including itself.
    """
    b, t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    qg = q.reshape(b, t, hkv, group, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache.astype(jnp.float32)) * (d**-0.5 if sm_scale is None else sm_scale)
    k_pos = jnp.arange(k_cache.shape[1])
    visible = k_pos[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        visible &= q_positions[:, :, None] - k_pos[None, None, :] < sliding_window
    scores = jnp.where(visible[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bske->btkge", probs, v_cache.astype(jnp.float32))
    return out.reshape(b, t, hq, v_cache.shape[-1]).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# Ragged paged attention (the engine's flat, mixed prefill/decode batch over a paged KV cache).
#
# Layout follows JAX's TPU kernel (jax.experimental.pallas.ops.tpu.ragged_paged_attention) so the
# Pallas path is a drop-in: kv_pages is [num_pages, page_size, 2 * Hkv, D] with K of kv-head h at
# combined index 2h and V at 2h + 1.

_IMPLS = ("jnp", "pallas")
_IMPL_ENV = "MORAY_ATTENTION_IMPL"


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
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    return fn(*args, sm_scale=float(sm_scale), sliding_window=sliding_window)


def _live_tokens(n: int, cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """bool[N]: rows that belong to a sequence (the rest are padding)."""
    return jnp.arange(n) < cu_q_lens[num_seqs[0]]


def _ragged_paged_attention_pallas(*args, sm_scale, sliding_window):
    """JAX's TPU kernel (imported lazily: CPU-only users never need Pallas)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as tpu_rpa

    q, _, _, page_indices, cu_q_lens, num_seqs = args
    blocks = {}
    if jax.default_backend() != "tpu":
        # Interpret mode: the kernel's tuned block-size table asks for the TPU generation and
        # raises without one, so pass small block sizes directly.
        blocks = dict(num_kv_pages_per_block=min(8, page_indices.shape[1]), num_queries_per_block=min(32, q.shape[0]))
    out = tpu_rpa.ragged_paged_attention(*args, sm_scale=sm_scale, sliding_window=sliding_window, **blocks)
    # The kernel never stores padding rows (they hold uninitialised scratch): zero them.
    return jnp.where(_live_tokens(q.shape[0], cu_q_lens, num_seqs)[:, None, None], out, 0).astype(q.dtype)


# --- jnp path --------------------------------------------------------------------------------
#
# Static shapes, dynamic work. Query tokens are grouped into *items*: up to R consecutive tokens of
# one sequence. Decode-like sequences get R = 1, so a decode token never pays for R query rows;
# prefill chunks get R = _CHUNK_ROWS, so their KV pages are gathered once per R tokens rather than
# once per token. An item needs the pages spanning its visible keys (from its first token's window
# start, else 0, up to its last token); a *unit* is one item against G consecutive pages. The units
# of all items form one flat list whose length is a traced value; a while loop takes B units per
# iteration and folds each unit's partial softmax into its item's running (max, sum, acc) state.
# Cost is ~ sum over items of R x (keys spanned): ~ N x kv_len for decode, with only 1/R of that in
# gathered KV for prefill; never N x total_pages. One iteration holds B x G pages, whatever N is.

_CHUNK_ROWS = 16  # R for long (prefill) sequences
_PER_TOKEN_BELOW = 8  # sequences with fewer new tokens than this get R = 1
_KEYS_PER_UNIT = 128  # G = this // page_size pages per unit (at least 1)
_ITER_BYTES = 8 << 20  # rough budget for one iteration's float32 temporaries; sets B
# With a static trip count (GPU): a larger budget, so decode-sized batches take one iteration (no loop at all).
_STATIC_ITER_BYTES = 256 << 20


def static_loop_default() -> bool:
    """Whether the jnp path's loop over units runs a static trip count (the bound for the shapes, dead units
    masked) instead of one that depends on the batch (for decode items, and prefill items that fit one
    iteration). On a GPU a loop whose trip count is data makes the host read the loop's predicate from the
    device at every iteration: the H200 trace of a bench-preset decode step showed the GPU busy 0.7 ms of a
    ~3 ms step, its two such loops per layer each waiting on a copy to the host. On CPU the dynamic count is
    cheaper: no dead units are computed, and there is no device to wait on."""
    return jax.default_backend() == "gpu"


class _Items(NamedTuple):
    seq: jax.Array  # i32[W] sequence of the item
    start: jax.Array  # i32[W] index into q of the item's first token
    rows: jax.Array  # i32[W] real tokens in the item; 0 for unused (padding) items
    first_pos: jax.Array  # i32[W] KV position of the item's first token


class _Units(NamedTuple):
    """The flat (item, page group) work list; item i owns units ends[i] - per_item[i] .. ends[i] - 1."""

    per_item: jax.Array  # i32[W] units of each item
    ends: jax.Array  # i32[W] cumulative sum of per_item
    first_page: jax.Array  # i32[W] page-table slot of each item's first visible key
    last_pos: jax.Array  # i32[W] position of each item's last token


_STATIC = ("sm_scale", "sliding_window", "pages_per_unit", "units_per_iter", "latent_v_dim", "static_loop")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _ragged_paged_attention_jnp(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    sliding_window,
    pages_per_unit: int | None = None,  # tuning overrides; tests use tiny ones to exercise the loop
    units_per_iter: int | None = None,
    latent_v_dim: int | None = None,  # MLA: pages [P, page, 1, Dk] hold one row per token; V = its first dims
    static_loop: bool | None = None,  # None: static_loop_default()
):
    if static_loop is None:
        static_loop = static_loop_default()
    n, hq, _ = q.shape
    max_seqs = page_indices.shape[0]
    hkv = _kv_heads(kv_pages, latent_v_dim)
    if hq % hkv:
        raise ValueError(f"{hq} query heads is not a multiple of {hkv} kv heads")
    # Entries past num_seqs may be garbage: those sequences get no tokens.
    q_start = cu_q_lens[:-1]
    q_len = jnp.where(jnp.arange(max_seqs) < num_seqs[0], cu_q_lens[1:] - q_start, 0)

    # Two passes, each with a static item count that fits any batch of these shapes:
    #  short sequences: one item per token, so at most min(N, S * (_PER_TOKEN_BELOW - 1)) items;
    #  long sequences: sum of ceil(q_len / R) <= N // R + (number of long sequences).
    short = q_len < _PER_TOKEN_BELOW
    passes = (
        (1, short, min(n, max_seqs * (_PER_TOKEN_BELOW - 1))),
        (_CHUNK_ROWS, ~short, n // _CHUNK_ROWS + min(max_seqs, n // _PER_TOKEN_BELOW)),
    )
    out = jnp.zeros((n, hq, latent_v_dim or q.shape[-1]), q.dtype)  # padding rows stay 0
    for rows, selected, num_items in passes:
        if num_items == 0:
            continue  # e.g. a batch too small to hold a long sequence
        items = _plan_items(q_start, q_len, kv_lens, selected, rows, num_items)
        values = _attend_items(
            q, kv_pages, page_indices, items, rows, sm_scale, sliding_window, pages_per_unit, units_per_iter, latent_v_dim, static_loop
        )
        out = _scatter_items(out, items, values)
    return out


def _bucket(ends: jax.Array, i: jax.Array) -> jax.Array:
    """For each i, the first k with i < ends[k] (ends = inclusive cumsum of counts): i's owner."""
    return jnp.searchsorted(ends, i, side="right", method="compare_all")  # small arrays: no loop


def _plan_items(q_start, q_len, kv_lens, selected, rows: int, num_items: int) -> _Items:
    """Cut each selected sequence's tokens into items of `rows` tokens; pad the list to `num_items`."""
    per_seq = jnp.where(selected, -(-q_len // rows), 0)
    ends = jnp.cumsum(per_seq)
    w = jnp.arange(num_items)
    seq = jnp.minimum(_bucket(ends, w), q_len.shape[0] - 1)
    # One gather of a per-sequence table instead of one per field (fewer ops to compile).
    table = jnp.stack([ends - per_seq, q_len, q_start, kv_lens])
    first_item, seq_q_len, seq_q_start, seq_kv_len = table[:, seq]
    offset = (w - first_item) * rows  # the item's first token within its sequence
    return _Items(
        seq=seq.astype(jnp.int32),
        start=(seq_q_start + offset).astype(jnp.int32),
        rows=jnp.where(w < ends[-1], jnp.clip(seq_q_len - offset, 0, rows), 0).astype(jnp.int32),
        first_pos=(seq_kv_len - seq_q_len + offset).astype(jnp.int32),
    )


def _plan_units(items: _Items, page_size: int, pages_per_unit: int, sliding_window: int | None) -> _Units:
    """Each item spans pages from its first token's first visible key to its last token."""
    last_pos = items.first_pos + items.rows - 1
    first_key = jnp.zeros_like(items.first_pos)
    if sliding_window is not None:
        first_key = jnp.maximum(items.first_pos - sliding_window + 1, 0)
    first_page = first_key // page_size
    span = last_pos // page_size - first_page + 1
    per_item = jnp.where(items.rows > 0, -(-span // pages_per_unit), 0)
    return _Units(per_item=per_item, ends=jnp.cumsum(per_item), first_page=first_page, last_pos=last_pos)


def _units_per_iteration(rows: int, keys: int, hq: int, hkv: int, d: int, budget: int = _ITER_BYTES) -> int:
    """B, from the memory budget: gathered K/V, scores and probabilities, query rows and p @ V."""
    floats = keys * 2 * hkv * d + 2 * rows * hq * keys + 2 * rows * hq * d
    return max(1, budget // (4 * floats))


def _kv_heads(kv_pages: jax.Array, latent_v_dim: int | None) -> int:
    return 1 if latent_v_dim else kv_pages.shape[2] // 2


def _gather_kv(kv_pages, page_indices, seq, page0, pages_per_unit: int, latent_v_dim: int | None = None):
    """K and V [B, Hkv, keys, D] (float32) of pages page0 .. page0 + G - 1 of each unit's sequence.

    Page-table slots past the end are clamped; their keys lie beyond the item and are masked. Latent
    pages (MLA) hold one row per token: K is the row, V its first `latent_v_dim` dims (one KV head).
    """
    _, page_size, combined, d = kv_pages.shape
    slots = jnp.minimum(page0[:, None] + jnp.arange(pages_per_unit), page_indices.shape[1] - 1)
    kv = jnp.take(kv_pages, page_indices[seq[:, None], slots], axis=0, mode="clip").astype(jnp.float32)
    if latent_v_dim:
        k = kv.reshape(page0.shape[0], 1, pages_per_unit * page_size, d)
        return k, k[..., :latent_v_dim]
    # Heads before keys, so the matmuls are plain batched matmuls (~3x faster on XLA:CPU).
    kv = kv.reshape(page0.shape[0], pages_per_unit * page_size, combined // 2, 2, d).transpose(0, 2, 3, 1, 4)
    return kv[:, :, 0], kv[:, :, 1]


def _attend_items(
    q: jax.Array,  # [N, Hq, D]
    kv_pages: jax.Array,
    page_indices: jax.Array,
    items: _Items,
    rows: int,
    sm_scale: float,
    sliding_window: int | None,
    pages_per_unit: int | None,
    units_per_iter: int | None,
    latent_v_dim: int | None = None,
    static_loop: bool = False,
) -> jax.Array:
    """Attention output [W, rows, Hq, Dv] (float32) of every item row; rows past items.rows are junk.
    `static_loop`: iterate over every unit the shapes allow (dead ones masked), see static_loop_default."""
    n, hq, d = q.shape
    _, page_size, _, _ = kv_pages.shape
    hkv, pages_per_seq = _kv_heads(kv_pages, latent_v_dim), page_indices.shape[1]
    dv = latent_v_dim or d
    group = hq // hkv
    num_items = items.seq.shape[0]
    pages_per_unit = min(pages_per_seq, pages_per_unit or max(1, _KEYS_PER_UNIT // page_size))
    keys = pages_per_unit * page_size
    units = _plan_units(items, page_size, pages_per_unit, sliding_window)
    max_units = num_items * -(-pages_per_seq // pages_per_unit)
    budget = _STATIC_ITER_BYTES if static_loop else _ITER_BYTES
    per_iter = min(max_units, units_per_iter or _units_per_iteration(rows, keys, hq, hkv, d, budget))
    if static_loop:
        # Prefill chunks (rows > 1) need about half the units the shapes allow (the causal triangle): a static
        # count would compute the other half for nothing, so they keep the dynamic one unless one iteration
        # covers them (as in a decode step, where this pass holds no real item).
        static_loop = rows == 1 or max_units <= per_iter

    # Query rows of an item as [Hkv, rows * group, D] to match K/V's [Hkv, keys, D].
    token = jnp.minimum(items.start[:, None] + jnp.arange(rows), n - 1)
    q_items = (q[token].astype(jnp.float32) * sm_scale).reshape(num_items, rows, hkv, group, d)
    q_items = q_items.transpose(0, 2, 1, 3, 4).reshape(num_items, hkv, rows * group, d)

    # What a unit needs of its item, as one table so the loop gathers it once.
    item_table = jnp.stack([items.seq, units.first_page, units.ends - units.per_item, items.first_pos, units.last_pos])

    def body(it, state):
        unit = it * per_iter + jnp.arange(per_iter)
        live = unit < units.ends[-1]
        item = jnp.minimum(_bucket(units.ends, unit), num_items - 1)
        seq, first_page, first_unit, first_pos, last_pos = item_table[:, item]
        page0 = first_page + (unit - first_unit) * pages_per_unit
        k, v = _gather_kv(kv_pages, page_indices, seq, page0, pages_per_unit, latent_v_dim)

        key_pos = page0[:, None] * page_size + jnp.arange(keys)  # [B, keys]
        row_pos = first_pos[:, None] + jnp.arange(rows)  # [B, rows]
        visible = (key_pos[:, None, :] <= row_pos[:, :, None]) & live[:, None, None]
        if sliding_window is not None:
            visible &= key_pos[:, None, :] > row_pos[:, :, None] - sliding_window
        visible = jnp.repeat(visible, group, axis=1)[:, None]  # [B, 1, rows * group, keys]
        # Slots past the item's last token may hold anything (unwritten or recycled pages, even NaN):
        # zero V there so that masked probabilities (0) times V stay 0.
        v = jnp.where((key_pos <= last_pos[:, None])[:, None, :, None], v, 0.0)

        s = jnp.where(visible, jnp.einsum("bhqd,bhkd->bhqk", q_items[item], k), _MASKED)
        return _fold_units(state, jnp.where(live, item, num_items), s, visible, v)

    state_shape = (num_items, hkv, rows * group)
    init = (jnp.full(state_shape, _MASKED, jnp.float32), jnp.zeros((*state_shape, dv + 1), jnp.float32))
    if static_loop:
        trips = -(-max_units // per_iter)
        _, acc = body(0, init) if trips == 1 else jax.lax.fori_loop(0, trips, body, init)
    else:
        _, acc = jax.lax.fori_loop(0, -(-units.ends[-1] // per_iter), body, init)
    l = acc[..., dv:]
    out = acc[..., :dv] / jnp.where(l == 0.0, 1.0, l)  # rows that saw no key stay 0
    out = out.reshape(num_items, hkv, rows, group, dv).transpose(0, 2, 1, 3, 4)
    return out.reshape(num_items, rows, hq, dv)


def _fold_units(state, target, s, visible, v):
    """Online-softmax update of the items' state with B units' scores s [B, Hkv, rows, keys].

    State: running max m and acc = [sum of exp * V | sum of exp] (one array, so one scatter updates
    both). target[b] is unit b's item (out of range for dead units: their scatters are dropped).
    Several units of one item can share an iteration (they are adjacent in the list), so: max-scatter
    the new maxima, rescale each touched item's acc once (at its first unit), then add every unit's part.
    """
    m, acc = state
    m_new = m.at[target].max(s.max(axis=-1), mode="drop")
    item = jnp.minimum(target, m.shape[0] - 1)
    m_item = m_new[item]
    p = jnp.where(visible, jnp.exp(s - m_item[..., None]), 0.0)
    first = jnp.concatenate([jnp.ones((1,), bool), target[1:] != target[:-1]])
    alpha = jnp.exp(m[item] - m_item)[..., None]
    acc = acc.at[jnp.where(first, target, m.shape[0])].multiply(alpha, mode="drop")
    part = jnp.concatenate([jnp.einsum("bhqk,bhkd->bhqd", p, v), p.sum(axis=-1, keepdims=True)], axis=-1)
    return m_new, acc.at[target].add(part, mode="drop")


def _scatter_items(out: jax.Array, items: _Items, values: jax.Array) -> jax.Array:
    """Write each item's real rows into out [N, Hq, D]; junk rows are dropped."""
    n, rows = out.shape[0], values.shape[1]
    r = jnp.arange(rows)
    token = jnp.where(r < items.rows[:, None], items.start[:, None] + r, n)
    return out.at[token.reshape(-1)].set(values.reshape(-1, *out.shape[1:]).astype(out.dtype), mode="drop")


# ---------------------------------------------------------------------------------------------
# Multi-head latent attention (DeepSeek-V3) over a paged latent cache.
#
# The cache holds one row per token and layer, [latent (kv_lora_rank) | rope key], shared by all heads:
# pages [num_pages, page_size, 1, Dk]. Queries come absorbed (the key half of kv_b folded into them), so
# attention is single-KV-head attention with K = the row and V = its latent part; the value half of kv_b
# is applied to the output afterwards. A step reads only the latent rows.

_MLA_IMPL_ENV = "MORAY_MLA_IMPL"


def mla_attention_impl() -> str:
    """The one place the MLA attention implementation is chosen. Only the jnp path exists so far; a Pallas
    TPU kernel (tpu-inference's MLA kernel is the model) plugs in here."""
    override = os.environ.get(_MLA_IMPL_ENV, "").strip().lower() or "jnp"
    if override != "jnp":
        raise ValueError(f"{_MLA_IMPL_ENV}={override!r}: only 'jnp' is implemented (no Pallas MLA kernel yet)")
    return override


def write_latent(latent_pages: jax.Array, rows: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Write new tokens' latent rows [N, Dk] into their slots of pages [P, page_size, 1, Dk]; negative
    slots (padding tokens) and slots past the cache write nothing."""
    num_pages, page_size, _, d = latent_pages.shape
    num_slots = num_pages * page_size
    slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)
    flat = latent_pages.reshape(num_slots, d).at[slots].set(rows.astype(latent_pages.dtype), mode="drop")
    return flat.reshape(latent_pages.shape)


def ragged_paged_mla(
    q: jax.Array,  # [N, Hq, Dk], absorbed: [q_nope @ W_uk | q_rope]
    latent_pages: jax.Array,  # [num_pages, page_size, 1, Dk]
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    v_dim: int,
    impl: str | None = None,
) -> jax.Array:
    """Causal attention of a flat ragged batch against latent pages; returns [N, Hq, v_dim] (the latent
    part, before the value up-projection). Batch layout and masking as `ragged_paged_attention`."""
    impl = impl or mla_attention_impl()
    if impl != "jnp":
        raise ValueError(f"impl={impl!r}: only 'jnp' is implemented for MLA")
    if not 0 < v_dim <= latent_pages.shape[-1]:
        raise ValueError(f"v_dim {v_dim} must be in [1, {latent_pages.shape[-1]}]")
    args = (q, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    return _ragged_paged_attention_jnp(*args, sm_scale=float(sm_scale), sliding_window=None, latent_v_dim=int(v_dim))
