"""RoPE scaling types (default, linear, dynamic, yarn, llama3) against transformers 5.x: inverse frequencies and
attention factors from `ROPE_INIT_FUNCTIONS` on real transformers configs, cos/sin from the rotary embedding
modules, both config key styles, and the load errors."""

from __future__ import annotations

import copy
import math
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from workers.models.config import ModelConfig, ModelLoadError, RopeConfig, rope_from_hf
from workers.models.layers import rope_cos_sin
from workers.models.rope import rope_attention_factor, rope_inv_freq, yarn_get_mscale

REL_TOL = 1e-6

# config.json contents (4.x `rope_scaling` style, as the released checkpoints ship them).
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "qk_rope_head_dim": 64,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
LLAMA_3_1 = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


def rotary_dim(raw: dict) -> int:
    return raw.get("qk_rope_head_dim") or raw["head_dim"]


def hf_config(raw: dict):
    """The transformers config class the checkpoint would load with (it edits its dict, so give it a copy)."""
    raw = copy.deepcopy(raw)
    if raw.pop("model_type", "llama") == "deepseek_v3":
        return DeepseekV3Config(**raw)
    raw.setdefault("hidden_size", 2 * raw["head_dim"])
    raw.setdefault("num_attention_heads", 2)
    return LlamaConfig(**raw)


def hf_rotary(raw: dict):
    cfg = hf_config(raw)
    return (DeepseekV3RotaryEmbedding if isinstance(cfg, DeepseekV3Config) else LlamaRotaryEmbedding)(cfg)


def hf_inv_freq(raw: dict, **kwargs) -> tuple[np.ndarray, float]:
    cfg = hf_config(raw)
    rope_type = cfg.rope_parameters["rope_type"]
    fn = LlamaRotaryEmbedding.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, attention_factor = fn(cfg, **kwargs)
    return inv_freq.numpy(), float(attention_factor)


def assert_rel_close(ours: np.ndarray, ref: np.ndarray, what: str):
    assert ours.dtype == np.float32 and ours.shape == ref.shape, (ours.dtype, ours.shape, ref.shape)
    rel = np.abs(ours.astype(np.float64) - ref.astype(np.float64)) / np.abs(ref.astype(np.float64))
    assert rel.max() <= REL_TOL, f"{what}: max relative difference {rel.max():.2e} at {rel.argmax()}"


def random_raw(rope_type: str, seed: int, style: str = "v5") -> dict:
    """A random config.json with a `rope_type` rope; 5.x `rope_parameters` or 4.x `rope_theta` + `rope_scaling`."""
    rng = np.random.default_rng(seed)
    theta = float(10 ** rng.uniform(3, 7))
    mpe = int(rng.choice([512, 2048, 4096, 32768, 131072]))
    params: dict = {"rope_type": rope_type}
    if rope_type in ("linear", "dynamic"):
        params["factor"] = float(rng.integers(2, 17)) if rope_type == "dynamic" else float(rng.uniform(1.0, 16.0))
    elif rope_type == "yarn":
        original = int(rng.choice([256, 1024, 4096, 8192]))
        params |= {"factor": float(rng.uniform(1.5, 64.0)), "original_max_position_embeddings": original}
        mpe = int(original * params["factor"])
        params |= {"beta_fast": float(rng.uniform(8, 64)), "beta_slow": float(rng.uniform(0.25, 4))}
        choice = rng.integers(4)  # attention factor: paper default, mscale pair, mscale alone (ignored), explicit
        if choice == 1:
            params |= {"mscale": float(rng.uniform(0.5, 2)), "mscale_all_dim": float(rng.uniform(0.5, 2))}
        elif choice == 2:
            params["mscale"] = float(rng.uniform(0.5, 2))
        elif choice == 3:
            params["attention_factor"] = float(rng.uniform(0.8, 1.5))
        params["truncate"] = bool(rng.integers(2))
    elif rope_type == "llama3":
        low = float(rng.uniform(0.5, 2))
        params |= {
            "factor": float(rng.uniform(2, 16)),
            "low_freq_factor": low,
            "high_freq_factor": low + float(rng.uniform(1, 8)),
            "original_max_position_embeddings": int(rng.choice([1024, 4096, 8192])),
        }
        mpe = int(params["original_max_position_embeddings"] * params["factor"])
    raw = {"head_dim": int(rng.choice([16, 32, 64, 96, 128, 256])), "max_position_embeddings": mpe}
    if style == "v5":
        raw["rope_parameters"] = params | {"rope_theta": theta}
    else:
        params = dict(params)
        params["type"] = params.pop("rope_type")  # the oldest spelling
        raw |= {"rope_theta": theta, "rope_scaling": None if rope_type == "default" else params}
    return raw


TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
RANDOM_CASES = [(t, seed, style) for t in TYPES for seed in range(4) for style in ("v5", "v4")]


def hf_kwargs(raw: dict) -> dict:
    """dynamic: transformers' frequencies at the sequence length this engine fixes them for."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type")) == "dynamic":
        return {"seq_len": raw["max_position_embeddings"] * params["factor"]}
    return {}


@pytest.mark.parametrize("rope_type, seed, style", RANDOM_CASES)
def test_inv_freq_and_attention_factor_match_transformers(rope_type, seed, style):
    raw = random_raw(rope_type, seed, style)
    rope = rope_from_hf(raw)
    assert rope.scaling_type == rope_type
    ref_inv_freq, ref_factor = hf_inv_freq(raw, **hf_kwargs(raw))
    assert_rel_close(rope_inv_freq(rope, rotary_dim(raw)), ref_inv_freq, f"{rope_type} seed {seed}")
    assert rope_attention_factor(rope) == pytest.approx(ref_factor, rel=REL_TOL, abs=0)
    if rope_type != "default":  # the parameters matter: plain RoPE would not pass
        plain = rope_inv_freq(RopeConfig(theta=rope.theta), rotary_dim(raw))
        assert np.abs(plain - ref_inv_freq).max() > 1e-6 * np.abs(ref_inv_freq).max()


@pytest.mark.parametrize("raw", [DEEPSEEK_V3, LLAMA_3_1], ids=["deepseek_v3", "llama_3_1"])
def test_real_configs_match_transformers(raw):
    rope = rope_from_hf(raw)
    ref_inv_freq, ref_factor = hf_inv_freq(raw)
    assert_rel_close(rope_inv_freq(rope, rotary_dim(raw)), ref_inv_freq, raw["model_type"])
    assert rope_attention_factor(rope) == pytest.approx(ref_factor, rel=REL_TOL, abs=0)
    if raw is LLAMA_3_1:  # all three bands present: kept, smoothed, divided by factor
        plain = rope_inv_freq(RopeConfig(theta=500000.0), 128)
        ratio = plain / ref_inv_freq
        assert np.isclose(ratio, 1).any() and np.isclose(ratio, 8).any() and ((ratio > 1.01) & (ratio < 7.9)).any()
    else:  # DeepSeek-V3: mscale == mscale_all_dim, so cos/sin are unscaled and the softmax scale carries mscale**2
        assert rope_attention_factor(rope) == 1.0
        assert yarn_get_mscale(40, 1.0) == pytest.approx(0.1 * math.log(40) + 1, rel=1e-12)
        softmax_scale = 192**-0.5 * yarn_get_mscale(rope.factor, rope.mscale_all_dim) ** 2
        assert softmax_scale == pytest.approx(yarn_apply_mscale(hf_config(raw).rope_parameters, 192**-0.5), rel=1e-12)


def model_config(raw: dict) -> ModelConfig:
    return ModelConfig(
        model_type="x",
        vocab_size=8,
        hidden_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=rotary_dim(raw),
        rms_norm_eps=1e-6,
        rope=rope_from_hf(raw),
        sliding_windows=(None,),
        moe_layers=(False,),
        intermediate_size=8,
    )


YARN_QWEN = {  # plain YaRN (no mscale): cos/sin scaled by 0.1 ln(4) + 1
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
}
DYNAMIC = {"head_dim": 64, "max_position_embeddings": 256, "rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 4.0}}
LINEAR = {"head_dim": 32, "max_position_embeddings": 512, "rope_parameters": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.5}}


@pytest.mark.parametrize(
    "raw, positions",
    [
        (DEEPSEEK_V3, [0, 1, 5, 4095, 4096, 20000, 163839]),
        (LLAMA_3_1, [0, 3, 8191, 8192, 65000, 131071]),
        (YARN_QWEN, [0, 2, 32767, 32768, 131071]),
        (DYNAMIC, [0, 7, 255, 256, 1023]),  # max position + 1 == 256 * 4: transformers' dynamic update matches
        (LINEAR, [0, 1, 100, 511]),
    ],
    ids=["deepseek_v3", "llama_3_1", "yarn", "dynamic", "linear"],
)
def test_cos_sin_match_transformers_rotary_embedding(raw, positions):
    cfg = model_config(raw)
    cos, sin = rope_cos_sin(cfg, jnp.asarray([positions], jnp.int32))
    x = torch.zeros(1, dtype=torch.float32)
    ref_cos, ref_sin = hf_rotary(raw)(x, torch.tensor([positions]))
    assert cos.shape == sin.shape == (1, len(positions), rotary_dim(raw))
    # An angle is position * inv_freq (inv_freq <= 1): one float32 ulp of inv_freq moves it by up to 6e-8 * position.
    tol = 1e-6 + 6e-8 * np.asarray(positions, np.float64)[None, :, None]
    assert (np.abs(np.asarray(cos) - ref_cos.numpy()) <= tol).all()
    assert (np.abs(np.asarray(sin) - ref_sin.numpy()) <= tol).all()
    factor = rope_attention_factor(cfg.rope)
    assert np.abs(np.asarray(cos)[0, 0]).max() == pytest.approx(factor, rel=1e-6)  # position 0: cos == factor


def test_dynamic_fixes_frequencies_for_the_longest_sequence():
    """transformers recomputes dynamic NTK frequencies per sequence length; this engine fixes them for
    max_position_embeddings * factor (or the given max_len), so they equal transformers' at that length only."""
    raw = random_raw("dynamic", 7)
    rope, dim = rope_from_hf(raw), rotary_dim(raw)
    mpe, factor = raw["max_position_embeddings"], raw["rope_parameters"]["factor"]
    assert rope.max_position_embeddings == mpe
    fixed = rope_inv_freq(rope, dim)
    assert_rel_close(fixed, hf_inv_freq(raw, seq_len=mpe * factor)[0], "at max_position_embeddings * factor")
    assert_rel_close(rope_inv_freq(rope, dim, max_len=3 * mpe), hf_inv_freq(raw, seq_len=3 * mpe)[0], "at max_len")
    plain, _ = hf_inv_freq(raw, seq_len=mpe // 2)  # transformers below max_position_embeddings: unscaled RoPE
    assert_rel_close(rope_inv_freq(rope, dim, max_len=mpe), plain, "max_len <= max_position_embeddings")
    assert_rel_close(rope_inv_freq(RopeConfig(theta=rope.theta), dim), plain, "plain RoPE")
    assert np.abs(fixed - plain).max() > 1e-3 * plain.max()  # the documented difference for short prompts

    # The same through the rotary module: a short prompt gets transformers' unscaled cos, not ours.
    short = list(range(8))
    ref_cos, _ = hf_rotary(DYNAMIC)(torch.zeros(1), torch.tensor([short]))
    cos, _ = rope_cos_sin(model_config(DYNAMIC), jnp.asarray([short], jnp.int32))
    plain_cos, _ = rope_cos_sin(model_config({**DYNAMIC, "rope_scaling": None}), jnp.asarray([short], jnp.int32))
    assert np.abs(np.asarray(plain_cos) - ref_cos.numpy()).max() <= 1e-6
    assert np.abs(np.asarray(cos) - ref_cos.numpy()).max() > 1e-3


def test_yarn_truncate_and_attention_factor_options():
    base = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 2048}
    for params in (
        base | {"truncate": False},  # gpt-oss
        base | {"beta_fast": 16, "beta_slow": 2},
        base | {"mscale": 0.707, "mscale_all_dim": 1.0},
        base | {"mscale": 2.0},  # transformers ignores mscale without mscale_all_dim
        base | {"attention_factor": 1.25},
        base | {"rope_theta": 50.0, "original_max_position_embeddings": 131072, "beta_fast": 4096},  # range clamped at dim - 1
    ):
        raw = {"head_dim": 64, "max_position_embeddings": 16384, "rope_parameters": params}
        ref_inv_freq, ref_factor = hf_inv_freq(raw)
        rope = rope_from_hf(raw)
        assert_rel_close(rope_inv_freq(rope, 64), ref_inv_freq, str(params))
        assert rope_attention_factor(rope) == pytest.approx(ref_factor, rel=1e-12, abs=0)
    truncated = rope_inv_freq(rope_from_hf({"rope_parameters": base}), 64)
    untruncated = rope_inv_freq(rope_from_hf({"rope_parameters": base | {"truncate": False}}), 64)
    assert rope_from_hf({"rope_parameters": base}).truncate and np.abs(truncated - untruncated).max() > 1e-6 * truncated.max()
    assert rope_attention_factor(rope_from_hf({"rope_parameters": base})) == pytest.approx(0.1 * math.log(8) + 1)
    assert rope_attention_factor(rope_from_hf({"rope_parameters": base | {"mscale": 2.0}})) == pytest.approx(0.1 * math.log(8) + 1)


def test_key_styles_parse_alike():
    v4 = rope_from_hf(LLAMA_3_1)
    params = {"rope_type": "llama3", "rope_theta": 500000.0} | {k: v for k, v in LLAMA_3_1["rope_scaling"].items() if k != "rope_type"}
    v5 = rope_from_hf({"max_position_embeddings": 131072, "rope_parameters": params})
    nested = rope_from_hf({"max_position_embeddings": 131072, "rope_parameters": {"full_attention": params}})
    assert v4 == v5 == nested
    assert (v4.scaling_type, v4.theta, v4.factor, v4.original_max_position_embeddings) == ("llama3", 500000.0, 8.0, 8192)
    assert (v4.low_freq_factor, v4.high_freq_factor) == (1.0, 4.0)

    ds = rope_from_hf(DEEPSEEK_V3)  # 4.x `type` spelling
    assert (ds.scaling_type, ds.theta, ds.factor, ds.original_max_position_embeddings) == ("yarn", 10000.0, 40.0, 4096)
    assert (ds.beta_fast, ds.beta_slow, ds.mscale, ds.mscale_all_dim, ds.attention_factor, ds.truncate) == (32, 1, 1.0, 1.0, None, True)
    v5_params = dict(DEEPSEEK_V3["rope_scaling"], rope_type="yarn", rope_theta=10000.0)
    del v5_params["type"]
    assert rope_from_hf({"max_position_embeddings": 163840, "rope_parameters": v5_params}) == ds

    # dynamic: max_position_embeddings from the top level, in both styles.
    dyn = rope_from_hf(DYNAMIC)
    assert (dyn.scaling_type, dyn.factor, dyn.max_position_embeddings, dyn.theta) == ("dynamic", 4.0, 256, 10000.0)
    v5_dyn = {"max_position_embeddings": 256, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}}
    assert rope_from_hf(v5_dyn) == dyn

    # default and linear as before.
    assert rope_from_hf({}) == RopeConfig(theta=10000.0)
    assert rope_from_hf({"rope_theta": 5000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}) == RopeConfig(
        theta=5000.0, scaling_type="linear", factor=2.0
    )
    assert rope_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == RopeConfig(theta=1e6)


def test_original_max_position_embeddings_sources_follow_transformers():
    """Top level wins over the dict (transformers' Phi-3 rule); both absent: max_position_embeddings."""
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
    cases = [
        ({"rope_parameters": params}, 1024),
        ({"original_max_position_embeddings": 512, "rope_parameters": params}, 512),
        ({"rope_parameters": {k: v for k, v in params.items() if k != "original_max_position_embeddings"}}, 4096),
    ]
    for raw, expected in cases:
        raw = {"head_dim": 32, "max_position_embeddings": 4096} | raw
        rope = rope_from_hf(raw)
        assert rope.original_max_position_embeddings == expected
        cfg = hf_config(raw)
        inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](cfg)
        assert cfg.rope_parameters["original_max_position_embeddings"] == expected
        assert_rel_close(rope_inv_freq(rope, 32), inv_freq.numpy(), str(raw))
    # DeepSeek-style null factor: the ratio of the extended to the original length.
    raw = {"head_dim": 32, "max_position_embeddings": 8192, "rope_parameters": params | {"factor": None}}
    assert rope_from_hf(raw).factor == 8.0
    ref_inv_freq, ref_factor = hf_inv_freq(raw)
    assert_rel_close(rope_inv_freq(rope_from_hf(raw), 32), ref_inv_freq, "null factor")
    assert rope_attention_factor(rope_from_hf(raw)) == pytest.approx(ref_factor)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "unsupported rope scaling type 'longrope'"),
        ({"rope_scaling": {"type": "su"}}, "unsupported rope scaling type 'su'"),
        ({"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 4096}}, "needs 'factor' in rope_parameters"),
        ({"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}}, "needs 'factor' in rope_scaling"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "needs 'original_max_position_embeddings'"),
        (
            {"max_position_embeddings": 1 << 17, "rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1, "high_freq_factor": 4}},
            "needs 'factor' in rope_scaling",
        ),
        (
            {"max_position_embeddings": 1 << 17, "rope_scaling": {"rope_type": "llama3", "factor": 8, "high_freq_factor": 4}},
            "'low_freq_factor'",
        ),
        (
            {"max_position_embeddings": 1 << 17, "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1}},
            "'high_freq_factor'",
        ),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "needs an integer 'max_position_embeddings'"),
        ({"max_position_embeddings": 512, "rope_scaling": {"type": "dynamic"}}, "needs 'factor'"),
        ({"max_position_embeddings": 512, "rope_scaling": {"type": "yarn", "factor": "big"}}, "rope_scaling.factor must be a number"),
        ({"rope_parameters": {"rope_type": "linear", "factor": -2.0}}, "invalid rope_parameters.factor"),
        ({"rope_scaling": [1, 2]}, "rope_scaling must be an object"),
    ],
)
def test_load_errors_name_the_key(raw, message):
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        rope_from_hf(raw)


def test_rope_config_requires_the_type_parameters():
    with pytest.raises(ValueError, match="needs original_max_position_embeddings"):
        RopeConfig(theta=1e4, scaling_type="yarn", factor=4.0)
    with pytest.raises(ValueError, match="needs low_freq_factor"):
        RopeConfig(theta=1e4, scaling_type="llama3", factor=4.0, original_max_position_embeddings=8192)
    with pytest.raises(ValueError, match="needs max_position_embeddings"):
        RopeConfig(theta=1e4, scaling_type="dynamic", factor=4.0)
    with pytest.raises(ValueError, match="unsupported rope scaling type 'ntk'"):
        RopeConfig(theta=1e4, scaling_type="ntk")
