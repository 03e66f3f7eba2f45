"""Layers shared by the decoder-only MoE families: weights as pytree dataclasses plus pure functions.

Linear weights keep the checkpoint's [out, in] layout; projections that are always applied together are
fused at load time (q|k|v, gate|up) so each becomes one matmul. A family file composes these pieces into
its decoder block; anything a family does differently lives in that family's file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from kernels.attention import causal_attention
from kernels.moe import route_softmax_topk, routed_experts

from .config import ModelConfig

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclass
class AttentionWeights:
    qkv: Array  # [q_size + 2 * kv_size, hidden]
    o: Array  # [hidden, q_size]
    qkv_bias: Array | None = None  # [q_size + 2 * kv_size]
    q_norm: Array | None = None  # [head_dim], per-head RMSNorm (Qwen3)
    k_norm: Array | None = None


@jax.tree_util.register_dataclass
@dataclass
class MLPWeights:
    gate_up: Array  # [2 * intermediate, hidden], gate rows first
    down: Array  # [hidden, intermediate]


@jax.tree_util.register_dataclass
@dataclass
class MoEWeights:
    router: Array  # [E, hidden]
    gate_up: Array  # [E, 2 * moe_intermediate, hidden]
    down: Array  # [E, hidden, moe_intermediate]
    shared: MLPWeights | None = None  # Qwen2-MoE shared expert
    shared_gate: Array | None = None  # [1, hidden]


@jax.tree_util.register_dataclass
@dataclass
class LayerWeights:
    input_norm: Array
    attn: AttentionWeights
    post_attn_norm: Array
    mlp: MLPWeights | MoEWeights


@jax.tree_util.register_dataclass
@dataclass
class ModelWeights:
    embed: Array  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: Array
    lm_head: Array | None = None  # None when tied to `embed`


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """Contiguous cache: slot j of sequence b holds position j. One [B, S, Hkv, D] pair per layer."""

    k: list[Array]
    v: list[Array]

    @staticmethod
    def zeros(cfg: ModelConfig, batch: int, max_len: int, dtype) -> "KVCache":
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return KVCache(
            k=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
            v=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        )


# ---------------------------------------------------------------------------------------------
# Numerical building blocks.


def linear(x: Array, w: Array, bias: Array | None = None) -> Array:
    y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return y if bias is None else y + bias


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """Normalise in float32, cast back, then scale (the order transformers uses)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_cos_sin(cfg: ModelConfig, positions: Array) -> tuple[Array, Array]:
    """cos/sin tables [B, T, head_dim] in float32 for the rotate_half convention."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope.theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if cfg.rope.scaling_type == "linear":
        inv_freq = inv_freq / cfg.rope.factor
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B, T, heads, D]; rotates the two halves of D (not interleaved pairs)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def attention(
    x: Array,
    w: AttentionWeights,
    cfg: ModelConfig,
    rope: tuple[Array, Array],
    positions: Array,
    k_cache: Array,
    v_cache: Array,
    sliding_window: int | None,
) -> tuple[Array, Array, Array]:
    """Self-attention for [B, T] new tokens; writes their K/V at `positions` and reads the cache."""
    b, t, _ = x.shape
    qkv = linear(x, w.qkv, w.qkv_bias)
    q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if w.q_norm is not None:
        q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    rows = jnp.arange(b)[:, None]
    # Out-of-range positions (padding past the cache) are dropped by the scatter.
    k_cache = k_cache.at[rows, positions].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, positions].set(v.astype(v_cache.dtype), mode="drop")
    out = causal_attention(q, k_cache, v_cache, positions, sliding_window)
    return linear(out.reshape(b, t, cfg.q_size), w.o), k_cache, v_cache


def swiglu_mlp(x: Array, w: MLPWeights) -> Array:
    gate, up = jnp.split(linear(x, w.gate_up), 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, w.down)


def moe_softmax_topk(x: Array, w: MoEWeights, cfg: ModelConfig) -> Array:
    """Softmax router -> top-k (optionally renormalised) -> routed experts (+ gated shared expert)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    router_logits = linear(flat, w.router)
    weights, ids = route_softmax_topk(router_logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    out = routed_experts(flat, ids, weights.astype(flat.dtype), w.gate_up, w.down)
    if w.shared is not None:
        gate = jax.nn.sigmoid(linear(flat, w.shared_gate))
        out = out + gate * swiglu_mlp(flat, w.shared)
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# The decoder stack every family runs; a family supplies its block's MLP choice.

MlpFn = Callable[[Array, "MLPWeights | MoEWeights", ModelConfig], Array]


def decoder_block(
    x: Array,
    lw: LayerWeights,
    cfg: ModelConfig,
    layer: int,
    rope: tuple[Array, Array],
    positions: Array,
    cache: KVCache,
    moe_fn: MlpFn,
) -> Array:
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h)). Updates `cache` in place."""
    h, cache.k[layer], cache.v[layer] = attention(
        rms_norm(x, lw.input_norm, cfg.rms_norm_eps),
        lw.attn,
        cfg,
        rope,
        positions,
        cache.k[layer],
        cache.v[layer],
        cfg.sliding_windows[layer],
    )
    h = x + h
    normed = rms_norm(h, lw.post_attn_norm, cfg.rms_norm_eps)
    mlp_out = moe_fn(normed, lw.mlp, cfg) if cfg.moe_layers[layer] else swiglu_mlp(normed, lw.mlp)
    return h + mlp_out


def decoder_forward(
    weights: ModelWeights,
    cfg: ModelConfig,
    tokens: Array,  # [B, T] int32
    positions: Array,  # [B, T] int32
    cache: KVCache,
    moe_fn: MlpFn,
) -> tuple[Array, KVCache]:
    """Returns float32 logits [B, T, vocab] and the updated cache."""
    x = weights.embed[tokens]
    rope = rope_cos_sin(cfg, positions)
    cache = KVCache(k=list(cache.k), v=list(cache.v))
    for layer, lw in enumerate(weights.layers):
        with jax.named_scope(f"layer_{layer}"):
            x = decoder_block(x, lw, cfg, layer, rope, positions, cache, moe_fn)
    x = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    head = weights.embed if weights.lm_head is None else weights.lm_head
    logits = jnp.einsum("bth,vh->btv", x, head, preferred_element_type=jnp.float32)
    return logits, cache
