"""`moray make-model`: write a complete random-weight Hugging Face checkpoint for tests, demos and benchmarks.

The tensor names and shapes come from the family's own weight plan (its per-expert layout, the one
Hugging Face writes), so what we write is by construction what we load; transformers loads it too.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from safetensors.numpy import save_file

from ..progress import Progress
from . import FAMILIES
from .safetensors_io import INDEX_FILE, SINGLE_FILE
from .weights import Concat, OneOf, Rows, Stack, Tensor, plan_leaves

log = logging.getLogger("moray.models")

ARCHS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    # Hybrid linear attention. qwen3_5_moe is written as the released vision-language composite (text
    # model under model.language_model, a minimal vision_config, no vision weights).
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    # Written as the released multimodal composite (text model under model.language_model, no towers).
    "gemma4": "Gemma4ForConditionalGeneration",
}
HYBRID_ARCHS = ("qwen3_5_moe", "qwen3_next")
# Written with transformers 5's fused expert tensors (the only layout transformers' Gemma 4 reads).
FUSED_EXPERT_ARCHS = ("gemma4",)


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int  # dense layers / shared expert
    initializer_range: float
    max_shard_bytes: int


# tiny: < 5 MB for unit tests. small: ~70 MB, sharded. bench: ~1.4 GB float32 with many experts, for
# roofline benchmarks (64 experts top-8; Mixtral-style 8 experts top-2).
PRESETS: dict[str, Preset] = {
    "tiny": Preset(512, 64, 2, 4, 2, 16, 8, 2, 32, 96, 0.2, 1 << 30),
    "small": Preset(8192, 256, 4, 8, 2, 32, 16, 4, 256, 512, 0.1, 40 << 20),
    "bench": Preset(16384, 1024, 6, 16, 4, 64, 64, 8, 256, 2048, 0.02, 512 << 20),
}
MIXTRAL_BENCH = Preset(16384, 1024, 4, 16, 4, 64, 8, 2, 3584, 3584, 0.02, 512 << 20)


@dataclass(frozen=True)
class LinearPreset:
    """The Gated DeltaNet part of a hybrid preset; every `full_attention_interval`-th layer is full attention."""

    num_key_heads: int
    num_value_heads: int
    head_dim: int  # key and value heads alike
    conv_kernel_size: int
    full_attention_interval: int
    partial_rotary_factor: float


# Hybrid presets (qwen3_5_moe, qwen3_next); `intermediate_size` is the shared expert's. tiny: < 5 MB, 3 linear
# + 1 full layer. small: ~7 MB, sharded. bench: ~1.2 GB float32, the released models' 3:1 layer mix and
# head ratios (16 q / 2 KV heads of 128; 8 key / 16 value linear heads of 128), 64 experts top-8.
HYBRID_PRESETS: dict[str, tuple[Preset, LinearPreset]] = {
    "tiny": (Preset(512, 64, 4, 4, 2, 16, 8, 2, 32, 48, 0.2, 1 << 30), LinearPreset(2, 4, 16, 4, 4, 0.25)),
    "small": (Preset(2048, 128, 4, 4, 2, 32, 16, 4, 32, 64, 0.1, 3 << 20), LinearPreset(4, 8, 32, 4, 4, 0.25)),
    "bench": (
        Preset(16384, 1024, 8, 16, 2, 128, 64, 8, 128, 512, 0.02, 512 << 20),
        LinearPreset(8, 16, 128, 4, 4, 0.25),
    ),
}


@dataclass(frozen=True)
class MLAPreset:
    """DeepSeek-V3's attention and routing part of a preset (`Preset.head_dim` and `num_kv_heads` unused)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_group: int
    topk_group: int
    n_shared_experts: int
    first_k_dense_replace: int


# DeepSeek-V3 presets; `intermediate_size` is the dense layers'. tiny: < 5 MB, 1 dense + 2 MoE layers, 4
# expert groups. small: ~15 MB, sharded. bench: ~1.3 GB float32, V3's ratios (latent 512 -> 256, rope 64 -> 32),
# 64 experts top-8 in 8 groups (4 kept).
DEEPSEEK_PRESETS: dict[str, tuple[Preset, MLAPreset]] = {
    "tiny": (Preset(512, 64, 3, 4, 4, 0, 8, 2, 32, 96, 0.2, 1 << 30), MLAPreset(32, 32, 16, 8, 16, 4, 2, 1, 1)),
    "small": (Preset(2048, 128, 4, 8, 8, 0, 16, 4, 64, 256, 0.1, 4 << 20), MLAPreset(64, 64, 32, 16, 32, 4, 2, 1, 1)),
    "bench": (
        Preset(16384, 1024, 6, 16, 16, 0, 64, 8, 256, 2048, 0.02, 512 << 20),
        MLAPreset(384, 256, 64, 32, 64, 8, 4, 1, 1),
    ),
}


@dataclass(frozen=True)
class Gemma4Preset:
    """Gemma 4's attention part of a preset: every `full_every`-th layer (and the last) is full attention,
    with `global_head_dim` and, through attention_k_eq_v, `global_kv_heads`; the others slide."""

    sliding_window: int
    global_head_dim: int
    global_kv_heads: int
    full_every: int
    per_layer_input: int  # hidden_size_per_layer_input (0: none, as in the 31B and 26B-A4B)


# Gemma 4 presets, MoE like the 26B-A4B (experts beside a dense GeGLU MLP); `intermediate_size` is the dense
# MLP's. tiny: < 5 MB, 3 sliding (window 16) + 1 full layer. small: ~10 MB, 6 layers, per-layer inputs.
# bench: ~1.2 GB float32, the 26B-A4B's head ratios and window.
GEMMA4_PRESETS: dict[str, tuple[Preset, Gemma4Preset]] = {
    "tiny": (Preset(512, 64, 4, 4, 2, 16, 8, 2, 32, 48, 0.2, 1 << 30), Gemma4Preset(16, 32, 1, 4, 0)),
    "small": (Preset(2048, 128, 6, 4, 2, 32, 16, 4, 32, 64, 0.1, 4 << 20), Gemma4Preset(32, 64, 1, 3, 16)),
    "bench": (Preset(16384, 1024, 6, 8, 4, 128, 64, 8, 256, 768, 0.02, 512 << 20), Gemma4Preset(1024, 256, 1, 6, 0)),
}


def gemma4_config(p: Preset, gp: Gemma4Preset, eos_id: int, pad_id: int) -> dict[str, Any]:
    """config.json of a Gemma 4 composite (no vision or audio tower weights), transformers 5.x key style."""
    types = [
        "full_attention" if (i + 1) % gp.full_every == 0 or i == p.num_layers - 1 else "sliding_attention" for i in range(p.num_layers)
    ]
    text = {
        "model_type": "gemma4_text",
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "global_head_dim": gp.global_head_dim,
        "num_global_key_value_heads": gp.global_kv_heads,
        "attention_k_eq_v": True,
        "sliding_window": gp.sliding_window,
        "layer_types": types,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": gp.per_layer_input,
        "vocab_size_per_layer_input": p.vocab_size,
        "enable_moe_block": True,
        "num_experts": p.num_experts,
        "top_k_experts": p.top_k,
        "moe_intermediate_size": p.moe_intermediate_size,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "tie_word_embeddings": True,
        "initializer_range": p.initializer_range,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
    }
    return {
        "architectures": [ARCHS["gemma4"]],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": None,
        "audio_config": None,
        "tie_word_embeddings": True,
        "dtype": "float32",
    }


def deepseek_config(p: Preset, mp: MLAPreset, eos_id: int, pad_id: int) -> dict[str, Any]:
    """config.json of a DeepSeek-V3 model, transformers 5.x key style."""
    return {
        "architectures": [ARCHS["deepseek_v3"]],
        "model_type": "deepseek_v3",
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "moe_intermediate_size": p.moe_intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_heads,
        "n_shared_experts": mp.n_shared_experts,
        "n_routed_experts": p.num_experts,
        "num_experts_per_tok": p.top_k,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": mp.kv_lora_rank,
        "q_lora_rank": mp.q_lora_rank,
        "qk_rope_head_dim": mp.qk_rope_head_dim,
        "qk_nope_head_dim": mp.qk_nope_head_dim,
        "v_head_dim": mp.v_head_dim,
        "n_group": mp.n_group,
        "topk_group": mp.topk_group,
        "first_k_dense_replace": mp.first_k_dense_replace,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": p.initializer_range,
        "num_nextn_predict_layers": 0,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
        "use_cache": True,
    }


def hf_config(arch: str, p: Preset, eos_id: int, pad_id: int) -> dict[str, Any]:
    """config.json in the transformers 5.x key style."""
    cfg: dict[str, Any] = {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "initializer_range": p.initializer_range,
        "num_experts_per_tok": p.top_k,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
        "use_cache": True,
    }
    if arch == "mixtral":
        cfg.update(num_local_experts=p.num_experts, intermediate_size=p.moe_intermediate_size, sliding_window=None)
    else:
        cfg.update(
            num_experts=p.num_experts,
            moe_intermediate_size=p.moe_intermediate_size,
            intermediate_size=p.intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            use_sliding_window=False,
            sliding_window=None,
        )
    if arch == "qwen2_moe":
        cfg.update(shared_expert_intermediate_size=p.intermediate_size, qkv_bias=True)
    if arch == "qwen3_moe":
        cfg.update(attention_bias=False)
    return cfg


def hybrid_config(arch: str, p: Preset, lp: LinearPreset, eos_id: int, pad_id: int) -> dict[str, Any]:
    """config.json of a Qwen3.5-MoE composite or a Qwen3-Next model, transformers 5.x key style."""
    text: dict[str, Any] = {
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": lp.partial_rotary_factor,
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": p.initializer_range,
        "layer_types": ["full_attention" if (i + 1) % lp.full_attention_interval == 0 else "linear_attention" for i in range(p.num_layers)],
        "linear_num_key_heads": lp.num_key_heads,
        "linear_num_value_heads": lp.num_value_heads,
        "linear_key_head_dim": lp.head_dim,
        "linear_value_head_dim": lp.head_dim,
        "linear_conv_kernel_dim": lp.conv_kernel_size,
        "num_experts": p.num_experts,
        "num_experts_per_tok": p.top_k,
        "moe_intermediate_size": p.moe_intermediate_size,
        "shared_expert_intermediate_size": p.intermediate_size,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "use_cache": True,
    }
    if arch == "qwen3_next":
        text.update(intermediate_size=p.intermediate_size, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        return {"architectures": [ARCHS[arch]], "model_type": arch, **text, "dtype": "float32"}
    vision = {  # the smallest vision tower transformers builds; the checkpoint holds none of its weights
        "model_type": "qwen3_5_moe_vision",
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": p.hidden_size,
        "patch_size": 16,
    }
    return {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "text_config": {"model_type": "qwen3_5_moe_text", **text, "dtype": "float32"},
        "vision_config": vision,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def _tensors(source, fused: bool = False) -> Iterator[Tensor]:
    """The checkpoint tensors behind a source, in the layout Hugging Face writes (`fused`: experts as one
    tensor, the last option of their OneOf)."""
    if isinstance(source, Tensor):
        yield source
    elif isinstance(source, OneOf):
        yield from _tensors(source.options[-1 if fused else 0], fused)
    elif isinstance(source, (Concat, Stack, Rows)):
        for part in source.parts:
            yield from _tensors(part, fused)


def random_tensors(cfg, plan, seed: int, std: float, fused: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    for spec in plan_leaves(plan):
        for t in _tensors(spec.source, fused):
            if spec.init_scale is None:  # norms start at one, as transformers initialises them
                yield t.key, np.ones(t.shape, np.float32)
            elif spec.init_scale == 0:  # zero-centred norms (weight = offset from one) start at zero
                yield t.key, np.zeros(t.shape, np.float32)
            else:
                yield t.key, (rng.standard_normal(t.shape, dtype=np.float32) * std)


def write_safetensors(out: Path, tensors: Iterator[tuple[str, np.ndarray]], total: int, max_shard_bytes: int):
    """Writes shards of at most `max_shard_bytes`; an index file when there is more than one."""
    progress = Progress(total, "writing tensors")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    tmp_names = []
    weight_map: dict[str, str] = {}
    total_bytes = 0

    def flush():
        name = f"shard-{len(tmp_names):05d}.tmp"
        save_file(shards[-1], str(out / name), metadata={"format": "pt"})
        tmp_names.append((name, list(shards[-1])))

    for key, arr in tensors:
        if size and size + arr.nbytes > max_shard_bytes:
            flush()
            shards.append({})
            size = 0
        shards[-1][key] = arr
        size += arr.nbytes
        total_bytes += arr.nbytes
        progress(1)
    flush()
    for tmp, _ in tmp_names:
        (out / tmp).chmod(0o644)  # safetensors writes 0600; checkpoints are shared read-only data
    if len(tmp_names) == 1:
        (out / tmp_names[0][0]).rename(out / SINGLE_FILE)
        return
    n = len(tmp_names)
    for i, (tmp, keys) in enumerate(tmp_names):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (out / tmp).rename(out / final)
        weight_map.update({k: final for k in keys})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def make_model(
    out_dir: str | Path, arch: str, preset: str | Preset, seed: int = 0, mtp: bool = False, initializer_range: float | None = None
) -> Path:
    """A random checkpoint of `arch` at a named preset, or (attention-only families) any `Preset`. `mtp`: with
    a multi-token-prediction head as the family stores it (deepseek_v3, qwen3_5_moe, qwen3_next; mtp.py).
    `initializer_range` replaces the preset's (a checkpoint to be trained starts smaller than a test's)."""
    from . import mtp as mtp_head
    from .tokenizer import train_byte_level_bpe  # tokenizer training is only needed here

    if mtp and arch not in mtp_head.FAMILIES:
        raise ValueError(f"{arch} has no multi-token-prediction head (only {', '.join(mtp_head.FAMILIES)})")

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (choose from {', '.join(ARCHS)})")
    if isinstance(preset, Preset):
        if arch in HYBRID_ARCHS or arch in ("deepseek_v3", "gemma4"):
            raise ValueError(f"{arch} takes a named preset")
        p = preset
    elif preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    else:
        p = MIXTRAL_BENCH if (arch, preset) == ("mixtral", "bench") else PRESETS[preset]
    if arch in HYBRID_ARCHS:
        p, linear_preset = HYBRID_PRESETS[preset]
    if arch == "deepseek_v3":
        p, mla_preset = DEEPSEEK_PRESETS[preset]
    if arch == "gemma4":
        p, gemma_preset = GEMMA4_PRESETS[preset]
    if initializer_range is not None:
        p = replace(p, initializer_range=initializer_range)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tok = train_byte_level_bpe(out, vocab_size=min(p.vocab_size, 8192))
    eos = tok.eos_token_ids[0]
    pad = tok.encode("<|endoftext|>", add_special_tokens=False)[0]
    if arch in HYBRID_ARCHS:
        raw = hybrid_config(arch, p, linear_preset, eos, pad)
    elif arch == "deepseek_v3":
        raw = deepseek_config(p, mla_preset, eos, pad)
    elif arch == "gemma4":
        raw = gemma4_config(p, gemma_preset, eos, pad)
    else:
        raw = hf_config(arch, p, eos, pad)
    if mtp:
        text = raw.get("text_config", raw)
        text["num_nextn_predict_layers" if arch == "deepseek_v3" else "mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = {"eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    family = FAMILIES[arch]
    cfg = family.config_from_hf(raw)
    plan = family.plan(cfg)
    fused = arch in FUSED_EXPERT_ARCHS
    tensors = random_tensors(cfg, plan, seed, p.initializer_range, fused)
    if mtp:
        _, _, head = mtp_head.plan(family, cfg, raw)
        plan = (plan, head)
        tensors = itertools.chain(tensors, random_tensors(cfg, head, seed + 1, p.initializer_range, fused))
    total = sum(1 for spec in plan_leaves(plan) for _ in _tensors(spec.source, fused))
    write_safetensors(out, tensors, total, p.max_shard_bytes)
    log.info("wrote %s/%s checkpoint to %s in %.1fs", arch, preset, out, time.perf_counter() - start)
    return out
