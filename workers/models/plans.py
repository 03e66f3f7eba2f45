"""Weight plans for the Hugging Face key layout the supported families share.

`model.embed_tokens`, `model.layers.N.{input_layernorm,post_attention_layernorm}`, `self_attn.{q,k,v,o}_proj`,
`model.norm`, `lm_head`. Family files pick the MLP/MoE naming (Qwen: `mlp.experts.I.gate_proj`, Mixtral:
`block_sparse_moe.experts.I.w1`).
"""

from __future__ import annotations

from typing import Callable

from .config import ModelConfig
from .layers import AttentionWeights, LayerWeights, MLPWeights, MoEWeights, ModelWeights
from .weights import Concat, Tensor, WeightSpec, fused_experts, linear_spec, norm_spec


def attention_plan(prefix: str, cfg: ModelConfig) -> AttentionWeights:
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    qkv = Concat(
        (
            Tensor(f"{prefix}.q_proj.weight", (q, h)),
            Tensor(f"{prefix}.k_proj.weight", (kv, h)),
            Tensor(f"{prefix}.v_proj.weight", (kv, h)),
        )
    )
    bias = None
    if cfg.qkv_bias:
        bias = WeightSpec(
            Concat(
                (
                    Tensor(f"{prefix}.q_proj.bias", (q,)),
                    Tensor(f"{prefix}.k_proj.bias", (kv,)),
                    Tensor(f"{prefix}.v_proj.bias", (kv,)),
                )
            ),
            ("heads",),
        )
    return AttentionWeights(
        qkv=WeightSpec(qkv, ("heads", "embed")),
        o=linear_spec(f"{prefix}.o_proj.weight", h, q, ("embed", "heads")),
        qkv_bias=bias,
        q_norm=norm_spec(f"{prefix}.q_norm.weight", cfg.head_dim) if cfg.qk_norm else None,
        k_norm=norm_spec(f"{prefix}.k_norm.weight", cfg.head_dim) if cfg.qk_norm else None,
    )


def mlp_plan(prefix: str, hidden: int, inter: int, names=("gate_proj", "up_proj", "down_proj")) -> MLPWeights:
    gate, up, down = names
    return MLPWeights(
        gate_up=WeightSpec(
            Concat(
                (Tensor(f"{prefix}.{gate}.weight", (inter, hidden)), Tensor(f"{prefix}.{up}.weight", (inter, hidden)))
            ),
            ("mlp", "embed"),
        ),
        down=linear_spec(f"{prefix}.{down}.weight", hidden, inter, ("embed", "mlp")),
    )


def experts_plan(
    prefix: str, cfg: ModelConfig, names=("gate_proj", "up_proj", "down_proj")
) -> tuple[WeightSpec, WeightSpec]:
    """gate_up [E, 2I, H] and down [E, H, I] from `prefix.I.<name>.weight` (or fused v5 tensors)."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    gate, up, down = names
    per_expert_gate_up = [
        Concat((Tensor(f"{prefix}.{e}.{gate}.weight", (i, h)), Tensor(f"{prefix}.{e}.{up}.weight", (i, h))))
        for e in range(cfg.num_experts)
    ]
    per_expert_down = [Tensor(f"{prefix}.{e}.{down}.weight", (h, i)) for e in range(cfg.num_experts)]
    return (
        WeightSpec(fused_experts(per_expert_gate_up, f"{prefix}.gate_up_proj"), ("experts", "moe_mlp", "embed")),
        WeightSpec(fused_experts(per_expert_down, f"{prefix}.down_proj"), ("experts", "embed", "moe_mlp")),
    )


def model_plan(cfg: ModelConfig, mlp_for_layer: Callable[[int, str], MLPWeights | MoEWeights]) -> ModelWeights:
    h = cfg.hidden_size
    layers = []
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}"
        layers.append(
            LayerWeights(
                input_norm=norm_spec(f"{p}.input_layernorm.weight", h),
                attn=attention_plan(f"{p}.self_attn", cfg),
                post_attn_norm=norm_spec(f"{p}.post_attention_layernorm.weight", h),
                mlp=mlp_for_layer(n, p),
            )
        )
    return ModelWeights(
        embed=linear_spec("model.embed_tokens.weight", cfg.vocab_size, h, ("vocab", "embed")),
        layers=layers,
        final_norm=norm_spec("model.norm.weight", h),
        lm_head=None
        if cfg.tie_word_embeddings
        else linear_spec("lm_head.weight", cfg.vocab_size, h, ("vocab", "embed")),
    )
