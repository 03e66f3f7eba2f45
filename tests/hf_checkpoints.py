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
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def rewrite_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    path.write_text(json.dumps(raw, indent=2))
