"""Gated DeltaNet kernels against a float64 numpy recurrence, transformers' torch reference, and (for the
ragged pool API) the contiguous functions run one sequence at a time. Tiny float32 shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

from kernels import gated_delta as gd

DK, DV, CHANNELS = 8, 6, 10


def make_inputs(t, hk, hv, seed=0, batch=2):
    """q, k, v, g (log decay, <= 0), beta (0, 1) for [batch, t] tokens, as float32 numpy."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, t, hk, DK), np.float32)
    k = rng.standard_normal((batch, t, hk, DK), np.float32)
    v = rng.standard_normal((batch, t, hv, DV), np.float32)
    g = -rng.uniform(0.01, 1.5, (batch, t, hv)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (batch, t, hv)).astype(np.float32)
    return q, k, v, g, beta


def make_state(batch, hv, seed=1):
    return (np.random.default_rng(seed).standard_normal((batch, hv, DK, DV)) * 0.3).astype(np.float32)


# One compiled function per static configuration: eager calls would compile each op separately.
recurrent = jax.jit(gd.gated_delta_rule_recurrent, static_argnames=("use_qk_l2norm",))
chunked = jax.jit(gd.gated_delta_rule_chunked, static_argnames=("chunk_size", "use_qk_l2norm"))
conv = jax.jit(gd.causal_conv1d)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


# --- contiguous --------------------------------------------------------------------------------


@pytest.mark.parametrize("hk,hv", [(2, 2), (1, 3)])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_and_chunked_match_reference(hk, hv, with_state):
    t = 11  # not a multiple of either chunk size
    inputs = make_inputs(t, hk, hv)
    state = make_state(2, hv) if with_state else None
    want_out, want_state = gd.gated_delta_rule_reference(*inputs, initial_state=state)
    assert np.abs(want_out).max() > 0.1  # a non-trivial case
    got = [recurrent(*inputs, state)] + [chunked(*inputs, state, chunk_size=c) for c in (4, 64)]
    for out, final in got:
        assert out.shape == (2, t, hv, DV) and final.shape == (2, hv, DK, DV) and final.dtype == jnp.float32
        close(out, want_out)
        close(final, want_state)


def test_without_l2norm_matches_reference():
    inputs = make_inputs(6, 1, 2)
    inputs = (inputs[0] * 0.3, inputs[1] * 0.3, *inputs[2:])  # keep the unnormalised keys stable
    want_out, want_state = gd.gated_delta_rule_reference(*inputs, use_qk_l2norm=False)
    for out, final in (recurrent(*inputs, use_qk_l2norm=False), chunked(*inputs, chunk_size=4, use_qk_l2norm=False)):
        close(out, want_out)
        close(final, want_state)


def test_chunked_in_pieces_equals_whole():
    inputs = make_inputs(13, 1, 2)
    state = make_state(2, 2)
    whole_out, whole_state = chunked(*inputs, state, chunk_size=4)
    out_a, state_a = chunked(*(a[:, :5] for a in inputs), state, chunk_size=4)
    out_b, state_b = chunked(*(a[:, 5:] for a in inputs), state_a, chunk_size=4)
    close(jnp.concatenate([out_a, out_b], axis=1), whole_out)
    close(state_b, whole_state)


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_matches_transformers(chunk_size):
    hk, hv = 1, 2
    inputs = make_inputs(11, hk, hv, seed=3)
    state = make_state(2, hv, seed=4)
    torch_in = [torch.from_numpy(a) for a in inputs]
    kwargs = dict(initial_state=torch.from_numpy(state), output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_out, want_state = hf.torch_chunk_gated_delta_rule(*torch_in, chunk_size=chunk_size, **kwargs)
    out, final = chunked(*inputs, state, chunk_size=chunk_size)
    close(out, want_out.numpy())
    close(final, want_state.numpy())
    want_out, want_state = hf.torch_recurrent_gated_delta_rule(*torch_in, **kwargs)
    out, final = recurrent(*inputs, state)
    close(out, want_out.numpy())
    close(final, want_state.numpy())


def test_output_dtype_follows_v():
    q, k, v, g, beta = make_inputs(5, 1, 2)
    v16 = jnp.asarray(v, jnp.bfloat16)
    for out, final in (recurrent(q, k, v16, g, beta), chunked(q, k, v16, g, beta, chunk_size=4)):
        assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32
        close(out, recurrent(q, k, v16.astype(jnp.float32), g, beta)[0], tol=2e-2)


@pytest.mark.parametrize("kernel_size", [3, 4])
def test_conv_matches_transformers_and_pieces(kernel_size):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 9, CHANNELS), np.float32)
    weight = rng.standard_normal((CHANNELS, kernel_size), np.float32)
    out, state = conv(x, weight)
    want = hf.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(weight), activation="silu")
    close(out, want.transpose(1, 2).numpy())
    close(state, x[:, -(kernel_size - 1) :])

    # In pieces (the last a single decode token), carrying the state, equals the whole.
    outs, state = [], None
    for lo, hi in ((0, 1), (1, 6), (6, 8), (8, 9)):
        piece, state = conv(x[:, lo:hi], weight, state)
        outs.append(piece)
    close(jnp.concatenate(outs, axis=1), out)
    close(state, x[:, -(kernel_size - 1) :])

    # A decode step equals transformers' causal_conv1d_update (state as [B, C, K-1] there).
    torch_state = torch.from_numpy(np.ascontiguousarray(x[:, 5:8].transpose(0, 2, 1)))
    want = hf.causal_conv1d_update(
        torch.from_numpy(x[:, 8:9]).transpose(1, 2),
        torch_state[..., -(kernel_size - 1) :].contiguous(),
        torch.from_numpy(weight),
        activation="silu",
    )
    piece, _ = conv(x[:, 8:9], weight, x[:, 8 - (kernel_size - 1) : 8])
    close(piece, want.transpose(1, 2).numpy())


# --- ragged ------------------------------------------------------------------------------------

HK, HV, KERNEL, NUM_SLOTS = 1, 2, 4, 16
# q_lens of the live sequences: decode tokens, an empty sequence, and one longer than 64 tokens.
LENS = (5, 1, 0, 70, 1, 3, 9)
SLOTS = (7, 2, 0, 4, 9, 1, 12)  # shuffled; slot 0 belongs to the empty sequence (not written)
# Snapshots: valid ones (including at the last token and on a single token), and ignored ones.
SNAP_LENS = (2, 1, 1, 33, 0, 3, 10)
SNAP_SLOTS = (5, 6, 13, 8, 10, 11, 3)
WRITTEN = {7, 2, 4, 9, 1, 12, 5, 6, 8, 11}  # 13 (empty sequence), 10 (len 0) and 3 (len > q_len) not
DEAD_SEQS, DEAD_TOKENS = 2, 4  # unused sequence entries and padding tokens after the live ones


def ragged_batch(seed=0):
    """A flat batch of LENS, padded with dead sequence entries and NaN padding tokens, plus pools."""
    rng = np.random.default_rng(seed)
    live = sum(LENS)
    n = live + DEAD_TOKENS
    q, k, v, g, beta = (a[0] for a in make_inputs(n, HK, HV, seed=seed, batch=1))
    x = rng.standard_normal((n, CHANNELS), np.float32)
    for a in (q, k, v, g, beta, x):
        a[live:] = np.nan  # padding may hold anything; it must not leak anywhere
    cu = np.concatenate([[0], np.cumsum(LENS), [live] * DEAD_SEQS]).astype(np.int32)
    # Dead entries point at live slots: the kernel must ignore them.
    slots = np.array(SLOTS + (7, 4), np.int32)
    snap_lens = np.array(SNAP_LENS + (1, 1), np.int32)
    snap_slots = np.array(SNAP_SLOTS + (14, 15), np.int32)
    states = (rng.standard_normal((NUM_SLOTS, HV, DK, DV)) * 0.3).astype(np.float32)
    conv_states = rng.standard_normal((NUM_SLOTS, KERNEL - 1, CHANNELS)).astype(np.float32)
    weight = rng.standard_normal((CHANNELS, KERNEL)).astype(np.float32)
    return dict(
        tokens=(q, k, v, g, beta),
        x=x,
        weight=weight,
        states=states,
        conv_states=conv_states,
        cu=cu,
        slots=slots,
        snap_lens=snap_lens,
        snap_slots=snap_slots,
        num_seqs=np.array([len(LENS)], np.int32),
    )


@functools.partial(jax.jit, static_argnames=("chunk_size", "decode_only"), donate_argnums=(1,))
def ragged_step(tokens, states, b, chunk_size, decode_only=False):
    return gd.ragged_gated_delta_rule(
        *tokens,
        states,
        b["slots"],
        b["cu"],
        b["num_seqs"],
        b["snap_lens"],
        b["snap_slots"],
        chunk_size=chunk_size,
        decode_only=decode_only,
    )


@functools.partial(jax.jit, donate_argnums=(2,))
def ragged_conv(x, weight, conv_states, b):
    return gd.ragged_causal_conv1d(x, weight, conv_states, b["slots"], b["cu"], b["num_seqs"], b["snap_lens"], b["snap_slots"])


def index_args(b):
    return {key: b[key] for key in ("slots", "cu", "num_seqs", "snap_lens", "snap_slots")}


def contiguous(i, b, length):
    """Sequence i's first `length` tokens run alone through the contiguous functions."""
    lo = b["cu"][i]
    toks = [a[None, lo : lo + length] for a in b["tokens"]]
    slot = SLOTS[i]
    out, state = recurrent(*toks, b["states"][slot][None])
    conv_out, conv_state = conv(b["x"][None, lo : lo + length], b["weight"], b["conv_states"][slot][None])
    return out[0], state[0], conv_out[0], conv_state[0]


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_ragged_matches_per_sequence(chunk_size):
    b = ragged_batch()
    live = sum(LENS)
    out, states = ragged_step(b["tokens"], jnp.asarray(b["states"]), index_args(b), chunk_size=chunk_size)
    conv_out, conv_states = ragged_conv(b["x"], b["weight"], jnp.asarray(b["conv_states"]), index_args(b))
    out, states, conv_out, conv_states = map(np.asarray, (out, states, conv_out, conv_states))

    expected_writes = set()
    for i, q_len in enumerate(LENS):
        if q_len == 0:
            continue
        lo, slot = b["cu"][i], SLOTS[i]
        want_out, want_state, want_conv, want_conv_state = contiguous(i, b, q_len)
        close(out[lo : lo + q_len], want_out)
        close(states[slot], want_state)
        close(conv_out[lo : lo + q_len], want_conv)
        close(conv_states[slot], want_conv_state)
        expected_writes.add(slot)
        if 1 <= SNAP_LENS[i] <= q_len:
            _, snap_state, _, snap_conv = contiguous(i, b, SNAP_LENS[i])
            close(states[SNAP_SLOTS[i]], snap_state)
            close(conv_states[SNAP_SLOTS[i]], snap_conv)
            expected_writes.add(SNAP_SLOTS[i])
    assert expected_writes == WRITTEN

    # Other slots are bit-identical; padding tokens' outputs are finite.
    for slot in set(range(NUM_SLOTS)) - WRITTEN:
        np.testing.assert_array_equal(states[slot], b["states"][slot])
        np.testing.assert_array_equal(conv_states[slot], b["conv_states"][slot])
    assert np.isfinite(out).all() and np.isfinite(conv_out).all()
    assert out.shape == (live + DEAD_TOKENS, HV, DV) and conv_out.shape == b["x"].shape


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_ragged_several_snapshots_per_sequence(chunk_size):
    """Snapshots as [S, K]: several per sequence, given in any order, with unused entries between them
    (length 0, past the sequence, slot -1 or past the pool); each valid one is the state after its length."""
    lens = (70, 9, 1, 5)
    slots = (0, 1, 2, 3)
    snap_lens = ((65, 16, 33), (0, 9, 4), (1, 2, 1), (5, 2, 40))
    snap_slots = ((10, 11, 12), (13, 14, 15), (16, 17, -1), (18, 19, 32))
    valid = {10: (0, 65), 11: (0, 16), 12: (0, 33), 14: (1, 9), 15: (1, 4), 16: (2, 1), 18: (3, 5), 19: (3, 2)}
    num_slots, live = 32, sum(lens)
    rng = np.random.default_rng(5)
    n = live + 3
    tokens = tuple(a[0] for a in make_inputs(n, HK, HV, seed=5, batch=1))
    x = rng.standard_normal((n, CHANNELS), np.float32)
    for a in (*tokens, x):
        a[live:] = np.nan
    states0 = (rng.standard_normal((num_slots, HV, DK, DV)) * 0.3).astype(np.float32)
    conv0 = rng.standard_normal((num_slots, KERNEL - 1, CHANNELS)).astype(np.float32)
    weight = rng.standard_normal((CHANNELS, KERNEL)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    b = dict(
        slots=np.array(slots, np.int32),
        cu=cu,
        num_seqs=np.array([len(lens)], np.int32),
        snap_lens=np.array(snap_lens, np.int32),
        snap_slots=np.array(snap_slots, np.int32),
    )
    out, states = map(np.asarray, ragged_step(tokens, jnp.asarray(states0), b, chunk_size=chunk_size))
    conv_out, conv_states = map(np.asarray, ragged_conv(x, weight, jnp.asarray(conv0), b))

    def alone(i, length):
        lo = cu[i]
        _, state = recurrent(*(a[None, lo : lo + length] for a in tokens), states0[slots[i]][None])
        _, conv_state = conv(x[None, lo : lo + length], weight, conv0[slots[i]][None])
        return state[0], conv_state[0]

    for i, q_len in enumerate(lens):
        lo = cu[i]
        want_out, _ = recurrent(*(a[None, lo : lo + q_len] for a in tokens), states0[slots[i]][None])
        close(out[lo : lo + q_len], want_out[0])
        want_state, want_conv = alone(i, q_len)
        close(states[slots[i]], want_state)
        close(conv_states[slots[i]], want_conv)
    for slot, (i, length) in valid.items():
        want_state, want_conv = alone(i, length)
        close(states[slot], want_state)
        close(conv_states[slot], want_conv)
    for slot in set(range(num_slots)) - set(valid) - set(slots):  # 13, 17 and the rest: untouched
        np.testing.assert_array_equal(states[slot], states0[slot])
        np.testing.assert_array_equal(conv_states[slot], conv0[slot])
    assert np.isfinite(out).all() and np.isfinite(conv_out).all()


def test_ragged_padding_changes_nothing():
    """More padding tokens (different values) and fewer live sequences: the live results are the same."""
    b = ragged_batch()
    live = sum(LENS)
    out, states = ragged_step(b["tokens"], jnp.asarray(b["states"]), index_args(b), chunk_size=4)

    # Drop the last live sequence (it becomes padding) and fill every padding token with finite junk.
    short = dict(b, num_seqs=np.array([len(LENS) - 1], np.int32))
    cut = live - LENS[-1]
    junk = np.random.default_rng(9)
    short["tokens"] = tuple(
        np.where(np.arange(len(a)).reshape(-1, *(1,) * (a.ndim - 1)) < cut, a, junk.uniform(-1, 0, a.shape).astype(np.float32))
        for a in b["tokens"]
    )
    out2, states2 = ragged_step(short["tokens"], jnp.asarray(b["states"]), index_args(short), chunk_size=4)
    out2, states2 = np.asarray(out2), np.asarray(states2)
    np.testing.assert_array_equal(out2[:cut], np.asarray(out)[:cut])
    dropped = {SLOTS[-1], SNAP_SLOTS[-1]}
    for slot in range(NUM_SLOTS):
        want = b["states"][slot] if slot in dropped else np.asarray(states)[slot]
        np.testing.assert_array_equal(states2[slot], want)
    assert np.isfinite(out2).all()


def test_decode_only_equals_general_path():
    """One token per sequence, sequence i's being token i, with padding and a single-token snapshot."""
    b = ragged_batch(seed=2)
    num_live, n = 5, 7
    tokens = tuple(a[:n].copy() for a in b["tokens"])
    for a in tokens:
        a[num_live:] = np.nan
    d = dict(
        slots=np.array([3, 9, 0, 14, 6, 2, 2], np.int32),
        cu=np.array([0, 1, 2, 3, 4, 5, 5, 5], np.int32),
        num_seqs=np.array([num_live], np.int32),
        snap_lens=np.array([1, 0, 1, 1, 1, 1, 1], np.int32),
        snap_slots=np.array([11, 12, -1, NUM_SLOTS, 8, 1, 1], np.int32),
    )
    fast = ragged_step(tokens, jnp.asarray(b["states"]), d, chunk_size=4, decode_only=True)
    general = ragged_step(tokens, jnp.asarray(b["states"]), d, chunk_size=4)
    for got, want in zip(fast, general):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    out, states = map(np.asarray, fast)
    for i in range(num_live):  # and both equal one contiguous recurrent step
        want_out, want_state = recurrent(*(a[None, i : i + 1] for a in tokens), b["states"][d["slots"][i]][None])
        close(out[i], want_out[0, 0])
        close(states[d["slots"][i]], want_state[0])
    close(states[11], states[3])  # snapshot after the only token = the final state
    close(states[8], states[6])
    for slot in (1, 2, 4, 5, 7, 10, 12, 13, 15):  # written: 3 9 0 14 6 and snapshots 11 8
        np.testing.assert_array_equal(states[slot], b["states"][slot])
    assert np.isfinite(out).all()


def test_impl_is_portable():
    assert gd.gated_delta_impl() == "jnp"
