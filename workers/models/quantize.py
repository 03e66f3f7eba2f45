"""`moray quantize IN OUT --scheme w4a16|fp8|mxfp8|fp8-block`: an unquantised checkpoint to a quantised one
(compressed-tensors; `fp8-block`: DeepSeek's native FP8 format).

numpy only (no torch, no jax, no accelerator). The output is what compressed-tensors 0.20 writes for the
same weights, tensor for tensor: the library's scale rule (max |w| of each group, including 0, over the
format's largest value), its round-then-clamp, its int4 packing and its `config.json` entries, so vLLM,
the library and `moray` all read it.

| scheme | library preset | per Linear module                                                          |
| ------ | -------------- | -------------------------------------------------------------------------- |
| w4a16  | W4A16          | weight_packed int32 [out, in/8], weight_scale [out, in/group], weight_shape |
| fp8    | FP8_DYNAMIC    | weight fp8 e4m3 [out, in], weight_scale [out, 1]; dynamic per-token inputs  |
| mxfp8  | MXFP8          | weight fp8 e4m3 [out, in], weight_scale uint8 E8M0 [out, in/32]             |

`fp8-block` writes DeepSeek-V3's released format instead (`quant_method: fp8`, `weight_block_size: [128,
128]`): weight fp8 e4m3 [out, in] and weight_scale_inv float32 [ceil(out/128), ceil(in/128)], one scale per
128x128 block (max |w| of the block / 448; w = q * scale), dynamic activations.

Scales keep the weight's dtype (as the library does) and arithmetic happens in that dtype.
Linear modules are the 2-D `*.weight` tensors other than the token embeddings; MoE experts are one Linear
per expert projection, also when the input holds transformers 5's fused `experts.gate_up_proj` [E, 2I, H] /
`experts.down_proj` [E, H, I] (Gemma 4): those are written per expert (`experts.N.gate_proj`, ...). Routers (`mlp.gate`, Mixtral's
`block_sparse_moe.gate`, Qwen2-MoE's `shared_expert_gate`), `lm_head` and the vision tower of
vision-language composites (`model.visual.*`, e.g. Qwen3.5: Moray serves only the text model, the tower
holds 2-D tensors that are no Linear such as `pos_embed`, and widths like 4304 that fit no group) are left
unquantised by default; `--ignore` adds module names or `re:` patterns (they match the full key path, e.g.
`re:.*linear_attn.*` under a composite's `model.language_model.`). This module imports no jax (the CLI
imports it eagerly).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import shutil
import time
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from .config import ModelLoadError, read_config_json
from .safetensors_io import INDEX_FILE, SINGLE_FILE, CheckpointReader

log = logging.getLogger("moray.models")

SCHEMES = ("w4a16", "fp8", "mxfp8", "fp8-block")
FP8_BLOCK = 128
DEFAULT_IGNORE = (
    "lm_head",
    r"re:.*mlp\.gate$",
    r"re:.*block_sparse_moe\.gate$",
    r"re:.*shared_expert_gate$",
    r"re:model\.visual\.",  # vision-language composites: the vision tower (not served by Moray)
    r"re:.*router\.proj$",  # Gemma 4's router
    r"re:model\.(vision_tower|audio_tower|embed_vision|embed_audio)\.",  # Gemma 4's towers (not served)
)
FORMATS = {"w4a16": "pack-quantized", "fp8": "float-quantized", "mxfp8": "mxfp8-quantized"}
MAX_SHARD_BYTES = 4 << 30

INT4_MIN, INT4_MAX = -8, 7
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
MX_GROUP = 32
MX_ELEM_EXPONENT = 8  # floor(log2(448))
E8M0_BIAS = 127


# ---------------------------------------------------------------------------------------------
# Quantisers: one Linear weight [out, in] -> its compressed-tensors tensors.


def _eps(dtype: np.dtype) -> float:
    return float(ml_dtypes.finfo(dtype).eps)


def _absmax_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Symmetric scale amax / qmax in the weight dtype; 0 (an all-zero group) becomes the dtype's eps."""
    scale = (amax / np.asarray(qmax, amax.dtype)).astype(amax.dtype)
    return np.where(scale == 0, np.asarray(_eps(amax.dtype), amax.dtype), scale)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int values in [-8, 7], [..., K] (K % 8 == 0) -> int32 words [..., K / 8]: element j at bits
    4 * (j % 8) of word j // 8, stored as q + 8 (compressed-tensors' pack_to_int32 with 4 bits)."""
    if q.shape[-1] % 8:
        raise ValueError(f"int4 packing needs a multiple of 8 values per row, got {q.shape[-1]}")
    nibbles = (q.astype(np.int32) + 8).astype(np.uint32).reshape(*q.shape[:-1], -1, 8)
    words = np.bitwise_or.reduce(nibbles << (np.arange(8, dtype=np.uint32) * 4), axis=-1)
    return words.view(np.int32)


def unpack_int4(words: np.ndarray) -> np.ndarray:
    """The inverse of `pack_int4`: int32 [..., K / 8] -> int8 [..., K]."""
    nibbles = (words.view(np.uint32)[..., None] >> (np.arange(8, dtype=np.uint32) * 4)) & 0xF
    return (nibbles.astype(np.int8) - 8).reshape(*words.shape[:-1], -1)


def quantize_int4(w: np.ndarray, group_size: int | None) -> dict[str, np.ndarray]:
    """Symmetric int4 with one scale per `group_size` inputs (None: per output channel)."""
    out_dim, in_dim = w.shape
    g = in_dim if group_size is None else group_size
    groups = w.reshape(out_dim, in_dim // g, g)
    scale = _absmax_scale(np.abs(groups).max(axis=-1), (INT4_MAX - INT4_MIN) / 2)  # max |w| / 7.5
    scaled = (groups / scale[..., None]).astype(np.float32)  # divided in the weight dtype, like the library
    q = np.round(np.clip(scaled, INT4_MIN, INT4_MAX)).astype(np.int8).reshape(out_dim, in_dim)
    return {
        "weight_packed": pack_int4(q),
        "weight_scale": scale,
        "weight_shape": np.array([out_dim, in_dim], np.int64),
    }


def _to_fp8(scaled: np.ndarray) -> np.ndarray:
    return np.clip(scaled.astype(np.float32), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def quantize_fp8_channel(w: np.ndarray) -> dict[str, np.ndarray]:
    """fp8 e4m3 weights with one scale per output channel (max |w| / 448)."""
    scale = _absmax_scale(np.abs(w).max(axis=-1, keepdims=True), FP8_MAX)
    return {"weight": _to_fp8(w / scale), "weight_scale": scale}


def round_to_power_of_two(x: np.ndarray) -> np.ndarray:
    """compressed-tensors' MX rounding of group maxima: keep sign and exponent after adding 2^21 to the
    float32 bit pattern, i.e. round up to the next power of two when the mantissa is >= 1.75."""
    bits = x.astype(np.float32).view(np.int32)
    return ((bits + (1 << 21)) & np.int32(-(1 << 23))).view(np.float32)


def e8m0_exponents(amax: np.ndarray) -> np.ndarray:
    """uint8 biased exponents e of the MX scales 2^(e - 127) that map each group's max into e4m3's range."""
    with np.errstate(divide="ignore"):  # an all-zero group: log2(0) = -inf, clipped to e = 0
        exponent = np.floor(np.log2(round_to_power_of_two(amax))) + (E8M0_BIAS - MX_ELEM_EXPONENT)
    return np.clip(exponent, 0, 255).astype(np.uint8)


def e8m0_to_float(e: np.ndarray, dtype) -> np.ndarray:
    return np.ldexp(np.float32(1.0), e.astype(np.int32) - E8M0_BIAS).astype(dtype)


def quantize_mxfp8(w: np.ndarray) -> dict[str, np.ndarray]:
    """fp8 e4m3 weights in groups of 32 inputs, each with a power-of-two scale stored as E8M0."""
    out_dim, in_dim = w.shape
    groups = w.reshape(out_dim, in_dim // MX_GROUP, MX_GROUP)
    exponents = e8m0_exponents(np.abs(groups).max(axis=-1))
    scale = e8m0_to_float(exponents, w.dtype)
    return {"weight": _to_fp8(groups / scale[..., None]).reshape(out_dim, in_dim), "weight_scale": exponents}


def quantize_fp8_block(w: np.ndarray, block: int = FP8_BLOCK) -> dict[str, np.ndarray]:
    """DeepSeek's block quantisation: per block scale = max |w| / 448 (float32), q = w / scale in e4m3;
    edge blocks are partial."""
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // block), -(-in_dim // block)
    padded = np.zeros((rows * block, cols * block), np.float32)
    padded[:out_dim, :in_dim] = w
    blocks = padded.reshape(rows, block, cols, block)
    amax = np.abs(blocks).max(axis=(1, 3)).astype(np.float32)
    scale = np.maximum(amax / np.float32(FP8_MAX), np.float32(np.finfo(np.float32).tiny)).astype(np.float32)
    q = blocks / scale[:, None, :, None]
    q = _to_fp8(q.reshape(rows * block, cols * block)[:out_dim, :in_dim])
    return {"weight": q, "weight_scale_inv": scale}


def quantize_weight(w: np.ndarray, scheme: str, group_size: int | None) -> dict[str, np.ndarray]:
    if scheme == "fp8-block":
        return quantize_fp8_block(w.astype(np.float32))
    if scheme == "w4a16":
        return quantize_int4(w, group_size)
    if scheme == "fp8":
        return quantize_fp8_channel(w)
    if scheme == "mxfp8":
        return quantize_mxfp8(w)
    raise ValueError(f"unknown scheme {scheme!r} (choose from {', '.join(SCHEMES)})")


# ---------------------------------------------------------------------------------------------
# config.json: the entries compressed-tensors' ModelCompressor.update_config writes.


def _args(num_bits: int, type_: str, strategy: str, group_size: int | None, dynamic: bool, mx: bool) -> dict:
    args = {
        "dynamic": dynamic,
        "group_size": group_size,
        "num_bits": num_bits,
        "strategy": strategy,
        "symmetric": True,
        "type": type_,
    }
    if mx:
        args["scale_dtype"] = "torch.uint8"
    return args


def quantization_config(scheme: str, group_size: int | None, ignore: list[str]) -> dict:
    if scheme == "fp8-block":  # DeepSeek's own entries (transformers reads them as FineGrainedFP8Config)
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "modules_to_not_convert": ignore,
        }
    if scheme == "w4a16":
        strategy = "channel" if group_size is None else "group"
        weights, inputs = _args(4, "int", strategy, group_size, False, False), None
    elif scheme == "fp8":
        weights = _args(8, "float", "channel", None, False, False)
        inputs = _args(8, "float", "token", None, True, False)
    else:
        weights = _args(8, "float", "group", MX_GROUP, False, True)
        inputs = _args(8, "float", "group", MX_GROUP, True, True)
    fmt = FORMATS[scheme]
    group = {"format": fmt, "input_activations": inputs, "output_activations": None, "targets": ["Linear"], "weights": weights}
    return {
        "config_groups": {"group_0": group},
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
    }


# ---------------------------------------------------------------------------------------------
# The checkpoint.


def matches(module: str, patterns) -> bool:
    """compressed-tensors name matching: an exact module name, or `re:` + a regex tried with re.match."""
    return any(p == module or (p.startswith("re:") and re.match(p[3:], module)) for p in patterns)


EMBEDDINGS = ("embed_tokens", "embed_tokens_per_layer")  # 2-D, but looked up, never multiplied
# transformers 5's fused expert tensors [E, 2I, H] / [E, H, I] (Gemma 4's `experts.gate_up_proj`, Qwen's v5
# saves): written as one Linear per expert and projection, the layout the QAT releases and vLLM use.
FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def is_linear_weight(key: str, shape: tuple[int, ...]) -> bool:
    return key.endswith(".weight") and len(shape) == 2 and not key.removesuffix(".weight").endswith(EMBEDDINGS)


def fused_expert_parts(key: str, shape: tuple[int, ...]) -> list[tuple[str, int, slice]] | None:
    """For a fused expert tensor `...experts.gate_up_proj` [E, rows, in]: (per-expert module, expert, rows)
    of each Linear it holds, e.g. `...experts.3.up_proj` = rows [I, 2I) of expert 3; None for other keys."""
    prefix, _, name = key.rpartition(".")
    if len(shape) != 3 or name not in FUSED_EXPERTS or not prefix.endswith("experts"):
        return None
    parts = FUSED_EXPERTS[name]
    rows = shape[1] // len(parts)
    return [(f"{prefix}.{e}.{part}", e, slice(i * rows, (i + 1) * rows)) for e in range(shape[0]) for i, part in enumerate(parts)]


def linear_modules(reader: CheckpointReader) -> dict[str, tuple[int, ...]]:
    """Every Linear module of the checkpoint and its [out, in] shape, fused experts split per expert."""
    out = {}
    for key in reader.keys():
        shape = reader.shape(key)
        if is_linear_weight(key, shape):
            out[key.removesuffix(".weight")] = shape
        for module, _, rows in fused_expert_parts(key, shape) or ():
            out[module] = (rows.stop - rows.start, shape[2])
    return out


def _check_layer(module: str, shape: tuple[int, ...], scheme: str, group_size: int | None) -> None:
    """Whole groups (and whole packed int4 words) per row, as the library requires."""
    in_dim = shape[1]
    need = {"w4a16": math.lcm(8, group_size or 8), "mxfp8": MX_GROUP, "fp8": 1, "fp8-block": 1}[scheme]
    if in_dim % need:
        raise ValueError(
            f"layer '{module}': input dimension {in_dim} is not a multiple of {need} for {scheme}; "
            f"pass --ignore {module} (or a smaller --group-size)"
        )


def _output_tensors(reader: CheckpointReader, scheme, group_size, ignore) -> Iterator[tuple[str, np.ndarray]]:
    for key in sorted(reader.keys()):
        shape = reader.shape(key)
        module = key.removesuffix(".weight")
        parts = fused_expert_parts(key, shape)
        if parts is not None:
            fused = np.asarray(reader.array(key))
            for name, expert, rows in parts:
                w = np.ascontiguousarray(fused[expert, rows])
                tensors = {"weight": w} if matches(name, ignore) else quantize_weight(w, scheme, group_size)
                yield from ((f"{name}.{param}", t) for param, t in tensors.items())
            continue
        if len(shape) == 3 and key.endswith("_proj"):
            raise ValueError(f"'{key}' is a 3-D tensor this quantizer does not know how to split into Linear layers")
        if not is_linear_weight(key, shape) or matches(module, ignore):
            yield key, np.asarray(reader.array(key))
            continue
        for name, tensor in quantize_weight(np.asarray(reader.array(key)), scheme, group_size).items():
            yield f"{module}.{name}", tensor


def _write_shards(out: Path, tensors: Iterator[tuple[str, np.ndarray]], max_shard_bytes: int) -> int:
    """safetensors shards of at most `max_shard_bytes`, plus an index when there is more than one."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    size = total = 0
    for key, arr in tensors:
        if size and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = np.ascontiguousarray(arr)
        size += arr.nbytes
        total += arr.nbytes
    names = [SINGLE_FILE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, str(out / name), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return total


def quantize_checkpoint(
    in_dir: str | Path,
    out_dir: str | Path,
    scheme: str,
    group_size: int | None = 128,
    ignore: tuple[str, ...] = (),
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Writes OUT: the quantised safetensors, config.json with quantization_config, and IN's other files."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r} (choose from {', '.join(SCHEMES)})")
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if in_dir.resolve() == out_dir.resolve():
        raise ValueError("OUT must differ from IN")
    raw = read_config_json(in_dir)
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{in_dir} is already quantised (config.json has a quantization_config)")
    if scheme != "w4a16":
        group_size = None  # fp8 is per channel, MXFP8 fixes groups of 32
    elif group_size is not None and group_size <= 0:
        group_size = None  # --group-size -1: one scale per output channel
    patterns = (*DEFAULT_IGNORE, *ignore)
    reader = CheckpointReader(in_dir)
    linear = linear_modules(reader)
    ignored = sorted(m for m in linear if matches(m, patterns))
    for module, shape in linear.items():
        if module not in ignored:
            _check_layer(module, shape, scheme, group_size)

    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    total = _write_shards(out_dir, _output_tensors(reader, scheme, group_size, patterns), max_shard_bytes)
    raw["quantization_config"] = quantization_config(scheme, group_size, ignored)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    for f in in_dir.iterdir():  # tokenizer, generation config, chat template, ...
        if f.is_file() and f.name != "config.json" and f.name != INDEX_FILE and f.suffix != ".safetensors":
            shutil.copy2(f, out_dir / f.name)
    log.info("wrote %s checkpoint (%.1f MiB) to %s in %.1fs", scheme, total / 2**20, out_dir, time.perf_counter() - start)
    return out_dir


# ---------------------------------------------------------------------------------------------
# The `moray quantize` command.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="unquantised Hugging Face checkpoint directory")
    parser.add_argument("output", type=Path, help="directory for the compressed-tensors checkpoint")
    parser.add_argument("--scheme", choices=SCHEMES, required=True)
    parser.add_argument("--group-size", type=int, default=128, help="w4a16: inputs per scale (-1: one scale per output channel)")
    parser.add_argument(
        "--ignore",
        nargs="+",
        action="extend",
        default=[],
        metavar="PATTERN",
        help="module names or re:REGEX to keep unquantised, in addition to lm_head, the MoE routers and a "
        "vision-language composite's vision tower (model.visual.*)",
    )


def run(args: argparse.Namespace) -> int:
    out = quantize_checkpoint(args.input, args.output, args.scheme, args.group_size, tuple(args.ignore))
    print(out)
    return 0
