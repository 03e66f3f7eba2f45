"""Model families, config parsing and checkpoint loading. Imports only `kernels` from Moray.

One file per family (`qwen3_moe.py`, `mixtral.py`, `qwen2_moe.py`), each exposing `MODEL_TYPE`,
`config_from_hf(raw) -> ModelConfig`, `plan(cfg) -> ModelWeights of WeightSpec` and
`forward(weights, cfg, tokens, positions, cache) -> (logits, cache)`. Adding a family (DeepSeek-V3 with
MLA, the Qwen3-Next hybrid) means adding one such file and registering it below.
"""

from . import mixtral, qwen2_moe, qwen3_moe
from .config import ModelConfig, ModelLoadError
from .model import LoadedModel, default_dtype, load_config, load_model, prompt_logits

FAMILIES = {m.MODEL_TYPE: m for m in (qwen3_moe, mixtral, qwen2_moe)}

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
