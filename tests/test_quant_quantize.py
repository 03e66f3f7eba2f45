"""`moray quantize` writes what compressed-tensors writes (names, packing, scales, config), and the library's
decompression of our output is exactly the weights we dequantise on device."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from hf_checkpoints import save_hf_checkpoint
from quant_reference import compress_with_library, decompress_with_library
from safetensors.numpy import save_file

from kernels.quant import QuantizedWeight, dequantize
from workers.models import load_config, load_model
from workers.models.quantize import quantize_checkpoint
from workers.models.safetensors_io import CheckpointReader
from workers.models.weights import plan_leaves

ROOT = Path(__file__).resolve().parent.parent
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {
    "qwen3_moe": MOE,
    "qwen2_moe": dict(MOE, shared_expert_intermediate_size=32),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
}
# (family, our scheme, --group-size, library preset, library weight-arg overrides)
CASES = {
    "w4a16-group32-qwen3_moe": ("qwen3_moe", "w4a16", 32, "W4A16", dict(group_size=32)),
    "w4a16-channel-qwen2_moe": ("qwen2_moe", "w4a16", -1, "W4A16", dict(strategy="channel", group_size=None)),
    "fp8-mixtral": ("mixtral", "fp8", None, "FP8_DYNAMIC", {}),
    "mxfp8-qwen3_moe": ("qwen3_moe", "mxfp8", None, "MXFP8", {}),
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return {f: save_hf_checkpoint(tmp_path_factory.mktemp(f"dense-{f}"), f, seed=2, **kw) for f, kw in FAMILIES.items()}


@pytest.fixture(scope="module")
def dense_bf16(dense, tmp_path_factory):
    """The qwen3_moe checkpoint in bfloat16: scales then live in bf16 and arithmetic rounds to bf16."""
    out = tmp_path_factory.mktemp("dense-bf16")
    reader = CheckpointReader(dense["qwen3_moe"])
    save_file({k: np.asarray(reader.array(k)).astype(ml_dtypes.bfloat16) for k in reader.keys()}, str(out / "model.safetensors"))
    config = json.loads((dense["qwen3_moe"] / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return out


def assert_same_checkpoint(ours: Path, theirs: Path) -> None:
    a, b = CheckpointReader(ours), CheckpointReader(theirs)
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for key in sorted(a.keys()):
        x, y = np.asarray(a.array(key)), np.asarray(b.array(key))
        assert (x.dtype, x.shape) == (y.dtype, y.shape), key
        assert x.tobytes() == y.tobytes(), f"{key} differs"
    config = lambda d: {k: v for k, v in json.loads((d / "config.json").read_text())["quantization_config"].items() if k != "version"}
    assert config(ours) == config(theirs)


@pytest.mark.parametrize("name", CASES)
def test_same_layout_as_the_library(dense, tmp_path, name):
    family, scheme, group, preset, weights = CASES[name]
    ours = quantize_checkpoint(dense[family], tmp_path / "ours", scheme, group)
    theirs = compress_with_library(dense[family], tmp_path / "theirs", preset, **weights)
    assert_same_checkpoint(ours, theirs)


@pytest.mark.parametrize("scheme,preset", [("w4a16", "W4A16"), ("fp8", "FP8_DYNAMIC"), ("mxfp8", "MXFP8")])
def test_same_layout_as_the_library_for_bfloat16_weights(dense_bf16, tmp_path, scheme, preset):
    weights = dict(group_size=32) if scheme == "w4a16" else {}
    ours = quantize_checkpoint(dense_bf16, tmp_path / "ours", scheme, 32)
    assert_same_checkpoint(ours, compress_with_library(dense_bf16, tmp_path / "theirs", preset, **weights))


@pytest.mark.parametrize("name", CASES)
def test_library_decompression_of_our_output_is_what_we_dequantise(dense, tmp_path, name):
    family, scheme, group, _, _ = CASES[name]
    ours = quantize_checkpoint(dense[family], tmp_path / "ours", scheme, group)
    reference = CheckpointReader(decompress_with_library(ours, tmp_path / "dense"))
    _, cfg = load_config(ours)
    dense_plan = load_config(ours)[0].plan(cfg)  # where each leaf's dense tensors live
    model = load_model(ours, dtype="float32", show_progress=False)
    leaves = jax.tree.leaves(model.weights, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    checked = 0
    for spec, leaf in zip(plan_leaves(dense_plan), leaves, strict=True):
        if isinstance(leaf, QuantizedWeight):
            want = spec.source.read(reference, tuple(slice(None) for _ in spec.shape))
            np.testing.assert_array_equal(np.asarray(dequantize(leaf)), want)
            checked += 1
    assert checked == cfg.num_layers * (6 if family == "qwen2_moe" else 4)  # + the shared expert


def moray(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_cli_quantize_and_errors(dense, tmp_path):
    out = tmp_path / "q"
    proc = moray(
        "quantize", str(dense["qwen3_moe"]), str(out), "--scheme", "w4a16", "--group-size", "32", "--ignore", r"re:.*self_attn\.o_proj$"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.o_proj" in config["ignore"] and "lm_head" in config["ignore"]
    assert "model.layers.1.mlp.gate" in config["ignore"]
    model = load_model(out, dtype="float32", show_progress=False)
    assert not isinstance(model.weights.layers[0].attn.o, QuantizedWeight)
    assert isinstance(model.weights.layers[0].attn.qkv, QuantizedWeight)

    proc = moray("quantize", str(dense["qwen3_moe"]), str(tmp_path / "bad"), "--scheme", "w4a16", "--group-size", "48")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    # Which layer is named first depends on the checkpoint's key order; each offending one names itself.
    assert re.search(r"layer '[\w.]+': input dimension (64|32) is not a multiple of 48 for w4a16", proc.stderr), proc.stderr
    proc = moray("quantize", str(out), str(tmp_path / "twice"), "--scheme", "fp8")
    assert proc.returncode == 1 and "is already quantised" in proc.stderr


def test_command_modules_do_not_import_jax_or_torch():
    code = (
        "import argparse, sys, workers.models.quantize as q, bench.memory as m; "
        "q.add_arguments(argparse.ArgumentParser()); m.add_arguments(argparse.ArgumentParser()); "
        "bad = [m for m in ('jax', 'torch', 'transformers') if m in sys.modules]; assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
