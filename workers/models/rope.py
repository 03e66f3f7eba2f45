"""RoPE inverse frequencies and cos/sin scaling for every supported `rope_type`, as transformers 5.x computes them.

Types: `default`, `linear` (position interpolation), `dynamic` (dynamic NTK, fixed per program: see
`rope_inv_freq`), `yarn` (YaRN, incl. DeepSeek's mscale variant) and `llama3` (Llama 3.1's banded scaling).

The arithmetic follows transformers' float32 torch code step by step (the base and the exponents rounded to
float32, the ramps and blends in float32), so the frequencies agree with the reference to about one float32 ulp;
at large positions an angle is `position * inv_freq`, so a closer-to-exact float64 result would drift away from
the reference (and from how the checkpoints were trained) by more than that.
"""

from __future__ import annotations

import math

import numpy as np

from .config import RopeConfig


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 for scale <= 1).

    transformers uses it for the cos/sin factor (`rope_attention_factor`) and DeepSeek-V3's attention multiplies
    its softmax scale by `yarn_get_mscale(factor, mscale_all_dim) ** 2` when `mscale_all_dim` is set.
    """
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _default_inv_freq(base: float, dim: int) -> np.ndarray:
    """1 / base ** (2i / dim) in float32 like torch: float32 base and exponents, pow rounded to float32."""
    exponents = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    powers = (np.float64(np.float32(base)) ** exponents.astype(np.float64)).astype(np.float32)
    return np.float32(1.0) / powers


def _dynamic_inv_freq(rope: RopeConfig, dim: int, max_len: int | None) -> np.ndarray:
    mpe = rope.max_position_embeddings
    seq_len = max_len if max_len is not None else mpe * rope.factor
    seq_len = max(seq_len, mpe)  # transformers: never below max_position_embeddings (then it is plain RoPE)
    if dim <= 2:
        raise ValueError(f"dynamic NTK RoPE needs rotary_dim > 2, got {dim}")
    base = rope.theta * ((rope.factor * seq_len / mpe) - (rope.factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(base, dim)


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    base, factor = rope.theta, rope.factor
    original = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength makes `num_rotations` turns over the original context.
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: avoid the singular ramp

    exponents = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    pos_freqs = (np.float64(np.float32(base)) ** exponents.astype(np.float64)).astype(np.float32)
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = np.float32(1.0) - ramp
    return interpolation * (np.float32(1.0) - extrapolation_weight) + extrapolation * extrapolation_weight


def _llama3_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    inv_freq = _default_inv_freq(rope.theta, dim)
    factor = np.float32(rope.factor)
    low, high = rope.low_freq_factor, rope.high_freq_factor
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high

    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > np.float32(low_freq_wavelen), inv_freq / factor, inv_freq)  # long waves: / factor
    medium = ~(wavelen < np.float32(high_freq_wavelen)) & ~(wavelen > np.float32(low_freq_wavelen))
    if not medium.any():  # also covers high == low, where the smoothing below would divide by zero
        return scaled
    smooth = (np.float32(old_context) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (np.float32(1.0) - smooth) * scaled / factor + smooth * scaled
    return np.where(medium, smoothed, scaled)


def rope_inv_freq(rope: RopeConfig, rotary_dim: int, max_len: int | None = None) -> np.ndarray:
    """The inverse frequencies (float32 [rotary_dim // 2]) transformers' `ROPE_INIT_FUNCTIONS` give this config.

    `dynamic` (dynamic NTK): transformers recomputes the frequencies from the current sequence length once it
    exceeds `max_position_embeddings` (and uses plain RoPE below it). A compiled serving program needs one fixed
    set, so, like vLLM's `DynamicNTKScalingRotaryEmbedding`, the frequencies are computed once for the longest
    sequence: `max_len` when given (the served maximum length), else `max_position_embeddings * factor`. They then
    equal transformers' only for a sequence of that length; shorter prompts (in particular those within
    `max_position_embeddings`, which transformers runs with unscaled RoPE) get different logits than transformers.
    As in transformers, a `max_len` at or below `max_position_embeddings` gives plain RoPE.

    `max_len` is used by `dynamic` only.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    kind = rope.scaling_type
    if kind == "default":
        inv_freq = _default_inv_freq(rope.theta, rotary_dim)
    elif kind == "linear":
        inv_freq = _default_inv_freq(rope.theta, rotary_dim) / np.float32(rope.factor)
    elif kind == "dynamic":
        inv_freq = _dynamic_inv_freq(rope, rotary_dim, max_len)
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(rope, rotary_dim)
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(rope, rotary_dim)
    else:  # RopeConfig rejects other types; this guards against a new type added there but not here
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    return np.asarray(inv_freq, dtype=np.float32)


def rope_attention_factor(rope: RopeConfig) -> float:
    """The factor transformers multiplies cos and sin by (its rotary embedding's `attention_scaling`).

    yarn: `attention_factor` when set; else `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both
    `mscale` and `mscale_all_dim` are set and non-zero (1.0 for DeepSeek-V3, whose correction is in the softmax
    scale instead); else `mscale(factor)`. Every other type: 1.0.
    """
    if rope.scaling_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return float(yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(rope.factor, rope.mscale_all_dim))
    return float(yarn_get_mscale(rope.factor))
