"""Qwen2-MoE.

Attention: GQA with biases on q, k and v (`qkv_bias`, default true), none on o.
MLP: MoE layers chosen like Qwen3-MoE; each MoE layer adds a shared expert gated per token:
out = routed + sigmoid(shared_expert_gate(x)) * shared_expert(x).
Sliding window on the layers `layer_types` marks "sliding_attention" (transformers 5.x rule when absent).
"""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, build_config, common_fields, sparse_moe_layers, windows_from_layer_types
from .layers import ModelWeights, MoEWeights, decoder_forward, moe_softmax_topk
from .plans import experts_plan, mlp_plan, model_plan
from .weights import linear_spec

MODEL_TYPE = "qwen2_moe"


def _default_layer_types(raw: dict[str, Any], n: int) -> list[str]:
    use = bool(raw.get("use_sliding_window"))
    max_window_layers = raw.get("max_window_layers", 28)
    return ["sliding_attention" if use and (i + 1) % 2 and i < max_window_layers else "full_attention" for i in range(n)]


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    num_experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    fields = common_fields(raw)
    return build_config(
        **fields,
        qkv_bias=bool(raw.get("qkv_bias", True)),
        sliding_windows=windows_from_layer_types(raw, _default_layer_types(raw, fields["num_layers"])),
        moe_layers=sparse_moe_layers(raw, num_experts),
        intermediate_size=raw.get("intermediate_size", 0),
        num_experts=num_experts,
        num_experts_per_tok=raw.get("num_experts_per_tok", 0),
        moe_intermediate_size=raw.get("moe_intermediate_size", 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0),
    )


def plan(cfg: ModelConfig) -> ModelWeights:
    h = cfg.hidden_size

    def mlp_for_layer(n: int, prefix: str):
        if not cfg.moe_layers[n]:
            return mlp_plan(f"{prefix}.mlp", h, cfg.intermediate_size)
        gate_up, down = experts_plan(f"{prefix}.mlp.experts", cfg)
        return MoEWeights(
            router=linear_spec(f"{prefix}.mlp.gate.weight", cfg.num_experts, h, ("router", "embed")),
            gate_up=gate_up,
            down=down,
            shared=mlp_plan(f"{prefix}.mlp.shared_expert", h, cfg.shared_expert_intermediate_size),
            shared_gate=linear_spec(f"{prefix}.mlp.shared_expert_gate.weight", 1, h, (None, "embed")),
        )

    return model_plan(cfg, mlp_for_layer)


def forward(weights: ModelWeights, cfg: ModelConfig, tokens, positions, cache, logits_indices=None, experts=None):
    return decoder_forward(weights, cfg, tokens, positions, cache, moe_softmax_topk, logits_indices, experts)
