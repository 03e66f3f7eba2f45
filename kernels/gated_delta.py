"""Gated DeltaNet kernels: the linear-attention layers of Qwen3.5 / Qwen3-Next.

A Gated DeltaNet layer keeps, per sequence, a short causal-conv history and one [dk, dv] matrix state
per value head instead of a growing KV cache. Each token decays the state by exp(g) and then writes
its value with the delta rule (only the part the state does not already predict):

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

Two APIs, both matching transformers 5.x (`causal_conv1d_fn` / `causal_conv1d_update`,
`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`):
- contiguous [B, T, ...] batches (the model's reference path, and the oracle for the ragged one):
  `causal_conv1d`, `gated_delta_rule_recurrent` (one step per token) and `gated_delta_rule_chunked`
  (the chunked WY form: a triangular solve per chunk turns chunk_size sequential delta updates into a
  few matmuls, then a scan carries the state across chunks);
- ragged flat batches over state *pools* indexed by slot, for the engine's mixed prefill/decode steps:
  `ragged_causal_conv1d` and `ragged_gated_delta_rule`, with optional mid-step snapshots (the states
  after a sequence's first n1, n2, ... tokens of this step, e.g. for prefix caching at several boundaries).

All math runs in float32; outputs come back in the input dtype of v (x for the conv). Recurrent
states are float32. `gated_delta_impl` is the one place a TPU kernel would be chosen.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_L2NORM_EPS = 1e-6  # as transformers' l2norm (and the FLA library)
# The state is a running sum over the whole sequence, so its matmuls keep full float32 precision
# (TPU/GPU default float32 matmuls round inputs to bf16/tf32, which would drift from transformers).
_PRECISION = jax.lax.Precision.HIGHEST


def gated_delta_impl() -> str:
    """The one place the Gated DeltaNet implementation is chosen: "jnp" on every backend for now.

    A Pallas TPU kernel (chunked WY form with the state resident in VMEM) would plug in here,
    returning "pallas" when jax.default_backend() == "tpu"; the ragged entry points dispatch on it.
    """
    return "jnp"


def _mm(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(subscripts, a, b, precision=_PRECISION)


# ---------------------------------------------------------------------------------------------
# Causal depthwise conv (the short convolution over the q/k/v projections).


def causal_conv1d(
    x: jax.Array,  # [B, T, C]
    weight: jax.Array,  # [C, K] (torch's depthwise Conv1d weight [C, 1, K] squeezed)
    conv_state: jax.Array | None = None,  # [B, K-1, C]: the previous K-1 inputs, oldest first
) -> tuple[jax.Array, jax.Array]:
    """silu(depthwise causal conv over concat(conv_state, x)) [B, T, C] in x.dtype, and the new state.

    The new state is the last K-1 rows of concat(conv_state, x), so feeding a sequence in pieces gives
    what feeding it whole does. No state means a fresh sequence (zero history). The new state has
    conv_state's dtype (x's when None), so it can be carried through a scan or a pool unchanged.
    """
    b, t, c = x.shape
    k = weight.shape[1]
    if conv_state is None:
        conv_state = jnp.zeros((b, k - 1, c), x.dtype)
    xx = jnp.concatenate([conv_state.astype(jnp.float32), x.astype(jnp.float32)], axis=1)
    w = weight.astype(jnp.float32)
    # Cross-correlation like torch's conv1d: tap j sees the input K-1-j steps back. K is tiny (~4),
    # so a static loop of shifted multiply-adds beats a general convolution.
    acc = sum(xx[:, j : j + t] * w[:, j] for j in range(k))
    new_state = xx[:, t:].astype(conv_state.dtype)
    return jax.nn.silu(acc).astype(x.dtype), new_state


# ---------------------------------------------------------------------------------------------
# Gated delta rule, contiguous batches.


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2NORM_EPS)


def _prepare_qk(q: jax.Array, k: jax.Array, use_qk_l2norm: bool) -> tuple[jax.Array, jax.Array]:
    """float32 q, k, L2-normalised over dk if asked, q scaled by dk**-0.5 (always, as transformers)."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * (q.shape[-1] ** -0.5), k


def _expand_heads(x: jax.Array, num_v_heads: int, axis: int = -2) -> jax.Array:
    """Key head j serves value heads j*G .. j*G+G-1 (torch's repeat_interleave)."""
    group = num_v_heads // x.shape[axis]
    return x if group == 1 else jnp.repeat(x, group, axis=axis)


def _check_heads(k: jax.Array, v: jax.Array) -> None:
    if v.shape[-2] % k.shape[-2]:
        raise ValueError(f"{v.shape[-2]} value heads is not a multiple of {k.shape[-2]} key heads")


def _delta_step(state, q, k, v, g, beta):
    """One token for any leading dims: state [..., dk, dv]; q, k [..., dk]; v [..., dv]; g, beta [...]."""
    state = state * jnp.exp(g)[..., None, None]
    predicted = _mm("...kv,...k->...v", state, k)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return state, _mm("...kv,...k->...v", state, q)


def _initial_state(initial_state, b, hv, dk, dv):
    if initial_state is None:
        return jnp.zeros((b, hv, dk, dv), jnp.float32)
    return initial_state.astype(jnp.float32)


def gated_delta_rule_recurrent(
    q: jax.Array,  # [B, T, Hk, dk]
    k: jax.Array,  # [B, T, Hk, dk]
    v: jax.Array,  # [B, T, Hv, dv]
    g: jax.Array,  # [B, T, Hv] log decay (<= 0)
    beta: jax.Array,  # [B, T, Hv] in (0, 1)
    initial_state: jax.Array | None = None,  # [B, Hv, dk, dv] float32
    use_qk_l2norm: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token gated delta rule (a scan over T): out [B, T, Hv, dv] in v.dtype, final state f32.

    Cost is T sequential rank-1 updates: the right choice for decode (T = 1), the chunked form for
    prefill.
    """
    _check_heads(k, v)
    b, _, _, dk = k.shape
    hv, dv = v.shape[-2:]
    q, k = _prepare_qk(q, k, use_qk_l2norm)
    q, k = _expand_heads(q, hv), _expand_heads(k, hv)
    xs = tuple(jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta))  # time first

    def step(state, x):
        return _delta_step(state, *x)

    state, out = jax.lax.scan(step, _initial_state(initial_state, b, hv, dk, dv), xs)
    return jnp.moveaxis(out, 0, 1).astype(v.dtype), state


class _ChunkParts(NamedTuple):
    """What the scan over chunks needs of each chunk, all computable for every chunk at once.

    Leading dims [..., C] (C = chunk_size); a padded or masked token has k = 0, beta = 0, g = 0.
    """

    values: jax.Array  # [..., C, dv] WY-transformed beta*v ("u" in the DeltaNet paper)
    k_cumdecay: jax.Array  # [..., C, dk] WY-transformed decayed beta*k: how each u reads the old state
    q_decayed: jax.Array  # [..., C, dk] q scaled by the decay since the chunk start
    k_decayed: jax.Array  # [..., C, dk] k scaled by the decay to the chunk end
    attn: jax.Array  # [..., C, C] causal (diagonal included) decayed q.k within the chunk
    chunk_decay: jax.Array  # [...] exp(sum of g over the chunk)


def _chunk_parts(q, k, v, g, beta) -> _ChunkParts:
    """Intra-chunk quantities of torch_chunk_gated_delta_rule's first phase.

    q, k [..., C, dk] (already normalised, scaled and expanded to value heads), v [..., C, dv],
    g, beta [..., C], all float32.
    """
    c = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)  # log decay from the chunk start through each token
    causal = jnp.tril(jnp.ones((c, c), bool))
    # decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0. The exponent is masked before exp so the
    # (positive) upper triangle can never overflow.
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    # The UT transform: C delta updates inside a chunk compose to (I + strict_lower(A))^-1 applied to
    # beta*v and to the decayed beta*k, A = (beta k k^T) * decay. One unit-diagonal triangular solve
    # handles both right-hand sides (torch solves them separately; same math).
    system = _mm("...id,...jd->...ij", k_beta, k) * decay
    dv = v.shape[-1]
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(cum)[..., None]], axis=-1)
    solved = jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)
    last = cum[..., -1:]
    return _ChunkParts(
        values=solved[..., :dv],
        k_cumdecay=solved[..., dv:],
        q_decayed=q * jnp.exp(cum)[..., None],
        k_decayed=k * jnp.exp(last - cum)[..., None],
        attn=_mm("...id,...jd->...ij", q, k) * decay,
        chunk_decay=jnp.exp(last[..., 0]),
    )


def _chunk_step(state: jax.Array, p: _ChunkParts) -> tuple[jax.Array, jax.Array]:
    """Second phase for one chunk: state [..., dk, dv] in, (new state, out [..., C, dv])."""
    # Subtract what the state entering the chunk already predicts: only the correction is written.
    v_new = p.values - _mm("...ck,...kv->...cv", p.k_cumdecay, state)
    out = _mm("...ck,...kv->...cv", p.q_decayed, state) + _mm("...ij,...jv->...iv", p.attn, v_new)
    state = state * p.chunk_decay[..., None, None] + _mm("...ck,...cv->...kv", p.k_decayed, v_new)
    return state, out


def gated_delta_rule_chunked(
    q: jax.Array,  # [B, T, Hk, dk]
    k: jax.Array,  # [B, T, Hk, dk]
    v: jax.Array,  # [B, T, Hv, dv]
    g: jax.Array,  # [B, T, Hv] log decay (<= 0)
    beta: jax.Array,  # [B, T, Hv] in (0, 1)
    initial_state: jax.Array | None = None,  # [B, Hv, dk, dv] float32
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The chunked (WY) gated delta rule: same result as `gated_delta_rule_recurrent`, for prefill.

    Intra-chunk quantities for all chunks at once, then a scan over T / chunk_size chunks carrying the
    state. T is padded to a multiple of chunk_size with k = 0, beta = 0, g = 0: tokens that leave the
    state unchanged, so the final state is the one after token T-1.
    """
    _check_heads(k, v)
    b, t, _, dk = k.shape
    hv, dv = v.shape[-2:]
    q, k = _prepare_qk(q, k, use_qk_l2norm)
    q, k = _expand_heads(q, hv), _expand_heads(k, hv)
    pad = -t % chunk_size
    num_chunks = (t + pad) // chunk_size

    def chunked(x):  # [B, T, Hv, ...] -> [chunks, B, Hv, C, ...], chunks first for the scan
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, num_chunks, chunk_size, *x.shape[2:])
        return jnp.moveaxis(x, (1, 2), (0, 3))

    parts = _chunk_parts(*(chunked(a) for a in (q, k, v, g, beta)))
    state, out = jax.lax.scan(_chunk_step, _initial_state(initial_state, b, hv, dk, dv), parts)
    out = jnp.moveaxis(out, (0, 3), (1, 2)).reshape(b, num_chunks * chunk_size, hv, dv)
    return out[:, :t].astype(v.dtype), state


def gated_delta_rule_reference(q, k, v, g, beta, initial_state=None, use_qk_l2norm=True):
    """Naive float64 numpy recurrence, one token and one value head at a time. Tests only."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    b, t, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    group = hv // hk
    if use_qk_l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + _L2NORM_EPS)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + _L2NORM_EPS)
    q = q * dk**-0.5
    state = np.zeros((b, hv, dk, dv)) if initial_state is None else np.array(initial_state, np.float64)
    out = np.zeros((b, t, hv, dv))
    for bi in range(b):
        for ti in range(t):
            for h in range(hv):
                kt, qt = k[bi, ti, h // group], q[bi, ti, h // group]
                s = state[bi, h] * np.exp(g[bi, ti, h])
                delta = beta[bi, ti, h] * (v[bi, ti, h] - s.T @ kt)
                s = s + np.outer(kt, delta)
                state[bi, h] = s
                out[bi, ti, h] = s.T @ qt
    return out, state


# ---------------------------------------------------------------------------------------------
# Ragged batches over state pools (the engine's flat, mixed prefill/decode steps).
#
# Sequence i < num_seqs[0] owns tokens cu_q_lens[i] : cu_q_lens[i+1] and the pool entry slots[i]: its
# state is read from there and the state after its last token written back. Optionally the states
# after its first snap_lens[i, j] tokens are also written to snap_slots[i, j] (snapshots: [S] for one per
# sequence, [S, K] for up to K, in any order; a slot out of [0, num_slots), or a snap_len outside
# [1, q_len], means none). Tokens from cu_q_lens[num_seqs] on are padding: they touch no state and their
# outputs are 0. All written slots are distinct (the caller's promise), so every write lands on a slot no
# other sequence reads, and the order of writes does not matter.


class _Seqs(NamedTuple):
    """Per-sequence plan, i32[S] each; sequences >= num_seqs have q_len 0 and write nothing."""

    start: jax.Array  # first token
    q_len: jax.Array  # tokens this step
    write: jax.Array  # slot the final state goes to; num_slots (dropped) when nothing to write
    snap_len: jax.Array  # [S, K] tokens before each snapshot, non-decreasing (an unused entry repeats the one before)
    snap_write: jax.Array  # [S, K] slot each snapshot goes to; num_slots (dropped) where there is none


def _plan_seqs(cu_q_lens, num_seqs, slots, snap_lens, snap_slots, num_slots: int) -> _Seqs:
    max_seqs = slots.shape[0]
    live = jnp.arange(max_seqs) < num_seqs[0]  # entries past num_seqs may be garbage
    start = cu_q_lens[:-1]
    q_len = jnp.where(live, cu_q_lens[1:] - start, 0)
    write = jnp.where(q_len > 0, slots, num_slots)
    if snap_slots is None:
        snap_len, snap_write = q_len[:, None], jnp.full_like(slots, num_slots)[:, None]
    else:
        if snap_lens is None:
            raise ValueError("snap_slots needs snap_lens")
        snap_lens, snap_slots = jnp.asarray(snap_lens), jnp.asarray(snap_slots)
        if snap_slots.ndim == 1:  # one snapshot per sequence
            snap_lens, snap_slots = snap_lens[:, None], snap_slots[:, None]
        snap = (snap_slots >= 0) & (snap_slots < num_slots) & (snap_lens >= 1) & (snap_lens <= q_len[:, None])
        # In order of length, unused entries last; an unused entry splits nowhere (it takes the length before
        # it), so the segments between snapshots follow each other whatever the unused entries hold.
        order = jnp.argsort(jnp.where(snap, snap_lens, jnp.iinfo(jnp.int32).max), axis=1, stable=True)
        snap_lens, snap_slots, snap = (jnp.take_along_axis(a, order, axis=1) for a in (snap_lens, snap_slots, snap))
        snap_len = jax.lax.cummax(jnp.where(snap, snap_lens, 0), axis=1)
        snap_write = jnp.where(snap, snap_slots, num_slots)
    return _Seqs(*(jnp.asarray(a, jnp.int32) for a in (start, q_len, write, snap_len, snap_write)))


def _set_slots(pool: jax.Array, targets: jax.Array, values: jax.Array) -> jax.Array:
    """pool[targets[i]] = values[i]; targets == num_slots are dropped. In place under donation."""
    return pool.at[targets].set(values.astype(pool.dtype), mode="drop")


@jax.jit
def ragged_causal_conv1d(
    x: jax.Array,  # [N, C]
    weight: jax.Array,  # [C, K]
    conv_states: jax.Array,  # [num_slots, K-1, C] pool, oldest input first
    slots: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    snap_lens: jax.Array | None = None,  # i32[S] or i32[S, K]
    snap_slots: jax.Array | None = None,  # i32[S] or i32[S, K]
) -> tuple[jax.Array, jax.Array]:
    """`causal_conv1d` for a flat ragged batch over a pool of conv states: (out [N, C] x.dtype, pool).

    Fully vectorised (no loop): each token gathers its K-1 predecessors from its own sequence's
    tokens or, for the first K-1 tokens, from the sequence's pooled history. Cost ~ N x K x C.
    """
    n, c = x.shape
    num_slots, hist_len, _ = conv_states.shape
    k = weight.shape[1]
    if k < 2 or hist_len != k - 1:
        raise ValueError(f"conv_states hold {hist_len} inputs; kernel size {k} needs {k - 1} (and k >= 2)")
    seqs = _plan_seqs(cu_q_lens, num_seqs, slots, snap_lens, snap_slots, num_slots)
    hist = conv_states[jnp.clip(slots, 0, num_slots - 1)].astype(jnp.float32)  # [S, K-1, C]
    xf = x.astype(jnp.float32)

    # Each token's sequence (the first whose end is past it: empty sequences are skipped) and position
    # in it. Entries past num_seqs may be garbage, so their ends go past every token; padding tokens
    # land on num_seqs (clamped) and are zeroed below.
    token = jnp.arange(n)
    max_seqs = slots.shape[0]
    ends = jnp.where(jnp.arange(max_seqs) < num_seqs[0], cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    seq = jnp.minimum(jnp.searchsorted(ends, token, side="right"), max_seqs - 1)
    pos = token - seqs.start[seq]
    live = token < cu_q_lens[num_seqs[0]]

    xpad = jnp.concatenate([jnp.zeros((hist_len, c), jnp.float32), xf])
    acc = xf * weight[:, k - 1].astype(jnp.float32)
    for back in range(1, k):  # tap K-1-back reads the input `back` steps earlier
        own = xpad[hist_len - back : hist_len - back + n]
        pooled = hist[seq, jnp.clip(hist_len - back + pos, 0, hist_len - 1)]
        acc += jnp.where((pos >= back)[:, None], own, pooled) * weight[:, k - 1 - back].astype(jnp.float32)
    out = jnp.where(live[:, None], jax.nn.silu(acc), 0.0).astype(x.dtype)

    def state_after(length):  # [S, K-1, C]: the last K-1 inputs after `length` tokens of each sequence
        back = length[:, None] - hist_len + jnp.arange(hist_len)  # position within the sequence
        own = xf[jnp.clip(seqs.start[:, None] + back, 0, n - 1)]
        pooled = hist[jnp.arange(max_seqs)[:, None], jnp.clip(hist_len + back, 0, hist_len - 1)]
        return jnp.where((back >= 0)[..., None], own, pooled)

    conv_states = _set_slots(conv_states, seqs.write, state_after(seqs.q_len))
    if snap_slots is not None:
        for j in range(seqs.snap_write.shape[1]):
            conv_states = _set_slots(conv_states, seqs.snap_write[:, j], state_after(seqs.snap_len[:, j]))
    return out, conv_states


def ragged_gated_delta_rule(
    q: jax.Array,  # [N, Hk, dk]
    k: jax.Array,  # [N, Hk, dk]
    v: jax.Array,  # [N, Hv, dv]
    g: jax.Array,  # [N, Hv]
    beta: jax.Array,  # [N, Hv]
    states: jax.Array,  # [num_slots, Hv, dk, dv] float32 pool
    slots: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    snap_lens: jax.Array | None = None,  # i32[S] or i32[S, K]
    snap_slots: jax.Array | None = None,  # i32[S] or i32[S, K]
    chunk_size: int = 64,
    decode_only: bool = False,
    use_qk_l2norm: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule for a flat ragged batch over a pool of states: (out [N, Hv, dv], pool).

    decode_only (static) promises one token per sequence, sequence i's being token i: then one
    vectorised step updates every sequence. Otherwise single-token sequences still take that step
    and the rest run the chunked form in a loop whose trip count is their real chunk count.
    """
    impl = gated_delta_impl()
    if impl != "jnp":  # a Pallas TPU kernel would be dispatched here
        raise ValueError(f"gated delta impl {impl!r} is not available")
    _check_heads(k, v)
    return _ragged_gated_delta_rule_jnp(
        q,
        k,
        v,
        g,
        beta,
        states,
        slots,
        cu_q_lens,
        num_seqs,
        snap_lens,
        snap_slots,
        chunk_size=chunk_size,
        decode_only=decode_only,
        use_qk_l2norm=use_qk_l2norm,
    )


@functools.partial(jax.jit, static_argnames=("chunk_size", "decode_only", "use_qk_l2norm"))
def _ragged_gated_delta_rule_jnp(
    q,
    k,
    v,
    g,
    beta,
    states,
    slots,
    cu_q_lens,
    num_seqs,
    snap_lens,
    snap_slots,
    *,
    chunk_size,
    decode_only,
    use_qk_l2norm,
):
    n, hv, dv = v.shape
    out_dtype = v.dtype  # v itself is recast below
    seqs = _plan_seqs(cu_q_lens, num_seqs, slots, snap_lens, snap_slots, states.shape[0])
    q, k = _prepare_qk(q, k, use_qk_l2norm)  # [N, Hk, dk] float32; expanded to value heads per use
    tokens = (q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32))
    out = jnp.zeros((n, hv, dv), jnp.float32)  # padding rows stay 0

    if decode_only:
        m = min(n, slots.shape[0])  # sequence i is token i
        seqs = _Seqs(*(a[:m] for a in seqs))
        out, states = _single_steps(out, states, tokens, jnp.arange(m, dtype=jnp.int32), seqs)
        return out.astype(out_dtype), states
    out, states = _single_steps(out, states, tokens, seqs.start, seqs)
    out, states = _chunk_loop(out, states, tokens, seqs, chunk_size)
    return out.astype(out_dtype), states


def _single_steps(out, states, tokens, token_of_seq, seqs: _Seqs):
    """One vectorised recurrent step for every sequence with exactly one token (the decode path).

    Gathers each sequence's state (all S of them: static shapes), steps, and scatters the outputs and
    states of the single-token sequences only; the rest are dropped.
    """
    n, num_slots = out.shape[0], states.shape[0]
    single = seqs.q_len == 1
    idx = jnp.clip(token_of_seq, 0, n - 1)
    q, k, v, g, beta = (a[idx] for a in tokens)
    hv = v.shape[-2]
    state = states[jnp.clip(seqs.write, 0, num_slots - 1)].astype(jnp.float32)
    state, o = _delta_step(state, _expand_heads(q, hv), _expand_heads(k, hv), v, g, beta)
    out = out.at[jnp.where(single, token_of_seq, n)].set(o, mode="drop")
    states = _set_slots(states, jnp.where(single, seqs.write, num_slots), state)
    # A single-token sequence's snapshots (snap_len == 1: at most one is valid) are the state after that token.
    for j in range(seqs.snap_write.shape[1]):
        states = _set_slots(states, jnp.where(single, seqs.snap_write[:, j], num_slots), state)
    return out, states


def _chunk_loop(out, states, tokens, seqs: _Seqs, chunk_size: int):
    """The chunked form for every sequence with more than one token, one chunk at a time.

    A while loop over those sequences (their count is dynamic), each running a loop over its real
    chunks, so work follows the tokens rather than the static N. Snapshots split the sequence into
    segments, each chunked from its own start, so the state at each split is exact. Chunks are read
    with dynamic_slice from inputs padded by chunk_size rows (a slice near the end is never shifted);
    rows beyond the segment are masked to k = beta = g = 0 (no effect on the state) and their outputs
    are not merged, so other sequences' rows in the same window are kept.
    """
    n, hv, _ = out.shape
    num_slots = states.shape[0]

    def pad(a):
        return jnp.concatenate([a, jnp.zeros((chunk_size, *a.shape[1:]), a.dtype)])

    tokens = tuple(pad(a) for a in tokens)
    out = pad(out)
    multi = seqs.q_len > 1
    order = jnp.nonzero(multi, size=multi.shape[0], fill_value=0)[0]

    def chunk(c, carry, lo, hi):
        state, out = carry
        pos = lo + c * chunk_size
        valid = pos + jnp.arange(chunk_size) < hi
        # where, not multiply: rows past the end may be padding holding NaN.
        q, k, v, g, beta = (
            jnp.where(valid.reshape(-1, *(1,) * (a.ndim - 1)), jax.lax.dynamic_slice_in_dim(a, pos, chunk_size), 0) for a in tokens
        )
        # [C, H, d] -> [Hv, C, d]: heads lead, as in the contiguous form.
        q, k = (jnp.swapaxes(_expand_heads(a, hv), 0, 1) for a in (q, k))
        v, g, beta = (jnp.swapaxes(a, 0, 1) for a in (v, g, beta))
        state, o = _chunk_step(state, _chunk_parts(q, k, v, g, beta))
        window = jax.lax.dynamic_slice_in_dim(out, pos, chunk_size)
        merged = jnp.where(valid[:, None, None], jnp.swapaxes(o, 0, 1), window)
        return state, jax.lax.dynamic_update_slice_in_dim(out, merged, pos, axis=0)

    def segment(state, out, lo, hi):
        num_chunks = (hi - lo + chunk_size - 1) // chunk_size
        return jax.lax.fori_loop(0, num_chunks, functools.partial(chunk, lo=lo, hi=hi), (state, out))

    def sequence(j, carry):
        out, states = carry
        i = order[j]
        start, slot = seqs.start[i], seqs.write[i]
        state = jax.lax.dynamic_index_in_dim(states, slot, keepdims=False).astype(jnp.float32)
        done = 0
        for point in range(seqs.snap_write.shape[1]):  # K is static and small
            snap_len, snap_slot = seqs.snap_len[i, point], seqs.snap_write[i, point]
            state, out = segment(state, out, start + done, start + snap_len)
            done = snap_len
            # Without a snapshot, this writes a partial state to the sequence's own slot, which the final
            # write below overwrites: branch-free, and a cheap in-place update.
            target = jnp.where(snap_slot < num_slots, snap_slot, slot)
            states = jax.lax.dynamic_update_index_in_dim(states, state.astype(states.dtype), target, axis=0)
        state, out = segment(state, out, start + done, start + seqs.q_len[i])
        states = jax.lax.dynamic_update_index_in_dim(states, state.astype(states.dtype), slot, axis=0)
        return out, states

    out, states = jax.lax.fori_loop(0, jnp.sum(multi), sequence, (out, states))
    return out[:n], states
