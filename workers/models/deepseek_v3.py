"""DeepSeek-V3 (and models built on its architecture, e.g. Kimi K2): multi-head latent attention (MLA)
and a sigmoid router that chooses within the best expert groups. Math as transformers 5.x.

Attention: q = q_b(norm(q_a(x))) (or a plain q_proj when `q_lora_rank` is null), per head
[nope (qk_nope_head_dim) | rope (qk_rope_head_dim)]; kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) |
rope key], the latent normed; kv_b_proj expands a latent to per-head [k_nope | v]. The cache holds only
the row [latent | roped key] per token and layer. Attention runs in the absorbed form: the key half of
kv_b folds into the query (q_nope @ W_uk), scores are taken against the rows, and the value half of kv_b
is applied to the attended latent; so a step reads the latent rows only. `forward_expanded` runs the
textbook form (keys and values expanded per head) on the contiguous cache, as the check of the absorbed
one. The softmax scale is qk_head_dim ** -0.5 times YaRN's mscale ** 2 (`mscale_all_dim`).

MLP: dense SwiGLU for the first `first_k_dense_replace` layers, then MoE: sigmoid scores, the choice on
scores + `e_score_correction_bias` within the `topk_group` best of `n_group` groups, weights from the
unbiased scores (renormalised iff `norm_topk_prob`) times `routed_scaling_factor`; plus
`n_shared_experts` always-on shared experts (one SwiGLU of n_shared x moe_intermediate_size).
Multi-token-prediction layers (`num_nextn_predict_layers`, stored as layers past the last) are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp

from kernels.attention import causal_attention
from kernels.moe import route_sigmoid_group_topk
from kernels.quant import as_dense

from .config import MLAConfig, ModelConfig, ModelLoadError, RopeConfig, build_config, common_fields, require
from .layers import KVCache, ModelWeights, MoEWeights, apply_rope, decoder_forward, linear, moe_block, rms_norm
from .plans import experts_plan, mlp_plan, model_plan
from .rope import yarn_get_mscale
from .weights import Concat, Tensor, WeightSpec, linear_spec, norm_spec

MODEL_TYPE = "deepseek_v3"
LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use RMSNorm's default eps, not rms_norm_eps

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# Config.


def softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times mscale ** 2 under a RoPE scaling with `mscale_all_dim` (YaRN): without it
    the logits of short prompts already differ from transformers."""
    scale = qk_head_dim**-0.5
    if rope.scaling_type != "default" and rope.mscale_all_dim:
        m = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return scale


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    fields = common_fields(raw)
    n = fields["num_layers"]
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ModelLoadError(f"config.json: scoring_func '{scoring}' is not supported for deepseek_v3 (only 'sigmoid')")
    mla = MLAConfig(
        kv_lora_rank=require(raw, "kv_lora_rank"),
        q_lora_rank=raw.get("q_lora_rank"),
        qk_nope_head_dim=require(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=require(raw, "qk_rope_head_dim"),
        v_head_dim=require(raw, "v_head_dim"),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        softmax_scale=softmax_scale(fields["rope"], int(raw["qk_nope_head_dim"]) + int(raw["qk_rope_head_dim"])),
    )
    num_experts = raw.get("n_routed_experts") or 0
    first_dense = raw.get("first_k_dense_replace") or 0
    shared = raw.get("n_shared_experts") or 0
    fields.update(
        # RoPE covers the rope part of a head only; heads are not grouped (the cache has no head axis).
        head_dim=mla.qk_rope_head_dim,
        num_kv_heads=fields["num_heads"],
    )
    return build_config(
        **fields,
        sliding_windows=(None,) * n,
        moe_layers=tuple(num_experts > 0 and i >= first_dense for i in range(n)),
        intermediate_size=raw.get("intermediate_size", 0),
        num_experts=num_experts,
        num_experts_per_tok=raw.get("num_experts_per_tok", 0),
        moe_intermediate_size=raw.get("moe_intermediate_size", 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=shared * (raw.get("moe_intermediate_size") or 0),
        mla=mla,
        num_expert_groups=raw.get("n_group") or 1,
        topk_expert_groups=raw.get("topk_group") or 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
    )


def skipped_prefixes(raw: dict[str, Any]) -> tuple[str, ...]:
    """The multi-token-prediction layers, stored after the last decoder layer."""
    n = int(raw.get("num_hidden_layers", 0))
    mtp = int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0)
    return tuple(f"model.layers.{n + i}." for i in range(mtp))


# ---------------------------------------------------------------------------------------------
# Weights.


@jax.tree_util.register_dataclass
@dataclass
class MLAWeights:
    # The two projections of x, fused: [q_a (q_lora_rank) | kv_a (kv_lora_rank + rope)] rows, or with no
    # q_lora_rank [q (heads * qk_head_dim) | kv_a].
    q_kv_a: Array
    kv_a_norm: Array  # [kv_lora_rank]
    kv_b: Array  # [heads * (qk_nope + v), kv_lora_rank], per head [k_nope rows | v rows]
    o: Array  # [hidden, heads * v]
    q_a_norm: Array | None = None  # [q_lora_rank]
    q_b: Array | None = None  # [heads * qk_head_dim, q_lora_rank]


def mla_plan(prefix: str, cfg: ModelConfig) -> MLAWeights:
    m, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    kv_a = Tensor(f"{prefix}.kv_a_proj_with_mqa.weight", (m.latent_dim, h))
    if m.q_lora_rank is None:
        q_first = Tensor(f"{prefix}.q_proj.weight", (heads * m.qk_head_dim, h))
    else:
        q_first = Tensor(f"{prefix}.q_a_proj.weight", (m.q_lora_rank, h))
    lora = m.q_lora_rank is not None
    return MLAWeights(
        q_kv_a=WeightSpec(Concat((q_first, kv_a)), ("mla_a", "embed")),
        kv_a_norm=norm_spec(f"{prefix}.kv_a_layernorm.weight", m.kv_lora_rank),
        kv_b=linear_spec(f"{prefix}.kv_b_proj.weight", heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, ("heads", None)),
        o=linear_spec(f"{prefix}.o_proj.weight", h, heads * m.v_head_dim, ("embed", "heads")),
        q_a_norm=norm_spec(f"{prefix}.q_a_layernorm.weight", m.q_lora_rank) if lora else None,
        q_b=linear_spec(f"{prefix}.q_b_proj.weight", heads * m.qk_head_dim, m.q_lora_rank, ("heads", None)) if lora else None,
    )


def plan(cfg: ModelConfig, first_layer: int = 0) -> ModelWeights:
    """`first_layer`: the stored index of layer 0 (the multi-token-prediction layer's is num_hidden_layers, mtp.py)."""

    def mlp_for_layer(n: int, prefix: str):
        if not cfg.moe_layers[n]:
            return mlp_plan(f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size)
        gate_up, down = experts_plan(f"{prefix}.mlp.experts", cfg)
        shared = None
        if cfg.shared_expert_intermediate_size:
            shared = mlp_plan(f"{prefix}.mlp.shared_experts", cfg.hidden_size, cfg.shared_expert_intermediate_size)
        return MoEWeights(
            router=linear_spec(f"{prefix}.mlp.gate.weight", cfg.num_experts, cfg.hidden_size, ("router", "embed")),
            gate_up=gate_up,
            down=down,
            shared=shared,
            router_bias=WeightSpec(Tensor(f"{prefix}.mlp.gate.e_score_correction_bias", (cfg.num_experts,)), ("router",)),
        )

    return model_plan(cfg, mlp_for_layer, attention_plan_fn=mla_plan, first_layer=first_layer)


# ---------------------------------------------------------------------------------------------
# Forward.


def rope_interleaved(x: Array, cos: Array, sin: Array) -> Array:
    """RoPE on (x0, x1), (x2, x3), ... pairs; the output lists the pairs' first elements, then their
    second ones (as transformers' apply_rotary_pos_emb_interleave: q and k alike, so scores agree)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, :, None, :half].astype(x.dtype), sin[:, :, None, :half].astype(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _project(x: Array, w: MLAWeights, cfg: ModelConfig, rope: tuple[Array, Array]):
    """q [B, T, H, qk_head_dim] (rope part roped) and the cache row [B, T, latent | roped key]."""
    m, (b, t, _) = cfg.mla, x.shape
    q_first = m.q_lora_rank or cfg.num_heads * m.qk_head_dim
    q, kv_a = jnp.split(linear(x, w.q_kv_a), [q_first], axis=-1)
    if m.q_lora_rank is not None:
        q = linear(rms_norm(q, w.q_a_norm, LORA_NORM_EPS), w.q_b)
    q = q.reshape(b, t, cfg.num_heads, m.qk_head_dim)
    q_nope, q_rope = jnp.split(q, [m.qk_nope_head_dim], axis=-1)
    latent, k_rope = jnp.split(kv_a, [m.kv_lora_rank], axis=-1)
    latent = rms_norm(latent, w.kv_a_norm, LORA_NORM_EPS)
    rotate = rope_interleaved if m.rope_interleave else apply_rope
    q_rope, k_rope = rotate(q_rope, *rope), rotate(k_rope[:, :, None, :], *rope)[:, :, 0]
    return jnp.concatenate([q_nope, q_rope], axis=-1), jnp.concatenate([latent, k_rope], axis=-1)


def _kv_b_halves(w: MLAWeights, cfg: ModelConfig) -> tuple[Array, Array]:
    """kv_b as W_uk [H, qk_nope, r] and W_uv [H, v, r]. A quantised kv_b (FP8 checkpoints) is dequantised
    here: both halves are used per head, not as one matmul."""
    m = cfg.mla
    kv_b = as_dense(w.kv_b, w.kv_a_norm.dtype).reshape(cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    return kv_b[:, : m.qk_nope_head_dim], kv_b[:, m.qk_nope_head_dim :]


def _einsum_f32(spec: str, a: Array, b: Array) -> Array:
    """A per-head einsum accumulated in float32. XLA:CPU has no batched bfloat16 x bfloat16 -> float32 dot
    ("Unsupported element type for DotThunk"): there the operands are widened first (CPU computes in float32
    anyway); accelerators take bfloat16 operands as they are."""
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def mla_attention(x: Array, w: MLAWeights, cfg: ModelConfig, rope, positions: Array, cache, layer: int) -> Array:
    """Absorbed MLA for [B, T] new tokens; their rows go into `cache` (updated in place)."""
    m, (b, t, _) = cfg.mla, x.shape
    q, row = _project(x, w, cfg, rope)
    w_uk, w_uv = _kv_b_halves(w, cfg)
    q_nope, q_rope = jnp.split(q, [m.qk_nope_head_dim], axis=-1)
    q_latent = _einsum_f32("bthn,hnr->bthr", q_nope, w_uk).astype(q.dtype)
    q_abs = jnp.concatenate([q_latent, q_rope], axis=-1)
    out = cache.update_and_attend_latent(cfg.kv_layer_index(layer), q_abs, row, positions, m.softmax_scale, m.kv_lora_rank)
    out = _einsum_f32("bthr,hvr->bthv", out, w_uv).astype(x.dtype)
    return linear(out.reshape(b, t, cfg.num_heads * m.v_head_dim), w.o)


def mla_attention_expanded(x: Array, w: MLAWeights, cfg: ModelConfig, rope, positions: Array, cache: KVCache, layer: int) -> Array:
    """The textbook form on the contiguous cache: every cached latent expanded to per-head keys and
    values through kv_b, then ordinary attention. The check of `mla_attention`."""
    m, (b, t, _) = cfg.mla, x.shape
    q, row = _project(x, w, cfg, rope)
    kv_layer = cfg.kv_layer_index(layer)
    rows = jnp.arange(b)[:, None]
    cache.k[kv_layer] = cache.k[kv_layer].at[rows, positions, 0].set(row.astype(cache.k[kv_layer].dtype), mode="drop")
    cached = cache.k[kv_layer][:, :, 0]  # [B, S, latent | rope key]
    latent, k_rope = jnp.split(cached, [m.kv_lora_rank], axis=-1)
    w_uk, w_uv = _kv_b_halves(w, cfg)
    k_nope = _einsum_f32("bsr,hnr->bshn", latent, w_uk).astype(x.dtype)
    v = _einsum_f32("bsr,hvr->bshv", latent, w_uv).astype(x.dtype)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None], (*k_nope.shape[:3], m.qk_rope_head_dim))], axis=-1)
    out = causal_attention(q, k, v, positions, sm_scale=m.softmax_scale)
    return linear(out.reshape(b, t, cfg.num_heads * m.v_head_dim), w.o)


def moe_sigmoid_grouped(
    x: Array, w: MoEWeights, cfg: ModelConfig, experts: Callable | None = None, positions: Array | None = None
) -> Array:
    """Group-limited sigmoid routing (computed per token, before any dispatch) -> routed experts, plus the
    always-on shared experts."""

    def route(flat):
        logits = jnp.einsum("th,eh->te", flat.astype(jnp.float32), w.router.astype(jnp.float32))
        k, groups, kept = cfg.num_experts_per_tok, cfg.num_expert_groups, cfg.topk_expert_groups
        return route_sigmoid_group_topk(logits, w.router_bias, k, groups, kept, cfg.norm_topk_prob, cfg.routed_scaling_factor)

    return moe_block(x, w, route, experts, positions)


def forward(
    weights: ModelWeights, cfg: ModelConfig, tokens, positions, cache, logits_indices=None, experts=None, attention_fn=None, **extra
):
    """`extra`: `decoder_forward`'s inputs_embeds / hidden_out (the multi-token-prediction head, mtp.py)."""
    return decoder_forward(
        weights,
        cfg,
        tokens,
        positions,
        cache,
        moe_sigmoid_grouped,
        logits_indices,
        experts,
        attention_fn=attention_fn or mla_attention,
        **extra,
    )


forward_expanded = partial(forward, attention_fn=mla_attention_expanded)
