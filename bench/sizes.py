"""Per-token KV and per-sequence state sizes of a model, from its `config.json` alone (no weights).

A hybrid model (Qwen3.5, Qwen3-Next) keeps a paged KV cache only for its full-attention layers; each
Gated DeltaNet layer instead holds a fixed-size float32 state per sequence: the causal conv's last K-1
inputs [K-1, conv_dim] plus one [dk, dv] recurrent matrix per value head. These are the two figures
that size a serving deployment (`moray bench engine --sizes-only`), computed the way the engine
allocates them (`workers.engine.runner.kv_bytes_per_block`, `state_bytes_per_sequence`).

The config is parsed by the model family's own reader (the `text_config` of a composite, `layer_types`
or `full_attention_interval`), which imports jax; this module itself imports nothing heavy.
"""

from __future__ import annotations

import math
from typing import Any

# The engine's state pools are float32 whatever the model dtype (workers/engine/runner.py).
STATE_ITEMSIZE = 4
KV_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}

# Qwen/Qwen3.5-397B-A17B `config.json`, trimmed to what the sizes (and the family's config reader)
# need; the vision tower's config is left out. 60 layers, every 4th full attention: 45 Gated DeltaNet
# layers, 15 gated full-attention layers.
QWEN3_5_397B_A17B: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 4096,
        "num_hidden_layers": 60,
        "full_attention_interval": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "attn_output_gate": True,
        "attention_bias": False,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 64,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        "hidden_act": "silu",
        "dtype": "bfloat16",
    },
}

# deepseek-ai/DeepSeek-V3 `config.json`, trimmed likewise (its FP8 quantization_config left out: the
# KV cache is in the engine's dtype). 61 layers of MLA: latent 512 + rope key 64 per token and layer.
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "num_nextn_predict_layers": 1,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}

# Gemma 4's text configs. Nothing can be downloaded here: the values are those transformers' own conversion
# script writes (huggingface/transformers src/transformers/models/gemma4/convert_gemma4_weights.py, its
# `_VARIANTS` "gemma-4-31b" and "gemma-4-26b-a4b", plus Gemma4TextConfig's defaults for what it leaves unset),
# which agree with the GGUF metadata Ollama publishes for both and with config excerpts quoted in public
# tests (mlx-community/gemma-4-26b-a4b-it-4bit). Published sizes: 31B "30.7B parameters" (with a ~550M
# vision encoder), 26B-A4B "25.2B total / 3.8B active". Layers: 5 sliding (window 1024, head_dim 256) to
# 1 full (head_dim 512, attention_k_eq_v with `num_global_key_value_heads`).
_GEMMA4_ROPE = {
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}


def _gemma4(num_layers: int, **text: Any) -> dict[str, Any]:
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "gemma4_text",
            "vocab_size": 262144,
            "num_hidden_layers": num_layers,
            "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * (num_layers // 6),
            "head_dim": 256,
            "global_head_dim": 512,
            "attention_k_eq_v": True,
            "sliding_window": 1024,
            "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 262144,
            "final_logit_softcapping": 30.0,
            "max_position_embeddings": 262144,
            "rope_parameters": _GEMMA4_ROPE,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6,
            "use_bidirectional_attention": "vision",
            "tie_word_embeddings": True,
            **text,
        },
    }


GEMMA4_31B = _gemma4(
    60, hidden_size=5376, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4
)
GEMMA4_26B_A4B = _gemma4(
    30,
    hidden_size=2816,
    intermediate_size=2112,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_global_key_value_heads=2,
    enable_moe_block=True,
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=704,
)

PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3.5-397b": QWEN3_5_397B_A17B,
    "deepseek-v3": DEEPSEEK_V3,
    "gemma4-31b": GEMMA4_31B,
    "gemma4-26b-a4b": GEMMA4_26B_A4B,
}
# Contexts the per-sequence KV is given at, and the weight formats the weight bytes are given in.
CONTEXTS = (8192, 131072)
W4A16_GROUP = 32  # the group of Google's QAT W4A16 releases (vllm-project/recipes#514)


def model_config(raw: dict[str, Any]):
    """The engine's `ModelConfig` for a `config.json` dict, read by its family (imports jax)."""
    from workers.models import FAMILIES, ModelLoadError

    family = FAMILIES.get(raw.get("model_type"))
    if family is None:
        raise ModelLoadError(f"config.json: unknown model_type {raw.get('model_type')!r} (supported: {', '.join(sorted(FAMILIES))})")
    return family.config_from_hf(raw)


def layer_summary(cfg) -> dict[str, Any]:
    return {
        "num_layers": cfg.num_layers,
        "linear_attention": cfg.num_state_layers,
        "full_attention": cfg.num_kv_layers,
        "full_attention_layers": list(cfg.attention_layer_ids),  # the others are linear attention
    }


def kv_bytes_per_token(cfg, itemsize: int) -> int:
    """K and V of one token in every full-attention layer (linear-attention layers have no KV); for MLA
    (DeepSeek-V3) one latent row of kv_lora_rank + rope dim per layer."""
    return cfg.kv_elements_per_token * itemsize


def state_bytes_per_layer(cfg) -> dict[str, int]:
    """float32 conv and recurrent state of one sequence in one linear-attention layer."""
    if not cfg.is_hybrid:
        return {"conv": 0, "recurrent": 0}
    return {
        "conv": STATE_ITEMSIZE * math.prod(cfg.conv_state_shape),
        "recurrent": STATE_ITEMSIZE * math.prod(cfg.recurrent_state_shape),
    }


def state_bytes_per_sequence(cfg) -> int:
    """The state of one sequence over every linear-attention layer; 0 for attention-only models."""
    return cfg.num_state_layers * sum(state_bytes_per_layer(cfg).values())


def kv_bytes_per_sequence(cfg, itemsize: int, context: int, window_rule: bool, block_size: int = 16) -> int:
    """One sequence's KV at `context` tokens. With the window rule a sliding-window layer holds only the
    blocks its window can still reach (ceil(window / block) + 1 at most: the window straddles a block
    boundary); without it every layer holds every block."""
    blocks = -(-context // block_size)
    total = 0
    for i, layer in enumerate(cfg.kv_layer_ids):
        window = cfg.sliding_windows[layer]
        held = min(blocks, -(-window // block_size) + 1) if window_rule and window else blocks
        total += held * block_size * math.prod(cfg.kv_layer_page_dims(i)) * itemsize
    return total


def weight_bytes(raw: dict[str, Any], cfg) -> dict[str, int]:
    """The served weights (the family's load plan: a composite's towers excluded) in bfloat16, and in
    compressed-tensors W4A16 (group 32, bf16 scales) for every Linear but routers, as `moray quantize`
    writes them; embeddings stay bfloat16 (the LM head is tied)."""
    from workers.models import FAMILIES
    from workers.models.quant import _linear_tensors
    from workers.models.weights import plan_leaves

    bf16 = w4a16 = 0
    for spec in plan_leaves(FAMILIES[raw["model_type"]].plan(cfg)):
        n = math.prod(spec.shape)
        bf16 += 2 * n
        linear = _linear_tensors(spec) is not None or "experts" in (spec.logical_axes or ())
        router = "router" in (spec.logical_axes or ())
        w4a16 += n // 2 + 2 * (n // W4A16_GROUP) if linear and not router else 2 * n
    return {"bfloat16": bf16, "w4a16": w4a16}


def sizes(cfg, kv_dtype: str) -> dict[str, Any]:
    if kv_dtype not in KV_ITEMSIZE:
        raise ValueError(f"unknown KV dtype {kv_dtype!r} (known: {', '.join(KV_ITEMSIZE)})")
    kv = kv_bytes_per_token(cfg, KV_ITEMSIZE[kv_dtype])
    state = state_bytes_per_sequence(cfg)
    return {
        "model_type": cfg.model_type,
        "layers": layer_summary(cfg),
        "kv_dtype": kv_dtype,
        "kv_bytes_per_token": kv,
        "kv_kib_per_token": kv / 2**10,
        "state_dtype": "float32",
        "state_bytes_per_sequence": state,
        "state_mib_per_sequence": state / 2**20,
        "state_bytes_per_layer": state_bytes_per_layer(cfg),
        "conv_state_shape": list(cfg.conv_state_shape) if cfg.is_hybrid else None,
        "recurrent_state_shape": list(cfg.recurrent_state_shape) if cfg.is_hybrid else None,
        # How many tokens of KV weigh as much as one sequence's state.
        "state_equals_kv_tokens": state / kv if kv else None,
    }


def window_sizes(raw: dict[str, Any], cfg, kv_dtype: str) -> dict[str, Any]:
    """Weight bytes and per-sequence KV with and without the sliding-window rule (models with windows)."""
    itemsize = KV_ITEMSIZE[kv_dtype]
    weights = weight_bytes(raw, cfg)
    per_sequence = {
        str(n): {
            "all_blocks_gib": kv_bytes_per_sequence(cfg, itemsize, n, False) / 2**30,
            "window_rule_gib": kv_bytes_per_sequence(cfg, itemsize, n, True) / 2**30,
        }
        for n in CONTEXTS
    }
    return {
        "weight_bytes": weights,
        "weight_gib": {k: v / 2**30 for k, v in weights.items()},
        "kv_per_sequence": per_sequence,
        "sliding_layers": sum(1 for layer in cfg.kv_layer_ids if cfg.sliding_windows[layer]),
    }


def sizes_from_config(raw: dict[str, Any], kv_dtype: str = "bfloat16") -> dict[str, Any]:
    """KV bytes per token (in `kv_dtype`) and state bytes per sequence of a `config.json` dict; for models
    with sliding-window layers also the weight bytes and the KV of one sequence with and without the window rule."""
    cfg = model_config(raw)
    out = sizes(cfg, kv_dtype)
    if any(cfg.sliding_windows):
        out.update(window_sizes(raw, cfg, kv_dtype))
    return out
