"""DeepSeek-V3 (issue #14): MLA with a paged latent cache, group-limited sigmoid routing, the family's
loading rules; transformers 5.x in float32 is the reference."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from engine_harness import prompts, small_engine_args
from safetensors.numpy import load_file, save_file

from kernels.moe import route_sigmoid_group_topk
from workers.engine import LLM, SamplingParams
from workers.models import ModelLoadError, load_model
from workers.models import deepseek_v3 as ds
from workers.models.layers import KVCache
from workers.models.make_model import make_model
from workers.models.safetensors_io import CheckpointReader

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=512,
    initializer_range=0.05,
    num_nextn_predict_layers=0,
    rope_interleave=True,
    tie_word_embeddings=False,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip

CASES = {
    "q_lora+default": {},
    "no_q_lora": {"q_lora_rank": None},
    "yarn": {"rope_parameters": YARN},
    "one_group+no_dense": {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 0},
    "two_shared+halves_rope": {"n_shared_experts": 2, "rope_interleave": False},
    "no_renorm": {"norm_topk_prob": False, "first_k_dense_replace": 2},
}


def hf_checkpoint(path, seed: int = 0, **overrides):
    """A random transformers DeepSeek-V3 saved as Hugging Face writes it, with a non-zero correction bias
    (transformers initialises it to zeros, which would hide a bias used in the wrong place)."""
    cfg = transformers.DeepseekV3Config(**{**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **overrides})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.3)
    model.save_pretrained(path)
    return model


def reference_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def our_logits(m, ids: np.ndarray, forward=None, max_len: int = 64) -> np.ndarray:
    b, t = ids.shape
    cache = KVCache.zeros(m.cfg, b, max_len, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, _ = (forward or m.family.forward)(m.weights, m.cfg, jnp.asarray(ids), pos, cache)
    return np.asarray(logits)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    model = hf_checkpoint(tmp_path, seed=len(case), **CASES[case])
    m = load_model(tmp_path, dtype="float32", show_progress=False)
    ids = np.random.default_rng(1).integers(0, 256, size=(2, 40))
    ref = reference_logits(model, ids)
    ours = our_logits(m, ids)
    assert np.abs(ours - ref).max() <= 1e-4, (case, np.abs(ours - ref).max())
    expanded = our_logits(m, ids, ds.forward_expanded)
    assert np.abs(expanded - ref).max() <= 1e-4


def test_yarn_scales_the_softmax_by_mscale_squared():
    raw = {**BASE, "model_type": "deepseek_v3", "rope_parameters": YARN}
    cfg = ds.config_from_hf(raw)
    base = (16 + 8) ** -0.5
    assert cfg.mla.softmax_scale == pytest.approx(base * (0.1 * np.log(8.0) + 1.0) ** 2)
    assert ds.config_from_hf({**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}).mla.softmax_scale == base


def test_decode_equals_prefill_of_the_extended_sequence_and_absorbed_equals_expanded(tmp_path):
    hf_checkpoint(tmp_path, seed=3)
    m = load_model(tmp_path, dtype="float32", show_progress=False)
    ids = np.random.default_rng(2).integers(0, 256, size=(1, 24))
    full = our_logits(m, ids)
    for forward in (m.family.forward, ds.forward_expanded):
        cache = KVCache.zeros(m.cfg, 1, 64, jnp.float32)
        prefix, rest = ids[:, :16], ids[:, 16:]
        _, cache = forward(m.weights, m.cfg, jnp.asarray(prefix), jnp.arange(16)[None], cache)
        for i in range(rest.shape[1]):  # one token at a time: the decode path
            logits, cache = forward(m.weights, m.cfg, jnp.asarray(rest[:, i : i + 1]), jnp.array([[16 + i]]), cache)
            np.testing.assert_allclose(np.asarray(logits)[0, 0], full[0, 16 + i], atol=2e-5, rtol=0)


def test_cache_holds_one_latent_row_per_token_and_layer(tmp_path):
    hf_checkpoint(tmp_path, seed=4)
    cfg = load_model(tmp_path, dtype="float32", show_progress=False).cfg
    assert cfg.kv_page_dims == (1, 32 + 8)
    assert cfg.kv_elements_per_token == 3 * (32 + 8)  # (kv_lora_rank + rope dim) x layers
    cache = KVCache.zeros(cfg, 2, 16, jnp.float32)
    assert [a.shape for a in cache.k] == [(2, 16, 1, 40)] * 3 and cache.v == []


def test_router_matches_transformers():
    cfg = transformers.DeepseekV3Config(**{**BASE, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2})
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(50, 64)
    with torch.no_grad():
        _, ref_w, ref_ids = router(x)
    logits = jnp.asarray((x @ router.weight.T).detach().numpy())
    w, ids = route_sigmoid_group_topk(logits, jnp.asarray(router.e_score_correction_bias.detach().numpy()), 4, 4, 2, True, 2.5)
    order = lambda i, v: [dict(zip(a, b)) for a, b in zip(np.asarray(i).tolist(), np.asarray(v).tolist())]
    ours, ref = order(ids, w), order(ref_ids, ref_w)
    assert [set(a) for a in ours] == [set(a) for a in ref]
    for a, b in zip(ours, ref):
        for e in a:
            assert a[e] == pytest.approx(b[e], abs=1e-6)
    # The bias changes which experts are chosen, not their weights: with a huge bias on expert 0 it is
    # always chosen, with its unbiased score as weight.
    bias = jnp.zeros(16).at[0].set(100.0)
    w, ids = route_sigmoid_group_topk(logits, bias, 4, 4, 2, False, 1.0)
    assert bool((ids == 0).any(axis=-1).all())
    chosen = np.asarray(w)[np.asarray(ids) == 0]
    np.testing.assert_allclose(chosen, np.asarray(jax.nn.sigmoid(logits[:, 0])), rtol=1e-6)


def test_multi_token_prediction_layers_are_skipped_with_one_log_line(tmp_path, caplog):
    model = hf_checkpoint(tmp_path, seed=5)
    shard = tmp_path / "model.safetensors"
    tensors = load_file(shard)
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in tensors.items() if k.startswith("model.layers.2.")}
    save_file({**tensors, **mtp}, shard, metadata={"format": "pt"})
    raw = (tmp_path / "config.json").read_text().replace('"num_nextn_predict_layers": 0', '"num_nextn_predict_layers": 1')
    (tmp_path / "config.json").write_text(raw)
    with caplog.at_level(logging.INFO, logger="moray.models"):
        m = load_model(tmp_path, dtype="float32", show_progress=False)
    assert [r for r in caplog.records if "model.layers.3.*" in r.getMessage()]
    ids = np.random.default_rng(3).integers(0, 256, size=(1, 12))
    assert np.abs(our_logits(m, ids) - reference_logits(model, ids)).max() <= 1e-4


@pytest.mark.parametrize(
    "change, words",
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"n_group": 3}, "n_group"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
    ],
)
def test_bad_configs_fail_at_load_naming_the_key(change, words):
    with pytest.raises(ModelLoadError, match=words):
        ds.config_from_hf({**BASE, "model_type": "deepseek_v3", **change})


# ---------------------------------------------------------------------------------------------
# Expert parallelism and data-parallel attention (8 virtual CPU devices).


@pytest.fixture(scope="module")
def ep_checkpoint(tmp_path_factory):
    """Hidden 512, so the hierarchical dispatch really splits its gather on 2x4 (hidden % (128 * 4) == 0);
    initializer_range 0.02 keeps float32 differences between partitionings ~1e-6."""
    path = tmp_path_factory.mktemp("deepseek-ep")
    hf_checkpoint(path, seed=8, hidden_size=512, initializer_range=0.02, num_hidden_layers=2)
    return path


@pytest.mark.parametrize("mode", ["flat", "hierarchical", "hierarchical-dispatch", "all-to-all"])
def test_expert_parallel_2x4_with_dp_attention_equals_one_device(ep_checkpoint, mode):
    """Every MoE dispatch mode, the group-limited routing computed per token before dispatch."""
    from workers.engine.config import ParallelConfig
    from workers.models import prompt_logits
    from workers.parallel import load_parallel_model

    rows = [[3, 17, 42, 5, 88, 61, 9, 23, 70, 11], [8, 2, 77, 45], [5, 5, 5, 60, 21, 33, 94]]
    want = prompt_logits(load_model(ep_checkpoint, dtype="float32", show_progress=False), rows)
    moe = {"all_to_all_min_tokens": 1} if mode == "all-to-all" else {"dispatch": mode}  # the padded all-to-all emulation
    model = load_parallel_model(ep_checkpoint, ParallelConfig(mesh="2x4", moe=moe), dtype="float32", show_progress=False)
    got = prompt_logits(model, rows)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Through the engine: the paged latent cache.

ARGS = small_engine_args("mla")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("deepseek") / "tiny", "deepseek_v3", "tiny", seed=7)


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(str(tiny), **ARGS)


def test_engine_greedy_equals_transformers(tiny, llm):
    batch = [[3, 17, 42, 5, 88, 61, 9, 23, 70, 11], [8, 2, 77, 45, 1, 90, 33], list(range(1, 30))]
    ours = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    # No EOS for transformers either (min_new_tokens would forbid EOS, which ignore_eos still lets us pick).
    model.generation_config.eos_token_id = None
    for prompt, out in zip(batch, ours):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt) :].tolist()


def test_engine_kv_pages_are_latent_rows(llm):
    runner = llm.engine.runner
    cfg = runner.cfg
    assert all(p.shape[1:] == (8, 1, cfg.mla.latent_dim) for p in runner.kv_pages)
    assert runner.kv_bytes_per_block == 8 * cfg.num_layers * cfg.mla.latent_dim * 4


def test_engine_concurrent_requests_equal_alone(llm):
    batch = prompts(16, seed=1)
    together = llm.generate(batch, GREEDY)
    for prompt, out in zip(batch[:5], together[:5]):
        assert llm.generate([prompt], GREEDY)[0].token_ids == out.token_ids
    assert len({tuple(o.token_ids) for o in together}) > 1


def test_engine_prefix_hits_give_the_same_tokens(tiny, llm):
    turn1 = prompts(1, seed=5, lo=40, hi=41)[0]
    first = llm.generate([turn1], GREEDY)[0]
    turn2 = turn1 + first.token_ids + [11, 12, 13]
    again = llm.generate([turn2], GREEDY)[0]
    assert again.num_cached_tokens >= 40
    uncached = LLM(str(tiny), **{**ARGS, "enable_prefix_caching": False}).generate([turn2], GREEDY)[0]
    assert again.token_ids == uncached.token_ids


def test_engine_preemption_gives_identical_outputs(tiny, llm):
    batch = prompts(6, seed=9, lo=30, hi=50)
    expected = llm.generate(batch, GREEDY)
    small = LLM(str(tiny), **{**ARGS, "num_kv_blocks": 24, "enable_prefix_caching": False})
    assert [o.token_ids for o in small.generate(batch, GREEDY)] == [o.token_ids for o in expected]


def test_engine_data_parallel_attention_keeps_each_ranks_latent_pages(tiny, llm):
    """Data-parallel attention on 8 virtual devices (dp 2, tp 4, experts over all 8): each rank writes and
    reads its own latent pages; greedy tokens equal one device's, also with a pool small enough to preempt
    and a prefix hit on a rank."""
    from workers.engine.data_parallel import DataParallelRunner

    batch = prompts(8, seed=12, lo=20, hi=50)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(batch, params)]
    parallel = {"mesh": "2x4", "dp": 2, "tp": 4, "moe": {"dispatch": "hierarchical"}}
    dp = LLM(str(tiny), parallel=parallel, num_kv_blocks=20, **ARGS)
    assert isinstance(dp.engine.runner, DataParallelRunner)
    assert [o.token_ids for o in dp.generate(batch, params)] == expected
    assert dp.engine.preemptions > 0
    prompt = prompts(1, seed=13, lo=37, hi=38)[0]
    first, again = dp.generate([prompt], params)[0], dp.generate([prompt], params)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == first.token_ids
    assert dp.engine.kv.num_free_blocks == dp.engine.kv.pool.num_blocks


# ---------------------------------------------------------------------------------------------
# DeepSeek's native FP8 checkpoints (quant_method fp8, weight_block_size, weight_scale_inv).


def _is_quantised_linear(key: str, shape) -> bool:
    module = key.removesuffix(".weight")
    return key.endswith(".weight") and len(shape) == 2 and not module.endswith(("embed_tokens", "lm_head", "mlp.gate"))


def script_quantise(dense: Path, out: Path, block: int) -> Path:
    """The format from its definition, independently of `moray quantize`: per [block x block] tile of every
    Linear but the routers and lm_head, scale = max |w| / 448 (float32), weight = e4m3(w / scale)."""
    import json
    import shutil

    import ml_dtypes

    out.mkdir()
    tensors = {}
    reader = CheckpointReader(dense)
    for key in reader.keys():
        w = np.asarray(reader.array(key))
        if not _is_quantised_linear(key, w.shape):
            tensors[key] = w
            continue
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        scale = np.zeros((rows, cols), np.float32)
        q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
        for i in range(rows):
            for j in range(cols):
                tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
                scale[i, j] = max(np.abs(tile).max() / 448.0, 1e-12)
                q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
        tensors[key], tensors[key.removesuffix("weight") + "weight_scale_inv"] = q, scale
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((dense / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    (out / "config.json").write_text(json.dumps(raw))
    for f in dense.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    return out


def dequantised(src: Path, out: Path) -> Path:
    """The dense checkpoint an FP8 one stands for (w = q * scale per block), for transformers."""
    import json
    import shutil

    out.mkdir()
    raw = json.loads((src / "config.json").read_text())
    block = raw.pop("quantization_config")["weight_block_size"]
    reader = CheckpointReader(src)
    tensors = {k: np.asarray(reader.array(k)) for k in reader.keys()}
    dense = {}
    for key, value in tensors.items():
        if key.endswith("weight_scale_inv"):
            continue
        scale = tensors.get(key.removesuffix("weight") + "weight_scale_inv")
        if scale is not None:
            full = np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)[: value.shape[0], : value.shape[1]]
            value = value.astype(np.float32) * full
        dense[key] = np.ascontiguousarray(value.astype(np.float32))
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def fp8_dense(tmp_path_factory):
    """A DeepSeek-V3 whose matrices span several 32-wide blocks (hidden 128) and one 128 block."""
    return make_model(tmp_path_factory.mktemp("fp8") / "small", "deepseek_v3", "small", seed=3)


@pytest.mark.parametrize("how", ["moray-quantize-128", "script-32"])
def test_native_fp8_checkpoint_matches_transformers_on_the_dequantised_weights(fp8_dense, tmp_path, how):
    from workers.models.config import read_config_json
    from workers.models.quant import quantize_plan, quantized_modules
    from workers.models.quantize import quantize_checkpoint

    if how == "moray-quantize-128":
        fp8 = quantize_checkpoint(fp8_dense, tmp_path / "fp8", "fp8-block")
    else:
        fp8 = script_quantise(fp8_dense, tmp_path / "fp8", block=32)
    m = load_model(fp8, dtype="float32", show_progress=False)
    names = set(quantized_modules(quantize_plan(m.family.plan(m.cfg), read_config_json(fp8))))
    assert "model.layers.1.self_attn.kv_b_proj" in names and "model.layers.1.mlp.experts.0.down_proj" in names
    assert "model.layers.1.mlp.gate" not in names and "lm_head" not in names
    attn, moe = m.weights.layers[1].attn, m.weights.layers[1].mlp
    for w in (attn.q_kv_a, attn.kv_b, attn.o, moe.gate_up, moe.down):  # FP8 stays FP8 in device memory
        assert w.values.dtype == jnp.float8_e4m3fn, w
    model = transformers.AutoModelForCausalLM.from_pretrained(dequantised(fp8, tmp_path / "dense"), dtype=torch.float32).eval()
    ids = np.random.default_rng(4).integers(3, 2000, size=(2, 24))
    ref = reference_logits(model, ids)
    ours = our_logits(m, ids)
    assert np.abs(ours - ref).max() <= 1e-3 * np.abs(ref).max(), np.abs(ours - ref).max()


@pytest.mark.parametrize(
    "q, words",
    [
        ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt"),
    ],
)
def test_unsupported_native_fp8_variants_fail_at_load(q, words):
    from workers.models.quant import parse_quantization_config

    with pytest.raises(ModelLoadError, match=words):
        parse_quantization_config({"quantization_config": q})


# ---------------------------------------------------------------------------------------------
# The ragged paged MLA kernel against a naive reference.


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [5, 1, 17], [40, 3], [1, 9, 2, 30]])
def test_ragged_paged_mla_matches_a_naive_reference(q_lens):
    from kernels.attention import ragged_paged_mla, write_latent

    rng = np.random.default_rng(sum(q_lens))
    page, heads, r, rope = 4, 3, 16, 8
    dk = r + rope
    ctx = [int(rng.integers(0, 20)) for _ in q_lens]  # tokens already cached per sequence
    kv_lens = [c + q for c, q in zip(ctx, q_lens)]
    pages_per_seq = max(-(-k // page) for k in kv_lens)
    num_pages = len(q_lens) * pages_per_seq + 3
    order = rng.permutation(num_pages)[: len(q_lens) * pages_per_seq].reshape(len(q_lens), pages_per_seq)
    pages = jnp.asarray(rng.standard_normal((num_pages, page, 1, dk)), jnp.float32)
    rows = rng.standard_normal((sum(q_lens), dk)).astype(np.float32)
    slots = np.concatenate(
        [order[s][(c + np.arange(q)) // page] * page + (c + np.arange(q)) % page for s, (c, q) in enumerate(zip(ctx, q_lens))]
    )
    pages = write_latent(pages, jnp.asarray(rows), jnp.asarray(slots, jnp.int32))
    q = rng.standard_normal((sum(q_lens), heads, dk)).astype(np.float32)
    n_pad = 64  # padded batch, as the engine's buckets
    q_padded = np.zeros((n_pad, heads, dk), np.float32)
    q_padded[: len(q)] = q
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    out = ragged_paged_mla(
        jnp.asarray(q_padded), pages, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(order, jnp.int32), jnp.asarray(cu),
        jnp.asarray([len(q_lens)], jnp.int32), sm_scale=0.3, v_dim=r,
    )  # fmt: skip
    out = np.asarray(out)
    flat = np.asarray(pages).reshape(num_pages * page, dk)
    for s, (c, ql) in enumerate(zip(ctx, q_lens)):
        seq_rows = flat[(order[s][:, None] * page + np.arange(page)).reshape(-1)][: kv_lens[s]]
        for j in range(ql):
            t, p = cu[s] + j, c + j
            scores = q[t] @ seq_rows[: p + 1].T * 0.3  # [heads, p + 1]
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            np.testing.assert_allclose(out[t], probs @ seq_rows[: p + 1, :r], atol=2e-5, rtol=0)
    assert not out[cu[-1] :].any()  # padding rows stay zero


def test_a_native_fp8_layer_without_its_scale_fails_naming_the_layer(fp8_dense, tmp_path):
    from workers.models.quantize import quantize_checkpoint

    fp8 = quantize_checkpoint(fp8_dense, tmp_path / "fp8", "fp8-block", max_shard_bytes=1 << 40)
    shard = fp8 / "model.safetensors"
    reader = CheckpointReader(fp8)
    tensors = {k: np.asarray(reader.array(k)) for k in reader.keys() if k != "model.layers.2.self_attn.o_proj.weight_scale_inv"}
    del reader
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layer 'model\.layers\.2\.self_attn\.o_proj'.*weight_scale_inv"):
        load_model(fp8, dtype="float32", show_progress=False)
