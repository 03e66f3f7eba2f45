"""Checkpoints compressed by the real compressed-tensors library load packed and give the logits that
transformers computes on the library's own decompression of the same checkpoint (float32, 1e-3 relative),
on one device, under expert parallelism, and with input-sharded layers."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hf_checkpoints import hf_logits, save_hf_checkpoint
from jax.sharding import AxisType
from quant_reference import ROUTERS, compress_with_library, decompress_with_library

from kernels.quant import ActivationQuant, QuantizedWeight
from workers.models import ModelLoadError, load_model, prompt_logits

PROMPT = [3, 17, 42, 5, 88, 61, 9, 23, 70, 11, 4, 36]
PROMPTS = [PROMPT, [8, 2, 77, 45]]
REL_TOL = 1e-3

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
FAMILIES = {
    "qwen3_moe": MOE,
    "qwen2_moe": dict(MOE, shared_expert_intermediate_size=32),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
}
# (family, library preset, weight-arg overrides, ignore list, what the packed values are on device)
CASES = {
    "w4a16-group32-qwen3_moe": ("qwen3_moe", "W4A16", dict(group_size=32), None, "int32"),
    "w4a16-channel-qwen2_moe": ("qwen2_moe", "W4A16", dict(strategy="channel", group_size=None), None, "int32"),
    "fp8-channel-mixtral": ("mixtral", "FP8_DYNAMIC", {}, None, "float8_e4m3fn"),
    "fp8-block128-qwen3_moe": ("qwen3_moe", "FP8_BLOCK", {}, None, "float8_e4m3fn"),
    # The LM head is quantised too here: only the routers are ignored.
    "mxfp8-qwen3_moe-quantised-lm-head": ("qwen3_moe", "MXFP8", {}, ROUTERS, "float8_e4m3fn"),
}


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return {f: save_hf_checkpoint(tmp_path_factory.mktemp(f"dense-{f}"), f, seed=1, **kw) for f, kw in FAMILIES.items()}


@pytest.fixture(scope="module")
def library(dense, tmp_path_factory):
    """name -> (compressed checkpoint made by the library, the library's decompression of it)."""
    out = {}
    for name, (family, preset, weights, ignore, _) in CASES.items():
        kwargs = {} if ignore is None else dict(ignore=ignore)
        ct = compress_with_library(dense[family], tmp_path_factory.mktemp(name), preset, **kwargs, **weights)
        out[name] = (ct, decompress_with_library(ct, tmp_path_factory.mktemp(f"{name}-dense")))
    return out


@pytest.mark.parametrize("name", CASES)
def test_library_checkpoint_matches_transformers_on_library_decompression(library, dense, name):
    ct, decompressed = library[name]
    model = load_model(ct, dtype="float32", show_progress=False)
    packed = [w for w in jax.tree.leaves(model.weights, is_leaf=lambda x: isinstance(x, QuantizedWeight)) if isinstance(w, QuantizedWeight)]
    mlp = model.weights.layers[0].mlp
    assert isinstance(mlp.gate_up, QuantizedWeight) and isinstance(model.weights.layers[0].attn.qkv, QuantizedWeight)
    assert {str(w.values.dtype) for w in packed} == {CASES[name][4]}  # never dense on device
    assert not isinstance(mlp.router, QuantizedWeight)  # ignored by the config
    if "lm-head" in name:
        assert isinstance(model.weights.lm_head, QuantizedWeight)
    got = prompt_logits(model, [PROMPT])[0]
    want = hf_logits(decompressed, PROMPT)
    assert relative_error(got, want) < REL_TOL
    # The tolerance is far below what quantisation changes, so dense-as-packed or wrong scales would fail.
    assert relative_error(got, hf_logits(dense[CASES[name][0]], PROMPT)) > 10 * REL_TOL


def test_expert_parallel_shards_packed_experts_and_scales(library):
    ct, _ = library["w4a16-group32-qwen3_moe"]
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(AxisType.Auto,))
    sharded = load_model(ct, dtype="float32", mesh=mesh, rules={"experts": "ep"}, show_progress=False)
    gate_up = sharded.weights.layers[0].mlp.gate_up
    for arr in (gate_up.values, gate_up.scale):
        assert arr.sharding.spec[0] == "ep"
        assert [s.data.shape[0] for s in arr.addressable_shards] == [1] * 8  # one expert per device
    single = load_model(ct, dtype="float32", show_progress=False)
    np.testing.assert_array_equal(np.asarray(gate_up.values), np.asarray(single.weights.layers[0].mlp.gate_up.values))
    np.testing.assert_allclose(prompt_logits(sharded, PROMPTS), prompt_logits(single, PROMPTS), atol=1e-5)


def test_input_sharded_layers_split_scales_into_whole_groups(library):
    """moe_intermediate 32 over 4 shards leaves 8 inputs per shard: groups of 32 are re-expressed as groups of
    gcd(32, 8) = 8 so every shard dequantises with its own scales; 8 shards would cut packed words."""
    ct, _ = library["w4a16-group32-qwen3_moe"]
    rules = {"experts": None, "heads": "tp", "moe_mlp": "tp"}
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    sharded = load_model(ct, dtype="float32", mesh=mesh, rules=rules, show_progress=False)
    down, o = sharded.weights.layers[0].mlp.down, sharded.weights.layers[0].attn.o
    assert (down.group_size, down.scale.shape) == (8, (8, 64, 4))
    assert (o.group_size, o.scale.shape) == (16, (64, 4))  # q_size 64 over 4 shards: gcd(32, 16)
    assert [s.data.shape for s in down.scale.addressable_shards] == [(8, 64, 1)] * 4
    single = load_model(ct, dtype="float32", show_progress=False)
    np.testing.assert_allclose(prompt_logits(sharded, PROMPTS), prompt_logits(single, PROMPTS), atol=1e-5)

    mesh8 = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Auto,))
    with pytest.raises(ModelLoadError, match=r"experts\.0\.down_proj.*input-sharded layout: 8 shards of 4 inputs would split packed words"):
        load_model(ct, dtype="float32", mesh=mesh8, rules=rules, show_progress=False)


def test_activation_quantisation_emulation_is_opt_in(library, monkeypatch):
    """Weight-only compute by default; MORAY_QUANTIZE_ACTIVATIONS=1 quantises inputs like the checkpoint's
    runtime (per token for FP8_DYNAMIC; each layer is checked bit-exact against the library in
    test_quant_kernels). e4m3 keeps 4 significant bits to bf16's 8, and this random model already moves
    ~2% under bf16 compute, so the logits move by tens of percent but stay bounded."""
    ct, decompressed = library["fp8-channel-mixtral"]
    assert load_model(ct, dtype="float32", show_progress=False).weights.layers[0].attn.qkv.activations is None
    monkeypatch.setenv("MORAY_QUANTIZE_ACTIVATIONS", "1")
    model = load_model(ct, dtype="float32", show_progress=False)
    assert model.weights.layers[0].mlp.gate_up.activations == ActivationQuant("token")
    err = relative_error(prompt_logits(model, [PROMPT])[0], hf_logits(decompressed, PROMPT))
    assert 10 * REL_TOL < err < 0.5
    # FP8_BLOCK quantises activations in groups of 128, which a 64-wide input cannot hold.
    with pytest.raises(ModelLoadError, match=r"input dimension 64 is not a multiple of the activation group size 128"):
        load_model(library["fp8-block128-qwen3_moe"][0], dtype="float32", show_progress=False)


@pytest.mark.parametrize("name", ["w4a16-group32-qwen3_moe", "mxfp8-qwen3_moe-quantised-lm-head"])
def test_whole_model_through_the_pallas_kernel(library, monkeypatch, name):
    """Every quantised matmul (dense layers, LM head and routed experts) through the grouped Pallas kernel in
    interpret mode, as TPU would run groups narrower than the MXU."""
    monkeypatch.setenv("MORAY_QUANT_IMPL", "pallas")
    monkeypatch.setenv("MORAY_MOE_IMPL", "pallas")
    jax.clear_caches()  # the implementation is chosen while tracing: drop programs traced with XLA
    ct, decompressed = library[name]
    model = load_model(ct, dtype="float32", show_progress=False)
    tokens = positions = np.zeros((1, len(PROMPT)), np.int32)
    jaxpr = jax.make_jaxpr(lambda w: model.family.forward(w, model.cfg, tokens, positions, model.new_cache(1, 12)))
    # Per layer q|k|v, o, experts gate|up and down; plus the LM head when it is quantised.
    expected = 4 * model.cfg.num_layers + isinstance(model.weights.lm_head, QuantizedWeight)
    assert str(jaxpr(model.weights)).count("pallas_call") == expected
    got = prompt_logits(model, [PROMPT])[0]
    assert relative_error(got, hf_logits(decompressed, PROMPT)) < REL_TOL
    jax.clear_caches()
