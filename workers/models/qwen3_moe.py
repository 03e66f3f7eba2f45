"""Qwen3-MoE.

Attention: GQA with a per-head RMSNorm on q and k (over head_dim) before RoPE; no biases by default.
MLP: layer i is MoE unless listed in `mlp_only_layers` or (i + 1) % decoder_sparse_step != 0, else a dense
SwiGLU. Router: softmax in float32 over all experts -> top-k -> renormalised iff `norm_topk_prob`.
Optional sliding window on every layer when `use_sliding_window`.
"""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, build_config, common_fields, sparse_moe_layers
from .layers import ModelWeights, MoEWeights, decoder_forward, moe_softmax_topk
from .plans import experts_plan, mlp_plan, model_plan
from .weights import linear_spec

MODEL_TYPE = "qwen3_moe"


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    num_experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    fields = common_fields(raw)
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    return build_config(
        **fields,
        qk_norm=True,
        qkv_bias=bool(raw.get("attention_bias", False)),
        sliding_windows=(window or None,) * fields["num_layers"],
        moe_layers=sparse_moe_layers(raw, num_experts),
        intermediate_size=raw.get("intermediate_size", 0),
        num_experts=num_experts,
        num_experts_per_tok=raw.get("num_experts_per_tok", 0),
        moe_intermediate_size=raw.get("moe_intermediate_size", 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )


def plan(cfg: ModelConfig) -> ModelWeights:
    def mlp_for_layer(n: int, prefix: str):
        if not cfg.moe_layers[n]:
            return mlp_plan(f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size)
        gate_up, down = experts_plan(f"{prefix}.mlp.experts", cfg)
        router = linear_spec(f"{prefix}.mlp.gate.weight", cfg.num_experts, cfg.hidden_size, ("router", "embed"))
        return MoEWeights(router=router, gate_up=gate_up, down=down)

    return model_plan(cfg, mlp_for_layer)


def forward(weights: ModelWeights, cfg: ModelConfig, tokens, positions, cache, logits_indices=None, experts=None):
    return decoder_forward(weights, cfg, tokens, positions, cache, moe_softmax_topk, logits_indices, experts)
