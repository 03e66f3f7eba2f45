"""Hybrid linear-attention families (Qwen3.5-MoE, Qwen3.5 dense, Qwen3-Next) against transformers.

Logit parity on random checkpoints saved by transformers (float32), with the default chunk size of the
chunked gated delta rule (one chunk per prompt) and a small one (prompts cross chunk boundaries); decode
after prefill on the contiguous cache; load errors; `make-model` checkpoints in transformers.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from hf_checkpoints import COMPOSITES, hf_logits, hf_logits_many, save_hybrid_checkpoint
from safetensors.numpy import load_file, save_file

from workers.models import FAMILIES, ModelConfig, ModelLoadError, load_config, load_model, prompt_logits
from workers.models.layers import KVCache

PROMPTS = [
    [
        3,
        17,
        42,
        5,
        88,
        61,
        9,
        23,
        70,
        11,
        4,
        36,
        52,
        90,
        1,
        7,
        30,
        64,
        12,
        50,
        2,
        81,
        44,
        19,
        6,
        73,
        28,
        95,
        37,
        14,
        59,
        8,
        66,
        21,
        47,
        10,
        85,
        33,
    ],
    [8, 2, 77, 45, 12, 91, 30, 5, 63, 18],
    [5, 5, 5, 60, 21, 33, 94, 18, 2, 40, 66, 71, 9, 26, 55, 3, 80, 13, 47, 29, 62, 7, 38, 16],
]
TOL = 1e-4
SMALL_CHUNK = 8

CASES = {
    # The released layout: composite with a vision tower, Hk < Hv, conv 4, rotary 0.25, untied.
    "qwen3_5_moe-composite": ("qwen3_5_moe", dict()),
    # Composite, tied, conv 3, rotary 0.5, Hk == Hv with dk != dv, a full-attention layer first, larger shared expert.
    "qwen3_5_moe-composite-tied-conv3": (
        "qwen3_5_moe",
        dict(
            tie_word_embeddings=True,
            linear_conv_kernel_dim=3,
            linear_num_key_heads=4,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            partial_rotary_factor=0.5,
            layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
            shared_expert_intermediate_size=96,
        ),
    ),
    # Text layout, G = 4 value heads per key head, 8 heads of attention over 1 KV head, fused expert tensors.
    "qwen3_5_moe_text-fused-experts": (
        "qwen3_5_moe_text",
        dict(
            linear_num_key_heads=1,
            linear_num_value_heads=4,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=8,
            num_experts_per_tok=3,
            shared_expert_intermediate_size=16,
        ),
    ),
    # Dense Qwen3.5 composite.
    "qwen3_5-dense-composite": ("qwen3_5", dict(partial_rotary_factor=0.5)),
    # Qwen3-Next: G = 3, a dense mlp_only layer, no top-k renormalisation, rotary 0.5.
    "qwen3_next-mlp-only": (
        "qwen3_next",
        dict(
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            linear_key_head_dim=8,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            partial_rotary_factor=0.5,
        ),
    ),
    # Qwen3-Next: decoder_sparse_step 2, tied, conv 3, Hk == Hv, 6 layers with full_attention_interval 3.
    "qwen3_next-sparse-step2-tied": (
        "qwen3_next",
        dict(
            num_hidden_layers=6,
            full_attention_interval=3,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
            linear_conv_kernel_dim=3,
            linear_num_key_heads=4,
            linear_num_value_heads=4,
            shared_expert_intermediate_size=24,
        ),
    ),
}


def fuse_expert_tensors(model_dir, num_layers: int, num_experts: int, prefix: str = "model") -> None:
    """Rewrites per-expert tensors as transformers 5.x fused ones (gate_up_proj [E, 2I, H], down_proj)."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for layer in range(num_layers):
        p = f"{prefix}.layers.{layer}.mlp.experts"
        gate_up = [
            np.concatenate([tensors.pop(f"{p}.{e}.gate_proj.weight"), tensors.pop(f"{p}.{e}.up_proj.weight")]) for e in range(num_experts)
        ]
        tensors[f"{p}.gate_up_proj"] = np.stack(gate_up)
        tensors[f"{p}.down_proj"] = np.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(num_experts)])
    save_file(tensors, str(path), metadata={"format": "pt"})


def logits_with_chunk(model, rows, chunk_size: int) -> np.ndarray:
    """prompt_logits with a given chunk size of the chunked gated delta rule."""
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    cache = KVCache.zeros(model.cfg, *tokens.shape, model.dtype, chunk_size=chunk_size)
    logits, _ = model.step(tokens, positions, cache)
    return np.asarray(logits)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    d = save_hybrid_checkpoint(tmp_path_factory.mktemp(request.param), family, **overrides)
    refs = hf_logits_many(d, PROMPTS)  # from the checkpoint transformers wrote
    if "fused-experts" in request.param:
        fuse_expert_tensors(d, overrides.get("num_hidden_layers", 4), 8)
    return request.param, d, refs


def test_prompt_logits_match_transformers(case):
    name, d, refs = case
    model = load_model(d, dtype="float32", show_progress=False)
    assert model.cfg.is_hybrid
    ours = prompt_logits(model, PROMPTS)  # one chunk per prompt
    chunked = logits_with_chunk(model, PROMPTS, SMALL_CHUNK)  # up to 5 chunks per prompt
    for row, (ids, ref) in enumerate(zip(PROMPTS, refs)):
        diff = np.abs(ours[row, : len(ids)] - ref).max()
        diff_chunked = np.abs(chunked[row, : len(ids)] - ref).max()
        print(f"{name} prompt {row} ({len(ids)} tokens): max |diff| {diff:.2e}, chunk {SMALL_CHUNK} {diff_chunked:.2e}")
        assert diff <= TOL, f"prompt {row}: max |logit diff| {diff:.2e}"
        assert diff_chunked <= TOL, f"prompt {row}, chunk {SMALL_CHUNK}: max |logit diff| {diff_chunked:.2e}"
        assert np.isnan(ours[row, len(ids) :]).all()


@pytest.mark.parametrize("name", ["qwen3_5_moe-composite", "qwen3_next-mlp-only"])
def test_decode_after_prefill_matches_full_prefill(name, tmp_path):
    """Prefill T tokens, then continue from the cache one token at a time and with a 3-token step: the
    logits equal those of prefilling the whole sequence (rows of equal length: no padding in the state)."""
    family, overrides = CASES[name]
    model = load_model(save_hybrid_checkpoint(tmp_path, family, **overrides), dtype="float32", show_progress=False)
    full = np.array([PROMPTS[0][:24], PROMPTS[2][:24]], np.int32)
    reference = prompt_logits(model, full.tolist())
    prefill = 13
    cache = KVCache.zeros(model.cfg, 2, full.shape[1], model.dtype, chunk_size=SMALL_CHUNK)
    positions = np.broadcast_to(np.arange(full.shape[1], dtype=np.int32), full.shape)
    logits, cache = model.step(full[:, :prefill], positions[:, :prefill], cache)
    np.testing.assert_allclose(np.asarray(logits), reference[:, :prefill], atol=TOL, rtol=0)
    steps = [(p, p + 1) for p in range(prefill, 18)] + [(18, 21), (21, 22)]
    for lo, hi in steps:
        logits, cache = model.step(full[:, lo:hi], positions[:, lo:hi], cache)
        diff = np.abs(np.asarray(logits) - reference[:, lo:hi]).max()
        assert diff <= TOL, f"tokens {lo}..{hi - 1}: {diff:.2e}"


def test_composite_skips_vision_tensors_with_one_log_line(tmp_path, caplog):
    d = save_hybrid_checkpoint(tmp_path, "qwen3_5_moe")
    visual = [k for k in load_file(str(d / "model.safetensors")) if k.startswith("model.visual.")]
    assert visual
    with caplog.at_level(logging.INFO, logger="moray.models"):
        model = load_model(d, dtype="float32", show_progress=False)
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert lines == [f"skipping {len(visual)} checkpoint tensors Moray does not serve (model.visual.*)"]
    assert model.cfg.model_type == "qwen3_5_moe" and model.cfg.linear_attention_layers == (0, 1, 2)


def test_hybrid_config_bookkeeping(tmp_path):
    """Layer kinds from full_attention_interval (no layer_types), index maps, state shapes, the plan."""
    from workers.models.weights import plan_leaves

    raw = json.loads((save_hybrid_checkpoint(tmp_path, "qwen3_next", num_hidden_layers=6) / "config.json").read_text())
    del raw["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps({**raw, "full_attention_interval": 3}))
    family, cfg = load_config(tmp_path)
    assert family is FAMILIES["qwen3_next"]
    assert cfg.linear_attention_layers == (0, 1, 3, 4) and cfg.attention_layer_ids == (2, 5)
    assert (cfg.num_kv_layers, cfg.num_state_layers) == (2, 4)
    assert [cfg.kv_layer_index(l) for l in (2, 5)] == [0, 1]
    assert [cfg.state_layer_index(l) for l in (0, 1, 3, 4)] == [0, 1, 2, 3]
    assert cfg.conv_state_shape == (3, 2 * 2 * 16 + 4 * 16) and cfg.recurrent_state_shape == (4, 16, 16)
    assert (cfg.rotary_dim, cfg.attn_output_gate, cfg.zero_centered_norm) == (4, True, True)
    cache = KVCache.zeros(cfg, 2, 8, np.float32)
    assert len(cache.k) == 2 and len(cache.conv) == 4 and cache.recurrent[0].shape == (2, 4, 16, 16)
    assert cache.conv[0].dtype == np.float32 and cache.conv[0].shape == (2, *cfg.conv_state_shape)
    plan = family.plan(cfg)
    assert plan.layers[0].attn.conv.shape == (128, 1, 4) and plan.layers[2].attn.qkv.shape == (2 * 64 + 2 * 32, 64)
    zero_centred = {s.source.key for s in plan_leaves(plan) if s.init_scale == 0}  # dummy weights: zeros
    assert "model.norm.weight" in zero_centred and "model.layers.2.self_attn.q_norm.weight" in zero_centred
    assert "model.layers.0.linear_attn.norm.weight" not in zero_centred  # RMSNormGated: a plain weight
    plain = ModelConfig(
        model_type="x",
        vocab_size=8,
        hidden_size=8,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope={"theta": 1e4},
        sliding_windows=(None,) * 3,
        moe_layers=(False,) * 3,
        intermediate_size=8,
    )
    assert not plain.is_hybrid and plain.num_kv_layers == 3 and [plain.kv_layer_index(l) for l in range(3)] == [0, 1, 2]
    assert KVCache.zeros(plain, 1, 4, np.float32).conv is None


@pytest.fixture(scope="module")
def composite_config(tmp_path_factory) -> str:
    return (save_hybrid_checkpoint(tmp_path_factory.mktemp("composite"), "qwen3_5_moe") / "config.json").read_text()


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda raw: raw["text_config"].__setitem__("layer_types", ["sliding_attention"] * 4), "layer_types"),
        (lambda raw: raw["text_config"].pop("linear_num_value_heads"), "linear_num_value_heads"),
        (lambda raw: raw.pop("text_config"), "text_config"),  # a vision-only composite
        (lambda raw: raw["text_config"].__setitem__("linear_num_value_heads", 3), "linear_num_value_heads"),
    ],
    ids=["unknown-layer-type", "missing-linear-key", "vision-only", "value-heads-not-multiple"],
)
def test_unsupported_configs_fail_naming_the_key(composite_config, tmp_path, edit, key):
    raw = json.loads(composite_config)
    edit(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))  # the config fails before any tensor is read
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path, dtype="float32", show_progress=False)
    message = str(e.value)
    assert key in message and "\n" not in message, message


def test_qwen3_next_quantised_w4a16_matches_transformers_on_dequantised(tmp_path):
    """in_proj_qkvz / in_proj_ba are reordered at load: packed int4 values and their group scales alike."""
    from quant_reference import decompress_with_library

    from workers.models.quantize import quantize_checkpoint

    dense = save_hybrid_checkpoint(tmp_path / "dense", "qwen3_next", linear_num_value_heads=6, linear_key_head_dim=8)
    ct = quantize_checkpoint(dense, tmp_path / "ct", "w4a16", group_size=16)
    model = load_model(ct, dtype="float32", show_progress=False)
    assert type(model.weights.layers[0].attn.qkvz).__name__ == "QuantizedWeight"
    ours = prompt_logits(model, [PROMPTS[1]])[0]
    ref = hf_logits(decompress_with_library(ct, tmp_path / "deq"), PROMPTS[1])
    assert np.abs(ours - ref).max() <= 1e-3 * np.abs(ref).max()


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_make_model_tiny_loads_in_transformers_with_same_logits(arch, tmp_path):
    from workers.models.make_model import make_model

    d = make_model(tmp_path / arch, arch, "tiny")
    raw = json.loads((d / "config.json").read_text())
    if arch in COMPOSITES:
        assert "text_config" in raw and "vision_config" in raw
        assert all(k.startswith(("model.language_model.", "lm_head.")) for k in load_file(str(d / "model.safetensors")))
    assert sum(f.stat().st_size for f in d.iterdir()) < 5 * 2**20
    ids = [5, 17, 300, 42, 7, 99, 250, 3, 11, 120, 64, 8]
    ours = prompt_logits(load_model(d, dtype="float32", show_progress=False), [ids])[0]
    ref = hf_logits(d, ids)
    assert np.abs(ours - ref).max() <= TOL
    top2 = np.sort(ref, axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 1e-3  # a clear greedy winner at every step


def test_rows_source_reads_any_slice_in_the_new_order(tmp_path):
    """`Rows` (Qwen3-Next's un-interleaving) read by slices, as a sharded load asks for them."""
    from workers.models.safetensors_io import CheckpointReader
    from workers.models.weights import Rows, Tensor, grouped_rows

    weight = np.arange(2 * 10 * 3, dtype=np.float32).reshape(20, 3)  # 2 key heads of [q 2 | k 2 | v 3 | z 3]
    save_file({"w": weight}, str(tmp_path / "model.safetensors"))
    order = grouped_rows((2, 2, 3, 3), 2)
    assert order[:4] == (0, 1, 10, 11) and order[-3:] == (17, 18, 19)
    rows = Rows((Tensor("w", (20, 3)),), order)
    reader = CheckpointReader(tmp_path)
    full = rows.read(reader, (slice(None), slice(None)))
    np.testing.assert_array_equal(full, weight[list(order)])
    np.testing.assert_array_equal(rows.read(reader, (slice(3, 9), slice(1, 3))), full[3:9, 1:3])
