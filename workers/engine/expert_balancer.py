"""Expert load balancing while serving (`EngineConfig.eplb`): redundant expert slots, re-placed from the
loads the engine counts.

The model is loaded with `num_redundant_experts` extra physical slots per MoE layer (R = E + spare, split
over the EP ranks like the experts), so the step programs' shapes never change after start-up. Every
`period_steps` steps (or on `EngineCore.rebalance_experts()`), the logical loads routed since the last
rebalance go to `eplb.rebalance_experts` on a background thread (which also waits for the counts' copy
from the device: the engine thread never does). Then the move, `layers_per_move` MoE layers at a time: a
group's experts are copied into new arrays in their new slots one part at a time (gate_up, then down, and a
packed weight's scales: `moe_parallel.copy_experts`, one program per part, compiled when the balancer
starts; a step launched while one runs shares the devices with it, so a smaller program costs it less)
while steps keep running on the current ones. At each step boundary where the part's copy is done the next
part's starts; after the last, the group's arrays and replica maps are swapped in together (a reference
swap: the next step reads them) and the next group's copy starts. A step in flight keeps the
arrays it was launched with, and a replicated expert computes the same numbers in any slot: streams are
unchanged by a rebalance, and no step waits for a copy.

An engine over several hosts runs the same balancer on every host, fed the same calls (the period counts
the replayed steps, a manual trigger is a replicated call, the loads are replicated on every host): each
host computes the same placement and starts and swaps every group at the same steps, counted from the
request (`SWAP_AFTER_STEPS`, and `MOVE_STEPS` per part; a swap whose computation or copy is late waits
for it there),
never at "whenever it is ready", which would differ between hosts and desynchronise their collectives.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging

import jax
import numpy as np

from workers.models import LoadedModel
from workers.models.eplb import Placement, rebalance_experts
from workers.models.moe_parallel import compile_expert_moves, copy_experts, install_experts, moe_blocks, num_expert_parts

from .config import EplbConfig

log = logging.getLogger("moray.engine")

# Multi-host: the step after whose end a requested placement's first copy starts, counted from the request
# (a placement takes milliseconds for hundreds of experts; the wait there is the rare late one), and the
# steps between starting a part's copy and the next part's (or, after the last part, the swap).
SWAP_AFTER_STEPS = 4
MOVE_STEPS = 2


@dataclasses.dataclass
class _Move:
    """A rebalance under way: the placement, where each new slot's expert comes from, the groups of MoE
    layers still to copy, and the group being copied (its new arrays part by part, the last part's still
    being copied, and the step at which a multi-host engine moves on)."""

    placement: Placement
    rows: np.ndarray  # [L, R] source slot of each new slot
    groups: list[list[int]]
    layers: list[int] = dataclasses.field(default_factory=list)
    parts: list[list[jax.Array]] = dataclasses.field(default_factory=list)  # per part copied so far: one per layer
    swap_at: int = 0

    def copied(self) -> bool:
        return all(leaf.is_ready() for leaf in self.parts[-1])

    @property
    def leaves(self) -> list[jax.Array]:
        """The group's new arrays in the blocks' order (each layer's parts together), as `install_experts`
        takes them."""
        return [part[i] for i in range(len(self.layers)) for part in self.parts]


class ExpertBalancer:
    def __init__(self, model: LoadedModel, config: EplbConfig):
        cfg = model.cfg
        if not any(cfg.moe_layers):
            raise ValueError("eplb: the model has no MoE layers")
        experts = model.experts
        self.ep_size = getattr(experts, "ep_size", 1)
        self.num_slots = cfg.num_experts + config.num_redundant_experts
        if self.num_slots % self.ep_size:
            raise ValueError(
                f"eplb: {cfg.num_experts} experts + {config.num_redundant_experts} redundant slots must split evenly "
                f"over the {self.ep_size} expert-parallel ranks"
            )
        self.model, self.config = model, config
        self.num_layers = sum(cfg.moe_layers)
        self.num_experts = cfg.num_experts
        self.max_replicas = 1 + config.num_redundant_experts  # the replica map's fixed width
        # Groups stay whole on a node (the first EP axis when the experts span several; else one node).
        ep_axes = getattr(experts, "ep_axes", ())
        self.num_nodes = model.mesh.shape[ep_axes[0]] if len(ep_axes) > 1 else 1
        self.num_groups = cfg.num_expert_groups
        self.num_rebalances = 0
        self._steps = 0
        self._base: np.ndarray | None = None  # physical counts when the current window started
        self._pending: concurrent.futures.Future | None = None
        self._swap_at: int | None = None  # multi-host: the step count at which the pending one starts moving
        self._move: _Move | None = None
        self.lockstep = jax.process_count() > 1
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moray-eplb")
        # Start-up: every expert once, the spare slots to the first experts (no loads yet); loaded weights
        # are in logical order, so the identity map is the current placement.
        identity = np.tile(np.arange(self.num_experts), (self.num_layers, 1))
        self.placement = Placement(identity, identity[:, :, None], np.ones_like(identity))
        self.num_parts = num_expert_parts(moe_blocks(model.weights)[0])
        self._start(self._place(np.ones((self.num_layers, self.num_experts))))
        self.wait()
        self.num_rebalances = 0  # the start-up placement is no rebalance
        blocks = moe_blocks(model.weights)
        for size in {len(group) for group in self._groups()}:
            compile_expert_moves(blocks[:size], model.mesh)

    @property
    def moving(self) -> bool:
        """Whether a rebalance is under way (its placement being computed or its experts being moved)."""
        return self._pending is not None or self._move is not None

    # ---------------------------------------------------------------- in the engine thread

    def on_step(self, device_counts) -> None:
        """At a step boundary: swap in a group whose copy is done and start the next; start moving a placement
        that is ready; start computing one every `period_steps` (`device_counts()`: the counts on the device)."""
        self._steps += 1
        if self._move is not None:
            self._advance(self._move)
        elif self._pending is not None and (self._steps >= self._swap_at if self.lockstep else self._pending.done()):
            placement, self._pending = self._pending.result(), None
            self._start(placement)
        period = self.config.period_steps
        if period and self._steps % period == 0 and not self.moving:
            self.request(device_counts())

    def request(self, physical) -> bool:
        """Starts computing a placement from the loads since the last one (on the background thread, which
        also waits for `physical`, the counts per physical slot, host or device array); False when a rebalance
        is already under way or nothing was counted yet."""
        if self.moving or physical is None:
            return False
        if isinstance(physical, jax.Array) and physical.is_fully_addressable:
            physical.copy_to_host_async()
        self._pending = self._pool.submit(self._place_window, physical)
        self._swap_at = self._steps + SWAP_AFTER_STEPS
        return True

    def wait(self) -> None:
        """Completes the rebalance under way, if any (manual trigger, tests): its placement, then every group's
        copy swapped in at once (the next step waits for the copies)."""
        if self._pending is not None:
            placement, self._pending = self._pending.result(), None
            self._start(placement)
        while self._move is not None:
            self._next(self._move)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- placement

    def logical_loads(self, physical: np.ndarray) -> np.ndarray:
        """Counts per physical slot [L, R] -> per logical expert [L, E] (the replicas summed)."""
        out = np.zeros((self.num_layers, self.num_experts))
        for layer in range(self.num_layers):
            np.add.at(out[layer], self.placement.phy2log[layer], physical[layer])
        return out

    def _place_window(self, physical) -> Placement:
        """On the background thread: the placement for the loads counted since the last request."""
        physical = np.asarray(physical).astype(np.int64)
        window = physical if self._base is None else physical - self._base
        self._base = physical
        return self._place(self.logical_loads(window))

    def _place(self, loads: np.ndarray) -> Placement:
        groups = self.num_groups if self.num_groups % self.num_nodes == 0 else 1
        return rebalance_experts(loads, self.num_slots, groups, self.num_nodes, self.ep_size)

    # ---------------------------------------------------------------- the move

    def _groups(self) -> list[list[int]]:
        size = self.config.layers_per_move
        return [list(range(i, min(i + size, self.num_layers))) for i in range(0, self.num_layers, size)]

    def _start(self, placement: Placement) -> None:
        move = _Move(placement, source_slots(self.placement, placement, self.ep_size), self._groups())
        self._move = move
        self._copy_next(move)

    def _copy_next(self, move: _Move) -> None:
        """Dispatches the copy of the next part of the group (of the next group after the last part); it runs
        on the device beside the steps."""
        if not move.parts or len(move.parts) == self.num_parts:
            move.layers, move.parts = move.groups.pop(0), []
        blocks = moe_blocks(self.model.weights)
        layers = move.layers
        move.parts.append(copy_experts([blocks[i] for i in layers], move.rows[layers], self.model.mesh, len(move.parts)))
        move.swap_at = self._steps + MOVE_STEPS

    def _advance(self, move: _Move) -> None:
        if self._steps >= move.swap_at if self.lockstep else move.copied():
            self._next(move)

    def _next(self, move: _Move) -> None:
        """The part being copied is done: the next part's copy starts, or (after the last) the group is swapped in."""
        if len(move.parts) < self.num_parts:
            self._copy_next(move)
        else:
            self._swap_group(move)

    def _swap_group(self, move: _Move) -> None:
        """Puts the group just copied in place, with its replica maps; starts the next group's copy, or ends
        the move."""
        layers, new = move.layers, move.placement
        blocks = moe_blocks(self.model.weights)
        install_experts(
            [blocks[i] for i in layers], move.leaves, new.log2phy[layers], new.logcnt[layers], self.model.mesh, self.max_replicas
        )
        if move.groups:
            self._copy_next(move)
            return
        # Only now: nothing reads the placement while a move is under way (a request waits for its end), and
        # the move's source slots were taken from the placement before it.
        self._move, self.placement = None, new
        self.num_rebalances += 1
        log.info("eplb: placement %d swapped in (%d slots, most replicas %d)", self.num_rebalances, self.num_slots, new.logcnt.max())


def source_slots(current: Placement, new: Placement, ep_size: int) -> np.ndarray:
    """Where each new slot's expert is copied from [L, R]: a current replica on the slot's own EP rank (copied
    there, nothing crosses), else its first replica."""
    layers, slots = new.phy2log.shape
    per_rank, current_per_rank = slots // ep_size, current.phy2log.shape[1] // ep_size
    rows = np.empty((layers, slots), np.int64)
    for layer in range(layers):
        for r, expert in enumerate(new.phy2log[layer]):
            replicas = [int(s) for s in current.log2phy[layer, expert] if s >= 0]
            local = [s for s in replicas if s // current_per_rank == r // per_rank]
            rows[layer, r] = (local or replicas)[0]
    return rows
