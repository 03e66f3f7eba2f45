"""The router's vocabulary: requests, decisions, worker loads, and the `KVIndex` protocol both index
backends (memory, Redis) implement.

Block hashes are the engine's own (`workers.engine.block_hash.block_hashes`, extra_keys = the served
model name), so what the router expects a worker to hold and what that worker actually caches can never
disagree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Iterable, Literal, NamedTuple, Protocol, runtime_checkable

from workers.engine.kv_events import KVEvent
from workers.messages import WorkerHeartbeat

Role = Literal["prefill", "decode", "both"]
DEVICE_TIER = "device"


class IndexUnavailable(RuntimeError):
    """The index cannot be reached now (Redis down, timed out, refused our credentials, or the circuit
    breaker is open). The router routes by load alone when it sees this."""


class NoWorkersAvailable(RuntimeError):
    """No live worker can take the request (every heartbeat has expired)."""


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    block_hashes: list[int]  # chained hashes of the prompt's full blocks
    prompt_len: int  # tokens, including a partial trailing block the hashes do not cover
    session_id: str | None = None


@dataclass(frozen=True)
class RouteDecision:
    decode_worker: str
    prefill_worker: str | None  # None: the decode worker prefills locally
    expected_cached_tokens: int  # prefix tokens the worker that prefills should find in its cache
    reason: str  # which branch decided: kv-aware, session, explore, least-loaded, round-robin, degraded, ...
    best_cached_tokens: int = 0  # the most prefix tokens any live candidate held
    uncached_tokens: int = 0  # prompt tokens the chosen prefill side must compute
    cost: float = 0.0  # the chosen decode worker's cost (blocks)
    degraded: bool = False  # decided without the KV index


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's heartbeat: the load the policy balances, and how far its KV events have got."""

    worker_id: str
    role: Role = "both"
    inflight_prefill_tokens: int = 0  # prompt tokens admitted but not yet prefilled (queued or running)
    active_decode_blocks: int = 0  # KV blocks held by running sequences
    kv_usage: float = 0.0  # fraction of the KV pool in use
    num_waiting: int = 0  # requests queued for admission
    epoch: int = 0  # the worker's KV event epoch (changes when the engine restarts)
    last_seq: int = -1  # the last KV event sequence number the worker emitted
    ts: float = 0.0  # wall-clock time the load was measured (seconds)
    index_lag_s: float = 0.0  # how old the worker's last shipped KV events were when they left it
    # Publishes only reusable block boundaries (hybrid linear-attention models: the blocks where it keeps
    # a recurrent-state snapshot), so it may hold later blocks of a chain and not its first one. False
    # (attention-only engines): every block is published and a sequence's tail is evicted first, so a
    # worker holding any block of a chain holds its first block too; the Redis lookup relies on that.
    sparse_blocks: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_heartbeat(hb: WorkerHeartbeat, index_lag_s: float = 0.0) -> "WorkerLoad":
        """The router's view of a worker's heartbeat (what the policy balances, what Redis stores)."""
        e = hb.engine
        return WorkerLoad(
            worker_id=hb.worker_id,
            role=hb.role,
            inflight_prefill_tokens=e.num_pending_prefill_tokens,
            active_decode_blocks=e.num_total_blocks - e.num_free_blocks,
            kv_usage=e.kv_usage,
            num_waiting=e.num_waiting,
            epoch=e.kv_event_epoch,
            last_seq=e.kv_event_last_seq,
            # When the worker measured it: a report that was in flight when the worker died is older than
            # the failure that dropped it, so it cannot bring the worker back.
            ts=hb.ts,
            index_lag_s=index_lag_s,
            sparse_blocks=e.sparse_blocks,  # hybrid engines: boundary blocks only
        )

    @staticmethod
    def from_dict(d: dict) -> "WorkerLoad":
        """Parses a dict of strings (a Redis HASH) or of native values; unknown keys are ignored."""
        return WorkerLoad(**{k: _LOAD_PARSERS[k](v) for k, v in d.items() if k in _LOAD_PARSERS})


def parse_bool(v) -> bool:
    """A bool from a Redis string ("1"/"0", as heartbeats write it, or "True"/"False") or a native value."""
    if isinstance(v, (bool, int)):
        return bool(v)
    s = v.decode() if isinstance(v, bytes) else str(v)
    if s in ("1", "True", "true"):
        return True
    if s in ("0", "False", "false", ""):
        return False
    raise ValueError(f"not a bool: {v!r}")


# One parser per WorkerLoad field (on every Redis lookup; kept off the dataclass machinery).
_LOAD_PARSERS = {f.name: {"float": float, "int": int, "bool": parse_bool}.get(f.type, str) for f in fields(WorkerLoad)}


class PrefixMatch(NamedTuple):
    """A worker's cached prefix of a request: `blocks` = its deepest held block along the request's chain
    + 1 (block hashes are chained, so holding block i means holding the prefix through block i; hybrid
    linear-attention engines publish only the blocks they can resume from, so holes before it do not
    matter), and `offloaded` = the chain positions up to there it holds only in a slower tier (host
    DRAM, disk), which the policy credits partially."""

    blocks: int
    offloaded: int = 0


@dataclass
class Lookup:
    """Everything one routing decision reads from the index, fetched together (one Redis round trip)."""

    matches: dict[str, PrefixMatch]  # live workers with a non-empty prefix match
    loads: dict[str, WorkerLoad]  # every live worker
    session_workers: list[str] = field(default_factory=list)


@runtime_checkable
class KVIndex(Protocol):
    """Which worker caches which block, who is alive, and how loaded.

    Per-worker consistency: events carry (epoch, seq). A new epoch, a gap in seq, or a `cleared` event
    purges the worker's entries; entries re-accumulate from the events that follow. Workers whose
    heartbeat is older than the TTL are not live: their entries are never returned.
    """

    def apply(self, events: Iterable[KVEvent]) -> None: ...

    def longest_prefix(self, block_hashes: list[int]) -> dict[str, int]:
        """Live worker -> matched blocks (`PrefixMatch.blocks`: its deepest held block + 1)."""
        ...

    def lookup(self, block_hashes: list[int], session_id: str | None = None) -> Lookup: ...

    def heartbeat(self, load: WorkerLoad) -> None: ...

    def live_workers(self) -> dict[str, WorkerLoad]: ...

    def remove_worker(self, worker_id: str) -> None: ...

    def remove_dead_workers(self) -> list[str]: ...

    def note_speculative(self, worker_id: str, block_hashes: list[int], ttl_s: float) -> None: ...

    def record_session(self, session_id: str, worker_id: str) -> None: ...

    def session_workers(self, session_id: str) -> list[str]: ...

    def record_decision(
        self, workers: list[str], block_hashes: list[int], ttl_s: float, session_id: str | None, held: list[int] | None = None
    ) -> None:
        """`note_speculative` for each chosen worker (from block `held[i]` on) + `record_session`, at once."""
        ...

    def flush(self, timeout: float = 2.0) -> bool:
        """Waits until writes queued by record_decision have reached the index."""
        ...

    def close(self) -> None: ...

    def load_snapshot(self, worker_id: str, epoch: int, last_seq: int, blocks: list[tuple[int, str]], reset: bool = True) -> None: ...
