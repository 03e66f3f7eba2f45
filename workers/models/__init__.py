"""Model families, config parsing and checkpoint loading. Imports only `kernels` from Moray.

One file per family (`qwen3_moe.py`, `mixtral.py`, `qwen2_moe.py`, the hybrid linear-attention
`qwen3_5_moe.py` and `qwen3_next.py`, `deepseek_v3.py`, `gemma4.py`), each exposing `MODEL_TYPE`, `config_from_hf(raw) -> ModelConfig`,
`plan(cfg) -> ModelWeights of WeightSpec` and
`forward(weights, cfg, tokens, positions, cache, logits_indices=None, experts=None) -> (logits, cache)`
(`experts`: an executor replacing `routed_experts`, e.g. `moe_parallel.ExpertParallel` over a mesh).
Optional: `MODEL_TYPES` (every `model_type` the file serves, default `(MODEL_TYPE,)`) and
`SKIPPED_PREFIXES` (checkpoint tensors of parts not served, e.g. a vision tower) or
`skipped_prefixes(raw_config)` when they depend on the config (DeepSeek-V3's multi-token-prediction
layers). Adding a family means adding one such file and registering it below.

The families and the loader import jax, so they load on first use (PEP 562): jax-free submodules such as
`quantize` (a `moray` subcommand) stay cheap to import.
"""

from importlib import import_module

from .config import ModelConfig, ModelLoadError

_FROM_MODEL = ("LoadedModel", "default_dtype", "load_config", "load_model", "prompt_logits")


def __getattr__(name: str):
    if name == "FAMILIES":
        from . import deepseek_v3, gemma4, mixtral, qwen2_moe, qwen3_5_moe, qwen3_moe, qwen3_next

        families = (qwen3_moe, mixtral, qwen2_moe, qwen3_5_moe, qwen3_next, deepseek_v3, gemma4)
        value = {t: m for m in families for t in getattr(m, "MODEL_TYPES", (m.MODEL_TYPE,))}
    elif name in _FROM_MODEL:
        value = getattr(import_module(".model", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [
    "FAMILIES",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "default_dtype",
    "load_config",
    "load_model",
    "prompt_logits",
]
