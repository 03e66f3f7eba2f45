"""Weights stay packed in device memory (measured from the device buffers by `moray bench memory`), the
benchmark reports speed and quality, `--load-format dummy` builds packed weights, and the engine serves a
quantised checkpoint like the library-decompressed dense one."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_checkpoints import save_hf_checkpoint
from quant_reference import decompress_with_library

from bench.memory import device_bytes, measure
from kernels.quant import QuantizedWeight
from workers.engine import LLM, SamplingParams
from workers.models import load_model, prompt_logits
from workers.models.make_model import make_model
from workers.models.quantize import quantize_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def expert_heavy(tmp_path_factory) -> Path:
    """Like real MoE LLMs, expert weights dominate: 16 experts of 3 x 128 x 128 per layer vs a 256-token
    vocabulary (the embedding, LM head, routers and norms stay bf16 in every version)."""
    return save_hf_checkpoint(
        tmp_path_factory.mktemp("heavy"),
        "qwen3_moe",
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        initializer_range=0.05,
    )


def test_bench_memory_measures_device_buffers(expert_heavy, tmp_path):
    args = argparse.Namespace(
        model=expert_heavy,
        json=tmp_path / "m.json",
        schemes=["w4a16", "fp8", "mxfp8"],
        group_size=128,
        work_dir=tmp_path / "work",
        dtype="float32",
        batch=2,
        prompt_len=8,
        decode_steps=3,
        num_prompts=2,
        seed=0,
    )
    results = measure(args)["results"]
    assert results["w4a16"]["weight_ratio"] <= 0.30
    assert results["mxfp8"]["weight_ratio"] <= 0.54
    assert results["fp8"]["weight_ratio"] <= 0.55
    assert results["w4a16"]["linear_ratio"] < 0.27 and results["mxfp8"]["linear_ratio"] < 0.52
    for row in results.values():
        assert 0.0 <= row["top1_agreement"] <= 1.0 and row["mean_kl"] >= 0.0 and row["decode_tokens_per_s"] > 0
    assert results["bf16"]["mean_kl"] == 0.0 and results["w4a16"]["mean_kl"] > results["fp8"]["mean_kl"] > 0
    # The byte counts are the device buffers' own: check one against a direct measurement.
    model = load_model(args.work_dir / "w4a16", dtype="bfloat16", show_progress=False)
    gate_up = model.weights.layers[0].mlp.gate_up
    assert gate_up.values.dtype == np.int32 and gate_up.values.shape == (16, 256, 16)
    assert sum(device_bytes(model.weights).values()) == results["w4a16"]["weight_bytes"]
    assert sum(s.data.nbytes for s in gate_up.values.addressable_shards) == 16 * 256 * 128 // 2


def test_bench_memory_cli(tmp_path):
    tiny = make_model(tmp_path / "tiny", "mixtral", "tiny", seed=1)
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "bench",
            "memory",
            "--model",
            str(tiny),
            "--json",
            str(out),
            "--schemes",
            "w4a16",
            "--group-size",
            "32",
            "--batch",
            "1",
            "--prompt-len",
            "4",
            "--decode-steps",
            "2",
            "--num-prompts",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"bf16", "w4a16"} and report["memory_dtype"] == "bfloat16"


def test_dummy_load_format_builds_packed_weights(tmp_path, expert_heavy):
    q = quantize_checkpoint(expert_heavy, tmp_path / "q", "mxfp8")
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((q / "config.json").read_text())
    model = load_model(config_only, load_format="dummy", dtype="float32", show_progress=False)
    real = load_model(q, dtype="float32", show_progress=False)
    shapes = lambda m: jax.tree.map(lambda a: (a.shape, a.dtype), m.weights)
    assert shapes(model) == shapes(real)
    assert isinstance(model.weights.layers[0].mlp.down, QuantizedWeight)
    assert np.isfinite(prompt_logits(model, [[1, 2, 3]])).all()


def test_engine_serves_quantised_checkpoint_like_its_decompression(tmp_path):
    tiny = make_model(tmp_path / "tiny", "qwen3_moe", "tiny", seed=3)
    q = quantize_checkpoint(tiny, tmp_path / "w4a16", "w4a16", group_size=32)
    dense = decompress_with_library(q, tmp_path / "dense")
    args = dict(
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        token_buckets=[8, 32],
        page_buckets=[8],
        compilation_cache_dir=None,
        warmup=False,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 200, 31, 7], [42, 17, 3]]
    got = [o.token_ids for o in LLM(str(q), **args).generate(prompts, greedy)]
    want = [o.token_ids for o in LLM(str(dense), **args).generate(prompts, greedy)]
    assert got == want
