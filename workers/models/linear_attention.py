"""Gated DeltaNet: the linear-attention token mixer of the hybrid families (Qwen3.5, Qwen3-Next).

Per layer (transformers 5.x `Qwen3_5MoeGatedDeltaNet`):
    q | k | v = silu(causal_conv1d(in_proj_qkv(x)))            conv over conv_dim = 2*key_dim + value_dim
    z = in_proj_z(x);  beta = sigmoid(in_proj_b(x));  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    o = gated_delta_rule(q, k, v, g, beta)                      per value head, state [dk, dv]
    out = out_proj(RMSNormGated(o, z))                          norm per value head, times silu(z)
The conv and the recurrence carry per-sequence state, so they are the cache's (`cache.causal_conv`,
`cache.gated_delta`, indexed by the layer's state index); everything else is here, shared by every cache.

Weights are laid out once for both families: `qkvz` = the conv channels q | k | v (heads in order) then z,
`ba` = b | a. Qwen3-Next's fused projections, grouped per key head, are un-interleaved into this layout
at load time (`plans.qwen3_next_linear_attention_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layers import linear

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclass
class LinearAttentionWeights:
    qkvz: Array  # [conv_dim + value_dim, hidden]: q | k | v | z
    ba: Array  # [2 * Hv, hidden]: b | a
    conv: Array  # [conv_dim, 1, K], the checkpoint's depthwise Conv1d layout
    dt_bias: Array  # [Hv]
    A_log: Array  # [Hv]
    norm: Array  # [dv], RMSNormGated weight (plain, not zero-centred)
    out: Array  # [hidden, value_dim]


def gated_rms_norm(x: Array, gate: Array, weight: Array, eps: float) -> Array:
    """transformers' RMSNormGated: float32 norm, cast back, times the weight, times silu(gate) in float32."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = weight * xf.astype(x.dtype)
    return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def gated_deltanet(x: Array, w: LinearAttentionWeights, cfg: ModelConfig, cache, state_layer: int) -> Array:
    """One Gated DeltaNet layer over [B, T, hidden]; its conv and recurrent states advance in `cache`."""
    lc = cfg.linear
    b, t, _ = x.shape
    mixed, z = jnp.split(linear(x, w.qkvz), [lc.conv_dim], axis=-1)
    beta, a = jnp.split(linear(x, w.ba), 2, axis=-1)
    mixed = cache.causal_conv(state_layer, mixed, w.conv[:, 0, :])
    q, k, v = jnp.split(mixed, [lc.key_dim, 2 * lc.key_dim], axis=-1)
    q = q.reshape(b, t, lc.num_key_heads, lc.key_head_dim)
    k = k.reshape(b, t, lc.num_key_heads, lc.key_head_dim)
    v = v.reshape(b, t, lc.num_value_heads, lc.value_head_dim)
    beta = jax.nn.sigmoid(beta)
    # float32 so exp(A_log) cannot overflow in half precision (as transformers).
    g = -jnp.exp(w.A_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + w.dt_bias.astype(jnp.float32))
    out = cache.gated_delta(state_layer, q, k, v, g, beta)  # [B, T, Hv, dv]
    z = z.reshape(b, t, lc.num_value_heads, lc.value_head_dim)
    out = gated_rms_norm(out, z, w.norm, cfg.rms_norm_eps)
    return linear(out.reshape(b, t, lc.value_dim), w.out)
