"""Routed-expert computation: top-k routing and the expert SwiGLU over [E, ...] stacked weights.

Weight layout follows the checkpoints' [out, in] convention, experts stacked first:
`gate_up` [E, 2I, H] (gate rows first, then up) and `down` [E, H, I].

Seven implementations of `routed_experts`, all computing in the weights' dtype with float32
accumulation and agreeing within float32 rounding:
- `cpu`: a C++ kernel through XLA's FFI (kernels/cpu/moe_experts.cc, built on first use by
  kernels/cpu_ffi.py) for float32 weights on CPU: each selected expert's rows are streamed once from the
  stacked weights and dotted with all of its tokens. XLA:CPU copies a sliced expert before each dot,
  which held the `gather` path well under the memory bandwidth. Replaces `gather` on CPU when it builds.
- `gather`: loop over the distinct selected experts, slicing each one's weights once, and run each of
  its assignments as a matrix-vector product. Reads only the active parameters, each once, which is what
  a decode batch should cost (at batch 16 of 64 experts top-8 the union is ~56 experts).
- `tiled`: portable grouped matmul. Assignments are sorted by expert and laid out in fixed-size row tiles,
  each tile owned by one expert, then a loop over tiles runs one [m, H] x [H, 2I] matmul per tile. Cost is
  ~(T*k + E*m) x H x 2I, proportional to the real work; the default for large batches off TPU.
- `pallas`: the same grouped matmul with the TPU megablox GMM kernel (`interpret=True` off TPU, for tests).
- `take`: every assignment takes its expert's weights ([T*k, 2I, H], a gather) and runs as one batched
  matrix-vector product: a handful of kernels, no loop. For accelerators at small batches, where the
  `gather` path's data-dependent loops cost a host round trip per iteration (the bench preset's batch-1 step
  took 6 ms on an H200, the experts read at 18 GB/s).
- `masked`: every expert runs on every token and the routing weights (zero for unchosen experts) combine
  them: reads each expert once, E/k times the FLOPs. For accelerators when the batch chooses most experts
  and the compute is still small (decode batches), where it is a few large matmuls.
- `sorted`: the same grouped matmul with `jax.lax.ragged_dot`. XLA:CPU emulates ragged_dot densely
  (cost ~ E x T*k x H x 2I), so it is kept only as an explicit choice and a cross-check.

`moe_impl` picks one from the static number of assignments (and expert count) and the backend, and
`routed_experts` swaps `gather` for `cpu` where that kernel applies; `MORAY_MOE_IMPL` forces one.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm  # the custom_vjp op

from . import cpu_ffi
from .quant import as_dense, grouped_matmul, is_quantized, quantized_matmul, select_impl

# Use `gather` while tokens x top_k stays at or below this many assignments, on every backend.
GATHER_MAX_ASSIGNMENTS = 64
# Off TPU, also while the average expert group (assignments / experts) has at most this many rows: XLA:CPU
# runs small-row matmuls poorly (a [4, 1024] x [1024, 512] dot took 3x a [1, 1024] one), so one GEMV per
# assignment against an expert sliced once beats the tiled grouped matmul. Measured on XLA:CPU (E=64, k=8,
# H=1024, I=256, 6 layers): batch 8 71 vs 225 ms (tiled), batch 16 127 vs 239 ms, batch 32 247 vs 369 ms.
GATHER_MAX_GROUP_ROWS = 4

# On GPU, `masked` while its work, tokens x experts x weights per expert (3HI), stays at or below this.
# Measured on an H200 with the bench preset's layer (E=64, k=8, H=1024, I=256, bfloat16; ms per call, take /
# masked / sorted (ragged_dot) / tiled / gather): T=1 0.08 / 0.11 / 0.15 / 0.50 / 0.75; T=8 0.11 / 0.13 /
# 0.18 / 1.9 / 4.4; T=16 0.18 / 0.13 / 0.24 / 2.1 / 7.1; T=64 0.32 / 0.22 / 0.36 / 3.2; T=512 1.71 / 0.30 /
# 1.16 / 3.5; T=2048 5.7 / - / 3.8 / 5.4. Every expert on every token costs E/k times the useful FLOPs, so
# the bound is on the whole product: 512 tokens of that layer; DeepSeek-V3's experts (E=256, H=7168,
# I=2048) never (its decode batches up to 32 tokens take `take`, larger ones ragged_dot).
MASKED_MAX_WORK = 512 * 64 * 3 * 1024 * 256

IMPLS = ("gather", "tiled", "pallas", "sorted", "cpu", "take", "masked")
IMPL_ENV_VAR = "MORAY_MOE_IMPL"

# Row-tile bounds for the `tiled` path (see `tile_rows`).
MIN_TILE_ROWS = 8
MAX_TILE_ROWS = 128

# Megablox tiling (rows, contraction, output columns). 128 rows fill the MXU; 512-wide contraction and
# output blocks keep the double-buffered VMEM footprint of bf16 blocks around 2 MiB. Untuned.
PALLAS_TILING = (128, 512, 512)


def route_softmax_topk(router_logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax over all experts in float32, then top-k; optionally renormalise the k weights."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def route_sigmoid_group_topk(
    router_logits: jax.Array,  # [T, E]
    correction_bias: jax.Array | None,  # [E], added for the choice only
    top_k: int,
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's router: sigmoid scores; the experts are chosen on scores + correction bias, only within
    the `topk_groups` best of `num_groups` equal groups (a group's score is the sum of its two best); the
    weights are the unbiased scores of the chosen experts, renormalised if asked, times `scaling_factor`."""
    t, e = router_logits.shape
    if e % num_groups or not 0 < topk_groups <= num_groups:
        raise ValueError(f"{e} experts in {num_groups} groups, {topk_groups} kept: not a valid grouping")
    scores = jax.nn.sigmoid(router_logits.astype(jnp.float32))
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if num_groups > 1:
        grouped = choice.reshape(t, num_groups, e // num_groups)
        group_scores = jax.lax.top_k(grouped, min(2, e // num_groups))[0].sum(axis=-1)
        _, best = jax.lax.top_k(group_scores, topk_groups)
        keep = jnp.zeros((t, num_groups), bool).at[jnp.arange(t)[:, None], best].set(True)
        choice = jnp.where(jnp.repeat(keep, e // num_groups, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling_factor, ids.astype(jnp.int32)


def moe_impl(
    num_assignments: int,
    backend: str | None = None,
    num_experts: int | None = None,
    num_tokens: int | None = None,
    expert_weights: int | None = None,
) -> str:
    """The implementation `routed_experts` uses for `num_assignments` = tokens x top_k.

    `MORAY_MOE_IMPL` (one of IMPLS) overrides the choice. Otherwise small batches gather, and larger ones
    run a grouped matmul: the megablox kernel on TPU, the tiled loop elsewhere. Off TPU, given
    `num_experts`, batches whose average expert group is small (decode) gather too. GPUs get loop-free
    paths (`_gpu_impl`; `num_tokens` and `expert_weights`, the weights per expert, size their choice).
    """
    forced = os.environ.get(IMPL_ENV_VAR)
    if forced:
        if forced not in IMPLS:
            raise ValueError(f"{IMPL_ENV_VAR}={forced!r}; expected one of {IMPLS}")
        return forced
    backend = backend or jax.default_backend()
    if backend == "gpu":
        return _gpu_impl(num_assignments, num_experts, num_tokens or num_assignments, expert_weights)
    if num_assignments <= GATHER_MAX_ASSIGNMENTS:
        return "gather"
    if backend == "tpu":
        return "pallas"
    if num_experts and num_assignments <= GATHER_MAX_GROUP_ROWS * num_experts:
        return "gather"
    return "tiled"


def _gpu_impl(num_assignments: int, num_experts: int | None, num_tokens: int, expert_weights: int | None) -> str:
    """On a GPU: no data-dependent loops (each iteration of one waits on the host). Up to one assignment per
    expert, `take` reads no more experts than are chosen; then `masked` while running every expert on
    every token stays small work; past that the grouped matmul of `ragged_dot`."""
    if num_experts is None or num_assignments <= num_experts:
        return "take"
    if expert_weights is not None and num_tokens * num_experts * expert_weights <= MASKED_MAX_WORK:
        return "masked"
    return "sorted"


def tile_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per tile for the `tiled` path: the average group size, as a power of two in [8, 128].

    Each non-empty expert wastes up to m-1 padded rows, so m should not exceed a typical group; larger m
    runs fewer, more efficient matmuls. On CPU (E=64, k=8, H=1024, I=256) the average group size was the
    fastest of the powers of two tried, for T from 8 to 2048.
    """
    average = -(-num_assignments // num_experts)
    m = 1 << max(average - 1, 0).bit_length()  # next power of two >= average
    return min(max(m, MIN_TILE_ROWS), MAX_TILE_ROWS)


# The gate's activation in each expert's gated MLP: SiLU (SwiGLU, most families) or the tanh
# approximation of GELU (GeGLU: Gemma 4's `gelu_pytorch_tanh`). Both map 0 to 0, so zero padding rows stay 0.
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def _swiglu(gate_up: jax.Array, activation: str = "silu") -> jax.Array:
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return ACTIVATIONS[activation](gate) * up


def _expert_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, activation: str = "silu") -> jax.Array:
    """One expert on rows x [..., H] with its gate_up [2I, H] and down [H, I]; float32 result [..., H]."""
    if is_quantized(gate_up):  # packed experts (kernels/quant.py): dequantise just this expert, per group
        h = quantized_matmul(x, gate_up, impl="xla")
        return quantized_matmul(_swiglu(h, activation).astype(x.dtype), down, impl="xla")
    h = jnp.einsum("...h,ih->...i", x, gate_up, preferred_element_type=jnp.float32)
    act = _swiglu(h, activation).astype(x.dtype)
    return jnp.einsum("...i,hi->...h", act, down, preferred_element_type=jnp.float32)


def _combine(out: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted sum over k of per-assignment outputs out [T*k, H] (token-major) -> [T, H] float32."""
    t, k = weights.shape
    return jnp.einsum("tkh,tk->th", out.reshape(t, k, -1), weights)


def _experts_gather(x, ids, weights, gate_up, down, activation="silu"):
    # Each distinct expert is sliced once (XLA:CPU copies a dynamic slice before a dot, so slicing per
    # assignment re-copied an expert for every token choosing it), then each of its assignments runs as a
    # matrix-vector product against that copy, which is still hot in cache. Gathering all chosen experts
    # into one [T, k, 2I, H] array first was 14-30x slower on XLA:CPU (a copy plus a slow batched GEMV), and
    # row tiles (m > 1) ran XLA:CPU's slow small matmuls.
    t, k = ids.shape
    num_experts, a = gate_up.shape[0], ids.size
    order, group_sizes = _sort_by_expert(ids, num_experts)
    group_starts = jnp.cumsum(group_sizes) - group_sizes
    token_of = order // k  # sorted position -> token
    weight_of = weights.reshape(-1)[order].astype(jnp.float32)
    used = jnp.nonzero(group_sizes, size=min(num_experts, a), fill_value=0)[0]
    num_used = jnp.sum(group_sizes > 0)

    def expert(i, out):
        e = used[i] + _zero_that_keeps_loop_unfused(i)
        expert_gate_up, expert_down = gate_up[e], down[e]  # the copies, split across cores

        def assignment(j, out):
            p = group_starts[e] + j
            token = token_of[p]
            row = jax.lax.dynamic_slice_in_dim(x, token, 1)
            y = _expert_mlp(row, expert_gate_up, expert_down, activation) * weight_of[p]
            # A read-modify-write rather than a scatter-add: a scatter would stop XLA:CPU from compiling
            # the loop into one fused function, which was slower here.
            return jax.lax.dynamic_update_slice_in_dim(out, jax.lax.dynamic_slice_in_dim(out, token, 1) + y, token, 0)

        return jax.lax.fori_loop(0, group_sizes[e], assignment, out)

    return jax.lax.fori_loop(0, num_used, expert, jnp.zeros((t, x.shape[-1]), jnp.float32))


def _experts_take(x, ids, weights, gate_up, down, activation="silu"):
    # One row per assignment against its own copy of its expert's weights (packed weights are taken packed
    # and dequantised per assignment by _expert_mlp): a gather, two batched matrix-vector products and the
    # combine, whatever the routing.
    t, k = ids.shape
    flat = ids.reshape(-1)
    rows = jnp.repeat(x, k, axis=0)[:, None, :]  # token-major, like ids.reshape(-1)
    per_assignment = jax.vmap(lambda r, gu, d: _expert_mlp(r, gu, d, activation))
    out = per_assignment(rows, gate_up[flat], down[flat])  # [T*k, 1, H]
    return _combine(out.reshape(t * k, -1), weights)


def _experts_masked(x, ids, weights, gate_up, down, activation="silu"):
    # Every expert on every token ([E, T, H]); a token's unchosen experts get weight 0 in the combine.
    t, k = ids.shape
    num_experts = gate_up.shape[0]
    per_expert = jax.vmap(lambda gu, d: _expert_mlp(x, gu, d, activation))(gate_up, down)
    dense_weights = jnp.zeros((t, num_experts), jnp.float32).at[jnp.arange(t)[:, None], ids].add(weights.astype(jnp.float32))
    return jnp.einsum("eth,te->th", per_expert, dense_weights)


def _zero_that_keeps_loop_unfused(i: jax.Array) -> jax.Array:
    """0, computed with a sort. XLA:CPU compiles a while loop free of sorts, scatters and custom calls into
    one single-threaded function (its "small call" hoisting), which left a core idle through the whole
    expert loop; a loop containing this runs op by op, so each expert's weight copy is split across cores
    (batch-1 decode step 21.3 -> 16.2 ms on the bench model). The per-assignment loop inside stays fused.
    """
    return jnp.sort(jnp.stack([i, i]))[0] - i


def _sort_by_expert(ids: jax.Array, num_experts: int):
    """Stable sort of the flattened assignments by expert: (order, group_sizes)."""
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    return order, group_sizes


def _experts_sorted(x, ids, weights, gate_up, down, activation="silu"):
    gate_up, down = as_dense(gate_up, x.dtype), as_dense(down, x.dtype)  # ragged_dot takes dense operands
    t, k = ids.shape
    order, group_sizes = _sort_by_expert(ids, gate_up.shape[0])
    token_of = order // k
    xs = x[token_of]
    h = jax.lax.ragged_dot(xs, jnp.swapaxes(gate_up, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    act = _swiglu(h, activation).astype(x.dtype)
    out = jax.lax.ragged_dot(act, jnp.swapaxes(down, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros((t, x.shape[-1]), jnp.float32).at[token_of].add(out)


def _tile_layout(group: jax.Array, num_groups: int, m: int):
    """Place each assignment in a row of a tiled buffer where every m-row tile belongs to one group.

    group [T, k] names each assignment's group (an expert, or a sentinel for another device's experts).
    Group g's assignments (in stable sorted order) fill ceil(size_g / m) consecutive tiles starting at
    row m * (tiles of groups < g); the rest of its last tile is padding. All shapes are static: the tile
    count is the worst case over routings, num_tiles = floor((A + min(G, A) * (m - 1)) / m), since each
    non-empty group adds at most m - 1 padded rows.

    Returns (row_of [A]: the buffer row of each assignment in token-major order,
             row_token [num_tiles * m]: the token in each buffer row, T for padding rows,
             tile_group [num_tiles]: the group owning each tile (G past the used tiles),
             tile_ends [G]: one past each group's last tile).
    """
    t, k = group.shape
    a = t * k
    num_tiles = (a + min(num_groups, a) * (m - 1)) // m
    order, group_sizes = _sort_by_expert(group, num_groups)
    group_starts = jnp.cumsum(group_sizes) - group_sizes  # first sorted position of each group
    group_tiles = (group_sizes + m - 1) // m
    tile_ends = jnp.cumsum(group_tiles)
    tile_starts = tile_ends - group_tiles

    sorted_group = group.reshape(-1)[order]
    rank = jnp.arange(a, dtype=jnp.int32) - group_starts[sorted_group]  # position within its group
    row_of = jnp.zeros(a, jnp.int32).at[order].set(tile_starts[sorted_group] * m + rank)
    row_token = jnp.full(num_tiles * m, t, jnp.int32).at[row_of].set(jnp.arange(a, dtype=jnp.int32) // k)
    tile_group = jnp.searchsorted(tile_ends, jnp.arange(num_tiles, dtype=jnp.int32), side="right")
    return row_of, row_token, tile_group.astype(jnp.int32), tile_ends


def experts_in_range(x, ids, weights, gate_up, down, first_expert, m: int | None = None, activation: str = "silu"):
    """The `tiled` grouped matmul over the experts [first_expert, first_expert + E) that gate_up/down
    hold; assignments to other experts contribute 0. float32 [T, H].

    This is an expert-parallel device's local work (workers/models/moe_parallel.py) and, with
    first_expert 0, the whole `tiled` path. Assignments of other experts go to a trailing sentinel group
    whose tiles never run (a data-dependent cond), so the cost follows the local assignments only.
    """
    t, h = x.shape
    num_experts = gate_up.shape[0]
    m = m or tile_rows(ids.size, num_experts)
    local = ids - first_expert
    mine = (local >= 0) & (local < num_experts)
    row_of, row_token, tile_expert, tile_ends = _tile_layout(jnp.where(mine, local, num_experts), num_experts + 1, m)
    used_tiles = tile_ends[num_experts - 1]  # the sentinel's tiles come after every local expert's
    tile_expert = jnp.minimum(tile_expert, num_experts - 1)
    # Padding rows read an appended zero row; silu(0) * 0 = 0 keeps them zero through the MLP.
    tiles = jnp.concatenate([x, jnp.zeros((1, h), x.dtype)])[row_token].reshape(-1, m, h)

    def tile(args):
        index, rows, expert = args
        return jax.lax.cond(
            index < used_tiles,
            lambda: _expert_mlp(rows, gate_up[expert], down[expert], activation),
            lambda: jnp.zeros_like(rows, jnp.float32),  # zeros_like keeps shard_map's varying-axes type
        )

    # A sequential loop beat one batched matmul over per-tile gathered weights ~2x on XLA:CPU: it slices
    # each expert in place instead of copying num_tiles expert matrices.
    out = jax.lax.map(tile, (jnp.arange(tiles.shape[0]), tiles, tile_expert))
    return _combine(out.reshape(-1, h)[row_of], jnp.where(mine, weights.astype(jnp.float32), 0.0))


def _experts_tiled(x, ids, weights, gate_up, down, activation="silu", m: int | None = None):
    return experts_in_range(x, ids, weights, gate_up, down, 0, m, activation)


def _experts_pallas(x, ids, weights, gate_up, down, activation="silu", interpret: bool | None = None):
    if is_quantized(gate_up):
        return _experts_pallas_quantized(x, ids, weights, gate_up, down, activation, interpret)
    t, k = ids.shape
    a = t * k
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    order, group_sizes = _sort_by_expert(ids, gate_up.shape[0])
    tm = PALLAS_TILING[0]
    # gmm needs a row count divisible by its row tile. Rows past sum(group_sizes) belong to no group and
    # are never written (uninitialised on TPU), so they are sliced off before use.
    pad = -a % tm

    def gmm(lhs, rhs):  # lhs [a, K] sorted by expert; rhs [E, N, K] ([out, in]) -> [a, N] float32
        n, kdim = rhs.shape[1:]
        tiling = (tm, min(kdim, PALLAS_TILING[1]), min(n, PALLAS_TILING[2]))
        out = megablox_gmm(
            jnp.pad(lhs, ((0, pad), (0, 0))),
            rhs,
            group_sizes,
            preferred_element_type=jnp.float32,
            tiling=tiling,
            transpose_rhs=True,
            interpret=interpret,
        )
        return out[:a]

    act = _swiglu(gmm(x[order // k], gate_up), activation).astype(x.dtype)
    out_sorted = gmm(act, down)
    unsort = jnp.argsort(order)  # sorted position of each token-major assignment
    return _combine(out_sorted[unsort], weights)


def _experts_pallas_quantized(x, ids, weights, gate_up, down, activation="silu", interpret: bool | None = None):
    """Packed experts: the `tiled` layout (each row tile owned by one expert) through the Pallas kernel of
    `kernels.quant.grouped_matmul`, which dequantises each weight block in VMEM."""
    h = x.shape[1]
    num_experts = gate_up.shape[0]
    m = tile_rows(ids.size, num_experts)
    row_of, row_token, tile_expert, tile_ends = _tile_layout(ids, num_experts, m)
    tile_expert = jnp.minimum(tile_expert, num_experts - 1)
    rows = jnp.concatenate([x, jnp.zeros((1, h), x.dtype)])[row_token]  # padding rows stay zero
    used = tile_ends[-1:]
    act = _swiglu(grouped_matmul(rows, gate_up, tile_expert, used, tm=m, interpret=interpret), activation).astype(x.dtype)
    out = grouped_matmul(act, down, tile_expert, used, tm=m, interpret=interpret)
    return _combine(out[row_of], weights)


def cpu_kernel_applies(x: jax.Array, gate_up, activation: str = "silu") -> bool:
    """The `cpu` kernel takes dense float32 SiLU experts and tokens on the CPU backend (and needs to build)."""
    dense_f32 = activation == "silu" and not is_quantized(gate_up) and gate_up.dtype == jnp.float32 and x.dtype == jnp.float32
    return dense_f32 and jax.default_backend() == "cpu" and cpu_ffi.available()


def _experts_cpu(x, ids, weights, gate_up, down, activation="silu"):
    if not cpu_kernel_applies(x, gate_up, activation):
        raise ValueError("MoE impl 'cpu' needs dense float32 SiLU experts on the CPU backend and a C++ compiler")
    return cpu_ffi.moe_experts(x, ids, weights, gate_up, down)


_IMPL_FNS = {
    "cpu": _experts_cpu,
    "gather": _experts_gather,
    "tiled": _experts_tiled,
    "pallas": _experts_pallas,
    "sorted": _experts_sorted,
    "take": _experts_take,
    "masked": _experts_masked,
}


def chosen_impl(x: jax.Array, ids: jax.Array, gate_up, activation: str = "silu") -> str:
    """The implementation `routed_experts` runs when none is named: `moe_impl`'s choice, with the
    kernels that apply to these operands swapped in."""
    num_experts, two_inter, hidden = gate_up.shape
    impl = moe_impl(ids.size, num_experts=num_experts, num_tokens=ids.shape[0], expert_weights=3 * two_inter // 2 * hidden)
    if os.environ.get(IMPL_ENV_VAR):
        return impl
    if impl == "pallas" and is_quantized(gate_up) and select_impl(gate_up.group_size) == "xla":
        return "tiled"  # groups as wide as the MXU: XLA dequantises per tile (kernels.quant.select_impl)
    if impl == "gather" and cpu_kernel_applies(x, gate_up, activation):
        return "cpu"
    return impl


def routed_experts(
    x: jax.Array,  # [T, H]
    ids: jax.Array,  # [T, k] int32 expert ids
    weights: jax.Array,  # [T, k] float32 routing weights
    gate_up: jax.Array,  # [E, 2I, H]
    down: jax.Array,  # [E, H, I]
    impl: str | None = None,
    activation: str = "silu",
) -> jax.Array:
    """Sum over k of weight * down(act(gate(x)) * up(x)) for each token's selected experts.

    `impl` is one of IMPLS; None lets `moe_impl` choose from the static shapes and the backend.
    `activation` is a key of ACTIVATIONS; where an implementation lacks it (the C++ `cpu` kernel is SiLU
    only) the automatic choice falls back to the XLA `gather` path.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}; expected one of {tuple(ACTIVATIONS)}")
    impl = impl or chosen_impl(x, ids, gate_up, activation)
    if impl not in _IMPL_FNS:
        raise ValueError(f"unknown MoE impl {impl!r}; expected one of {IMPLS}")
    return _IMPL_FNS[impl](x, ids, weights, gate_up, down, activation).astype(x.dtype)
