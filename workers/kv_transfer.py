"""The KV transfer layer: how a prompt's KV (and a hybrid model's state) moves from a prefill worker to a
decode worker. The mechanism lives here; how a chunk crosses processes is a `KVTransport`.

Prefill half. The engine *stages* a finished `hold_kv` request: right after the step that finished its
prefill it dispatches a device copy of the request's blocks (and state) and frees them, so its own steps
never wait for an export and held requests take no KV blocks. Off the engine thread, `KVExport.build`
waits for that copy to reach the host, cuts it into chunks by bytes (whole-request for small prompts) and
checksums each (XXH3-64); the transport publishes them, one handle per chunk, and the handoff carries the chunks'
headers and handles.

Decode half. `import_kv` picks the chunks the decode engine's own prefix cache lacks, fetches them through
the transport (any order, a few in flight), checks each against the header that came with the handoff
(not with the data), fetches a bad or missing one once more, writes it, and tells the engine the KV is
ready. Anything else (a chunk bad twice, a transport error, the deadline) makes the request prefill
locally: it is never decoded on wrong KV.

One prefill engine over several hosts: the staged copy is split by blocks across the hosts, each host
stages and publishes the blocks it holds (the first host also the state), and the handoff lists every
host's chunks (`merge_published`). The decode side needs nothing more: a chunk says which blocks and
layers it holds, and the decode engine writes it into its own layout (any mesh, any number of hosts).

The chunk layout is blocks first, [blocks, layers, page, 2*Hkv, D], so that a chunk of whole blocks is a
contiguous slice of the staged copy and a decode worker that has the first blocks skips whole chunks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

import numpy as np

from workers.messages import KVChunk, KVChunkCorrupt, KVChunkHeader, copy_checksummed

if TYPE_CHECKING:
    from workers.engine.engine import StagedKV

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 8 << 20
# Chunks smaller than this are checked on the event loop (~0.06 ms at XXH3's speed; a thread hop costs as much).
VERIFY_INLINE_BYTES = 2 << 20


def plan_chunks(
    num_blocks: int,
    num_layers: int,
    block_layer_nbytes: int,
    chunk_bytes: int,
    skip_layers: tuple[int, ...] = (),
    skip_blocks: int = 0,
) -> list[tuple[int, int, int, int]]:
    """(block_start, block_end, layer_start, layer_end) of each chunk: runs of whole blocks (every layer)
    up to `chunk_bytes`, a power of two of them (the decode engine's page buckets: it writes such a chunk
    as it comes, without a padded copy); a block larger than that is split by layers.

    `skip_layers` of the first `skip_blocks` blocks are not sent: a sender's sliding-window layers of blocks it
    let go of (window_cache.py), which no query of the request reads; those blocks go as runs of the other
    layers."""
    skip_blocks = min(skip_blocks, num_blocks) if skip_layers else 0
    chunks = []
    if skip_blocks:
        runs: list[tuple[int, int]] = []  # the other layers, as runs of adjacent ones
        for layer in range(num_layers):
            if layer in skip_layers:
                continue
            if runs and runs[-1][1] == layer:
                runs[-1] = (runs[-1][0], layer + 1)
            else:
                runs.append((layer, layer + 1))
        for l0, l1 in runs:
            chunks += [
                (b0, b1, l0 + m0, l0 + m1) for b0, b1, m0, m1 in _whole_block_runs(skip_blocks, l1 - l0, block_layer_nbytes, chunk_bytes)
            ]
    rest = _whole_block_runs(num_blocks - skip_blocks, num_layers, block_layer_nbytes, chunk_bytes)
    return chunks + [(b0 + skip_blocks, b1 + skip_blocks, l0, l1) for b0, b1, l0, l1 in rest]


def _whole_block_runs(num_blocks: int, num_layers: int, block_layer_nbytes: int, chunk_bytes: int) -> list[tuple[int, int, int, int]]:
    per_block = num_layers * block_layer_nbytes
    if per_block <= chunk_bytes:
        step = 1 << (max(1, chunk_bytes // per_block).bit_length() - 1)
        return [(b, min(b + step, num_blocks), 0, num_layers) for b in range(0, num_blocks, step)]
    lstep = max(1, chunk_bytes // block_layer_nbytes)
    return [(b, b + 1, l, min(l + lstep, num_layers)) for b in range(num_blocks) for l in range(0, num_layers, lstep)]


@dataclass(slots=True)
class KVExport:
    """A request's KV on the host, cut into checksummed chunks (the prefill half's product)."""

    request_id: str
    chunks: list[KVChunk]
    staged_seconds: float = 0.0  # from the engine's dispatch to the host copy being complete

    @property
    def headers(self) -> tuple[KVChunkHeader, ...]:
        return tuple(c.header for c in self.chunks)

    @property
    def nbytes(self) -> int:
        return sum(c.header.nbytes for c in self.chunks)

    @staticmethod
    def build(staged: StagedKV, chunk_bytes: int = DEFAULT_CHUNK_BYTES, reserve: Reserve | None = None) -> KVExport:
        """Waits for the staged copy piece by piece (blocking: call it off the event loop and off the engine
        thread; a piece is checksummed while later ones are still being copied) and cuts each piece into
        chunks. Whole-block chunks are views of the host copy: no extra pass over memory.

        `reserve` (the transport's, `KVTransport.reserve`) is asked, before any piece is waited on, for a
        buffer per KV chunk; where it gives them (a shared-memory arena), each chunk is copied there as
        soon as its piece is on the host, checksummed in the same pass (`copy_checksummed`), and its data is
        that copy: the copy out overlaps the device's copy of the later pieces, and nothing is copied after."""
        rid = staged.request_id
        plan = _plan(staged, chunk_bytes)
        buffers = reserve(rid, [c.nbytes for c in plan]) if reserve is not None and plan else None
        chunks: list[KVChunk] = []
        piece, host = None, None
        for i, c in enumerate(plan):
            if c.piece is not piece:
                piece, host = c.piece, np.asarray(c.piece)[: c.count]  # waits for this piece's device->host copy
            data = host[c.b0 : c.b1] if c.whole else host[c.b0 : c.b1, c.l0 : c.l1]
            checksum = None
            if buffers is not None:
                checksum = copy_checksummed(data, buffers[i])
                data = buffers[i].view(data.dtype).reshape(data.shape)
            elif not c.whole:
                data = np.ascontiguousarray(data)
            chunks.append(KVChunk(KVChunkHeader.of(rid, i, "kv", c.base + c.b0, c.base + c.b1, c.l0, c.l1, data, checksum), data))
        if staged.state is not None:
            chunks.append(KVChunk.of(rid, len(chunks), "state", 0, 0, 0, 0, staged.pack_state(staged.state)))
        return KVExport(rid, chunks, time.perf_counter() - staged.staged_at)


@dataclass(frozen=True, slots=True)
class _PlannedChunk:
    """A KV chunk of an export, known from the staged pieces' shapes before their data is on the host:
    blocks [b0, b1) x layers [l0, l1) of `piece` (whose first `count` rows are blocks from `base` on)."""

    piece: Any
    count: int
    base: int
    b0: int
    b1: int
    l0: int
    l1: int
    whole: bool  # every layer: a contiguous slice of the piece
    nbytes: int


def _plan(staged: StagedKV, chunk_bytes: int) -> list[_PlannedChunk]:
    plan = []
    starts = [first for first, _ in staged.pieces] + [staged.num_blocks]
    for (first, piece), end in zip(staged.pieces, starts[1:]):
        count = min(piece.shape[0], end - first)  # a piece's rows past its blocks are padding
        if count <= 0:
            continue
        num_layers = piece.shape[1]
        block_layer_nbytes = math.prod(piece.shape[2:]) * np.dtype(piece.dtype).itemsize
        base = staged.block_start + first
        skip = max(0, staged.window_start_block - base)  # this piece's blocks whose sliding layers were let go of
        for b0, b1, l0, l1 in plan_chunks(count, num_layers, block_layer_nbytes, chunk_bytes, staged.window_layers, skip):
            whole = (l0, l1) == (0, num_layers)
            plan.append(_PlannedChunk(piece, count, base, b0, b1, l0, l1, whole, (b1 - b0) * (l1 - l0) * block_layer_nbytes))
    return plan


# A transport's offer of buffers for an export's KV chunks (request id, each chunk's bytes): one writable uint8
# array per chunk, or None to take the chunks as they are in `publish`.
Reserve = Callable[[str, list[int]], list[np.ndarray] | None]


Published = tuple[tuple[KVChunkHeader, ...], tuple[Any, ...]]  # an export's headers and its transport handles


def merge_published(parts: list[Published]) -> Published:
    """One handoff's chunk list from the parts several hosts published (each numbered its chunks from 0):
    concatenated and renumbered, so that every chunk's index is its position in the handoff."""
    headers = [dataclasses.replace(h, index=i) for i, h in enumerate(h for hs, _ in parts for h in hs)]
    handles = [x for _, xs in parts for x in xs]
    return tuple(headers), tuple(handles)


class PeerExports(Protocol):
    """The other hosts of a multi-host prefill engine. Each staged the part of a handoff's KV its devices
    hold (`EngineCore._stage_held` runs on every host); `export` has each publish its part through its own
    transport and returns what they published, `unpublish` lets go of it. The cluster implements it over
    its follower actors (cluster/multihost.py)."""

    async def export(self, request_id: str, chunk_bytes: int) -> list[Published]: ...

    def unpublish(self, request_id: str) -> None: ...


class KVTransport(Protocol):
    """How chunks cross from a prefill worker to a decode worker. The prefill side publishes an export
    (one handle per chunk, carried in the handoff) and unpublishes it when the handoff is over; the
    decode side fetches a chunk's data by its handle. Handles must survive the trip through the handoff
    message (pickled by Ray)."""

    name: str

    def reserve(self, request_id: str, sizes: list[int]) -> list[np.ndarray] | None:
        """Buffers the export's KV chunks are to be copied into as they are built (`Reserve`), or None.
        Called from the thread that builds the export; `publish` then finds them there, and `unpublish`
        lets go of them (also when the export failed before it was published)."""
        ...

    async def publish(self, export: KVExport) -> tuple[Any, ...]: ...

    def unpublish(self, request_id: str) -> None: ...

    async def fetch(self, header: KVChunkHeader, handle: Any) -> np.ndarray: ...


class LocalTransport:
    """Both halves in one process (tests, an in-process prefill/decode pair): the handle is the data."""

    name = "local"

    def reserve(self, request_id: str, sizes: list[int]) -> list[np.ndarray] | None:
        return None

    async def publish(self, export: KVExport) -> tuple[Any, ...]:
        return tuple(c.data for c in export.chunks)

    def unpublish(self, request_id: str) -> None:
        pass

    async def fetch(self, header: KVChunkHeader, handle: Any) -> np.ndarray:
        return handle


# ---------------------------------------------------------------------------------------- decode half


class KVTransferFailed(RuntimeError):
    """The KV could not be moved: the request prefills locally instead."""


@dataclass(slots=True)
class ImportStats:
    bytes: int = 0
    state_bytes: int = 0
    skipped_bytes: int = 0  # chunks the decode side's own prefix cache already held
    chunks: int = 0
    refetched: int = 0
    corrupt: int = 0
    first_chunk_s: float | None = None  # from the start to the first chunk written


Fetch = Callable[[KVChunkHeader, Any], Awaitable[np.ndarray]]
# (header, data, last): `last` is the final chunk written, so the write may also mark the KV ready (one engine
# call instead of two: the engine runs its calls in order, so every earlier write is done by then).
Write = Callable[[KVChunkHeader, np.ndarray, bool], Awaitable[bool]]


def needed(headers: tuple[KVChunkHeader, ...], from_block: int) -> list[int]:
    """Indices of the chunks a decode worker must fetch when its prefix cache holds blocks [0, from_block)."""
    return [i for i, h in enumerate(headers) if h.kind == "state" or h.block_end > from_block]


async def import_chunks(
    headers: tuple[KVChunkHeader, ...],
    handles: tuple[Any, ...],
    from_block: int,
    fetch: Fetch,
    write: Write,
    stats: ImportStats,
    max_in_flight: int = 4,
    on_corrupt: Callable[[KVChunkCorrupt], None] | None = None,
) -> bool:
    """Fetches, verifies and writes every chunk the decode side lacks, up to `max_in_flight` at once.
    A chunk that fails its check (or its fetch) is fetched once more; a second failure raises
    `KVTransferFailed`. `write` returning False means the request stopped waiting (aborted): stop.
    Returns whether every chunk was written (the last write said so)."""
    if len(headers) != len(handles):
        raise KVTransferFailed(f"the handoff has {len(headers)} chunk headers and {len(handles)} handles")
    start = time.perf_counter()
    todo = needed(headers, from_block)
    stats.skipped_bytes += sum(h.nbytes for i, h in enumerate(headers) if i not in set(todo))
    slots = asyncio.Semaphore(max(1, max_in_flight))
    unwritten = [len(todo)]

    async def one(i: int) -> bool:
        header = headers[i]
        async with slots:
            data = await _fetch_verified(header, handles[i], fetch, stats, on_corrupt)
        unwritten[0] -= 1
        if not await write(header, data, unwritten[0] == 0):
            return False
        stats.chunks += 1
        stats.bytes += header.nbytes
        if header.kind == "state":
            stats.state_bytes += header.nbytes
        if stats.first_chunk_s is None:
            stats.first_chunk_s = time.perf_counter() - start
        return True

    tasks = [asyncio.ensure_future(one(i)) for i in todo]
    try:
        for done in asyncio.as_completed(tasks):
            if not await done:
                return False
        return True
    finally:
        for t in tasks:
            t.cancel()


async def _fetch_verified(header: KVChunkHeader, handle: Any, fetch: Fetch, stats: ImportStats, on_corrupt) -> np.ndarray:
    for attempt in range(2):
        try:
            data = await fetch(header, handle)
            if header.nbytes < VERIFY_INLINE_BYTES:
                return KVChunk(header, data).verified(header)
            # A large chunk's checksum takes a fraction of a millisecond per 8 MiB: off the event loop
            # (the decode worker streams from it), and several chunks' at once (xxhash lets go of the GIL).
            return await asyncio.to_thread(KVChunk(header, data).verified, header)
        except KVChunkCorrupt as e:
            stats.corrupt += 1
            if on_corrupt is not None:
                on_corrupt(e)
            problem: Exception = e
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the transport's own error (lost object, dead owner)
            problem = e
        if attempt == 0:
            stats.refetched += 1
            log.warning("KV chunk %d of %s: %s; fetching it again", header.index, header.request_id, problem)
    raise KVTransferFailed(f"KV chunk {header.index} of {header.request_id} failed twice: {problem}")
