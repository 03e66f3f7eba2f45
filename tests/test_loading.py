"""Loading places tensors straight into their sharding, reads each slice once, and `dummy` needs no files."""

from __future__ import annotations

from collections import Counter

import jax
import numpy as np
import pytest
from hf_checkpoints import save_hf_checkpoint
from jax.sharding import AxisType

from workers.models import load_model, prompt_logits
from workers.models.safetensors_io import CheckpointReader

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf_checkpoint(
        tmp_path_factory.mktemp("ep"),
        "qwen2_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        max_shard_size="80KB",
    )


def test_experts_sharded_over_devices_read_once_and_match(ckpt, monkeypatch):
    assert len(jax.devices()) == 8
    reads: Counter[str] = Counter()
    original = CheckpointReader.array

    def counting(self, name):
        reads[name] += 1
        return original(self, name)

    monkeypatch.setattr(CheckpointReader, "array", counting)
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(AxisType.Auto,))
    sharded = load_model(ckpt, dtype="float32", mesh=mesh, rules={"experts": "ep"}, show_progress=False)
    gate_up = sharded.weights.layers[0].mlp.gate_up
    assert gate_up.sharding.spec[0] == "ep"
    assert [s.data.shape[0] for s in gate_up.addressable_shards] == [1] * 8
    # Each device holds exactly its own expert, and every expert tensor was read exactly once.
    expert_keys = [k for k in reads if ".experts." in k]
    assert len(expert_keys) == 2 * 8 * 3 and all(reads[k] == 1 for k in expert_keys)
    raw = CheckpointReader(ckpt)
    for shard in gate_up.addressable_shards:
        e = shard.index[0].start
        want = np.asarray(raw.array(f"model.layers.0.mlp.experts.{e}.gate_proj.weight"))
        np.testing.assert_array_equal(np.asarray(shard.data)[0, :16], want)

    monkeypatch.setattr(CheckpointReader, "array", original)
    single = load_model(ckpt, dtype="float32", show_progress=False)
    np.testing.assert_allclose(prompt_logits(sharded, PROMPTS), prompt_logits(single, PROMPTS), atol=1e-5)


def test_dummy_load_format_reads_no_weights(ckpt, tmp_path):
    d = tmp_path / "config-only"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    model = load_model(d, load_format="dummy", dtype="float32", show_progress=False)
    real = load_model(ckpt, dtype="float32", show_progress=False)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), model.weights) == jax.tree.map(lambda a: (a.shape, a.dtype), real.weights)
    logits = prompt_logits(model, PROMPTS)
    assert np.isfinite(logits[0]).all()


def test_bfloat16_load_casts_weights(ckpt):
    model = load_model(ckpt, dtype="bfloat16", show_progress=False)
    assert {a.dtype for a in jax.tree.leaves(model.weights)} == {np.dtype("bfloat16")}
    ref = prompt_logits(load_model(ckpt, dtype="float32", show_progress=False), PROMPTS)
    got = prompt_logits(model, PROMPTS)
    assert np.nanmax(np.abs(got - ref)) < 0.5  # bf16 rounding only
