"""Every quantised variant we cannot serve is a load-time error naming the layer and the reason; packed
weights are never loaded as if they were dense."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hf_checkpoints import save_hf_checkpoint
from safetensors.numpy import save_file

from workers.models import ModelLoadError, load_model
from workers.models.quantize import quantize_checkpoint
from workers.models.safetensors_io import CheckpointReader

ROOT = Path(__file__).resolve().parent.parent
Q = "model.layers.0.self_attn.q_proj"
UP = "model.layers.0.mlp.experts.1.up_proj"  # [32, 64]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    dense = save_hf_checkpoint(
        tmp_path_factory.mktemp("dense"), "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
    return {
        scheme: quantize_checkpoint(dense, tmp_path_factory.mktemp(scheme), scheme, group_size=32) for scheme in ("w4a16", "fp8", "mxfp8")
    }


def variant(base, tmp_path, scheme="w4a16", config=None, tensors=None) -> Path:
    """A copy of the `scheme` checkpoint with `config(quantization_config)` and `tensors(dict)` applied."""
    d = tmp_path / "ckpt"
    shutil.copytree(base[scheme], d)
    raw = json.loads((d / "config.json").read_text())
    if config:
        config(raw["quantization_config"], raw)
    (d / "config.json").write_text(json.dumps(raw))
    if tensors:
        reader = CheckpointReader(d)
        state = {k: np.array(reader.array(k)) for k in reader.keys()}
        del reader
        tensors(state)
        save_file(state, str(d / "model.safetensors"))
    return d


def weights_of(group=0):
    return lambda q, raw=None: q["config_groups"][f"group_{group}"]["weights"]


def load_error(path: Path, message: str) -> None:
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        load_model(path, dtype="float32", show_progress=False)


def setter(**fields):
    def apply(q, raw):
        q["config_groups"]["group_0"]["weights"].update(fields)

    return apply


GROUP_ERR = f"quantization_config: layer '{Q}' (group_0): "

CONFIG_CASES = {
    "asymmetric": (setter(symmetric=False), GROUP_ERR + "asymmetric int4 weights (zero points) are not supported"),
    "actorder-group": (setter(actorder="group"), GROUP_ERR + "actorder 'group' (activation reordering with weight_g_idx)"),
    "int8-weight-only": (setter(num_bits=8), GROUP_ERR + "8-bit integer weights (int8 W8A16/W8A8) are not supported"),
    "nvfp4": (
        lambda q, raw: q.update(
            format="nvfp4-pack-quantized",
            config_groups={
                "group_0": dict(
                    q["config_groups"]["group_0"],
                    format="nvfp4-pack-quantized",
                    weights=dict(
                        num_bits=4,
                        type="float",
                        strategy="tensor_group",
                        group_size=16,
                        symmetric=True,
                        dynamic=False,
                        scale_dtype="torch.float8_e4m3fn",
                    ),
                )
            },
        ),
        GROUP_ERR + "NVFP4 (4-bit float weights) is not supported",
    ),
    "mxfp4": (
        lambda q, raw: q.update(
            config_groups={
                "group_0": dict(
                    q["config_groups"]["group_0"],
                    format="mxfp4-pack-quantized",
                    weights=dict(
                        num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, dynamic=False, scale_dtype="torch.uint8"
                    ),
                )
            },
        ),
        GROUP_ERR + "MXFP4 (4-bit float weights) is not supported",
    ),
    "dynamic-weights": (setter(dynamic=True), GROUP_ERR + "dynamic weight quantisation (scales computed at run time)"),
    "unsupported-format": (
        lambda q, raw: q["config_groups"]["group_0"].update(format="marlin-24"),
        GROUP_ERR + "format 'marlin-24' is not supported for int4 weights (expected pack-quantized)",
    ),
    "w4a8": (
        lambda q, raw: q["config_groups"]["group_0"].update(
            input_activations=dict(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=True)
        ),
        GROUP_ERR + "int4 weights with quantised activations (W4A8/W4AFP8) are not supported",
    ),
    "other-method": (
        lambda q, raw: q.update(quant_method="gptq"),
        "quantization_config: quant_method 'gptq' is not supported (compressed-tensors: ",
    ),
    "kv-cache-scheme": (
        lambda q, raw: q.update(kv_cache_scheme=dict(num_bits=8, type="float", strategy="tensor", dynamic=False)),
        "quantization_config: kv_cache_scheme (KV cache quantisation) is not supported",
    ),
    "not-compressed": (
        lambda q, raw: q.update(quantization_status="frozen"),
        "quantization_config: quantization_status 'frozen' is not supported (expected 'compressed')",
    ),
    "fused-quantised-differently": (
        lambda q, raw: q["ignore"].append("model.layers.0.self_attn.k_proj"),
        f"quantization_config: layers '{Q}' and 'model.layers.0.self_attn.k_proj' are fused into one matrix but "
        "quantised differently (W4A16 int4 (group 32) vs unquantised)",
    ),
    "ignored-but-packed": (
        lambda q, raw: q["ignore"].append(r"re:.*mlp\.experts\."),
        "layer 'model.layers.0.mlp.experts.0.gate_proj': checkpoint holds quantised tensors (weight_packed, weight_scale, weight_shape) but "
        "quantization_config does not quantise this layer; refusing to load packed weights as dense",
    ),
    "no-quantization-config": (
        lambda q, raw: raw.pop("quantization_config"),
        f"layer '{Q}': checkpoint holds quantised tensors (weight_packed, weight_scale, weight_shape) but "
        "config.json has no quantization_config; refusing to load packed weights as dense",
    ),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_unsupported_config(base, tmp_path, case):
    edit, message = CONFIG_CASES[case]
    load_error(variant(base, tmp_path, config=edit), message)


def _set(key, value):
    return lambda state: state.__setitem__(key, value)


W4 = f"layer '{UP}' (W4A16 int4 (group 32)): "
TENSOR_CASES = {
    "zero-point-tensor": (
        _set(f"{UP}.weight_zero_point", np.zeros((4, 2), np.int32)),
        W4 + "asymmetric weights: zero points (weight_zero_point) are not supported",
    ),
    "g-idx-tensor": (
        _set(f"{UP}.weight_g_idx", np.zeros(64, np.int32)),
        W4 + "activation reordering (weight_g_idx, actorder 'group') is not supported",
    ),
    "unknown-tensor": (_set(f"{UP}.weight_magic", np.zeros(3, np.float32)), W4 + f"unknown tensor '{UP}.weight_magic'"),
    "weight-shape-transposed": (
        _set(f"{UP}.weight_shape", np.array([64, 32], np.int64)),
        W4 + "weight_shape is [64, 32], expected [out, in] = [32, 64]",
    ),
    "float-weight-packed": (
        _set(f"{UP}.weight_packed", np.zeros((32, 8), np.float32)),
        W4 + "weight_packed is floating-point (F32); packed int4 weights must be I32 words",
    ),
    "dense-weight-instead": (
        lambda s: (s.pop(f"{UP}.weight_packed"), s.__setitem__(f"{UP}.weight", np.zeros((32, 64), np.float32))),
        W4 + "quantization_config quantises this layer but the checkpoint holds a dense 'weight'",
    ),
    "missing-scale": (lambda s: s.pop(f"{UP}.weight_scale"), W4 + f"missing tensor '{UP}.weight_scale'"),
}


@pytest.mark.parametrize("case", TENSOR_CASES)
def test_bad_quantised_tensors(base, tmp_path, case):
    edit, message = TENSOR_CASES[case]
    load_error(variant(base, tmp_path, tensors=edit), message)


def test_fp8_static_activations(base, tmp_path):
    static = lambda q, raw: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False)
    load_error(
        variant(base, tmp_path, "fp8", config=static),
        GROUP_ERR + "static activation scales (input_scale) are not supported; only dynamic activations",
    )
    d = variant(base, tmp_path / "b", "fp8", tensors=_set(f"{UP}.input_scale", np.ones(1, np.float32)))
    load_error(d, f"layer '{UP}' (FP8 (channel)): static activation scales (input_scale) are not supported")


def test_fp8_formats_and_mxfp8_scale_dtype(base, tmp_path):
    naive = lambda q, raw: q["config_groups"]["group_0"].update(format="naive-quantized")
    load_error(
        variant(base, tmp_path, "fp8", config=naive),
        GROUP_ERR + "format 'naive-quantized' is not supported for fp8 weights (expected float-quantized)",
    )
    float_scales = _set(f"{UP}.weight_scale", np.ones((32, 2), np.float32))
    load_error(
        variant(base, tmp_path / "b", "mxfp8", tensors=float_scales),
        f"layer '{UP}' (MXFP8 (group 32)): weight_scale has dtype F32, expected U8 (E8M0 exponents)",
    )


def test_cli_reports_one_line(base, tmp_path):
    d = variant(base, tmp_path, config=setter(symmetric=False))
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "logits", "--model", str(d), "--token-ids", "1,2,3", "--out", str(tmp_path / "l.npy")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("moray: error:")]
    assert lines == [f"moray: error: {GROUP_ERR}asymmetric int4 weights (zero points) are not supported; only symmetric"]
