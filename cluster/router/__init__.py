"""KV-prefix-aware routing for prefill/decode pools.

    types.py         RouteRequest, RouteDecision, WorkerLoad, PrefixMatch, Lookup, the KVIndex protocol
    memory_index.py  MemoryKVIndex: one process (the default for a single router)
    redis_index.py   RedisKVIndex: shared by router replicas; the Redis layout and its Lua scripts
    mirror_index.py  MirroredKVIndex: Redis shared, lookups from a local copy kept by the event stream
    redis_conn.py    connecting (ACL user/password, TLS), EVALSHA->EVAL, the circuit breaker
    publisher.py     RedisKVEventSink (worker -> Redis), KVEventStreamConsumer (Redis -> local index)
    policy.py        the cost function and the policies: kv-aware, least-loaded, round-robin, session-sticky
    router.py        Router: index + policy -> route(RouteRequest) -> RouteDecision; degradation
    metrics.py       RouterMetrics: a Prometheus registry for /metrics

Typical use (a router replica):

    router = Router.from_config(cfg.router, cfg.kv_index, model=cfg.engine.model_name,
                                block_size=cfg.engine.block_size)
    hashes = block_hashes(prompt_token_ids, block_size, extra_keys=model_name)
    decision = router.route(RouteRequest(request_id, hashes, len(prompt_token_ids), session_id))

and on each worker, next to its engine:

    sink = RedisKVEventSink.from_config(cfg.kv_index, cfg.router, model_name, worker_id, role="decode",
                                        load_fn=lambda: load_from_engine_stats(worker_id, "decode", core.stats(),
                                                                               sparse_blocks=core.cfg.is_hybrid))
    sink.attach(core.events)
"""

from .memory_index import MemoryKVIndex
from .metrics import RouterMetrics
from .mirror_index import MirroredKVIndex
from .policy import POLICIES, CostWeights, make_policy
from .publisher import KVEventStreamConsumer, RedisKVEventSink, attach_in_process, load_from_engine_stats
from .redis_index import RedisKVIndex
from .router import Router, build_index
from .types import (
    IndexUnavailable,
    KVIndex,
    Lookup,
    NoWorkersAvailable,
    PrefixMatch,
    RouteDecision,
    RouteRequest,
    WorkerLoad,
)

__all__ = [
    "POLICIES",
    "CostWeights",
    "IndexUnavailable",
    "KVEventStreamConsumer",
    "KVIndex",
    "Lookup",
    "MemoryKVIndex",
    "MirroredKVIndex",
    "NoWorkersAvailable",
    "PrefixMatch",
    "RedisKVEventSink",
    "RedisKVIndex",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "RouterMetrics",
    "WorkerLoad",
    "attach_in_process",
    "build_index",
    "load_from_engine_stats",
    "make_policy",
]
