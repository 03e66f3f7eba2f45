"""Routing policies: small classes behind one interface, each giving every candidate a cost (lower wins).

The kv-aware cost of a candidate worker `w`, in KV blocks (the unit both cache and load are measured in):

    cost(w) = cache_weight * uncached_blocks(w)
            + load_weight  * max(0, load_blocks(w) - mean load_blocks of the candidates - load_slack_blocks)
            + queue_weight * num_waiting(w)
            - session_bonus_blocks            (only if w served this session before)
            + 0.001 * (load_blocks(w) + upcoming_blocks(w))   (ties only: see below)

    uncached_blocks(w) = prompt_len / block_size - (device blocks matched + host_tier_credit * offloaded)
    load_blocks(w)     = active_decode_blocks(w) + inflight_prefill_tokens(w) / block_size
                         (+ what this router sent it since its last heartbeat)

Why these terms: uncached blocks are the prefill work the choice creates (a host-tier block still needs a
copy to the device, hence the 0.75 credit); active decode blocks are what each decode step streams, so
they measure how much a new sequence slows a worker's tokens; in-flight prefill tokens and queued
requests are work the new request waits behind.

Why load counts only above the mean plus a slack (64 blocks by default, about one request's KV): with the
default weights (1, 1, 1) a cached block is worth one block of excess load. A worker holding a prefix
wins until it carries more excess load than the prefix would cost to recompute elsewhere; then the prefix
is replicated to a second worker instead of piling onto the first (the "death spiral" of pure affinity),
which bounds a worker's load at about the mean + slack + one prefix + one request. Below that, load is no
advantage: the ordinary spread of loads between workers (hundreds of blocks when each runs tens of
sequences, one whole request when each runs one) would otherwise outweigh a prefix of tens of blocks and
scatter system prompts and conversations over every worker; SGLang's cache-aware router makes the same
trade with its absolute/relative imbalance thresholds. In a simulation (tests/test_router_policy.py: 8
workers, Zipf-popular system prompts, the hottest twice a worker's share) the defaults keep max/mean load
at ~1.05 while reusing 0.84 of prompt tokens (best possible ~0.87), against 0.75 when every difference in
load counts (Dynamo-style) and 0.71 for least-loaded routing; ignoring load reaches 2.8x. The tiny last
term only orders candidates that are otherwise equal (a new conversation, a cold prompt): they go to the
worker with the least work now and about to come, instead of a hashed pick, which would leave placement
of new conversations and system prompts to chance. Work about to come (`upcoming_blocks`, kept by the
router replica) is what will follow the KV a worker holds:
  - the next turns of the live conversations whose last turn it served (live until `session_idle_s`
    without a turn; a turn re-sends at least the previous prompt, which is what is counted);
  - for requests without a session, the prompt blocks it was sent lately (decaying over
    `session_idle_s`): they come back through the prefixes it holds, at about the rate they came.
Load alone misses both: a worker whose conversations are all between turns runs nothing, looks free
and collects every new one (measured on the multi-turn benchmark: max/mean 1.33-1.5). A decaying sum of
all work misses the other way: it keeps counting conversations that ended and the previous workload, so a
worker that had more then gets too little now (max/mean 1.17-1.5). Counted as above: multi-turn 1.00-1.17
and shared-prefix 1.04-1.12 over eight runs (`moray bench routing`).

The session bonus is a few blocks: it breaks near-ties toward the worker that holds a conversation's KV,
never an override. kv_usage is exported as a metric but not scored: it is active_decode_blocks / pool
size, already counted.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from random import Random
from typing import Literal

from .types import Lookup, PrefixMatch, RouteRequest, WorkerLoad

Stage = Literal["decode", "prefill"]
_NO_MATCH = PrefixMatch(0, 0)


@dataclass(frozen=True)
class CostWeights:
    cache_weight: float = 1.0
    load_weight: float = 1.0
    queue_weight: float = 1.0
    host_tier_credit: float = 0.75
    session_bonus_blocks: float = 4.0
    load_slack_blocks: float = 64.0

    @classmethod
    def from_config(cls, cfg) -> "CostWeights":
        return cls(
            cfg.cache_weight, cfg.load_weight, cfg.queue_weight, cfg.host_tier_credit, cfg.session_bonus_blocks, cfg.load_slack_blocks
        )


TIE_WEIGHT = 0.001  # per block of load or upcoming work: decides only between otherwise equal candidates


@dataclass
class RoutingContext:
    """What one decision knows: the request, the index's answer, and the load this router replica sent
    to workers that their heartbeats do not show yet (`pending`: worker -> (decode blocks, prefill
    tokens), see `router.PendingLoad`)."""

    request: RouteRequest
    block_size: int
    weights: CostWeights
    lookup: Lookup
    pending: dict[str, tuple[int, int]] = field(default_factory=dict)
    upcoming: dict[str, float] = field(default_factory=dict)  # worker -> blocks about to come (router._upcoming_work)
    # The engines are hybrid (linear-attention state): they resume only at a block boundary before the
    # prompt's last token, so a block-aligned prompt fully cached reuses one block less.
    state_boundaries: bool = False
    _kv_costs: dict[tuple, dict[str, float]] = field(default_factory=dict, repr=False)  # per candidate set

    @property
    def loads(self) -> dict[str, WorkerLoad]:
        return self.lookup.loads

    @property
    def prompt_blocks(self) -> float:
        return self.request.prompt_len / self.block_size

    def match(self, w: str) -> PrefixMatch:
        return self.lookup.matches.get(w, _NO_MATCH)

    def cached_tokens(self, w: str) -> int:
        return self.reusable_tokens(self.match(w).blocks)

    def reusable_tokens(self, blocks: int) -> int:
        """Prompt tokens an engine reuses from `blocks` cached blocks of this request's chain."""
        if self.state_boundaries:
            return min(blocks, (self.request.prompt_len - 1) // self.block_size) * self.block_size
        return min(self.request.prompt_len, blocks * self.block_size)

    def uncached_blocks(self, w: str) -> float:
        m = self.match(w)
        credited = m.blocks - m.offloaded * (1.0 - self.weights.host_tier_credit)
        return max(0.0, self.prompt_blocks - credited)

    def load_blocks(self, w: str) -> float:
        load = self.loads[w]
        blocks, tokens = self.pending.get(w, (0, 0))
        return load.active_decode_blocks + blocks + (load.inflight_prefill_tokens + tokens) / self.block_size

    def in_session(self, w: str) -> bool:
        return w in self.lookup.session_workers

    def cost(self, w: str, load_blocks: float, baseline: float) -> float:
        """The kv-aware cost, load counted above `baseline` (the candidates' mean load plus the slack)."""
        wt = self.weights
        return (
            wt.cache_weight * self.uncached_blocks(w)
            + wt.load_weight * max(0.0, load_blocks - baseline)
            + TIE_WEIGHT * (load_blocks + self.upcoming.get(w, 0.0))
            + wt.queue_weight * self.loads[w].num_waiting
            - (wt.session_bonus_blocks if self.in_session(w) else 0.0)
        )

    def kv_costs(self, candidates: list[str]) -> dict[str, float]:
        """`cost` for every candidate, computed once per candidate set (the branch label reuses it)."""
        key = tuple(candidates)
        costs = self._kv_costs.get(key)
        if costs is None:
            load = {w: self.load_blocks(w) for w in candidates}
            baseline = sum(load.values()) / len(candidates) + self.weights.load_slack_blocks
            costs = self._kv_costs[key] = {w: self.cost(w, load[w], baseline) for w in candidates}
        return costs


class Policy:
    """Gives candidates a cost; `Router` picks the cheapest (ties broken per request, reproducibly)."""

    name: str = ""
    # kv-aware only: softmax temperature and exploration apply (others are meant to be predictable).
    stochastic: bool = False

    def costs(self, ctx: RoutingContext, candidates: list[str], stage: Stage) -> dict[str, float]:
        raise NotImplementedError

    def branch(self, ctx: RoutingContext, chosen: str, candidates: list[str], stage: Stage) -> str:
        """The label of what decided (a metrics label and RouteDecision.reason)."""
        return self.name


class KVAwarePolicy(Policy):
    name = "kv-aware"
    stochastic = True

    def costs(self, ctx, candidates, stage):
        return ctx.kv_costs(candidates)

    def branch(self, ctx, chosen, candidates, stage):
        best_cached = max(ctx.match(w).blocks for w in candidates)
        if best_cached == 0:
            return "cold"  # nothing cached anywhere: decided by load
        bonus = ctx.weights.session_bonus_blocks
        if ctx.in_session(chosen) and bonus:
            costs = ctx.kv_costs(candidates)
            without_bonus = min(candidates, key=lambda w: costs[w] + (bonus if ctx.in_session(w) else 0.0))
            if without_bonus != chosen:
                return "session"  # the bonus tipped it
        return "cache-hit" if ctx.match(chosen).blocks == best_cached else "load-balance"


class LeastLoadedPolicy(Policy):
    name = "least-loaded"

    def costs(self, ctx, candidates, stage):
        wt = ctx.weights
        return {w: ctx.load_blocks(w) + wt.queue_weight * ctx.loads[w].num_waiting for w in candidates}


class RoundRobinPolicy(Policy):
    name = "round-robin"

    def __init__(self):
        self._next = {"decode": 0, "prefill": 0}

    def costs(self, ctx, candidates, stage):
        ordered = sorted(candidates)
        start = self._next[stage] % len(ordered)
        self._next[stage] += 1
        return {w: float((i - start) % len(ordered)) for i, w in enumerate(ordered)}


class SessionStickyPolicy(Policy):
    """The session's previous worker while it is not overloaded, else the least-loaded one. Overloaded:
    its load exceeds twice the least-loaded candidate's plus `slack_blocks` (so a session does not pin a
    conversation to a worker that fell far behind)."""

    name = "session-sticky"

    def __init__(self, slack_blocks: float = 64.0):
        self.slack_blocks = slack_blocks
        self._least = LeastLoadedPolicy()

    def costs(self, ctx, candidates, stage):
        costs = self._least.costs(ctx, candidates, stage)
        floor = min(costs.values())
        sticky = [w for w in candidates if ctx.in_session(w) and costs[w] <= 2 * floor + self.slack_blocks]
        if sticky:
            w = min(sticky, key=lambda w: costs[w])
            costs[w] = -math.inf
        return costs

    def branch(self, ctx, chosen, candidates, stage):
        return "session" if ctx.in_session(chosen) else "least-loaded"


POLICIES = {p.name: p for p in (KVAwarePolicy, LeastLoadedPolicy, RoundRobinPolicy, SessionStickyPolicy)}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}") from None


def tiebreak(request_id: str, worker: str) -> int:
    """A per-request, process-independent order among equal costs: replicas agree on the same request,
    and different requests spread over tied workers instead of all taking the first."""
    return zlib.crc32(f"{request_id}\x00{worker}".encode())


def select(
    costs: dict[str, float],
    request_id: str,
    rng: Random,
    temperature: float = 0.0,
    exploration: float = 0.0,
) -> tuple[str, str | None]:
    """The cheapest candidate; with temperature > 0 a softmax sample over -cost/temperature, and with
    probability `exploration` a uniform pick. Returns (worker, "explore" | "sampled" | None)."""
    if not exploration and not temperature:  # the common case: the cheapest, ties broken per request
        best = min(costs.values())
        tied = [w for w, c in costs.items() if c == best]
        return (tied[0] if len(tied) == 1 else min(tied, key=lambda w: tiebreak(request_id, w))), None
    ranked = sorted(costs, key=lambda w: (costs[w], tiebreak(request_id, w)))
    if exploration and len(ranked) > 1 and rng.random() < exploration:
        return rng.choice(ranked), "explore"
    if temperature > 0 and len(ranked) > 1:
        best = costs[ranked[0]]
        weights = [math.exp(-(costs[w] - best) / temperature) for w in ranked]
        w = rng.choices(ranked, weights)[0]
        return w, ("sampled" if w != ranked[0] else None)
    return ranked[0], None
