"""Bad checkpoints make `moray logits` exit non-zero with one line naming the cause, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hf_checkpoints import rewrite_config, save_hf_checkpoint
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return save_hf_checkpoint(tmp_path_factory.mktemp("good"), "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.fixture
def ckpt(good, tmp_path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(good, d)
    return d


def run_logits(model_dir: Path, tmp_path: Path, *token_ids: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "cluster.cli", "logits", "--model", str(model_dir), "--out", str(tmp_path / "l.npy")]
    for ids in token_ids or ("1,2,3",):
        args += ["--token-ids", ids]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("moray: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def edit_tensors(d: Path, fn) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_good_checkpoint_writes_logits(good, tmp_path):
    proc = run_logits(good, tmp_path, "1,2,3", "4,5")
    assert proc.returncode == 0, proc.stderr
    logits = np.load(tmp_path / "l.npy")
    assert logits.shape == (2, 3, 96) and logits.dtype == np.float32
    assert np.isnan(logits[1, 2]).all() and np.isfinite(logits[0]).all()


def test_missing_tensor(ckpt, tmp_path):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    line = error_line(run_logits(ckpt, tmp_path))
    assert "missing tensor 'model.layers.1.self_attn.k_proj.weight'" in line and "[32, 64]" in line


def test_missing_expert_tensor(ckpt, tmp_path):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight"))
    line = error_line(run_logits(ckpt, tmp_path))
    assert "'model.layers.0.mlp.experts.3.up_proj.weight'" in line


def test_wrong_shape(ckpt, tmp_path):
    def shrink(t):
        t["model.layers.0.mlp.experts.2.down_proj.weight"] = np.zeros((64, 15), np.float32)

    edit_tensors(ckpt, shrink)
    line = error_line(run_logits(ckpt, tmp_path))
    assert "model.layers.0.mlp.experts.2.down_proj.weight" in line and "[64, 15]" in line and "[64, 16]" in line


def test_unexpected_tensor(ckpt, tmp_path):
    edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", np.zeros(3, np.float32)))
    assert "unexpected tensor 'model.layers.0.mlp.extra.weight'" in error_line(run_logits(ckpt, tmp_path))


def test_unknown_model_type(ckpt, tmp_path):
    rewrite_config(ckpt, model_type="llama4_moe_xl")
    line = error_line(run_logits(ckpt, tmp_path))
    assert "unknown model_type 'llama4_moe_xl'" in line and "qwen3_moe" in line and "mixtral" in line


def test_unsupported_rope_scaling(ckpt, tmp_path):
    rewrite_config(ckpt, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0})
    assert "unsupported rope scaling type 'longrope'" in error_line(run_logits(ckpt, tmp_path))


def test_corrupt_safetensors_header(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"{ this is not json at all !!!!!!"
    path.write_bytes(bytes(data))
    line = error_line(run_logits(ckpt, tmp_path))
    assert "corrupt safetensors header in model.safetensors" in line


def test_truncated_safetensors(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    assert "corrupt safetensors header in model.safetensors" in error_line(run_logits(ckpt, tmp_path))


def test_missing_config_json(ckpt, tmp_path):
    (ckpt / "config.json").unlink()
    assert "missing config.json" in error_line(run_logits(ckpt, tmp_path))


def test_invalid_config_value(ckpt, tmp_path):
    rewrite_config(ckpt, num_experts_per_tok=9)
    assert "num_experts_per_tok (9)" in error_line(run_logits(ckpt, tmp_path))


def test_index_names_missing_shard(ckpt, tmp_path):
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "missing file: model-00002-of-00002.safetensors" in error_line(run_logits(ckpt, tmp_path))


def test_token_id_outside_vocab_exits_2(good, tmp_path):
    proc = run_logits(good, tmp_path, "1,2,96")
    assert proc.returncode == 2
    assert "token id 96 is outside the vocabulary [0, 96)" in error_line(proc)


def test_malformed_token_ids_exit_2(good, tmp_path):
    proc = run_logits(good, tmp_path, "1,x")
    assert proc.returncode == 2 and "comma-separated integers" in proc.stderr
