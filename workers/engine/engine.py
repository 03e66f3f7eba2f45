"""The engine core: one synchronous step loop over scheduler -> runner -> sampler -> outputs.

`EngineCore` is single-threaded and runs without Ray; `AsyncEngine` (async_engine.py) drives it from a
background thread for the Serve workers, and `LLM` (llm.py) for offline batches.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from workers.messages import EngineStats, TokenDelta
from workers.models import LoadedModel
from workers.models.tokenizer import Tokenizer
from workers.parallel import distributed_settings, init_distributed, load_parallel_model

from .config import EngineConfig
from .data_parallel import DataParallelKVCacheManager, DataParallelRunner
from .expert_balancer import ExpertBalancer
from .host_memory import retain_freed_host_memory
from .host_tier import HostKVTier
from .kv_cache_manager import KVCacheManager
from .kv_events import KVEventPublisher
from .mtp_proposer import MTPProposer
from .output_processor import OutputProcessor, RequestOutput  # noqa: F401 - RequestOutput: the offline result type
from .request import Request, RequestStatus
from .retention import SessionAwareLRU
from .runner import LoadWindow, ModelRunner, kv_bytes_per_block, rank_imbalance, state_bytes_per_sequence, window_layers
from .sampler import SamplerOutput, build_sampling_batch, prompt_logprob_entries, prompt_logprobs, prompt_row_logprobs, sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .speculative import DraftModelProposer, Speculator, accepted_length
from .state_cache import HybridCacheManager
from .structured import GrammarCompiler, GrammarState, ids_bitmask
from .window_cache import NO_BLOCK, WindowedKVCacheManager, window_blocks_per_sequence

log = logging.getLogger("moray.engine")

MAX_LOGPROBS = 20
DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class KVImport:
    """The decode side of a prefill -> decode handoff: the prefill worker's first token and its hit (the
    token itself, its text and logprobs reached the client from the prefill side)."""

    first_token: int
    num_cached_tokens: int = 0
    # The first block whose sliding-window layers the handoff holds (`PrefillHandoff.window_start_block`).
    window_start_block: int = 0


@dataclass(slots=True)
class StagedKV:
    """A finished `hold_kv` request's KV on its way to the host (`workers/kv_transfer.py` takes it from
    here): the engine dispatched the copies and freed the blocks.

    `pieces`: the copy of the prompt's `num_blocks` blocks from `block_start` on (one engine over several
    hosts: the part this host holds; none if it holds none), as (first block, device array [padded blocks,
    layers, page, 2*Hkv, D] whose leading rows are the piece's blocks) in order; `state`: the device copy of
    a hybrid model's state slot (on one host only), `pack_state` packs it flat."""

    request_id: str
    num_blocks: int
    pieces: list[tuple[int, jax.Array]]
    block_start: int = 0
    state: object = None
    pack_state: object = None
    staged_at: float = 0.0
    window_start_block: int = 0  # the first block whose sliding-window layers are held (window_cache.py)
    window_layers: tuple[int, ...] = ()  # those layers (cache layer indices)


@dataclass
class _InFlight:
    """A launched step: the requests it samples for, each from its first row `rows[j]` of the sampled
    arrays (still on the device) over 1 + len(drafts[j]) rows (speculative decoding verifies the drafts)."""

    requests: list[Request]
    sampled: dict
    rows: list[int]
    drafts: list[list[int]]
    # Prompt logprobs the step computed: (request, first position predicted, its tokens, device arrays).
    prompt: list[tuple[Request, int, list[int], object]] = field(default_factory=list)
    # Speculative method mtp: the step's hidden states and, per scheduled request, (request, first row, first
    # position, positions computed), for the head to catch up on once the step's tokens are known.
    hidden_feed: tuple | None = None


def setup_compilation_cache(path: str | None) -> None:
    """A persistent XLA compilation cache: a restarted worker skips the compiles it already did.

    A directory already configured (e.g. JAX_COMPILATION_CACHE_DIR) wins; either way every program is
    cached, not only those over JAX's default one-second threshold.
    """
    if not (path or jax.config.jax_compilation_cache_dir):
        return
    if not jax.config.jax_compilation_cache_dir:
        Path(path).expanduser().mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(Path(path).expanduser()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model: LoadedModel | None = None,
        tokenizer: Tokenizer | None = None,
        show_progress: bool = True,
    ):
        self.config = config
        setup_compilation_cache(config.compilation_cache_dir)
        if config.retain_freed_host_memory:
            retain_freed_host_memory()
        self.model = model or load_engine_model(config, show_progress)
        self.cfg = self.model.cfg
        # Redundant expert slots are placed before the runner compiles against the weights' shapes.
        self.balancer = ExpertBalancer(self.model, config.eplb) if config.eplb is not None else None
        self._load_window = LoadWindow()  # the stats' imbalance: over the last few hundred steps
        self.tokenizer = tokenizer if tokenizer is not None else _maybe_tokenizer(config.model)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) if self.tokenizer else self.cfg.eos_token_ids
        self.grammars = GrammarCompiler(self.tokenizer, self.cfg.vocab_size, self.eos_token_ids, config.structured_coerce_one_of)
        self.max_model_len = config.max_model_len or min(self.cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.grammars, self.max_model_len)
        # Hybrid models: one state's bytes size the snapshots (state_cache_memory_bytes takes them out of the
        # KV pool's memory).
        self.state_bytes = state_bytes_per_sequence(self.cfg)
        self.max_snapshots = config.max_state_snapshots(self.state_bytes) if self.cfg.is_hybrid else 0
        kv_bytes = config.kv_pool_bytes(self.state_bytes, self.cfg.is_hybrid)
        num_blocks = config.num_kv_blocks or kv_bytes // kv_bytes_per_block(self.model, config.block_size)
        window_group = self._window_group(config, kv_bytes)  # (window, full blocks, window blocks) or None
        if window_group is not None:
            num_blocks = window_group[1]
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {config.block_size} tokens) cannot hold one sequence of "
                f"max_model_len={self.max_model_len}; raise kv_cache_memory_bytes or lower max_model_len"
            )
        self.events = KVEventPublisher(config.worker_id)
        # Hybrid models: paged KV for the full-attention layers + state slots for the linear ones.
        slots = config.state_slots(self.state_bytes) if self.cfg.is_hybrid else 0
        if self.model.data_parallel_size > 1:  # each rank its own sequences, blocks and state slots
            dp = self.model.data_parallel_size
            window_blocks = window_group[2] if window_group else 0
            self.kv = DataParallelKVCacheManager(
                dp,
                num_blocks,
                config.block_size,
                config.enable_prefix_caching,
                config.model_name,
                self.events,
                slots_per_rank=slots,
                snapshots_per_rank=self.max_snapshots,
                keep_points=config.keep_points(),
                window=window_group and window_group[0],
                window_blocks_per_rank=window_blocks,
            )
            self.runner = DataParallelRunner(self.model, config, num_blocks, self.max_model_len, slots, window_blocks)
        elif self.cfg.is_hybrid:
            self.runner = ModelRunner(self.model, config, num_blocks, self.max_model_len, slots)
            host, host_states = self._hybrid_host_tiers(config, num_blocks)
            self.kv = HybridCacheManager(
                num_blocks,
                config.block_size,
                slots,
                self.max_snapshots,
                config.enable_prefix_caching,
                config.model_name,
                self.events,
                host,
                host_states,
                config.session_idle_s,
                config.keep_points(),
            )
        elif window_group is not None:
            window, _, num_window_blocks = window_group
            self.runner = ModelRunner(self.model, config, num_blocks, self.max_model_len, num_window_blocks=num_window_blocks)
            self.kv = WindowedKVCacheManager(
                num_blocks,
                num_window_blocks,
                config.block_size,
                window,
                config.enable_prefix_caching,
                config.model_name,
                self.events,
                config.session_idle_s,
                *self._window_host_tiers(config, num_blocks, num_window_blocks),
            )
        else:
            self.runner = ModelRunner(self.model, config, num_blocks, self.max_model_len)
            self.kv = KVCacheManager(
                num_blocks,
                config.block_size,
                config.enable_prefix_caching,
                config.model_name,
                self.events,
                self._host_tier(config),
                config.session_idle_s,
            )
        if config.host_kv.enabled and not isinstance(getattr(self.kv, "host", None), HostKVTier):
            raise ValueError("host_kv: the host KV tier is not supported yet with data-parallel attention")
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.speculator = self._speculator(config)
        self._speculating = False  # this step's mode (the speculator wanted drafts)
        self._last_launch: tuple[int, bool] | None = None  # (batch, speculating) of the decode step launched last
        self._finished_outside_step: list[TokenDelta] = []
        self._step_counter = 0
        self._inflight: _InFlight | None = None  # the step launched last, whose outputs are not read yet
        # One engine over several processes runs every step in lockstep on all of them: kept synchronous
        # (and compiled before serving) until asynchronous steps are checked for lockstep there.
        self.single_process = jax.process_count() == 1
        self._rng = np.random.default_rng(config.seed)
        self.prefix_queries = self.prefix_hits = 0
        self.host_copy_seconds = 0.0  # host time spent on the host tier's copies (dispatch and fetch)
        self._staged_loads: dict[str, list] = {}  # request -> its host-tier blocks on their way to the device
        # Finished hold_kv requests' KV on its way to the host, until the worker takes it (`take_staged`, from
        # another thread: single dict operations are atomic).
        self.staged: dict[str, StagedKV] = {}
        self.export_dispatch_seconds = 0.0  # engine-thread time spent staging exports (dispatching the copies)
        self.import_seconds = 0.0  # engine-thread time spent in KV imports (dispatching the writes, waiting for them)
        if config.warmup:
            self.warmup(show_progress)

    # ---------------------------------------------------------------- requests in and out

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one generated token)"
            )
        for t in prompt_token_ids:
            if not 0 <= int(t) < self.cfg.vocab_size:
                raise ValueError(f"token id {t} is outside the vocabulary [0, {self.cfg.vocab_size})")
        for t in params.token_ids_named:
            if t >= self.cfg.vocab_size:
                raise ValueError(f"token id {t} in the sampling parameters is outside the vocabulary [0, {self.cfg.vocab_size})")
        if params.structured is not None:
            self.grammars.grammar(params.structured)  # a GrammarError (ValueError) names what is wrong
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer; this model has none")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        hold_kv: bool = False,
        kv_import: KVImport | None = None,
        session_id: str | None = None,
        resume: Sequence[int] = (),
    ) -> None:
        """Queues a request. `hold_kv` keeps its KV after it finishes, for the handoff (staged);
        `kv_import` makes it wait for its prompt's KV via `import_kv` instead of prefilling;
        `session_id` (the conversation it continues) keeps its cached blocks longest while the session is live;
        `resume`: output tokens another engine already generated and streamed (a migrated request): they
        are recomputed with the prompt, count as output (max_tokens, penalties, stop strings, the seeded
        random stream's position, the grammar) and are not sent again."""
        params = params or SamplingParams()
        if request_id in self.scheduler.requests or request_id in self.scheduler.held or request_id in self.staged:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = [int(t) for t in prompt_token_ids]
        self.validate(prompt, params)
        resumed = [int(t) for t in resume]
        if resumed:
            self._validate_resume(prompt, resumed, params, kv_import)
        request = Request(request_id, prompt, params, hold_kv=hold_kv, session_id=session_id)
        # Sent with the first delta already: by the engine the request was migrated from, or by the prefill
        # worker whose KV it imports.
        wants_prompt_logprobs = params.prompt_logprobs is not None and not resumed and kv_import is None
        prompt_logprobs = None
        if wants_prompt_logprobs and self.runner.prompt_rows_in_step:
            # From the steps that prefill it (batched with the others), filled in as they run.
            request.prompt_logprobs = params.prompt_logprobs
            prompt_logprobs = [None] * len(prompt)
        elif wants_prompt_logprobs:
            prompt_logprobs = self._prompt_logprobs(prompt, params.prompt_logprobs)
        self.outputs.add(request_id, params, prompt_logprobs)
        if resumed:
            request.output_token_ids = resumed
            self.outputs.continue_from(request, resumed)
        if kv_import is None:
            self.scheduler.add(request)
        else:
            self._start_import(request, kv_import)

    def _validate_resume(self, prompt: list[int], resumed: list[int], params: SamplingParams, kv_import: KVImport | None) -> None:
        if kv_import is not None:
            raise ValueError("a resumed request recomputes its KV: it cannot also import it")
        if len(prompt) + len(resumed) >= self.max_model_len:
            raise ValueError(f"prompt and resumed output have {len(prompt) + len(resumed)} tokens; max_model_len is {self.max_model_len}")
        if params.max_tokens is not None and len(resumed) >= params.max_tokens:
            raise ValueError(f"{len(resumed)} resumed tokens leave nothing to generate (max_tokens {params.max_tokens})")
        for t in resumed:
            if not 0 <= t < self.cfg.vocab_size:
                raise ValueError(f"resumed token id {t} is outside the vocabulary [0, {self.cfg.vocab_size})")

    # ---------------------------------------------------------------- KV handoff

    def _start_import(self, request: Request, kv_import: KVImport) -> None:
        """Allocates the prompt's blocks (reusing our own cached prefix) and waits for the rest."""
        request.output_token_ids = [int(kv_import.first_token)]
        self.outputs.continue_from(request, [int(kv_import.first_token)])  # already streamed by the prefill side
        prompt_len = request.num_prompt_tokens
        prefix = self.kv.cached_prefix(request, prompt_len // self.kv.block_size)
        request.num_computed_tokens = len(prefix) * self.kv.block_size
        request.num_cached_tokens = kv_import.num_cached_tokens
        if self.kv.allocate_import(request, prefix) is None:
            request.num_computed_tokens = 0  # no room now: recompute locally instead, losing nothing
            self.scheduler.add(request)
            return
        if self.kv.host_channels():
            self._dispatch_host_saves()  # the imported KV is written at once, into blocks this may have evicted
        if kv_import.window_start_block > len(prefix):
            self.kv.import_lacks_window(request, kv_import.window_start_block)
        request.kv_import_from_block = len(prefix)
        self.scheduler.add_importing(request)

    def import_from_block(self, request_id: str) -> int | None:
        """The first prompt block a waiting import needs (earlier ones were in our prefix cache); None when
        the request does not wait for KV (it prefills locally: no room when it arrived, or aborted)."""
        request = self.scheduler.importing.get(request_id)
        return None if request is None else request.kv_import_from_block

    def import_kv(self, request_id: str, block_start: int, layer_start: int, data: np.ndarray) -> bool:
        """Writes prompt blocks [block_start, block_start + len(data)) x layers [layer_start, ...) of the
        prompt's KV (data blocks first: [blocks, layers, page, 2*Hkv, D]); blocks our own prefix cache holds
        are skipped. Returns False when the request no longer waits for KV (aborted, or recomputing)."""
        request = self.scheduler.importing.get(request_id)
        if request is None:
            return False
        num_blocks = self.kv.blocks_needed(request.num_prompt_tokens)
        block_end = block_start + data.shape[0]
        if block_end > num_blocks or data.shape[1] + layer_start > self.cfg.num_kv_layers:
            raise ValueError(
                f"KV chunk covers blocks [{block_start}, {block_end}) x {data.shape[1]} layers from {layer_start}; "
                f"the prompt has {num_blocks} blocks and the model {self.cfg.num_kv_layers} layers"
            )
        skip = max(0, request.kv_import_from_block - block_start)
        if skip < data.shape[0]:
            start = time.perf_counter()
            ids = request.block_ids[block_start + skip : block_end]
            window_ids = request.window_block_ids[block_start + skip : block_end]
            self.runner.scatter_blocks(ids, layer_start, data[skip:], window_ids)  # may read `data` until `finish_import`
            self.import_seconds += time.perf_counter() - start
        return True

    def import_state(self, request_id: str, packed: np.ndarray) -> bool:
        """Writes a hybrid model's packed linear-attention state (the handoff's state chunk)."""
        if request_id not in self.scheduler.importing:
            return False
        start = time.perf_counter()
        self.runner.scatter_state(self.kv.working_slot(request_id), packed)
        # Read in place like `import_kv`'s chunks; the state is small: its write is waited for at once.
        jax.block_until_ready(self.runner.state_pools)
        self.import_seconds += time.perf_counter() - start
        self.kv.state_written(request_id)
        return True

    def finish_import(self, request_id: str) -> bool:
        """Every chunk is written: the request runs from the next step. False if it no longer waits."""
        request = self.scheduler.importing.get(request_id)
        if request is None:
            return False
        # The writes read the chunks in place: they must be done before the worker lets the sender free them.
        start = time.perf_counter()
        self.runner.wait_for_imports()
        self.import_seconds += time.perf_counter() - start
        request.num_computed_tokens = request.num_prompt_tokens
        self.scheduler.admit_imported(request)
        return True

    def recompute_instead_of_import(self, request_id: str) -> None:
        """The KV will not arrive (prefill worker gone): prefill locally instead, losing nothing."""
        request = self.scheduler.importing.pop(request_id, None)
        if request is not None:
            self.runner.wait_for_imports()  # its chunks written so far are read before their sender frees them
            self.kv.free(request)
            request.num_computed_tokens = 0
            self.scheduler.waiting.append(request)

    def _stage_held(self) -> None:
        """Finished `hold_kv` requests: dispatch the copy of their prompt's KV (and state) to the host and free
        their blocks at once; the copy overlaps the next steps and the worker exports from it. On one engine
        over several hosts every host runs this (the copy is one program over all of them) and stages the
        part it holds: each host's worker exports its own part."""
        if not self.scheduler.held:
            return
        start = time.perf_counter()
        for request_id, request in list(self.scheduler.held.items()):
            num_blocks = self.kv.blocks_needed(request.num_prompt_tokens)
            offset, pieces = self.runner.stage_export(request.block_ids[:num_blocks], request.window_block_ids[:num_blocks])
            copied = pieces[-1][0] + pieces[-1][1].shape[0] if pieces else 0
            local = max(0, min(copied, num_blocks - offset))
            staged = StagedKV(request_id, local, pieces, block_start=offset, staged_at=time.perf_counter())
            staged.window_start_block = next((i for i, b in enumerate(request.window_block_ids[:num_blocks]) if b != NO_BLOCK), 0)
            staged.window_layers = self.runner.window_layers
            if self.cfg.is_hybrid:
                staged.state = self.runner.stage_state_export(self.kv.working_slot(request_id))
                staged.pack_state = self.runner.pack_state
            self.staged[request_id] = staged
            self.scheduler.release_held(request_id)
        self.export_dispatch_seconds += time.perf_counter() - start

    def take_staged(self, request_id: str) -> StagedKV | None:
        """The staged KV of a finished `hold_kv` request (once: the taker owns it). Thread-safe."""
        return self.staged.pop(request_id, None)

    def release_kv(self, request_id: str) -> bool:
        """Lets go of a finished `hold_kv` request's KV: its staged copy, or its held blocks."""
        return self.staged.pop(request_id, None) is not None or self.scheduler.release_held(request_id)

    def abort(self, request_id: str) -> None:
        """Stops a request now and frees its KV blocks; its final output (reason "abort") comes with the next step."""
        if self.release_kv(request_id):
            return
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return
        if request_id in self.scheduler.importing:
            self.runner.wait_for_imports()  # as in `recompute_instead_of_import`
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._finished_outside_step.append(self.outputs.aborted(request))

    @property
    def preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def has_unfinished(self) -> bool:
        """Work the step loop can make progress on (importing requests wait for `import_kv`)."""
        inflight = self._inflight is not None and any(not r.status.finished for r in self._inflight.requests)
        return self.scheduler.has_unfinished() or bool(self._finished_outside_step) or inflight

    def stats(self) -> EngineStats:
        running = self.scheduler.running
        return EngineStats(
            num_running=len(running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.loading),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.pool.num_blocks,
            kv_usage=self.kv.usage,
            num_tokens_in_flight=sum(r.num_tokens for r in running),
            prefix_cache_queries=self.prefix_queries,
            prefix_cache_hits=self.prefix_hits,
            num_pending_prefill_tokens=sum(
                max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in [*self.scheduler.waiting, *running]
            ),
            num_held=len(self.scheduler.held) + len(self.staged),
            num_importing=len(self.scheduler.importing),
            num_requests=len(self.scheduler.requests),
            num_preemptions=self.scheduler.num_preemptions,
            kv_event_epoch=self.events.epoch,
            kv_event_last_seq=self.events.last_seq,
            kv_bytes_per_token=self.runner.kv_bytes_per_block // self.config.block_size,
            sparse_blocks=bool(self.cfg.is_hybrid or self.runner.window_layers),
            state_snapshot_bytes=getattr(self.kv, "num_snapshots", 0) * self.state_bytes,
            state_snapshot_budget_bytes=self.max_snapshots * self.state_bytes * self.model.data_parallel_size,
            **self._host_stats(),
            **self._spec_stats(),
            **self._expert_stats(),
        )

    def rebalance_experts(self, wait: bool = False) -> bool:
        """Starts a rebalance from the expert loads since the last one (swapped in at a later step boundary, or
        before returning with `wait`); False when expert load balancing is off or one is under way."""
        if self.balancer is None:
            return False
        if wait:
            self.balancer.wait()  # a placement under way goes in first (an idle engine has no step to swap it at)
        started = self.balancer.request(self.runner.read_expert_loads())
        if started and wait:
            self.balancer.wait()
        return started

    def _expert_stats(self) -> dict:
        loads = self.runner.expert_load_snapshot() if any(self.cfg.moe_layers) else None
        if loads is None:
            return {}
        ep = getattr(self.model.experts, "ep_size", 1)
        return {
            "expert_routed_tokens": int(loads.sum()),
            "expert_rank_imbalance": rank_imbalance(self._load_window.recent(loads), ep),
            "expert_rebalances": self.balancer.num_rebalances if self.balancer is not None else 0,
        }

    def _spec_stats(self) -> dict:
        if self.speculator is None:
            return {}
        s = self.speculator.stats
        return {
            "spec_num_drafts": s.num_drafts,
            "spec_num_draft_tokens": s.num_draft_tokens,
            "spec_num_accepted_tokens": s.num_accepted_tokens,
            "spec_accepted_per_pos": tuple(s.accepted_per_pos),
        }

    def _host_stats(self) -> dict:
        tiers = [channel.tier for channel in self.kv.host_channels()]  # one per cache group
        if not tiers:
            return {}
        return {
            "host_hit_tokens": self.kv.host_hit_tokens,
            "host_blocks_used": sum(t.num_used for t in tiers),
            "host_blocks_total": sum(t.num_blocks for t in tiers),
            "host_blocks_saved": sum(t.stats.blocks_saved for t in tiers),
            "host_blocks_loaded": sum(t.stats.blocks_loaded for t in tiers),
            "host_blocks_evicted": sum(t.stats.blocks_evicted for t in tiers),
            "host_copy_seconds": self.host_copy_seconds,
            "evicted_live_session_blocks": self.kv.pool.evicted_live_session + sum(t.order.evicted_live_session for t in tiers),
        }

    def _host_tier(
        self, config: EngineConfig, extra_bytes_per_block: float = 0.0, events=True, layers: int | None = None
    ) -> HostKVTier | None:
        """The host tier of attention KV blocks (None when off); `extra_bytes_per_block`: what else the
        tier's memory budget pays per block (a hybrid model's state snapshots, the window group's blocks);
        `layers`: the cache layers a block holds (default: all)."""
        num_blocks = config.host_kv.num_blocks(int(self._host_block_nbytes(config, layers) + extra_bytes_per_block))
        if not num_blocks:
            return None
        return self._host_tier_of(config, num_blocks, layers, events)

    def _host_tier_of(self, config: EngineConfig, num_blocks: int, layers: int | None, events: bool) -> HostKVTier:
        shape = (self.cfg.num_kv_layers if layers is None else layers, config.block_size, *self.cfg.kv_transport_dims)
        dtype = np.dtype(self.runner.kv_pages[0].dtype)
        log.info(
            "host KV tier: %d blocks of %d layers (%.2f GiB)",
            num_blocks,
            shape[0],
            num_blocks * self._host_block_nbytes(config, shape[0]) / (1 << 30),
        )
        return HostKVTier(num_blocks, shape, dtype, self.events if events else None, SessionAwareLRU(config.session_idle_s))

    def _host_block_nbytes(self, config: EngineConfig, layers: int | None = None) -> int:
        """A host-tier block's bytes: `layers` cache layers (default: all) in the transport layout."""
        layers = self.cfg.num_kv_layers if layers is None else layers
        return layers * config.block_size * math.prod(self.cfg.kv_transport_dims) * np.dtype(self.runner.kv_pages[0].dtype).itemsize

    def _window_host_tiers(
        self, config: EngineConfig, num_blocks: int, num_window_blocks: int
    ) -> tuple[HostKVTier | None, HostKVTier | None]:
        """The host tiers of a sliding-window cache group's model, one per group, in the device pools' proportion
        from one budget (`host_kv.blocks` counts the full group's); each holds its group's layers. They publish
        nothing: the manager publishes what a hit can reuse from both."""
        windowed = len(self.runner.window_layers)
        ratio = num_window_blocks / num_blocks
        full = self._host_tier(config, ratio * self._host_block_nbytes(config, windowed), False, self.cfg.num_kv_layers - windowed)
        if full is None:
            return None, None
        return full, self._host_tier_of(config, max(1, math.ceil(full.num_blocks * ratio)), windowed, False)

    def _window_group(self, config: EngineConfig, kv_bytes: int) -> tuple[int, int, int] | None:
        """(window, full-group blocks, window-group blocks) when the sliding-window layers get a cache group of
        their own (window_cache.py); None when the model has none or the configuration keeps one pool."""
        layers = window_layers(self.cfg)
        if not layers or not config.sliding_window_group or self.cfg.is_hybrid:
            return None
        window = max(self.cfg.sliding_windows[self.cfg.kv_layer_ids[i]] for i in layers)
        bs = config.block_size
        # Every running sequence's window plus a step's new tokens, twice over: the other half keeps blocks
        # that left a window cached for prefix hits (a branch point's window, a conversation's last turn).
        running = config.max_num_seqs * (window_blocks_per_sequence(window, bs) + 1) + -(-config.max_num_batched_tokens // bs)
        cap = 2 * running
        full_bytes = kv_bytes_per_block(self.model, bs, [i for i in range(self.cfg.num_kv_layers) if i not in layers])
        window_bytes = kv_bytes_per_block(self.model, bs, layers)
        if config.num_kv_blocks:
            full, win = config.num_kv_blocks, min(config.num_kv_blocks, cap)
        else:
            even = kv_bytes // (full_bytes + window_bytes)
            full, win = (even, even) if even <= cap else ((kv_bytes - cap * window_bytes) // full_bytes, cap)
        log.info(
            "sliding-window cache group (window %d): %d full-attention blocks (%d without the group), %d window blocks",
            window,
            full,
            config.num_kv_blocks or kv_bytes // (full_bytes + window_bytes),
            win,
        )
        return window, full, win

    def _hybrid_host_tiers(self, config: EngineConfig, num_blocks: int) -> tuple[HostKVTier | None, HostKVTier | None]:
        """A hybrid model's host tiers: attention blocks (publishing nothing: the model's events are its
        boundaries) and state snapshots, as many per block as the device keeps, from one budget."""
        per_block = self.max_snapshots / num_blocks
        state_nbytes = self.runner.state_bytes_per_slot
        host = self._host_tier(config, per_block * state_nbytes, events=False)
        if host is None or not self.max_snapshots:
            return None, None
        num_states = max(1, int(np.ceil(host.num_blocks * per_block)))
        log.info("host state tier: %d snapshots (%.2f GiB)", num_states, num_states * state_nbytes / (1 << 30))
        states = HostKVTier(
            num_states, (state_nbytes // 4,), np.float32, self.events, SessionAwareLRU(config.session_idle_s), config.block_size
        )
        return host, states

    def _finish_host_saves(self) -> None:
        """Stores the evicted blocks whose copies the previous step dispatched (done by now: that step's
        results were read after them), so this step's lookups find them."""
        channels = self.kv.host_channels()
        if not channels:
            return
        start = time.perf_counter()
        for channel in channels:
            for part, data in channel.take_inflight_saves():
                data = np.asarray(data)  # [layers, padded n, ...]
                for j, (_, h, parent, session) in enumerate(part):
                    channel.tier.put(h, parent, data[:, j], session)
        if getattr(self.kv, "host_states", None) is not None:
            for (h, parent, session), state in self.kv.take_inflight_state_saves():
                self.kv.host_states.put(h, parent, self.runner.pack_state(state), session)
        self.host_copy_seconds += time.perf_counter() - start

    def _dispatch_host_copies(self) -> None:
        """The host tier's copies for this step, in dispatch order: evicted blocks out (read before their new
        owners write them; fetched by the next step's `_finish_host_saves`), then reused host blocks in
        (written before the step reads them)."""
        channels = self.kv.host_channels()
        if not channels:
            return
        start = time.perf_counter()
        self._dispatch_host_saves()
        for channel in channels:
            for request_id, block_ids, data in channel.take_pending_loads():
                staged = self.runner.stage_blocks(block_ids, data, channel.group)
                if request_id in self.scheduler.loading:
                    self._staged_loads.setdefault(request_id, []).extend(staged)
                else:  # scheduled in this very step (nothing else to run): written before the step reads it
                    self.runner.write_staged(staged)
        if getattr(self.kv, "host_states", None) is not None:
            loads, copies = self.kv.take_pending_state_loads()
            for slot, state in loads:  # into working slots nothing else uses: ahead of the step that reads them
                self.runner.scatter_state(slot, state)
            if copies:
                self.runner.init_state_slots(copies)
        self.host_copy_seconds += time.perf_counter() - start

    def _dispatch_host_saves(self) -> None:
        """Starts copying the blocks evicted since the last call: before anything writes them again."""
        chunk = self.runner.page_buckets[-1]
        for channel in self.kv.host_channels():
            saves = channel.take_pending_saves()
            for i in range(0, len(saves), chunk):
                part = saves[i : i + chunk]
                channel.inflight_saves.append((part, self.runner.gather_group_async([b for b, *_ in part], channel.group)))
        if getattr(self.kv, "host_states", None) is not None:
            for slot, h, parent, session in self.kv.take_pending_state_saves():
                self.kv.inflight_state_saves.append(((h, parent, session), self.runner.gather_state_async(slot)))

    def _admit_loaded(self) -> None:
        """Requests whose host-tier blocks were staged on the device last step: written into their blocks
        now (a device-local copy, ahead of this step's program) and scheduled from this step on. A request
        that ended meanwhile (aborted) has its staging dropped: its blocks may belong to another by now."""
        if not self._staged_loads:
            return
        start = time.perf_counter()
        staged, self._staged_loads = self._staged_loads, {}
        live = [rid for rid in staged if rid in self.scheduler.loading]
        for rid in live:
            self.runner.write_staged(staged[rid])
        self.scheduler.admit_loaded(live)
        self.host_copy_seconds += time.perf_counter() - start

    # ---------------------------------------------------------------- the step

    def step(self) -> list[TokenDelta]:
        """One engine step, in three calls: schedule, run, post-process. The step's deltas (every request's
        new tokens, or its end) come back as one list: the batch a decode worker sends its front end.

        With asynchronous scheduling (the default) `run` launches this step's program and returns at once;
        `postprocess` then reads the *previous* step's sampled tokens while the device runs this one, so the
        host's work (schedule, prepare, detokenise, stop checks) overlaps the device's, and a step's deltas
        come back from the next call. Without it, each call waits for its own step."""
        start = time.perf_counter()
        if self.balancer is not None:
            self.balancer.on_step(self.runner.expert_loads_array)  # read only when a rebalance is due
        deltas = self._schedule_prelude()
        sched = self._schedule()
        launched = self._run(sched) if sched.scheduled else None
        deltas += self._postprocess(launched)
        self._stage_held()  # before the deltas leave: whoever reads a finished prefill finds its copy staged
        if self.speculator is not None:
            self._measure_speculation(sched, deltas, time.perf_counter() - start)
        return deltas

    def _schedule_prelude(self) -> list[TokenDelta]:
        """What must be known before planning: requests ended from outside the step (aborts), and the tokens
        the step in flight is sampling when planning the next one depends on them."""
        deltas, self._finished_outside_step = self._finished_outside_step, []
        if self._inflight is not None and self._needs_pending_tokens():
            deltas += self._process(self._take_inflight())
        if self.speculator is not None:
            self._speculating = self.speculator.wants(len(self.scheduler.running))
            self.speculator.propose(self.scheduler.running, self.max_model_len)
            self._fit_drafts_to_grammars()
        return deltas

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's plan, with the host tier's copies around it: finished saves stored, staged loads
        admitted, then evicted blocks copied out and reused ones in (even when only loads started)."""
        self._finish_host_saves()
        self._admit_loaded()
        sched = self.scheduler.schedule()
        self._dispatch_host_copies()
        return sched

    def _postprocess(self, launched: _InFlight | None) -> list[TokenDelta]:
        """The previous step's tokens (async) or this one's (sync) turned into deltas."""
        deltas = self._process(self._take_inflight()) if self._inflight is not None else []
        self._inflight = launched
        if launched is not None and not (self.config.async_scheduling and self.single_process):
            deltas += self._process(self._take_inflight())
        return deltas

    def _needs_pending_tokens(self) -> bool:
        """Whether planning the next step needs tokens the step in flight is still sampling: penalties count
        every output token, a grammar's next mask follows from the last token, and a hybrid model names the
        snapshot at a block's end by the block's tokens. Speculative decoding proposes from the last token
        and places the next step's positions by how many drafts were accepted: it always needs them."""
        if self.speculator is not None:
            if self._inflight is not None and any(self._inflight.drafts):
                return True  # how many tokens it yields is known only once they are
            if self.speculator.wants(len(self.scheduler.running)):
                return True
        return any(
            r.num_pending_outputs
            and (
                r.sampling_params.uses_penalties
                or r.sampling_params.structured is not None
                or r.sampling_params.bad_words
                or self.kv.plan_needs_pending_token(r)
            )
            for r in self.scheduler.running
        )

    def _take_inflight(self) -> _InFlight:
        inflight, self._inflight = self._inflight, None
        return inflight

    def _run(self, sched: SchedulerOutput) -> _InFlight:
        """Dispatches the step's program and its sampling, and returns without waiting for either."""
        self.runner.copy_blocks(sched.block_copies)
        prev = self._inflight.sampled.get("token_ids") if self._inflight is not None else None
        inputs = self.runner.prepare(sched, prev)
        logits = self.runner.run(inputs)
        prompt = self._prompt_row_logprobs(sched, inputs, logits)
        items = [(inputs.logits_rows[i], item) for i, item in enumerate(sched.scheduled) if item.completes_known_tokens]
        requests = [item.request for _, item in items]
        drafts = [item.drafts for _, item in items]
        logit_rows = [row + i for row, item in items for i in range(item.num_spec + 1)]
        if inputs.prompt_rows and items:  # a row per token this step: the sampler gets its usual rows
            logits, logit_rows = self._sampling_rows(logits, logit_rows, inputs.tokens.shape[-1])
        sampled = self._sample(logits, requests, drafts, logit_rows) if items else {}
        for item in sched.scheduled:
            self.scheduler.advance(item)
        rows, j = [], 0
        for request, d in zip(requests, drafts):
            request.num_pending_outputs += 1
            request.pending_row = j  # without drafts its one token's row (a draft's request waits for its tokens)
            rows.append(j)
            j += len(d) + 1
        self._step_counter += 1
        feed = None
        if self.runner.hidden_out is not None:
            feed = (
                self.runner.last_hidden,
                [(it.request, int(inputs.cu_q_lens[i]), it.start, it.num_new_tokens) for i, it in enumerate(sched.scheduled)],
            )
        return _InFlight(requests, sampled, rows, drafts, prompt, feed)

    def _prompt_row_logprobs(self, sched: SchedulerOutput, inputs, logits) -> list:
        """Dispatches the logprobs of the prompt positions this step computed for requests that want them."""
        out = []
        for i, first_row, count in inputs.prompt_rows:
            item = sched.scheduled[i]
            request = item.request
            next_ids = request.prompt_token_ids[item.start + 1 : item.start + 1 + count]
            out.append((request, item.start + 1, next_ids, prompt_row_logprobs(logits, first_row, next_ids, request.prompt_logprobs)))
        return out

    def _sampling_rows(self, logits, logit_rows: list[int], num_tokens: int):
        """The rows to sample from a step with a logits row per token, gathered into the usual row bucket."""
        rows = np.zeros((max(self.runner.logits_rows_for(num_tokens), len(logit_rows)),), np.int32)
        rows[: len(logit_rows)] = logit_rows
        return _take_rows_jit(logits, rows), list(range(len(logit_rows)))

    def _process(self, inflight: _InFlight) -> list[TokenDelta]:
        """The step's sampled tokens on the host, appended to their requests (skipping requests that ended
        meanwhile: aborted, or stopped by the token before, whose step ran ahead of knowing it)."""
        for request, first, next_ids, arrays in inflight.prompt:  # before the first token's delta, which carries them
            if not request.status.finished:
                self.outputs.fill_prompt_logprobs(
                    request.request_id, first, prompt_logprob_entries(arrays, next_ids, request.prompt_logprobs)
                )
        try:
            return self._process_tokens(inflight)
        finally:
            if inflight.hidden_feed is not None:  # after the tokens: the head reads which drafts were accepted
                self.speculator.proposer.feed(*inflight.hidden_feed)

    def _process_tokens(self, inflight: _InFlight) -> list[TokenDelta]:
        if not inflight.requests:
            return []
        sampled = jax.device_get(inflight.sampled)
        deltas = []
        for request, j, drafts in zip(inflight.requests, inflight.rows, inflight.drafts):
            request.num_pending_outputs -= 1
            if request.status.finished or not self.outputs.has(request.request_id):
                continue
            if drafts:
                deltas.append(self._verify(request, sampled, j, drafts))
            else:
                deltas.append(self._append_token(request, sampled, j))
        return deltas

    def _verify(self, request: Request, sampled: dict, j: int, drafts: list[int]) -> TokenDelta:
        """Speculative decoding: the drafts the target's draws confirm, then the first draw that differs
        (or the bonus draw after the last draft), appended in order until one ends the request; one delta
        for all of them."""
        accepted = accepted_length(drafts, sampled["token_ids"][j : j + len(drafts)])
        self.speculator.verified(request, len(drafts), accepted)
        deltas = []
        for i in range(accepted + 1):
            deltas.append(self._append_token(request, sampled, j + i, finish=False))
            if deltas[-1].finish_reason is not None:
                # The tokens before the last have their KV (as a step-by-step decode would): their full
                # blocks are cached before the request lets go of them.
                request.num_computed_tokens += min(accepted, len(deltas) - 1)
                self.kv.cache_full_blocks(request)
                self._finish(request, deltas[-1])
                return _merged(deltas)
        self.scheduler.accept_drafts(request, accepted, len(drafts))
        return _merged(deltas)

    def _sample(self, logits: jax.Array, requests: list[Request], drafts: list[list[int]], logit_rows: list[int]) -> dict:
        """Samples one token per request, or one per position of a request's drafts and one more: each row
        as if the drafts before it were the request's tokens (its seeded draw, penalties and grammar
        follow them), so a confirmed draft is exactly the token the request would have sampled there."""
        bucket = logits.shape[0]
        order = np.zeros((bucket,), np.int32)
        order[: len(logit_rows)] = logit_rows
        row_requests = [r for r, d in zip(requests, drafts) for _ in range(len(d) + 1)]
        row_drafts = [d[:i] for d in drafts for i in range(len(d) + 1)]
        params = [r.sampling_params for r in row_requests]
        uses_penalties = any(p.uses_penalties for p in params)
        # The step's program is already dispatched: the grammar masks are computed while the device runs it.
        grammars = self._row_grammars(row_requests, row_drafts)
        batch = build_sampling_batch(
            params,
            [len(r.output_token_ids) + r.num_pending_outputs + len(d) for r, d in zip(row_requests, row_drafts)],
            bucket,
            logits.shape[1],
            prompt_token_ids_list=[r.prompt_token_ids for r in row_requests] if uses_penalties else None,
            output_token_ids_list=[r.output_token_ids + d for r, d in zip(row_requests, row_drafts)] if uses_penalties else None,
            step_seed=int(self._rng.integers(0, 2**63)),
            eos_token_ids=self.eos_token_ids,
            allowed_bitmask=self._allowed_bitmask(params, grammars, bucket),
            extra_banned=self.outputs.bad_word_bans(row_requests),
        )
        num_logprobs = MAX_LOGPROBS if any(p.logprobs for p in params) else 0
        wants_logprobs = any(p.logprobs is not None for p in params)  # else no softmax over the vocabulary
        out: SamplerOutput = sample(logits, batch, num_logprobs, rows=order, token_logprobs=wants_logprobs)
        # Only what the step reads comes back to the host: the tokens, plus logprobs if a request asks.
        # Left on the device here; the copies start now and are read when the step's outputs are made.
        wanted = out._asdict() if wants_logprobs else {"token_ids": out.token_ids}
        for array in wanted.values():
            array.copy_to_host_async()
        return wanted

    def _row_grammars(self, row_requests: list[Request], row_drafts: list[list[int]]) -> list:
        """(row, grammar state) for each constrained row: the request's own state, or after a draft prefix a
        copy advanced past it (the request's matcher only ever sees accepted tokens)."""
        grammars, copy = [], None
        for j, (r, d) in enumerate(zip(row_requests, row_drafts)):
            if r.sampling_params.structured is None:
                continue
            state = self.outputs.grammar(r.request_id)
            if not d:
                grammars.append((j, state))
                copy = None
                continue
            if copy is None:
                copy = GrammarState(state.matcher.deep_copy())
            copy.accept(d[-1])
            grammars.append((j, GrammarState(copy.matcher.deep_copy())))
        return grammars

    def _fit_drafts_to_grammars(self) -> None:
        """A constrained request's drafts end before the first token its grammar refuses (no row is sampled
        under a grammar that has already failed)."""
        for r in self.scheduler.running:
            if r.spec_token_ids and r.sampling_params.structured is not None:
                state = self.outputs.grammar(r.request_id)
                if state is None:
                    r.spec_token_ids = []
                else:
                    r.spec_token_ids = r.spec_token_ids[: state.matcher.validate_tokens(r.spec_token_ids)]

    def _measure_speculation(self, sched: SchedulerOutput, deltas: list[TokenDelta], seconds: float) -> None:
        """Feeds the speculator's speed gate: a call delivers the tokens of the step launched by the call
        before (asynchronously or not), so its tokens and time count for that step's mode, if that step
        only decoded (a prefill chunk's time says nothing about decoding). The mode of the step this call
        launched tells the gate whether the measured one sat between two of its own mode."""
        last, self._last_launch = self._last_launch, None
        if sched.scheduled and all(item.num_new_tokens - item.num_spec == 1 for item in sched.scheduled):
            self._last_launch = (len(sched.scheduled), self._speculating)
        if last is not None and self.speculator.gate is not None:
            following = self._last_launch[1] if self._last_launch is not None else None
            self.speculator.gate.observe(last[0], last[1], sum(len(d.token_ids) for d in deltas), seconds, following)

    def _speculator(self, config: EngineConfig) -> Speculator | None:
        if config.speculative is None:
            return None
        proposer = None
        if config.speculative.method == "draft":  # refuses meshes itself (the draft runs on one device)
            proposer = DraftModelProposer(config, self.kv, self.max_model_len, self.runner.num_blocks, self.cfg, config.model)
        elif config.speculative.method == "mtp":  # likewise (the head runs on one device)
            proposer = MTPProposer(config, self.kv, self.max_model_len, self.runner.num_blocks, self.model)
        if proposer is not None and config.warmup:
            proposer.warmup()
        return Speculator(config.speculative, proposer)

    def _allowed_bitmask(self, params: list[SamplingParams], grammars: list, bucket: int) -> np.ndarray | None:
        """The step's token bitmask: the grammars' masks, and allowed_token_ids; None when nothing is
        constrained (the sampler then skips the masking)."""
        restricted = [(j, p.allowed_token_ids) for j, p in enumerate(params) if p.allowed_token_ids]
        if not grammars and not restricted:
            return None
        mask = self.grammars.fill_bitmask(grammars, bucket)
        for j, ids in restricted:
            mask[j] &= ids_bitmask(ids, mask.shape[1])
        return mask

    def _append_token(self, request: Request, sampled: dict, j: int, finish: bool = True) -> TokenDelta:
        """Row `j`'s token appended to its request; the output processor makes its delta, and a delta that
        ends the request finishes it in the scheduler (unless `finish` is off: the caller does)."""
        token = int(sampled["token_ids"][j])
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
            self.prefix_queries += request.num_prompt_tokens
            self.prefix_hits += max(request.num_cached_tokens, 0)
        request.output_token_ids.append(token)
        logprobs = None
        k = request.sampling_params.logprobs
        if k is not None:
            logprobs = {int(t): float(lp) for t, lp in zip(sampled["top_logprob_ids"][j][:k], sampled["top_logprobs"][j][:k])}
            logprobs[token] = float(sampled["token_logprob"][j])
        delta = self.outputs.append(request, token, logprobs)
        if delta.finish_reason is not None and finish:
            self._finish(request, delta)
        return delta

    def _finish(self, request: Request, delta: TokenDelta) -> None:
        status = RequestStatus.FINISHED_STOPPED if delta.finish_reason == "stop" else RequestStatus.FINISHED_LENGTH
        self.scheduler.finish(request, status)

    def _prompt_logprobs(self, prompt: list[int], k: int):
        """Logprobs of each prompt token given its prefix, from a contiguous forward over the prompt."""
        from workers.models import prompt_logits

        # Padded to a power of two (at least 16, at most max_model_len): a compile per length bucket, not
        # per prompt length (lm-eval's scoring requests all differ in length).
        bucket = min(max(16, 1 << (len(prompt) - 1).bit_length()), max(self.max_model_len, len(prompt)))
        logits = prompt_logits(self.model, [prompt], pad_to=bucket)[0]
        return prompt_logprobs(logits, prompt, k)

    # ---------------------------------------------------------------- warm-up

    def warmup(self, show_progress: bool = True) -> float:
        """Compiles every step bucket and the greedy and plain-sampling sampler variants."""
        greedy, plain = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)

        def sample_variants(logits):
            for p in (greedy, plain):
                batch = build_sampling_batch([p], [0], logits.shape[0], logits.shape[1], step_seed=0, eos_token_ids=self.eos_token_ids)
                # As served without logprobs.
                out = sample(logits, batch, 0, rows=np.zeros((logits.shape[0],), np.int32), token_logprobs=False)
            return out.token_ids

        return self.runner.warmup(sample_variants, show_progress, background=self.config.background_compile and self.single_process)


_take_rows_jit = jax.jit(lambda logits, rows: logits[rows])


def _merged(deltas: list[TokenDelta]) -> TokenDelta:
    """One request's deltas of one step as one (speculative decoding appends several tokens a step)."""
    if len(deltas) == 1:
        return deltas[0]
    first, last = deltas[0], deltas[-1]
    logprobs = None if first.logprobs is None else [lp for d in deltas for lp in d.logprobs or ()]
    return TokenDelta(
        first.request_id,
        [t for d in deltas for t in d.token_ids],
        "".join(d.text for d in deltas),
        last.num_output_tokens,
        last.num_cached_tokens,
        last.finish_reason,
        logprobs,
        first.prompt_logprobs,
        first.queue_s,
    )


def load_engine_model(config: EngineConfig, show_progress: bool = True) -> LoadedModel:
    """The model on the engine's devices: one, or the mesh of `config.parallel` (joining the other
    processes of a multi-host engine first)."""
    d = config.parallel.distributed
    init_distributed(distributed_settings(d.coordinator_address, d.num_processes, d.process_id))
    return load_parallel_model(
        config.model, config.parallel, dtype=config.dtype, load_format=config.load_format, seed=config.seed, show_progress=show_progress
    )


def _maybe_tokenizer(model_dir: str) -> Tokenizer | None:
    if (Path(model_dir) / "tokenizer.json").is_file():
        return Tokenizer.from_dir(model_dir)
    return None
