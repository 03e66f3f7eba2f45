"""Collectives for expert parallelism, called inside `jax.shard_map` over named mesh axes.

Mesh axes name the levels of the machine, slowest first (e.g. `("host", "chip", "core")`): a collective
over a subset of them stays inside the faster levels by construction. Every function takes the axes
it spans as a tuple in mesh order; rows gathered over several axes come out in the mesh's row-major
device order, the same order `jax.lax.all_gather(x, axes, tiled=True)` gives, so every variant below
is interchangeable with the flat one.

Row gathers (every device needs every token; the dispatch of an all-gather MoE):
- `gather_rows`: one all-gather over all axes (the flat baseline).
- `gather_rows_staged`: one all-gather per level, slowest first. Each slow-level step moves only the
  rows of one device per fast-domain position; the fast levels then share them.
- `gather_rows_split_columns`: the hierarchical dispatch. The k devices of a fast domain first trade
  column pieces (all-to-all), so device c holds columns c of all rows of its domain; each then gathers
  only its H/k columns across the slow levels and the pieces are swapped back inside the domain.
  The slow link carries 1/k of the flat gather's bytes; the result is bitwise that of the flat gather.

Row reductions (each device holds partial outputs for every token; the combine):
- `reduce_scatter_rows`: one reduce-scatter over all axes.
- `reduce_scatter_rows_staged`: one per level, fastest first, so the slow link carries rows already
  summed over the fast domain (the mirror of `gather_rows_staged`). Sums in a different order than the
  flat reduce-scatter: equal up to rounding.

Payload encodings, so each dispatch is one collective:
- `pack_routing` / `unpack_routing`: top-k ids and weights (bitcast) in one int32 array.
- `fp8_encode_rows` / `fp8_decode_rows`: per-row e4m3 values with the float32 scale appended as four
  uint8 columns (one scale per row, copied into every column piece under the hierarchical dispatch).

`ragged_all_to_all` runs `jax.lax.ragged_all_to_all` where the backend has it (TPU, GPU) and an
equivalent padded `all_to_all` elsewhere (XLA:CPU has no ragged all-to-all).

This module imports nothing else from Moray.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("moray.collectives")

Axes = tuple[str, ...]

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 4  # one float32 scale per row, as uint8 columns

# Backends whose XLA lowers ragged-all-to-all natively.
RAGGED_ALL_TO_ALL_BACKENDS = ("tpu", "gpu", "cuda", "rocm")

_warned: set[str] = set()


def warn_once(key: str, message: str, *args) -> None:
    """Logs `message` the first time `key` is seen in this process (collectives are traced per shape,
    so a condition found while tracing would otherwise repeat for every compiled bucket)."""
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def axes_size(axes: Sequence[str]) -> int:
    """Number of devices spanned by `axes` (inside shard_map)."""
    return math.prod(jax.lax.axis_size(a) for a in axes)


def axes_index(axes: Sequence[str]):
    """This device's row-major index over `axes` (inside shard_map); 0 for no axes."""
    return jax.lax.axis_index(tuple(axes)) if axes else jnp.int32(0)


# ---------------------------------------------------------------------------------------------
# Row gathers.


def gather_rows(x: jax.Array, axes: Axes) -> jax.Array:
    """[n, ...] per device -> [D * n, ...]: every device's rows in device order (one collective)."""
    return jax.lax.all_gather(x, tuple(axes), axis=0, tiled=True) if axes else x


def gather_rows_staged(x: jax.Array, axes: Axes) -> jax.Array:
    """`gather_rows`, as one all-gather per mesh level, slowest level first.

    Gathering level i inserts its dimension after those of the slower levels, so the stacked
    [s0, s1, ..., n, ...] result is already in row-major device order: no transpose is needed.
    """
    out = x[None]  # a leading dimension for the levels gathered so far
    for depth, axis in enumerate(axes):
        out = jax.lax.all_gather(out, axis, axis=depth)
    return out.reshape(-1, *x.shape[1:])


def gather_rows_split_columns(pieces: jax.Array, slow_axes: Axes, fast_axes: Axes) -> jax.Array:
    """The hierarchical dispatch: [n, k, w] per device -> [D * n, k, w], equal to `gather_rows`.

    `pieces` is this device's rows cut into k = |fast domain| column pieces of width w. Three steps:
      1. all-to-all in the fast domain: piece c of every row goes to domain device c, which then
         holds piece c of the domain's k * n rows (in fast-device order);
      2. all-gather of those [k * n, w] rows across the slow levels (the only slow-link traffic:
         w = H / k columns instead of H);
      3. all-gather of the pieces inside the fast domain, along the piece dimension.
    Rows come out in (slow, fast) device order because the fast axes follow the slow ones in the mesh.
    """
    n, k, w = pieces.shape
    local = jax.lax.all_to_all(pieces, tuple(fast_axes), split_axis=1, concat_axis=0, tiled=True)
    local = local.reshape(k * n, w)  # piece c (this device's) of the domain's rows
    across = gather_rows(local, slow_axes)  # [S * k * n, w]
    return jax.lax.all_gather(across, tuple(fast_axes), axis=1)  # [S * k * n, k, w]


# ---------------------------------------------------------------------------------------------
# Row reductions.


def reduce_scatter_rows(y: jax.Array, axes: Axes) -> jax.Array:
    """[D * n, ...] partial sums per device -> [n, ...]: this device's rows, summed over `axes`."""
    return jax.lax.psum_scatter(y, tuple(axes), scatter_dimension=0, tiled=True) if axes else y


def reduce_scatter_rows_staged(y: jax.Array, axes: Axes) -> jax.Array:
    """`reduce_scatter_rows`, as one reduce-scatter per mesh level, fastest level first.

    Viewing the rows as [s0, ..., sL, n, ...] (device order), reducing level L scatters dimension L
    and drops it; the slow levels then see rows already summed over the faster ones.
    """
    sizes = [jax.lax.axis_size(a) for a in axes]
    out = y.reshape(*sizes, -1, *y.shape[1:])
    for depth in reversed(range(len(axes))):
        out = jax.lax.psum_scatter(out, axes[depth], scatter_dimension=depth)
    return out


# ---------------------------------------------------------------------------------------------
# Payload encodings.


def pack_routing(ids: jax.Array, weights: jax.Array) -> jax.Array:
    """ids i32[n, k] and weights f32[n, k] -> i32[n, 2k] (weights bitcast), one array to gather."""
    bits = jax.lax.bitcast_convert_type(weights.astype(jnp.float32), jnp.int32)
    return jnp.concatenate([ids.astype(jnp.int32), bits], axis=1)


def unpack_routing(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    ids, bits = jnp.split(packed, 2, axis=1)
    return ids, jax.lax.bitcast_convert_type(bits, jnp.float32)


def collectives_over_gloo() -> bool:
    """Whether cross-device collectives run on XLA:CPU between processes (gloo). There XLA lets a program's
    independent collectives overlap, and gloo uses one tag for all of them: two over the same devices in
    flight at once match each other's messages and hang. Programs built for it order them by data."""
    return jax.process_count() > 1 and jax.default_backend() == "cpu"


def place_host(x, sharding):
    """Host data (a numpy array, or a pytree of them; device arrays pass to `jax.device_put`) that every process
    holds the same copy of, placed as `sharding`. Across processes each one places its own devices' parts of
    its copy: `jax.device_put` of host data there first checks that every process passed the same value,
    with a collective program of its own (an all-gather over the processes), which a multi-host engine
    would run for every argument of every step, and which hung two hosts over gloo beside their
    programs."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)

    def place(a):
        if isinstance(a, jax.Array):
            return jax.device_put(a, sharding)
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    return jax.tree.map(place, x)


_ALIGNMENTS = itertools.count()  # barrier names: every process takes them in the same order


def align_processes(timeout_s: float = 3600.0) -> None:
    """Waits until every process of the `jax.distributed` cluster has got here, on the coordination service
    (a key-value barrier, no collective); nothing to wait for in one process. Call it where the processes
    of one program are about to run a program each compiled on its own, before its first run.

    On CPU, gloo builds a device group's communicator at the first collective over that group and gives up
    when the processes arrive more than 30 s apart (a key-value lookup with a fixed 30 s limit, which
    `--xla_cpu_collective_timeout_seconds` does not change); the process that got there first then fails
    its part of the program and the others wait in the collective forever. A process that loaded a program
    from the persistent compilation cache (only process 0 writes it) is that far ahead of one compiling it
    on a busy machine: a two-host replica hung so in its first step, only in the full test suite."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed

    client = distributed.global_state.client
    if client is not None:
        client.wait_at_barrier(f"moray-align-{next(_ALIGNMENTS)}", int(timeout_s * 1000))


def append_words(rows: jax.Array, words: jax.Array) -> jax.Array:
    """rows [n, c] (any 1-, 2- or 4-byte dtype) and int32 words [n, w] -> [n, c + w * 4 / itemsize] in rows'
    dtype: the words' bits as extra columns, so both travel in one collective (`split_words` undoes it)."""
    n = rows.shape[0]
    bits = jax.lax.bitcast_convert_type(words.astype(jnp.int32), rows.dtype)  # [n, w] or [n, w, 4 / itemsize]
    return jnp.concatenate([rows, bits.reshape(n, -1)], axis=1)


def split_words(packed: jax.Array, columns: int) -> tuple[jax.Array, jax.Array]:
    """`append_words`' result -> (rows [n, columns], int32 words [n, w]), bit for bit."""
    n, per_word = packed.shape[0], 4 // jnp.dtype(packed.dtype).itemsize
    bits = packed[:, columns:]
    if per_word > 1:
        bits = bits.reshape(n, -1, per_word)
    return packed[:, :columns], jax.lax.bitcast_convert_type(bits, jnp.int32)


def fp8_encode_rows(x: jax.Array, pieces: int = 1) -> jax.Array:
    """[n, H] -> uint8 [n, pieces, H / pieces + 4]: e4m3 values of each row scaled by its max, and the
    row's float32 scale as four bytes appended to every piece (so any piece decodes on its own)."""
    n, h = x.shape
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = jax.lax.bitcast_convert_type((xf / scale).astype(FP8_DTYPE), jnp.uint8)
    scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.uint8)  # [n, 1, 4]
    q = q.reshape(n, pieces, h // pieces)
    return jnp.concatenate([q, jnp.broadcast_to(scale_bytes, (n, pieces, SCALE_BYTES))], axis=2)


def fp8_decode_rows(payload: jax.Array, dtype) -> jax.Array:
    """uint8 [n, pieces, w + 4] from `fp8_encode_rows` -> [n, pieces * w] in `dtype`."""
    n, pieces, width = payload.shape
    q = jax.lax.bitcast_convert_type(payload[:, :, : width - SCALE_BYTES], FP8_DTYPE)
    scale = jax.lax.bitcast_convert_type(payload[:, 0, width - SCALE_BYTES :], jnp.float32)  # [n]
    return (q.astype(jnp.float32).reshape(n, -1) * scale[:, None]).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Ragged all-to-all.


def has_ragged_all_to_all(backend: str | None = None) -> bool:
    return (backend or jax.default_backend()) in RAGGED_ALL_TO_ALL_BACKENDS


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes: Axes):
    """`jax.lax.ragged_all_to_all` semantics on every backend.

    Without a native op, each of the len(send_sizes) slices is padded to the operand's full length and
    exchanged with a dense all-to-all, then written at the offsets its sender chose. Same result,
    but it moves operand-sized slices: a correctness fallback, not a fast path.
    """
    axes = tuple(axes)
    if has_ragged_all_to_all():
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axes)
    warn_once(
        "ragged_all_to_all",
        "ragged_all_to_all is not available on the %s backend: using a padded all_to_all (same result, more bytes)",
        jax.default_backend(),
    )
    cap = operand.shape[0]
    rows = jnp.arange(cap, dtype=jnp.int32)
    # slices[i] = operand[input_offsets[i] : input_offsets[i] + send_sizes[i]], zero past send_sizes[i].
    src = jnp.clip(input_offsets[:, None] + rows[None, :], 0, cap - 1)
    valid = rows[None, :] < send_sizes[:, None]
    slices = jnp.where(_expand(valid, operand.ndim), operand[src], 0)
    # Each slice carries the offset its sender chose, in one collective: two independent collectives over the
    # same devices may overlap on XLA:CPU, which hangs between processes (`collectives_over_gloo`).
    packed = append_words(slices.reshape(slices.shape[0], -1), output_offsets.reshape(-1, 1))
    received, where = split_words(jax.lax.all_to_all(packed, axes, 0, 0, tiled=True), cap * math.prod(operand.shape[1:]))
    received, where = received.reshape(slices.shape), where.reshape(-1)  # slice i now from source i // per_device
    dst = where[:, None] + rows[None, :]
    dst = jnp.where(rows[None, :] < recv_sizes[:, None], dst, output.shape[0])  # past the end: dropped
    return output.at[dst.reshape(-1)].set(received.reshape(-1, *operand.shape[1:]), mode="drop")


def _expand(mask: jax.Array, ndim: int) -> jax.Array:
    """[a, b] mask broadcastable against [a, b, ...] rows of an ndim-dimensional operand."""
    return mask.reshape(*mask.shape, *([1] * (ndim - 1)))
