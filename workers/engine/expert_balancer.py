"""Expert load balancing while serving (`EngineConfig.eplb`): redundant expert slots, re-placed from the
loads the engine counts.

The model is loaded with `num_redundant_experts` extra physical slots per MoE layer (R = E + spare, split
over the EP ranks like the experts), so the step programs' shapes never change after start-up. Every
`period_steps` steps (or on `EngineCore.rebalance_experts()`), the logical loads routed since the last
rebalance go to `eplb.rebalance_experts` on a background thread; at the next step boundary after it
returns, the experts are copied into their new slots on the device (`moe_parallel.move_experts`: one program
for every MoE layer, compiled for every exchange width when the balancer starts, dispatched before the next
step, which therefore reads the new weights) and the replica maps swapped. A step in
flight keeps the arrays it was launched with, so no request waits more than the copies take, and a
replicated expert computes the same numbers in any slot: streams are unchanged by a rebalance.

An engine over several hosts runs the same balancer on every host, fed the same calls (the period counts
the replayed steps, a manual trigger is a replicated call, the loads are replicated on every host): each
host computes the same placement, and swaps it in at the same step, `SWAP_AFTER_STEPS` steps after the
request (waiting for the computation there if it is late), never at "whenever it is ready", which would
differ between hosts and desynchronise their collectives.
"""

from __future__ import annotations

import concurrent.futures
import logging

import jax
import numpy as np

from workers.models import LoadedModel
from workers.models.eplb import Placement, rebalance_experts
from workers.models.moe_parallel import compile_expert_moves, moe_blocks, move_experts

from .config import EplbConfig

log = logging.getLogger("moray.engine")

# Multi-host: the step after whose end a requested placement is swapped in, counted from the request (a
# placement takes milliseconds for hundreds of experts; the wait there is the rare late one).
SWAP_AFTER_STEPS = 4


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
        self._swap_at: int | None = None  # multi-host: the step count at which the pending one is swapped in
        self.lockstep = jax.process_count() > 1
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moray-eplb")
        # Start-up: every expert once, the spare slots to the first experts (no loads yet); loaded weights
        # are in logical order, so the identity map is the current placement.
        identity = np.tile(np.arange(self.num_experts), (self.num_layers, 1))
        self.placement = Placement(identity, identity[:, :, None], np.ones_like(identity))
        self._swap(self._place(np.ones((self.num_layers, self.num_experts))))
        self.num_rebalances = 0  # the start-up placement is no rebalance
        compile_expert_moves(moe_blocks(model.weights), model.mesh)

    # ---------------------------------------------------------------- in the engine thread

    def on_step(self, physical_counts) -> None:
        """At a step boundary: swap in a placement that is ready; start one every `period_steps`."""
        self._steps += 1
        if self._pending is not None and (self._steps >= self._swap_at if self.lockstep else self._pending.done()):
            self.wait()
        period = self.config.period_steps
        if period and self._steps % period == 0 and self._pending is None:
            self.request(physical_counts())

    def request(self, physical: np.ndarray | None) -> bool:
        """Starts computing a placement from the loads since the last one (on the background thread); False
        when one is already being computed or nothing was counted yet."""
        if self._pending is not None or physical is None:
            return False
        window = physical if self._base is None else physical - self._base
        self._base = physical
        self._pending = self._pool.submit(self._place, self.logical_loads(window))
        self._swap_at = self._steps + SWAP_AFTER_STEPS
        return True

    def wait(self) -> None:
        """Swaps in the placement being computed, if any (manual trigger, tests)."""
        if self._pending is not None:
            placement, self._pending = self._pending.result(), None
            self._swap(placement)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- placement

    def logical_loads(self, physical: np.ndarray) -> np.ndarray:
        """Counts per physical slot [L, R] -> per logical expert [L, E] (the replicas summed)."""
        out = np.zeros((self.num_layers, self.num_experts))
        for layer in range(self.num_layers):
            np.add.at(out[layer], self.placement.phy2log[layer], physical[layer])
        return out

    def _place(self, loads: np.ndarray) -> Placement:
        groups = self.num_groups if self.num_groups % self.num_nodes == 0 else 1
        return rebalance_experts(loads, self.num_slots, groups, self.num_nodes, self.ep_size)

    def _swap(self, placement: Placement) -> None:
        """Moves every MoE layer's experts from the current slots into the new ones (one move program, in
        dispatch order before the next step) and installs the new replica maps."""
        rows = source_slots(self.placement, placement, self.ep_size)
        move_experts(moe_blocks(self.model.weights), rows, placement.log2phy, placement.logcnt, self.model.mesh, self.max_replicas)
        self.placement = placement
        self.num_rebalances += 1
        log.info("eplb: placement %d swapped in (%d slots, most replicas %d)", self.num_rebalances, self.num_slots, placement.logcnt.max())


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
