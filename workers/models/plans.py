"""Weight plans for the Hugging Face key layout the supported families share.

`model.embed_tokens`, `model.layers.N.{input_layernorm,post_attention_layernorm}`, `self_attn.{q,k,v,o}_proj`,
`model.norm`, `lm_head`. Family files pick the MLP/MoE naming (Qwen: `mlp.experts.I.gate_proj`, Mixtral:
`block_sparse_moe.experts.I.w1`), and for hybrid models the linear-attention layout of `linear_attn`
(`linear_attention_plan`: Qwen3.5's separate projections, `qwen3_next_linear_attention_plan`: Qwen3-Next's
fused ones) and the text model's prefix (`model.language_model` in vision-language composites).
"""

from __future__ import annotations

from typing import Callable

from .config import ModelConfig
from .layers import AttentionWeights, LayerWeights, MLPWeights, ModelWeights, MoEWeights
from .linear_attention import LinearAttentionWeights
from .weights import Concat, Rows, Tensor, WeightSpec, fused_experts, grouped_rows, linear_spec, norm_spec


def attention_plan(prefix: str, cfg: ModelConfig) -> AttentionWeights:
    h, kv = cfg.hidden_size, cfg.kv_size
    q = 2 * cfg.q_size if cfg.attn_output_gate else cfg.q_size  # gated: per head [query | gate]
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
        o=linear_spec(f"{prefix}.o_proj.weight", h, cfg.q_size, ("embed", "heads")),
        qkv_bias=bias,
        q_norm=norm_spec(f"{prefix}.q_norm.weight", cfg.head_dim, cfg.zero_centered_norm) if cfg.qk_norm else None,
        k_norm=norm_spec(f"{prefix}.k_norm.weight", cfg.head_dim, cfg.zero_centered_norm) if cfg.qk_norm else None,
    )


# Gated DeltaNet leaves get their own logical axis name: their fused rows (q|k|v|z) do not split like
# attention heads, so a "heads" sharding rule must not reach them.
_LINEAR_AXES = ("linear_heads", "embed")


def _linear_attention_weights(prefix: str, cfg: ModelConfig, qkvz, ba) -> LinearAttentionWeights:
    lc, h = cfg.linear, cfg.hidden_size
    per_head = lambda name: WeightSpec(Tensor(f"{prefix}.{name}", (lc.num_value_heads,)), ("linear_heads",))
    return LinearAttentionWeights(
        qkvz=WeightSpec(qkvz, _LINEAR_AXES),
        ba=WeightSpec(ba, _LINEAR_AXES),
        conv=WeightSpec(Tensor(f"{prefix}.conv1d.weight", (lc.conv_dim, 1, lc.conv_kernel_size)), ("linear_heads", None, None)),
        dt_bias=per_head("dt_bias"),
        A_log=per_head("A_log"),
        norm=norm_spec(f"{prefix}.norm.weight", lc.value_head_dim),
        out=linear_spec(f"{prefix}.out_proj.weight", h, lc.value_dim, ("embed", "linear_heads")),
    )


def linear_attention_plan(prefix: str, cfg: ModelConfig) -> LinearAttentionWeights:
    """Qwen3.5: `in_proj_qkv` (q | k | v), `in_proj_z`, `in_proj_b`, `in_proj_a`, fused into two matmuls."""
    lc, h = cfg.linear, cfg.hidden_size
    qkvz = Concat(
        (
            Tensor(f"{prefix}.in_proj_qkv.weight", (lc.conv_dim, h)),
            Tensor(f"{prefix}.in_proj_z.weight", (lc.value_dim, h)),
        )
    )
    ba = Concat(
        (
            Tensor(f"{prefix}.in_proj_b.weight", (lc.num_value_heads, h)),
            Tensor(f"{prefix}.in_proj_a.weight", (lc.num_value_heads, h)),
        )
    )
    return _linear_attention_weights(prefix, cfg, qkvz, ba)


def qwen3_next_linear_attention_plan(prefix: str, cfg: ModelConfig) -> LinearAttentionWeights:
    """Qwen3-Next: `in_proj_qkvz` holds per key head [q | k | v (G heads) | z (G heads)] and `in_proj_ba`
    per key head [b (G) | a (G)] (transformers' fix_query_key_value_ordering); their rows are reordered
    at load time into Qwen3.5's q | k | v | z and b | a."""
    lc, h = cfg.linear, cfg.hidden_size
    group = lc.num_value_heads // lc.num_key_heads
    dk, vg = lc.key_head_dim, group * lc.value_head_dim
    qkvz = Tensor(f"{prefix}.in_proj_qkvz.weight", (lc.conv_dim + lc.value_dim, h))
    ba = Tensor(f"{prefix}.in_proj_ba.weight", (2 * lc.num_value_heads, h))
    return _linear_attention_weights(
        prefix,
        cfg,
        Rows((qkvz,), grouped_rows((dk, dk, vg, vg), lc.num_key_heads)),
        Rows((ba,), grouped_rows((group, group), lc.num_key_heads)),
    )


def mlp_plan(prefix: str, hidden: int, inter: int, names=("gate_proj", "up_proj", "down_proj")) -> MLPWeights:
    gate, up, down = names
    return MLPWeights(
        gate_up=WeightSpec(
            Concat((Tensor(f"{prefix}.{gate}.weight", (inter, hidden)), Tensor(f"{prefix}.{up}.weight", (inter, hidden)))),
            ("mlp", "embed"),
        ),
        down=linear_spec(f"{prefix}.{down}.weight", hidden, inter, ("embed", "mlp")),
    )


def experts_plan(prefix: str, cfg: ModelConfig, names=("gate_proj", "up_proj", "down_proj")) -> tuple[WeightSpec, WeightSpec]:
    """gate_up [E, 2I, H] and down [E, H, I] from `prefix.I.<name>.weight` (or fused v5 tensors)."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    gate, up, down = names
    per_expert_gate_up = [
        Concat((Tensor(f"{prefix}.{e}.{gate}.weight", (i, h)), Tensor(f"{prefix}.{e}.{up}.weight", (i, h)))) for e in range(cfg.num_experts)
    ]
    per_expert_down = [Tensor(f"{prefix}.{e}.{down}.weight", (h, i)) for e in range(cfg.num_experts)]
    return (
        WeightSpec(fused_experts(per_expert_gate_up, f"{prefix}.gate_up_proj"), ("experts", "moe_mlp", "embed")),
        WeightSpec(fused_experts(per_expert_down, f"{prefix}.down_proj"), ("experts", "embed", "moe_mlp")),
    )


def model_plan(
    cfg: ModelConfig,
    mlp_for_layer: Callable[[int, str], MLPWeights | MoEWeights],
    linear_plan: Callable[[str, ModelConfig], LinearAttentionWeights] = linear_attention_plan,
    prefix: str = "model",
    attention_plan_fn: Callable[[str, ModelConfig], object] = attention_plan,
    first_layer: int = 0,
) -> ModelWeights:
    """The decoder stack under `prefix`; attention (`self_attn`) from `attention_plan_fn` (MLA's differs),
    hybrid models' linear-attention layers (`linear_attn`) from `linear_plan`. `lm_head` stays at the top level.
    Layer n is stored as `{prefix}.layers.{first_layer + n}` (DeepSeek-V3 stores its multi-token-prediction
    layer after the decoder's, mtp.py)."""
    h, zc = cfg.hidden_size, cfg.zero_centered_norm
    layers = []
    for n in range(cfg.num_layers):
        p = f"{prefix}.layers.{first_layer + n}"
        if cfg.is_linear_layer(n):
            mixer = linear_plan(f"{p}.linear_attn", cfg)
        else:
            mixer = attention_plan_fn(f"{p}.self_attn", cfg)
        layers.append(
            LayerWeights(
                input_norm=norm_spec(f"{p}.input_layernorm.weight", h, zc),
                attn=mixer,
                post_attn_norm=norm_spec(f"{p}.post_attention_layernorm.weight", h, zc),
                mlp=mlp_for_layer(n, p),
            )
        )
    return ModelWeights(
        embed=linear_spec(f"{prefix}.embed_tokens.weight", cfg.vocab_size, h, ("vocab", "embed")),
        layers=layers,
        final_norm=norm_spec(f"{prefix}.norm.weight", h, zc),
        lm_head=None if cfg.tie_word_embeddings else linear_spec("lm_head.weight", cfg.vocab_size, h, ("vocab", "embed")),
    )
