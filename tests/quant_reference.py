"""compressed-tensors as the reference: quantise and compress a checkpoint with the real library, and
decompress one with the library.

transformers 5.x holds MoE experts as fused parameters, which the library's `Linear` targets skip, so we
quantise a plain torch tree with one nn.Linear per Linear weight of the dense checkpoint (per expert
projection included), named like its keys: `apply_quantization_config`, scales from the library's own
`calculate_qparams` over each group's min/max, frozen, then `ModelCompressor` compresses the tree, its
state dict is saved next to the untouched tensors, and `update_config` writes `quantization_config`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file
from torch import nn

# What real checkpoints leave unquantised: the LM head and the MoE routers.
ROUTERS = [r"re:.*mlp\.gate$", r"re:.*block_sparse_moe\.gate$", r"re:.*shared_expert_gate$"]
DEFAULT_IGNORE = ["lm_head", *ROUTERS]


def is_linear(key: str, t: torch.Tensor) -> bool:
    return key.endswith(".weight") and t.ndim == 2 and "embed_tokens" not in key


def linear_tree(tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A module tree holding one nn.Linear per Linear weight, at the checkpoint key's module path."""
    root = nn.Module()
    for key, t in tensors.items():
        if not is_linear(key, t):
            continue
        *parents, name = key.removesuffix(".weight").split(".")
        node = root
        for p in parents:
            if not hasattr(node, p):
                node.add_module(p, nn.Module())
            node = getattr(node, p)
        linear = nn.Linear(t.shape[1], t.shape[0], bias=False, dtype=t.dtype)
        linear.weight.data = t.clone()
        node.add_module(name, linear)
    return root


def observe(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """min and max of each scale's group of weights (what a min-max observer records)."""
    w = weight.detach()
    if args.strategy == "group":
        groups = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        return groups.amin(-1), groups.amax(-1)
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    if args.strategy == "block":
        rows, cols = args.block_structure
        padded = nn.functional.pad(w, (0, -w.shape[1] % cols, 0, -w.shape[0] % rows))  # zeros: min/max include 0
        blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
        return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    raise ValueError(args.strategy)


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def compress_with_library(dense_dir: Path, out_dir: Path, preset: str, ignore=DEFAULT_IGNORE, **weights) -> Path:
    """A compressed-tensors checkpoint of `dense_dir` made by the library (`preset`: W4A16, FP8_DYNAMIC,
    FP8_BLOCK, MXFP8, ...; `weights` overrides fields of the preset's weight args)."""
    tensors = read_tensors(dense_dir)
    tree = linear_tree(tensors)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    for k, v in weights.items():
        setattr(scheme.weights, k, v)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))
    apply_quantization_config(tree, config, show_progress=False)
    for _, module in tree.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        args = module.quantization_scheme.weights
        scale, _ = calculate_qparams(*observe(module.weight, args), args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(tree)
    compressor.compress_model(tree)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in tree.state_dict().items()}
    state.update({k: t for k, t in tensors.items() if not is_linear(k, t)})
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(Path(dense_dir) / "config.json", out_dir / "config.json")
    compressor.update_config(str(out_dir))
    return out_dir


def decompress_with_library(ct_dir: Path, out_dir: Path, embeddings=("model.embed_tokens",)) -> Path:
    """The library's own decompression of a compressed-tensors checkpoint, as a dense float32 checkpoint.

    The converter matches modules by name only, so the embeddings (`*.weight` tensors that are no Linear)
    are named as ignored."""
    ct_dir, out_dir = Path(ct_dir), Path(out_dir)
    dequantizer = CompressedTensorsDequantizer(str(ct_dir), ignore=list(embeddings), dtype=torch.float32)
    dense = dequantizer.process(read_tensors(ct_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in dense.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((ct_dir / "config.json").read_text())
    config.pop("quantization_config")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
