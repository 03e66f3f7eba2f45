"""Mixtral.

Attention: plain GQA (no q/k norm, no biases), optional sliding window on every layer.
MLP: every layer is MoE; experts are `block_sparse_moe.experts.I.{w1,w3,w2}` (gate, up, down).
Router: softmax in float32 over all experts -> top-k (2) -> always renormalised.
"""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, build_config, common_fields
from .layers import ModelWeights, MoEWeights, decoder_forward, moe_softmax_topk
from .plans import experts_plan, model_plan
from .weights import linear_spec

MODEL_TYPE = "mixtral"


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    fields = common_fields(raw)
    n = fields["num_layers"]
    return build_config(
        **fields,
        sliding_windows=(raw.get("sliding_window") or None,) * n,
        moe_layers=(True,) * n,
        num_experts=raw.get("num_local_experts") or raw.get("num_experts") or 0,
        num_experts_per_tok=raw.get("num_experts_per_tok", 2),
        moe_intermediate_size=raw.get("intermediate_size", 0),
        norm_topk_prob=True,
    )


def plan(cfg: ModelConfig) -> ModelWeights:
    def mlp_for_layer(n: int, prefix: str):
        p = f"{prefix}.block_sparse_moe"
        gate_up, down = experts_plan(f"{p}.experts", cfg, names=("w1", "w3", "w2"))
        router = linear_spec(f"{p}.gate.weight", cfg.num_experts, cfg.hidden_size, ("router", "embed"))
        return MoEWeights(router=router, gate_up=gate_up, down=down)

    return model_plan(cfg, mlp_for_layer)


def forward(weights: ModelWeights, cfg: ModelConfig, tokens, positions, cache, logits_indices=None, experts=None):
    return decoder_forward(weights, cfg, tokens, positions, cache, moe_softmax_topk, logits_indices, experts)
