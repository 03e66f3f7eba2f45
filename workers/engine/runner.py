"""The model runner: turns a `SchedulerOutput` into padded device arrays and runs the compiled step.

Static shapes: the flat token count is padded to a *token bucket*, the per-sequence page table to a
*page bucket*, and the number of sequences follows the token bucket (min(tokens, max_num_seqs)), so the
set of compiled programs is |token buckets| x |page buckets|, all compiled by `warmup()`.
The KV pages are donated to each step, so XLA updates them in place.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from workers.models import LoadedModel
from workers.models.layers import PagedKVCache

from ..progress import Progress
from .config import EngineConfig, powers_of_two_up_to
from .kv_cache_manager import BlockCopy
from .scheduler import SchedulerOutput

log = logging.getLogger("moray.engine")


def pick_bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class StepInputs:
    """Host-side arrays for one step (numpy), plus which row of the logits belongs to which request."""

    tokens: np.ndarray  # i32[1, N]
    positions: np.ndarray  # i32[1, N]
    slot_mapping: np.ndarray  # i32[N]
    kv_lens: np.ndarray  # i32[S]
    page_indices: np.ndarray  # i32[S, P]
    cu_q_lens: np.ndarray  # i32[S + 1]
    num_seqs: np.ndarray  # i32[1]
    logits_indices: np.ndarray  # i32[S]


class ModelRunner:
    def __init__(self, model: LoadedModel, config: EngineConfig, num_blocks: int, max_model_len: int):
        self.model = model
        self.cfg = model.cfg
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = config.max_num_seqs
        max_pages = math.ceil(max_model_len / config.block_size)
        self.token_buckets = config.token_buckets or powers_of_two_up_to(config.max_num_batched_tokens)
        self.page_buckets = config.page_buckets or powers_of_two_up_to(max_pages)
        if self.token_buckets[-1] < config.max_num_batched_tokens:
            raise ValueError("the largest token bucket must be >= max_num_batched_tokens")
        if self.page_buckets[-1] < max_pages:
            raise ValueError(f"the largest page bucket must be >= max_model_len / block_size = {max_pages}")
        page_shape = (num_blocks, config.block_size, 2 * self.cfg.num_kv_heads, self.cfg.head_dim)
        self.kv_pages = self._new_pages(page_shape)
        self.num_traces = 0  # how many step programs were traced (== compiled) so far
        self._step = jax.jit(self._step_impl, donate_argnums=(1,))
        self._copy = jax.jit(_copy_pages, donate_argnums=(0,))

    def _new_pages(self, page_shape: tuple[int, ...]) -> list[jax.Array]:
        # Committed to the mesh up front: a step's outputs are committed arrays, and jit keys its cache
        # on that, so uncommitted initial pages would compile the first bucket twice.
        replicated = NamedSharding(self.model.mesh, PartitionSpec())
        return [jax.device_put(jnp.zeros(page_shape, self.model.dtype), replicated) for _ in range(self.cfg.num_layers)]

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model, self.block_size)

    def _step_impl(self, weights, kv_pages, tokens, positions, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs, logits_indices):
        self.num_traces += 1  # runs only while tracing: counts compilations
        cache = PagedKVCache(list(kv_pages), slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs)
        logits, cache = self.model.family.forward(weights, self.cfg, tokens, positions, cache, logits_indices, experts=self.model.experts)
        return logits, cache.pages

    def seqs_for(self, token_bucket: int) -> int:
        return min(token_bucket, self.max_num_seqs)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        num_tokens = out.num_tokens
        n = pick_bucket(self.token_buckets, num_tokens)
        s = self.seqs_for(n)
        p = pick_bucket(self.page_buckets, max(len(x.request.block_ids) for x in out.scheduled))
        tokens = np.zeros((1, n), np.int32)
        positions = np.zeros((1, n), np.int32)
        slots = np.full((n,), -1, np.int32)
        kv_lens = np.zeros((s,), np.int32)
        pages = np.zeros((s, p), np.int32)
        cu = np.zeros((s + 1,), np.int32)
        logits_idx = np.zeros((s,), np.int32)
        offset = 0
        for i, item in enumerate(out.scheduled):
            req, k, start = item.request, item.num_new_tokens, item.start
            pos = np.arange(start, start + k, dtype=np.int32)
            tokens[0, offset : offset + k] = req.all_token_ids[start : start + k]
            positions[0, offset : offset + k] = pos
            blocks = np.asarray(req.block_ids, np.int32)
            slots[offset : offset + k] = blocks[pos // self.block_size] * self.block_size + pos % self.block_size
            kv_lens[i] = start + k
            pages[i, : len(blocks)] = blocks
            offset += k
            cu[i + 1] = offset
            logits_idx[i] = offset - 1
        cu[len(out.scheduled) + 1 :] = offset
        num_seqs = np.array([len(out.scheduled)], np.int32)
        return StepInputs(tokens, positions, slots, kv_lens, pages, cu, num_seqs, logits_idx)

    def run(self, inputs: StepInputs) -> jax.Array:
        """Runs one step; returns float32 logits [S_bucket, vocab] on device (row i = scheduled request i)."""
        logits, self.kv_pages = self._step(
            self.model.weights,
            self.kv_pages,
            inputs.tokens,
            inputs.positions,
            inputs.slot_mapping,
            inputs.kv_lens,
            inputs.page_indices,
            inputs.cu_q_lens,
            inputs.num_seqs,
            inputs.logits_indices,
        )
        return logits

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        if copies:
            src = jnp.asarray([c.src for c in copies], jnp.int32)
            dst = jnp.asarray([c.dst for c in copies], jnp.int32)
            self.kv_pages = self._copy(self.kv_pages, src, dst)

    def _padded_ids(self, block_ids: list[int], pad_value: int) -> np.ndarray:
        n = pick_bucket(self.page_buckets, max(len(block_ids), 1))
        ids = np.full((n,), pad_value, np.int32)
        ids[: len(block_ids)] = block_ids
        return ids

    def gather_blocks(self, block_ids: list[int], layer_start: int, layer_end: int) -> np.ndarray:
        """KV of `block_ids` for layers [start, end) on the host: [layers, blocks, page, 2*Hkv, D]."""
        ids = self._padded_ids(block_ids, 0)
        out = _gather_jit(self.kv_pages[layer_start:layer_end], ids)
        return np.asarray(out)[:, : len(block_ids)]

    def scatter_blocks(self, block_ids: list[int], layer_start: int, data: np.ndarray) -> None:
        """Writes host KV [layers, blocks, ...] into `block_ids` for layers starting at `layer_start`."""
        ids = self._padded_ids(block_ids, self.num_blocks)
        padded = np.zeros((data.shape[0], len(ids), *data.shape[2:]), data.dtype)
        padded[:, : len(block_ids)] = data
        end = layer_start + data.shape[0]
        self.kv_pages[layer_start:end] = _scatter_jit(self.kv_pages[layer_start:end], ids, padded)

    def dummy_inputs(self, n: int, p: int) -> StepInputs:
        """Inputs of bucket shape (n tokens, p pages) that compute nothing real (all tokens padding)."""
        s = self.seqs_for(n)
        return StepInputs(
            tokens=np.zeros((1, n), np.int32),
            positions=np.zeros((1, n), np.int32),
            slot_mapping=np.full((n,), -1, np.int32),
            kv_lens=np.zeros((s,), np.int32),
            page_indices=np.zeros((s, p), np.int32),
            cu_q_lens=np.zeros((s + 1,), np.int32),
            num_seqs=np.zeros((1,), np.int32),
            logits_indices=np.zeros((s,), np.int32),
        )

    def warmup(self, sample_fn=None, show_progress: bool = True) -> float:
        """Compiles every (token bucket, page bucket) step program, and the sampler per sequence bucket."""
        start = time.perf_counter()
        shapes = [(n, p) for n in self.token_buckets for p in self.page_buckets]
        progress = Progress(len(shapes), "compiling step buckets", enabled=show_progress)
        for n, p in shapes:
            logits = self.run(self.dummy_inputs(n, p))
            if sample_fn is not None:
                sample_fn(logits)
            jax.block_until_ready(logits)
            progress(1)
        elapsed = time.perf_counter() - start
        log.info("warm-up compiled %d step programs in %.1fs", len(shapes), elapsed)
        return elapsed


def _gather_blocks(kv_pages, ids):
    return jnp.stack([pages[ids] for pages in kv_pages])


def _scatter_blocks(kv_pages, ids, data):
    # Padded ids point past the pool and are dropped.
    return [pages.at[ids].set(d, mode="drop") for pages, d in zip(kv_pages, data)]


def _copy_pages(kv_pages, src, dst):
    return [pages.at[dst].set(pages[src]) for pages in kv_pages]


_gather_jit = jax.jit(_gather_blocks)
_scatter_jit = jax.jit(_scatter_blocks, donate_argnums=(0,))


_gather_jit = jax.jit(_gather_blocks)
_scatter_jit = jax.jit(_scatter_blocks, donate_argnums=(0,))


def kv_bytes_per_block(model: LoadedModel, block_size: int) -> int:
    cfg = model.cfg
    return cfg.num_layers * block_size * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(model.dtype).itemsize
