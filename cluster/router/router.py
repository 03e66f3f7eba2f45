"""`Router`: one KV index + one policy -> `route(RouteRequest) -> RouteDecision`.

A decision: read the index once (prefix matches for every live worker, their loads, the session's
workers), pick the decode worker, then decide whether a remote prefill pays (only when the decode worker
lacks at least `remote_prefill_min_tokens` of the prompt) and pick the prefill worker. Bookkeeping
follows: speculative entries for the blocks the chosen workers are about to compute, and the session
record (the Redis index queues these for a background writer, so a decision costs one round trip).
This replica also adds the decision to its own view of those workers' load until their next heartbeat
reports it, so a burst of decisions spreads instead of herding onto the worker that looked idlest a
moment ago.

When the index is unavailable (Redis down, timing out, refusing credentials) decisions go on by load
alone, from the last loads seen (or equal loads over `fallback_workers`), marked degraded and counted;
KV-aware routing resumes by itself once the index answers again.

Who may be routed to is the membership registry's answer (`membership`, a front end's
`cluster.membership.MembershipView`): every lookup is filtered through it, so a worker that is dead or
draining there, or whose call just failed in this front end, gets nothing, whatever the index holds.

Thread-safe; `route` is synchronous and fast (see `moray bench route`). From asyncio code call
`await router.aroute(req)`, which keeps the Redis round trip off the event loop (and awaits an index that
answers asynchronously, the registry's, directly).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import OrderedDict, deque
from random import Random
from typing import Callable

from cluster.config import KVIndexConfig, RouterConfig

from .metrics import RouterMetrics
from .policy import CostWeights, Policy, RoutingContext, make_policy, select
from .types import IndexUnavailable, KVIndex, Lookup, NoWorkersAvailable, Role, RouteDecision, RouteRequest, WorkerLoad


class PendingLoad:
    """Load this router replica has sent to workers that their heartbeats do not show yet.

    A decision at time t is added to the worker's load until a heartbeat measured after t arrives (it
    then includes the request), or until `ttl_s` passes (a request that never reached the worker).
    Bumps arrive in time order, so expiring them is popping from the left of a deque with running sums.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float]):
        self.ttl_s = ttl_s
        self.clock = clock
        self._bumps: dict[str, deque[tuple[float, int, int]]] = {}  # worker -> (t, decode blocks, prefill tokens)
        self._sums: dict[str, list[int]] = {}  # worker -> [decode blocks, prefill tokens] over its bumps

    def add(self, worker: str, decode_blocks: int, prefill_tokens: int) -> None:
        self._bumps.setdefault(worker, deque()).append((self.clock(), decode_blocks, prefill_tokens))
        sums = self._sums.setdefault(worker, [0, 0])
        sums[0] += decode_blocks
        sums[1] += prefill_tokens

    def pending(self, loads: dict[str, WorkerLoad]) -> dict[str, tuple[int, int]]:
        """worker -> (decode blocks, prefill tokens) not yet in its reported load."""
        horizon = self.clock() - self.ttl_s
        out = {}
        for w, bumps in list(self._bumps.items()):
            load = loads.get(w)
            cutoff = max(horizon, load.ts) if load is not None else horizon
            sums = self._sums[w]
            while bumps and bumps[0][0] < cutoff:
                _, blocks, tokens = bumps.popleft()
                sums[0] -= blocks
                sums[1] -= tokens
            if bumps:
                out[w] = (sums[0], sums[1])
            else:
                del self._bumps[w], self._sums[w]
        return out


class LiveSessions:
    """The conversations this router replica placed, per worker, while they are live: a session counts
    on the worker that served its last turn until `idle_s` passes without another turn. Its next turn
    will come back there (its KV is there), re-sending at least the prompt it sent last, so the sum of
    those prompts is work a worker is about to get that its reported load does not show (between turns
    a conversation runs nothing). New conversations go where the least of it waits.

    Sessions are kept in order of their last turn, so expiry pops from the front; per-worker sums are
    kept as they change, so a decision reads them in O(workers)."""

    def __init__(self, idle_s: float, clock: Callable[[], float]):
        self.idle_s = idle_s
        self.clock = clock
        self._sessions: OrderedDict[str, tuple[str, int, float]] = OrderedDict()  # session -> (worker, blocks, t)
        self._blocks: dict[str, int] = {}  # worker -> prompt blocks of its live sessions

    def note(self, session_id: str, worker: str, blocks: int) -> None:
        self._drop(session_id)
        self._sessions[session_id] = (worker, blocks, self.clock())
        self._blocks[worker] = self._blocks.get(worker, 0) + blocks

    def blocks(self) -> dict[str, int]:
        """worker -> prompt blocks of the live sessions whose last turn it served."""
        horizon = self.clock() - self.idle_s
        while self._sessions:
            session_id, (_, _, t) = next(iter(self._sessions.items()))
            if t >= horizon:
                break
            self._drop(session_id)
        return self._blocks

    def _drop(self, session_id: str) -> None:
        old = self._sessions.pop(session_id, None)
        if old is not None:
            worker, blocks, _ = old
            left = self._blocks[worker] - blocks
            if left:
                self._blocks[worker] = left
            else:
                del self._blocks[worker]


class RecentWork:
    """Prompt blocks of requests without a session this router sent each worker, decaying with time
    constant `tau_s`. Such requests come back to a worker through the prefixes it holds (a system prompt
    reused by many), so the work a worker attracted lately is the best guess at what it is about to get.
    (Conversations are counted by `LiveSessions` instead: a decaying sum would keep counting the ones
    that ended.)"""

    def __init__(self, tau_s: float, clock: Callable[[], float]):
        self.tau_s = tau_s
        self.clock = clock
        self._work: dict[str, tuple[float, float]] = {}  # worker -> (blocks, as of time)

    def add(self, worker: str, blocks: float) -> None:
        now = self.clock()
        value, at = self._work.get(worker, (0.0, now))
        self._work[worker] = (value * math.exp((at - now) / self.tau_s) + blocks, now)

    def snapshot(self) -> dict[str, float]:
        now = self.clock()
        return {w: value * math.exp((at - now) / self.tau_s) for w, (value, at) in self._work.items()}


class Router:
    def __init__(
        self,
        index: KVIndex,
        config: RouterConfig | None = None,
        *,
        block_size: int,
        metrics: RouterMetrics | None = None,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.time,
        fallback_workers: dict[str, Role] | None = None,
        membership=None,
        state_boundaries: bool = False,
    ):
        self.index = index
        self.state_boundaries = state_boundaries  # hybrid engines: see RoutingContext.state_boundaries
        self.config = config or RouterConfig()
        self.block_size = block_size
        self.metrics = metrics or RouterMetrics()
        self.policy = policy or make_policy(self.config.policy)
        self._load_only = make_policy("least-loaded")
        self.weights = CostWeights.from_config(self.config)
        self.clock = clock
        self._rng = Random(self.config.seed)
        self._lock = threading.Lock()
        # Pending bumps last one heartbeat TTL at most: by then a live worker has reported its real load.
        self._pending = PendingLoad(self.config.heartbeat_ttl_s, clock)
        self._sessions = LiveSessions(self.config.session_idle_s, clock)
        self._recent = RecentWork(self.config.session_idle_s, clock)  # the same horizon as a conversation's
        self._last_loads: dict[str, WorkerLoad] = {}
        self._fallback = dict(fallback_workers or {})
        self.membership = membership  # who is routable (cluster.membership.MembershipView); None: everyone
        self._wire_index_metrics()

    @classmethod
    def from_config(
        cls, router_cfg: RouterConfig, kv_cfg: KVIndexConfig, model: str, block_size: int, metrics: RouterMetrics | None = None, **kw
    ) -> "Router":
        """A router over the configured index: in-process memory, or Redis shared by all replicas."""
        return cls(build_index(kv_cfg, model, router_cfg), router_cfg, block_size=block_size, metrics=metrics, **kw)

    def _wire_index_metrics(self) -> None:
        for attr, hook in (("on_purge", self.metrics.on_purge), ("on_event_lag", self.metrics.observe_event_lag)):
            if hasattr(self.index, attr) and getattr(self.index, attr) is None:
                setattr(self.index, attr, hook)
        breaker = getattr(self.index, "breaker", None)
        if breaker is not None and breaker.on_change is None:
            breaker.on_change = lambda up: self.metrics.index_up.set(1 if up else 0)

    def set_fallback_workers(self, workers: dict[str, Role]) -> None:
        """Workers to spread over by equal load if the index is down before any load was ever seen."""
        with self._lock:
            self._fallback = dict(workers)

    # ---------------------------------------------------------------- the decision

    def route(self, request: RouteRequest) -> RouteDecision:
        t0 = time.perf_counter()
        lookup, degraded = self._lookup(request)
        return self._decided(request, lookup, degraded, t0)

    def _decided(self, request: RouteRequest, lookup: Lookup, degraded: bool, t0: float) -> RouteDecision:
        with self._lock:
            decision = self._decide(request, lookup, self._pending.pending(lookup.loads), degraded, self._upcoming_work())
            self._note_pending(request, decision)
        self.on_decision(request, decision, {w: m.blocks for w, m in lookup.matches.items()})
        self._observe(request, decision, lookup, time.perf_counter() - t0)
        return decision

    async def aroute(self, request: RouteRequest) -> RouteDecision:
        """`route` for asyncio callers: an index with `alookup` is awaited, another remote one (Redis) is
        consulted from a worker thread."""
        if hasattr(self.index, "alookup"):
            t0 = time.perf_counter()
            try:
                lookup = await self.index.alookup(self._reusable_hashes(request), request.session_id)
            except IndexUnavailable:
                return self._decided(request, *self._degraded_lookup(), t0)
            return self._decided(request, *self._looked_up(lookup), t0)
        if not getattr(self.index, "blocking_lookups", False):
            return self.route(request)
        return await asyncio.to_thread(self.route, request)

    def _reusable_hashes(self, request: RouteRequest) -> list[int]:
        """The blocks an engine could resume after: all of them, but for hybrid engines only those ending
        before the prompt's last token (a state there is the deepest they can use; one past it is not)."""
        if not self.state_boundaries:
            return request.block_hashes
        return request.block_hashes[: (request.prompt_len - 1) // self.block_size]

    def _upcoming_work(self) -> dict[str, float]:
        """worker -> blocks of work likely to arrive soon that its load does not show yet: the next turns
        of its live conversations and the sessionless work it has been attracting (see policy.py)."""
        out = self._recent.snapshot()
        for w, blocks in self._sessions.blocks().items():
            out[w] = out.get(w, 0.0) + blocks
        return out

    def _lookup(self, request: RouteRequest) -> tuple[Lookup, bool]:
        try:
            lookup = self.index.lookup(self._reusable_hashes(request), request.session_id)
        except IndexUnavailable:
            return self._degraded_lookup()
        return self._looked_up(lookup)

    def _looked_up(self, lookup: Lookup) -> tuple[Lookup, bool]:
        with self._lock:
            self._last_loads = lookup.loads
        return self._routable(lookup), False

    def _degraded_lookup(self) -> tuple[Lookup, bool]:
        self.metrics.degraded.inc()
        self.metrics.index_errors.labels("lookup").inc()
        with self._lock:
            loads = dict(self._last_loads) or {
                # ts=0: every pending bump counts, so degraded decisions still spread.
                w: WorkerLoad(w, role, ts=0.0)
                for w, role in self._fallback.items()
            }
        return self._routable(Lookup({}, loads)), True

    def _decide(self, request: RouteRequest, lookup: Lookup, pending: dict, degraded: bool, upcoming: dict | None = None) -> RouteDecision:
        loads = lookup.loads
        if not loads:
            raise NoWorkersAvailable("no live workers: every heartbeat has expired" + (" (KV index unavailable)" if degraded else ""))
        ctx = RoutingContext(request, self.block_size, self.weights, lookup, pending, upcoming or {}, self.state_boundaries)
        # Without the index there is nothing to match: by load alone.
        policy = self._load_only if degraded else self.policy
        # Decode first: decode and colocated workers only. A prefill worker cannot take a decode (its
        # deployment has no decode channel): with none alive the request waits for one (503), rather than
        # failing on a prefill replica (seen at start-up, before the decode replica had registered).
        decoders = sorted(w for w, l in loads.items() if l.role in ("decode", "both"))
        if not decoders:
            raise NoWorkersAvailable("no live decode worker" + (" (KV index unavailable)" if degraded else ""))
        decode, reason, cost = self._choose(policy, ctx, decoders, "decode")
        if degraded:
            reason = "degraded"

        # Then prefill: remote only when the decode worker would compute enough of the prompt itself.
        prefill = None
        uncached = request.prompt_len - ctx.cached_tokens(decode)
        if uncached >= self.config.remote_prefill_min_tokens:
            prefillers = sorted(w for w, l in loads.items() if l.role == "prefill" and w != decode)
            if prefillers:
                prefill, _, _ = self._choose(policy, ctx, prefillers, "prefill")
        side = prefill or decode
        return RouteDecision(
            decode_worker=decode,
            prefill_worker=prefill,
            expected_cached_tokens=ctx.cached_tokens(side),
            reason=reason,
            best_cached_tokens=ctx.reusable_tokens(max((m.blocks for m in lookup.matches.values()), default=0)),
            uncached_tokens=request.prompt_len - ctx.cached_tokens(side),
            cost=cost,
            degraded=degraded,
        )

    def _choose(self, policy: Policy, ctx: RoutingContext, candidates: list[str], stage) -> tuple[str, str, float]:
        """(worker, reason, its cost)."""
        costs = policy.costs(ctx, candidates, stage)
        stochastic = policy.stochastic
        worker, how = select(
            costs,
            ctx.request.request_id,
            self._rng,
            self.config.temperature if stochastic else 0.0,
            self.config.exploration if stochastic else 0.0,
        )
        return worker, how or policy.branch(ctx, worker, candidates, stage), costs[worker]

    def _note_pending(self, request: RouteRequest, d: RouteDecision) -> None:
        prompt_blocks = -(-request.prompt_len // self.block_size)
        self._pending.add(d.decode_worker, prompt_blocks, 0 if d.prefill_worker else d.uncached_tokens)
        if request.session_id:
            self._sessions.note(request.session_id, d.decode_worker, prompt_blocks)
        else:
            self._recent.add(d.decode_worker, prompt_blocks)
        if d.prefill_worker:
            self._pending.add(d.prefill_worker, 0, d.uncached_tokens)

    def on_decision(self, request: RouteRequest, decision: RouteDecision, held: dict[str, int] | None = None) -> None:
        """Index bookkeeping: the chosen workers are about to hold the prompt's blocks (speculative
        entries, so the next request with this prefix follows at once) and served this session.
        `held`: each worker's matched blocks (`PrefixMatch.blocks`: its deepest held block along the chain
        + 1, holes before it included, as hybrid engines hold only boundaries); speculative entries go on
        the blocks past that only."""
        held = held or {}
        if decision.degraded:
            return  # the index is down; nothing to write, and no request should wait on it
        workers = [decision.decode_worker] + ([decision.prefill_worker] if decision.prefill_worker else [])
        ahead = [held.get(w, 0) for w in workers]
        if self.state_boundaries:
            # A hybrid engine will hold the prompt's last full block (a state at its end), not the blocks
            # before it: entries there would predict reuse it cannot give.
            ahead = [max(h, len(request.block_hashes) - 1) for h in ahead]
        try:
            self.index.record_decision(workers, request.block_hashes, self.config.speculative_ttl_s, request.session_id, held=ahead)
        except IndexUnavailable:
            self.metrics.index_errors.labels("record").inc()

    def renew_speculative(self, request: RouteRequest, decision: RouteDecision) -> None:
        """Records a routed request's speculative entries again: its worker has not computed the prompt
        yet (it is queued behind others), so the next request with this prefix should still follow it.
        Without this they lapsed after speculative_ttl_s while the worker had not even started, and a
        burst on a new prefix scattered over workers, each computing it (issue #19)."""
        self.on_decision(request, decision)

    def _observe(self, request: RouteRequest, d: RouteDecision, lookup: Lookup, seconds: float) -> None:
        m = self.metrics
        m.decision_seconds.observe(seconds)
        m.child(m.decisions, self.policy.name, d.reason).inc()
        m.child(m.prefill, "remote" if d.prefill_worker else "local").inc()
        m.prompt_tokens.inc(request.prompt_len)
        m.child(m.routed_tokens, d.decode_worker).inc(request.prompt_len)
        m.cached_best.inc(d.best_cached_tokens)
        m.cached_chosen.inc(d.expected_cached_tokens)
        m.maybe_update_loads(lookup.loads)

    # ---------------------------------------------------------------- who may be routed to

    def _routable(self, lookup: Lookup) -> Lookup:
        """The lookup less the workers the membership says take no requests (dead, draining, or failed
        under a call here and not seen alive since: a load measured after that failure refutes it)."""
        view = self.membership
        if view is None:
            return lookup
        keep = {w for w, load in lookup.loads.items() if view.routable(w, load.ts)}
        if len(keep) == len(lookup.loads) and keep.issuperset(lookup.matches):
            return lookup
        return Lookup(
            {w: m for w, m in lookup.matches.items() if w in keep},
            {w: l for w, l in lookup.loads.items() if w in keep},
            [w for w in lookup.session_workers if w in keep],
        )

    def live_loads(self) -> dict[str, WorkerLoad]:
        """Every live worker's last heartbeat, failed workers left out (raises IndexUnavailable)."""
        return self._routable(Lookup({}, self.index.live_workers())).loads

    def refresh_load_gauges(self, force: bool = False) -> None:
        """The per-worker load gauges from the index's current view (between decisions too: heartbeats
        and maintenance call this), at most once per the metrics' interval unless `force`."""
        if not force and not self.metrics.load_gauges_due():
            return
        try:
            loads = self.live_loads()
        except IndexUnavailable:
            self.metrics.index_errors.labels("loads").inc()
            return
        self.metrics.maybe_update_loads(loads, force=True)

    def maintain(self) -> list[str]:
        """Housekeeping to run every few heartbeat TTLs (e.g. from a replica's background task): forgets
        workers whose heartbeat expired (their entries are ignored already; this frees the memory, and a
        worker that comes back resynchronises) and their metric series. Returns the workers removed."""
        try:
            removed = self.index.remove_dead_workers()
            sweep = getattr(self.index, "sweep", None)
            if sweep is not None:
                sweep()  # superseded Redis entries, should no worker be writing to sweep them
        except IndexUnavailable:
            self.metrics.index_errors.labels("maintain").inc()
            return []
        for w in removed:
            self.metrics.forget_worker(w)
        self.refresh_load_gauges(force=True)
        return removed

    def flush(self, timeout: float = 2.0) -> bool:
        """Waits for queued index bookkeeping (Redis writes are asynchronous); tests and shutdown."""
        return self.index.flush(timeout)

    def close(self) -> None:
        self.index.close()

    def record_reuse(self, tokens: int) -> None:
        """What an engine actually reused for a routed request (its output's num_cached_tokens)."""
        self.metrics.reused.inc(max(0, tokens))


def build_index(kv_cfg: KVIndexConfig, model: str, router_cfg: RouterConfig | None = None) -> KVIndex:
    router_cfg = router_cfg or RouterConfig()
    if kv_cfg.backend == "memory":
        from .memory_index import MemoryKVIndex

        return MemoryKVIndex(heartbeat_ttl_s=router_cfg.heartbeat_ttl_s, session_ttl_s=router_cfg.session_ttl_s)
    from .redis_index import RedisKVIndex

    remote = RedisKVIndex.from_config(kv_cfg, model, router_cfg)
    if kv_cfg.lookups == "mirror":
        from .mirror_index import MirroredKVIndex

        return MirroredKVIndex(remote, poll_interval_s=kv_cfg.mirror_poll_interval_s).start()
    return remote
