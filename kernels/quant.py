"""Quantised weights and the matmuls that read them without ever holding a dense copy in device memory.

A `QuantizedWeight` keeps a linear layer's (or a stack of experts') weights in the checkpoint's own
compressed layout, so the bytes in HBM are the bytes on disk:

    kind    values                                        scale [..., N, K / group_size]
    int4    int32 [..., N, K / 8]: eight 4-bit values per  float (compute dtype)
            word, element j in word j // 8 at bits 4 * (j % 8), stored as q + 8 (compressed-tensors
            `pack-quantized`); w = (nibble - 8) * scale
    fp8     float8_e4m3fn [..., N, K]                     float; channel: group_size = K; 2-D blocks
                                                          are expanded to one row per output at load
    mxfp8   float8_e4m3fn [..., N, K]                     uint8 E8M0 exponents, 2^(e - 127), group 32

Every scale covers `group_size` consecutive inputs of one output row, which gives all kinds one
dequantisation rule: values * scale repeated along K. Two consumers apply it:

- `quantized_matmul` (and the routed-expert loops in `kernels.moe`): the portable XLA path dequantises
  per group right before the dot, inside the jitted step (the expert loops one expert or tile at a
  time); nothing dequantised outlives the matmul.
- `grouped_matmul`: a Pallas TPU kernel over row tiles, each tile multiplied by one group's (expert's)
  weights; it DMAs packed weight blocks into VMEM and dequantises each [tn, tk] block there just before
  the MXU consumes it. Dense layers use it with a single group. Off TPU it runs in interpret mode.

`select_impl` is the one rule choosing between them, and `shard_group_size` the rule for layers whose
input dimension is sharded. Activations are float by default (weight-only compute: no fp8 MXU before
TPU v7, and it keeps logits equal to the dequantised model's); `fake_quantize_activations` emulates a
checkpoint's dynamic fp8 activation quantisation when a weight carries an `ActivationQuant`.

This module imports nothing else from Moray.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

KINDS = ("int4", "fp8", "mxfp8")
INT4_PER_WORD = 8  # 4-bit values packed into one int32 word
FP8_MAX = 448.0  # largest finite float8_e4m3fn
E8M0_BIAS = 127
MX_ELEM_EXPONENT = 8  # floor(log2(FP8_MAX)): the MX scale maps a group's max into e4m3's range

IMPLS = ("xla", "pallas")
IMPL_ENV_VAR = "MORAY_QUANT_IMPL"

# Pallas tiling: 128 rows fill the MXU; 512-wide output and contraction blocks keep the double-buffered
# VMEM footprint (lhs, packed weights, dequantised block, f32 accumulator) around 1-2 MiB. Untuned.
PALLAS_TM, PALLAS_TN, PALLAS_TK = 128, 512, 512
# Lane alignment of the K block on TPU: the packed int4 block is [tn, tk / 8] int32, so tk / 8 must fill
# 128 lanes; fp8 blocks are [tn, tk]. (Interpret mode does not care; tests pass explicit tiles.)
_K_ALIGN = {"int4": 128 * INT4_PER_WORD, "fp8": 128, "mxfp8": 128}

Array = jax.Array


@dataclass(frozen=True)
class ActivationQuant:
    """A checkpoint's dynamic activation quantisation (fp8 e4m3): per token, per tensor, or per group of
    `group_size` inputs; `e8m0` rounds scales to powers of two (MX)."""

    strategy: str  # "token" | "tensor" | "group"
    group_size: int = 0
    e8m0: bool = False


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    values: Array  # see the module docstring for each kind's layout
    scale: Array  # [..., N, K // group_size]
    kind: str = field(metadata=dict(static=True))
    group_size: int = field(metadata=dict(static=True))
    # When set, consumers quantise-dequantise their input like the checkpoint's runtime would.
    activations: ActivationQuant | None = field(default=None, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dense) shape [..., N, K]."""
        return (*self.scale.shape[:-1], self.scale.shape[-1] * self.group_size)

    @property
    def ndim(self) -> int:
        return self.scale.ndim

    def __getitem__(self, index) -> "QuantizedWeight":
        """Indexes leading (expert) dimensions only, e.g. `gate_up[expert]`."""
        return QuantizedWeight(self.values[index], self.scale[index], self.kind, self.group_size, self.activations)


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


# ---------------------------------------------------------------------------------------------
# Dequantisation: the rule both paths share.


def e8m0_to_float(exponents: Array) -> Array:
    """uint8 E8M0 exponents -> float32 2^(e - 127), exactly (built from the float32 exponent bits)."""
    e = exponents.astype(jnp.uint32)
    value = jax.lax.bitcast_convert_type(e << 23, jnp.float32)
    return jnp.where(e == 0, jnp.float32(2.0**-E8M0_BIAS), value)  # e = 0 is 2^-127, a float32 subnormal


def unpack_int4(words: Array) -> Array:
    """int32 [..., K / 8] -> int32 [..., K] in [-8, 7]; element j sits at bits 4 * (j % 8) of word j // 8."""
    shifts = jnp.arange(INT4_PER_WORD, dtype=jnp.int32) * 4
    nibbles = (words[..., None] >> shifts) & 0xF  # the arithmetic shift's sign bits are masked off
    return nibbles.reshape(*words.shape[:-1], -1) - 8


def _dequantize_arrays(values: Array, scale: Array, kind: str, group_size: int, dtype) -> Array:
    """values/scale of one block or a whole weight -> dense [..., N, K] in `dtype`."""
    q = unpack_int4(values) if kind == "int4" else values
    s = e8m0_to_float(scale) if kind == "mxfp8" else scale
    q, s = q.astype(dtype), s.astype(dtype)
    grouped = q.reshape(*q.shape[:-1], s.shape[-1], group_size) * s[..., None]
    return grouped.reshape(q.shape)


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> Array:
    """The dense weights a quantised weight stands for (for references, tests and dense-only paths)."""
    return _dequantize_arrays(w.values, w.scale, w.kind, w.group_size, dtype)


def as_dense(w, dtype) -> Array:
    """`w` itself when dense; otherwise its dequantised form (paths that need a dense operand)."""
    return dequantize(w, dtype) if is_quantized(w) else w


# ---------------------------------------------------------------------------------------------
# Dynamic activation quantisation (emulated: quantise to e4m3 and straight back).


def _round_to_power_of_two(x: Array) -> Array:
    """compressed-tensors' MX rounding: up to the next power of two when the mantissa is >= 1.75."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    bits = (bits + (1 << 21)) & jnp.int32(-(1 << 23))  # keep sign and exponent after the carry
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _divide(a: Array, b) -> Array:
    """a / b correctly rounded. XLA rewrites division by a broadcast into multiplication by its
    reciprocal (1 ulp off), which would make emulated scales and codes differ from the library's."""
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape))


def fake_quantize_activations(x: Array, spec: ActivationQuant) -> Array:
    """x with each token/tensor/group quantised to fp8 e4m3 by its absolute maximum, then dequantised."""
    xf = x.astype(jnp.float32)
    if spec.strategy == "group":
        xf = xf.reshape(*x.shape[:-1], x.shape[-1] // spec.group_size, spec.group_size)
    axes = None if spec.strategy == "tensor" else -1
    amax = jnp.max(jnp.abs(xf), axis=axes, keepdims=True)
    if spec.e8m0:
        biased = jnp.floor(jnp.log2(_round_to_power_of_two(amax))) + (E8M0_BIAS - MX_ELEM_EXPONENT)
        scale = e8m0_to_float(jnp.clip(biased, 0, 255).astype(jnp.uint8))  # exact powers of two
    else:
        scale = _divide(amax, FP8_MAX)
        scale = jnp.where(scale == 0, jnp.finfo(x.dtype).eps, scale)
    q = jnp.clip(_divide(xf, scale), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return (q * scale).reshape(x.shape).astype(x.dtype)


def _maybe_quantize_input(x: Array, w: QuantizedWeight) -> Array:
    return x if w.activations is None else fake_quantize_activations(x, w.activations)


# ---------------------------------------------------------------------------------------------
# The selection rule.


def tpu_generation(device_kind: str) -> int | None:
    """5 for "TPU v5 lite", 6 for "TPU v6 lite", 7 for "TPU7x"; None when the kind names no generation."""
    m = re.search(r"v(\d+)", device_kind, re.IGNORECASE) or re.search(r"TPU\s*(\d+)", device_kind)
    return int(m.group(1)) if m else None


def mxu_width(device_kind: str) -> int:
    """MXU columns: 128 (128x128 MXUs) before v6e, 256 from v6e (Trillium) on; unknown kinds count as new."""
    gen = tpu_generation(device_kind)
    return 128 if gen is not None and gen < 6 else 256


def select_impl(group_size: int, backend: str | None = None, device_kind: str | None = None) -> str:
    """ "pallas" or "xla" for a quantised matmul whose scales cover `group_size` inputs.

    Off TPU: always XLA (the kernel would run interpreted). On TPU: a group narrower than the MXU
    column width cannot feed the MXU a full-width contraction per scale, so XLA's
    dequantise-per-group-then-dot loses to the kernel that dequantises [tn, tk] blocks in VMEM and
    contracts them at full width; groups at least as wide as the MXU (and channel scales) go to XLA,
    which fuses the scale multiply into the dot and compiles ~3x faster. `MORAY_QUANT_IMPL` overrides.
    """
    forced = os.environ.get(IMPL_ENV_VAR)
    if forced:
        if forced not in IMPLS:
            raise ValueError(f"{IMPL_ENV_VAR}={forced!r}; expected one of {IMPLS}")
        return forced
    backend = backend or jax.default_backend()
    if backend != "tpu":
        return "xla"
    device_kind = device_kind or jax.devices()[0].device_kind
    return "pallas" if group_size < mxu_width(device_kind) else "xla"


def shard_group_size(group_size: int, in_dim: int, shards: int, values_per_word: int = 1) -> int:
    """The group size to store scales at so each of `shards` equal input slices holds whole groups.

    A slice of s = in_dim / shards inputs holds whole groups of gcd(group_size, s): each original scale is
    repeated group_size / gcd times (scales stay tiny next to the weights), so dequantisation never needs
    another shard's scales. The same gcd also splits a partial last group (in_dim % group_size != 0, as
    2-D block scales leave) into whole ones. Raises ValueError when the inputs cannot be split evenly or a
    slice would cut a packed int4 word.
    """
    if in_dim % shards:
        raise ValueError(f"input dimension {in_dim} does not split evenly over {shards} shards")
    per_shard = in_dim // shards
    if per_shard % values_per_word:
        raise ValueError(f"{shards} shards of {per_shard} inputs would split packed words of {values_per_word} values")
    return math.gcd(group_size, per_shard)


# ---------------------------------------------------------------------------------------------
# Matmuls.


def quantized_matmul(x: Array, w, impl: str | None = None) -> Array:
    """x [..., K] times w [N, K] transposed -> float32 [..., N]; w dense or a `QuantizedWeight`."""
    if not is_quantized(w):
        return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32)
    x = _maybe_quantize_input(x, w)
    impl = impl or select_impl(w.group_size)
    if impl == "pallas":
        return _matmul_pallas(x, w)
    if impl != "xla":
        raise ValueError(f"unknown quantised matmul impl {impl!r}; expected one of {IMPLS}")
    return jnp.einsum("...k,nk->...n", x, dequantize(w, x.dtype), preferred_element_type=jnp.float32)


def _matmul_pallas(x: Array, w: QuantizedWeight, interpret: bool | None = None) -> Array:
    """A dense layer through the grouped kernel: one group, rows padded to whole tiles."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    tm = min(PALLAS_TM, -(-m // 8) * 8)
    tiles = -(-m // tm)
    rows = jnp.pad(rows, ((0, tiles * tm - m), (0, 0)))
    one_group = QuantizedWeight(w.values[None], w.scale[None], w.kind, w.group_size)
    out = grouped_matmul(rows, one_group, jnp.zeros((tiles,), jnp.int32), jnp.array([tiles], jnp.int32), tm=tm, interpret=interpret)
    return out[:m].reshape(*lead, -1)


def _pick_tile(dim: int, preferred: int, multiple_of: int) -> int:
    """The largest t <= preferred that divides dim and is a multiple of `multiple_of`; dim when none is."""
    t = (min(preferred, dim) // multiple_of) * multiple_of
    while t >= multiple_of:
        if dim % t == 0:
            return t
        t -= multiple_of
    return dim


def pallas_tiles(w: QuantizedWeight) -> tuple[int, int]:
    """(tn, tk) for `grouped_matmul`: tk holds whole scale groups (or lies inside one) and whole packed
    words, lane-aligned on TPU; falls back to the full dimension, which is always a legal block."""
    n, k = w.shape[-2:]
    align = _K_ALIGN[w.kind]
    g = w.group_size
    tk = _pick_tile(k, PALLAS_TK, math.lcm(align, g)) if g <= PALLAS_TK else _pick_tile(g, PALLAS_TK, align)
    return _pick_tile(n, PALLAS_TN, 128), tk


def grouped_matmul(
    lhs: Array,  # [num_tiles * tm, K], row tile i belongs to group tile_group[i]
    w: QuantizedWeight,  # [G, N, K]
    tile_group: Array,  # i32[num_tiles]
    used_tiles: Array,  # i32[1]: tiles at or past this index hold only padding and are skipped
    *,
    tm: int,
    tiles: tuple[int, int] | None = None,  # (tn, tk); `pallas_tiles(w)` when None
    interpret: bool | None = None,
) -> Array:
    """float32 [num_tiles * tm, N]: each row tile times its group's weights transposed, dequantised in VMEM.

    Grid (row tile, N block, K block), K innermost and accumulated in a float32 VMEM scratch. The packed
    weight block of the tile's group is chosen by a scalar-prefetched index map, so only the experts a
    batch routes to are read from HBM; their scales come in as a whole [tn, K / group] row block (a legal
    TPU block for any group count) and the kernel slices the columns of the current K block.
    """
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    lhs = _maybe_quantize_input(lhs, w)
    n, k = w.shape[-2:]
    tn, tk = tiles or pallas_tiles(w)
    if n % tn or k % tk or lhs.shape[0] % tm:
        raise ValueError(f"tiles (tm={tm}, tn={tn}, tk={tk}) do not divide [{lhs.shape[0]}, {n}, {k}]")
    g = w.group_size
    if tk % g and g % tk:
        raise ValueError(f"K tile {tk} neither holds whole groups of {g} nor lies inside one")
    packed_tk = tk // INT4_PER_WORD if w.kind == "int4" else tk
    scale_cols = tk // g if tk >= g else 1  # scale columns one K block needs
    block_group = min(g, tk)  # inputs per scale within a block
    num_scale_cols = w.scale.shape[-1]
    dtype = lhs.dtype

    def kernel(tile_group_ref, used_ref, x_ref, values_ref, scale_ref, out_ref, acc_ref):
        i, kk = pl.program_id(0), pl.program_id(2)

        @pl.when(kk == 0)
        def _init():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(i < used_ref[0])
        def _accumulate():
            start = kk * scale_cols if tk >= g else (kk * tk) // g
            scale = scale_ref[:, pl.ds(start, scale_cols)]
            block = _dequantize_arrays(values_ref[...], scale, w.kind, block_group, dtype)  # [tn, tk]
            acc_ref[...] += jax.lax.dot_general(x_ref[...], block, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        @pl.when(kk == pl.num_programs(2) - 1)
        def _store():
            out_ref[...] = acc_ref[...]

    num_tiles = lhs.shape[0] // tm
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((lhs.shape[0], n), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_tiles, n // tn, k // tk),
            in_specs=[
                pl.BlockSpec((tm, tk), lambda i, j, kk, grp, used: (i, kk)),
                pl.BlockSpec((None, tn, packed_tk), lambda i, j, kk, grp, used: (grp[i], j, kk)),
                pl.BlockSpec((None, tn, num_scale_cols), lambda i, j, kk, grp, used: (grp[i], j, 0)),
            ],
            out_specs=pl.BlockSpec((tm, tn), lambda i, j, kk, grp, used: (i, j)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )
    return call(tile_group.astype(jnp.int32), used_tiles.astype(jnp.int32), lhs, w.values, w.scale)
