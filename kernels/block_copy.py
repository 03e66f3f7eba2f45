"""Whole KV blocks between a cache's page pools (one per layer, [blocks, page, ...]) and one blocks-first array
([blocks, layers, page, *transport dims]): what a KV handoff exports and imports and the host tier writes
back.

The scatter and the gather have two paths each, chosen by `impl_for` on the concrete pages (outside jit, where
their placement is known):
- `xla`: a scatter or gather per layer (any backend, any sharding).
- `cpu`: kernels/cpu/block_copy.cc through XLA's FFI for pages on one CPU device: a memcpy per (block, layer)
  on the kernels' pool threads. Measured on 2 cores: a scatter of 64 MiB (16 layers x 64 blocks) 26 -> 4.4 ms
  (2.4 -> 14 GB/s; numpy's copy here: 8.8 GB/s); a gather of an export piece (6 MiB: 32 blocks x 6 layers of
  the bench preset, into warm memory) 0.9-1.3 -> 0.5-0.7 ms.

The transport layout: layers of different shapes (a model whose layers' KV rows differ) share one row width,
each token's row zero-padded to it (`ModelConfig.kv_transport_dims`); `width` None: the pages' own rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import cpu_ffi


def impl_for(kv_pages: list[jax.Array]) -> str:
    """`cpu` for pages that all live on one CPU device and when the CPU kernels are built, else `xla`."""
    one_cpu_device = all(len(p.sharding.device_set) == 1 and next(iter(p.sharding.device_set)).platform == "cpu" for p in kv_pages)
    return "cpu" if kv_pages and one_cpu_device and cpu_ffi.available() else "xla"


def to_transport(blocks, width: int | None):
    """[n, page, R, D] -> [n, page, 1, width], zero-padded; width None: unchanged."""
    if width is None:
        return blocks
    flat = blocks.reshape(*blocks.shape[:2], 1, -1)
    return jnp.pad(flat, ((0, 0), (0, 0), (0, 0), (0, width - flat.shape[-1])))


def from_transport(data, page_shape):
    """The inverse of `to_transport` for a layer whose pages are `page_shape`."""
    if data.shape[2:] == tuple(page_shape[2:]):
        return data
    r, d = page_shape[2:]
    return data[..., : r * d].reshape(*data.shape[:2], r, d)


def ids_of(ids, layer: int):
    """One array of block ids for every layer, or (cache groups) a list with one per layer."""
    return ids[layer] if isinstance(ids, (list, tuple)) else ids


def gather_blocks_first(kv_pages, ids, width: int | None = None, impl: str = "xla"):
    """[n, layers, page, *transport dims]: the blocks `ids` (one array, or one per layer) of every layer."""
    if impl == "cpu" and len({p.dtype for p in kv_pages}) == 1:
        n = len(ids_of(ids, 0))
        dims = kv_pages[0].shape[2:] if width is None else (1, width)
        out = jax.ShapeDtypeStruct((n, len(kv_pages), kv_pages[0].shape[1], *dims), kv_pages[0].dtype)
        return cpu_ffi.gather_blocks(list(kv_pages), _id_rows(ids), out)
    return jnp.stack([to_transport(pages[ids_of(ids, i)], width) for i, pages in enumerate(kv_pages)], axis=1)


def scatter_blocks_first(kv_pages, ids, data, impl: str = "xla"):
    """The pages with the blocks `ids` written from `data` ([n, layers, page, *transport dims]); ids past a
    pool (padding) are dropped. Jit it with the pages donated: the `cpu` path then writes them in place."""
    if impl == "cpu" and len({p.dtype for p in kv_pages}) == 1:
        # The kernel copies bytes: data of another dtype (a sender's KV dtype) is converted first, as `.set` does.
        return cpu_ffi.scatter_blocks(list(kv_pages), _id_rows(ids), data.astype(kv_pages[0].dtype))
    return [pages.at[ids_of(ids, i)].set(from_transport(data[:, i], pages.shape), mode="drop") for i, pages in enumerate(kv_pages)]


def _id_rows(ids):
    """[1, n] for one array shared by every layer, [layers, n] for one per layer."""
    if isinstance(ids, (list, tuple)):
        return jnp.stack([jnp.asarray(i, jnp.int32) for i in ids])
    return jnp.asarray(ids, jnp.int32)[None]


def gather_blocks_first_async(kv_pages, ids, width: int | None = None, impl: str = "xla"):
    """`gather_blocks_first` and a 32x32 product of the ids (discard it). XLA:CPU runs a program its cost
    model prices under 1,000 flops inline on the thread that dispatches it, and a gather is priced at ~3
    flops per id (the `cpu` path's custom call at 0): a copy of a few MiB would block the dispatching thread
    (the engine's) for milliseconds. The product (~65k flops, microseconds) puts it on XLA's own threads
    like any step."""
    rows = _id_rows(ids)
    x = jnp.resize(rows[0].astype(jnp.float32), (32, 32))
    return gather_blocks_first(kv_pages, ids, width, impl), x @ x


def scatter_blocks_first_async(kv_pages, ids, data, impl: str = "xla"):
    """`scatter_blocks_first` and the same 32x32 product (`gather_blocks_first_async`): an imported chunk's
    write (the kernel's custom call is priced at 0 flops) ran inline on the engine thread, ~0.5-1 ms per
    6 MiB chunk, so a decode engine stepped no other request while it imported. The product is done when
    the write is: wait on it, not on the pages (later steps donate them)."""
    rows = _id_rows(ids)
    x = jnp.resize(rows[0].astype(jnp.float32), (32, 32))
    return scatter_blocks_first(kv_pages, ids, data, impl), x @ x


gather_blocks_first_jit = jax.jit(gather_blocks_first, static_argnames=("width", "impl"))
gather_blocks_first_async_jit = jax.jit(gather_blocks_first_async, static_argnames=("width", "impl"))
scatter_blocks_first_jit = jax.jit(scatter_blocks_first, donate_argnums=(0,), static_argnames=("impl",))
scatter_blocks_first_async_jit = jax.jit(scatter_blocks_first_async, donate_argnums=(0,), static_argnames=("impl",))
