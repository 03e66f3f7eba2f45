"""Qwen3.5 (MoE, and its dense sibling): a hybrid of Gated DeltaNet and gated full-attention layers.

Model types: `qwen3_5_moe` / `qwen3_5` are the released vision-language composites; we serve their text
model (`text_config`, tensors under `model.language_model.`, `lm_head` at the top; the vision tower
`model.visual.*` and the multi-token-prediction head `mtp.*` are skipped). `qwen3_5_moe_text` /
`qwen3_5_text` are the text models (tensors under `model.`).

Layers: `layer_types` ("linear_attention" | "full_attention"), else every `full_attention_interval`-th
(default 4) layer is full attention.
- Linear attention: Gated DeltaNet (`linear_attention.py`), separate in_proj_qkv / z / b / a.
- Full attention: GQA whose q_proj yields per head [query | gate]; zero-centred RMSNorm on q and k per
  head; RoPE on the first `partial_rotary_factor` (default 0.25) of head_dim (text-only mRoPE is plain
  RoPE); output times sigmoid(gate) before o_proj.
- MLP (MoE): softmax over all experts -> top-k -> always renormalised, plus a shared expert gated by
  sigmoid(shared_expert_gate(x)); every layer. Dense: a SwiGLU of `intermediate_size`.
All other RMSNorms (input, post-attention, final) are zero-centred: norm(x) * (1 + w).
"""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, build_config, common_fields, hybrid_fields, text_config_from_hf
from .layers import ModelWeights, MoEWeights, decoder_forward, moe_softmax_topk
from .linear_attention import gated_deltanet
from .plans import experts_plan, linear_attention_plan, mlp_plan, model_plan
from .weights import linear_spec

MODEL_TYPE = "qwen3_5_moe"
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_text")
COMPOSITE_TYPES = ("qwen3_5_moe", "qwen3_5")  # vision-language checkpoints: text model under model.language_model
DENSE_TYPES = ("qwen3_5", "qwen3_5_text")
# Checkpoint tensors of parts we do not serve: the vision tower and the multi-token-prediction head.
SKIPPED_PREFIXES = ("model.visual.", "mtp.")


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    if raw["model_type"] in COMPOSITE_TYPES:
        raw = text_config_from_hf(raw)
    fields = common_fields(raw)
    n = fields["num_layers"]
    if raw["model_type"] in DENSE_TYPES:
        mlp = dict(moe_layers=(False,) * n, intermediate_size=raw.get("intermediate_size", 0))
    else:
        mlp = dict(
            moe_layers=(True,) * n,
            num_experts=raw.get("num_experts") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok", 0),
            moe_intermediate_size=raw.get("moe_intermediate_size", 0),
            norm_topk_prob=True,  # transformers always renormalises the top-k of Qwen3.5-MoE
            shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0),
        )
    return build_config(**fields, **hybrid_fields(raw), **mlp)


def shared_expert_moe_plan(prefix: str, cfg: ModelConfig) -> MoEWeights:
    """Routed experts (per expert or fused v5 tensors) plus a sigmoid-gated shared expert (also Qwen3-Next)."""
    h = cfg.hidden_size
    gate_up, down = experts_plan(f"{prefix}.experts", cfg)
    return MoEWeights(
        router=linear_spec(f"{prefix}.gate.weight", cfg.num_experts, h, ("router", "embed")),
        gate_up=gate_up,
        down=down,
        shared=mlp_plan(f"{prefix}.shared_expert", h, cfg.shared_expert_intermediate_size),
        shared_gate=linear_spec(f"{prefix}.shared_expert_gate.weight", 1, h, (None, "embed")),
    )


def plan(cfg: ModelConfig, prefix: str | None = None) -> ModelWeights:
    """`prefix`: where the decoder layers are stored (`mtp` for the multi-token-prediction head's, mtp.py)."""

    def mlp_for_layer(n: int, prefix: str):
        if not cfg.moe_layers[n]:
            return mlp_plan(f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size)
        return shared_expert_moe_plan(f"{prefix}.mlp", cfg)

    if prefix is None:
        prefix = "model.language_model" if cfg.model_type in COMPOSITE_TYPES else "model"
    return model_plan(cfg, mlp_for_layer, linear_attention_plan, prefix)


def forward(weights: ModelWeights, cfg: ModelConfig, tokens, positions, cache, logits_indices=None, experts=None, **extra):
    """`extra`: `decoder_forward`'s inputs_embeds / hidden_out (the multi-token-prediction head, mtp.py)."""
    return decoder_forward(
        weights, cfg, tokens, positions, cache, moe_softmax_topk, logits_indices, experts, linear_mixer=gated_deltanet, **extra
    )
