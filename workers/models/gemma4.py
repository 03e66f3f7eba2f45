"""Gemma 4 (dense and MoE): sliding-window and full-attention layers of different shapes, KV-shared layers,
per-layer input embeddings.

Model types: `gemma4` is the released multimodal composite; we serve its text model (`text_config`, tensors
under `model.language_model.`; the vision and audio towers and their embedders are skipped with one log
line). `gemma4_text` is the text model (tensors under `model.`). The math is transformers 5.x's:

- Layers: `layer_types` (default: every 6th full, the rest sliding; the last is always full). Sliding layers
  see `sliding_window` keys including the query, default RoPE (theta of `rope_parameters.sliding_attention`)
  over `head_dim`. Full layers use `global_head_dim` and `num_global_key_value_heads` (the latter only with
  `attention_k_eq_v`), or the saved `per_layer_config`, and "proportional" RoPE: the first
  int(partial * hd / 2) frequencies theta^(-2j/hd), the rest 0, rotate-half over the whole head.
- Attention: scale 1; per-head RMSNorm on q and k (weighted) and v (unweighted), RoPE after the norms. With
  `attention_k_eq_v` full layers have no v_proj: V = v_norm(k_proj x).
- KV sharing: the last `num_kv_shared_layers` layers have no k/v weights and attend the cache of the last
  earlier non-shared layer of their type (ModelConfig.kv_source_layers); they write no cache.
- Block: h = x + post_attn(attn(input_norm x)); m = mlp(pre_ff h) with a GeGLU (gelu_tanh) MLP; MoE models
  add the experts beside it: m = post_ff_1(m) + post_ff_2(experts(pre_ff_2 h)), routed from h; then
  h = h + post_ff(m); per-layer input (below); h *= layer_scalar.
- Per-layer inputs: tok = embed_tokens_per_layer(ids) * sqrt(P) as [.., L, P]; ctx = RMSNorm(
  per_layer_model_projection(emb) * H^-0.5); pl = (ctx + tok) / sqrt(2); layer i adds
  post_per_layer_input_norm(per_layer_projection(gelu_tanh(per_layer_input_gate h) * pl[i])).
- Router: RMSNorm without weight, * router.scale * H^-0.5, proj, softmax over all experts, top-k,
  renormalised, * per_expert_scale[expert]. Experts' activation gelu_tanh (kernels.moe.ACTIVATIONS).
- RMSNorm: x * (mean(x^2) + eps)^-0.5 * w in float32 (plain w). Embedding * sqrt(H) in the weights' dtype.
  Logits soft-capped: tanh(z / c) * c.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from kernels.dense import matmul as dense_matmul
from kernels.moe import routed_experts
from kernels.quant import QuantizedWeight, quantized_matmul

from .config import Gemma4Settings, ModelConfig, ModelLoadError, build_config, common_fields, text_config_from_hf
from .layers import MLPWeights, apply_rope, linear, physical_ids
from .plans import mlp_plan
from .weights import Concat, Tensor, WeightSpec, fused_experts, linear_spec, norm_spec

log = logging.getLogger("moray.models")

MODEL_TYPE = "gemma4_text"
MODEL_TYPES = ("gemma4", "gemma4_text")
COMPOSITE_TYPE = "gemma4"
# The composite's parts we do not serve.
SKIPPED_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# Config.


def _fail(message: str):
    raise ModelLoadError(f"config.json: {message}")


def _layer_types(raw: dict[str, Any], n: int) -> list[str]:
    types = list(raw.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    if len(types) != n:
        _fail("layer_types must have num_hidden_layers entries")
    for t in types:
        if t not in (SLIDING, FULL):
            _fail(f"unsupported layer type '{t}' in layer_types (supported: {SLIDING}, {FULL})")
    if types[-1] != FULL:  # transformers forces it too (with a warning)
        log.info("gemma4: the last layer is always full attention (layer_types said %s)", types[-1])
        types[-1] = FULL
    return types


def _rope_params(raw: dict[str, Any]) -> tuple[dict, dict]:
    params = raw.get("rope_parameters") or {}
    sliding = params.get(SLIDING) or {"rope_type": "default", "rope_theta": 10_000.0}
    full = params.get(FULL) or {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}
    if sliding.get("rope_type", "default") != "default":
        _fail(f"rope_parameters.{SLIDING}.rope_type '{sliding['rope_type']}' is not supported (supported: default)")
    if full.get("rope_type", "default") not in ("default", "proportional"):
        _fail(f"rope_parameters.{FULL}.rope_type '{full['rope_type']}' is not supported (supported: proportional, default)")
    return sliding, full


def _full_layer_shape(raw: dict[str, Any], layer: int, head_dim: int, kv_heads: int) -> tuple[int, int]:
    """(head_dim, kv_heads) of full layer `layer`: the saved per_layer_config (transformers 5 writes it), else
    `global_head_dim` (default 512) and, with attention_k_eq_v, `num_global_key_value_heads`."""
    saved = raw.get("per_layer_config")
    if isinstance(saved, dict):
        override = saved.get(str(layer), saved.get(layer)) or {}
        return int(override.get("head_dim", head_dim)), int(override.get("num_key_value_heads", kv_heads))
    dim = int(raw.get("global_head_dim") or 512)
    global_kv = raw.get("num_global_key_value_heads")
    return dim, int(global_kv) if raw.get("attention_k_eq_v") and global_kv else kv_heads


def _kv_sources(types: list[str], num_shared: int) -> tuple[int, ...]:
    """Per layer the layer whose KV it attends: the last `num_shared` layers reuse the last earlier
    non-shared layer of their type (transformers' kv_sharing_modes)."""
    n = len(types)
    if not 0 <= num_shared < n:
        _fail(f"num_kv_shared_layers ({num_shared}) must be in [0, num_hidden_layers={n})")
    first_shared = n - num_shared
    sources = list(range(n))
    for layer in range(first_shared, n):
        producers = [i for i in range(first_shared) if types[i] == types[layer]]
        if not producers:
            _fail(f"num_kv_shared_layers: layer {layer} ({types[layer]}) has no earlier {types[layer]} layer to reuse the KV of")
        sources[layer] = producers[-1]
    return tuple(sources)


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    if raw["model_type"] == COMPOSITE_TYPE:
        raw = text_config_from_hf(raw)
    if raw.get("hidden_activation", "gelu_pytorch_tanh") not in ACTIVATIONS:
        _fail(f"hidden_activation '{raw['hidden_activation']}' is not supported (supported: gelu_pytorch_tanh)")
    if raw.get("use_bidirectional_attention") == "all":
        _fail("use_bidirectional_attention 'all' is not supported (a causal decoder is served)")
    if raw.get("attention_bias"):
        _fail("attention_bias true is not supported for gemma4")
    sliding_rope, full_rope = _rope_params(raw)
    # The shared fields, with the sliding layers' RoPE as the model's (full layers compute their own).
    fields = common_fields({**raw, "rope_parameters": sliding_rope, "tie_word_embeddings": raw.get("tie_word_embeddings", True)})
    n = fields["num_layers"]
    types = _layer_types(raw, n)
    window = raw.get("sliding_window") or 512
    head_dims, kv_heads = [], []
    for i, t in enumerate(types):
        d, h = (
            (fields["head_dim"], fields["num_kv_heads"])
            if t == SLIDING
            else _full_layer_shape(raw, i, fields["head_dim"], fields["num_kv_heads"])
        )
        head_dims.append(d)
        kv_heads.append(h)
    num_shared = int(raw.get("num_kv_shared_layers") or 0)
    sources = _kv_sources(types, num_shared)
    inter = int(raw.get("intermediate_size") or 0)
    if inter <= 0:
        _fail("gemma4 needs a positive intermediate_size (every layer has a dense MLP)")
    double = bool(raw.get("use_double_wide_mlp"))
    moe = bool(raw.get("enable_moe_block"))
    ple = int(raw.get("hidden_size_per_layer_input") or 0)
    ple_vocab = int(raw.get("vocab_size_per_layer_input") or 0) if ple else 0
    if ple and ple_vocab < fields["vocab_size"]:
        _fail(f"vocab_size_per_layer_input ({ple_vocab}) must cover vocab_size ({fields['vocab_size']})")
    gemma = Gemma4Settings(
        full_rope_theta=float(full_rope.get("rope_theta", 1_000_000.0)),
        full_partial_rotary_factor=float(full_rope.get("partial_rotary_factor", 1.0)),
        full_rope_factor=float(full_rope.get("factor") or 1.0),
        attention_k_eq_v=bool(raw.get("attention_k_eq_v")),
        final_logit_softcapping=raw.get("final_logit_softcapping") or None,
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=ple_vocab,
        layer_intermediate_sizes=tuple(inter * (2 if double and sources[i] != i else 1) for i in range(n)),
    )
    moe_fields = {}
    if moe:
        moe_fields = dict(
            num_experts=int(raw.get("num_experts") or 0),
            num_experts_per_tok=int(raw.get("top_k_experts") or 0),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            norm_topk_prob=True,
            expert_activation="gelu_tanh",
        )
    return build_config(
        **fields,
        qk_norm=True,
        sliding_windows=tuple(window if t == SLIDING else None for t in types),
        moe_layers=(moe,) * n,
        intermediate_size=inter,
        layer_head_dims=tuple(head_dims),
        layer_kv_heads=tuple(kv_heads),
        kv_source_layers=sources if num_shared else (),
        gemma4=gemma,
        **moe_fields,
    )


def skipped_prefixes(raw: dict[str, Any]) -> tuple[str, ...]:
    return SKIPPED_PREFIXES if raw.get("model_type") == COMPOSITE_TYPE else ()


# ---------------------------------------------------------------------------------------------
# Weights.


@jax.tree_util.register_dataclass
@dataclass
class Gemma4Attention:
    # [q | k | v] rows, [q | k] for full layers with attention_k_eq_v, only q for a KV-shared layer.
    qkv: Array
    o: Array  # [hidden, heads * head_dim]
    q_norm: Array  # [head_dim]
    k_norm: Array | None = None  # None on KV-shared layers


@jax.tree_util.register_dataclass
@dataclass
class Gemma4Experts:
    router: Array  # [E, hidden]
    router_scale: Array  # [hidden]
    per_expert_scale: Array  # [E]
    gate_up: Array  # [E (or R physical slots), 2 * moe_intermediate, hidden]
    down: Array  # [E, hidden, moe_intermediate]
    pre_norm: Array  # pre_feedforward_layernorm_2
    post_norm_mlp: Array  # post_feedforward_layernorm_1 (the dense MLP's output)
    post_norm: Array  # post_feedforward_layernorm_2 (the experts' output)
    log2phy: Array | None = None  # redundant experts, as layers.MoEWeights
    logcnt: Array | None = None


@jax.tree_util.register_dataclass
@dataclass
class PerLayerInput:
    gate: Array  # [P, hidden]
    projection: Array  # [hidden, P]
    norm: Array  # [hidden]


@jax.tree_util.register_dataclass
@dataclass
class Gemma4Layer:
    input_norm: Array
    attn: Gemma4Attention
    post_attn_norm: Array
    pre_ff_norm: Array
    mlp: MLPWeights
    post_ff_norm: Array
    layer_scalar: Array  # [1]
    experts: Gemma4Experts | None = None
    per_layer_input: PerLayerInput | None = None


@jax.tree_util.register_dataclass
@dataclass
class Gemma4Weights:
    embed: Array  # [vocab, hidden]
    layers: list[Gemma4Layer]
    final_norm: Array
    lm_head: Array | None = None  # None when tied to `embed`
    per_layer_embed: Array | None = None  # [vocab_per_layer, layers * P]
    per_layer_model_projection: Array | None = None  # [layers * P, hidden]
    per_layer_projection_norm: Array | None = None  # [P]


def _attention_plan(prefix: str, cfg: ModelConfig, layer: int) -> Gemma4Attention:
    h, d = cfg.hidden_size, cfg.layer_head_dim(layer)
    q = cfg.num_heads * d
    kv = cfg.layer_num_kv_heads(layer) * d
    shared = cfg.kv_source_layer(layer) != layer
    rows = [Tensor(f"{prefix}.q_proj.weight", (q, h))]
    if not shared:
        rows.append(Tensor(f"{prefix}.k_proj.weight", (kv, h)))
        if not _k_eq_v(cfg, layer):
            rows.append(Tensor(f"{prefix}.v_proj.weight", (kv, h)))
    return Gemma4Attention(
        qkv=WeightSpec(Concat(tuple(rows)) if len(rows) > 1 else rows[0], ("heads", "embed")),
        o=linear_spec(f"{prefix}.o_proj.weight", h, q, ("embed", "heads")),
        q_norm=norm_spec(f"{prefix}.q_norm.weight", d),
        k_norm=None if shared else norm_spec(f"{prefix}.k_norm.weight", d),
    )


def _k_eq_v(cfg: ModelConfig, layer: int) -> bool:
    return cfg.gemma4.attention_k_eq_v and cfg.sliding_windows[layer] is None


def _experts_plan(prefix: str, cfg: ModelConfig) -> Gemma4Experts:
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    # transformers 5 stores fused [E, 2I, H] / [E, H, I]; per-expert tensors (a quantised export) also load.
    gate_up = [
        Concat((Tensor(f"{prefix}.experts.{x}.gate_proj.weight", (i, h)), Tensor(f"{prefix}.experts.{x}.up_proj.weight", (i, h))))
        for x in range(e)
    ]
    down = [Tensor(f"{prefix}.experts.{x}.down_proj.weight", (h, i)) for x in range(e)]
    vector = lambda name, dim, axes, scale=None: WeightSpec(Tensor(f"{prefix}.{name}", (dim,)), axes, init_scale=scale)
    return Gemma4Experts(
        router=linear_spec(f"{prefix}.router.proj.weight", e, h, ("router", "embed")),
        router_scale=vector("router.scale", h, (None,)),
        per_expert_scale=vector("router.per_expert_scale", e, (None,)),
        gate_up=WeightSpec(fused_experts(gate_up, f"{prefix}.experts.gate_up_proj"), ("experts", "moe_mlp", "embed")),
        down=WeightSpec(fused_experts(down, f"{prefix}.experts.down_proj"), ("experts", "embed", "moe_mlp")),
        pre_norm=norm_spec(f"{prefix}.pre_feedforward_layernorm_2.weight", h),
        post_norm_mlp=norm_spec(f"{prefix}.post_feedforward_layernorm_1.weight", h),
        post_norm=norm_spec(f"{prefix}.post_feedforward_layernorm_2.weight", h),
    )


def plan(cfg: ModelConfig) -> Gemma4Weights:
    g, h = cfg.gemma4, cfg.hidden_size
    prefix = "model.language_model" if cfg.model_type == COMPOSITE_TYPE else "model"
    p_dim = g.hidden_size_per_layer_input
    layers = []
    for n in range(cfg.num_layers):
        p = f"{prefix}.layers.{n}"
        ple = None
        if p_dim:
            ple = PerLayerInput(
                gate=linear_spec(f"{p}.per_layer_input_gate.weight", p_dim, h, (None, "embed")),
                projection=linear_spec(f"{p}.per_layer_projection.weight", h, p_dim, ("embed", None)),
                norm=norm_spec(f"{p}.post_per_layer_input_norm.weight", h),
            )
        layers.append(
            Gemma4Layer(
                input_norm=norm_spec(f"{p}.input_layernorm.weight", h),
                attn=_attention_plan(f"{p}.self_attn", cfg, n),
                post_attn_norm=norm_spec(f"{p}.post_attention_layernorm.weight", h),
                pre_ff_norm=norm_spec(f"{p}.pre_feedforward_layernorm.weight", h),
                mlp=mlp_plan(f"{p}.mlp", h, g.layer_intermediate_sizes[n]),
                post_ff_norm=norm_spec(f"{p}.post_feedforward_layernorm.weight", h),
                layer_scalar=WeightSpec(Tensor(f"{p}.layer_scalar", (1,)), (None,), init_scale=None),
                experts=_experts_plan(p, cfg) if cfg.moe_layers[n] else None,
                per_layer_input=ple,
            )
        )
    total = cfg.num_layers * p_dim
    return Gemma4Weights(
        embed=linear_spec(f"{prefix}.embed_tokens.weight", cfg.vocab_size, h, ("vocab", "embed")),
        layers=layers,
        final_norm=norm_spec(f"{prefix}.norm.weight", h),
        lm_head=None if cfg.tie_word_embeddings else linear_spec("lm_head.weight", cfg.vocab_size, h, ("vocab", "embed")),
        per_layer_embed=linear_spec(f"{prefix}.embed_tokens_per_layer.weight", g.vocab_size_per_layer_input, total, ("vocab", None))
        if p_dim
        else None,
        per_layer_model_projection=linear_spec(f"{prefix}.per_layer_model_projection.weight", total, h, (None, "embed")) if p_dim else None,
        per_layer_projection_norm=norm_spec(f"{prefix}.per_layer_projection_norm.weight", p_dim) if p_dim else None,
    )


# ---------------------------------------------------------------------------------------------
# Forward.


def gemma_norm(x: Array, weight: Array | None, eps: float) -> Array:
    """RMSNorm scaled by the (plain) weight in float32 before the cast back; no weight: v_norm, router."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf if weight is None else xf * weight.astype(jnp.float32)).astype(x.dtype)


def gelu_tanh(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=True)


def _inv_freq(cfg: ModelConfig, layer: int) -> np.ndarray:
    """Per layer kind: [head_dim / 2] frequencies, zeros past the rotated ones (proportional RoPE)."""
    hd = cfg.layer_head_dim(layer)
    if cfg.sliding_windows[layer] is not None:
        return 1.0 / (cfg.rope.theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    g = cfg.gemma4
    rotated = int(g.full_partial_rotary_factor * hd // 2)
    freq = np.zeros(hd // 2, np.float32)
    freq[:rotated] = 1.0 / (g.full_rope_theta ** (np.arange(0, 2 * rotated, 2, dtype=np.float32) / hd))
    return freq / g.full_rope_factor


def _cos_sin(inv_freq: np.ndarray, positions: Array, dtype) -> tuple[Array, Array]:
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def attention(x: Array, w: Gemma4Attention, cfg: ModelConfig, layer: int, rope, positions: Array, cache) -> Array:
    b, t, _ = x.shape
    d, kv_heads = cfg.layer_head_dim(layer), cfg.layer_num_kv_heads(layer)
    eps, window = cfg.rms_norm_eps, cfg.sliding_windows[layer]
    proj = linear(x, w.qkv)
    q = gemma_norm(proj[..., : cfg.num_heads * d].reshape(b, t, cfg.num_heads, d), w.q_norm, eps)
    q = apply_rope(q, *rope)
    kv_layer = cfg.kv_layer_index(layer)
    if w.k_norm is None:  # a KV-shared layer: attends the cache of the layer it reuses
        out = cache.attend(kv_layer, q, positions, window, sm_scale=1.0)
    else:
        rest = proj[..., cfg.num_heads * d :].reshape(b, t, -1, kv_heads, d)
        k_raw = rest[:, :, 0]
        v_raw = k_raw if _k_eq_v(cfg, layer) else rest[:, :, 1]
        k = apply_rope(gemma_norm(k_raw, w.k_norm, eps), *rope)
        v = gemma_norm(v_raw, None, eps)
        out = cache.update_and_attend(kv_layer, q, k, v, positions, window, sm_scale=1.0)
    return linear(out.reshape(b, t, cfg.num_heads * d), w.o)


def geglu_mlp(x: Array, w: MLPWeights) -> Array:
    gate, up = jnp.split(linear(x, w.gate_up), 2, axis=-1)
    return linear(gelu_tanh(gate) * up, w.down)


def routed(h: Array, w: Gemma4Experts, cfg: ModelConfig, experts: Callable | None, positions: Array | None = None) -> Array:
    """The expert block beside the dense MLP: routed from the block's input h [B, T, H]."""
    shape = h.shape
    flat = h.reshape(-1, shape[-1])
    scaled = gemma_norm(flat, None, cfg.rms_norm_eps) * w.router_scale * jnp.asarray(cfg.hidden_size**-0.5, flat.dtype)
    probs = jax.nn.softmax(linear(scaled, w.router).astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    top = top / jnp.sum(top, axis=-1, keepdims=True)
    weights = top * w.per_expert_scale.astype(jnp.float32)[ids]
    x = gemma_norm(flat, w.pre_norm, cfg.rms_norm_eps)
    ids = ids.astype(jnp.int32)
    if w.log2phy is not None:
        ids = physical_ids(ids, w.log2phy, w.logcnt, positions)
    out = (experts or routed_experts)(x, ids, weights.astype(x.dtype), w.gate_up, w.down, activation=cfg.expert_activation)
    return out.reshape(shape)


def block(x: Array, lw: Gemma4Layer, cfg: ModelConfig, layer: int, rope, positions, cache, per_layer_input, experts) -> Array:
    eps = cfg.rms_norm_eps
    h = x + gemma_norm(attention(gemma_norm(x, lw.input_norm, eps), lw.attn, cfg, layer, rope, positions, cache), lw.post_attn_norm, eps)
    m = geglu_mlp(gemma_norm(h, lw.pre_ff_norm, eps), lw.mlp)
    if lw.experts is not None:
        e = lw.experts
        m = gemma_norm(m, e.post_norm_mlp, eps) + gemma_norm(routed(h, e, cfg, experts, positions), e.post_norm, eps)
    h = h + gemma_norm(m, lw.post_ff_norm, eps)
    if lw.per_layer_input is not None:
        p = lw.per_layer_input
        gated = gelu_tanh(linear(h, p.gate)) * per_layer_input
        h = h + gemma_norm(linear(gated, p.projection), p.norm, eps)
    return h * lw.layer_scalar.astype(h.dtype)


def per_layer_inputs(weights: Gemma4Weights, cfg: ModelConfig, tokens: Array, embeds: Array) -> Array:
    """[B, T, layers, P]: the token's own per-layer embedding mixed with a projection of its embedding."""
    p = cfg.gemma4.hidden_size_per_layer_input
    shape = (*tokens.shape, cfg.num_layers, p)
    tok = (weights.per_layer_embed[tokens] * jnp.asarray(p**0.5, embeds.dtype)).reshape(shape)
    ctx = linear(embeds, weights.per_layer_model_projection) * jnp.asarray(cfg.hidden_size**-0.5, embeds.dtype)
    ctx = gemma_norm(ctx.reshape(shape), weights.per_layer_projection_norm, cfg.rms_norm_eps)
    return (ctx + tok) * jnp.asarray(2.0**-0.5, embeds.dtype)


def forward(weights: Gemma4Weights, cfg: ModelConfig, tokens, positions, cache, logits_indices=None, experts=None):
    """float32 logits [B, T, vocab] (or [len(logits_indices), vocab]) and the updated cache."""
    embeds = weights.embed[tokens]
    x = embeds * jnp.asarray(cfg.hidden_size**0.5, embeds.dtype)
    ple = per_layer_inputs(weights, cfg, tokens, x) if cfg.gemma4.hidden_size_per_layer_input else None
    ropes: dict[tuple[int, bool], tuple[Array, Array]] = {}
    cache = jax.tree.map(lambda a: a, cache)  # a shallow copy whose per-layer lists we may replace
    for layer, lw in enumerate(weights.layers):
        key = (cfg.layer_head_dim(layer), cfg.sliding_windows[layer] is None)
        if key not in ropes:
            ropes[key] = _cos_sin(_inv_freq(cfg, layer), positions, x.dtype)
        with jax.named_scope(f"layer_{layer}"):
            x = block(x, lw, cfg, layer, ropes[key], positions, cache, None if ple is None else ple[:, :, layer], experts)
    if logits_indices is not None:
        x = x.reshape(-1, x.shape[-1])[logits_indices]
    x = gemma_norm(x, weights.final_norm, cfg.rms_norm_eps)
    head = weights.embed if weights.lm_head is None else weights.lm_head
    if isinstance(head, QuantizedWeight):
        logits = quantized_matmul(x, head)
    else:
        logits = dense_matmul(x, head)
    cap = cfg.gemma4.final_logit_softcapping
    if cap:
        logits = jnp.tanh(logits / cap) * cap
    return logits, cache
