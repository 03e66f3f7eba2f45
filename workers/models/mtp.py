"""Multi-token-prediction (MTP) heads, loaded from the checkpoint for speculative decoding.

DeepSeek-V3 and Qwen3.5 / Qwen3-Next ship a small head trained to predict the token after next. At
position i it reads the target's last hidden state h_i (after the final norm) and the embedding of the
token at i + 1, and predicts the token at i + 2:

    x = proj(concat(enorm(embed(t[i+1])), hnorm(h_i)))  ->  decoder layer(s)  ->  norm  ->  LM head

The decoder layers are the family's own (DeepSeek: MLA + its MoE; Qwen: gated full attention + its MoE),
run with their own KV cache by the family's `forward` (`inputs_embeds` replaces the token embeddings); the
embedding table and the LM head are the target's. A chained step (the next draft) reads the head's own
hidden state in place of h: after its norm for Qwen (vLLM's Qwen3-Next MTP returns the normed state),
before it for DeepSeek (vLLM's DeepSeek MTP applies `shared_head.norm` only for the logits). As in vLLM,
DeepSeek's head sees a zero embedding at position 0.

Stored names (transformers skips them all; the peers' implementations and ../shared/reference/wave3.md
describe them):
- DeepSeek-V3: layer `model.layers.{num_hidden_layers}` (`num_nextn_predict_layers` = 1) holds `enorm`,
  `hnorm`, `eh_proj` [H, 2H], `shared_head.norm`, the decoder layer's usual tensors, and copies of the
  target's embedding and head (`embed_tokens`, `shared_head.head`; unused). Only the first such layer is
  served (each is a separate head for a further position; chained steps reuse the first, as vLLM does).
- Qwen3.5 / Qwen3-Next: `mtp.fc` [H, 2H], `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
  `mtp.layers.{j}` (`mtp_num_hidden_layers`, or `num_nextn_predict_layers`, default 1; all run in
  sequence), `mtp.norm`; norms zero-centred like the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from kernels.dense import matmul as dense_matmul

from .config import ModelConfig, ModelLoadError, read_config_json, text_config_from_hf
from .layers import LayerWeights, ModelWeights, norm
from .quant import quantize_plan
from .safetensors_io import CheckpointReader
from .weights import DEFAULT_RULES, linear_spec, load_weights, norm_spec, plan_leaves

FAMILIES = ("deepseek_v3", "qwen3_5_moe", "qwen3_next")


@dataclass(frozen=True)
class Layout:
    """Where a family stores its head, and how the head is run."""

    layers_prefix: str  # the decoder layers: {layers_prefix}.layers.{first_layer + j}
    first_layer: int
    enorm: str
    hnorm: str
    proj: str
    norm: str
    chain_normed: bool  # a chained step reads the head's normed output (else its residual stream)
    zero_first_embedding: bool


@jax.tree_util.register_dataclass
@dataclass
class MTPWeights:
    enorm: jax.Array  # [H] norm of the next token's embedding
    hnorm: jax.Array  # [H] norm of the target's hidden state
    proj: jax.Array  # [H, 2H]: [embedding | hidden] -> the layers' input
    layers: list[LayerWeights]
    norm: jax.Array  # [H] before the (target's) LM head


@dataclass
class MTPHead:
    """A loaded head: its own config (its decoder layers only: full attention, the family's MLP), weights,
    and how to run it. `forward` needs the target's weights for the embedding and the LM head."""

    family: ModuleType
    cfg: ModelConfig
    layout: Layout
    weights: MTPWeights

    def model_weights(self, target: ModelWeights) -> ModelWeights:
        """The head as a decoder stack the family's `forward` runs: its layers and norm, the target's
        embedding and LM head."""
        return ModelWeights(embed=target.embed, layers=self.weights.layers, final_norm=self.weights.norm, lm_head=target.lm_head)

    def forward(self, target: ModelWeights, tokens, positions, hidden, cache, logits_indices=None, experts=None):
        """tokens [..., T] (the token after each position), positions [..., T], hidden [..., T, H] (the
        target's normed hidden state at each position, or the head's own for a chained step) ->
        (float32 logits, cache, the head's hidden state [..., T, H] to chain from)."""
        return forward(self, target, tokens, positions, hidden, cache, logits_indices, experts)


def family_name(family: ModuleType) -> str:
    return family.__name__.rsplit(".", 1)[-1]


def num_heads_stored(family: ModuleType, raw: dict[str, Any]) -> int:
    """How many MTP layers the config declares (0: none)."""
    if family_name(family) == "deepseek_v3":
        return int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0)
    text = text_config_from_hf(raw) if "text_config" in raw else raw
    return int(text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 1)) or 0)


def layout(family: ModuleType, cfg: ModelConfig) -> Layout:
    name = family_name(family)
    if name == "deepseek_v3":
        p = f"model.layers.{cfg.num_layers}"
        return Layout(
            "model",
            cfg.num_layers,
            f"{p}.enorm.weight",
            f"{p}.hnorm.weight",
            f"{p}.eh_proj.weight",
            f"{p}.shared_head.norm.weight",
            False,
            True,
        )
    if name in ("qwen3_5_moe", "qwen3_next"):
        return Layout(
            "mtp", 0, "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight", "mtp.norm.weight", True, False
        )
    raise ModelLoadError(f"{cfg.model_type}: no multi-token-prediction head is known for this family (only {', '.join(FAMILIES)})")


def head_config(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    """The head's decoder layers as a model of their own: full attention (no linear, sliding or shared-KV
    layers), the family's MoE when the model has experts."""
    data = cfg.model_dump()
    data.update(
        num_layers=num_layers,
        sliding_windows=(None,) * num_layers,
        moe_layers=(any(cfg.moe_layers),) * num_layers,
        linear_attention_layers=(),
        layer_head_dims=(),
        layer_kv_heads=(),
        kv_source_layers=(),
    )
    return ModelConfig.model_validate(data)


def plan(family: ModuleType, cfg: ModelConfig, raw: dict[str, Any]) -> tuple[ModelConfig, Layout, MTPWeights]:
    """The head's config, layout and weight plan (`WeightSpec` leaves)."""
    where = layout(family, cfg)
    stored = num_heads_stored(family, raw)
    if stored < 1:
        key = "num_nextn_predict_layers" if family_name(family) == "deepseek_v3" else "mtp_num_hidden_layers"
        raise ModelLoadError(f"config.json: {key} is 0: the checkpoint has no multi-token-prediction head (speculative method mtp)")
    n = 1 if family_name(family) == "deepseek_v3" else stored
    head_cfg = head_config(cfg, n)
    if family_name(family) == "deepseek_v3":
        stack = family.plan(head_cfg, first_layer=where.first_layer)
    else:
        stack = family.plan(head_cfg, prefix=where.layers_prefix)
    h, zc = cfg.hidden_size, cfg.zero_centered_norm
    weights = MTPWeights(
        enorm=norm_spec(where.enorm, h, zc),
        hnorm=norm_spec(where.hnorm, h, zc),
        proj=linear_spec(where.proj, h, 2 * h, ("embed", None)),
        layers=stack.layers,
        norm=norm_spec(where.norm, h, zc),
    )
    return head_cfg, where, weights


def load(model_dir: str | Path, family: ModuleType, cfg: ModelConfig, mesh, dtype, rules=None) -> MTPHead:
    """Reads the head from the target's checkpoint; a missing tensor is a load error naming it."""
    raw = read_config_json(model_dir)
    head_cfg, where, specs = plan(family, cfg, raw)
    specs = quantize_plan(specs, raw)
    reader = CheckpointReader(model_dir)
    for spec in plan_leaves(specs):
        spec.source.check(reader)
    weights = load_weights(specs, reader, mesh, DEFAULT_RULES if rules is None else rules, dtype)
    return MTPHead(family, head_cfg, where, weights)


def forward(head: MTPHead, target: ModelWeights, tokens, positions, hidden, cache, logits_indices=None, experts=None):
    w, cfg = head.weights, head.cfg
    embedded = target.embed[tokens]
    if head.layout.zero_first_embedding:
        embedded = jnp.where((positions == 0)[..., None], 0, embedded)
    joined = jnp.concatenate([norm(embedded, w.enorm, cfg), norm(hidden.astype(embedded.dtype), w.hnorm, cfg)], axis=-1)
    x = dense_matmul(joined, w.proj).astype(embedded.dtype)
    return head.family.forward(
        head.model_weights(target),
        cfg,
        tokens,
        positions,
        cache,
        logits_indices,
        experts=experts,
        inputs_embeds=x,
        hidden_out="normed" if head.layout.chain_normed else "residual",
    )
