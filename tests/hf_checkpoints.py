"""Random-weight checkpoints written by transformers itself, the reference for parity tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers

FAMILY_CLASSES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
}

BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
    max_position_embeddings=256,
)


def save_hf_checkpoint(out: Path, family: str, seed: int = 0, max_shard_size=None, **overrides) -> Path:
    cfg_cls, model_cls = FAMILY_CLASSES[family]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**BASE, **overrides})
    model = model_cls(cfg).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out


def hf_logits(model_dir: Path, token_ids: list[int], **kwargs) -> np.ndarray:
    return hf_logits_many(model_dir, [token_ids], **kwargs)[0]


def hf_logits_many(model_dir: Path, prompts: list[list[int]], **kwargs) -> list[np.ndarray]:
    """Each prompt's logits [len, vocab], run one at a time through one loaded model (`kwargs` go to its
    forward)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids]), **kwargs).logits[0].numpy() for ids in prompts]


def rewrite_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    path.write_text(json.dumps(raw, indent=2))


# ---------------------------------------------------------------------------------------------
# Hybrid linear-attention families (Qwen3.5, Qwen3-Next).

HYBRID_CLASSES = {
    "qwen3_5_moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration),
    "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
    "qwen3_5": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
    "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
}
COMPOSITES = ("qwen3_5_moe", "qwen3_5")
HYBRID_BASE = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    initializer_range=0.05,
    max_position_embeddings=256,
)
HYBRID_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, patch_size=4, num_position_embeddings=16)


def save_hybrid_checkpoint(out: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A random hybrid checkpoint saved by transformers. Composites (`qwen3_5_moe`, `qwen3_5`) get a
    one-block vision tower; `tie_word_embeddings` is set on both levels of a composite. Every 1-D
    parameter (norms that start at zero or one, dt_bias, A_log) is moved off its initial value so that
    each of them matters to the logits."""
    cfg_cls, model_cls = HYBRID_CLASSES[family]
    mlp = {} if family in ("qwen3_5", "qwen3_5_text") else dict(HYBRID_MOE)
    if family in ("qwen3_next", "qwen3_5", "qwen3_5_text"):  # dense layers (Qwen3-Next: mlp_only_layers)
        mlp["intermediate_size"] = 80
    text = {**HYBRID_BASE, **mlp, **overrides}
    torch.manual_seed(seed)
    if family in COMPOSITES:
        tie = text.get("tie_word_embeddings", False)
        vision = {**TINY_VISION, "out_hidden_size": text["hidden_size"]}
        cfg = cfg_cls(text_config=text, vision_config=vision, tie_word_embeddings=tie)
    else:
        cfg = cfg_cls(**text)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    return out


SMALL_INIT = dict(initializer_range=0.05)


def qwen2_ep_checkpoint(out_dir):
    """Hidden 256 (the k = 2 hierarchical dispatch splits it into two 128-lane halves), 16 experts top-4,
    a shared expert whose output must be combined consistently with the routed one."""
    return save_hf_checkpoint(
        out_dir,
        "qwen2_moe",
        hidden_size=256,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        **SMALL_INIT,
    )


# ---------------------------------------------------------------------------------------------
# Gemma 4: sliding and full layers of different shapes, KV-shared layers, per-layer inputs, MoE.

GEMMA4_BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=5,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    vocab_size_per_layer_input=96,
    hidden_size_per_layer_input=8,
    initializer_range=0.1,
    max_position_embeddings=256,
    final_logit_softcapping=30.0,
)
# transformers 5.24 slices the per-layer inputs before the KV-shared layers even when there are none (a
# TypeError); asking for the hidden states turns that slicing off without changing the logits.
GEMMA4_HF_KWARGS = dict(output_hidden_states=True)
GEMMA4_MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=24)
TINY_GEMMA4_VISION = dict(
    hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16
)


def save_gemma4_checkpoint(out: Path, seed: int = 0, composite: bool = False, **overrides) -> Path:
    """A random Gemma 4 checkpoint saved by transformers (`gemma4_text`, or the `gemma4` composite with a
    one-layer vision tower). Every 1-D parameter and each layer_scalar is moved off its initial value."""
    text = {**GEMMA4_BASE, **overrides}
    torch.manual_seed(seed)
    if composite:
        cfg = transformers.Gemma4Config(text_config=text, vision_config=TINY_GEMMA4_VISION, audio_config=None)
        model = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    else:
        model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**text)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.mul_(1.0 + torch.rand_like(b) * 0.5)
    model.save_pretrained(out)
    return out
