"""Write a Qwen3-MoE checkpoint as a float32 GGUF file, so llama.cpp runs the same weights as Moray.

Used by `moray bench engine` for its llama.cpp comparison. Only what that needs: the `qwen3moe`
architecture, float32 tensors, and the checkpoint's byte-level BPE tokenizer (padded with unused tokens
to the config's vocab size, since llama.cpp sizes the embedding from the token list). Needs the `gguf`
package (llama.cpp's own writer, on PyPI); anything else fails with a ValueError naming what is missing.

Tensor names and layout follow llama.cpp's qwen3moe loader: HF [out, in] matrices keep their numpy
shape (GGUF lists dimensions innermost first), and each layer's experts are stacked into one
[E, out, in] tensor per projection.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ARCH = "qwen3moe"

# HF name (after "model.layers.N.") -> GGUF name (after "blk.N.")
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
_EXPERT_TENSORS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight"}


def export_gguf(model_dir: str | Path, out_path: str | Path) -> Path:
    """Write `model_dir` (a qwen3_moe safetensors checkpoint with tokenizer.json) to `out_path`."""
    try:
        import gguf
    except ImportError as e:
        raise ValueError(f"the gguf package is not installed ({e}); pip install 'moray[bench]'") from None
    from workers.models.safetensors_io import CheckpointReader

    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "qwen3_moe":
        raise ValueError(f"GGUF export supports model_type qwen3_moe only, not {config.get('model_type')!r}")
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ValueError("GGUF export needs every layer to be an MoE layer (mlp_only_layers, decoder_sparse_step)")
    reader = CheckpointReader(model_dir)
    writer = gguf.GGUFWriter(out_path, ARCH)
    _write_config(writer, gguf, config)
    _write_tokenizer(writer, gguf, model_dir, config)
    writer.add_tensor("token_embd.weight", _f32(reader.array("model.embed_tokens.weight")))
    writer.add_tensor("output_norm.weight", _f32(reader.array("model.norm.weight")))
    head = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    writer.add_tensor("output.weight", _f32(reader.array(head)))
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        for hf_name, gguf_name in _LAYER_TENSORS.items():
            writer.add_tensor(f"blk.{i}.{gguf_name}", _f32(reader.array(prefix + hf_name)))
        for proj, gguf_name in _EXPERT_TENSORS.items():
            stacked = np.stack([reader.array(f"{prefix}mlp.experts.{e}.{proj}.weight") for e in range(config["num_experts"])])
            writer.add_tensor(f"blk.{i}.{gguf_name}", _f32(stacked))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _write_config(writer, gguf, config: dict) -> None:
    rope = config.get("rope_parameters") or {}
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_context_length(config.get("max_position_embeddings", 4096))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config.get("intermediate_size") or config["moe_intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def _write_tokenizer(writer, gguf, model_dir: Path, config: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    if tok.get("model", {}).get("type") != "BPE":
        raise ValueError("GGUF export needs a BPE tokenizer.json")
    vocab = {t: i for t, i in tok["model"]["vocab"].items()}
    vocab.update({a["content"]: a["id"] for a in tok.get("added_tokens", [])})
    size = max(config["vocab_size"], max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for a in tok.get("added_tokens", []):
        types[a["id"]] = gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if config.get("eos_token_id") is not None:
        writer.add_eos_token_id(config["eos_token_id"])
    if config.get("pad_token_id") is not None:
        writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
