"""Every message that crosses a process, in one place.

    worker --WorkerReport(WorkerHeartbeat, [KVEvent])--------------------> membership registry
    pipeline --PrefillRequest--> prefill worker --PrefillHandoff--> pipeline
    pipeline --DecodeRequest(PrefillHandoff | None)--> decode worker
    prefill worker --KVChunk data, published through a KV transport--> decode worker (workers/kv_transfer.py;
        the chunks' KVChunkHeaders travel in the PrefillHandoff, apart from the data they vouch for)
    decode worker --TokenDeltaBatch (one per step, per channel)--> pipeline --TokenDelta--> front end

`TokenDelta` is the one type a request's new tokens travel in, from the engine's output processor to the
protocol front end that writes them to the client; nothing converts it on the way. Messages are frozen or
slotted dataclasses of plain values (Ray pickles them); a field added here is added for every sender and
receiver at once, and `tests/test_messages.py` checks each one's shape.

This module imports nothing heavy (no JAX, no Ray): the router, the front end and the CLI load it.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import numpy as np

    from workers.engine.sampling_params import SamplingParams

Role = Literal["prefill", "decode", "both"]

# ---------------------------------------------------------------------------------------- tokens out


@dataclass(slots=True)
class TokenDelta:
    """What one request gained in one step: its new tokens and their text, or its end.

    Made by the engine's output processor (`workers/engine/output_processor.py`); a request's last delta
    has `finish_reason` set (stop, length, abort; the pipeline adds error and timeout). The pipeline sends a
    prefill worker's first token in the same type."""

    request_id: str
    token_ids: list[int]  # the tokens this delta adds
    text: str  # their text (a stop string's trimmed tail: the text up to it)
    num_output_tokens: int  # output tokens so far, these included
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None  # one per new token when the request asked: {token id: logprob}
    prompt_logprobs: list | None = None  # on the first delta of a request that asked
    queue_s: float | None = None  # on the first delta: how long the request waited for its first engine step

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class TokenDeltaBatch:
    """A decode worker's deltas for one channel (one front-end replica) since its last batch: one message
    per engine step, whatever the number of requests. `closing`: the worker ends the channel after this
    batch because no request of it is left (a channel that ends without it ended because the worker died)."""

    worker_id: str
    deltas: list[TokenDelta]
    closing: bool = False

    # On the wire a batch is bytes: its deltas as plain tuples, pickled (C pickle of tuples costs ~20 us for
    # 64 deltas against ~240 us for Ray's cloudpickle of the objects, and it is paid once per step).
    def encode(self) -> bytes:
        rows = [
            (
                d.request_id,
                d.token_ids,
                d.text,
                d.num_output_tokens,
                d.num_cached_tokens,
                d.finish_reason,
                d.logprobs,
                d.prompt_logprobs,
                d.queue_s,
            )
            for d in self.deltas
        ]
        return pickle.dumps((self.worker_id, self.closing, rows), protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def decode(data: bytes) -> TokenDeltaBatch:
        worker_id, closing, rows = pickle.loads(data)
        return TokenDeltaBatch(worker_id, [TokenDelta(*row) for row in rows], closing)


# ---------------------------------------------------------------------------------------- requests in


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """A prompt for a prefill worker: compute it, sample the first token, hold the KV for the handoff."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    session_id: str | None = None
    trace_context: dict[str, str] | None = None  # W3C traceparent of the caller's span (cluster/tracing.py)


@dataclass(frozen=True, slots=True)
class PrefillHandoff:
    """The prefill worker's answer: the first token and where the prompt's KV waits.

    `chunks`: the headers of the KV chunks (their checksums travel here, apart from the data); `sources`:
    one transport handle per chunk (`workers/kv_transfer.py`; object references on a Ray cluster).
    `transport`: the name of the transport that published them."""

    request_id: str
    worker_id: str  # the prefill worker that published the KV (told when the handoff is over)
    first: TokenDelta  # the first output token (finished: the request ended there, nothing is held)
    prompt_len: int
    chunks: tuple[KVChunkHeader, ...] = ()
    sources: tuple = ()
    transport: str = ""
    prefill_time_s: float = 0.0
    export_time_s: float = 0.0  # from the engine's dispatch of the copy to the chunks being published
    # The first block whose sliding-window layers' KV the chunks hold (a sender with a sliding-window cache
    # group let go of earlier ones: they come as filler, out of every query's window; window_cache.py).
    window_start_block: int = 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """A request for a decode worker. Without a handoff the worker prefills the prompt (and `resume`) itself.
    Its deltas go out on `channel` (the name of the front-end replica's channel it listens on: a worker
    starts it only while that very channel is open)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    channel: str
    handoff: PrefillHandoff | None = None
    session_id: str | None = None
    trace_context: dict[str, str] | None = None
    # A migrated request: the output tokens the client has already (from a decode replica that died or was
    # drained). The new worker recomputes them with the prompt and continues after them.
    resume: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StreamOffer:
    """A decode worker's answer to a front end that asks for a direct channel: connect to `host:port` and
    present `token` (one use) as the first frame; the channel's batches, starts and aborts then go over that
    connection (cluster/direct_stream.py)."""

    host: str
    port: int
    token: bytes


# ---------------------------------------------------------------------------------------- KV transfer


class KVChunkCorrupt(ValueError):
    """A KV chunk does not match its header (wrong request, range, shape, dtype or checksum)."""


@dataclass(frozen=True, slots=True)
class KVChunkHeader:
    """What a chunk of a request's KV claims to be; travels with the handoff (apart from the data) and is
    checked by the receiver before anything is written. A "kv" chunk holds blocks [block_start,
    block_end) x layers [layer_start, layer_end) as [blocks, layers, page, 2*Hkv, D]; a "state" chunk a
    hybrid model's packed linear-attention state (its ranges are 0)."""

    request_id: str
    index: int  # position in the handoff's chunk list
    kind: str  # "kv" | "state"
    block_start: int
    block_end: int
    layer_start: int
    layer_end: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    checksum: int  # XXH3-64 of the data's bytes

    @staticmethod
    def of(
        request_id: str,
        index: int,
        kind: str,
        block_start: int,
        block_end: int,
        layer_start: int,
        layer_end: int,
        data,
        checksum: int | None = None,
    ) -> KVChunkHeader:
        """`checksum`: the data's, when the caller has it already (`copy_checksummed`)."""
        return KVChunkHeader(
            request_id,
            index,
            kind,
            block_start,
            block_end,
            layer_start,
            layer_end,
            tuple(data.shape),
            str(data.dtype),
            int(data.nbytes),
            _checksum(data) if checksum is None else checksum,
        )


@dataclass(frozen=True, slots=True)
class KVChunk:
    header: KVChunkHeader
    data: np.ndarray

    @staticmethod
    def of(request_id: str, index: int, kind: str, block_start: int, block_end: int, layer_start: int, layer_end: int, data) -> KVChunk:
        return KVChunk(KVChunkHeader.of(request_id, index, kind, block_start, block_end, layer_start, layer_end, data), data)

    def verified(self, expected: KVChunkHeader) -> np.ndarray:
        """The data, once it is what the handoff announced and what the sender sent; else `KVChunkCorrupt`."""
        h, data = expected, self.data
        if self.header != expected:
            raise KVChunkCorrupt(f"KV chunk is {self.header.request_id}#{self.header.index}, expected {h.request_id}#{h.index}")
        if not hasattr(data, "dtype") or tuple(data.shape) != h.shape or str(data.dtype) != h.dtype or data.nbytes != h.nbytes:
            got = f"{data.dtype}{list(data.shape)}" if hasattr(data, "dtype") else type(data).__name__
            raise KVChunkCorrupt(f"KV chunk {h.index} of {h.request_id} arrived as {got}, sent as {h.dtype}{list(h.shape)}")
        if _checksum(data) != h.checksum:
            raise KVChunkCorrupt(f"KV chunk {h.index} of {h.request_id} fails its checksum")
        return data


CHECKSUM_TILE = 256 << 10  # a tile just copied is still in the core's L2 cache when it is hashed


def copy_checksummed(data: np.ndarray, out: np.ndarray) -> int:
    """Copies `data` into the bytes `out` (as many as it has) and returns the data's checksum, the same as
    `_checksum(data)`: tile by tile, each tile hashed right after its copy, while it is still in the cache,
    so that copying and checking take one pass over memory instead of two (7.5 against 10.2 ms for 66 MiB
    here)."""
    import numpy as np
    import xxhash

    if not data.flags.c_contiguous:  # a layer range of whole blocks: copied by numpy, then hashed
        np.copyto(out.view(data.dtype).reshape(data.shape), data)
        return _checksum(out)
    src = data.reshape(-1).view(np.uint8)
    h = xxhash.xxh3_64()
    for start in range(0, src.nbytes, CHECKSUM_TILE):
        tile = out[start : start + CHECKSUM_TILE]
        tile[:] = src[start : start + CHECKSUM_TILE]
        h.update(memoryview(tile))
    return h.intdigest()


def _checksum(data: np.ndarray) -> int:
    """XXH3-64 of the bytes: ~10x CRC-32's speed here (37 vs 3.9 GB/s on one core), and it lets go of the
    GIL, so the decode worker checks chunks on threads beside its event loop."""
    import numpy as np
    import xxhash

    # As bytes: a buffer of bfloat16 (ml_dtypes) cannot be cast by memoryview, and refused every bfloat16 export.
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(data).reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------------------------- membership


class WorkerState(str, Enum):
    """What a worker says of itself. The registry adds DEAD (a failed call, or no heartbeat for a TTL)."""

    ALIVE = "alive"  # takes new requests
    DRAINING = "draining"  # takes nothing new; front ends move its streams elsewhere (scale-down, shutdown)
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's own figures, read from its thread without stopping it (counters may be a step stale)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_usage: float = 0.0
    num_tokens_in_flight: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_pending_prefill_tokens: int = 0  # prompt tokens admitted but not yet computed
    num_held: int = 0  # finished prefills whose KV awaits export
    num_importing: int = 0  # handoffs whose KV is still arriving
    num_requests: int = 0  # every request the scheduler knows
    host_hit_tokens: int = 0  # of prefix_cache_hits, tokens copied back from the host tier
    host_blocks_used: int = 0
    host_blocks_total: int = 0
    host_blocks_saved: int = 0  # device blocks copied to the host tier on eviction (running total)
    host_blocks_loaded: int = 0  # host blocks copied back for a prefix hit (running total)
    host_blocks_evicted: int = 0  # host blocks dropped for room (running total)
    host_copy_seconds: float = 0.0  # host time spent on the tier's copies (running total)
    # Cached blocks evicted (device and host tier) while the session that last used them was live: the
    # retention order's last resort (retention.py); growing fast means the tiers are too small.
    evicted_live_session_blocks: int = 0
    num_preemptions: int = 0  # running requests restarted for room (running total)
    kv_event_epoch: int = 0  # the KV event stream's epoch and last sequence number (the index's consistency)
    kv_event_last_seq: int = -1
    kv_bytes_per_token: int = 0  # KV bytes one token takes over all layers (MLA: one latent row per layer)
    sparse_blocks: bool = False  # publishes only resumable block boundaries (hybrid models; the router's lookup)
    state_snapshot_bytes: int = 0  # device bytes the hybrid model's state snapshots hold now
    state_snapshot_budget_bytes: int = 0  # ... and may hold (state_cache_memory_bytes or state_snapshots)
    # Speculative decoding (running totals): verify runs, draft tokens proposed and accepted, and accepted
    # drafts by position in the run (vLLM's spec_decode counters).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # MoE models: token-to-expert assignments routed so far (padding excluded); the worst MoE layer's
    # busiest expert-parallel rank against the mean rank over the last ~256 steps (1.0: balanced; with one
    # rank, 1.0); placements swapped in by expert load balancing. From device snapshots every 32 steps.
    expert_routed_tokens: int = 0
    expert_rank_imbalance: float = 0.0
    expert_rebalances: int = 0

    @property
    def host_kv_usage(self) -> float:
        return self.host_blocks_used / self.host_blocks_total if self.host_blocks_total else 0.0


@dataclass(frozen=True, slots=True)
class HandoffCounters:
    """A worker's KV handoff totals (running totals since it started)."""

    handoffs: int = 0
    bytes: int = 0  # everything imported: attention KV plus linear-attention state
    state_bytes: int = 0  # of `bytes`, the linear-attention state (hybrid models)
    seconds: float = 0.0
    import_failures: int = 0  # handoffs recomputed locally instead (the KV did not arrive, or arrived damaged)
    corrupt_chunks: int = 0  # chunks refused because they failed their header check or checksum
    held_released_by_timeout: int = 0  # prefill side: published KV nobody fetched within the hold timeout
    refetched_chunks: int = 0  # chunks fetched a second time (the first failed its check or its fetch)
    skipped_bytes: int = 0  # KV not moved: the decode side's own prefix cache held those blocks
    exports: int = 0  # prefill side: handoffs published
    export_bytes: int = 0
    export_seconds: float = 0.0  # from the engine's dispatch of the copy to the host copy being complete


@dataclass(frozen=True, slots=True)
class WorkerHeartbeat:
    """A worker's state, sent with every report (a few times a second)."""

    worker_id: str
    role: Role
    ts: float  # when the worker measured it (its clock): a report in flight when it died is older than the failure
    state: WorkerState = WorkerState.ALIVE
    engine: EngineStats = field(default_factory=EngineStats)
    handoff: HandoffCounters = field(default_factory=HandoffCounters)
    misrouted: int = 0  # requests that reached this worker although the router chose another (running total)
    healthy: bool = True  # its engine thread is running
    num_processes: int = 1  # > 1: one engine over several hosts


@dataclass(slots=True)
class WorkerReport:
    """What a worker sends the membership registry: its heartbeat and the KV events since its last report
    (none when the cluster's KV index is Redis, which the worker writes itself)."""

    heartbeat: WorkerHeartbeat
    events: list[KVEvent] = field(default_factory=list)


class KVEventKind(str, Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class KVEvent:
    """A change to what a worker's prefix cache holds (workers/engine/kv_events.py publishes them)."""

    worker_id: str
    epoch: int
    seq: int
    kind: KVEventKind
    block_hash: int | None = None
    parent_hash: int | None = None
    num_tokens: int = 0
    tier: str = "device"
    timestamp: float = 0.0

    def to_dict(self) -> dict:
        return {
            "worker_id": self.worker_id,
            "epoch": self.epoch,
            "seq": self.seq,
            "kind": self.kind.value,
            "block_hash": self.block_hash,
            "parent_hash": self.parent_hash,
            "num_tokens": self.num_tokens,
            "tier": self.tier,
            "timestamp": self.timestamp,
        }

    @staticmethod
    def from_dict(d: dict) -> KVEvent:
        return KVEvent(**{**d, "kind": KVEventKind(d["kind"])})


# Every message type, for the shape tests.
MESSAGES = (
    TokenDelta,
    TokenDeltaBatch,
    PrefillRequest,
    PrefillHandoff,
    DecodeRequest,
    KVChunkHeader,
    KVChunk,
    EngineStats,
    HandoffCounters,
    WorkerHeartbeat,
    WorkerReport,
    KVEvent,
)
