"""KV transports on a Ray cluster (the mechanism is `workers/kv_transfer.py`; this is only the wiring).

`object_store` (the default, any Ray cluster): the prefill replica `ray.put`s each chunk and the handoff
carries the object references; the decode replica awaits them. Ray moves the bytes (zero-copy within a
node, its object transfer between nodes), so a transfer never waits in a replica's Serve request queue
behind prefills (`max_ongoing_requests` covers a whole replica). Passes over memory: the device gather,
the device-to-host copy (none on CPU: the host reads the staged array in place), the copy into the object
store, the checksum (XXH3) on each side, and the decode side's write into its pages (its program reads a
whole-bucket chunk from the object store's 64-byte-aligned buffer without a copy).

A prefill replica that dies takes its objects with it (Ray frees what a dead owner put): the decode
side's fetch fails, it fetches once more, then prefills locally.

`shared_memory` (prefill and decode replicas on one node): the prefill process copies each export into
its own shared-memory arena (an anonymous memfd of `kv_transfer.shared_memory_mib`, created empty and
kept: pages touched once stay, so later exports write into warm memory, where `ray.put` writes into
fresh object-store pages: 50 against 14 ms for 66 MiB) while it builds the export (`reserve`: a chunk is
copied in and checksummed in one pass as soon as its piece is on the host), and the handoff carries (node, process,
descriptor, offset) handles; the decode side maps the arena read-only through /proc/<pid>/fd/<fd> and
reads the chunk in place. A region is reused only after the decode side released the handoff or the hold
expired (`hold_timeout_s`, longer than the decode side's own `timeout_s`, after which it no longer
reads). An export that does not fit goes through the object store; a decode replica on another node
cannot map the arena: its fetch fails and it prefills locally, so a cluster over several nodes keeps
`object_store`. The arena has no name: a prefill process that dies, even killed, leaves nothing behind
(a decode replica that had mapped it still reads what it holds, checked by the chunk checksums as
always; one that had not prefills locally).

A direct device-to-device transport (`jax.experimental.transfer` where the backend has it) is a class
with the same four methods, selected in `build_transport`; nothing else changes.
"""

from __future__ import annotations

import asyncio
import bisect
import mmap
import os
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.kv_transfer import KVExport, KVTransferFailed, KVTransport
from workers.messages import KVChunkHeader

INLINE_BYTES = 1 << 20


class ObjectStoreTransport:
    """`inline_bytes`: an export this small travels inside the handoff message itself (Ray moves that message
    anyway): no `ray.put`, no separate fetch; the checksums still guard it."""

    name = "object_store"

    def __init__(self, inline_bytes: int = INLINE_BYTES) -> None:
        self.inline_bytes = inline_bytes
        self._refs: dict[str, list] = {}  # request -> its chunks' references, held until unpublished

    def reserve(self, request_id: str, sizes: list[int]) -> list[np.ndarray] | None:
        return None  # `ray.put` copies into the store's own buffers

    async def publish(self, export: KVExport) -> tuple[Any, ...]:
        import ray

        if export.nbytes <= self.inline_bytes:
            return tuple(c.data for c in export.chunks)
        # As raw bytes: Ray serialises a bfloat16 array through pickle (3x slower to put here, and copied again
        # on the way out), and the header says what the bytes are.
        refs = await asyncio.to_thread(lambda: [ray.put(_as_bytes(c.data)) for c in export.chunks])
        self._refs[export.request_id] = refs
        return tuple(refs)

    def unpublish(self, request_id: str) -> None:
        # The decode side's references (borrowed through the handoff) keep what it still reads alive.
        self._refs.pop(request_id, None)

    async def fetch(self, header: KVChunkHeader, handle: Any) -> np.ndarray:
        if isinstance(handle, np.ndarray):
            return handle
        if isinstance(handle, ShmChunk):  # a prefill replica on shared memory: read where it wrote
            return _ARENAS.read(handle)
        raw = await handle
        if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.nbytes != header.nbytes:
            return raw  # not what was put: the chunk's check refuses it
        return raw.view(_dtype(header.dtype)).reshape(header.shape)

    @property
    def num_published(self) -> int:
        return len(self._refs)


# ---------------------------------------------------------------------------------------- shared memory

ALIGN = 64  # every chunk starts on a 64-byte boundary, as the object store's buffers do (read in place)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class ShmChunk:
    """Where a chunk lies: in the arena of process `pid` on node `node` (its descriptor `fd`, tagged `tag`
    so that a recycled pid or descriptor is never read as the arena), from `offset`."""

    node: str
    pid: int
    fd: int
    tag: bytes
    offset: int
    dtype: str  # its name: bfloat16's `dtype.str` is "<V2", which reads back as raw bytes
    shape: tuple[int, ...]


class Arena:
    """Regions of one anonymous shared-memory file (memfd): first fit over a sorted free list, neighbours
    merged on free. Other processes map it through /proc/<pid>/fd/<fd>; it has no name, so nothing is
    left behind when its process dies, however it dies (the memory goes with the last mapping). Its first
    `ALIGN` bytes hold a random tag."""

    def __init__(self, nbytes: int):
        self.fd = os.memfd_create("moray-kv", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, ALIGN + nbytes)
        self.map = mmap.mmap(self.fd, ALIGN + nbytes)
        self.tag = uuid.uuid4().bytes
        self.map[: len(self.tag)] = self.tag
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(ALIGN, nbytes)]  # (offset, size), by offset

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    def allocate(self, nbytes: int) -> int | None:
        nbytes = _aligned(nbytes)
        for i, (offset, size) in enumerate(self._free):
            if size >= nbytes:
                self._free[i : i + 1] = [(offset + nbytes, size - nbytes)] if size > nbytes else []
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        nbytes = _aligned(nbytes)
        i = bisect.bisect(self._free, (offset, 0))
        self._free.insert(i, (offset, nbytes))
        # Merge with the region after, then the one before.
        if i + 1 < len(self._free) and offset + nbytes == self._free[i + 1][0]:
            self._free[i : i + 2] = [(offset, nbytes + self._free[i + 1][1])]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1 : i + 1] = [(self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])]

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return np.frombuffer(self.map, np.uint8, nbytes, offset)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class _MappedArenas:
    """A decode process's read-only mappings of the prefill processes' arenas (the most recent 16: an
    arena no longer mapped here stays alive while a chunk read from it is, and is mapped again if a
    handoff names it)."""

    KEEP = 16

    def __init__(self) -> None:
        self._maps: OrderedDict[tuple[int, int, bytes], mmap.mmap] = OrderedDict()

    def read(self, handle: ShmChunk) -> np.ndarray:
        if handle.node != _node_id():
            raise KVTransferFailed(f"KV chunk in shared memory on node {handle.node}: this replica runs on another node")
        key = (handle.pid, handle.fd, handle.tag)
        mapped = self._maps.get(key)
        if mapped is None:
            mapped = self._map(handle)
            self._maps[key] = mapped
            while len(self._maps) > self.KEEP:
                self._maps.popitem(last=False)
        self._maps.move_to_end(key)
        count = int(np.prod(handle.shape))
        return np.frombuffer(mapped, _dtype(handle.dtype), count, handle.offset).reshape(handle.shape)

    @staticmethod
    def _map(handle: ShmChunk) -> mmap.mmap:
        # Its process gone, the path is too (FileNotFoundError): the decode side prefills locally.
        fd = os.open(f"/proc/{handle.pid}/fd/{handle.fd}", os.O_RDONLY)
        try:
            mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if mapped[: len(handle.tag)] != handle.tag:
            mapped.close()
            raise KVTransferFailed(f"process {handle.pid}'s descriptor {handle.fd} is no longer its KV arena")
        return mapped


_ARENAS = _MappedArenas()


def _as_bytes(data: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def _dtype(name: str) -> np.dtype:
    import ml_dtypes  # noqa: F401 - registers bfloat16 and the float8 types by name

    return np.dtype(name)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


class SharedMemoryTransport(ObjectStoreTransport):
    """`arena_bytes` of shared memory for this prefill process's exports (see the module's docstring); an
    export that does not fit now goes through the object store (`fallbacks` counts them).

    The KV chunks go into the arena as the export is built (`reserve`: each is copied there as soon as its
    piece of the staged copy is on the host, checksummed in the same pass), so `publish` copies only what
    was not reserved (a hybrid model's state)."""

    name = "shared_memory"

    def __init__(self, arena_bytes: int, inline_bytes: int = INLINE_BYTES) -> None:
        super().__init__(inline_bytes)
        self.arena_bytes = arena_bytes
        self.arena: Arena | None = None  # created at the first export that needs it
        self._lock = threading.Lock()  # `reserve` runs on the exporting thread, the rest on the event loop
        self._regions: dict[str, list[tuple[int, int]]] = {}  # request -> its regions (offset, bytes)
        self._reserved: dict[str, list[int]] = {}  # request -> offsets of its first chunks, copied in by the build
        self.fallbacks = 0

    def reserve(self, request_id: str, sizes: list[int]) -> list[np.ndarray] | None:
        if sum(sizes) <= self.inline_bytes:
            return None
        offsets = self._allocate(request_id, sizes)
        if offsets is None:
            return None  # `publish` tries the whole export, then falls back to the object store
        self._reserved[request_id] = offsets
        return [self.arena.view(o, n) for o, n in zip(offsets, sizes)]

    async def publish(self, export: KVExport) -> tuple[Any, ...]:
        rid = export.request_id
        offsets = self._reserved.pop(rid, [])
        if not offsets and export.nbytes <= self.inline_bytes:
            return await super().publish(export)
        rest = export.chunks[len(offsets) :]
        if rest:
            more = self._allocate(rid, [c.data.nbytes for c in rest])
            if more is None:
                self.fallbacks += 1
                try:
                    return await super().publish(export)  # copies the reserved chunks out of the arena
                finally:
                    self._free(rid)
            try:
                await asyncio.to_thread(self._copy_in, rest, more)
            except BaseException:
                self.unpublish(rid)
                raise
            offsets = offsets + more
        node, pid, arena = _node_id(), os.getpid(), self.arena
        return tuple(ShmChunk(node, pid, arena.fd, arena.tag, o, c.data.dtype.name, c.data.shape) for c, o in zip(export.chunks, offsets))

    def _allocate(self, request_id: str, sizes: list[int]) -> list[int] | None:
        """One region for chunks of `sizes` bytes, each on an `ALIGN` boundary: their offsets, or None."""
        with self._lock:
            if self.arena is None:
                self.arena = Arena(self.arena_bytes)
            starts, total = [], 0
            for n in sizes:
                starts.append(total)
                total += _aligned(n)
            base = self.arena.allocate(total)
            if base is None:
                return None
            self._regions.setdefault(request_id, []).append((base, total))
            return [base + s for s in starts]

    def _copy_in(self, chunks: list, offsets: list[int]) -> None:
        for c, o in zip(chunks, offsets):
            src = _as_bytes(c.data)
            self.arena.view(o, src.nbytes)[:] = src

    def _free(self, request_id: str) -> None:
        with self._lock:
            self._reserved.pop(request_id, None)
            for region in self._regions.pop(request_id, []):
                self.arena.free(*region)

    def unpublish(self, request_id: str) -> None:
        self._free(request_id)
        super().unpublish(request_id)

    @property
    def num_published(self) -> int:
        return len(self._regions) + super().num_published


def build_transport(name: str, inline_bytes: int = INLINE_BYTES, shared_memory_bytes: int = 1 << 30) -> KVTransport:
    if name == "object_store":
        return ObjectStoreTransport(inline_bytes)
    if name == "shared_memory":
        return SharedMemoryTransport(shared_memory_bytes, inline_bytes)
    raise ValueError(f"kv_transfer.transport {name!r} is not available here (available: object_store, shared_memory)")
