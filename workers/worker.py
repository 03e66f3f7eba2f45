"""Prefill and decode workers: one engine each, with the handoff protocol between them.

These classes know nothing of Ray Serve; `cluster/app.py` wraps them in deployments and supplies the
transport (how a decode worker fetches a KV chunk from a prefill worker).

Handoff: the prefill worker computes the uncached part of the prompt, samples the first token and
holds the prompt's KV blocks. The decode worker allocates blocks, fetches the KV in chunks of layers
(all chunk requests in flight at once, each imported as it arrives) and continues decoding. Held KV
that nobody fetches is released after `hold_timeout_s`, so a vanished decode side leaks nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import jax
import numpy as np

from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.engine.engine import KVImport, RequestOutput
from workers.engine.sampler import check_stop
from workers.engine.sampling_params import SamplingParams

log = logging.getLogger("moray.worker")

FetchChunk = Callable[[int, int], Awaitable[np.ndarray]]


@dataclass
class PrefillResult:
    request_id: str
    worker_id: str
    first_token: int
    text: str  # the first token's text (trimmed if it completed a stop string)
    finished: bool  # the first token already ends the request
    finish_reason: str | None
    num_cached_tokens: int
    prompt_len: int
    num_layers: int
    first_logprobs: dict[int, float] | None = None
    prefill_time_s: float = 0.0


@dataclass
class StreamUpdate:
    """What a worker streams to the front end per engine output: only what changed, so an update costs
    the same to send at the 1st token as at the 1000th, whatever the prompt's length (a `RequestOutput`
    carries the prompt and everything produced so far)."""

    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_tokens: int  # output tokens so far
    new_logprobs: list[dict[int, float]] | None = None  # one per new token, when the request asked

    @staticmethod
    def of(out: RequestOutput) -> "StreamUpdate":
        new = len(out.new_token_ids)
        return StreamUpdate(
            list(out.new_token_ids),
            out.delta_text,
            out.finished,
            out.finish_reason,
            out.num_cached_tokens,
            len(out.token_ids),
            out.logprobs[-new:] if (out.logprobs and new) else None,
        )


@dataclass
class HandoffStats:
    bytes: int = 0  # everything moved: attention KV plus linear-attention state
    seconds: float = 0.0
    chunks: int = 0
    state_bytes: int = 0  # of `bytes`, the linear-attention state (hybrid models)


@dataclass
class WorkerCounters:
    handoffs: int = 0
    handoff_bytes: int = 0
    handoff_state_bytes: int = 0
    handoff_seconds: float = 0.0
    held_released_by_timeout: int = 0
    import_failures: int = 0
    misrouted: int = 0  # requests that reached this worker although the router chose another
    history: list[HandoffStats] = field(default_factory=list)


class EngineWorker:
    role = "both"

    def __init__(self, engine_config: EngineConfig, show_progress: bool = False, engine: AsyncEngine | None = None):
        self.config = engine_config
        self.worker_id = engine_config.worker_id
        self.engine = engine or AsyncEngine(engine_config, show_progress=show_progress)
        self.counters = WorkerCounters()

    @property
    def num_layers(self) -> int:
        """Units of a KV handoff: full-attention layers, plus the packed state of a hybrid model."""
        return self.engine.core.num_handoff_layers

    def load(self) -> dict:
        s = self.engine.stats()
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_usage": s.kv_usage,
            "num_free_blocks": s.num_free_blocks,
            "num_total_blocks": s.num_total_blocks,
            "tokens_in_flight": s.num_tokens_in_flight,
            "pending_prefill_tokens": s.num_pending_prefill_tokens,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_host_hits": s.host_hit_tokens,
            "host_kv_usage": s.host_blocks_used / s.host_blocks_total if s.host_blocks_total else 0.0,
            "host_blocks_saved": s.host_blocks_saved,
            "host_blocks_loaded": s.host_blocks_loaded,
            "host_blocks_evicted": s.host_blocks_evicted,
            "host_copy_seconds": s.host_copy_seconds,
            "evicted_live_session_blocks": s.evicted_live_session_blocks,
            "num_preemptions": s.num_preemptions,
            "num_held": s.num_held,
            "num_importing": s.num_importing,
            "num_requests": len(self.engine.core.scheduler.requests),
            "epoch": self.engine.core.events.epoch,
            "last_seq": self.engine.core.events.last_seq,
            "handoffs": self.counters.handoffs,
            "handoff_bytes": self.counters.handoff_bytes,
            "handoff_state_bytes": self.counters.handoff_state_bytes,
            "handoff_seconds": self.counters.handoff_seconds,
            # KV bytes one token takes over all layers (MLA: one latent row per layer, no head axis).
            "kv_bytes_per_token": self.engine.core.runner.kv_bytes_per_block // self.engine.core.config.block_size,
            "misrouted": self.counters.misrouted,
            "healthy": self.engine.healthy,
            "num_processes": jax.process_count(),  # > 1: one engine over several hosts
            "sparse_blocks": self.engine.core.cfg.is_hybrid,  # publishes only block boundaries (the router's lookup)
            "ts": time.time(),  # when this was measured (a router tells a dead worker's last report by it)
        }

    async def _add(self, request_id: str, prompt: list[int], params: SamplingParams, **kw):
        """`engine.add_request`, safe against cancellation: a call cancelled (the client left) just as the
        engine thread took the request would leave it there with nobody to abort it (running to its end,
        holding KV, or waiting forever for an import); abort it then (a no-op if it never got in)."""
        try:
            return await self.engine.add_request(request_id, prompt, params, **kw)
        except asyncio.CancelledError:
            if self.engine.healthy:
                self.engine.submit(lambda core: core.abort(request_id))
            raise

    async def _outputs(self, request_id: str, prompt: list[int], params: SamplingParams, **kw) -> AsyncIterator[RequestOutput]:
        stream = await self._add(request_id, prompt, params, **kw)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()  # before the end: aborts the request and frees its blocks

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, session_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Prefill and decode locally (colocated mode, or a short uncached prompt)."""
        async for out in self._outputs(request_id, prompt, params, session_id=session_id):
            yield out


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, engine_config: EngineConfig, hold_timeout_s: float = 60.0, **kw):
        super().__init__(engine_config, **kw)
        self.hold_timeout_s = hold_timeout_s
        # Requests released before their KV was held (the client left during the prefill): let go of
        # the KV as soon as the prefill ends instead of holding it for nobody. request -> when (monotonic)
        self._unwanted: dict[str, float] = {}

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, session_id: str | None = None) -> PrefillResult:
        start = time.perf_counter()
        first_only = params.model_copy(update={"max_tokens": 1, "min_tokens": min(params.min_tokens, 1), "stop": ()})
        out = None
        async for out in self._outputs(request_id, prompt, first_only, hold_kv=True, session_id=session_id):  # noqa: B007 - the last one
            pass
        token = out.token_ids[0]
        eos = self.engine.core.eos_token_ids
        stop = check_stop([token], "", out.text, params, eos)
        result = PrefillResult(
            request_id=request_id,
            worker_id=self.worker_id,
            first_token=token,
            text=stop.text,
            finished=stop.finished,
            finish_reason=stop.reason,
            num_cached_tokens=out.num_cached_tokens,
            prompt_len=len(prompt),
            num_layers=self.num_layers,
            first_logprobs=out.logprobs[0] if out.logprobs else None,
            prefill_time_s=time.perf_counter() - start,
        )
        if result.finished or self._unwanted.pop(request_id, None) is not None:
            await self.engine.release_kv(request_id)
        else:
            asyncio.get_running_loop().call_later(self.hold_timeout_s, self._expire_hold, request_id)
        return result

    def _expire_hold(self, request_id: str) -> None:
        def release(core):
            if core.release_kv(request_id):
                self.counters.held_released_by_timeout += 1
                log.warning("released unclaimed KV of %s after %.0fs", request_id, self.hold_timeout_s)

        if self.engine.healthy:
            self.engine.submit(release)

    async def kv_chunk(self, request_id: str, layer_start: int, layer_end: int) -> np.ndarray:
        return await self.engine.export_kv(request_id, layer_start, layer_end)

    async def release(self, request_id: str) -> bool:
        """Frees the KV held for a handoff (idempotent). Called before the hold exists (the client left
        during the prefill), it makes the prefill let go of the KV when it ends."""
        if await self.engine.release_kv(request_id):
            return True
        now = time.monotonic()
        if len(self._unwanted) > 1024:
            self._unwanted = {r: t for r, t in self._unwanted.items() if t > now - self.hold_timeout_s}
        self._unwanted[request_id] = now
        return await self.engine.release_kv(request_id)  # held in the meantime


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(self, engine_config: EngineConfig, layers_per_chunk: int = 1, **kw):
        super().__init__(engine_config, **kw)
        self.layers_per_chunk = layers_per_chunk

    async def generate_from_prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        handoff: PrefillResult,
        fetch_chunk: FetchChunk,
        release: Callable[[], Awaitable[object]] | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Continues a request prefilled elsewhere: imports its KV chunk by chunk, then decodes."""
        kv_import = KVImport(handoff.first_token, handoff.num_cached_tokens, handoff.first_logprobs)
        try:
            stream = await self._add(request_id, prompt, params, kv_import=kv_import, session_id=session_id)
        except BaseException:
            # Refused or cancelled before the import began: nobody else will free the prefill side's KV.
            await asyncio.shield(_release_quietly(release))
            raise
        importer = asyncio.create_task(self._import_all(request_id, fetch_chunk, release))
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()
            if not importer.done():
                importer.cancel()
                # Cancelled mid-transfer: still tell the prefill side to let go (idempotent there).
                await _release_quietly(release)

    async def _import_all(self, request_id: str, fetch_chunk: FetchChunk, release) -> None:
        start = time.perf_counter()
        stats = HandoffStats()

        core = self.engine.core

        async def one(layer_start: int, layer_end: int) -> None:
            data = await fetch_chunk(layer_start, layer_end)
            stats.bytes += data.nbytes
            if layer_start >= core.cfg.num_kv_layers:
                stats.state_bytes += data.nbytes
            stats.chunks += 1
            await self.engine.import_kv(request_id, layer_start, data)

        try:
            await asyncio.gather(*(one(a, b) for a, b in core.handoff_chunks(self.layers_per_chunk)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any transport failure: recompute locally
            log.warning("KV import for %s failed (%s); prefilling locally", request_id, e)
            self.counters.import_failures += 1
            self.engine.submit(lambda c: c.recompute_instead_of_import(request_id))
        else:
            # Counted before the release: a short request can finish (and cancel this task) while the
            # release is in flight, and the bytes it moved must still show.
            stats.seconds = time.perf_counter() - start
            self._count_handoff(stats)
        finally:
            # Shielded: the cancellation above must not leave the prefill side holding the blocks.
            await asyncio.shield(_release_quietly(release))

    def _count_handoff(self, stats: HandoffStats) -> None:
        self.counters.handoffs += 1
        self.counters.handoff_bytes += stats.bytes
        self.counters.handoff_state_bytes += stats.state_bytes
        self.counters.handoff_seconds += stats.seconds
        self.counters.history = (self.counters.history + [stats])[-256:]


async def _release_quietly(release) -> None:
    """Frees the prefill side's held KV; failures are harmless (its hold timeout frees it anyway)."""
    if release is None:
        return
    try:
        await release()
    except Exception:  # noqa: BLE001
        pass
