"""`EngineConfig`: everything one engine (one prefill or decode worker) needs; the cluster config embeds it."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_COMPILE_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "moray", "xla")


def powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(description="checkpoint directory (Hugging Face layout)")
    served_model_name: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="compute dtype; default float32 on CPU, bfloat16 on TPU"
    )
    load_format: Literal["safetensors", "dummy"] = "safetensors"
    seed: int = 0

    block_size: int = Field(default=16, ge=1, le=1024)
    num_kv_blocks: int | None = Field(default=None, ge=2, description="overrides kv_cache_memory_bytes")
    kv_cache_memory_bytes: int = Field(default=256 << 20, gt=0)
    enable_prefix_caching: bool = True

    max_num_seqs: int = Field(default=32, ge=1)
    max_num_batched_tokens: int = Field(default=512, ge=1)
    max_model_len: int | None = Field(default=None, ge=2, description="default: the model's, capped at 4096")

    # Static shapes for XLA: a step's token count and pages-per-sequence are padded up to a bucket.
    token_buckets: list[int] | None = None
    page_buckets: list[int] | None = None
    warmup: bool = True
    compilation_cache_dir: str | None = DEFAULT_COMPILE_CACHE

    worker_id: str = "worker-0"

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        for name in ("token_buckets", "page_buckets"):
            buckets = getattr(self, name)
            if buckets is not None and (not buckets or sorted(set(buckets)) != buckets or buckets[0] < 1):
                raise ValueError(f"{name} must be a non-empty, strictly increasing list of positive integers")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))
