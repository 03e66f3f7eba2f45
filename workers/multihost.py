"""One engine over several hosts: the leader's engine core drives identical cores on the other hosts.

A multi-host replica is one SPMD program: every process of the `jax.distributed` cluster must run the
same jitted computations in the same order, each on the shards its devices hold. The engine core is
deterministic given the sequence of calls made on it (scheduling, block allocation and sampling seeds
depend only on that sequence and the engine seed), so the leader records every state-changing call
(`REPLICATED_METHODS`) and sends it, in order, to a follower core on each other host before running it
itself. The followers' collectives meet the leader's; only the leader's outputs are used.

Transport-free: the leader's `send(op)` delivers an op to every follower in order (the cluster uses Ray
actor calls, which keep their submission order); `EngineFollower.apply(op)` runs one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable

import jax

from .engine.config import EngineConfig
from .engine.engine import EngineCore, StagedKV
from .kv_transfer import KVExport, KVTransferFailed, KVTransport, Published

log = logging.getLogger("moray.engine")

# EngineCore methods that change its state or run device computations. Everything else (stats, the
# event publisher, reading requests) is leader-local.
REPLICATED_METHODS = frozenset(
    {
        "add_request",
        "abort",
        "step",
        "import_kv",
        "import_state",
        "finish_import",
        "release_kv",
        "recompute_instead_of_import",
        "clear_prefix_cache",
        "rebalance_experts",
    }
)

Op = tuple[str, tuple, dict]


class ReplicatedCore:
    """The leader's view of a multi-host engine: an `EngineCore` whose state-changing calls are sent to
    the followers first. Pass it to `AsyncEngine(core=...)`."""

    def __init__(self, core: EngineCore, send: Callable[[Op], None]):
        self._core = core
        self._send = send

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._core, name)
        if name not in REPLICATED_METHODS:
            return attr

        def replicated(*args, **kwargs):
            self._send((name, args, kwargs))
            return attr(*args, **kwargs)

        return replicated


class EngineFollower:
    """A non-leader host of a multi-host engine: builds the same core (joining `jax.distributed` as the
    process its config names) and runs the leader's ops in order.

    A prefill engine's handoff: the step that finished a `hold_kv` prompt staged, on every host, the part
    of its KV that host holds; `export` (called from another thread than `apply`'s) takes this host's
    part once this follower has run that step, builds its chunks and publishes them."""

    def __init__(self, config: EngineConfig):
        self.core = EngineCore(config, show_progress=False)
        self.ops = 0
        self._applied = threading.Condition()
        self._order = threading.Lock()
        self._next_batch = 0  # the leader's number of the next batch of ops to run
        self._early: dict[int, list[Op]] = {}  # batches that arrived before an earlier one

    def apply(self, ops: list[Op], batch: int | None = None) -> int:
        """Runs ops in the leader's order; returns how many ran so far (the leader checks for errors with it).
        `batch`: the leader's number of this batch (0, 1, ...). A batch that arrives before an earlier one waits
        here and runs when the gap is filled, by the call that fills it: Ray does not promise to run calls to an
        actor with concurrency groups (the follower's) in the order they were sent, and a follower that ran a
        step before the request it should contain would compute another program than the leader's (the
        hosts' collectives then hang). None: right after the batches before it (one caller, in order)."""
        with self._order:
            if batch is None:
                batch = self._next_batch + len(self._early)
            if batch < self._next_batch or batch in self._early:
                raise ValueError(f"batch {batch} of the leader's engine calls arrived twice")
            self._early[batch] = ops
            while self._next_batch in self._early:
                for name, args, kwargs in self._early.pop(self._next_batch):
                    if name not in REPLICATED_METHODS:
                        raise ValueError(f"not a replicated engine call: {name!r}")
                    getattr(self.core, name)(*args, **kwargs)
                    self.ops += 1
                self._next_batch += 1
                with self._applied:  # an export waiting for the step that staged its KV
                    self._applied.notify_all()
        return self.ops

    def take_staged(self, request_id: str, timeout_s: float) -> StagedKV | None:
        """This host's staged part of a handoff, waiting (up to `timeout_s`) for this follower to reach the
        step that staged it: it may run behind the leader."""
        with self._applied:
            self._applied.wait_for(lambda: request_id in self.core.staged, timeout_s)
        return self.core.take_staged(request_id)

    def export(self, request_id: str, transport: KVTransport, chunk_bytes: int, timeout_s: float) -> Published:
        """Publishes this host's part of a handoff's KV; blocks (call it off the thread running `apply`)."""
        staged = self.take_staged(request_id, timeout_s)
        if staged is None:
            raise KVTransferFailed(f"host {jax.process_index()} has no staged KV for {request_id}")
        export = KVExport.build(staged, chunk_bytes)
        return export.headers, asyncio.run(transport.publish(export))
