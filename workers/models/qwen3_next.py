"""Qwen3-Next: Qwen3.5-MoE's predecessor, the same hybrid of Gated DeltaNet and gated full attention.

Differences from Qwen3.5-MoE (`qwen3_5_moe.py`, which documents the shared math):
- The linear-attention projections are fused and grouped per key head: `in_proj_qkvz` holds, for each key
  head, [q | k | v of its G value heads | z of its G value heads] and `in_proj_ba` [b (G) | a (G)]. Their
  rows are reordered at load time into Qwen3.5's layout, so both run the same forward.
- MLP: layer i is MoE (routed + sigmoid-gated shared expert) unless listed in `mlp_only_layers` or
  (i + 1) % decoder_sparse_step != 0, else a dense SwiGLU of `intermediate_size`; the top-k is
  renormalised iff `norm_topk_prob` (default true).
- Plain checkpoint layout (`model.`); `mtp.*` tensors are skipped.
"""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, build_config, common_fields, hybrid_fields, sparse_moe_layers
from .layers import ModelWeights, decoder_forward, moe_softmax_topk
from .linear_attention import gated_deltanet
from .plans import mlp_plan, model_plan, qwen3_next_linear_attention_plan
from .qwen3_5_moe import shared_expert_moe_plan

MODEL_TYPE = "qwen3_next"
SKIPPED_PREFIXES = ("mtp.",)


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    num_experts = raw.get("num_experts") or 0
    return build_config(
        **common_fields(raw),
        **hybrid_fields(raw),
        moe_layers=sparse_moe_layers(raw, num_experts),
        intermediate_size=raw.get("intermediate_size", 0),
        num_experts=num_experts,
        num_experts_per_tok=raw.get("num_experts_per_tok", 0),
        moe_intermediate_size=raw.get("moe_intermediate_size", 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0),
    )


def plan(cfg: ModelConfig, prefix: str = "model") -> ModelWeights:
    """`prefix`: where the decoder layers are stored (`mtp` for the multi-token-prediction head's, mtp.py)."""

    def mlp_for_layer(n: int, prefix: str):
        if not cfg.moe_layers[n]:
            return mlp_plan(f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size)
        return shared_expert_moe_plan(f"{prefix}.mlp", cfg)

    return model_plan(cfg, mlp_for_layer, qwen3_next_linear_attention_plan, prefix)


def forward(weights: ModelWeights, cfg: ModelConfig, tokens, positions, cache, logits_indices=None, experts=None, **extra):
    """`extra`: `decoder_forward`'s inputs_embeds / hidden_out (the multi-token-prediction head, mtp.py)."""
    return decoder_forward(
        weights, cfg, tokens, positions, cache, moe_softmax_topk, logits_indices, experts, linear_mixer=gated_deltanet, **extra
    )
