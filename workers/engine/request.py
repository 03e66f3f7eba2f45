"""A request's life in the engine: waiting -> running -> (preempted -> waiting ->) finished."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from .sampling_params import SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache (cached prefix + computed so far).
    num_computed_tokens: int = 0
    # Prefix-cache hit at the first schedule; reported to the client.
    num_cached_tokens: int = -1
    block_ids: list[int] = field(default_factory=list)
    # A sliding-window cache group's block table (window_cache.py): same length, -1 where a block was let go.
    window_block_ids: list[int] = field(default_factory=list)
    # Hashes of the full blocks of all_token_ids, extended as blocks fill.
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Prefill-only requests (disaggregation) keep their blocks after finishing until exported.
    hold_kv: bool = False
    # Decode side of a handoff: the first prompt block to import (those before it were in our prefix cache).
    kv_import_from_block: int = 0
    # The conversation this request continues (the router's session hint): its cached blocks are
    # evicted after sessionless ones while the session is live (retention.py).
    session_id: str | None = None
    first_token_time: float | None = None
    scheduled_time: float | None = None  # its first step (queue time: this - arrival_time)
    # Asynchronous scheduling: tokens sampled by a step still in flight (0 or 1), not yet in
    # `output_token_ids`, and the row of that step's sampled tokens holding it (the next step's input
    # reads it there, on the device).
    num_pending_outputs: int = 0
    pending_row: int = -1
    # Speculative decoding: the tokens proposed to follow it, verified by the next step (speculative.py).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_acceptance: float = 1.0  # recent share of its drafts accepted (an exponential average)
    spec_draft_len: int = 0  # a draft model's KV holds this many of its first tokens (speculative.DraftModelProposer)
    # The n-gram proposer's copy of the tokens as an array, extended as they grow (speculative.NgramProposer).
    spec_token_array: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32), repr=False, compare=False)
    spec_token_array_len: int = 0
    # Top-k of each prompt position's logprobs, computed from the steps that prefill it (None: not wanted).
    prompt_logprobs: int | None = None
    _all_tokens: list[int] = field(default_factory=list, repr=False)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens: one list extended in place as outputs arrive, so a call costs the new
        tokens, not the whole sequence (the scheduler, the block hashes and the runner read it every step).
        Read-only for callers."""
        have = len(self._all_tokens) - len(self.prompt_token_ids)
        if have < 0:
            self._all_tokens, have = list(self.prompt_token_ids), 0
        if have < len(self.output_token_ids):
            self._all_tokens += self.output_token_ids[have:]
        return self._all_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the scheduler plans with: the known ones plus those a step in flight is sampling."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_outputs

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
