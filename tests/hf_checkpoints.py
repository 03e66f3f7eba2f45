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


def hf_logits(model_dir: Path, token_ids: list[int]) -> np.ndarray:
    return hf_logits_many(model_dir, [token_ids])[0]


def hf_logits_many(model_dir: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    """Each prompt's logits [len, vocab], run one at a time through one loaded model."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].numpy() for ids in prompts]


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
