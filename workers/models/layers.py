"""Layers shared by the decoder-only MoE families: weights as pytree dataclasses plus pure functions.

Linear weights keep the checkpoint's [out, in] layout; projections that are always applied together are
fused at load time (q|k|v, gate|up) so each becomes one matmul. A family file composes these pieces into
its decoder block; anything a family does differently lives in that family's file.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp

from kernels.attention import causal_attention, ragged_paged_attention, write_kv
from kernels.moe import route_softmax_topk, routed_experts
from kernels.quant import QuantizedWeight, quantized_matmul

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
    """Contiguous cache: slot j of sequence b holds position j. One [B, S, Hkv, D] pair per layer.

    Used by `moray logits` and parity tests; the engine uses `PagedKVCache`.
    """

    k: list[Array]
    v: list[Array]

    @staticmethod
    def zeros(cfg: ModelConfig, batch: int, max_len: int, dtype) -> "KVCache":
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return KVCache(
            k=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
            v=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        )

    def update_and_attend(self, layer, q, k, v, positions, sliding_window):
        rows = jnp.arange(q.shape[0])[:, None]
        # Out-of-range positions (padding past the cache) are dropped by the scatter.
        self.k[layer] = self.k[layer].at[rows, positions].set(k.astype(self.k[layer].dtype), mode="drop")
        self.v[layer] = self.v[layer].at[rows, positions].set(v.astype(self.v[layer].dtype), mode="drop")
        return causal_attention(q, self.k[layer], self.v[layer], positions, sliding_window)


@jax.tree_util.register_dataclass
@dataclass
class PagedKVCache:
    """Paged cache for a flat, ragged batch (the engine's layout; tokens are [1, N]).

    `pages[layer]` is [num_pages, page_size, 2 * Hkv, D] with K/V interleaved per head (the layout of
    JAX's TPU ragged paged attention kernel). The metadata describes this step's batch.
    """

    pages: list[Array]
    slot_mapping: Array  # i32[N], -1 for padding tokens
    kv_lens: Array  # i32[S], including this step's tokens
    page_indices: Array  # i32[S, pages_per_seq]
    cu_q_lens: Array  # i32[S + 1]
    num_seqs: Array  # i32[1]

    def update_and_attend(self, layer, q, k, v, positions, sliding_window):
        b, t = q.shape[:2]
        flat = lambda a: a.reshape(b * t, *a.shape[2:])
        self.pages[layer] = write_kv(self.pages[layer], flat(k), flat(v), self.slot_mapping)
        out = ragged_paged_attention(
            flat(q),
            self.pages[layer],
            self.kv_lens,
            self.page_indices,
            self.cu_q_lens,
            self.num_seqs,
            sm_scale=q.shape[-1] ** -0.5,
            sliding_window=sliding_window,
        )
        return out.reshape(q.shape)


# ---------------------------------------------------------------------------------------------
# Numerical building blocks.


def linear(x: Array, w: Array | QuantizedWeight, bias: Array | None = None) -> Array:
    if isinstance(w, QuantizedWeight):  # stays packed in HBM; dequantised tile by tile inside the matmul
        y = quantized_matmul(x, w).astype(x.dtype)
    else:
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
    cache: "KVCache | PagedKVCache",
    layer: int,
) -> Array:
    """Self-attention for [B, T] new tokens; their K/V go into `cache` (updated in place)."""
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
    out = cache.update_and_attend(layer, q, k, v, positions, cfg.sliding_windows[layer])
    return linear(out.reshape(b, t, cfg.q_size), w.o)


def swiglu_mlp(x: Array, w: MLPWeights) -> Array:
    gate, up = jnp.split(linear(x, w.gate_up), 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, w.down)


def moe_softmax_topk(x: Array, w: MoEWeights, cfg: ModelConfig, experts: Callable | None = None) -> Array:
    """Softmax router -> top-k (optionally renormalised) -> routed experts (+ gated shared expert).

    `experts` replaces `routed_experts` (same arguments), e.g. `moe_parallel.ExpertParallel` to run
    them over a mesh; routing and the shared expert stay per token, so they need no collective.
    """
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    router_logits = linear(flat, w.router)
    weights, ids = route_softmax_topk(router_logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    out = (experts or routed_experts)(flat, ids, weights.astype(flat.dtype), w.gate_up, w.down)
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
    cache: "KVCache | PagedKVCache",
    moe_fn: MlpFn,
) -> Array:
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h)). Updates `cache` in place."""
    h = x + attention(rms_norm(x, lw.input_norm, cfg.rms_norm_eps), lw.attn, cfg, rope, positions, cache, layer)
    normed = rms_norm(h, lw.post_attn_norm, cfg.rms_norm_eps)
    mlp_out = moe_fn(normed, lw.mlp, cfg) if cfg.moe_layers[layer] else swiglu_mlp(normed, lw.mlp)
    return h + mlp_out


def decoder_forward(
    weights: ModelWeights,
    cfg: ModelConfig,
    tokens: Array,  # [B, T] int32
    positions: Array,  # [B, T] int32
    cache,  # KVCache | PagedKVCache
    moe_fn: MlpFn,
    logits_indices: Array | None = None,
    experts: Callable | None = None,
):
    """Returns float32 logits and the updated cache.

    Logits are [B, T, vocab], or [len(logits_indices), vocab] for those rows of the flattened batch
    only (the engine needs one row per sequence, and the LM head is the largest matmul of a step).
    `experts` (e.g. an expert-parallel executor) is handed to `moe_fn` in place of `routed_experts`.
    """
    if experts is not None:
        moe_fn = partial(moe_fn, experts=experts)
    x = weights.embed[tokens]
    rope = rope_cos_sin(cfg, positions)
    cache = jax.tree.map(lambda a: a, cache)  # a shallow copy whose per-layer lists we may replace
    for layer, lw in enumerate(weights.layers):
        with jax.named_scope(f"layer_{layer}"):
            x = decoder_block(x, lw, cfg, layer, rope, positions, cache, moe_fn)
    if logits_indices is not None:
        x = x.reshape(-1, x.shape[-1])[logits_indices]
    x = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    head = weights.embed if weights.lm_head is None else weights.lm_head
    if isinstance(head, QuantizedWeight):  # an LM head the checkpoint's quantization_config did not ignore
        logits = quantized_matmul(x, head)
    else:
        logits = jnp.einsum("...h,vh->...v", x, head, preferred_element_type=jnp.float32)
    return logits, cache
