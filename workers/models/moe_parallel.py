"""Expert-parallel execution of a routed-expert (MoE) layer over a device mesh.

`ExpertParallel` is a drop-in for `kernels.moe.routed_experts`: same arguments (tokens, top-k ids and
weights, stacked expert weights), same result, but the experts live sharded over the mesh's EP axes
(E / ep per device) and the tokens are spread over every device. It is frozen and hashable, so a
jitted forward can take it as a static argument.

Dataflow per device (inside `jax.shard_map`), the all-gather design the TPU stacks use for decode:
  1. the routing metadata (ids and bitcast weights) is packed into one int32 array and all-gathered
     over the EP axes; the hidden states are all-gathered too (`dispatch`, see below);
  2. each device runs its local experts on the assignments routed to them (a tiled grouped matmul
     that skips the other devices' assignments);
  3. the per-token partial sums are reduce-scattered back to the devices that own the tokens.

`dispatch` picks how steps 1 and 3 cross the levels of the mesh (axes are ordered slowest first):
- "flat": one all-gather and one reduce-scatter over all EP axes.
- "hierarchical": one collective per mesh level; the reduce-scatter runs the fastest level first so
  the slow link carries rows already summed inside the fast domain, the gather mirrors it.
- "hierarchical-dispatch": the gather is split by columns: the k devices of the fast domain
  (`fast_axes`, default every EP axis below the outermost) each fetch H/k columns across the slow
  levels, then exchange them inside the domain; bitwise equal to the flat gather. The combine is the
  staged reduce-scatter. Needs hidden % (128 * k) == 0 (whole 128-lane pieces); otherwise one warning
  and the flat path.
`gather_dtype="fp8"` sends the gathered hidden states as e4m3 with a per-row float32 scale in the same
collective (works with every dispatch mode); the result is no longer exact.

For large batches (prefill), `all_to_all_min_tokens` switches to an all-to-all dispatch: each
assignment's row travels only to the device holding its expert and back (`ragged_all_to_all` on
TPU/GPU; a padded all-to-all emulation on CPU, see `kernels.collectives.ragged_all_to_all`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kernels.collectives import (
    append_words,
    axes_index,
    collectives_over_gloo,
    fp8_decode_rows,
    fp8_encode_rows,
    gather_rows,
    gather_rows_split_columns,
    gather_rows_staged,
    pack_routing,
    place_host,
    ragged_all_to_all,
    reduce_scatter_rows,
    reduce_scatter_rows_staged,
    split_words,
    unpack_routing,
    warn_once,
)
from kernels.moe import experts_in_range, routed_experts, tile_rows

DISPATCH_MODES = ("flat", "hierarchical", "hierarchical-dispatch")
GATHER_DTYPES = ("model", "fp8")
LANES = 128  # a column piece of the hierarchical dispatch must be whole 128-lane tiles

Array = jax.Array


@dataclass(frozen=True)
class ExpertParallel:
    mesh: Mesh
    ep_axes: tuple[str, ...]  # experts are sharded over these mesh axes (mesh order, slowest first)
    dispatch: str = "flat"
    gather_dtype: str = "model"
    fast_axes: tuple[str, ...] | None = None  # the hierarchical dispatch's fast domain
    all_to_all_min_tokens: int | None = None  # None: always the all-gather dispatch

    def __post_init__(self):
        names = tuple(self.mesh.axis_names)
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"unknown MoE dispatch {self.dispatch!r}; expected one of {DISPATCH_MODES}")
        if self.gather_dtype not in GATHER_DTYPES:
            raise ValueError(f"unknown MoE gather dtype {self.gather_dtype!r}; expected one of {GATHER_DTYPES}")
        if not set(self.ep_axes) <= set(names) or tuple(a for a in names if a in self.ep_axes) != self.ep_axes:
            raise ValueError(f"EP axes {self.ep_axes} must be mesh axes {names}, in mesh order")
        if self.fast_axes is not None and self.ep_axes[len(self.ep_axes) - len(self.fast_axes) :] != self.fast_axes:
            raise ValueError(f"fast axes {self.fast_axes} must be the innermost EP axes of {self.ep_axes}")

    # ---------------------------------------------------------------- static facts

    @property
    def ep_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.ep_axes)

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Inside the MoE, tokens are split over every device (replicas of a token only slice)."""
        return tuple(self.mesh.axis_names)

    @property
    def domain_axes(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(slow, fast) EP axes of the hierarchical dispatch."""
        fast = self.ep_axes[1:] if self.fast_axes is None else self.fast_axes
        return self.ep_axes[: len(self.ep_axes) - len(fast)], fast

    def dispatch_for(self, hidden: int) -> str:
        """The dispatch actually used for this hidden size (the hierarchical dispatch may fall back)."""
        if self.dispatch != "hierarchical-dispatch":
            return self.dispatch
        slow, fast = self.domain_axes
        k = math.prod(self.mesh.shape[a] for a in fast)
        if k == 1 or math.prod(self.mesh.shape[a] for a in slow) == 1:
            return "flat"  # one device per domain, or a single domain: no slow link to spare
        if hidden % (LANES * k):
            warn_once(
                f"hierarchical-dispatch:{hidden}:{k}",
                "hierarchical dispatch needs hidden %% (128 * %d) == 0 but hidden is %d: using the flat path",
                k,
                hidden,
            )
            return "flat"
        return self.dispatch

    def uses_all_to_all(self, num_tokens: int) -> bool:
        return self.all_to_all_min_tokens is not None and num_tokens >= self.all_to_all_min_tokens

    # ---------------------------------------------------------------- entry points

    def __call__(self, x: Array, ids: Array, weights: Array, gate_up, down, activation: str = "silu") -> Array:
        """`routed_experts` over the mesh: x [T, H], ids/weights [T, k] (any sharding) -> [T, H]."""
        t = x.shape[0]
        pad = -t % self.mesh.size  # every device gets the same number of rows
        if pad:
            x, ids, weights = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, ids, weights))
        tokens, experts = PartitionSpec(self.token_axes), PartitionSpec(self.ep_axes)
        fn = jax.shard_map(
            partial(self.local, activation=activation),
            mesh=self.mesh,
            in_specs=(tokens, tokens, tokens, experts, experts),
            out_specs=tokens,
        )
        return fn(x, ids, weights, gate_up, down)[:t]

    def local(self, x: Array, ids: Array, weights: Array, gate_up, down, activation: str = "silu") -> Array:
        """The per-device body (call inside shard_map): this device's tokens and experts -> its output."""
        if self.ep_size == 1:
            return routed_experts(x, ids, weights, gate_up, down, activation=activation)
        first_expert = axes_index(self.ep_axes) * gate_up.shape[0]
        if self.uses_all_to_all(x.shape[0] * self.mesh.size):
            return self._all_to_all_moe(x, ids, weights, gate_up, down, first_expert, activation)
        mode = self.dispatch_for(x.shape[1])
        if mode == "hierarchical-dispatch":
            all_ids, all_weights = self.gather_routing(ids, weights, mode)
            if collectives_over_gloo():  # the rows' gather after the routing's (`gather_rows_and_routing`)
                x = jnp.where(all_ids[0, 0] == jnp.iinfo(jnp.int32).min, jnp.zeros_like(x), x)  # never: ids >= 0
            rows = self.gather_tokens(x, mode)
        else:
            rows, all_ids, all_weights = self.gather_rows_and_routing(x, ids, weights, mode)
        m = tile_rows(all_ids.size // self.ep_size, gate_up.shape[0])
        y = experts_in_range(rows, all_ids, all_weights, gate_up, down, first_expert, m, activation)
        return self.combine(y.astype(x.dtype), mode)

    # ---------------------------------------------------------------- dispatch and combine

    def gather_rows_and_routing(self, x: Array, ids: Array, weights: Array, mode: str) -> tuple[Array, Array, Array]:
        """Every EP device's hidden states and routing in one all-gather (per mesh level): the routing ints
        ride as extra columns of the rows. Two gathers over the same devices would be independent in the
        program, and XLA:CPU runs independent collectives in any order and overlapped: over gloo (one tag
        for every collective) two processes then matched each other's messages and hung."""
        fp8 = self.gather_dtype == "fp8"
        payload = fp8_encode_rows(x).reshape(x.shape[0], -1) if fp8 else x
        gather = gather_rows_staged if mode == "hierarchical" else gather_rows
        rows, routing = split_words(gather(append_words(payload, pack_routing(ids, weights)), self.ep_axes), payload.shape[1])
        all_ids, all_weights = unpack_routing(routing)
        return (fp8_decode_rows(rows[:, None], x.dtype) if fp8 else rows), all_ids, all_weights

    def gather_routing(self, ids: Array, weights: Array, mode: str) -> tuple[Array, Array]:
        """Every EP device's top-k ids and weights, packed into one int32 all-gather. The rows are
        too narrow to split by columns, so the hierarchical modes gather them level by level (the slow
        link then carries each row once per fast domain, like the hidden states)."""
        gather = gather_rows if mode == "flat" else gather_rows_staged
        return unpack_routing(gather(pack_routing(ids, weights), self.ep_axes))

    def gather_tokens(self, x: Array, mode: str) -> Array:
        """[n, H] -> [ep * n, H]: every EP device's rows, in device order, in x's dtype."""
        fp8 = self.gather_dtype == "fp8"
        if mode == "hierarchical-dispatch":
            slow, fast = self.domain_axes
            k = math.prod(self.mesh.shape[a] for a in fast)
            pieces = fp8_encode_rows(x, k) if fp8 else x.reshape(x.shape[0], k, -1)
            out = gather_rows_split_columns(pieces, slow, fast)
            return fp8_decode_rows(out, x.dtype) if fp8 else out.reshape(out.shape[0], -1)
        gather = gather_rows_staged if mode == "hierarchical" else gather_rows
        if fp8:
            return fp8_decode_rows(gather(fp8_encode_rows(x), self.ep_axes), x.dtype)
        return gather(x, self.ep_axes)

    def combine(self, y: Array, mode: str) -> Array:
        """[ep * n, H] partial sums -> [n, H] summed over the EP devices."""
        if mode == "flat":
            return reduce_scatter_rows(y, self.ep_axes)
        return reduce_scatter_rows_staged(y, self.ep_axes)

    # ---------------------------------------------------------------- all-to-all dispatch

    def _all_to_all_moe(self, x, ids, weights, gate_up, down, first_expert, activation="silu"):
        """Each assignment's row goes to the device of its expert and its output comes back.

        counts[s, d] = assignments device s sends to device d (all-gathered: a few ints). A slice's
        place in its receiver's buffer follows the slices of lower-ranked senders, and on the way back
        the roles swap. The receive buffer holds the worst case: every assignment of every device.
        """
        n, k = ids.shape
        e_local, ep = gate_up.shape[0], self.ep_size
        me = axes_index(self.ep_axes)
        dest = ids.reshape(-1) // e_local
        order = jnp.argsort(dest, stable=True).astype(jnp.int32)
        send = jnp.bincount(dest, length=ep).astype(jnp.int32)
        counts = gather_rows(send[None], self.ep_axes)  # [src, dst]
        sender_offsets = jnp.cumsum(counts, axis=1) - counts  # where a slice starts in its sender
        receiver_offsets = jnp.cumsum(counts, axis=0) - counts  # where it lands in its receiver
        there = (sender_offsets[me], counts[me], receiver_offsets[me], counts[:, me])
        back = (receiver_offsets[:, me], counts[:, me], sender_offsets[:, me], counts[me])

        capacity = ep * n * k
        h = x.shape[1]

        def exchange(operand, output, offsets):
            return ragged_all_to_all(operand, output, *offsets, self.ep_axes)

        # Rows and their expert ids in one exchange (`gather_rows_and_routing` says why); -1: an empty row.
        empty = append_words(jnp.zeros((capacity, h), x.dtype), jnp.full((capacity, 1), -1, jnp.int32))
        recv_rows, recv_ids = split_words(exchange(append_words(x[order // k], ids.reshape(-1, 1)[order]), empty, there), h)
        ones = jnp.ones((capacity, 1), jnp.float32)
        m = tile_rows(n * k, e_local)
        y = experts_in_range(recv_rows, recv_ids, ones, gate_up, down, first_expert, m, activation).astype(x.dtype)
        returned = exchange(y, jnp.zeros((n * k, h), x.dtype), back)  # in destination order
        per_assignment = jnp.zeros_like(returned).at[order].set(returned)
        return jnp.einsum("tkh,tk->th", per_assignment.reshape(n, k, -1).astype(jnp.float32), weights).astype(x.dtype)


def moe_blocks(weights) -> list:
    """The MoE layers' expert blocks (layers.MoEWeights, gemma4.Gemma4Experts), in layer order."""
    blocks = [getattr(lw, "experts", None) or getattr(lw, "mlp", None) for lw in weights.layers]
    return [b for b in blocks if getattr(b, "router", None) is not None]


def place_experts(block, rows, log2phy, logcnt, mesh: Mesh, width: int | None = None) -> None:
    """Sets one MoE layer's expert slots: new slot r takes the expert in the block's current row rows[r]
    (a device gather keeping the experts' sharding; packed experts move with their scales), and installs the
    replica maps (log2phy [E, max replicas], -1 padding read as slot 0 and never chosen; zero-padded to
    `width` columns so that later placements keep the step programs' shapes)."""
    move_experts([block], np.asarray(rows)[None], np.asarray(log2phy)[None], np.asarray(logcnt)[None], mesh, width)


def move_experts(blocks: list, rows: np.ndarray, log2phy: np.ndarray, logcnt: np.ndarray, mesh: Mesh, width: int | None = None) -> None:
    """`place_experts` for several MoE layers at once (rows [L, R], log2phy [L, E, k], logcnt [L, E]):
    `copy_experts` then `install_experts`, at once (the copies run on the device ahead of the next step)."""
    install_experts(blocks, copy_experts(blocks, rows, mesh), log2phy, logcnt, mesh, width)


def copy_experts(blocks: list, rows: np.ndarray, mesh: Mesh, part: int | None = None) -> list[jax.Array]:
    """Dispatches the copy of the blocks' experts into new slots (new slot r of layer l <- current slot
    rows[l, r]) as one program per expert part (`num_expert_parts`), into new arrays, and returns them
    without waiting (`install_experts` puts them in place). Nothing is donated: steps keep reading the current slots while the copy runs, at the
    cost of the moved layers' experts twice over until it is installed (`ExpertBalancer` moves `layers_per_move` layers
    at a time). A row that stays on its EP rank is copied there; a moved row crosses once, to the one rank
    that needs it (`slot_moves`), where a gather of the sharded array would send every rank's experts to
    every rank (a random permutation of 24 slots over 2x4 CPU devices: 230 -> 140 ms).

    `part`: only that one of each block's expert arrays (`num_expert_parts`; gate_up, down, and a packed
    weight's scales), one array per block: smaller programs, each beside fewer steps."""
    experts = _ExpertLeaves(blocks, mesh)
    return experts.copy(*slot_moves(np.asarray(rows), experts.num_slots, experts.ep), part)


def num_expert_parts(block) -> int:
    """How many arrays hold one MoE block's experts (gate_up and down, and their scales when packed)."""
    return len(jax.tree.leaves((block.gate_up, block.down)))


def install_experts(
    blocks: list, leaves: list[jax.Array], log2phy: np.ndarray, logcnt: np.ndarray, mesh: Mesh, width: int | None = None
) -> None:
    """Puts `copy_experts`' arrays in the blocks and installs the replica maps (log2phy [L, E, k], -1 padding
    read as slot 0 and never chosen; zero-padded to `width` columns so that later placements keep the step
    programs' shapes). The next step launched reads them (waiting for the copy if it is still running)."""
    _ExpertLeaves(blocks, mesh).install(leaves)
    maps = np.maximum(np.asarray(log2phy), 0)
    if width is not None:
        maps = np.pad(maps[:, :, :width], ((0, 0), (0, 0), (0, width - min(width, maps.shape[2]))))
    replicated = NamedSharding(mesh, PartitionSpec())
    maps = place_host(np.asarray(maps, np.int32), replicated)
    counts = place_host(np.asarray(logcnt, np.int32), replicated)
    for i, block in enumerate(blocks):
        block.log2phy, block.logcnt = maps[i], counts[i]


def compile_expert_moves(blocks: list, mesh: Mesh) -> None:
    """Compiles the copy program of each part (`copy_experts`) for the blocks (a group of layers moved
    together) for every exchange width a placement can need (each run once as a no-op: every slot keeps its
    expert), so that a rebalance while serving never waits for a compilation."""
    experts = _ExpertLeaves(blocks, mesh)
    per_rank = experts.num_slots // experts.ep
    keep = np.tile(np.arange(experts.num_slots) % per_rank, (len(blocks), 1)).astype(np.int32)
    most = 1 << max(per_rank - 1, 0).bit_length() if experts.ep > 1 else 0
    for part in range(experts.per_block):
        for width in [0] + [1 << i for i in range(most.bit_length())]:
            experts.copy(keep, np.zeros((len(blocks), experts.ep * (experts.ep - 1) * width), np.int32), part)


class _ExpertLeaves:
    """The MoE blocks' expert leaves as the move program sees them: split over the EP ranks along axis 0."""

    def __init__(self, blocks: list, mesh: Mesh):
        self.blocks, self.mesh = blocks, mesh
        pairs = [(block.gate_up, block.down) for block in blocks]
        self.flat, self.tree = jax.tree.flatten(pairs)
        self.layer_of = tuple(i for i, pair in enumerate(pairs) for _ in jax.tree.leaves(pair))
        self.per_block = num_expert_parts(blocks[0])  # the same layout in every block
        self.specs = tuple(getattr(leaf.sharding, "spec", PartitionSpec()) for leaf in self.flat)
        self.ep_axis = self.specs[0][0] if len(self.specs[0]) else None
        if any((spec[0] if len(spec) else None) != self.ep_axis for spec in self.specs):
            raise ValueError(f"expert leaves are split over different mesh axes along their slots: {self.specs}")
        axes = (self.ep_axis,) if isinstance(self.ep_axis, str) else tuple(self.ep_axis or ())
        self.ep = math.prod(mesh.shape[a] for a in axes)
        self.num_slots = self.flat[0].shape[0]

    def copy(self, local: np.ndarray, sends: np.ndarray, part: int | None = None) -> list[jax.Array]:
        """The new arrays: all of them, or `part` of each block's (leaf `part` of its (gate_up, down)). One
        program per part: its arrays, one per block, have one shape and are exchanged together."""
        if part is None:
            by_part = [self.copy(local, sends, p) for p in range(self.per_block)]
            return [by_part[i % self.per_block][i // self.per_block] for i in range(len(self.flat))]
        program, args = self.program(local, sends, part)
        return program(*args)

    def program(self, local: np.ndarray, sends: np.ndarray, part: int):
        """The copy program of `part` and its arguments."""
        chosen = range(part, len(self.flat), self.per_block)
        flat = [self.flat[i] for i in chosen]
        if len({(leaf.shape, leaf.dtype) for leaf in flat}) > 1:
            raise ValueError(f"expert part {part} differs between the MoE layers moved together: {[leaf.shape for leaf in flat]}")
        specs, layer_of = tuple(self.specs[i] for i in chosen), tuple(self.layer_of[i] for i in chosen)
        width = sends.shape[1] // max(self.ep * (self.ep - 1), 1)
        program = _move_slots(self.mesh, specs, self.ep_axis, layer_of, self.ep, width)
        by_rank = NamedSharding(self.mesh, PartitionSpec(None, self.ep_axis))
        return program, (flat, place_host(local, by_rank), place_host(sends, by_rank))

    def install(self, leaves: list[jax.Array]) -> None:
        for block, (gate_up, down) in zip(self.blocks, jax.tree.unflatten(self.tree, leaves)):
            block.gate_up, block.down = gate_up, down


def slot_moves(rows: np.ndarray, num_sources: int, ep: int) -> tuple[np.ndarray, np.ndarray]:
    """Plans `new slot r <- current slot rows[l, r]` per EP rank: new slot r lives on rank r // (R / ep),
    current slot s on rank s // S (S = num_sources / ep; the loaded weights have fewer slots than a placement).
    A row moving from rank q to rank d travels in the exchange with shift k = (d - q) mod ep (every rank sends
    to the rank k after it), in up to W rows per exchange: W the most any rank sends in one exchange in any
    layer, rounded up to a power of two (a few program shapes serve every placement). Returns `local` [L, R]:
    where each new slot reads in its rank's pool = its S current slots, then the W rows received in the
    exchange with shift 1, 2, ..., ep-1; and `sends` [L, ep*(ep-1)*W]: each rank's (ep-1)*W local rows to
    send (padded with row 0)."""
    layers, slots = rows.shape
    per_rank, new_per_rank = num_sources // ep, slots // ep
    sent: dict[tuple[int, int, int], dict[int, int]] = {}  # (layer, sender, shift) -> {source slot: position}
    moves = []
    local = np.empty((layers, slots), np.int32)
    for layer in range(layers):
        for r, src in enumerate(rows[layer]):
            src, q, d = int(src), int(src) // per_rank, r // new_per_rank
            if q == d:
                local[layer, r] = src % per_rank
                continue
            shift = (d - q) % ep
            rows_sent = sent.setdefault((layer, q, shift), {})
            moves.append((layer, r, shift, rows_sent.setdefault(src, len(rows_sent))))
    most = max((len(v) for v in sent.values()), default=0)
    width = 0 if most == 0 else 1 << (most - 1).bit_length()
    for layer, r, shift, k in moves:
        local[layer, r] = per_rank + (shift - 1) * width + k
    sends = np.zeros((layers, ep, max(ep - 1, 0) * width), np.int32)
    for (layer, q, shift), rows_sent in sent.items():
        for src, k in rows_sent.items():
            sends[layer, q, (shift - 1) * width + k] = src % per_rank
    return local, sends.reshape(layers, -1)


@lru_cache(maxsize=32)
def _move_slots(mesh: Mesh, specs: tuple, ep_axis, layer_of: tuple[int, ...], ep: int, width: int):
    """The per-device copy: the rows bound for each other rank (W per rank, in `slot_moves`' shift order), of
    every array at once, in one `all_to_all` (each moved row crosses once, to where it is needed), then every
    new slot taken from this rank's own slots or from what it received.

    One collective per program, on purpose: XLA:CPU starts a program's independent collectives in any order
    and lets them overlap, and over gloo two processes that enter them in different orders wait on each other
    for ever (a multi-host replica hung at start-up with one `ppermute` per shift, seen in CI). The arrays of
    one program are one part of each block (`_ExpertLeaves.copy`), so they stack."""

    def body(flat, local, sends):
        if not width:
            return [jnp.take(leaf, local[layer], axis=0) for leaf, layer in zip(flat, layer_of)]
        q = jax.lax.axis_index(ep_axis)
        shifts = jnp.arange(ep)
        # Rows for rank d go out in chunk d: the shift (d - q) mod ep's W rows; chunk q (no shift) is W
        # copies of row 0, not read.
        to_rank = (shifts - q) % ep
        outgoing = []
        for leaf, layer in zip(flat, layer_of):
            by_shift = jnp.concatenate([jnp.zeros((width,), jnp.int32), sends[layer]]).reshape(ep, width)
            outgoing.append(jnp.take(leaf, by_shift[to_rank].reshape(-1), axis=0))
        received = jax.lax.all_to_all(jnp.stack(outgoing), ep_axis, 1, 1, tiled=True)  # chunk j: from rank j
        from_rank = (q - shifts[1:]) % ep  # shift k's rows came from rank q - k
        out = []
        for leaf, layer, got in zip(flat, layer_of, received):
            by_shift = got.reshape(ep, width, *got.shape[1:])[from_rank].reshape(-1, *got.shape[1:])
            out.append(jnp.take(jnp.concatenate([leaf, by_shift]), local[layer], axis=0))
        return out

    by_rank = PartitionSpec(None, ep_axis)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(list(specs), by_rank, by_rank), out_specs=list(specs), check_vma=False)
    return jax.jit(mapped)


def apply_placement(weights, placement, mesh: Mesh):
    """The model's weights with redundant experts: every MoE layer's experts (loaded in logical order)
    rearranged into the placement's physical slots (`eplb.Placement`, one row per MoE layer in layer order;
    slot r lives on EP rank r // (R / ep)). The slots keep the experts' sharding, so R must divide over the EP
    ranks."""
    blocks = moe_blocks(weights)
    if len(blocks) != placement.phy2log.shape[0]:
        raise ValueError(f"the placement has {placement.phy2log.shape[0]} MoE layers, the model {len(blocks)}")
    for block, phy2log, log2phy, logcnt in zip(blocks, placement.phy2log, placement.log2phy, placement.logcnt):
        place_experts(block, phy2log, log2phy, logcnt, mesh)
    return weights
