"""One request's path through the cluster: route -> (remote prefill -> KV handoff) -> decode -> stream.

Protocol-free: the HTTP and gRPC front ends both call `Orchestrator.stream` and format its `Chunk`s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from workers.engine.block_hash import block_hashes
from workers.engine.sampling_params import SamplingParams

from .router.types import RouteDecision, RouteRequest

log = logging.getLogger("moray.cluster")


@dataclass
class Chunk:
    token_ids: list[int]  # new tokens
    text: str  # new text
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    completion_tokens: int  # total so far
    logprobs: list[dict[int, float]] | None = None  # for the new tokens


@dataclass
class RequestTrace:
    """Timings and routing of one request, for metrics."""

    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    end: float | None = None
    decision: RouteDecision | None = None
    remote_prefill: bool = False


class Orchestrator:
    def __init__(self, router, prefill_handle, decode_handle, block_size: int, model_name: str, colocated: bool):
        self.router = router
        self.prefill = prefill_handle
        self.decode = decode_handle
        self.block_size = block_size
        self.model_name = model_name
        self.colocated = colocated

    async def route(self, request_id: str, prompt: list[int], session_id: str | None) -> RouteDecision:
        """Raises `NoWorkersAvailable` when no worker has registered (yet)."""
        hashes = block_hashes(prompt, self.block_size, self.model_name)
        decision = await self.router.aroute(RouteRequest(request_id, hashes, len(prompt), session_id))
        if self.colocated and decision.prefill_worker is not None:
            decision = replace(decision, prefill_worker=None)
        return decision

    async def stream(
        self, request_id: str, prompt: list[int], params: SamplingParams, decision: RouteDecision, trace: RequestTrace
    ) -> AsyncIterator[Chunk]:
        trace.decision = decision
        if decision.prefill_worker is not None:
            trace.remote_prefill = True
            result = await _cancellable(
                self.prefill.prefill.remote(request_id, prompt, params, target_replica=decision.prefill_worker)
            )
            trace.first_token = time.perf_counter()
            first_logprobs = [result.first_logprobs] if result.first_logprobs else None
            yield Chunk([result.first_token], result.text, result.finished, result.finish_reason, result.num_cached_tokens, 1, first_logprobs)
            if result.finished:
                return
            gen = self.decode.options(stream=True).generate_from_prefill.remote(
                request_id, prompt, params, result, target_replica=decision.decode_worker
            )
        else:
            gen = self.decode.options(stream=True).generate.remote(
                request_id, prompt, params, target_replica=decision.decode_worker
            )
        finished = False
        try:
            async for out in gen:
                if trace.first_token is None:
                    trace.first_token = time.perf_counter()
                finished = out.finished
                new = len(out.new_token_ids)
                logprobs = out.logprobs[-new:] if (out.logprobs and new) else None
                yield Chunk(list(out.new_token_ids), out.delta_text, out.finished, out.finish_reason, out.num_cached_tokens, len(out.token_ids), logprobs)
        finally:
            trace.end = time.perf_counter()
            if not finished:
                gen.cancel()  # client went away: the decode replica aborts and frees the KV blocks


async def _cancellable(response) -> Any:
    """Awaits a Serve response; if our caller is cancelled, the replica-side call is cancelled too."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise
