"""Gemma 4 against transformers 5.x (float32): logits of random tiny checkpoints covering sliding and full
layers with different head dims and KV heads, attention_k_eq_v on and off, KV-shared layers, per-layer
inputs, MoE and dense, tied and untied, the multimodal composite; greedy generation through the engine
(prompts longer than the sliding window, chunked prefill, prefix-cache hits, the host tier, a KV handoff);
expert parallelism; load errors."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import transformers
from engine_harness import ENGINE_ARGS, kv_handoff
from hf_checkpoints import GEMMA4_HF_KWARGS, GEMMA4_MOE, SMALL_INIT, rewrite_config, save_gemma4_checkpoint

from workers.engine import LLM, EngineConfig, EngineCore, SamplingParams
from workers.models import ModelLoadError, load_model, prompt_logits

PROMPTS = [
    [3, 17, 42, 5, 88, 61, 9, 23, 70, 11, 4, 36, 52, 90, 1, 7, 30, 64, 12],  # past the window of 5
    [8, 2, 77, 45],
]
TOL = 1e-4

CASES = {
    # Full layers 32-dim with the sliding layers' 2 KV heads, per-layer inputs, tied, soft-capped.
    "dense-ple-tied": dict(),
    # k_eq_v full layers with 1 KV head; the last two layers reuse layers 1 (full) and 3 (sliding); MoE.
    "moe-keqv-shared": dict(attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=2, **GEMMA4_MOE),
    # No per-layer inputs, an LM head of its own, three shared layers with double-width MLPs, no soft cap.
    "dense-untied-shared-doublewide": dict(
        hidden_size_per_layer_input=0,
        tie_word_embeddings=False,
        num_kv_shared_layers=3,
        use_double_wide_mlp=True,
        final_logit_softcapping=None,
    ),
}

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ARGS = {**ENGINE_ARGS, "warmup": False}  # compile only the step shapes a test reaches
# A 16-token step budget: the 39-token prompt is prefilled in three chunks.
CHUNKED = {**ARGS, "max_num_batched_tokens": 16, "token_buckets": [8, 16]}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return save_gemma4_checkpoint(tmp_path_factory.mktemp("g4") / "moe", **CASES["moe-keqv-shared"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    d = save_gemma4_checkpoint(tmp_path / case, **CASES[case])
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = prompt_logits(load_model(d, show_progress=False), PROMPTS)
    for i, ids in enumerate(PROMPTS):
        with torch.no_grad():
            ref = model(torch.tensor([ids]), **GEMMA4_HF_KWARGS).logits[0].numpy()
        np.testing.assert_allclose(ours[i, : len(ids)], ref, atol=TOL, rtol=0, err_msg=case)


def test_composite_checkpoint_serves_its_text_model(tmp_path, caplog):
    d = save_gemma4_checkpoint(tmp_path / "composite", composite=True, **GEMMA4_MOE)
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    with caplog.at_level("INFO", logger="moray.models"):
        ours = prompt_logits(load_model(d, show_progress=False), PROMPTS[:1])[0]
    assert "model.vision_tower.*" in caplog.text  # the skipped tower, said once
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([PROMPTS[0]]), **GEMMA4_HF_KWARGS).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_cache_layers_skip_shared_layers_and_keep_their_own_shapes(moe):
    cfg = load_model(moe, load_format="dummy", show_progress=False).cfg
    assert cfg.kv_layer_ids == (0, 1, 2, 3)  # layers 4 and 5 reuse 3 (sliding) and 1 (full)
    assert [cfg.kv_layer_index(layer) for layer in range(6)] == [0, 1, 2, 3, 3, 1]
    assert [cfg.kv_layer_page_dims(i) for i in range(4)] == [(4, 16), (2, 32), (4, 16), (4, 16)]
    assert cfg.kv_elements_per_token == 3 * 64 + 64 and cfg.kv_transport_dims == (1, 64)


def test_greedy_generate_equals_transformers_past_the_window_with_chunked_prefill(moe):
    llm = LLM(str(moe), **CHUNKED)
    batch = [list(range(1, 40)), [8, 2, 77, 45, 1, 90, 33]]
    model = transformers.AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
    for prompt, out in zip(batch, llm.generate(batch, GREEDY)):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def tiered(moe):
    """24 device blocks of 8 tokens and a host tier behind them."""
    return LLM(str(moe), num_kv_blocks=24, host_kv={"blocks": 64}, **ARGS)


@pytest.fixture(scope="module")
def uncached(moe):
    return LLM(str(moe), num_kv_blocks=24, enable_prefix_caching=False, **ARGS)


def test_prefix_cache_hits_across_the_window_give_the_uncached_tokens(tiered, uncached):
    prompt = list(range(5, 45))  # 40 tokens: 5 blocks, hits far past the 5-token window
    first = tiered.generate([prompt], SHORT)[0]
    turn2 = prompt + first.token_ids + [7, 8]
    again = tiered.generate([turn2], SHORT)[0]
    assert again.num_cached_tokens >= 40
    assert again.token_ids == uncached.generate([turn2], SHORT)[0].token_ids


def test_host_tier_reloads_layers_of_different_shapes(tiered, uncached):
    first = list(range(1, 73))
    tiered.generate([first], SHORT)
    for seed in range(2, 5):  # push the first prompt's blocks off the device
        tiered.generate([[(seed * 7 + i) % 90 + 3 for i in range(72)]], SHORT)
    turn2 = first + [7, 8, 9]
    again = tiered.generate([turn2], SHORT)[0]
    kv = tiered.engine.kv
    assert kv.host.stats.blocks_loaded >= 9 and again.num_cached_tokens >= 72
    # The sliding layers' window came back from their own tier (the window group: host_kv keeps it).
    assert tiered.engine.runner.window_layers and kv.host_window.stats.blocks_loaded >= 1
    assert kv.host_window.data.shape[1] == len(tiered.engine.runner.window_layers)
    assert again.token_ids == uncached.generate([turn2], SHORT)[0].token_ids


def test_kv_handoff_between_engines(moe, uncached):
    prefill = EngineCore(EngineConfig(model=str(moe), worker_id="p", **ARGS), show_progress=False)
    decode = EngineCore(EngineConfig(model=str(moe), worker_id="d", **ARGS), show_progress=False)
    prompt = list(range(3, 40))
    _, outs, _ = kv_handoff(prefill, decode, "r", prompt, SHORT, chunk_bytes=4096)
    assert outs[-1].token_ids == uncached.generate([prompt], SHORT)[0].token_ids


def test_moe_under_expert_parallel_dispatch_modes(tmp_path):
    from workers.engine.config import ParallelConfig
    from workers.models.moe_parallel import DISPATCH_MODES
    from workers.parallel import load_parallel_model

    d = save_gemma4_checkpoint(tmp_path / "ep", hidden_size=256, **GEMMA4_MOE, **SMALL_INIT)
    want = prompt_logits(load_model(d, show_progress=False), PROMPTS)
    for mode in DISPATCH_MODES:
        model = load_parallel_model(d, ParallelConfig(mesh="2x4", moe={"dispatch": mode}), dtype="float32", show_progress=False)
        np.testing.assert_allclose(prompt_logits(model, PROMPTS), want, atol=1e-5, rtol=0, err_msg=mode)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(hidden_activation="silu"), "hidden_activation 'silu'"),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention 'all'"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(num_kv_shared_layers=5), "layer 1 (full_attention) has no earlier full_attention layer"),
        (dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4}}), "rope_type 'yarn'"),
    ],
)
def test_unsupported_settings_fail_with_the_key(moe, tmp_path, change, message):
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(moe, d)
    rewrite_config(d, **change)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        load_model(d, load_format="dummy", show_progress=False)


@pytest.mark.parametrize("group", [8, None], ids=["group8", "channel"])
def test_w4a16_checkpoint_packs_dense_layers_and_experts(moe, tmp_path, group):
    """`moray quantize` writes the fused experts as one int4 Linear per expert and projection; the loaded
    packed leaves dequantise to what compressed-tensors itself decompresses, and the packed model's logits
    are those of the dense model of those weights."""
    import jax
    from quant_reference import decompress_with_library

    from kernels.quant import QuantizedWeight, dequantize
    from workers.models import load_config
    from workers.models.quantize import quantize_checkpoint
    from workers.models.safetensors_io import CheckpointReader
    from workers.models.weights import plan_leaves

    ours = quantize_checkpoint(moe, tmp_path / "w4a16", "w4a16", group)
    keys = CheckpointReader(ours).keys()
    assert "model.layers.0.experts.7.up_proj.weight_packed" in keys and "model.layers.0.router.proj.weight" in keys
    assert "model.embed_tokens_per_layer.weight" in keys  # an embedding: never packed
    embeddings = ("model.embed_tokens", "model.embed_tokens_per_layer")
    decompressed = decompress_with_library(ours, tmp_path / "dense", embeddings)
    reference = CheckpointReader(decompressed)
    family, cfg = load_config(ours)
    model = load_model(ours, dtype="float32", show_progress=False)
    leaves = jax.tree.leaves(model.weights, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    packed = 0
    for spec, leaf in zip(plan_leaves(family.plan(cfg)), leaves, strict=True):
        if isinstance(leaf, QuantizedWeight):
            want = spec.source.read(reference, tuple(slice(None) for _ in spec.shape))
            np.testing.assert_array_equal(np.asarray(dequantize(leaf)), want)
            packed += 1
    # Per layer: attention in and out, the MLP's gate|up and down, the experts' two, the per-layer input's two.
    assert packed == cfg.num_layers * 8 + 1  # + per_layer_model_projection
    # The packed model computes what the dense model of the library's dequantised weights computes.
    want = prompt_logits(load_model(decompressed, show_progress=False), PROMPTS)
    np.testing.assert_allclose(prompt_logits(model, PROMPTS), want, atol=TOL, rtol=0)


def test_data_parallel_engine_gives_the_single_device_tokens(moe, uncached):
    """Data-parallel attention over 8 virtual devices (each rank its own KV blocks, KV-shared layers read
    their rank's pages) with the experts split over the mesh."""
    batch = [list(range(1, 30)), [8, 2, 77, 45, 1, 90, 33], list(range(40, 52))]
    single = uncached.generate(batch, SHORT)
    llm = LLM(str(moe), parallel={"mesh": "1x8"}, **ARGS)
    assert llm.engine.runner.window_layers  # each rank's sliding layers in a cache group of their own
    parallel = llm.generate(batch, SHORT)
    assert [o.token_ids for o in parallel] == [o.token_ids for o in single]


def test_make_model_writes_what_transformers_reads(tmp_path):
    from workers.models.make_model import make_model

    d = make_model(tmp_path / "g", "gemma4", "tiny", seed=1)
    ids = list(range(3, 40))
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids]), **GEMMA4_HF_KWARGS).logits[0].numpy()
    np.testing.assert_allclose(prompt_logits(load_model(d, show_progress=False), [ids])[0], ref, atol=TOL, rtol=0)


def test_speculative_rollback_past_the_window(moe, uncached):
    """Drafts verified in one step and rejected part-way (an oracle spoiling every third proposal) give the
    tokens of a run without speculation, past the sliding window; every block goes back to the pool."""
    prompts = [list(range(1, 30)), [8, 2, 77, 45, 1, 90, 33]]
    plain = uncached.generate(prompts, GREEDY)

    class Oracle:
        calls = 0

        def propose(self, request, limit):
            ref = next(o.token_ids for p, o in zip(prompts, plain) if p == request.prompt_token_ids)
            drafts = ref[len(request.output_token_ids) : len(request.output_token_ids) + limit]
            Oracle.calls += 1
            if drafts and Oracle.calls % 3 == 0:
                drafts[-1] = (drafts[-1] + 1) % 96
            return drafts

    llm = LLM(str(moe), speculative={"num_speculative_tokens": 3, "adaptive": False}, **ARGS)
    llm.engine.speculator.proposer = Oracle()
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in plain]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks
