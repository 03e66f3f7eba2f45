"""Ragged paged attention and write_kv (kernels/attention.py) against a dense per-sequence reference.

Every batch carries the mess a real engine step has: pages in shuffled order, padding tokens,
padding sequences whose metadata is garbage (they even claim the padding rows), page-table slots
past each sequence pointing at other sequences' pages, and NaN in every slot no sequence has
written, so any read of an unwritten slot that leaks into the output shows up.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import attention
from kernels.attention import attention_impl, ragged_paged_attention, write_kv

TOL = 1e-5

# name -> (new tokens per sequence, KV length per sequence incl. the new tokens)
CASES = {
    "decode": ([1, 1, 1, 1], [1, 6, 17, 40]),
    "prefill": ([37], [37]),  # one whole prompt: three chunk items (16 + 16 + 5)
    # Chunk of 20 starting at position 25 (prefix cached), decodes, a whole 9-token prompt (a chunk
    # item of 9 rows), 5 tokens after a 7-token prefix and a 3-token prompt (per-token items).
    "mixed": ([20, 1, 9, 1, 5, 3], [45, 33, 9, 2, 12, 3]),
    # Spans over 128 keys, so even the default tuning splits items into several page groups.
    "long": ([1, 40, 1], [150, 200, 300]),
}


# Every batch is padded to these shapes (unless a test says otherwise), so the cases share
# compilations: only page size, head counts and static arguments make new ones.
MAX_TOKENS, MAX_SEQS, MAX_KV = 48, 8, 320


def build_batch(
    seed,
    q_lens,
    kv_lens,
    *,
    page_size,
    hq,
    hkv,
    d=8,
    n_tokens=MAX_TOKENS,
    max_seqs=MAX_SEQS,
    max_kv=MAX_KV,
    nan_fill=True,
):
    """Contiguous random K/V per sequence scattered into shuffled pages, plus the kernel's metadata.

    Rows past the sequences' tokens are padding tokens; sequence slots past len(q_lens) are padding
    sequences with garbage metadata.
    """
    rng = np.random.default_rng(seed)
    num_seqs, n = len(q_lens), n_tokens
    assert sum(q_lens) <= n and num_seqs <= max_seqs and max(kv_lens) <= max_kv
    needed = [-(-kv // page_size) for kv in kv_lens]
    pages_per_seq = -(-max_kv // page_size)
    num_pages = max_seqs * pages_per_seq  # fixed, and room for any batch; most pages stay unused
    fill = np.nan if nan_fill else 0.0
    kv_pages = np.full((num_pages, page_size, 2 * hkv, d), fill, np.float32)

    free = list(rng.permutation(num_pages))  # shuffled: a sequence's pages are not contiguous
    page_indices = rng.integers(0, num_pages, (max_seqs, pages_per_seq))  # garbage past the end
    keys, values = [], []
    for i, kv_len in enumerate(kv_lens):
        k = rng.standard_normal((kv_len, hkv, d)).astype(np.float32)
        v = rng.standard_normal((kv_len, hkv, d)).astype(np.float32)
        for p in range(needed[i]):
            page = free.pop()
            page_indices[i, p] = page
            chunk = slice(p * page_size, min((p + 1) * page_size, kv_len))
            rows = chunk.stop - chunk.start
            kv_pages[page, :rows, 0::2] = k[chunk]
            kv_pages[page, :rows, 1::2] = v[chunk]
        keys.append(k)
        values.append(v)

    cu = np.full(max_seqs + 1, n, np.int32)  # padding sequences claim the padding rows
    cu[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    padded_kv_lens = np.concatenate([kv_lens, rng.integers(1, max_kv, max_seqs - num_seqs)])
    arrays = dict(
        q=jnp.asarray(rng.standard_normal((n, hq, d)), jnp.float32),
        kv_pages=jnp.asarray(kv_pages),
        kv_lens=jnp.asarray(padded_kv_lens, jnp.int32),
        page_indices=jnp.asarray(page_indices, jnp.int32),
        cu_q_lens=jnp.asarray(cu, jnp.int32),
        num_seqs=jnp.asarray([num_seqs], jnp.int32),
    )
    return arrays, keys, values


def args_of(arrays):
    return tuple(arrays[k] for k in ("q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"))


def reference(arrays, keys, values, sm_scale, sliding_window=None):
    """Dense float64 attention of each sequence's new tokens over its contiguous K/V; padding rows 0."""
    q = np.asarray(arrays["q"], np.float64)
    cu = np.asarray(arrays["cu_q_lens"])
    out = np.zeros_like(q)
    for i, (k, v) in enumerate(zip(keys, values)):
        qi = q[cu[i] : cu[i + 1]]
        group = qi.shape[1] // k.shape[1]
        k = np.repeat(k.astype(np.float64), group, axis=1)
        v = np.repeat(v.astype(np.float64), group, axis=1)
        pos = len(k) - len(qi) + np.arange(len(qi))
        visible = np.arange(len(k))[None, :] <= pos[:, None]
        if sliding_window is not None:
            visible &= np.arange(len(k))[None, :] > pos[:, None] - sliding_window
        s = np.where(visible[None], np.einsum("qhd,khd->hqk", qi, k) * sm_scale, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[cu[i] : cu[i + 1]] = np.einsum("hqk,khd->qhd", p, v)
    return out


def assert_matches(out, arrays, keys, values, sm_scale, sliding_window=None):
    out = np.asarray(out)
    assert out.shape == arrays["q"].shape and out.dtype == np.float32
    assert np.isfinite(out).all()
    want = reference(arrays, keys, values, sm_scale, sliding_window)
    np.testing.assert_allclose(out, want, atol=TOL, rtol=TOL)
    live = int(arrays["cu_q_lens"][int(arrays["num_seqs"][0])])
    assert not out[live:].any(), "padding rows must be exactly zero"
    assert np.abs(out[:live]).max() > 0.1  # a real answer, not zeros


# --- ragged_paged_attention (jnp path) vs the dense reference ---------------------------------


@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(case, page_size, sliding_window):
    q_lens, kv_lens = CASES[case]
    arrays, keys, values = build_batch(0, q_lens, kv_lens, page_size=page_size, hq=4, hkv=2)
    out = ragged_paged_attention(*args_of(arrays), sm_scale=0.5, sliding_window=sliding_window, impl="jnp")
    assert_matches(out, arrays, keys, values, 0.5, sliding_window)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (8, 2)])  # GQA ratios 1, 2, 4
def test_gqa_ratios(hq, hkv, page_size):
    arrays, keys, values = build_batch(1, *CASES["mixed"], page_size=page_size, hq=hq, hkv=hkv)
    out = ragged_paged_attention(*args_of(arrays), sm_scale=0.5, impl="jnp")
    assert_matches(out, arrays, keys, values, 0.5)


@pytest.mark.parametrize("static_loop", [False, True])
@pytest.mark.parametrize("pages_per_unit,units_per_iter,sliding_window", [(1, 1, None), (1, 3, 5), (2, 7, None), (3, 2, 1)])
def test_tiny_units_and_iterations(pages_per_unit, units_per_iter, sliding_window, static_loop):
    """Many units per item, split across iterations and sharing them: exercises the online-softmax merge.
    With a static trip count (the GPU's loop) the iterations past the batch's last unit must change nothing."""
    arrays, keys, values = build_batch(2, *CASES["mixed"], page_size=4, hq=4, hkv=2)
    out = attention._ragged_paged_attention_jnp(
        *args_of(arrays),
        sm_scale=0.5,
        sliding_window=sliding_window,
        pages_per_unit=pages_per_unit,
        units_per_iter=units_per_iter,
        static_loop=static_loop,
    )
    assert_matches(out, arrays, keys, values, 0.5, sliding_window)


@pytest.mark.parametrize("case", ["mixed", "decode"])
def test_a_static_loop_has_no_data_dependent_trip_count(case):
    """The static loop's program has no loop whose trip count is data: at these sizes no loop at all (one
    iteration covers every unit), and its output equals the dynamic loop's."""
    arrays, keys, values = build_batch(5, *CASES[case], page_size=4, hq=4, hkv=2)
    fn = functools.partial(attention._ragged_paged_attention_jnp, sm_scale=0.5, sliding_window=None)
    static = fn(*args_of(arrays), static_loop=True)
    np.testing.assert_allclose(static, fn(*args_of(arrays), static_loop=False), rtol=1e-5, atol=1e-5)
    assert_matches(static, arrays, keys, values, 0.5)
    assert "while" not in jax.jit(functools.partial(fn, static_loop=True)).lower(*args_of(arrays)).as_text()
    assert "while" in jax.jit(functools.partial(fn, static_loop=False)).lower(*args_of(arrays)).as_text()


def test_empty_batch_is_all_zeros():
    arrays, _, _ = build_batch(3, [1, 4], [3, 4], page_size=4, hq=4, hkv=2)
    arrays["num_seqs"] = jnp.asarray([0], jnp.int32)
    out = ragged_paged_attention(*args_of(arrays), sm_scale=0.5, impl="jnp")
    assert not np.asarray(out).any()


def test_output_dtype_follows_q():
    arrays, keys, values = build_batch(4, *CASES["mixed"], page_size=4, hq=4, hkv=2, nan_fill=False)
    want = reference(arrays, keys, values, 0.5)
    arrays["q"] = arrays["q"].astype(jnp.bfloat16)
    out = ragged_paged_attention(*args_of(arrays), sm_scale=0.5, impl="jnp")
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=5e-2)


def test_matches_jax_reference_implementation():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

    # Its reference runs eagerly, op by op, per sequence: keep the batch short (a chunk starting
    # mid-sequence and a decode).
    arrays, _, _ = build_batch(5, [20, 1], [45, 33], page_size=4, hq=8, hkv=2)
    args = args_of(arrays)
    ours = np.asarray(ragged_paged_attention(*args, sm_scale=0.3, sliding_window=6, impl="jnp"))
    theirs = np.asarray(ref_ragged_paged_attention(*args, sm_scale=0.3, sliding_window=6))
    live = int(arrays["cu_q_lens"][int(arrays["num_seqs"][0])])
    assert theirs.shape[0] == live  # it returns only the sequences' rows
    np.testing.assert_allclose(ours[:live], theirs, atol=TOL, rtol=TOL)


def test_jit_compiles_once_for_same_shapes():
    """Different batch compositions with the same shapes reuse one compilation."""
    traces = []

    @jax.jit
    def step(*args):
        traces.append(1)  # runs only while tracing
        return ragged_paged_attention(*args, sm_scale=0.5, impl="jnp")

    batches = [  # different compositions, same shapes
        ([1, 1, 1, 1], [1, 6, 17, 40]),
        ([20, 1, 9, 1, 5, 3, 1, 8], [45, 33, 9, 2, 12, 3, 60, 70]),  # every sequence slot used
        ([48], [48]),  # every token row used
        ([33, 2], [50, 3]),
    ]
    for q_lens, kv_lens in batches:
        arrays, keys, values = build_batch(6, q_lens, kv_lens, page_size=4, hq=4, hkv=2, max_kv=80)
        assert_matches(step(*args_of(arrays)), arrays, keys, values, 0.5)
    assert len(traces) == 1
    assert step._cache_size() == 1


# --- write_kv ---------------------------------------------------------------------------------


def test_write_kv_writes_exactly_the_given_slots():
    num_pages, page_size, hkv, d = 6, 4, 2, 3
    rng = np.random.default_rng(7)
    pages = jnp.full((num_pages, page_size, 2 * hkv, d), -7.0, jnp.float32)
    slots = np.array([5, -1, 0, 23, -3, 24, 13], np.int32)  # -1, -3 padding; 24 is past the cache
    k = jnp.asarray(rng.standard_normal((len(slots), hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((len(slots), hkv, d)), jnp.float32)

    for fn in (write_kv, jax.jit(write_kv)):
        out = np.asarray(fn(pages, k, v, jnp.asarray(slots))).reshape(num_pages * page_size, 2 * hkv, d)
        want = np.full_like(out, -7.0)
        for t, slot in enumerate(slots):
            if 0 <= slot < num_pages * page_size:
                want[slot, 0::2] = k[t]  # K of head h at 2h
                want[slot, 1::2] = v[t]  # V of head h at 2h + 1
        np.testing.assert_array_equal(out, want)


def test_write_kv_then_attend():
    """Fill a cache with write_kv (a cached prefix, then this step's tokens) and attend over it."""
    page_size, hq, hkv, d = 4, 4, 2, 8
    q_lens, kv_lens = CASES["mixed"]
    template, keys, values = build_batch(8, q_lens, kv_lens, page_size=page_size, hq=hq, hkv=hkv)
    page_indices = np.asarray(template["page_indices"])
    pages = jnp.zeros(template["kv_pages"].shape, jnp.float32)

    def slots_of(seq, positions):
        return page_indices[seq, positions // page_size] * page_size + positions % page_size

    # Earlier steps: every sequence's prefix.
    prefix = [(i, np.arange(kv - q)) for i, (q, kv) in enumerate(zip(q_lens, kv_lens)) if kv > q]
    slot_mapping = np.concatenate([slots_of(i, pos) for i, pos in prefix])
    k = np.concatenate([keys[i][pos] for i, pos in prefix])
    v = np.concatenate([values[i][pos] for i, pos in prefix])
    pages = write_kv(pages, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slot_mapping, jnp.int32))

    # This step: the new tokens in q order, padding rows (slot -1) carry junk that must not land.
    n = template["q"].shape[0]
    slot_mapping = np.full(n, -1, np.int32)
    k_new = np.full((n, hkv, d), 1e6, np.float32)
    v_new = np.full((n, hkv, d), 1e6, np.float32)
    cu = np.asarray(template["cu_q_lens"])
    for i, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        pos = np.arange(kv - q, kv)
        slot_mapping[cu[i] : cu[i + 1]] = slots_of(i, pos)
        k_new[cu[i] : cu[i + 1]] = keys[i][pos]
        v_new[cu[i] : cu[i + 1]] = values[i][pos]
    pages = write_kv(pages, jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(slot_mapping))

    arrays = dict(template, kv_pages=pages)
    out = ragged_paged_attention(*args_of(arrays), sm_scale=0.5, impl="jnp")
    assert_matches(out, arrays, keys, values, 0.5)


# --- implementation choice and the Pallas path -----------------------------------------------


def test_attention_impl_choice(monkeypatch):
    monkeypatch.delenv("MORAY_ATTENTION_IMPL", raising=False)
    assert attention_impl() == ("pallas" if jax.default_backend() == "tpu" else "jnp")
    monkeypatch.setenv("MORAY_ATTENTION_IMPL", "pallas")
    assert attention_impl() == "pallas"
    monkeypatch.setenv("MORAY_ATTENTION_IMPL", "JNP")
    assert attention_impl() == "jnp"
    monkeypatch.setenv("MORAY_ATTENTION_IMPL", "cuda")
    with pytest.raises(ValueError, match="MORAY_ATTENTION_IMPL"):
        attention_impl()


def test_default_impl_is_used(monkeypatch):
    monkeypatch.setenv("MORAY_ATTENTION_IMPL", "jnp")
    arrays, keys, values = build_batch(9, *CASES["decode"], page_size=4, hq=4, hkv=2)
    assert_matches(ragged_paged_attention(*args_of(arrays), sm_scale=0.5), arrays, keys, values, 0.5)
    with pytest.raises(ValueError, match="impl"):
        ragged_paged_attention(*args_of(arrays), sm_scale=0.5, impl="triton")


# jax 0.12.0.1's TPU interpreter cannot run this kernel: the kernel reshapes the VMEM ref returned by
# its DMA wait (`cur_async_copy_kv.wait().reshape(...)`) and the interpreter's ref-transform code
# (jax/_src/pallas/mosaic/interpret/utils.py, to_range) fails on it with
# "AttributeError: 'ReshapeTransform' object has no attribute 'indices'".
_INTERPRETER_GAP = "'ReshapeTransform' object has no attribute 'indices'"


def test_pallas_kernel_matches_jnp():
    """The Pallas path (JAX's TPU kernel) against the jnp path; on CPU via TPU interpret mode."""
    from jax.experimental.pallas import tpu as pltpu

    arrays, keys, values = build_batch(10, [5, 1, 20], [9, 30, 20], page_size=16, hq=4, hkv=2, d=128, nan_fill=False)
    run = functools.partial(ragged_paged_attention, *args_of(arrays), sm_scale=0.1, sliding_window=12)
    expected = np.asarray(run(impl="jnp"))
    if jax.default_backend() == "tpu":
        got = run(impl="pallas")
    else:
        try:
            with pltpu.force_tpu_interpret_mode():
                got = run(impl="pallas")
        except Exception as e:  # noqa: BLE001 - only the known interpreter gap is a skip
            if _INTERPRETER_GAP in str(e):
                pytest.skip(f"JAX {jax.__version__} TPU interpret mode cannot run this kernel: {_INTERPRETER_GAP}")
            raise
    np.testing.assert_allclose(np.asarray(got), expected, atol=TOL, rtol=TOL)
    assert_matches(got, arrays, keys, values, 0.1, 12)
