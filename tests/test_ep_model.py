"""The full model under a mesh (`workers.parallel.load_parallel_model` + `prompt_logits`) against the
single-device model: every MoE dispatch mode on meshes 1x8, 2x4, 4x2 and 8x1 within 1e-5 (float32), the
fp8 gather within its documented tolerance, the other families, and tensor-parallel dense layers.

The checkpoints use initializer_range 0.05: logits stay O(1), so float32 rounding differences between
partitionings (different matmul shapes) stay ~2e-6. With transformers' tiny-test default (0.2) the
logits reach ~10 and the same rounding reaches ~5e-5 on every mesh, with or without expert parallelism.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hf_checkpoints import SMALL_INIT, qwen2_ep_checkpoint, save_hf_checkpoint

from workers.engine.config import ParallelConfig
from workers.models import load_model, prompt_logits
from workers.models.moe_parallel import DISPATCH_MODES
from workers.parallel import load_parallel_model

PROMPTS = [[3, 17, 42, 5, 88, 61, 9, 23, 70, 11], [8, 2, 77, 45], [5, 5, 5, 60, 21, 33, 94]]
_rng = random.Random(0)
FP8_PROMPTS = [[_rng.randrange(96) for _ in range(24)] for _ in range(8)]  # 192 positions
TOL = 1e-5
# FP8 gather: measured max |logit error| 0.47% of max |logit| and 100% top-1 agreement on FP8_PROMPTS.
FP8_REL_TOL = 0.01
FP8_TOP1 = 0.99


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return qwen2_ep_checkpoint(tmp_path_factory.mktemp("ep-qwen2"))


def single(ckpt, prompts=PROMPTS):
    return prompt_logits(load_model(ckpt, dtype="float32", show_progress=False), prompts)


def parallel(ckpt, prompts=PROMPTS, **config):
    return prompt_logits(load_parallel_model(ckpt, ParallelConfig(**config), dtype="float32", show_progress=False), prompts)


@pytest.mark.parametrize("mesh", ["1x8", "2x4", "4x2", "8x1"])
def test_every_mode_on_every_mesh_matches_one_device(qwen2, mesh):
    want = single(qwen2)
    for mode in DISPATCH_MODES:
        got = parallel(qwen2, mesh=mesh, moe={"dispatch": mode})
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0, err_msg=f"{mesh} {mode}")


def test_fp8_gather_tolerance_and_top1_agreement(qwen2):
    want = single(qwen2, FP8_PROMPTS)
    for mesh, mode in (("2x4", "flat"), ("4x2", "hierarchical-dispatch")):
        got = parallel(qwen2, FP8_PROMPTS, mesh=mesh, moe={"dispatch": mode, "gather_dtype": "fp8"})
        assert np.abs(got - want).max() <= FP8_REL_TOL * np.abs(want).max(), (mesh, mode)
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= FP8_TOP1, (mesh, mode)


def test_data_tensor_and_expert_parallel_sizes_combine(qwen2):
    """dp=2 over hosts with the dense layers split 4 ways (GSPMD), experts 8 ways; and experts only 4
    ways (each host row its own expert group) with data parallelism everywhere."""
    want = single(qwen2)
    np.testing.assert_allclose(parallel(qwen2, mesh="2x4", dp=2, tp=4, moe={"dispatch": "hierarchical"}), want, atol=TOL, rtol=0)
    np.testing.assert_allclose(parallel(qwen2, mesh="2x4", ep=4), want, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1], head_dim=32)),
        ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48)),
    ],
)
def test_other_families_under_hierarchical_modes(tmp_path, family, overrides):
    ckpt = save_hf_checkpoint(tmp_path / family, family, hidden_size=256, **overrides, **SMALL_INIT)
    want = single(ckpt)
    for mesh, mode in (("2x4", "hierarchical"), ("4x2", "hierarchical-dispatch")):
        np.testing.assert_allclose(parallel(ckpt, mesh=mesh, moe={"dispatch": mode}), want, atol=TOL, rtol=0, err_msg=f"{mesh} {mode}")
