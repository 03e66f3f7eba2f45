"""compressed-tensors checkpoints: scheme detection, validation, and quantised weight sources.

`quantize_plan(plan, raw_config)` reads `config.json`'s `quantization_config` and turns every Linear leaf
of a family's dense plan that the config quantises into a `QuantizedSpec`. Its source names the packed
tensors of each module behind the leaf (`weight_packed`/`weight`, `weight_scale`, `weight_shape`), stacked
per expert and fused (gate|up, q|k|v) exactly like the dense tensors, so expert parallelism shards the
packed values and their scales along the expert axis like dense weights. Loading places a
`kernels.quant.QuantizedWeight`: values keep their on-disk dtype (int32 words of eight int4, fp8), float
scales take the compute dtype and MXFP8's E8M0 exponents stay uint8.

Supported (everything else is a load error naming the layer and the reason):
- W4A16: `pack-quantized`, symmetric int4, group or channel strategy, no activation quantisation.
- FP8: `float-quantized`, fp8 e4m3 weights with channel, 2-D block, tensor or group scales; activations
  unquantised or dynamic fp8 (per token, tensor or group).
- MXFP8: `mxfp8-quantized`, fp8 weights in groups of 32 with uint8 E8M0 scales; dynamic group-32
  activations.
Activations are computed in float by default; `MORAY_QUANTIZE_ACTIVATIONS=1` emulates the checkpoint's
dynamic fp8 activation quantisation (see `kernels/quant.py`).

Module matching follows compressed-tensors: `ignore` wins; otherwise a group's exact module name, then a
`re:` pattern (`re.match`), then the class name `Linear` selects its scheme. Every 2-D `*.weight` leaf of
our plans except the token embedding is an `nn.Linear` in the Hugging Face models (the LM head and the
router gate included: real checkpoints list those in `ignore`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable
from weakref import WeakKeyDictionary

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kernels.quant import INT4_PER_WORD, ActivationQuant, QuantizedWeight, shard_group_size

from .config import ModelLoadError
from .safetensors_io import DTYPE_NAMES, CheckpointReader
from .weights import Index, OneOf, Tensor, WeightSpec, is_spec, partition_spec, plan_leaves

ACTIVATIONS_ENV_VAR = "MORAY_QUANTIZE_ACTIVATIONS"
SUPPORTED = "W4A16 pack-quantized, FP8 float-quantized, MXFP8 mxfp8-quantized"
# Parameter names compressed-tensors may attach to a quantised module.
QUANT_PARAMS = {
    "weight_packed",
    "weight_scale",
    "weight_scale_inv",
    "weight_shape",
    "weight_zero_point",
    "weight_g_idx",
    "weight_global_scale",
    "input_scale",
    "input_zero_point",
    "input_global_scale",
    "output_scale",
    "output_zero_point",
}
# Why a tensor next to a quantised layer cannot be served.
EXTRA_TENSOR_REASONS = {
    "weight_zero_point": "asymmetric weights: zero points (weight_zero_point) are not supported",
    "weight_g_idx": "activation reordering (weight_g_idx, actorder 'group') is not supported",
    "weight_global_scale": "global scales (weight_global_scale, NVFP4) are not supported",
    "input_scale": "static activation scales (input_scale) are not supported; only dynamic activations",
    "input_zero_point": "static activation zero points (input_zero_point) are not supported",
    "input_global_scale": "activation global scales (input_global_scale, NVFP4) are not supported",
    "output_scale": "output activation quantisation (output_scale) is not supported",
}
# 2-D weights that are nn.Embedding, not nn.Linear (Gemma 4's per-layer input table too).
_NON_LINEAR_MODULES = ("embed_tokens", "embed_tokens_per_layer")
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


class Unsupported(Exception):
    """A scheme we cannot serve; the caller adds the layer and config group to the message."""


# ---------------------------------------------------------------------------------------------
# Schemes.


@dataclass(frozen=True)
class Scheme:
    """How one module's weights are stored, reduced to what loading and the kernels need."""

    kind: str  # "int4" | "fp8" | "mxfp8" (kernels.quant kinds)
    strategy: str  # "group" | "channel" | "block" | "tensor"
    group_size: int = 0  # group strategy: inputs per scale
    block: tuple[int, int] = (0, 0)  # block strategy: (rows, cols) per scale
    activations: ActivationQuant | None = None
    # The scale tensor's name: compressed-tensors' `weight_scale`, DeepSeek's native `weight_scale_inv`
    # (despite the name, also the factor that dequantises: w = q * scale).
    scale_param: str = "weight_scale"

    @property
    def label(self) -> str:
        name = {"int4": "W4A16 int4", "fp8": "FP8", "mxfp8": "MXFP8"}[self.kind]
        detail = {"group": f"group {self.group_size}", "block": "block {}x{}".format(*self.block)}
        return f"{name} ({detail.get(self.strategy, self.strategy)})"

    @property
    def values_param(self) -> str:
        return "weight_packed" if self.kind == "int4" else "weight"

    @property
    def params(self) -> tuple[str, ...]:
        return ("weight_packed", "weight_scale", "weight_shape") if self.kind == "int4" else ("weight", self.scale_param)

    def inputs_per_scale(self, in_dim: int) -> int:
        """Inputs one stored scale covers along a row (the last group may be partial for blocks)."""
        if self.strategy in ("channel", "tensor"):
            return in_dim
        return self.block[1] if self.strategy == "block" else self.group_size

    def values_shape(self, out_dim: int, in_dim: int) -> tuple[int, int]:
        return (out_dim, in_dim // INT4_PER_WORD) if self.kind == "int4" else (out_dim, in_dim)

    def scale_shape(self, out_dim: int, in_dim: int) -> tuple[int, ...]:
        if self.strategy == "tensor":
            return (1,)
        if self.strategy == "block":
            return (-(-out_dim // self.block[0]), -(-in_dim // self.block[1]))
        return (out_dim, -(-in_dim // self.inputs_per_scale(in_dim)))


def _is_e8m0(args: dict) -> bool:
    return str(args.get("scale_dtype") or "").endswith("uint8")


def _float_activations(args: dict | None, mx: bool) -> ActivationQuant | None:
    if not args:
        return None
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise Unsupported(f"{args.get('num_bits')}-bit {args.get('type')} activations are not supported with fp8 weights")
    if not args.get("dynamic"):
        raise Unsupported("static activation scales (input_scale) are not supported; only dynamic activations")
    if not args.get("symmetric", True):
        raise Unsupported("asymmetric activation quantisation is not supported")
    strategy = args.get("strategy") or "tensor"
    if strategy not in ("token", "tensor", "group"):
        raise Unsupported(f"activation strategy '{strategy}' is not supported (token, tensor or group)")
    return ActivationQuant(strategy, int(args.get("group_size") or 0), e8m0=mx)


def _int4_scheme(w: dict, group: dict, fmt: str) -> Scheme:
    if not w.get("symmetric", True):
        raise Unsupported("asymmetric int4 weights (zero points) are not supported; only symmetric")
    if w.get("actorder") in ("group", "dynamic", True):
        raise Unsupported("actorder 'group' (activation reordering with weight_g_idx) is not supported")
    strategy = w.get("strategy") or ("group" if w.get("group_size") else "tensor")
    if strategy not in ("group", "channel"):
        raise Unsupported(f"int4 '{strategy}' strategy is not supported (group or channel)")
    if group.get("input_activations"):
        raise Unsupported("int4 weights with quantised activations (W4A8/W4AFP8) are not supported")
    if fmt != "pack-quantized":
        raise Unsupported(f"format '{fmt}' is not supported for int4 weights (expected pack-quantized)")
    return Scheme("int4", strategy, group_size=int(w.get("group_size") or 0) if strategy == "group" else 0)


def _fp8_scheme(w: dict, group: dict, fmt: str) -> Scheme:
    if not w.get("symmetric", True):
        raise Unsupported("asymmetric fp8 weights are not supported")
    strategy = w.get("strategy") or ("group" if w.get("group_size") else "tensor")
    mx = strategy == "group" and w.get("group_size") == 32 and _is_e8m0(w)
    activations = _float_activations(group.get("input_activations"), mx)
    if mx:
        if fmt != "mxfp8-quantized":
            raise Unsupported(f"format '{fmt}' is not supported for MXFP8 weights (expected mxfp8-quantized)")
        return Scheme("mxfp8", "group", group_size=32, activations=activations)
    if _is_e8m0(w):
        raise Unsupported(f"E8M0 scales with {strategy} strategy (group {w.get('group_size')}) are not MXFP8")
    if fmt != "float-quantized":
        raise Unsupported(f"format '{fmt}' is not supported for fp8 weights (expected float-quantized)")
    if strategy == "block":
        block = tuple(w.get("block_structure") or ())
        if len(block) != 2:
            raise Unsupported(f"block strategy needs a 2-D block_structure, got {w.get('block_structure')!r}")
        return Scheme("fp8", "block", block=(int(block[0]), int(block[1])), activations=activations)
    if strategy not in ("channel", "tensor", "group"):
        raise Unsupported(f"fp8 '{strategy}' strategy is not supported (channel, block, tensor or group)")
    return Scheme("fp8", strategy, group_size=int(w.get("group_size") or 0), activations=activations)


def scheme_from_group(group: dict, fmt: str) -> Scheme:
    """Validates one config group (its `weights`, activations and format) into a `Scheme`."""
    w = group.get("weights")
    if not w:
        raise Unsupported("activation-only quantisation (no weight scheme) is not supported")
    if group.get("output_activations"):
        raise Unsupported("output activation quantisation is not supported")
    if w.get("dynamic"):
        raise Unsupported("dynamic weight quantisation (scales computed at run time) is not supported")
    typ, bits = w.get("type", "int"), w.get("num_bits", 8)
    if (typ == "float" and bits == 4) or fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        mxfp4 = fmt == "mxfp4-pack-quantized" or (w.get("group_size") == 32 and _is_e8m0(w))
        raise Unsupported(f"{'MXFP4' if mxfp4 else 'NVFP4'} (4-bit float weights) is not supported")
    if typ == "int" and bits == 8:
        raise Unsupported("8-bit integer weights (int8 W8A16/W8A8) are not supported; use W4A16, FP8 or MXFP8")
    if typ == "int" and bits == 4:
        return _int4_scheme(w, group, fmt)
    if typ == "float" and bits == 8:
        return _fp8_scheme(w, group, fmt)
    raise Unsupported(f"{bits}-bit {typ} weights are not supported ({SUPPORTED})")


@dataclass(frozen=True)
class QuantConfig:
    """The parts of `quantization_config` that decide each module's scheme."""

    groups: tuple[tuple[str, tuple[str, ...], dict, str], ...]  # (name, targets, group dict, format)
    ignore: tuple[str, ...]
    scale_param: str = "weight_scale"

    def _matching_group(self, module: str) -> int | None:
        """compressed-tensors' priority: exact name, then `re:` pattern, then the class name `Linear`."""
        ranked = []
        for i, (_, targets, _, _) in enumerate(self.groups):
            for t in targets:
                if t == module:
                    ranked.append((0, t, i))
                elif t.startswith("re:") and re.match(t[3:], module):
                    ranked.append((1, t, i))
                elif t == "Linear":
                    ranked.append((2, t, i))
        return min(ranked)[2] if ranked else None

    def ignored(self, module: str) -> bool:
        return any(i == module or (i.startswith("re:") and re.match(i[3:], module)) for i in self.ignore)

    def scheme_for(self, module: str) -> Scheme | None:
        if self.ignored(module):
            return None
        i = self._matching_group(module)
        if i is None:
            return None
        name, _, group, fmt = self.groups[i]
        try:
            return dataclasses.replace(scheme_from_group(group, fmt), scale_param=self.scale_param)
        except Unsupported as e:
            raise ModelLoadError(f"quantization_config: layer '{module}' ({name}): {e}") from None


def parse_quantization_config(raw_config: dict[str, Any]) -> QuantConfig | None:
    """None for an unquantised model; a load error for methods and features we cannot serve."""
    q = raw_config.get("quantization_config") or raw_config.get("compression_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ModelLoadError("config.json: quantization_config must be an object")
    method = q.get("quant_method")
    if method == "fp8":
        return _native_fp8_config(q)
    if method != "compressed-tensors":
        raise ModelLoadError(
            f"quantization_config: quant_method {method!r} is not supported (compressed-tensors: {SUPPORTED}; "
            "or fp8 with weight_block_size, DeepSeek's native format)"
        )
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise ModelLoadError(f"quantization_config: quantization_status '{status}' is not supported (expected 'compressed')")
    for key, what in (
        ("kv_cache_scheme", "KV cache quantisation"),
        ("sparsity_config", "sparse weights"),
        ("transform_config", "weight transforms (rotations)"),
    ):
        if q.get(key):
            raise ModelLoadError(f"quantization_config: {key} ({what}) is not supported")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError("quantization_config: config_groups is missing or empty")
    top_format = q.get("format") or "dense"
    parsed = []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise ModelLoadError(f"quantization_config: config group '{name}' must be an object (preset names are not supported)")
        fmt = group.get("format") or top_format
        parsed.append((name, tuple(group.get("targets") or ()), group, fmt))
    return QuantConfig(tuple(parsed), tuple(q.get("ignore") or ()))


# DeepSeek's native FP8 (transformers' FineGrainedFP8): every nn.Linear but the MoE routers, lm_head and
# `modules_to_not_convert` holds e4m3 `weight` and a float `weight_scale_inv` per weight block; activations
# are quantised dynamically per token in groups of a block's width. Read as the equivalent compressed-tensors
# block scheme, so the same loader, checks and kernels serve it.
NATIVE_FP8_DEFAULT_IGNORE = ("lm_head", r"re:.*mlp\.gate$")


def _native_fp8_config(q: dict) -> QuantConfig:
    def fail(why: str):
        raise ModelLoadError(f"quantization_config (quant_method fp8): {why}")

    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        fail(f"weight_block_size must be two positive integers, got {block!r} (per-tensor FP8 is not supported)")
    if q.get("fmt", "e4m3") != "e4m3":
        fail(f"fmt {q.get('fmt')!r} is not supported (e4m3 only)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        fail(f"activation_scheme {q.get('activation_scheme')!r} is not supported (dynamic only)")
    group = {
        "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": block, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": block[1], "dynamic": True},
    }
    # An entry names a module or a dotted part of its path ("lm_head", "model.layers.3.mlp"): that module and
    # everything under it stay unquantised.
    ignore = (*NATIVE_FP8_DEFAULT_IGNORE, *(rf"re:(.*\.)?{re.escape(str(m))}(\..*)?$" for m in q.get("modules_to_not_convert") or ()))
    return QuantConfig((("fp8", ("Linear",), group, "float-quantized"),), ignore, scale_param="weight_scale_inv")


# ---------------------------------------------------------------------------------------------
# Sources for scales: reshape what is on disk into one scale row per output row.


@dataclass(frozen=True)
class BlockRows:
    """2-D block scales [ceil(out/b), ceil(in/c)] repeated to one row per output row: [out, ceil(in/c)]."""

    part: Tensor
    rows: int
    block_rows: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, self.part.shape[1])

    def keys(self):
        return self.part.keys()

    def present(self, reader) -> bool:
        return self.part.present(reader)

    def read(self, reader: CheckpointReader, index: Index) -> np.ndarray:
        full = np.asarray(reader.array(self.part.key))
        return np.repeat(full, self.block_rows, axis=0)[: self.rows][index]


@dataclass(frozen=True)
class BroadcastRows:
    """A per-tensor scale [1] as one scale per output row: [out, 1]."""

    part: Tensor
    rows: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, 1)

    def keys(self):
        return self.part.keys()

    def present(self, reader) -> bool:
        return self.part.present(reader)

    def read(self, reader: CheckpointReader, index: Index) -> np.ndarray:
        scale = np.asarray(reader.array(self.part.key)).reshape(1, 1)
        return np.broadcast_to(scale, self.shape)[index]


@dataclass(frozen=True)
class RegroupCols:
    """Scales of groups of `old` inputs re-expressed for groups of `new` (new divides old and in_dim):
    column j covers inputs [j*new, (j+1)*new), which lie inside old group (j*new) // old."""

    source: Any
    in_dim: int
    old: int
    new: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.source.shape[:-1], self.in_dim // self.new)

    def keys(self):
        return self.source.keys()

    def present(self, reader) -> bool:
        return self.source.present(reader)

    def read(self, reader: CheckpointReader, index: Index) -> np.ndarray:
        cols = np.arange(self.shape[-1])[index[-1]] * self.new // self.old
        return self.source.read(reader, (*index[:-1], slice(None)))[..., cols]


# ---------------------------------------------------------------------------------------------
# The quantised leaf.


@dataclass(frozen=True)
class Module:
    name: str
    out_dim: int
    in_dim: int


def _dtype_name(dtype: np.dtype) -> str:
    return DTYPE_NAMES.get(np.dtype(dtype), str(dtype))


def _check_values(reader: CheckpointReader, m: Module, scheme: Scheme, fail) -> None:
    key = f"{m.name}.{scheme.values_param}"
    if key not in reader:
        if f"{m.name}.weight" in reader:
            fail("quantization_config quantises this layer but the checkpoint holds a dense 'weight'")
        fail(f"missing tensor '{key}'")
    dtype = _dtype_name(reader.tensors[key].dtype)
    if scheme.kind == "int4" and dtype != "I32":
        kind = "floating-point" if dtype in _FLOAT_DTYPES else "not int32"
        fail(f"weight_packed is {kind} ({dtype}); packed int4 weights must be I32 words")
    if scheme.kind != "int4" and dtype != "F8_E4M3":
        fail(f"weight has dtype {dtype}, expected F8_E4M3")
    want = scheme.values_shape(m.out_dim, m.in_dim)
    if reader.shape(key) != want:
        fail(f"{scheme.values_param} has shape {list(reader.shape(key))}, expected {list(want)}")


def _check_scale(reader: CheckpointReader, m: Module, scheme: Scheme, fail) -> None:
    name = scheme.scale_param
    key = f"{m.name}.{name}"
    if key not in reader:
        fail(f"missing tensor '{key}'")
    dtype = _dtype_name(reader.tensors[key].dtype)
    if scheme.kind == "mxfp8" and dtype != "U8":
        fail(f"{name} has dtype {dtype}, expected U8 (E8M0 exponents)")
    if scheme.kind != "mxfp8" and dtype not in ("F64", "F32", "BF16", "F16"):
        fail(f"{name} has dtype {dtype}, expected a float")
    want = scheme.scale_shape(m.out_dim, m.in_dim)
    if reader.shape(key) != want:
        fail(f"{name} has shape {list(reader.shape(key))}, expected {list(want)}")


def _check_weight_shape(reader: CheckpointReader, m: Module, fail) -> None:
    """pack-quantized records the dense shape; it must be the [out, in] this layer's plan expects."""
    key = f"{m.name}.weight_shape"
    if key not in reader:
        fail(f"missing tensor '{key}'")
    got = np.asarray(reader.array(key))
    if got.dtype.kind not in "iu" or got.tolist() != [m.out_dim, m.in_dim]:
        fail(f"weight_shape is {got.tolist()}, expected [out, in] = [{m.out_dim}, {m.in_dim}]")


def _check_module(reader: CheckpointReader, m: Module, scheme: Scheme) -> None:
    """Every tensor of one quantised module: present, the right dtype and shape."""

    def fail(why: str):
        raise ModelLoadError(f"layer '{m.name}' ({scheme.label}): {why}")

    _check_values(reader, m, scheme, fail)
    _check_scale(reader, m, scheme, fail)
    if scheme.kind == "int4":
        _check_weight_shape(reader, m, fail)


@dataclass(frozen=True)
class QuantizedSource:
    """The packed values and scales behind one leaf, laid out like its dense source (stacked, fused)."""

    values: Any  # [..., N, K / 8] int32 or [..., N, K] fp8
    scale: Any  # [..., N, ceil(K / inputs_per_scale)]
    modules: tuple[Module, ...]
    scheme: Scheme
    shape: tuple[int, ...]  # the dense shape [..., N, K]

    @property
    def in_dim(self) -> int:
        return self.shape[-1]

    @property
    def inputs_per_scale(self) -> int:
        return self.scheme.inputs_per_scale(self.in_dim)

    def keys(self):
        for m in self.modules:
            for p in self.scheme.params:
                yield f"{m.name}.{p}"

    def present(self, reader) -> bool:
        return self.values.present(reader) and self.scale.present(reader)

    def check(self, reader: CheckpointReader) -> None:
        for m in self.modules:
            _check_module(reader, m, self.scheme)


def quantize_activations_enabled() -> bool:
    return os.environ.get(ACTIVATIONS_ENV_VAR, "").lower() in ("1", "true", "yes", "dynamic")


def _mesh_shards(mesh, mesh_axes) -> int:
    if mesh_axes is None:
        return 1
    names = mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)
    return math.prod(mesh.shape[n] for n in names)


@dataclass(frozen=True)
class QuantizedSpec(WeightSpec):
    """A leaf whose source is a `QuantizedSource`; it places a `QuantizedWeight` (values + scales)."""

    def _layout(self, mesh, rules) -> tuple[NamedSharding, int]:
        """The sharding values and scales share, and the group size that gives every input shard whole groups."""
        spec = partition_spec(self.logical_axes, rules)
        src: QuantizedSource = self.source
        shards = _mesh_shards(mesh, spec[-1])  # mesh axes of the input (last) dimension
        per_word = INT4_PER_WORD if src.scheme.kind == "int4" else 1
        try:
            group = shard_group_size(src.inputs_per_scale, src.in_dim, shards, per_word)
        except ValueError as e:
            raise ModelLoadError(f"layer '{src.modules[0].name}' ({src.scheme.label}): input-sharded layout: {e}") from None
        return NamedSharding(mesh, spec), group

    def _activations(self) -> ActivationQuant | None:
        src: QuantizedSource = self.source
        act = src.scheme.activations
        if act is None or not quantize_activations_enabled():
            return None
        if act.strategy == "group" and src.in_dim % act.group_size:
            raise ModelLoadError(
                f"layer '{src.modules[0].name}': input dimension {src.in_dim} is not a multiple of the "
                f"activation group size {act.group_size}"
            )
        return act

    def _scale_dtype(self, dtype) -> np.dtype:
        # MXFP8 keeps its 1-byte E8M0 exponents; float scales follow the compute dtype.
        return np.dtype(np.uint8) if self.source.scheme.kind == "mxfp8" else np.dtype(jnp.dtype(dtype))

    def load(self, reader: CheckpointReader, mesh, rules, dtype) -> QuantizedWeight:
        src: QuantizedSource = self.source
        sharding, group = self._layout(mesh, rules)
        scale_src = src.scale
        if group != src.inputs_per_scale:
            scale_src = RegroupCols(src.scale, src.in_dim, src.inputs_per_scale, group)
        scale_dtype = self._scale_dtype(dtype)
        values = jax.make_array_from_callback(
            src.values.shape, sharding, lambda index: np.ascontiguousarray(src.values.read(reader, index))
        )
        scale = jax.make_array_from_callback(
            scale_src.shape, sharding, lambda index: scale_src.read(reader, index).astype(scale_dtype, copy=False)
        )
        return QuantizedWeight(values, scale, src.scheme.kind, group, self._activations())

    def dummy(self, key, mesh, rules, dtype) -> QuantizedWeight:
        """Random packed values with scales that give weights of about `init_scale` standard deviation."""
        src: QuantizedSource = self.source
        sharding, group = self._layout(mesh, rules)
        kind, std = src.scheme.kind, self.init_scale or 0.02
        values_shape = (*src.shape[:-1], src.in_dim // (INT4_PER_WORD if kind == "int4" else 1))
        scale_shape = (*src.shape[:-1], src.in_dim // group)

        def make(k):
            if kind == "int4":  # uniform nibbles in [-8, 7] have a standard deviation of ~4.6
                values = jax.lax.bitcast_convert_type(jax.random.bits(k, values_shape, jnp.uint32), jnp.int32)
                return values, jnp.full(scale_shape, std / 4.6, dtype)
            values = jax.random.normal(k, values_shape, jnp.float32).astype(jnp.float8_e4m3fn)
            if kind == "mxfp8":
                exponent = 127 + round(math.log2(std))
                return values, jnp.full(scale_shape, exponent, jnp.uint8)
            return values, jnp.full(scale_shape, std, dtype)

        values, scale = jax.jit(make, out_shardings=(sharding, sharding))(key)
        return QuantizedWeight(values, scale, kind, group, self._activations())


# ---------------------------------------------------------------------------------------------
# Rewriting a dense plan.


def _base_tensors(source) -> list[Tensor]:
    """The per-module checkpoint tensors behind a source (for experts, the per-expert layout)."""
    if isinstance(source, Tensor):
        return [source]
    if isinstance(source, OneOf):
        return _base_tensors(source.options[0])
    return [t for part in source.parts for t in _base_tensors(part)]


def _map_tensors(source, fn):
    """The same Concat/Stack/Rows structure with every Tensor replaced by fn(tensor). Scales are per
    output row, so a `Rows` reordering applies to them as it does to the values."""
    if isinstance(source, Tensor):
        return fn(source)
    if isinstance(source, OneOf):
        return _map_tensors(source.options[0], fn)
    return dataclasses.replace(source, parts=tuple(_map_tensors(p, fn) for p in source.parts))


def _module_name(t: Tensor) -> str:
    return t.key.removesuffix(".weight")


def _linear_tensors(spec: WeightSpec) -> list[Tensor] | None:
    """The tensors behind a leaf when it is made of nn.Linear weights; None for norms, embeddings, biases."""
    tensors = _base_tensors(spec.source)
    for t in tensors:
        if not t.key.endswith(".weight") or len(t.shape) != 2 or _module_name(t).endswith(_NON_LINEAR_MODULES):
            return None
    return tensors


def _scale_source(t: Tensor, scheme: Scheme):
    out_dim, in_dim = t.shape
    name = _module_name(t)
    raw = Tensor(f"{name}.{scheme.scale_param}", scheme.scale_shape(out_dim, in_dim))
    if scheme.strategy == "tensor":
        return BroadcastRows(raw, out_dim)
    if scheme.strategy == "block":
        return BlockRows(raw, out_dim, scheme.block[0])
    return raw


def _check_dims(module: str, scheme: Scheme, in_dim: int) -> None:
    def fail(why):
        raise ModelLoadError(f"layer '{module}' ({scheme.label}): {why}")

    if scheme.kind == "int4" and in_dim % INT4_PER_WORD:
        fail(f"input dimension {in_dim} is not a multiple of {INT4_PER_WORD} (packed int4 words)")
    if scheme.strategy == "group" and in_dim % scheme.group_size:
        fail(f"input dimension {in_dim} is not a multiple of group_size {scheme.group_size}")


def _quantize_leaf(spec: WeightSpec, config: QuantConfig) -> WeightSpec:
    tensors = _linear_tensors(spec)
    if tensors is None:
        return spec
    schemes = [config.scheme_for(_module_name(t)) for t in tensors]
    if all(s is None for s in schemes):
        return spec
    for t, s in zip(tensors, schemes):
        if s != schemes[0]:
            a, b = _module_name(tensors[0]), _module_name(t)
            describe = lambda x: x.label if x else "unquantised"
            raise ModelLoadError(
                f"quantization_config: layers '{a}' and '{b}' are fused into one matrix but quantised "
                f"differently ({describe(schemes[0])} vs {describe(s)})"
            )
    scheme = schemes[0]
    for t in tensors:
        _check_dims(_module_name(t), scheme, t.shape[1])

    def values(t: Tensor) -> Tensor:
        return Tensor(f"{_module_name(t)}.{scheme.values_param}", scheme.values_shape(*t.shape))

    source = QuantizedSource(
        values=_map_tensors(spec.source, values),
        scale=_map_tensors(spec.source, lambda t: _scale_source(t, scheme)),
        modules=tuple(Module(_module_name(t), *t.shape) for t in tensors),
        scheme=scheme,
        shape=spec.shape,
    )
    return QuantizedSpec(source, spec.logical_axes, spec.init_scale)


def quantize_plan(plan, raw_config: dict[str, Any]):
    """The plan with every Linear leaf the checkpoint's quantization_config quantises made a QuantizedSpec."""
    config = parse_quantization_config(raw_config)
    if config is None:
        return plan
    return jax.tree.map(lambda spec: _quantize_leaf(spec, config), plan, is_leaf=is_spec)


# ---------------------------------------------------------------------------------------------
# Checks that need the whole checkpoint: stray quantisation tensors.

_module_params: "WeakKeyDictionary[CheckpointReader, dict[str, set[str]]]" = WeakKeyDictionary()


def _params_by_module(reader: CheckpointReader) -> dict[str, set[str]]:
    if reader not in _module_params:
        index: dict[str, set[str]] = defaultdict(set)
        for key in reader.keys():
            module, _, param = key.rpartition(".")
            index[module].add(param)
        _module_params[reader] = index
    return _module_params[reader]


def check_quantized_tensors(plan, reader: CheckpointReader, raw_config: dict[str, Any]) -> None:
    """Quantised layers hold no tensors we would ignore (zero points, g_idx, static input scales, ...), and
    layers we load as dense hold no packed tensors: packed weights are never served as if they were dense."""
    quantized = raw_config.get("quantization_config") is not None
    index = _params_by_module(reader)
    for spec in plan_leaves(plan):
        if isinstance(spec, QuantizedSpec):
            expected = {*spec.source.scheme.params, "bias"}  # a bias is its own (dense) leaf
            for m in spec.source.modules:
                extra = sorted(index.get(m.name, set()) - expected)
                if extra:
                    reason = EXTRA_TENSOR_REASONS.get(extra[0], f"unknown tensor '{m.name}.{extra[0]}'")
                    if extra[0] == "weight":
                        reason = "quantization_config quantises this layer but the checkpoint holds a dense 'weight'"
                    raise ModelLoadError(f"layer '{m.name}' ({spec.source.scheme.label}): {reason}")
            continue
        for t in _linear_tensors(spec) or ():
            stray = sorted(index.get(_module_name(t), set()) & QUANT_PARAMS)
            if stray:
                why = "quantization_config does not quantise this layer" if quantized else "config.json has no quantization_config"
                raise ModelLoadError(
                    f"layer '{_module_name(t)}': checkpoint holds quantised tensors ({', '.join(stray)}) but {why}; "
                    "refusing to load packed weights as dense"
                )


def quantized_modules(plan) -> Iterable[str]:
    """Names of the modules a plan loads quantised (for reports and tests)."""
    for spec in plan_leaves(plan):
        if isinstance(spec, QuantizedSpec):
            yield from (m.name for m in spec.source.modules)
