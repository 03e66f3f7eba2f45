"""Speculative decoding: a proposer guesses a request's next tokens, one target step verifies them all.

A running request in decode proposes up to k draft tokens d_1..d_k. The step feeds its last known token t
and the drafts (k + 1 positions, one ragged sequence like any other) and samples a token at every
position with the ordinary sampler: x_0 from the logits after t, x_i after d_i. Draft i is accepted while
x_{i-1} == d_i; the first mismatch x_a (or x_k when every draft holds, the bonus token) ends the run, so a
step yields a + 1 tokens.

Exactness. The proposers here are deterministic (n-gram lookup: q is one-hot on the draft). For a one-hot
q the standard rule (accept d with probability min(1, p(d)/q(d)) = p(d); on a reject sample from
norm(max(0, p - q)) = p without d) is exactly "draw x ~ p; accept iff x == d, else emit x": P(accept) =
p(d) and a rejected draw is distributed as p conditioned on x != d. Each x_i is drawn with the key of its
output position (`sampler.py`: seed and tokens generated so far), so a seeded request produces the very
tokens it produces without speculation, and greedy output is the target's argmax token for token.

Rollback. The KV of position i is written by the verify step whatever the outcome; a rejected position's
slot lies at or past the request's computed length, so no attention reads it before the next step
overwrites it, and no block holding only rejected tokens is hashed (block hashes follow the accepted
tokens) or kept: blocks past the accepted tokens go back to the pool (`KVCacheManager.trim`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .config import SpeculativeConfig
from .request import Request


def ngram_propose(tokens: list[int] | np.ndarray, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Prompt lookup: the longest suffix of `tokens` (lookup_max down to lookup_min tokens) that occurred
    earlier in `tokens`; its earliest occurrence proposes the (up to) k tokens that followed it."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        # Windows starting at 0 .. length-1-n: each is followed by at least one token.
        windows = sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return arr[start : start + k].tolist()
    return []


def accepted_length(drafts: list[int], sampled: list[int] | np.ndarray) -> int:
    """How many leading drafts the target's draws confirm: d_i is accepted while x_{i-1} == d_i."""
    a = 0
    while a < len(drafts) and int(sampled[a]) == drafts[a]:
        a += 1
    return a


@dataclass
class SpecStats:
    """Running totals under vLLM's metric names (`vllm:spec_decode_*`)."""

    num_drafts: int = 0  # verify runs (a request with at least one draft token in a step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    def record(self, num_drafted: int, num_accepted: int, k: int) -> None:
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos += [0] * (k - len(self.accepted_per_pos))
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify run (vLLM's definition: 1 + accepted / drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class NgramProposer:
    """Prompt lookup over the request's own tokens (no model)."""

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, request: Request, limit: int) -> list[int]:
        return ngram_propose(request.all_token_ids, limit, self.lookup_min, self.lookup_max)


class Speculator:
    """Proposes each running request's drafts for the next step and keeps each request's acceptance, which
    sets how many it proposes (back-off when a request's drafts keep failing)."""

    # Acceptance is an exponential average over a request's recent draft tokens.
    _EMA = 0.3

    def __init__(self, config: SpeculativeConfig, proposer=None):
        self.config = config
        # Anything with `propose(request, limit) -> tokens` (tests give one that knows the right answers).
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)

    def draft_limit(self, request: Request, max_model_len: int) -> int:
        """The most drafts `request` may propose now: k, fewer when its acceptance is poor, and never past
        max_tokens or the model length (the step's last position yields one more token)."""
        params = request.sampling_params
        if params.bad_words:  # a ban depends on the tokens before it: drafts would need their own bans
            return 0
        room = min(params.max_tokens - len(request.output_token_ids), max_model_len - request.num_tokens) - 1
        poor = request.spec_acceptance < self.config.min_acceptance
        return max(0, min(1 if poor else self.k, room))

    def propose(self, requests: list[Request], max_model_len: int) -> None:
        """Sets `spec_token_ids` on each running request in decode (one known token left to compute)."""
        cfg = self.config
        off = cfg.disable_by_batch_size is not None and len(requests) >= cfg.disable_by_batch_size
        for request in requests:
            request.spec_token_ids = []
            # In decode only (its prompt computed); a hybrid request rolled back has several known tokens left.
            if off or request.num_pending_outputs or request.num_computed_tokens < request.num_prompt_tokens:
                continue
            limit = self.draft_limit(request, max_model_len)
            if limit > 0:
                request.spec_token_ids = list(self.proposer.propose(request, limit))[:limit]

    def verified(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        self.stats.record(num_drafted, num_accepted, self.k)
        rate = num_accepted / num_drafted
        request.spec_acceptance = (1 - self._EMA) * request.spec_acceptance + self._EMA * rate
