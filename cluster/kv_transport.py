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

A direct device-to-device transport (`jax.experimental.transfer` where the backend has it) is a class
with the same three methods, selected in `build_transport`; nothing else changes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from workers.kv_transfer import KVExport, KVTransport
from workers.messages import KVChunkHeader

INLINE_BYTES = 1 << 20


class ObjectStoreTransport:
    """`inline_bytes`: an export this small travels inside the handoff message itself (Ray moves that message
    anyway): no `ray.put`, no separate fetch; the checksums still guard it."""

    name = "object_store"

    def __init__(self, inline_bytes: int = INLINE_BYTES) -> None:
        self.inline_bytes = inline_bytes
        self._refs: dict[str, list] = {}  # request -> its chunks' references, held until unpublished

    async def publish(self, export: KVExport) -> tuple[Any, ...]:
        import ray

        if export.nbytes <= self.inline_bytes:
            return tuple(c.data for c in export.chunks)
        refs = await asyncio.to_thread(lambda: [ray.put(c.data) for c in export.chunks])
        self._refs[export.request_id] = refs
        return tuple(refs)

    def unpublish(self, request_id: str) -> None:
        # The decode side's references (borrowed through the handoff) keep what it still reads alive.
        self._refs.pop(request_id, None)

    async def fetch(self, header: KVChunkHeader, handle: Any) -> np.ndarray:
        return handle if isinstance(handle, np.ndarray) else await handle

    @property
    def num_published(self) -> int:
        return len(self._refs)


def build_transport(name: str, inline_bytes: int = INLINE_BYTES) -> KVTransport:
    if name == "object_store":
        return ObjectStoreTransport(inline_bytes)
    raise ValueError(f"kv_transfer.transport {name!r} is not available here (available: object_store)")
