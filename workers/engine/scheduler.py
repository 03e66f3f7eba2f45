"""The scheduler: each step, which requests run and how many tokens each gets.

Continuous batching under one token budget (`max_num_batched_tokens`): running requests first (their
decode token, or the next chunk of an unfinished prefill), then waiting requests in arrival order,
whose prompts are split into chunks when the budget runs out (chunked prefill). A waiting request whose
next uncached block is being computed right now by a running request waits a step for it rather than
computing the same prefix a second time (requests sharing a new system prompt that arrive together:
the second would otherwise miss the cache, as it does in vLLM). When the KV pool runs
dry, the most recently admitted running request is preempted: its blocks are freed and it starts over
later (recompute; the prefix cache usually gives most of it back).
The output is a plain `SchedulerOutput`; the runner turns it into device arrays.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from .kv_cache_manager import BlockCopy, KVCacheManager
from .request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # first position computed this step
    # Per-sequence cache directions for the runner beyond block tables (a hybrid model's state slot and
    # snapshot: `state_cache.StateStep`); None for attention-only models. Opaque to the scheduler.
    cache_step: object | None = None
    # Speculative decoding: the last `num_spec` of the step's tokens are the request's first drafts
    # (`request.spec_token_ids`), verified by this step; they are not part of the request until accepted.
    num_spec: int = 0

    @property
    def completes_known_tokens(self) -> bool:
        """True when this step reaches the end of the request's tokens, so it yields a sampled token."""
        return self.start + self.num_new_tokens - self.num_spec == self.request.num_scheduled_tokens

    @property
    def drafts(self) -> list[int]:
        return self.request.spec_token_ids[: self.num_spec]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int | None = None):
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prefix_waits = 0  # steps a waiting request sat out for a prefix another was computing
        # Finished prefill-only requests whose blocks wait to be exported; and decode-side requests
        # whose blocks are allocated but whose KV is still arriving.
        self.held: dict[str, Request] = {}
        self.importing: dict[str, Request] = {}
        # Requests whose prefix is being copied back from the host KV tier: blocks allocated, the copy
        # started this step; they run from the next one (the request waits, the batch does not).
        self.loading: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request (stop, length or abort) and returns its blocks to the pool at once."""
        if request.status.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.importing.pop(request.request_id, None)
        self.loading.pop(request.request_id, None)
        request.status = status
        self.requests.pop(request.request_id, None)
        if request.hold_kv and status is not RequestStatus.FINISHED_ABORTED:
            self.held[request.request_id] = request
        else:
            self.kv.free(request)

    def release_held(self, request_id: str) -> bool:
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv.free(request)
        return request is not None

    def add_importing(self, request: Request) -> None:
        """A request whose KV arrives from a prefill worker; it is not schedulable until it has."""
        self.requests[request.request_id] = request
        self.importing[request.request_id] = request

    def admit_imported(self, request: Request) -> None:
        """All of its KV arrived: it runs next, ahead of new prompts."""
        self.importing.pop(request.request_id, None)
        self.kv.cache_full_blocks(request)
        self.waiting.appendleft(request)

    def admit_loaded(self, request_ids: list[str]) -> None:
        """Their host-tier blocks are on the device now: they run next, ahead of new prompts."""
        for rid in reversed(request_ids):
            request = self.loading.pop(rid, None)
            if request is not None:
                self.kv.cache_full_blocks(request)
                self.waiting.appendleft(request)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        request.spec_token_ids, request.spec_draft_len = [], 0
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request.request_id)

    def _victim_for(self, request: Request) -> Request:
        """The most recently admitted running request whose blocks can make room for `request` (with
        data-parallel attention, one on the same rank; `request` itself as the last resort)."""
        return next(r for r in reversed(self.running) if self.kv.shares_pool(r, request))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Running requests: decode tokens and continuing prefill chunks.
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted while making room for an earlier request
            if self._ends_with_pending_token(request):
                continue  # the token a step in flight samples is its last: nothing more to compute
            known = request.num_scheduled_tokens - request.num_computed_tokens
            # Drafts ride along a decode token when the budget has room for them.
            num_spec = max(0, min(len(request.spec_token_ids), budget - known))
            n = min(known, budget)
            n = self.kv.chunk_tokens(request, request.num_computed_tokens, n)
            num_spec = num_spec if n == known and self.kv.can_speculate(request) else 0
            while True:
                copies = self.kv.allocate(request, n + num_spec)
                if copies is not None:
                    break
                if num_spec:  # short of blocks: drop the drafts before preempting anyone
                    num_spec = 0
                    continue
                victim = self._victim_for(request)
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            out.scheduled.append(self._scheduled(request, n, num_spec))
            n += num_spec
            out.block_copies += copies
            budget -= n

        # 2. Waiting requests, in order, while budget and sequence slots remain. Requests waiting a step
        # for a prefix being computed are passed over; the scan is bounded so that a burst of them costs
        # each step at most `max_num_seqs` extra look-ups, not a pass over the whole queue.
        computing = self._blocks_being_computed() if self.waiting else {}
        passed_over = 0
        scan = list(islice(self.waiting, self.max_num_seqs - len(self.running) + self.max_num_seqs))
        for request in scan:
            if budget == 0 or len(self.running) >= self.max_num_seqs or passed_over >= self.max_num_seqs:
                break
            if request.num_pending_outputs:
                continue  # preempted while a step in flight samples its next token: back once it is known
            host: list[int] = []
            if request.block_ids:  # KV imported from a prefill worker: blocks already allocated
                prefix = []
            elif request.prompt_logprobs is not None:  # every prompt position's logits are wanted: computed here
                prefix = []
                request.num_computed_tokens = 0
            else:
                prefix = self.kv.cached_prefix(request)
                if self._next_block_is_being_computed(request, len(prefix), computing):
                    self.num_prefix_waits += 1
                    passed_over += 1
                    continue  # next step it is cached
                # The prefix continues in the host tier (if any): those blocks are copied back, not recomputed.
                host = self.kv.host_prefix(request, len(prefix))
                hit = (len(prefix) + len(host)) * self.kv.block_size
                # The last token is always computed: its logits give the first sampled token.
                request.num_computed_tokens = min(hit, request.num_tokens - 1)
            n = self.kv.chunk_tokens(request, request.num_computed_tokens, min(request.num_tokens - request.num_computed_tokens, budget))
            copies = self.kv.allocate(request, n, prefix, host) if host else self.kv.allocate(request, n, prefix)
            if copies is None:
                if not request.block_ids:
                    request.num_computed_tokens = 0
                break  # the pool is full; wait for running requests to finish
            self.waiting.remove(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            if request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
            # Copies run with this step even when the request waits for its host blocks: the source of a
            # copy-on-write (a window block kept on the device, window_cache.py) may be reused by then.
            out.block_copies += copies
            if host and out.scheduled:
                # Its blocks come back from the host while this step runs the others; it runs from the
                # next. (Alone in the step, it runs now: waiting would only add a step.)
                self.loading[request.request_id] = request
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, n))
            budget -= n
            self._note_computing(request, computing)
        return out

    def _ends_with_pending_token(self, request: Request) -> bool:
        """Asynchronous scheduling: whether the token being sampled for `request` is certain to finish it
        (max_tokens or the model length), so a step for the token after it would be wasted."""
        if not request.num_pending_outputs:
            return False
        outputs = len(request.output_token_ids) + request.num_pending_outputs
        if outputs >= request.sampling_params.max_tokens:
            return True
        return self.max_model_len is not None and request.num_scheduled_tokens >= self.max_model_len

    def _scheduled(self, request: Request, n: int, num_spec: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(request, n + num_spec, start, self.kv.plan_step(request, start, n + num_spec, num_spec), num_spec)

    def _blocks_being_computed(self) -> dict[int, list[Request]]:
        """block hash -> the running requests computing that full block (it is not cached yet)."""
        computing: dict[int, list[Request]] = {}
        for request in self.running:
            self._note_computing(request, computing)
        return computing

    def _note_computing(self, request: Request, computing: dict[int, list[Request]]) -> None:
        for h in request.block_hashes[request.num_computed_tokens // self.kv.block_size :]:
            computing.setdefault(h, []).append(request)

    def _next_block_is_being_computed(self, request: Request, num_cached: int, computing: dict[int, list[Request]]) -> bool:
        if num_cached >= len(request.block_hashes) or not computing:
            return False
        others = computing.get(request.block_hashes[num_cached])
        if not others:
            return False
        return any(self.kv.shares_pool(other, request) for other in others)  # data-parallel: its own rank's only

    def advance(self, scheduled: ScheduledRequest) -> None:
        """Marks the step's tokens computed and registers blocks that became full in the prefix cache.
        Drafts count once accepted (`accept_drafts`)."""
        request = scheduled.request
        request.num_computed_tokens = scheduled.start + scheduled.num_new_tokens - scheduled.num_spec
        self.kv.cache_full_blocks(request)

    def accept_drafts(self, request: Request, num_accepted: int, num_drafted: int) -> None:
        """The verify step confirmed `num_accepted` of `num_drafted` drafts (already appended as output
        tokens); the cache decides what of the step counts as computed (`verified`)."""
        self.kv.verified(request, num_accepted, num_drafted)
