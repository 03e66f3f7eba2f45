"""Quantised weights in kernels/quant.py: packing round trips, dequantisation against compressed-tensors,
the XLA and Pallas (interpret mode) matmuls, quantised routed experts, and the layout rules."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

from kernels import moe
from kernels.quant import (
    ActivationQuant,
    QuantizedWeight,
    dequantize,
    e8m0_to_float,
    fake_quantize_activations,
    grouped_matmul,
    mxu_width,
    quantized_matmul,
    select_impl,
    shard_group_size,
    unpack_int4,
)
from workers.models import quantize as q


def rand(shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def quantized(w: np.ndarray, kind: str, group: int | None = None) -> QuantizedWeight:
    """A QuantizedWeight from dense [..., N, K] weights via the numpy quantisers of `moray quantize`."""
    lead, (n, k) = w.shape[:-2], w.shape[-2:]
    parts = [
        q.quantize_int4(m, group) if kind == "int4" else q.quantize_fp8_channel(m) if kind == "fp8" else q.quantize_mxfp8(m)
        for m in w.reshape(-1, n, k)
    ]
    values = np.stack([p["weight_packed" if kind == "int4" else "weight"] for p in parts]).reshape(*lead, n, -1)
    scale = np.stack([p["weight_scale"] for p in parts]).reshape(*lead, n, -1)
    group_size = k // scale.shape[-1]
    return QuantizedWeight(jnp.asarray(values), jnp.asarray(scale), kind, group_size)


def to_torch(a) -> torch.Tensor:
    a = np.array(a)  # a writable copy
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(a)


CASES = [("int4", 32), ("int4", None), ("fp8", None), ("mxfp8", None)]  # (kind, int4 group; None = channel)


# ---------------------------------------------------------------------------------------------
# Packing and dequantisation round trips.


def test_int4_pack_unpack_round_trip_and_library_layout():
    values = np.random.default_rng(0).integers(-8, 8, (6, 64), dtype=np.int8)
    packed = q.pack_int4(values)
    assert packed.dtype == np.int32 and packed.shape == (6, 8)
    np.testing.assert_array_equal(q.unpack_int4(packed), values)
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed))), values)
    # Bit for bit what compressed-tensors packs, and it unpacks ours.
    np.testing.assert_array_equal(pack_to_int32(torch.from_numpy(values), 4).numpy(), packed)
    unpacked = unpack_from_int32(torch.from_numpy(packed), 4, torch.Size(values.shape)).numpy()
    np.testing.assert_array_equal(unpacked, values)
    # Element j sits at bits 4 * (j % 8) of word j // 8, stored as q + 8.
    first = values[0, :8].astype(np.int64) + 8
    assert packed[0, 0].view(np.uint32) == sum(int(v) << (4 * j) for j, v in enumerate(first))


def test_e8m0_exponents_decode_exactly():
    e = np.array([0, 1, 100, 126, 127, 128, 200, 254], np.uint8)
    got = np.asarray(e8m0_to_float(jnp.asarray(e)))
    np.testing.assert_array_equal(got, np.ldexp(np.float64(1), e.astype(np.int64) - 127).astype(np.float32))


@pytest.mark.parametrize("kind,group", CASES)
def test_quantise_dequantise_round_trip(kind, group):
    w = rand((16, 64), scale=0.05)
    qw = quantized(w, kind, group)
    got = np.asarray(dequantize(qw))
    if kind == "int4":  # within half a step of the group's scale
        step = np.repeat(np.asarray(qw.scale), qw.group_size, axis=-1)
        assert np.all(np.abs(got - w) <= step / 2 + 1e-7)
    else:  # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 away from the subnormal range
        big = np.abs(w) > 1e-3
        assert np.all(np.abs(got - w)[big] <= np.abs(w)[big] * 2**-4 + 1e-9)
    if kind == "int4":  # the codes survive a round trip through the packed words
        codes = np.round(got / np.repeat(np.asarray(qw.scale), qw.group_size, axis=-1))
        np.testing.assert_array_equal(q.unpack_int4(np.asarray(qw.values)), codes)
    else:  # fp8: the largest value maps to the format's maximum, so requantising reproduces the grid
        np.testing.assert_array_equal(np.asarray(dequantize(quantized(got, kind, group))), got)


@pytest.mark.parametrize("kind,group", CASES)
def test_dequantise_matches_compressed_tensors(kind, group):
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    w = rand((16, 64), seed=3, scale=0.05)
    qw = quantized(w, kind, group)
    preset = {"int4": "W4A16", "fp8": "FP8_DYNAMIC", "mxfp8": "MXFP8"}[kind]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if kind == "int4":
        scheme.weights.strategy, scheme.weights.group_size = ("group", group) if group else ("channel", None)
        state = {"weight_packed": qw.values, "weight_scale": qw.scale, "weight_shape": np.array(w.shape)}
        compressor = PackedQuantizationCompressor
    else:
        state = {"weight": qw.values, "weight_scale": qw.scale}
        compressor = MXFP8QuantizationCompressor if kind == "mxfp8" else FloatQuantizationCompressor
    want = compressor.decompress({k: to_torch(v) for k, v in state.items()}, scheme)["weight"].float().numpy()
    np.testing.assert_array_equal(np.asarray(dequantize(qw)), want)


# ---------------------------------------------------------------------------------------------
# Matmuls.


@pytest.mark.parametrize("kind,group", CASES)
def test_xla_and_pallas_matmul_match_dequantised_dot(kind, group):
    w = rand((32, 64), seed=1, scale=0.1)
    qw = quantized(w, kind, group)
    x = jnp.asarray(rand((3, 5, 64), seed=2))
    want = np.einsum("btk,nk->btn", np.asarray(x), np.asarray(dequantize(qw)))
    for impl in ("xla", "pallas"):
        got = jax.jit(functools.partial(quantized_matmul, impl=impl))(x, qw)
        assert got.shape == (3, 5, 32) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kind,group,tiles",
    [
        ("int4", 16, (16, 32)),  # two groups per K block, two K blocks
        ("int4", None, (16, 32)),  # channel scale: K blocks inside one group
        ("fp8", None, (32, 16)),
        ("mxfp8", None, (16, 32)),  # one E8M0 group per K block
    ],
)
def test_grouped_kernel_tiles_groups_and_skips_unused_tiles(kind, group, tiles):
    num_groups, n, k, tm = 3, 32, 64, 8
    w = rand((num_groups, n, k), seed=4, scale=0.1)
    qw = quantized(w, kind, group)
    dense = np.asarray(dequantize(qw))
    tile_group = np.array([2, 0, 0, 1, 2], np.int32)
    used = 4  # the last tile is padding and must come back zero
    lhs = rand((len(tile_group) * tm, k), seed=5)
    call = jax.jit(functools.partial(grouped_matmul, tm=tm, tiles=tiles, interpret=True))
    got = np.asarray(call(jnp.asarray(lhs), qw, jnp.asarray(tile_group), jnp.array([used], jnp.int32)))
    for i, g in enumerate(tile_group):
        rows = slice(i * tm, (i + 1) * tm)
        want = lhs[rows] @ dense[g].T if i < used else np.zeros((tm, n), np.float32)
        np.testing.assert_allclose(got[rows], want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Routed experts over packed expert stacks.


@functools.partial(jax.jit, static_argnames="impl")
def _routed(x, ids, weights, gate_up, down, impl):
    return moe.routed_experts(x, ids, weights, gate_up, down, impl=impl)


@pytest.mark.parametrize("kind,group", [("int4", 16), ("fp8", None), ("mxfp8", None)])
def test_routed_experts_accept_quantised_experts(kind, group):
    experts, hidden, inter, tokens, top_k = 4, 32, 32, 9, 2
    gate_up = quantized(rand((experts, 2 * inter, hidden), seed=6, scale=0.2), kind, group)
    down = quantized(rand((experts, hidden, inter), seed=7, scale=0.2), kind, group)
    x = jnp.asarray(rand((tokens, hidden), seed=8))
    rng = np.random.default_rng(9)
    ids = jnp.asarray(np.argsort(rng.random((tokens, experts)), axis=-1)[:, :top_k].astype(np.int32))
    weights = jnp.asarray(rng.random((tokens, top_k)).astype(np.float32))
    want = _routed(x, ids, weights, dequantize(gate_up), dequantize(down), impl="gather")
    for impl in (i for i in moe.IMPLS if i != "cpu"):  # the CPU kernel takes dense float32 experts only
        got = _routed(x, ids, weights, gate_up, down, impl=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=impl)


# ---------------------------------------------------------------------------------------------
# Activation emulation against compressed-tensors' own dynamic quantisation.


@pytest.mark.parametrize(
    "spec,args",
    [
        (ActivationQuant("token"), dict(strategy="token")),
        (ActivationQuant("group", 16), dict(strategy="group", group_size=16)),
        (ActivationQuant("group", 32, e8m0=True), dict(strategy="group", group_size=32, scale_dtype=torch.uint8)),
    ],
)
def test_activation_fake_quant_matches_library(spec, args):
    x = rand((2, 3, 64), seed=10, scale=3.0)
    x[0, 0, :16] = 0.0  # an all-zero token/group takes the library's eps/zero-exponent path
    qargs = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=True, **args)
    tx = torch.from_numpy(x)
    scale, zp = compute_dynamic_scales_and_zp(value=tx, args=qargs, module=None)
    want = fake_quantize(tx, scale, None, qargs).numpy()
    got = np.asarray(fake_quantize_activations(jnp.asarray(x), spec))
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# Rules.


def test_selection_rule_group_size_against_mxu_width(monkeypatch):
    monkeypatch.delenv("MORAY_QUANT_IMPL", raising=False)
    assert mxu_width("TPU v4") == mxu_width("TPU v5 lite") == mxu_width("TPU v5p") == 128
    assert mxu_width("TPU v6 lite") == mxu_width("TPU7x") == 256
    assert select_impl(32, backend="cpu") == "xla"  # off TPU the kernel would only be interpreted
    assert select_impl(64, backend="tpu", device_kind="TPU v5 lite") == "pallas"
    assert select_impl(128, backend="tpu", device_kind="TPU v5 lite") == "xla"
    assert select_impl(128, backend="tpu", device_kind="TPU v6 lite") == "pallas"
    assert select_impl(256, backend="tpu", device_kind="TPU v6 lite") == "xla"
    monkeypatch.setenv("MORAY_QUANT_IMPL", "pallas")
    assert select_impl(4096, backend="cpu") == "pallas"
    monkeypatch.setenv("MORAY_QUANT_IMPL", "bogus")
    with pytest.raises(ValueError, match="MORAY_QUANT_IMPL"):
        select_impl(128)


def test_shard_group_size_gcd_rule_and_errors():
    assert shard_group_size(128, 1024, 8, 8) == 128  # 128 inputs per shard: whole groups already
    assert shard_group_size(128, 1024, 16, 8) == 64  # 64 per shard: each scale repeated twice
    assert shard_group_size(1024, 1024, 4, 8) == 256  # channel scale split per shard
    assert shard_group_size(128, 192, 1) == 64  # a partial last block split into whole groups
    with pytest.raises(ValueError, match="does not split evenly over 3 shards"):
        shard_group_size(32, 64, 3)
    with pytest.raises(ValueError, match="would split packed words of 8 values"):
        shard_group_size(32, 64, 16, 8)
