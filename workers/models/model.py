"""Loading a model directory into device arrays, and running it over a contiguous KV cache."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kernels.collectives import place_host

from ..progress import Progress
from .config import ModelConfig, ModelLoadError, read_config_json
from .layers import KVCache, ModelWeights
from .quant import check_quantized_tensors, quantize_plan
from .safetensors_io import CheckpointReader
from .weights import DEFAULT_RULES, check_checkpoint, dummy_weights, load_weights, num_bytes, plan_leaves

log = logging.getLogger("moray.models")

LOAD_FORMATS = ("safetensors", "dummy")
# Tensors some exporters leave behind that carry no information we need.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def default_dtype() -> str:
    """bfloat16 on TPU; float32 elsewhere (XLA:CPU bf16 matmuls are ~30x slower than f32)."""
    return "bfloat16" if jax.default_backend() == "tpu" else "float32"


def _families() -> dict[str, ModuleType]:
    from . import FAMILIES

    return FAMILIES


def load_config(model_dir: str | Path) -> tuple[ModuleType, ModelConfig]:
    raw = read_config_json(model_dir)
    model_type = raw.get("model_type")
    family = _families().get(model_type)
    if family is None:
        supported = ", ".join(sorted(_families()))
        raise ModelLoadError(f"config.json: unknown model_type {model_type!r} (supported: {supported})")
    return family, family.config_from_hf(raw)


def single_device_mesh() -> Mesh:
    return jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))


@dataclass
class LoadedModel:
    family: ModuleType
    cfg: ModelConfig
    weights: ModelWeights
    dtype: jnp.dtype
    mesh: Mesh
    # Runs the routed experts over the mesh (`moe_parallel.ExpertParallel`); None: `routed_experts`.
    experts: Callable | None = None
    # Mesh axes the batch is split over (data-parallel attention); () keeps it replicated.
    data_axes: tuple[str, ...] = ()

    @property
    def weight_bytes(self) -> int:
        return num_bytes(self.weights)

    @property
    def data_parallel_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.data_axes)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        cache = KVCache.zeros(self.cfg, batch, max_len, self.dtype)
        return jax.device_put(cache, self._batch_sharding()) if self.data_axes else cache

    def _batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(self.data_axes))

    def step(self, tokens, positions, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """One forward over [B, T] tokens at [B, T] positions; float32 logits [B, T, vocab]."""
        tokens, positions = np.asarray(tokens, np.int32), np.asarray(positions, np.int32)
        if self.data_axes:  # each data-parallel group gets its own rows (and their KV cache)
            tokens, positions = place_host((tokens, positions), self._batch_sharding())
        return _jitted_forward(self.family.forward, self.cfg, self.experts)(self.weights, tokens, positions, cache)


@partial(jax.jit, static_argnums=(0, 1, 2))
def _forward_jit(forward, cfg, experts, weights, tokens, positions, cache):
    if experts is None:
        return forward(weights, cfg, tokens, positions, cache)
    return forward(weights, cfg, tokens, positions, cache, experts=experts)


def _jitted_forward(forward, cfg, experts=None):
    return partial(_forward_jit, forward, cfg, experts)


def load_model(
    model_dir: str | Path,
    dtype: str | None = None,
    load_format: str = "safetensors",
    mesh: Mesh | None = None,
    rules: dict[str, str | None] | None = None,
    seed: int = 0,
    show_progress: bool = True,
) -> LoadedModel:
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unknown load format {load_format!r} (supported: {', '.join(LOAD_FORMATS)})")
    family, cfg = load_config(model_dir)
    dtype = jnp.dtype(dtype or default_dtype())
    mesh = mesh or single_device_mesh()
    rules = DEFAULT_RULES if rules is None else rules
    raw_config = read_config_json(model_dir)
    plan = quantize_plan(family.plan(cfg), raw_config)  # compressed-tensors leaves stay packed on device
    start = time.perf_counter()
    if load_format == "dummy":
        weights = dummy_weights(plan, mesh, rules, dtype, seed)
    else:
        reader = CheckpointReader(model_dir)
        ignorable = {k for k in reader.keys() if k.endswith(_IGNORABLE_SUFFIXES)}
        prefixes = family.skipped_prefixes(raw_config) if hasattr(family, "skipped_prefixes") else getattr(family, "SKIPPED_PREFIXES", ())
        skipped = {k for k in reader.keys() if k.startswith(prefixes)}
        if skipped:
            parts = sorted({p for p in prefixes if any(k.startswith(p) for k in skipped)})
            log.info("skipping %d checkpoint tensors Moray does not serve (%s*)", len(skipped), "*, ".join(parts))
        ignorable |= skipped
        if cfg.tie_word_embeddings:
            ignorable.add("lm_head.weight")  # some exporters write the tied head anyway
        check_quantized_tensors(plan, reader, raw_config)
        check_checkpoint(plan, reader, ignorable)
        progress = Progress(len(plan_leaves(plan)), "loading weights", enabled=show_progress)
        weights = load_weights(plan, reader, mesh, rules, dtype, progress)
    jax.block_until_ready(weights)
    log.info(
        "loaded %s (%s, %.1f MiB) in %.2fs",
        cfg.model_type,
        dtype.name,
        num_bytes(weights) / 2**20,
        time.perf_counter() - start,
    )
    return LoadedModel(family, cfg, weights, dtype, mesh)


def host_array(x: jax.Array) -> np.ndarray:
    """A jax array as numpy on this host, also when it spans several processes (multi-host meshes)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check_token_ids(cfg: ModelConfig, rows: Sequence[Sequence[int]]) -> None:
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("every prompt needs at least one token id")
    for r in rows:
        for t in r:
            if not 0 <= int(t) < cfg.vocab_size:
                raise ValueError(f"token id {t} is outside the vocabulary [0, {cfg.vocab_size})")


def prompt_logits(model: LoadedModel, rows: Sequence[Sequence[int]], pad_to: int | None = None) -> np.ndarray:
    """float32 logits [batch, max_len, vocab] of each prompt; rows shorter than max_len are NaN-padded.
    `pad_to`: run at least this many positions (fewer shapes to compile; the model is causal, so
    positions past a row's end change nothing before it), returning only the rows' own."""
    check_token_ids(model.cfg, rows)
    longest = max(len(r) for r in rows)
    max_len = max(longest, pad_to or 0)
    batch = -(-len(rows) // model.data_parallel_size) * model.data_parallel_size  # whole rows per group
    tokens = np.zeros((batch, max_len), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    positions = np.broadcast_to(np.arange(max_len, dtype=np.int32), tokens.shape)
    logits, _ = model.step(tokens, positions, model.new_cache(batch, max_len))
    out = host_array(logits)[: len(rows), :longest].astype(np.float32)
    for i, r in enumerate(rows):
        out[i, len(r) :] = np.nan
    return out
