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

import json
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

import jax
import numpy as np

from .config import SpeculativeConfig
from .request import Request
from .sampler import argmax_rows


def ngram_propose(tokens: list[int] | np.ndarray, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Prompt lookup: the longest suffix of `tokens` (lookup_max down to lookup_min tokens) that occurred
    earlier in `tokens`; its earliest occurrence proposes the (up to) k tokens that followed it."""
    arr = np.asarray(tokens)
    length = len(arr)
    longest = min(lookup_max, length - 1)
    if longest < lookup_min:
        return []
    # Candidates are the ends e (exclusive; each followed by at least one token) of windows whose last token
    # is the suffix's; a candidate survives round n while its n tokens equal the suffix's. The longest n any
    # survives is the match; the earliest end among those is its earliest occurrence. One pass over the
    # tokens, then a few operations on the few candidates: 12 us at 8k tokens, where a window view per
    # suffix length took 330 us (10 and 33 us at 200).
    ends = np.flatnonzero(arr[:-1] == arr[-1]) + 1
    best = None
    for n in range(1, longest + 1):
        if n > 1:
            ends = ends[ends >= n]
            ends = ends[arr[ends - n] == arr[length - n]]
        if not ends.size:
            break
        if n >= lookup_min:
            best = int(ends[0])
    return [] if best is None else arr[best : best + k].tolist()


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

    def record(self, num_drafted: int, num_accepted: int) -> None:
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
        return ngram_propose(self.token_array(request), limit, self.lookup_min, self.lookup_max)

    @staticmethod
    def token_array(request: Request) -> np.ndarray:
        """The request's tokens as an array kept with it and extended by the new ones only (its capacity
        doubles), so a step costs its new tokens, not a conversion of the whole sequence (174 us at 8k)."""
        tokens = request.all_token_ids
        buf, have = request.spec_token_array, request.spec_token_array_len
        if have > len(tokens):  # never (tokens only grow); a request that somehow lost tokens starts over
            have = 0
        if len(tokens) > len(buf):
            grown = np.empty(max(2 * len(buf), len(tokens), 64), np.int32)
            grown[:have] = buf[:have]
            buf = request.spec_token_array = grown
        buf[have : len(tokens)] = tokens[have:]
        request.spec_token_array_len = len(tokens)
        return buf[: len(tokens)]


class SpeedGate:
    """Whether speculating pays at a batch size, measured: decode throughput (tokens delivered per second of
    engine step) with and without it, per power-of-two batch bucket. The faster mode runs; now and then a
    probe runs `probe_len` steps of the other mode to keep its figure current (load, acceptance and the
    step's cost all change). A probe that confirms the choice makes the wait for the next one
    `probe_growth` times longer (up to `max_probe_every` steps), one that overturns it brings probes back
    to every `probe_every` steps: a settled choice costs little and a changed one is found soon (and at
    once when the running mode's own figure falls below the other's). Probes are never so frequent that
    they cost over `probe_cost` of the throughput. Both modes are measured first.

    A mode's figure is its tokens per sequence and step times its sequence-steps per second (a
    speculating step yields 1 to k + 1 tokens per sequence: a median of per-step rates is not its
    throughput):
    - sequence-steps per second: only steady steps count, ones whose neighbours ran in the same mode. The
      steps at a switch pay for the switch itself (a plain step between speculating ones cannot overlap the
      host's work with the device's, since the next plan needs its tokens) and measured a plain step at half
      its speed. Their mean over the last `window` of them (a step's time depends on how many drafts it
      verifies: a median misses the long ones), leaving out a step over `_OUTLIER` times the typical one (a
      compile, a stall);
    - tokens per sequence and step: every step of the mode, over a longer window (`yield_window`). What a
      speculating step yields comes in runs (the text has stretches the drafts predict and stretches they do
      not), and a probe sees a few steps of one stretch: with the tokens of the last 4 probes alone, the gate
      kept n-gram drafts off at batch 1 where they ran 1.5x faster.
    Probe intervals are jittered by up to `_JITTER` either way: a workload that repeats itself (a
    benchmark's passes) must not meet every probe at the same place in its period.

    Switches are not free, and the gate counts them: the steps beside a switch take longer than steady
    ones (no overlap of host and device; a draft model or an MTP head catches up on the tokens it missed),
    and their extra seconds over a steady step are averaged (`_switch_s`). A probe's cost is its steps'
    shortfall plus its two switches, and probes are spaced to keep that under `probe_cost`. A mode also
    holds unless the other measures faster by `_HOLD`: near break-even either runs as fast, and switching
    back and forth on the figures' noise is what costs (with switches of 3 steps, equal modes ran at 0.89
    of either before)."""

    _OUTLIER = 4.0
    _JITTER = 0.2
    _SWITCH_EMA = 0.25
    _HOLD = 0.05

    def __init__(
        self,
        probe_every: int = 32,
        probe_len: int = 5,
        probe_growth: int = 4,
        max_probe_every: int = 512,
        probe_cost: float = 0.02,
        window: int = 12,
        min_samples: int = 4,
        yield_window: int = 128,
        seed: int = 0,
    ):
        if probe_len < 3:
            raise ValueError("probe_len must be >= 3: a probe's first and last steps are switches, not measurements")
        self.probe_every, self.probe_len, self.max_probe_every = probe_every, probe_len, max_probe_every
        self.probe_growth, self.probe_cost = probe_growth, probe_cost
        self.window, self.min_samples, self.yield_window = window, min_samples, yield_window
        self._jitter = random.Random(seed)
        self._samples: dict[tuple[int, bool], deque[tuple[int, float]]] = {}  # steady steps' (batch, seconds)
        self._yields: dict[tuple[int, bool], deque[float]] = {}  # every step's tokens per sequence
        self._rates: dict[tuple[int, bool], float] = {}  # kept with the samples: `wants` runs a few times a step
        self._steps: dict[int, int] = {}  # a bucket's steps since its last probe ended
        self._interval: dict[int, int] = {}  # a bucket's steps between probes
        self._choice: dict[int, bool] = {}  # the mode a bucket runs between its probes
        self._previous: bool | None = None  # the mode of the step observed last
        self._switch_s: dict[int, float] = {}  # a bucket's extra seconds of a step beside a switch (average)

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(0, batch - 1).bit_length()

    def rate(self, batch: int, speculating: bool) -> float | None:
        """A mode's measured tokens/s at `batch`'s bucket, None until it has `min_samples` steady steps."""
        return self._rates.get((self.bucket(batch), speculating))

    def wants(self, batch: int) -> bool:
        b = self.bucket(batch)
        on, off = self._rates.get((b, True)), self._rates.get((b, False))
        if on is None or off is None:
            return on is None  # measure speculating first, then without
        probing = self._steps.get(b, 0) >= self._interval[b] - self.probe_len
        return self._choice[b] != probing

    def observe(self, batch: int, speculated: bool, tokens: int, seconds: float, next_speculating: bool | None) -> None:
        """A decode step's delivered tokens and time; `next_speculating` is the mode of the step launched
        after it, None when none was (a step between two of its own mode is steady)."""
        previous, self._previous = self._previous, speculated
        if tokens <= 0 or seconds <= 0:
            return
        b = self.bucket(batch)
        key = (b, speculated)
        yields = self._yields.setdefault(key, deque(maxlen=self.yield_window))
        yields.append(tokens / batch)
        samples = self._samples.setdefault(key, deque(maxlen=self.window))
        if previous == speculated == next_speculating:
            samples.append((batch, seconds))
        elif key in self._rates:  # a step beside a switch: what it took beyond a steady step is the switch's
            steady = batch / self._sequence_steps_per_second(samples)
            extra = min(max(0.0, seconds - steady), self._OUTLIER * steady)  # not a compile's or a stall's
            last = self._switch_s.get(b)
            self._switch_s[b] = extra if last is None else (1 - self._SWITCH_EMA) * last + self._SWITCH_EMA * extra
        if len(samples) >= self.min_samples:
            self._rates[key] = sum(yields) / len(yields) * self._sequence_steps_per_second(samples)
        on, off = self._rates.get((b, True)), self._rates.get((b, False))
        if on is None or off is None:
            return
        if b not in self._interval:  # both measured: the first choice
            self._interval[b], self._choice[b] = self._next_interval(b, self.probe_every, on, off), on >= off
        choice = self._faster(b, on, off)
        steps = self._steps[b] = self._steps.get(b, 0) + 1
        if steps >= self._interval[b]:  # a probe ended: was the choice right?
            interval = self.probe_growth * self._interval[b] if self._choice[b] == choice else self.probe_every
            self._interval[b], self._choice[b], self._steps[b] = self._next_interval(b, interval, on, off), choice, 0
        elif steps < self._interval[b] - self.probe_len:  # between probes the faster mode takes over at once
            self._choice[b] = choice

    def _faster(self, b: int, on: float, off: float) -> bool:
        """The faster mode, where the one running now holds unless the other is faster by `_HOLD`: near
        break-even either mode runs as fast, and what costs is switching back and forth on noise."""
        if self._choice[b]:
            return on * (1 + self._HOLD) >= off
        return on >= off * (1 + self._HOLD)

    def _next_interval(self, b: int, interval: int, on: float, off: float) -> int:
        """`interval`, at most `max_probe_every`, but never so short that a probe costs over `probe_cost` of
        the throughput (that bound wins, up to 4 x `max_probe_every`). A probe costs its steps' shortfall
        (they run at the slower mode's speed) and its two switches: the 4 steps beside them, each
        `_switch_s` longer than a steady one (measured)."""
        slower = min(on, off) / max(on, off)
        faster = self._samples.get((b, on >= off))
        steps = self.probe_len * (1 - slower)
        if faster and self._switch_s.get(b):
            steps += 4 * self._switch_s[b] / (sum(s for _, s in faster) / len(faster))
        floor = min(math.ceil(steps / self.probe_cost), 4 * self.max_probe_every)
        interval = max(min(interval, self.max_probe_every), floor)
        return max(self.probe_len + 1, round(interval * self._jitter.uniform(1 - self._JITTER, 1 + self._JITTER)))

    def _sequence_steps_per_second(self, samples: deque[tuple[int, float]]) -> float:
        typical = statistics.median(seconds for _, seconds in samples)
        kept = [(batch, seconds) for batch, seconds in samples if seconds <= self._OUTLIER * typical]
        return sum(batch for batch, _ in kept) / sum(seconds for _, seconds in kept)


class Speculator:
    """Proposes each running request's drafts for the next step and keeps each request's acceptance, which
    sets how many it proposes (back-off when a request's drafts keep failing)."""

    # Acceptance is an exponential average over a request's recent draft tokens.
    _EMA = 0.3

    def __init__(self, config: SpeculativeConfig, proposer=None):
        self.config = config
        # Anything with `propose(request, limit) -> tokens`, or `propose_all([(request, limit)]) -> [tokens]`
        # for a batched one (tests give one that knows the right answers).
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)
        self.gate = SpeedGate() if config.adaptive else None

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
        off = not self.wants(len(requests))
        wanted = []
        for request in requests:
            request.spec_token_ids = []
            # In decode only (its prompt computed); a hybrid request rolled back has several known tokens left.
            if off or request.num_pending_outputs or request.num_computed_tokens < request.num_prompt_tokens:
                continue
            limit = self.draft_limit(request, max_model_len)
            if limit > 0:
                wanted.append((request, limit))
        if not wanted:
            return
        if hasattr(self.proposer, "propose_all"):  # one batched pass (a draft model)
            proposals = self.proposer.propose_all(wanted)
        else:
            proposals = [self.proposer.propose(request, limit) for request, limit in wanted]
        for (request, limit), drafts in zip(wanted, proposals):
            request.spec_token_ids = list(drafts)[:limit]

    def wants(self, batch: int) -> bool:
        """Whether a step of `batch` running requests proposes drafts: not at or past disable_by_batch_size,
        nor where the speed gate measured that speculating is slower."""
        cfg = self.config
        if cfg.disable_by_batch_size is not None and batch >= cfg.disable_by_batch_size:
            return False
        return self.gate is None or self.gate.wants(batch)

    def verified(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        self.stats.record(num_drafted, num_accepted)
        rate = num_accepted / num_drafted
        request.spec_acceptance = (1 - self._EMA) * request.spec_acceptance + self._EMA * rate


@dataclass
class _DraftView:
    """What the runner reads of a request for one draft step: its block table and its tokens with the
    drafts proposed so far appended."""

    block_ids: list[int]
    all_token_ids: list[int]
    pending_row: int = -1


class DraftModelProposer:
    """A smaller model with the target's tokenizer proposes greedily (q one-hot: the verification rule
    stays exact), run by the same worker in its own runner.

    Its KV pages use the target's block ids: a request's block table addresses both models' pools (the
    draft's pages are smaller), so the draft needs no cache manager of its own. Each round first feeds the
    draft the request's tokens it has not seen (`request.spec_draft_len` on: the whole prompt the first
    time, then the last step's accepted tokens), its logits giving the first draft; k - 1 one-token steps
    give the rest. Draft positions past the known tokens are rewritten when they become known, so only
    known tokens count as seen. The draft's KV never decides an output: a stale page (a prefix-cache
    block another request filled, a block copied for copy-on-write) only costs acceptance."""

    def __init__(self, config, kv, max_model_len: int, num_blocks: int, target_cfg, target_tokenizer_dir: str):
        from workers.models.model import load_config

        from .engine import load_engine_model
        from .runner import ModelRunner

        draft_dir = config.speculative.model
        _, draft_cfg = load_config(draft_dir)
        check_same_tokenizer(target_tokenizer_dir, draft_dir, target_cfg.vocab_size, draft_cfg.vocab_size)
        if draft_cfg.is_hybrid:
            raise ValueError(f"speculative.model {draft_dir}: a hybrid draft model is not supported (its state cannot be rolled back)")
        if not config.parallel.is_single_device:
            raise ValueError("speculative method draft: one device per engine only for now (the draft runs unsharded)")
        draft_config = config.model_copy(update={"model": draft_dir, "speculative": None, "parallel": type(config.parallel)()})
        self.model = load_engine_model(draft_config, show_progress=False)
        self.runner = ModelRunner(self.model, draft_config, num_blocks, max_model_len)
        self.kv = kv
        self.block_size = config.block_size
        self.max_tokens = self.runner.token_buckets[-1]
        self.max_seqs = config.max_num_seqs

    def propose_all(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        from .scheduler import ScheduledRequest, SchedulerOutput

        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in wanted}
        limits = {r.request_id: self._room(r, limit) for r, limit in wanted}
        # Round 0: every unseen known token, within one step's token budget; a request that cannot catch
        # up fully this step catches up partly and proposes nothing.
        budget, items, proposing = self.max_tokens, [], []
        for request, _ in wanted:
            start = min(request.spec_draft_len, request.num_tokens - 1)
            # Never past the blocks the request has (the last known token's may not be allocated yet).
            n = min(request.num_tokens, len(request.block_ids) * self.block_size) - start
            n = min(n, budget)
            if n <= 0 or len(items) >= self.max_seqs:
                continue
            items.append(ScheduledRequest(request, n, start))
            budget -= n
            if start + n == request.num_tokens and limits[request.request_id] > 0:
                proposing.append(request)
            request.spec_draft_len = start + n
        if not items:
            return [[] for _ in wanted]
        rows = self._step(SchedulerOutput(items))
        by_id = {item.request.request_id: rows[i] for i, item in enumerate(items)}
        for request in proposing:
            drafts[request.request_id].append(by_id[request.request_id])
        # Rounds 1 .. k-1: one token each, for the requests still drafting.
        for i in range(1, max(limits.values(), default=0)):
            live = [r for r in proposing if limits[r.request_id] > i]
            if not live:
                break
            views = [_DraftView(r.block_ids, r.all_token_ids + drafts[r.request_id]) for r in live]
            out = self._step(SchedulerOutput([ScheduledRequest(v, 1, len(v.all_token_ids) - 1) for v in views]))
            for j, r in enumerate(live):
                drafts[r.request_id].append(out[j])
        return [drafts[r.request_id] for r, _ in wanted]

    def _room(self, request: Request, limit: int) -> int:
        return draft_room(self.kv, request, limit, self.block_size)

    def _step(self, sched) -> list[int]:
        inputs = self.runner.prepare(sched)
        logits = self.runner.run(inputs)
        top = np.asarray(_argmax(logits))
        return [int(top[row]) for row in inputs.logits_rows]

    def warmup(self, show_progress: bool = False) -> None:
        self.runner.warmup(None, show_progress)


def draft_room(kv, request: Request, limit: int, block_size: int) -> int:
    """How many of `limit` drafts a proposer that runs its own steps at the request's positions (a draft
    model, an MTP head) can propose: those whose positions (the last known token's, then one per draft but
    the last: up to num_tokens - 2 + limit) have blocks, allocated now if the pool has them (the scheduler
    then finds them allocated; blocks past the accepted tokens go back after the verify step). Counted from
    the known tokens, not the computed ones: a hybrid request rolled back to a saved state has several
    known tokens left to compute."""
    if kv.allocate(request, request.num_tokens - 1 - request.num_computed_tokens + limit) is None:
        return max(0, min(limit, len(request.block_ids) * block_size - request.num_tokens + 1))
    return limit


def check_same_tokenizer(target_dir: str, draft_dir: str, target_vocab: int, draft_vocab: int) -> None:
    """A draft must speak the target's tokens: the same vocabulary size and the same tokenizer.json."""
    from pathlib import Path

    if target_vocab != draft_vocab:
        raise ValueError(f"speculative.model {draft_dir}: vocab_size {draft_vocab} differs from the target's {target_vocab}")
    a, b = Path(target_dir) / "tokenizer.json", Path(draft_dir) / "tokenizer.json"
    if a.is_file() != b.is_file():
        raise ValueError(f"speculative.model {draft_dir}: one of the target and the draft has a tokenizer.json and the other not")
    if a.is_file() and json.loads(a.read_text())["model"] != json.loads(b.read_text())["model"]:
        raise ValueError(f"speculative.model {draft_dir}: its tokenizer differs from the target's (tokenizer.json model)")


_argmax = jax.jit(argmax_rows)
