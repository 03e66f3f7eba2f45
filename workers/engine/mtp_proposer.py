"""Speculative method `mtp`: the checkpoint's own multi-token-prediction head proposes the drafts
(`workers/models/mtp.py`: DeepSeek-V3's extra layer, Qwen3.5 / Qwen3-Next's `mtp.*`).

The head at position i reads the target's last hidden state h_i and the token at i + 1, and predicts the
token at i + 2. So the target's step returns every token's hidden state (`ModelRunner.hidden_out`), and
after the step's tokens are known the engine hands them over (`feed`): the step's positions, its hidden
states still on the device. At the next proposal the head first catches up on those positions (each
whose next token is now known: a prefill chunk's every position; a verify step's last known token and
its accepted drafts, not the rejected ones), writing its own KV there; the row of the last known
position's predecessor gives draft 1. Draft j + 1 then comes from a one-token step at the next position,
fed draft j and the head's own hidden state from the step before (chained, as vLLM does).

The head's KV pages use the target's block ids (like the draft model's, `DraftModelProposer`): a
request's block table addresses both pools, so the head needs no cache manager. Positions the head has
not seen (a step run while speculation was off, a prefix another request cached before the head ran on
it, a disaggregated request's prompt) keep stale KV: that costs acceptance, never exactness, since the
target verifies every draft. Drafts are greedy (q one-hot), so the verification rule stays exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels.collectives import place_host
from workers.models import LoadedModel, mtp

from .request import Request
from .runner import ModelRunner, StepInputs
from .scheduler import ScheduledRequest, SchedulerOutput
from .speculative import _argmax, _DraftView, draft_room

# Target steps kept for the head to catch up on (speculation switched off meanwhile: large batches, the
# speed gate); positions of older ones keep stale head KV (acceptance, not exactness).
MAX_FEEDS = 8


class _HeadFamily:
    """The head as a model family the runner can run: its weights are (head's, target's)."""

    def __init__(self, head: mtp.MTPHead):
        self.head = head

    def forward(self, weights, cfg, tokens, positions, cache, logits_indices=None, experts=None, hidden_out=None, hidden=None):
        head_weights, target_weights = weights
        head = dataclasses.replace(self.head, weights=head_weights)
        return head.forward(target_weights, tokens, positions, hidden, cache, logits_indices, experts)


class MTPRunner(ModelRunner):
    """A `ModelRunner` for the head: its own KV pages (its layers only), a hidden state in per token, the
    head's hidden state out (to chain the next draft from)."""

    def __init__(self, head: mtp.MTPHead, target: LoadedModel, config, num_blocks: int, max_model_len: int):
        model = LoadedModel(_HeadFamily(head), head.cfg, (head.weights, target.weights), target.dtype, target.mesh)
        super().__init__(model, config, num_blocks, max_model_len)
        self.hidden_out = "chained"  # (the head decides which: mtp.Layout.chain_normed)

    def dummy_inputs(self, n: int, p: int, decode_only: bool = False, rows: int | None = None) -> StepInputs:
        inputs = super().dummy_inputs(n, p, decode_only, rows)
        inputs.hidden = jnp.zeros((1, n, self.cfg.hidden_size), self.model.dtype)
        return inputs

    def _step_args(self, inputs: StepInputs) -> tuple:
        return (*super()._step_args(inputs)[:-1], place_host(inputs.hidden, self.token_sharding))


class _HeadTokens:
    """The head's view of a request's tokens, without copying them (a step reads a few): position i holds
    the token at i + 1, then the drafts proposed so far."""

    __slots__ = ("tokens", "drafts")

    def __init__(self, tokens: list[int], drafts: list[int] = ()):
        self.tokens, self.drafts = tokens, drafts

    def __len__(self) -> int:
        return len(self.tokens) - 1 + len(self.drafts)

    def __getitem__(self, key):
        known = len(self.tokens) - 1
        if isinstance(key, slice):
            start, stop, _ = key.indices(len(self))
            return self.tokens[start + 1 : min(stop, known) + 1] + list(self.drafts[max(start - known, 0) : max(stop - known, 0)])
        return self.tokens[key + 1] if key < known else self.drafts[key - known]


@jax.jit
def _take_rows(hidden: jax.Array, rows: jax.Array) -> jax.Array:
    return hidden[:, rows]


class MTPProposer:
    def __init__(self, config, kv, max_model_len: int, num_blocks: int, target: LoadedModel):
        if not config.parallel.is_single_device:
            raise ValueError("speculative method mtp: one device per engine only for now (the head runs unsharded)")
        self.head = mtp.load(config.model, target.family, target.cfg, target.mesh, target.dtype)
        head_config = config.model_copy(update={"speculative": None})
        self.runner = MTPRunner(self.head, target, head_config, num_blocks, max_model_len)
        self.kv = kv
        self.block_size = config.block_size
        self.max_tokens = self.runner.token_buckets[-1]
        self.max_seqs = config.max_num_seqs
        self._logits: jax.Array | None = None  # the last head step's
        self._feeds: list[tuple[jax.Array, list[tuple[Request, int, int, int]]]] = []

    def feed(self, hidden: jax.Array, items: list[tuple[Request, int, int, int]]) -> None:
        """A target step whose tokens are now known: its hidden states [1, N, H] and, per scheduled request,
        (request, its first row, first position, positions computed). Kept until the next proposal (the
        last `MAX_FEEDS`: steps run while speculation was off are caught up on when it is back on)."""
        self._feeds.append((hidden, items))
        del self._feeds[:-MAX_FEEDS]

    def propose_all(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        limits = {r.request_id: self._room(r, limit) for r, limit in wanted}
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in wanted}
        # Round 0: the head catches up on the positions the target computed since the last proposal whose
        # next token is known; the row of a request's last known token's predecessor gives its first draft.
        hidden, runs = self._catch_up_runs()
        batch, fed_requests, rows, budget = [], [], [], self.max_tokens
        for request, start, run_rows in runs:
            keep = min(len(run_rows), budget)  # a run past the step's budget loses its oldest positions
            if keep == 0 or len(batch) >= self.max_seqs:
                continue
            start += len(run_rows) - keep
            batch.append(ScheduledRequest(_DraftView(request.block_ids, _HeadTokens(request.all_token_ids)), keep, start))
            fed_requests.append(request)
            rows.extend(run_rows[-keep:])
            budget -= keep
        if not batch:
            return [[] for _ in wanted]
        inputs = self.runner.prepare(SchedulerOutput(batch))
        chain = self._run(inputs, hidden, rows)
        top = np.asarray(_argmax(self._logits))
        fed = {}  # request id -> (draft 1, its row in the head's hidden states)
        for i, (request, item) in enumerate(zip(fed_requests, batch)):
            if item.start + item.num_new_tokens == request.num_tokens - 1:  # up to the last known token's predecessor
                fed[request.request_id] = (int(top[inputs.logits_rows[i]]), int(inputs.cu_q_lens[i]) + item.num_new_tokens - 1)
        proposing = [r for r, _ in wanted if r.request_id in fed and limits[r.request_id] > 0]
        for request in proposing:
            drafts[request.request_id].append(fed[request.request_id][0])
        chain_rows = {r.request_id: fed[r.request_id][1] for r in proposing}
        # Rounds 1 .. k-1: one token each at the next position, fed the last draft and the head's own state.
        for j in range(1, max(limits.values(), default=0)):
            live = [r for r in proposing if limits[r.request_id] > j]
            if not live:
                break
            views = [_DraftView(r.block_ids, _HeadTokens(r.all_token_ids, drafts[r.request_id])) for r in live]
            step = SchedulerOutput([ScheduledRequest(v, 1, r.num_tokens - 2 + j) for v, r in zip(views, live)])
            inputs = self.runner.prepare(step)
            chain = self._run(inputs, chain, [chain_rows[r.request_id] for r in live])
            top = np.asarray(_argmax(self._logits))
            for i, r in enumerate(live):
                drafts[r.request_id].append(int(top[inputs.logits_rows[i]]))
                chain_rows[r.request_id] = int(inputs.cu_q_lens[i])
        return [drafts[r.request_id] for r, _ in wanted]

    def _catch_up_runs(self) -> tuple[jax.Array | None, list[tuple[Request, int, list[int]]]]:
        """The fed steps' hidden states as one array, and per live request the run of positions to catch up
        on: the latest computation of each position (a later step recomputes a rejected draft's position
        with its true token), only positions whose next token is known, the contiguous run ending at the
        last of them (start, the rows of its positions)."""
        feeds, self._feeds = self._feeds, []
        if not feeds:
            return None, []
        hidden = feeds[0][0] if len(feeds) == 1 else jnp.concatenate([h for h, _ in feeds], axis=1)
        latest: dict[str, tuple[Request, dict[int, int]]] = {}
        base = 0
        for h, items in feeds:
            for request, first_row, start, computed in items:
                rows = latest.setdefault(request.request_id, (request, {}))[1]
                for i in range(computed):
                    rows[start + i] = base + first_row + i
            base += h.shape[1]
        runs = []
        for request, rows in latest.values():
            # Only where the next token is known, and the request still holds the blocks (not preempted).
            known = [p for p in rows if p < min(request.num_tokens - 1, len(request.block_ids) * self.block_size)]
            if request.status.finished or not known:
                continue
            last = start = max(known)
            while start - 1 in rows:
                start -= 1
            runs.append((request, start, [rows[p] for p in range(start, last + 1)]))
        return hidden, runs

    def _run(self, inputs: StepInputs, hidden: jax.Array, rows: list[int]) -> jax.Array:
        """One head step over `inputs`, reading hidden[:, rows] (padded to the step's token bucket); returns
        the head's own hidden states."""
        index = np.zeros((inputs.tokens.shape[1],), np.int32)
        index[: len(rows)] = rows
        inputs.hidden = _take_rows(hidden, jnp.asarray(index))
        self._logits = self.runner.run(inputs)
        return self.runner.last_hidden

    def _room(self, request: Request, limit: int) -> int:
        return draft_room(self.kv, request, limit, self.block_size)

    def warmup(self, show_progress: bool = False) -> None:
        self.runner.warmup(None, show_progress)
