"""The collectives of `kernels.collectives` on 8 virtual CPU devices: every staged or column-split gather is
bitwise the flat one, staged reduce-scatters sum like the flat one, encodings round-trip, and the
ragged all-to-all fallback follows `jax.lax.ragged_all_to_all`'s documented semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kernels.collectives import (
    FP8_MAX,
    fp8_decode_rows,
    fp8_encode_rows,
    gather_rows,
    gather_rows_split_columns,
    gather_rows_staged,
    pack_routing,
    ragged_all_to_all,
    reduce_scatter_rows,
    reduce_scatter_rows_staged,
    unpack_routing,
)
from workers.parallel import make_mesh

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1), (2, 2, 2)]


def per_device(mesh, fn, *arrays):
    """Runs fn on each device's row block of `arrays`; returns every device's result stacked: [D, ...]."""
    rows = P(tuple(mesh.axis_names))
    wrapped = lambda *xs: fn(*xs)[None]
    return np.asarray(jax.jit(jax.shard_map(wrapped, mesh=mesh, in_specs=rows, out_specs=rows))(*arrays))


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_staged_and_split_gathers_are_bitwise_the_flat_gather(shape):
    mesh = make_mesh(shape)
    axes = tuple(mesh.axis_names)
    hidden = 512
    x = jax.random.normal(jax.random.key(0), (8 * 3, hidden))  # 3 rows per device
    flat = per_device(mesh, lambda a: gather_rows(a, axes), x)
    assert flat.shape == (8, 24, hidden)
    np.testing.assert_array_equal(flat[0], np.asarray(x))  # device order == row order
    np.testing.assert_array_equal(per_device(mesh, lambda a: gather_rows_staged(a, axes), x), flat)
    for split in range(1, len(axes)):  # every choice of fast domain: the innermost `split` axes
        slow, fast = axes[:-split], axes[-split:]
        k = int(np.prod([mesh.shape[a] for a in fast]))

        def split_gather(a):
            return gather_rows_split_columns(a.reshape(a.shape[0], k, -1), slow, fast).reshape(-1, hidden)

        np.testing.assert_array_equal(per_device(mesh, split_gather, x), flat)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_staged_reduce_scatter_matches_the_flat_one_and_the_sum(shape):
    mesh = make_mesh(shape)
    axes = tuple(mesh.axis_names)
    partials = jax.random.normal(jax.random.key(1), (8, 8 * 2, 16))  # device d's partial sums for all rows
    flat = per_device(mesh, lambda a: reduce_scatter_rows(a[0], axes), partials)
    staged = per_device(mesh, lambda a: reduce_scatter_rows_staged(a[0], axes), partials)
    expected = np.asarray(partials, np.float64).sum(0).reshape(8, 2, 16)
    np.testing.assert_allclose(flat, expected, atol=1e-5)
    np.testing.assert_allclose(staged, flat, atol=1e-5)


def test_routing_pack_roundtrips_exactly():
    ids = jnp.array([[3, 15], [0, 7]], jnp.int32)
    weights = jnp.array([[0.75, 0.25], [1e-30, -0.0]], jnp.float32)
    packed = pack_routing(ids, weights)
    assert packed.dtype == jnp.int32 and packed.shape == (2, 4)
    got_ids, got_weights = unpack_routing(packed)
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_array_equal(np.asarray(got_weights).view(np.int32), np.asarray(weights).view(np.int32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8"])
def test_words_ride_along_rows_of_any_width_bit_for_bit(dtype):
    """`append_words` / `split_words`: int32 words as extra columns of 4-, 2- and 1-byte rows (the MoE's
    rows with their routing, fp8 payloads), NaN bit patterns and negative words included."""
    from kernels.collectives import append_words, split_words

    rows = jax.random.normal(jax.random.key(0), (3, 5)).astype(dtype)
    words = jnp.array([[0, -1], [0x7FC00001, -(2**31)], [123456789, 7]], jnp.int32)
    packed = append_words(rows, words)
    assert packed.dtype == rows.dtype and packed.shape == (3, 5 + 2 * 4 // jnp.dtype(dtype).itemsize)
    got_rows, got_words = split_words(packed, 5)
    np.testing.assert_array_equal(np.asarray(got_rows), np.asarray(rows))
    np.testing.assert_array_equal(np.asarray(got_words), np.asarray(words))


def test_fp8_rows_carry_their_scale_and_pieces_decode_alike():
    x = jax.random.normal(jax.random.key(2), (6, 256)) * jnp.array([1e-3, 1, 10, 100, 0, 5])[:, None]
    payload = fp8_encode_rows(x)
    assert payload.dtype == jnp.uint8 and payload.shape == (6, 1, 256 + 4)
    y = np.asarray(fp8_decode_rows(payload, jnp.float32))
    row_max = np.abs(np.asarray(x)).max(1, keepdims=True)
    # e4m3 keeps 3 mantissa bits: relative rounding <= 2^-4 of each value, and tiny values within
    # the smallest subnormal step of the row's scale.
    bound = np.abs(np.asarray(x)) * 2.0**-4 + row_max / FP8_MAX * 2.0**-9
    assert (np.abs(y - np.asarray(x)) <= bound + 1e-30).all()
    assert (y[4] == 0).all()  # an all-zero row survives
    pieces = fp8_encode_rows(x, 4)
    assert pieces.shape == (6, 4, 64 + 4)
    np.testing.assert_array_equal(np.asarray(fp8_decode_rows(pieces, jnp.float32)), y)


def test_ragged_all_to_all_fallback_follows_the_documented_example():
    """The two-device example of `jax.lax.ragged_all_to_all`'s docstring, on XLA:CPU's fallback."""
    mesh = make_mesh((1, 2), jax.devices()[:2])
    operand = jnp.array([[1, 2, 2], [3, 4, 0]], jnp.float32)
    output = jnp.zeros((2, 4), jnp.float32)
    input_offsets = jnp.array([[0, 1], [0, 1]], jnp.int32)
    send_sizes = jnp.array([[1, 2], [1, 1]], jnp.int32)
    output_offsets = jnp.array([[0, 0], [1, 2]], jnp.int32)
    recv_sizes = jnp.array([[1, 1], [2, 1]], jnp.int32)

    def body(*args):
        args = [a[0] for a in args]
        return ragged_all_to_all(*args, axes=("chip",))[None]

    spec = P("chip")
    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes
    )
    np.testing.assert_array_equal(np.asarray(got), [[1, 3, 0, 0], [2, 2, 4, 0]])
