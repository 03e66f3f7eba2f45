"""`moray make-model` writes checkpoints that transformers loads unchanged and that give our logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import transformers
from hf_checkpoints import hf_logits

from workers.models import load_model, prompt_logits
from workers.models.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 17, 300, 42, 7, 99, 250, 3, 11]


def make(out: Path, arch: str, preset: str, seed: int = 0) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "make-model", str(out), "--arch", arch, "--preset", preset, "--seed", str(seed)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_tiny_checkpoint_loads_in_transformers_with_same_logits(arch, tmp_path):
    d = make(tmp_path / arch, arch, "tiny")
    size = sum(f.stat().st_size for f in d.iterdir())
    assert size < 5 * 2**20
    ours = prompt_logits(load_model(d, dtype="float32", show_progress=False), [PROMPT])[0]
    ref = hf_logits(d, PROMPT)
    assert np.abs(ours - ref).max() <= 1e-4
    # Logits are far from uniform, so greedy decoding has a clear winner at every step.
    assert (np.sort(ref, axis=-1)[:, -1] - np.sort(ref, axis=-1)[:, -2]).min() > 1e-3


def test_tokenizer_and_generation_config(tmp_path):
    d = make(tmp_path / "m", "qwen3_moe", "tiny")
    ours = Tokenizer.from_dir(d)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    text = "Hello, MoE world! 你好"
    assert ours.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] in ours.eos_token_ids
    assert ours.vocab_size <= json.loads((d / "config.json").read_text())["vocab_size"]


def test_seed_changes_weights_deterministically(tmp_path):
    a = make(tmp_path / "a", "mixtral", "tiny", seed=1)
    b = make(tmp_path / "b", "mixtral", "tiny", seed=1)
    c = make(tmp_path / "c", "mixtral", "tiny", seed=2)
    read = lambda d: (d / "model.safetensors").read_bytes()
    assert read(a) == read(b) and read(a) != read(c)


def test_small_preset_is_sharded_and_loads_in_transformers(tmp_path):
    d = make(tmp_path / "small", "qwen3_moe", "small")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    total = sum((d / s).stat().st_size for s in shards)
    assert 50 * 2**20 <= total <= 100 * 2**20
    ours = prompt_logits(load_model(d, dtype="float32", show_progress=False), [PROMPT])[0]
    assert np.abs(ours - hf_logits(d, PROMPT)).max() <= 1e-4


def test_cli_offers_every_arch():
    from cluster.cli import MAKE_MODEL_ARCHS
    from workers.models.make_model import ARCHS

    assert sorted(MAKE_MODEL_ARCHS) == sorted(ARCHS)
