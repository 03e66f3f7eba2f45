"""Layers shared by the decoder-only MoE families: weights as pytree dataclasses plus pure functions.

Linear weights keep the checkpoint's [out, in] layout; projections that are always applied together are
fused at load time (q|k|v, gate|up) so each becomes one matmul. A family file composes these pieces into
its decoder block; anything a family does differently lives in that family's file.

The cache protocol the model calls (`KVCache` here, the engine's paged caches elsewhere):
- full-attention layers: `update_and_attend(cfg.kv_layer_index(layer), q, k, v, positions, sliding_window,
  sm_scale=None)` (None: head_dim ** -0.5); a layer reusing another's KV (Gemma 4) calls `attend(kv_layer, q,
  positions, sliding_window, sm_scale)`, which reads that layer's cache and writes nothing;
- MLA layers (DeepSeek-V3, `deepseek_v3.py`): `update_and_attend_latent(layer, q [B, T, H, Dk], row [B, T, Dk],
  positions, sm_scale, v_dim) -> [B, T, H, v_dim]`: the row (latent | rope key) is cached, q is absorbed;
- linear-attention layers (hybrid models, `linear_attention.py`), indexed by `cfg.state_layer_index(layer)`:
  `causal_conv(state_layer, x [B, T, conv_dim], weight [conv_dim, K]) -> silu(conv) [B, T, conv_dim]` and
  `gated_delta(state_layer, q, k, v, g, beta) -> [B, T, Hv, dv]`.
Each call updates the cache's per-layer lists in place (the forward works on a shallow copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp

from kernels.attention import causal_attention, ragged_paged_attention, ragged_paged_mla, write_kv, write_latent
from kernels.dense import matmul as dense_matmul
from kernels.gated_delta import causal_conv1d, gated_delta_rule_chunked, gated_delta_rule_recurrent
from kernels.moe import route_softmax_topk, routed_experts
from kernels.quant import QuantizedWeight, quantized_matmul

from .config import ModelConfig
from .rope import rope_attention_factor, rope_inv_freq

if TYPE_CHECKING:
    from .linear_attention import LinearAttentionWeights

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclass
class AttentionWeights:
    # [q_size + 2 * kv_size, hidden]; with attn_output_gate the q part is 2 * q_size, per head [query | gate]
    qkv: Array
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
    shared: MLPWeights | None = None  # Qwen2-MoE shared expert; DeepSeek-V3's shared experts (ungated)
    shared_gate: Array | None = None  # [1, hidden]
    router_bias: Array | None = None  # [E] DeepSeek-V3's e_score_correction_bias (expert choice only)
    # Redundant experts (`moe_parallel.apply_placement`): gate_up/down hold R >= E physical slots, and these
    # map each logical expert to its replicas: [E, max replicas] slot ids (-1 padded) and [E] counts.
    log2phy: Array | None = None
    logcnt: Array | None = None
    # Benchmarks only (`moray bench eplb`): added to the softmax router's logits to skew the expert loads.
    routing_bias: Array | None = None


@jax.tree_util.register_dataclass
@dataclass
class LayerWeights:
    input_norm: Array
    attn: AttentionWeights | LinearAttentionWeights  # the layer's token mixer
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
    """Contiguous cache: slot j of sequence b holds position j. One [B, S, Hkv, D] pair per full-attention
    layer; for hybrid models also, per linear-attention layer, the conv and recurrent states (float32).

    Used by `moray logits` and parity tests; the engine uses `PagedKVCache`. A linear layer's state
    advances over every token it is given, so a row continued by later steps must have no padding in
    earlier ones (right padding is harmless for the logits of the step itself).
    """

    k: list[Array]
    v: list[Array]
    conv: list[Array] | None = None  # per linear layer [B, K-1, conv_dim]
    recurrent: list[Array] | None = None  # per linear layer [B, Hv, dk, dv]
    # Tokens per chunk of the chunked gated delta rule (prefill); static, so a change recompiles.
    chunk_size: int = field(default=64, metadata=dict(static=True))

    @staticmethod
    def zeros(cfg: ModelConfig, batch: int, max_len: int, dtype, chunk_size: int = 64) -> "KVCache":
        if cfg.mla is not None:  # one latent row per token in `k`; no V
            row = jnp.zeros((batch, max_len, 1, cfg.mla.latent_dim), dtype)
            return KVCache(k=[row] * cfg.num_kv_layers, v=[], chunk_size=chunk_size)
        shapes = [(batch, max_len, rows // 2, d) for rows, d in map(cfg.kv_layer_page_dims, range(cfg.num_kv_layers))]
        conv = recurrent = None
        if cfg.is_hybrid:
            conv = [jnp.zeros((batch, *cfg.conv_state_shape), jnp.float32) for _ in range(cfg.num_state_layers)]
            recurrent = [jnp.zeros((batch, *cfg.recurrent_state_shape), jnp.float32) for _ in range(cfg.num_state_layers)]
        return KVCache(
            k=[jnp.zeros(shape, dtype) for shape in shapes],
            v=[jnp.zeros(shape, dtype) for shape in shapes],
            conv=conv,
            recurrent=recurrent,
            chunk_size=chunk_size,
        )

    def update_and_attend(self, layer, q, k, v, positions, sliding_window, sm_scale=None):
        rows = jnp.arange(q.shape[0])[:, None]
        # Out-of-range positions (padding past the cache) are dropped by the scatter.
        self.k[layer] = self.k[layer].at[rows, positions].set(k.astype(self.k[layer].dtype), mode="drop")
        self.v[layer] = self.v[layer].at[rows, positions].set(v.astype(self.v[layer].dtype), mode="drop")
        return self.attend(layer, q, positions, sliding_window, sm_scale)

    def attend(self, layer, q, positions, sliding_window, sm_scale=None):
        return causal_attention(q, self.k[layer], self.v[layer], positions, sliding_window, sm_scale=sm_scale)

    def update_and_attend_latent(self, layer, q, row, positions, sm_scale, v_dim):
        rows = jnp.arange(q.shape[0])[:, None]
        cache = self.k[layer].at[rows, positions, 0].set(row.astype(self.k[layer].dtype), mode="drop")
        self.k[layer] = cache
        return causal_attention(q, cache, cache[..., :v_dim], positions, sm_scale=sm_scale)

    def causal_conv(self, layer, x, weight):
        out, state = causal_conv1d(x, weight, self.conv[layer])
        self.conv[layer] = state.astype(self.conv[layer].dtype)
        return out

    def gated_delta(self, layer, q, k, v, g, beta):
        if q.shape[1] == 1:  # decode: one rank-1 update beats the chunked form's triangular solve
            out, state = gated_delta_rule_recurrent(q, k, v, g, beta, self.recurrent[layer])
        else:
            out, state = gated_delta_rule_chunked(q, k, v, g, beta, self.recurrent[layer], self.chunk_size)
        self.recurrent[layer] = state.astype(self.recurrent[layer].dtype)
        return out


@jax.tree_util.register_dataclass
@dataclass
class PagedKVCache:
    """Paged cache for a flat, ragged batch (the engine's layout; tokens are [1, N]).

    `pages[layer]` is [num_pages, page_size, 2 * Hkv, D] with K/V interleaved per head (the layout of
    JAX's TPU ragged paged attention kernel). The metadata describes this step's batch.

    Cache groups: the cache layers in `window_layers` (sliding-window layers with a pool of their own) write
    through `window_slot_mapping` and read through `window_page_indices`; the others through the main ones.
    """

    pages: list[Array]
    slot_mapping: Array  # i32[N], -1 for padding tokens
    kv_lens: Array  # i32[S], including this step's tokens
    page_indices: Array  # i32[S, pages_per_seq]
    cu_q_lens: Array  # i32[S + 1]
    num_seqs: Array  # i32[1]
    window_slot_mapping: Array | None = field(default=None, kw_only=True)
    window_page_indices: Array | None = field(default=None, kw_only=True)
    window_layers: tuple[int, ...] = field(default=(), kw_only=True, metadata=dict(static=True))

    def _tables(self, layer) -> tuple[Array, Array]:
        """(slot mapping, page table) of the cache group `layer` belongs to."""
        if layer in self.window_layers:
            return self.window_slot_mapping, self.window_page_indices
        return self.slot_mapping, self.page_indices

    def update_and_attend(self, layer, q, k, v, positions, sliding_window, sm_scale=None):
        b, t = q.shape[:2]
        flat = lambda a: a.reshape(b * t, *a.shape[2:])
        self.pages[layer] = write_kv(self.pages[layer], flat(k), flat(v), self._tables(layer)[0])
        return self.attend(layer, q, positions, sliding_window, sm_scale)

    def attend(self, layer, q, positions, sliding_window, sm_scale=None):
        b, t = q.shape[:2]
        out = ragged_paged_attention(
            q.reshape(b * t, *q.shape[2:]),
            self.pages[layer],
            self.kv_lens,
            self._tables(layer)[1],
            self.cu_q_lens,
            self.num_seqs,
            sm_scale=q.shape[-1] ** -0.5 if sm_scale is None else sm_scale,
            sliding_window=sliding_window,
        )
        return out.reshape(q.shape)

    def update_and_attend_latent(self, layer, q, row, positions, sm_scale, v_dim):
        b, t, h, d = q.shape
        self.pages[layer] = write_latent(self.pages[layer], row.reshape(b * t, d), self.slot_mapping)
        out = ragged_paged_mla(
            q.reshape(b * t, h, d),
            self.pages[layer],
            self.kv_lens,
            self.page_indices,
            self.cu_q_lens,
            self.num_seqs,
            sm_scale=sm_scale,
            v_dim=v_dim,
        )
        return out.reshape(b, t, h, v_dim)


# ---------------------------------------------------------------------------------------------
# Numerical building blocks.


def linear(x: Array, w: Array | QuantizedWeight, bias: Array | None = None) -> Array:
    if isinstance(w, QuantizedWeight):  # stays packed in HBM; dequantised tile by tile inside the matmul
        y = quantized_matmul(x, w).astype(x.dtype)
    else:
        y = dense_matmul(x, w).astype(x.dtype)
    return y if bias is None else y + bias


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """Normalise in float32, cast back, then scale (the order transformers uses)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def zero_centered_rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """norm(x) * (1 + w), scaled in float32 before the cast back (transformers' Qwen3_5MoeRMSNorm)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def norm(x: Array, weight: Array, cfg: ModelConfig) -> Array:
    """The model's RMSNorm (input, post-attention, final and q/k norms)."""
    fn = zero_centered_rms_norm if cfg.zero_centered_norm else rms_norm
    return fn(x, weight, cfg.rms_norm_eps)


def rope_cos_sin(cfg: ModelConfig, positions: Array) -> tuple[Array, Array]:
    """cos/sin tables [B, T, rotary_dim] in float32 for the rotate_half convention, for any `cfg.rope` type.

    The frequencies are constants of the compiled program (see `rope.rope_inv_freq`, e.g. for dynamic NTK);
    cos and sin are scaled by the type's attention factor (YaRN's mscale) as transformers does.
    """
    inv_freq = jnp.asarray(rope_inv_freq(cfg.rope, cfg.rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    scale = rope_attention_factor(cfg.rope)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B, T, heads, D]; rotates the two halves of the first rotary_dim (= cos's width) dims of D (not
    interleaved pairs); the other dims pass through (partial rotary)."""
    dim = cos.shape[-1]
    x, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    out = x * cos + rotated * sin
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


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
    q_width = 2 * cfg.q_size if cfg.attn_output_gate else cfg.q_size
    q, k, v = jnp.split(qkv, [q_width, q_width + cfg.kv_size], axis=-1)
    gate = None
    if cfg.attn_output_gate:  # per head [query | gate]
        q, gate = jnp.split(q.reshape(b, t, cfg.num_heads, 2 * cfg.head_dim), 2, axis=-1)
        gate = gate.reshape(b, t, cfg.q_size)
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if w.q_norm is not None:
        q = norm(q, w.q_norm, cfg)
        k = norm(k, w.k_norm, cfg)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    out = cache.update_and_attend(cfg.kv_layer_index(layer), q, k, v, positions, cfg.sliding_windows[layer])
    out = out.reshape(b, t, cfg.q_size)
    if gate is not None:
        out = out * jax.nn.sigmoid(gate)
    return linear(out, w.o)


def swiglu_mlp(x: Array, w: MLPWeights) -> Array:
    gate, up = jnp.split(linear(x, w.gate_up), 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, w.down)


def moe_softmax_topk(x: Array, w: MoEWeights, cfg: ModelConfig, experts: Callable | None = None, positions: Array | None = None) -> Array:
    """Softmax router -> top-k (optionally renormalised) -> routed experts (+ gated shared expert).

    `experts` replaces `routed_experts` (same arguments), e.g. `moe_parallel.ExpertParallel` to run
    them over a mesh; routing and the shared expert stay per token, so they need no collective.
    """

    def route(flat):
        logits = linear(flat, w.router)
        if w.routing_bias is not None:
            logits = logits + w.routing_bias.astype(logits.dtype)
        return route_softmax_topk(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)

    return moe_block(x, w, route, experts, positions)


def physical_ids(ids: Array, log2phy: Array, logcnt: Array, positions: Array | None = None) -> Array:
    """Logical expert ids [T, k] -> physical slots: token t (at sequence position p) sends its assignment to
    expert e to replica (t + p // n) mod n, n = logcnt[e]. The rule depends only on the batch, so every
    device splits a replicated expert's tokens the same way and each assignment runs exactly once.
    - By token, not by flat assignment index t * k + j: a hot expert is mostly its tokens' first choice,
      j = 0, and with k a multiple of the replica count every such assignment would land on replica 0.
    - The position term moves a decoding sequence to the next replica every n steps. By row alone, a
      sequence kept its batch row, so its tokens went to one replica for its whole life: sequences that
      keep choosing an expert (greedy text that repeats itself) loaded its replicas unevenly, which no
      placement sees (`bench eplb`: windowed max/mean 1.14-1.16 with balancing). Within a prompt t and p
      advance together and p // n adds one every n tokens: its tokens still go round every replica."""
    t = jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None]
    count = logcnt[ids]
    if positions is not None:
        t = t + positions.reshape(-1, 1).astype(jnp.int32) // count
    return log2phy[ids, t % count]


def moe_block(
    x: Array,
    w: MoEWeights,
    route: Callable[[Array], tuple[Array, Array]],
    experts: Callable | None = None,
    positions: Array | None = None,
) -> Array:
    """The MoE every family shares once it has routed: `route(tokens [T, hidden]) -> (weights, ids)` per
    token, then the routed experts, plus the shared expert (gated by sigmoid(shared_gate) when it has one).
    `positions` (x's [B, T]) spread a replicated expert's tokens over its replicas (`physical_ids`)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, ids = route(flat)
    if w.log2phy is not None:
        ids = physical_ids(ids, w.log2phy, w.logcnt, positions)
    out = (experts or routed_experts)(flat, ids, weights.astype(flat.dtype), w.gate_up, w.down)
    if w.shared is not None:
        shared = swiglu_mlp(flat, w.shared)
        out = out + (shared if w.shared_gate is None else jax.nn.sigmoid(linear(flat, w.shared_gate)) * shared)
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# The decoder stack every family runs; a family supplies its block's MLP choice.

MlpFn = Callable[..., Array]  # (x, MoEWeights, cfg, experts=None, positions=None): moe_softmax_topk's shape
# A linear-attention token mixer: (x, weights, cfg, cache, state_layer) -> [B, T, hidden]
# (`linear_attention.gated_deltanet`).
LinearMixerFn = Callable[..., Array]


def decoder_block(
    x: Array,
    lw: LayerWeights,
    cfg: ModelConfig,
    layer: int,
    rope: tuple[Array, Array],
    positions: Array,
    cache: "KVCache | PagedKVCache",
    moe_fn: MlpFn,
    linear_mixer: LinearMixerFn | None = None,
    attention_fn: Callable[..., Array] | None = None,
) -> Array:
    """Pre-norm residual block: x + mixer(norm(x)), then h + mlp(norm(h)). Updates `cache` in place.

    The mixer is attention (`attention_fn`, same arguments as `attention`, e.g. MLA), or `linear_mixer`
    on the linear-attention layers of a hybrid model.
    """
    normed = norm(x, lw.input_norm, cfg)
    if cfg.is_linear_layer(layer):
        if linear_mixer is None:
            raise ValueError(f"layer {layer} is a linear-attention layer but no linear mixer was given")
        h = x + linear_mixer(normed, lw.attn, cfg, cache, cfg.state_layer_index(layer))
    else:
        h = x + (attention_fn or attention)(normed, lw.attn, cfg, rope, positions, cache, layer)
    normed = norm(h, lw.post_attn_norm, cfg)
    mlp_out = moe_fn(normed, lw.mlp, cfg, positions=positions) if cfg.moe_layers[layer] else swiglu_mlp(normed, lw.mlp)
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
    linear_mixer: LinearMixerFn | None = None,
    attention_fn: Callable[..., Array] | None = None,
    inputs_embeds: Array | None = None,
    hidden_out: str | None = None,
):
    """Returns float32 logits and the updated cache (and with `hidden_out` the hidden states).

    Logits are [B, T, vocab], or [len(logits_indices), vocab] for those rows of the flattened batch
    only (the engine needs one row per sequence, and the LM head is the largest matmul of a step).
    `experts` (e.g. an expert-parallel executor) is handed to `moe_fn` in place of `routed_experts`.
    `linear_mixer` runs the linear-attention layers of hybrid models. `inputs_embeds` replaces the token
    embeddings (a multi-token-prediction head's own input, `mtp.py`). `hidden_out` also returns every
    token's last hidden state, [B, T, hidden]: "normed" after the final norm (what the LM head reads),
    "residual" before it.
    """
    if experts is not None:
        moe_fn = partial(moe_fn, experts=experts)
    x = weights.embed[tokens] if inputs_embeds is None else inputs_embeds
    rope = rope_cos_sin(cfg, positions)
    cache = jax.tree.map(lambda a: a, cache)  # a shallow copy whose per-layer lists we may replace
    for layer, lw in enumerate(weights.layers):
        with jax.named_scope(f"layer_{layer}"):
            x = decoder_block(x, lw, cfg, layer, rope, positions, cache, moe_fn, linear_mixer, attention_fn)
    hidden = None
    if hidden_out == "residual":
        hidden = x
    elif hidden_out == "normed":
        hidden = x = norm(x, weights.final_norm, cfg)
    elif hidden_out is not None:
        raise ValueError(f"hidden_out must be 'normed' or 'residual', not {hidden_out!r}")
    if logits_indices is not None:
        x = x.reshape(-1, x.shape[-1])[logits_indices]
    if hidden_out != "normed":
        x = norm(x, weights.final_norm, cfg)
    head = weights.embed if weights.lm_head is None else weights.lm_head
    if isinstance(head, QuantizedWeight):  # an LM head the checkpoint's quantization_config did not ignore
        logits = quantized_matmul(x, head)
    else:
        logits = dense_matmul(x, head)
    return (logits, cache) if hidden_out is None else (logits, cache, hidden)
