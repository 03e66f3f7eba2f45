"""The model runner: turns a `SchedulerOutput` into padded device arrays and runs the compiled step.

Static shapes: the flat token count is padded to a *token bucket*, the per-sequence page table to a
*page bucket*, and the number of sequences follows the token bucket (min(tokens, max_num_seqs)), so the
set of compiled programs is |token buckets| x |page buckets|, all compiled by `warmup()`.
The KV pages are donated to each step, so XLA updates them in place.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import logging
import math
import os
import threading
import time
import types
import weakref
from dataclasses import dataclass, field, is_dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kernels import block_copy, dense
from kernels.collectives import align_processes, axes_index, collectives_over_gloo, place_host
from workers.models import LoadedModel
from workers.models.layers import PagedKVCache
from workers.models.paged_state import KEEP, PagedHybridCache, init_slots

from ..progress import Progress
from .config import EngineConfig, powers_of_two_up_to
from .kv_cache_manager import BlockCopy
from .program_cache import STEP_PROGRAMS
from .scheduler import SchedulerOutput
from .state_cache import SNAPSHOTS_PER_STEP
from .window_cache import WINDOW_GROUP

log = logging.getLogger("moray.engine")

# An export's copy is dispatched in pieces of at most this many bytes (`Runner.stage_export`): the KV
# transfer's default chunk size, so a piece is one chunk.
EXPORT_PIECE_BYTES = 8 << 20

# Runners whose background compiler may still be running. A process that exits while XLA compiles on a
# daemon thread dies in the runtime's teardown (a segfault or an LLVM abort, 2 of 3 exits of a short
# script); at exit each is stopped after the program it is compiling.
_COMPILING: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_background_compilers() -> None:
    for runner in list(_COMPILING):
        runner.stop_background_compile()


def pick_bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class StepInputs:
    """Host-side arrays for one step (numpy), plus which row of the logits belongs to which request."""

    tokens: np.ndarray  # i32[1, N]
    positions: np.ndarray  # i32[1, N]
    slot_mapping: np.ndarray  # i32[N]
    kv_lens: np.ndarray  # i32[S]
    page_indices: np.ndarray  # i32[S, P]
    cu_q_lens: np.ndarray  # i32[S + 1]
    num_seqs: np.ndarray  # i32[1]
    logits_indices: np.ndarray  # i32[S]
    # Hybrid models (linear-attention state slots, see `state_cache.StateStep`); None otherwise.
    state_slots: np.ndarray | None = None  # i32[S]
    # (slot, ZERO | snapshot slot) for sequences starting this step; applied before the step, by global slot.
    state_inits: list[tuple[int, int]] = field(default_factory=list)
    snap_slots: np.ndarray | None = None  # i32[S, SNAPSHOTS_PER_STEP], -1 where unused
    snap_lens: np.ndarray | None = None  # i32[S, SNAPSHOTS_PER_STEP]
    decode_only: bool = False  # every sequence has exactly one token (a hybrid model's decode program)
    # Asynchronous scheduling: where an input token is one the previous step sampled and the host has not
    # seen yet, its row in that step's sampled tokens (`prev_tokens`, on the device); -1 elsewhere.
    token_sources: np.ndarray | None = None  # i32, the shape of `tokens`
    prev_tokens: jax.Array | None = None
    # The first logits row of each scheduled request (speculative decoding gives a request 1 + drafts rows).
    logits_rows: list[int] = field(default_factory=list)
    # Requests that want their prompt's logprobs (`Request.prompt_logprobs`): (scheduled index, first row,
    # rows) of the prompt positions this step computes, each row predicting the next prompt token. Such a
    # step has a logits row per token (row = token index).
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)
    # A sliding-window cache group (window_cache.py): its layers' slots and page table; None otherwise.
    window_slot_mapping: np.ndarray | None = None  # i32[N]
    window_page_indices: np.ndarray | None = None  # i32[S, P]
    # A multi-token-prediction head's step (mtp_proposer.py): the hidden state read at each token, [1, N, H].
    hidden: jax.Array | None = None

    def put_tokens(self, row: int, offset: int, request, start: int, k: int, prev_tokens: jax.Array | None) -> None:
        """Input tokens [start, start + k) of `request` at tokens[row, offset:]; a last one the host does
        not have yet (sampled by the step in flight) is taken from `prev_tokens` on the device."""
        known = request.all_token_ids
        have = max(0, min(k, len(known) - start))
        if have == 1:  # decode: a scalar write, no temporary list
            self.tokens[row, offset] = known[start]
        elif have:
            self.tokens[row, offset : offset + have] = known[start : start + have]
        if have < k:
            if self.token_sources is None:
                self.token_sources = np.full(self.tokens.shape, -1, np.int32)
                self.prev_tokens = prev_tokens
            self.token_sources[row, offset + k - 1] = request.pending_row

    def states(self) -> tuple | None:
        if self.state_slots is None:
            return None
        return (self.state_slots, self.snap_slots, self.snap_lens)

    def window(self) -> tuple | None:
        if self.window_slot_mapping is None:
            return None
        return (self.window_slot_mapping, self.window_page_indices)


class ModelRunner:
    # A prompt's logprobs come from the steps that prefill it (`StepInputs.prompt_rows`), batched with the rest.
    prompt_rows_in_step = True

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        num_state_slots: int = 0,
        num_window_blocks: int = 0,
    ):
        """`num_window_blocks`: the sliding-window layers' own pool (a cache group with its own block tables,
        window_cache.py); 0: every layer in one pool of `num_blocks`."""
        self.model = model
        self.cfg = model.cfg
        self.num_state_slots = num_state_slots if self.cfg.is_hybrid else 0
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = config.max_num_seqs
        # Speculative decoding: a sequence may need a logits row per draft plus one.
        self.rows_per_seq = 1 + (config.speculative.num_speculative_tokens if config.speculative else 0)
        # A multi-token-prediction head reads every token's last hidden state: the step returns them too
        # (`last_hidden`, [1, N, H] after the final norm).
        self.hidden_out = "normed" if config.speculative is not None and config.speculative.method == "mtp" else None
        self.last_hidden: jax.Array | None = None
        max_pages = math.ceil(max_model_len / config.block_size)
        self.token_buckets = config.token_buckets or powers_of_two_up_to(config.max_num_batched_tokens)
        self.page_buckets = config.page_buckets or powers_of_two_up_to(max_pages)
        if self.token_buckets[-1] < config.max_num_batched_tokens:
            raise ValueError("the largest token bucket must be >= max_num_batched_tokens")
        if self.page_buckets[-1] < max_pages:
            raise ValueError(f"the largest page bucket must be >= max_model_len / block_size = {max_pages}")
        self.num_window_blocks = num_window_blocks
        self.window_layers = window_layers(self.cfg) if num_window_blocks else ()
        # Per cache layer (MLA: one latent row per token; Gemma 4: full and sliding layers differ).
        page_shapes = [
            (num_window_blocks if i in self.window_layers else num_blocks, config.block_size, *self.cfg.kv_layer_page_dims(i))
            for i in range(self.cfg.num_kv_layers)
        ]
        self.kv_pages = self._new_pages(page_shapes)
        # Blocks leave the device (handoff, host tier) in one layout for every layer: ModelConfig.kv_transport_dims.
        self.transport_width = None if self.cfg.uniform_kv_pages else self.cfg.kv_transport_dims[1]
        # Linear-attention layers: conv and recurrent state pools, float32, addressed by slot.
        self.state_pools = self._new_state_pools() if self.num_state_slots else None
        self.num_traces = 0  # step programs this runner traced (those taken from the process's cache are not)
        self.expert_loads: jax.Array | None = None  # int32 [MoE layers, experts], summed on device (read_expert_loads)
        # Written only by the engine thread; the stats threads read it and never clear it (a reader that
        # cleared it raced the engine thread's next snapshot and killed the engine).
        self._load_snapshot: jax.Array | None = None  # expert_loads as of a recent step, on its way to the host
        self._load_host: tuple[jax.Array, np.ndarray] | None = None  # (snapshot, its host copy): the last one arrived
        self._steps_run = 0
        # Input tokens are placed explicitly, merged with the device's sampled tokens or not, so that both
        # kinds of step reach the same compiled program (jit keys its cache on the arguments' placement).
        self.token_sharding = NamedSharding(self.model.mesh, PartitionSpec())
        self._step = jax.jit(self._step_impl, donate_argnums=(1, 2), static_argnames=("decode_only",))
        self._copy = jax.jit(_copy_pages, donate_argnums=(0,))
        # Step programs compiled ahead of time, by shape (token bucket, page bucket, decode-only, logits rows); a shape
        # missing when a step needs it is compiled then, by whichever thread gets to it first.
        self._programs: dict[tuple[int, int, bool, int], object] = {}
        self._compiling: dict[tuple[int, int, bool, int], concurrent.futures.Future] = {}
        self._compile_lock = threading.Lock()
        self._background: threading.Thread | None = None
        self._stop_compiling = threading.Event()
        # Not across the processes of one multi-host engine: they compile each program together (its
        # collectives need all of them), so one waiting for another's lock deadlocks both (seen where two
        # of them share a machine: a Gloo context timed out at warmup).
        self.lock_dir = (
            None
            if not config.compilation_cache_dir or jax.process_count() > 1
            else os.path.join(os.path.expanduser(config.compilation_cache_dir), "moray-locks")
        )
        self._model_key = f"{config.model}|{config.dtype}|{self.num_blocks}|{self.num_state_slots}|{self.max_num_seqs}"
        # Shapes and placements of the weights, KV pages and state pools, fixed for the runner's life (taken
        # now: the live pages are donated to every step).
        self._cache_specs = jax.tree.map(_spec, (self.model.weights, self.kv_pages, self.state_pools))
        # Step programs built by any runner of the process with the same `program_key` are reused (program_cache.py).
        self.num_shared_programs = 0  # step programs taken from the process's cache, not traced here
        self._export_gathers: dict[int, object] = {}  # multi-host: padded blocks -> gather split over hosts
        self._state_gathers: dict[tuple[str, ...], object] = {}  # the state pools' slot axes -> `_slot_gather`
        self._unfinished_imports: list[jax.Array] = []  # `scatter_blocks` writes not yet known done (`wait_for_imports`)

    def _replicated(self, make) -> jax.Array:
        # Committed to the mesh up front: a step's outputs are committed arrays, and jit keys its cache
        # on that, so uncommitted initial pages would compile the first bucket twice.
        return jax.device_put(make(), NamedSharding(self.model.mesh, PartitionSpec()))

    def _new_pages(self, page_shapes: list[tuple[int, ...]]) -> list[jax.Array]:
        return [self._replicated(lambda: jnp.zeros(shape, self.model.dtype)) for shape in page_shapes]

    def _new_state_pools(self) -> tuple[list[jax.Array], list[jax.Array]]:
        n, cfg = self.num_state_slots, self.cfg
        conv = [self._replicated(lambda: jnp.zeros((n, *cfg.conv_state_shape), jnp.float32)) for _ in range(cfg.num_state_layers)]
        rec = [self._replicated(lambda: jnp.zeros((n, *cfg.recurrent_state_shape), jnp.float32)) for _ in range(cfg.num_state_layers)]
        return conv, rec

    @property
    def state_bytes_per_slot(self) -> int:
        return state_bytes_per_sequence(self.cfg)

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model, self.block_size)

    def _step_impl(
        self,
        weights,
        kv_pages,
        state_pools,
        tokens,
        positions,
        slot_mapping,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        logits_indices,
        states,
        window=None,
        hidden=None,
        decode_only=False,
    ):
        self.num_traces += 1  # runs only while tracing: counts compilations
        meta = (list(kv_pages), slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs)
        if state_pools is None:
            groups = {} if window is None else {"window_slot_mapping": window[0], "window_page_indices": window[1]}
            cache = PagedKVCache(*meta, **groups, window_layers=self.window_layers if groups else ())
        else:
            conv, rec = state_pools
            cache = PagedHybridCache(*meta, list(conv), list(rec), *states, decode_only=decode_only)
        counter = RoutingCounter(self.model.experts, slot_mapping >= 0, self.cfg.num_experts)
        # A one-device program holds whole weights: the dense projections may run as CPU kernels (kernels.dense).
        extra = {} if self.hidden_out is None else {"hidden_out": self.hidden_out}
        if hidden is not None:
            extra["hidden"] = hidden
        with dense.single_device(self.model.mesh.size == 1):
            out = self.model.family.forward(weights, self.cfg, tokens, positions, cache, logits_indices, experts=counter, **extra)
        logits, cache, hidden_states = out if self.hidden_out is not None else (*out, None)
        pools = None if state_pools is None else (cache.conv, cache.recurrent)
        return logits, cache.pages, pools, counter.loads(), hidden_states

    def seqs_for(self, token_bucket: int) -> int:
        return min(token_bucket, self.max_num_seqs)

    @property
    def largest_decode_bucket(self) -> int:
        """The largest token bucket a step of one token per sequence can pick."""
        return pick_bucket(self.token_buckets, min(self.max_num_seqs, self.token_buckets[-1]))

    def logits_rows_for(self, token_bucket: int, drafts: bool = True) -> int:
        """Logits rows of a step: one per sequence, or, for a step that may verify drafts, up to one per draft
        and one more (never more than the step's tokens: each row is one token's). A speculating engine's
        plain decode steps keep one row per sequence: with k + 1 rows they paid for the LM head and the
        sampler over rows nobody reads (0.83-0.92x the plain engine at batch 16 in bench spec's setup).
        Buckets only prefill chunks reach keep one row count: a second program for each of them cost
        compile time and memory (bench spec's five engines ran out of memory maps with them)."""
        plain = not drafts and token_bucket <= self.largest_decode_bucket
        return min(token_bucket, self.max_num_seqs * (1 if plain else self.rows_per_seq))

    def logits_row_buckets(self, token_bucket: int) -> list[int]:
        """Every logits-row count a step of `token_bucket` may have (with and without drafts)."""
        return sorted({self.logits_rows_for(token_bucket, drafts) for drafts in (False, True)})

    def prepare(self, out: SchedulerOutput, prev_tokens: jax.Array | None = None) -> StepInputs:
        """`prev_tokens`: the previous step's sampled tokens on the device, read for the input tokens the
        host does not have yet (asynchronous scheduling)."""
        num_tokens = out.num_tokens
        n = pick_bucket(self.token_buckets, num_tokens)
        s = self.seqs_for(n)
        p = pick_bucket(self.page_buckets, max(len(x.request.block_ids) for x in out.scheduled))
        tokens = np.zeros((1, n), np.int32)
        positions = np.zeros((1, n), np.int32)
        slots = np.full((n,), -1, np.int32)
        kv_lens = np.zeros((s,), np.int32)
        pages = np.zeros((s, p), np.int32)
        cu = np.zeros((s + 1,), np.int32)
        every_row = any(_prompt_positions(item) for item in out.scheduled)
        drafts = any(item.num_spec for item in out.scheduled)
        logits_idx = np.arange(n, dtype=np.int32) if every_row else np.zeros((self.logits_rows_for(n, drafts),), np.int32)
        offset = row = 0
        inputs = StepInputs(tokens, positions, slots, kv_lens, pages, cu, np.array([len(out.scheduled)], np.int32), logits_idx)
        bs = self.block_size
        for i, item in enumerate(out.scheduled):
            req, k, start = item.request, item.num_new_tokens, item.start
            inputs.put_tokens(0, offset, req, start, k - item.num_spec, prev_tokens)
            if item.num_spec:  # drafts after the known tokens, a logits row at each of the last 1 + drafts
                tokens[0, offset + k - item.num_spec : offset + k] = item.drafts
            if k == 1:  # decode: scalar writes, no temporary arrays
                positions[0, offset] = start
                slots[offset] = req.block_ids[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, start + k, dtype=np.int32)
                positions[0, offset : offset + k] = pos
                slots[offset : offset + k] = np.asarray(req.block_ids, np.int32)[pos // bs] * bs + pos % bs
            kv_lens[i] = start + k
            pages[i, : len(req.block_ids)] = req.block_ids
            if every_row:
                if _prompt_positions(item):
                    inputs.prompt_rows.append((i, offset, _prompt_positions(item)))
                offset += k
                inputs.logits_rows.append(offset - item.num_spec - 1)
            else:
                offset += k
                inputs.logits_rows.append(row)
                logits_idx[row : row + item.num_spec + 1] = np.arange(offset - item.num_spec - 1, offset)
                row += item.num_spec + 1
            cu[i + 1] = offset
        cu[len(out.scheduled) + 1 :] = offset
        if self.num_state_slots:
            self._prepare_states(inputs, out)
        if self.window_layers:
            self._prepare_window(inputs, out)
        return inputs

    def _prepare_window(self, inputs: StepInputs, out: SchedulerOutput) -> None:
        """The window group's slots and page table (blocks let go read as page 0: out of every query's window)."""
        self._empty_window(inputs)
        bs, offset = self.block_size, 0
        for i, item in enumerate(out.scheduled):
            table, k, start = item.request.window_block_ids, item.num_new_tokens, item.start
            if k == 1:  # decode: a scalar write
                inputs.window_slot_mapping[offset] = table[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, start + k, dtype=np.int32)
                inputs.window_slot_mapping[offset : offset + k] = np.asarray(table, np.int32)[pos // bs] * bs + pos % bs
            inputs.window_page_indices[i, : len(table)] = np.maximum(table, 0)
            offset += k

    def _empty_window(self, inputs: StepInputs) -> None:
        inputs.window_slot_mapping = np.full(inputs.slot_mapping.shape, -1, np.int32)
        inputs.window_page_indices = np.zeros(inputs.page_indices.shape, np.int32)

    def _prepare_states(self, inputs: StepInputs, out: SchedulerOutput) -> None:
        """Per sequence: its working slot, how it starts, and the snapshot the step writes."""
        self._empty_states(inputs)
        for i, item in enumerate(out.scheduled):
            st = item.cache_step
            inputs.state_slots[i] = st.slot
            if st.init != KEEP:
                inputs.state_inits.append((st.slot, st.init))
            if st.backup >= 0:  # copied in the same program as the init: from the init's source if any
                inputs.state_inits.append((st.backup, st.slot if st.init == KEEP else st.init))
            for j, (snap, length) in enumerate(st.snaps):
                inputs.snap_slots[i, j], inputs.snap_lens[i, j] = snap, length
        inputs.decode_only = all(item.num_new_tokens == 1 for item in out.scheduled)

    def _empty_states(self, inputs: StepInputs) -> None:
        s = len(inputs.kv_lens)
        inputs.state_slots = np.zeros((s,), np.int32)
        inputs.snap_slots = np.full((s, SNAPSHOTS_PER_STEP), -1, np.int32)
        inputs.snap_lens = np.zeros((s, SNAPSHOTS_PER_STEP), np.int32)

    def run(self, inputs: StepInputs) -> jax.Array:
        """Runs one step; returns float32 logits [S_bucket, vocab] on device (row i = scheduled request i)."""
        if inputs.state_inits:
            self.init_state_slots(inputs.state_inits)
        program = self.program(self.shape_of(inputs))
        logits, self.kv_pages, self.state_pools, loads, self.last_hidden = program(
            self.model.weights, self.kv_pages, self.state_pools, *self._step_args(inputs)
        )
        self.expert_loads = loads if self.expert_loads is None else _add_jit(self.expert_loads, loads)
        self._steps_run += 1
        if self._steps_run % LOAD_SNAPSHOT_STEPS == 1:  # the first step, then every LOAD_SNAPSHOT_STEPS
            snapshot = self.expert_loads
            if snapshot.is_fully_addressable:
                snapshot.copy_to_host_async()
            self._load_snapshot = snapshot
        return logits

    def expert_load_snapshot(self) -> np.ndarray | None:
        """The counts as of the last snapshot whose device copy is done (a few dozen steps old); None before
        the first. Never waits on the device: the stats that call it run on other threads, and on a
        multi-host engine a wait for a step's output there blocked the leader from sending that step to its
        followers (deadlock)."""
        snapshot, arrived = self._load_snapshot, self._load_host
        if snapshot is not None and (arrived is None or arrived[0] is not snapshot):
            local = snapshot if snapshot.is_fully_addressable else snapshot.addressable_shards[0].data
            if local.is_ready():
                arrived = self._load_host = (snapshot, np.asarray(local).astype(np.int64))
        return None if arrived is None else arrived[1]

    def expert_loads_array(self) -> jax.Array | None:
        """The counts of `read_expert_loads` on the device, this host's copy (None before the first step):
        for a reader that must not wait for the step in flight (it reads them on another thread)."""
        loads = self.expert_loads
        if loads is not None and not loads.is_fully_addressable:  # multi-host: replicated, any local shard is all of it
            loads = loads.addressable_shards[0].data
        return loads

    def read_expert_loads(self) -> np.ndarray:
        """Tokens routed to each (MoE layer, expert) since the runner started, padding excluded: int64 [MoE
        layers, experts]. Counted on the device every step; this is the only host read (call it every few
        hundred steps, not every step)."""
        if self.expert_loads is None:  # per physical slot: redundant experts make more slots than experts
            from workers.models.moe_parallel import moe_blocks

            blocks = moe_blocks(self.model.weights)
            return np.zeros((len(blocks), blocks[0].gate_up.shape[0] if blocks else 0), np.int64)
        return np.asarray(self.expert_loads_array()).astype(np.int64)

    def _step_args(self, inputs: StepInputs) -> tuple:
        """The step program's per-step arguments (after the weights and the cache)."""
        return (
            place_host(self.input_tokens(inputs), self.token_sharding),
            inputs.positions,
            inputs.slot_mapping,
            inputs.kv_lens,
            inputs.page_indices,
            inputs.cu_q_lens,
            inputs.num_seqs,
            inputs.logits_indices,
            inputs.states(),
            inputs.window(),
            inputs.hidden,
        )

    @staticmethod
    def shape_of(inputs: StepInputs) -> tuple[int, int, bool, int]:
        return inputs.tokens.shape[-1], inputs.page_indices.shape[-1], inputs.decode_only, len(inputs.logits_indices)

    # ---------------------------------------------------------------- step programs

    def compiled_shapes(self) -> list[tuple[int, int, bool, int]]:
        """The step programs' shapes (token bucket, page bucket, decode-only, logits rows) compiled so far."""
        return sorted(self._programs)

    def program(self, shape: tuple[int, int, bool, int]):
        """The compiled step program of `shape`: compiled now if nothing has compiled it yet, awaited if
        another thread is compiling it."""
        program = self._programs.get(shape)
        if program is not None:
            return program
        future, mine = self._claim(shape)
        if mine:
            with self._shape_lock(shape, wait=True):
                self._compile_into(shape, future)
            # Processes of one engine compile each program on their own (or one loads it from the cache):
            # they start its first run together, or gloo gives up on its first collective (`align_processes`).
            align_processes()
        return future.result()

    def _claim(self, shape: tuple[int, int, bool, int]) -> tuple[concurrent.futures.Future, bool]:
        """The future of `shape`'s program, and whether the caller just claimed it (and must compile it)."""
        with self._compile_lock:
            future = self._compiling.get(shape)
            if future is not None:
                return future, False
            future = self._compiling[shape] = concurrent.futures.Future()
            return future, True

    def _compile_into(self, shape: tuple[int, int, bool, int], future: concurrent.futures.Future) -> None:
        """Compiles one step program ahead of time: from shapes, touching no live array."""
        try:
            if self._program_key is None:
                program = self._lower_and_compile(shape)
            else:
                program, built = STEP_PROGRAMS.get_or_build((self._program_key, shape), lambda: self._lower_and_compile(shape))
                self.num_shared_programs += not built
        except BaseException as e:
            future.set_exception(e)  # a step waiting for it gets the error
            raise
        self._programs[shape] = program
        future.set_result(program)

    def _lower_and_compile(self, shape: tuple[int, int, bool, int]):
        n, p, decode_only, rows = shape
        specs = jax.tree.map(_spec, self._step_args(self.dummy_inputs(n, p, decode_only, rows)))
        return self._step.lower(*self._cache_specs, *specs, decode_only=decode_only).compile()

    @functools.cached_property
    def _program_key(self) -> tuple | None:
        # Taken at the first compile, once a subclass's constructor has set what its step reads.
        return self.program_key()

    def program_key(self) -> tuple | None:
        """Everything the step's trace reads besides its arguments' shapes (`StepProgramCache`): two runners
        with equal keys build the same step programs. A subclass whose step reads more extends it. None (not
        shared) where the model's family or expert executor is an object of its own (a speculative head's):
        the cache would compare it by identity and keep it, and its weights, alive."""
        experts = self.model.experts
        if not isinstance(self.model.family, types.ModuleType) or not (experts is None or is_dataclass(experts)):
            return None
        kernels_env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("MORAY_")))
        return (
            type(self),
            self.model.family,
            repr(self.cfg),
            str(self.model.dtype),
            self.model.mesh,
            self.model.data_axes,
            experts,
            self.window_layers,
            self.hidden_out,
            self.block_size,
            self.max_num_seqs,
            self.rows_per_seq,
            collectives_over_gloo(),
            kernels_env,  # the kernels' implementation switches are read while tracing
            jax.tree.structure(self._cache_specs),
            tuple(jax.tree.leaves(self._cache_specs)),
        )

    @contextlib.contextmanager
    def _shape_lock(self, shape: tuple[int, int, bool, int], wait: bool):
        """Yields whether this engine holds `shape`'s host-wide lock. Engines on one host sharing the
        compilation cache compile each shape once between them: the holder compiles, the others wait (or,
        in the background, move on) and then load its binary from the persistent cache."""
        if self.lock_dir is None:
            yield True
            return
        os.makedirs(self.lock_dir, exist_ok=True)
        key = hashlib.sha256(f"{self._model_key}|{shape}".encode()).hexdigest()[:24]
        fd = os.open(os.path.join(self.lock_dir, key), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the lock

    def compile_in_background(self, shapes: list[tuple[int, int, bool, int]], sample_fn=None) -> None:
        """Compiles `shapes` (smallest first) on a background thread while the engine serves; a step that
        needs one first compiles it itself. Shapes another engine holds the lock of are left for a second
        pass, by when their binaries are in the persistent cache."""

        stop = self._stop_compiling

        def work():
            start = time.perf_counter()
            later = [shape for shape in shapes if not stop.is_set() and not self._compile_unless_locked(shape, wait=False)]
            for shape in later:
                if not stop.is_set():
                    self._compile_unless_locked(shape, wait=True)
            for shape in shapes if sample_fn is not None else ():
                if not stop.is_set():
                    sample_fn(self._dummy_logits(shape))
            if not stop.is_set():
                log.info("background compilation of %d step programs done in %.1fs", len(shapes), time.perf_counter() - start)

        self._background = threading.Thread(target=work, name="moray-compile", daemon=True)
        _COMPILING.add(self)
        self._background.start()

    def stop_background_compile(self) -> None:
        """Stops the background compiler after the program it is compiling (steps still compile what
        they need on first use)."""
        self._stop_compiling.set()
        if self._background is not None:
            self._background.join()

    def _compile_unless_locked(self, shape: tuple[int, int, bool, int], wait: bool) -> bool:
        """Compiles `shape` unless another thread has (or is); False when another engine holds its lock
        (and `wait` is off). The lock is taken before the claim, so a step never waits on a claim that
        is given up."""
        with self._shape_lock(shape, wait) as held:
            if not held:
                return False
            future, mine = self._claim(shape)
            if mine:
                try:
                    self._compile_into(shape, future)
                except Exception:  # noqa: BLE001 - kept in the future: the step that needs it raises it
                    log.exception("background compilation of step program %s failed", shape)
        return True

    def _dummy_logits(self, shape) -> jax.Array:
        info = self.program(shape).out_info[0]
        return place_host(np.zeros(info.shape, info.dtype), info.sharding)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Waits for the background compilation (if any); True when every step program is compiled."""
        if self._background is not None:
            self._background.join(timeout)
        return all(shape in self._programs for shape in self.step_shapes())

    @staticmethod
    def input_tokens(inputs: StepInputs):
        """The step's input tokens: the host's, with the previous step's sampled tokens merged in on the
        device where the host does not have them yet."""
        if inputs.token_sources is None:
            return inputs.tokens
        return _merge_tokens_jit(inputs.tokens, inputs.prev_tokens, inputs.token_sources)

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copies blocks within each cache group's layers (one group: every layer)."""
        for group in sorted({c.group for c in copies}):
            src = jnp.asarray([c.src for c in copies if c.group == group], jnp.int32)
            dst = jnp.asarray([c.dst for c in copies if c.group == group], jnp.int32)
            layers = self.group_layers(group)
            copied = self._copy([self.kv_pages[i] for i in layers], src, dst)
            for i, pages in zip(layers, copied):
                self.kv_pages[i] = pages

    def _layer_ids(self, block_ids: list[int], window_ids: list[int] | None, pad_value: int, window_pad: int):
        """Block ids per cache layer: the full group's for its layers, the window group's (blocks let go:
        `window_pad`) for the sliding ones; one array for every layer without a window group."""
        ids = self._padded_ids(block_ids, pad_value)
        if not self.window_layers:
            return ids
        win = np.full(ids.shape, window_pad, np.int32)
        if window_ids:
            table = np.asarray(window_ids, np.int32)
            win[: len(table)] = np.where(table >= 0, table, window_pad)
        return [win if i in self.window_layers else ids for i in range(len(self.kv_pages))]

    def _padded_ids(self, block_ids: list[int], pad_value: int) -> np.ndarray:
        n = pick_bucket(self.page_buckets, max(len(block_ids), 1))
        ids = np.full((n,), pad_value, np.int32)
        ids[: len(block_ids)] = block_ids
        return ids

    def gather_blocks(self, block_ids: list[int], layer_start: int, layer_end: int) -> np.ndarray:
        """KV of `block_ids` for layers [start, end) on the host: [layers, blocks, page, *kv_transport_dims]."""
        return np.asarray(self.gather_blocks_async(block_ids, layer_start, layer_end))[:, : len(block_ids)]

    def gather_blocks_async(self, block_ids: list[int], layer_start: int, layer_end: int) -> jax.Array:
        """Dispatches the copy of `block_ids` into a fresh device array (padded to a page bucket) and returns
        at once: the copy reads the pages before any later step writes them (dispatch order), and the
        host fetches the array when it needs it."""
        return _gather_jit(self.kv_pages[layer_start:layer_end], self._padded_ids(block_ids, 0), self.transport_width)

    def group_layers(self, group: int) -> list[int]:
        """The cache layers of a cache group (`BlockCopy.group`, `HostChannel.group`): every layer of one pool;
        with a sliding-window group, the full layers (0) or the sliding ones (1)."""
        if not self.window_layers:
            return list(range(len(self.kv_pages)))
        return [i for i in range(len(self.kv_pages)) if (i in self.window_layers) == (group == WINDOW_GROUP)]

    def gather_group_async(self, block_ids: list[int], group: int) -> jax.Array:
        """`gather_blocks_async` over one cache group's layers ([layers, padded blocks, ...])."""
        pages = [self.kv_pages[i] for i in self.group_layers(group)]
        return _gather_jit(pages, self._padded_ids(block_ids, 0), self.transport_width)

    def stage_export(self, block_ids: list[int], window_ids: list[int] | None = None) -> tuple[int, list[tuple[int, jax.Array]]]:
        """Dispatches a copy of every layer's KV of `block_ids`, blocks first ([padded blocks, layers, page,
        2*Hkv, D]: a run of whole blocks is then a contiguous slice on the host), starts its transfer to
        the host and returns at once. Dispatch order makes it read the pages before any later step writes
        them, so the blocks may be freed right after.

        Returns (the first block this process holds, its pieces: (first block within the part, device array
        whose leading rows are those blocks)). In one process the copy is dispatched in pieces of
        `export_piece_blocks` blocks (a few MiB): the exporter checksums each piece while later ones are still
        being copied, and small copies are fast where a whole-request one is not (measured, 66 MiB on 2 CPU
        cores: one copy padded to 96 MiB 25-36 ms, 11 pieces of 6 MiB 6-7 ms; a fresh buffer of tens of MiB is
        page-faulted in as it is written, small ones reuse the allocator's pages). One engine over several
        hosts makes one copy split by blocks across the hosts, so that each host exports the blocks it holds
        and no host receives the whole KV; no pieces on a host that holds none of it. `window_ids`: the window
        group's table (its blocks let go are sent as page 0's contents, which the receiver drops)."""
        if jax.process_count() > 1:
            ids = self._layer_ids(block_ids, window_ids, 0, 0)
            padded = len(ids[0]) if self.window_layers else len(ids)
            offset, part = _local_part(self._export_gather(padded)(self.kv_pages, ids, self.transport_width))
            if part is None:
                return offset, []
            part.copy_to_host_async()
            return offset, [(0, part)]
        pieces = []
        step = self.export_piece_blocks
        for start in range(0, len(block_ids), step):
            window = window_ids[start : start + step] if window_ids else None
            ids = self._layer_ids(block_ids[start : start + step], window, 0, 0)
            piece, _ = block_copy.gather_blocks_first_async_jit(self.kv_pages, ids, self.transport_width, self.block_copy_impl)
            piece.copy_to_host_async()
            pieces.append((start, piece))
        return 0, pieces

    @functools.cached_property
    def export_piece_blocks(self) -> int:
        """Blocks per piece of an export copy: the largest page bucket within EXPORT_PIECE_BYTES (one bucket: one
        program, and only the last piece is padded)."""
        per_block = sum(math.prod(p.shape[1:]) * p.dtype.itemsize for p in self.kv_pages)
        fitting = [b for b in self.page_buckets if b * per_block <= EXPORT_PIECE_BYTES]
        return max(fitting, default=self.page_buckets[0])

    def stage_state_export(self, slot: int):
        """The slot's state on its way to the host; None on every host but the first of a multi-host engine
        (the state is small: one host exports all of it)."""
        state = self._gather_state(slot)
        if jax.process_count() > 1:
            if jax.process_index() != 0:
                return None
            state = jax.tree.map(lambda a: a.addressable_shards[0].data, state)  # replicated: any shard is all
        for a in jax.tree.leaves(state):
            a.copy_to_host_async()
        return state

    def _export_gather(self, padded_blocks: int):
        if jax.process_count() == 1:
            return block_copy.gather_blocks_first_jit
        fn = self._export_gathers.get(padded_blocks)
        if fn is None:
            sharding = _split_over_hosts(self.model.mesh, padded_blocks)
            fn = self._export_gathers[padded_blocks] = _gather_over_ranks(self.model.mesh, _row_axes(self.kv_pages), sharding)
        return fn

    @functools.cached_property
    def block_copy_impl(self) -> str:
        """How whole blocks are written into the pages (kernels/block_copy.py): their placement is fixed for
        the runner's life."""
        return block_copy.impl_for(self.kv_pages)

    def _scatter(self, pages: list[jax.Array], ids, data) -> list[jax.Array]:
        return block_copy.scatter_blocks_first_jit(pages, ids, data, impl=self.block_copy_impl)

    def _gather_state(self, slot: int):
        """Dispatches the copy of one slot's state, replicated on every device, into fresh device arrays."""
        axes = _row_axes(self.state_pools)
        program = self._state_gathers.get(axes)
        if program is None:
            program = self._state_gathers[axes] = _slot_gather(self.model.mesh, axes)
        return program(self.state_pools, jnp.int32(slot))

    def scatter_blocks(self, block_ids: list[int], layer_start: int, data: np.ndarray, window_ids: list[int] | None = None) -> None:
        """Dispatches the write of host KV, blocks first ([blocks, layers, page, 2*Hkv, D], as chunks and the
        host tier hold it), into `block_ids` for the layers from `layer_start` (the sliding layers: into
        `window_ids`, blocks let go dropped). It runs on XLA's threads and may read `data` after this returns
        (an aligned host array is not copied: jit reads it in place): keep `data` unchanged until
        `wait_for_imports`."""
        ids, padded = self._padded_blocks(block_ids, data)
        end = layer_start + data.shape[1]
        if self.window_layers:
            ids = self._layer_ids(block_ids, window_ids, self.num_blocks, self.num_window_blocks)[layer_start:end]
        written, done = block_copy.scatter_blocks_first_async_jit(self.kv_pages[layer_start:end], ids, padded, impl=self.block_copy_impl)
        self.kv_pages[layer_start:end] = written
        self._unfinished_imports.append(done)

    def wait_for_imports(self) -> None:
        """Until every `scatter_blocks` write dispatched so far has run, so that their sources (a transport's
        buffers, freed once the import is reported done) are no longer read. Chunks of other layers are
        other programs and may finish in any order: each one's own marker is waited for, not the pages
        (the steps after it donate them)."""
        unfinished, self._unfinished_imports = self._unfinished_imports, []  # a failed write is not waited for twice
        jax.block_until_ready(unfinished)

    def _padded_blocks(self, block_ids: list[int], data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Block ids padded to a page bucket (padding ids point past the pool: dropped) and the data to
        match; the data is copied only when its block count is not a bucket already (a transfer's chunks
        are whole buckets but the last)."""
        ids = self._padded_ids(block_ids, max(self.num_blocks, self.num_window_blocks))  # past either group's pool
        if len(ids) == data.shape[0]:
            return ids, data
        padded = np.zeros((len(ids), *data.shape[1:]), data.dtype)
        padded[: len(block_ids)] = data
        return ids, padded

    def stage_blocks(self, block_ids: list[int], data: np.ndarray, group: int = 0) -> list[tuple[np.ndarray, jax.Array, int]]:
        """Starts the host->device copy of a cache group's KV of `block_ids` (host [blocks, the group's layers,
        ...]) into staging arrays, in page-bucket chunks, without touching the cache pages (a step may run
        meanwhile); `write_staged` later moves them into place on the device."""
        chunk = self.page_buckets[-1]
        staged = []
        for i in range(0, len(block_ids), chunk):
            ids, padded = self._padded_blocks(block_ids[i : i + chunk], data[i : i + chunk])
            staged.append((ids, jax.device_put(padded), group))
        return staged

    def write_staged(self, staged: list[tuple[np.ndarray, jax.Array, int]]) -> None:
        for ids, data, group in staged:
            layers = self.group_layers(group)
            written = self._scatter([self.kv_pages[i] for i in layers], ids, data)
            for i, pages in zip(layers, written):
                self.kv_pages[i] = pages

    def init_state_slots(self, inits: list[tuple[int, int]]) -> None:
        """Zeroes or copies into the working slots of sequences that start now ((slot, source) pairs with
        global slot ids), padded to a power of two so few programs are compiled."""
        n = pick_bucket(self.init_buckets, len(inits))
        dst = np.full((n,), self.num_state_slots, np.int32)  # padding: past the pool, dropped
        src = np.zeros((n,), np.int32)
        dst[: len(inits)], src[: len(inits)] = zip(*inits)
        self.state_pools = _init_slots_jit(self.state_pools, dst, src)

    @property
    def init_buckets(self) -> list[int]:
        # Speculative decoding adds a backup copy per sequence to its init.
        return powers_of_two_up_to(max(self.max_num_seqs, 1) * (2 if self.rows_per_seq > 1 else 1))

    def gather_state_async(self, slot: int):
        """Dispatches the copy of one slot's state into fresh device arrays and returns them at once."""
        return self._gather_state(slot)

    @staticmethod
    def pack_state(state) -> np.ndarray:
        conv, rec = state
        return np.concatenate([np.asarray(a).ravel() for a in (*conv, *rec)])

    def scatter_state(self, slot: int, packed: np.ndarray) -> None:
        cfg = self.cfg
        conv_n, rec_n = math.prod(cfg.conv_state_shape), math.prod(cfg.recurrent_state_shape)
        layers = cfg.num_state_layers
        if packed.shape != (layers * (conv_n + rec_n),) or packed.dtype != np.float32:
            raise ValueError(f"state chunk has shape {packed.shape} ({packed.dtype}); expected ({layers * (conv_n + rec_n)},) float32")
        conv = [packed[i * conv_n : (i + 1) * conv_n].reshape(cfg.conv_state_shape) for i in range(layers)]
        base = layers * conv_n
        rec = [packed[base + i * rec_n : base + (i + 1) * rec_n].reshape(cfg.recurrent_state_shape) for i in range(layers)]
        self.state_pools = _scatter_state_jit(self.state_pools, jnp.int32(slot), conv, rec)

    def dummy_inputs(self, n: int, p: int, decode_only: bool = False, rows: int | None = None) -> StepInputs:
        """Inputs of bucket shape (n tokens, p pages, `rows` logits rows: default one per sequence) that compute
        nothing real (all tokens padding)."""
        s = self.seqs_for(n)
        inputs = StepInputs(
            tokens=np.zeros((1, n), np.int32),
            positions=np.zeros((1, n), np.int32),
            slot_mapping=np.full((n,), -1, np.int32),
            kv_lens=np.zeros((s,), np.int32),
            page_indices=np.zeros((s, p), np.int32),
            cu_q_lens=np.zeros((s + 1,), np.int32),
            num_seqs=np.zeros((1,), np.int32),
            logits_indices=np.zeros((self.logits_rows_for(n) if rows is None else rows,), np.int32),
        )
        if self.num_state_slots:
            self._empty_states(inputs)
            inputs.decode_only = decode_only
        if self.window_layers:
            self._empty_window(inputs)
        return inputs

    def step_shapes(self) -> list[tuple[int, int, bool, int]]:
        """Every (token bucket, page bucket, decode-only, logits rows) program a step can use. Hybrid models have
        a decode-only variant (one vectorised state update) for buckets a decode batch can pick. (A step with
        a prompt's logprobs takes a row per token: compiled when one comes, not here.)"""
        shapes = [(n, p, False, r) for n in self.token_buckets for r in self.logits_row_buckets(n) for p in self.page_buckets]
        if self.num_state_slots:
            shapes += [
                (n, p, True, r)
                for n in self.token_buckets
                if n <= self.largest_decode_bucket
                for r in self.logits_row_buckets(n)
                for p in self.page_buckets
            ]
        return shapes

    def _warm_token_merges(self, token_sharding) -> None:
        """Compiles the asynchronous step's token merge for every (input bucket, previous step's sampled rows)
        pair: each is a program of its own, and compiling one the first time a pair meets cost a served
        engine ~100 ms in the middle of decoding (seen in `moray bench serve --vs-engine` profiles).
        `token_sharding`: where a step's sampled tokens lie (jit keys its cache on it: tokens placed on one
        device instead of the mesh compiled programs no step ran, and the steps compiled their own)."""
        p = self.page_buckets[0]
        inputs = [self.dummy_inputs(n, p) for n in self.token_buckets]
        for rows in sorted({r for n in self.token_buckets for r in self.logits_row_buckets(n)}):
            prev = place_host(np.zeros((rows,), np.int32), token_sharding)
            for i in inputs:
                _merge_tokens_jit(i.tokens, prev, np.full(i.tokens.shape, -1, np.int32))

    def _warm_load_sum(self, shape: tuple[int, int, bool, int]) -> None:
        """Compiles the running sum of the steps' expert loads (`run`), which the second step met first."""
        info = self.program(shape).out_info[3]
        loads = place_host(np.zeros(info.shape, info.dtype), info.sharding)
        _add_jit(loads, loads)

    def warmup(self, sample_fn=None, show_progress: bool = True, background: bool = False) -> float:
        """Compiles every step program (`step_shapes`), and the sampler per sequence bucket (`sample_fn`:
        samples dummy logits, returns the sampled token ids). `background`: only the smallest program now
        (the engine can serve), the rest on a background thread."""
        start = time.perf_counter()
        shapes = sorted(self.step_shapes(), key=lambda s: (s[0] * s[1], s))
        now, later = (shapes[:1], shapes[1:]) if background else (shapes, [])
        progress = Progress(len(now), "compiling step buckets", enabled=show_progress)
        # A step's sampled tokens lie where the sampler puts them (the replicated mesh without one).
        token_sharding = NamedSharding(self.model.mesh, PartitionSpec())
        for shape in now:
            self.program(shape)
            if sample_fn is not None:
                token_sharding = sample_fn(self._dummy_logits(shape)).sharding
            progress(1)
        self._warm_token_merges(token_sharding)
        self._warm_load_sum(now[0])
        if self.num_state_slots:  # the slot set-up programs (nothing real: every destination is padding)
            for n in self.init_buckets:
                self.state_pools = _init_slots_jit(
                    self.state_pools, np.full((n,), self.num_state_slots, np.int32), np.zeros((n,), np.int32)
                )
        elapsed = time.perf_counter() - start
        log.info(
            "warm-up compiled %d step programs in %.1fs%s", len(now), elapsed, f"; {len(later)} more in the background" if later else ""
        )
        if later:
            self.compile_in_background(later, sample_fn)
        return elapsed


def _spec(x):
    """An argument's shape, dtype and (for device arrays) placement: what ahead-of-time compilation needs."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)


def _prompt_positions(item) -> int:
    """How many of a scheduled request's positions this step predicts a prompt token from (0 unless it wants
    its prompt's logprobs)."""
    request = item.request
    if getattr(request, "prompt_logprobs", None) is None:  # (a draft model's view of a request has none)
        return 0
    return max(0, min(item.start + item.num_new_tokens - item.num_spec, request.num_prompt_tokens - 1) - item.start)


def _gather_blocks(kv_pages, ids, width=None):
    return jnp.stack([block_copy.to_transport(pages[block_copy.ids_of(ids, i)], width) for i, pages in enumerate(kv_pages)])


def _copy_pages(kv_pages, src, dst):
    return [pages.at[dst].set(pages[src]) for pages in kv_pages]


def _merge_tokens(tokens, prev_tokens, sources):
    return jnp.where(sources >= 0, prev_tokens[jnp.maximum(sources, 0)], tokens)


_merge_tokens_jit = jax.jit(_merge_tokens)
_add_jit = jax.jit(jnp.add)
# Steps between the expert-load snapshots the engine's stats read (a [MoE layers, experts] int32 copy).
LOAD_SNAPSHOT_STEPS = 32
# The engine stats' imbalance is over the last this many snapshots (256 steps: at batch 32 and top-8, ~65k
# token-to-expert assignments, above the statistical floor of a small step).
LOAD_WINDOW_SNAPSHOTS = 8


class LoadWindow:
    """The loads of the last `LOAD_WINDOW_SNAPSHOTS` cumulative snapshots. Since start-up, a rebalance or a
    drift in the traffic would be averaged into the whole history; over a window it shows at once. Counts
    per slot keep adding up across rebalances, so a difference is still each rank's load over the window."""

    def __init__(self, snapshots: int = LOAD_WINDOW_SNAPSHOTS):
        self._seen: collections.deque = collections.deque(maxlen=snapshots + 1)

    def recent(self, cumulative: np.ndarray) -> np.ndarray:
        """Adds `cumulative` (if it is a new snapshot); the counts routed since the oldest one kept."""
        if not self._seen or self._seen[-1] is not cumulative:
            self._seen.append(cumulative)
        return self._seen[-1] - self._seen[0] if len(self._seen) > 1 else self._seen[-1]


def rank_imbalance(loads: np.ndarray, ep_size: int) -> float:
    """Over MoE layers [L, E], the worst layer's busiest expert-parallel rank (experts split contiguously,
    E / ep_size each) over the mean rank; 1.0 for a balanced or empty load."""
    if loads.size == 0 or loads.sum() == 0:
        return 1.0
    per_rank = loads.reshape(loads.shape[0], ep_size, -1).sum(-1).astype(np.float64)
    mean = per_rank.mean(1)
    live = mean > 0
    return float((per_rank.max(1)[live] / mean[live]).max())


class RoutingCounter:
    """The model's `experts` executor, wrapped (inside the step program) to count the tokens each MoE layer
    routes to each expert before running it, padding tokens excluded. Counting sees the router's ids before
    any dispatch, so it is the same for every expert-parallel mode."""

    def __init__(self, inner, valid: jax.Array, num_experts: int):
        from kernels.moe import routed_experts

        self.inner = inner or routed_experts
        self.valid = valid.reshape(-1)  # per token of the flattened batch (data-parallel: rank-major)
        self.num_experts = max(num_experts, 1)
        self.counts: list[jax.Array] = []

    def __call__(self, x, ids, weights, gate_up, down, **kwargs):
        # Per physical expert slot (= the logical expert without redundant experts).
        self.num_experts = gate_up.shape[0]
        valid = jnp.broadcast_to(self.valid[:, None], ids.shape).astype(jnp.int32)
        counts = jnp.zeros((self.num_experts,), jnp.int32).at[ids].add(valid, mode="drop")
        self.counts.append(counts)
        if collectives_over_gloo():
            # Tokens split over devices make the count a collective of its own, independent of the MoE's.
            # XLA:CPU runs independent collectives in any order and overlapped, and gloo (one tag for every
            # collective) then matches one's messages with another's: two hosts hung in a step. The
            # condition never holds; it makes the MoE wait for the count.
            ids = jnp.where(jnp.sum(counts) < 0, 0, ids)
        return self.inner(x, ids, weights, gate_up, down, **kwargs)

    def loads(self) -> jax.Array:
        """[MoE layers, experts] of this step, in layer order."""
        return jnp.stack(self.counts) if self.counts else jnp.zeros((0, self.num_experts), jnp.int32)


_gather_jit = jax.jit(_gather_blocks, static_argnums=2)


def _split_over_hosts(mesh, padded_blocks: int) -> NamedSharding:
    """Where a multi-host engine puts an export's copy: split by blocks over the mesh's first axis when
    that axis is the hosts (each row of devices on one process) and the blocks divide evenly; else
    replicated (every host gets all of it, the first exports it)."""
    rows = mesh.devices.reshape(mesh.devices.shape[0], -1)
    per_host = rows.shape[0] == jax.process_count() and all(len({d.process_index for d in row}) == 1 for row in rows)
    spec = PartitionSpec(mesh.axis_names[0]) if per_host and padded_blocks % rows.shape[0] == 0 else PartitionSpec()
    return NamedSharding(mesh, spec)


def _local_part(out: jax.Array) -> tuple[int, jax.Array | None]:
    """(first block, this process's part) of an export copy: all of it in one process; across processes
    the one shard this process holds the primary replica of (None if it holds none)."""
    if out.is_fully_addressable:
        return 0, out
    for shard in out.addressable_shards:
        if shard.replica_id == 0:
            return shard.index[0].start or 0, shard.data
    return 0, None


def _row_axes(arrays) -> tuple[str, ...]:
    """The mesh axes the cache arrays' rows (blocks, state slots) are split over: data-parallel attention
    keeps each rank's rows on its devices. () when every device holds every row."""
    specs = {tuple(getattr(a.sharding, "spec", ())) for a in jax.tree.leaves(arrays)}
    if len(specs) != 1:
        raise ValueError(f"cache arrays split in more than one way: {sorted(specs)}")
    (spec,) = specs
    if any(part is not None for part in spec[1:]):
        raise ValueError(f"cache arrays split other than by rows: {spec}")
    first = spec[0] if spec else None
    return () if first is None else (first,) if isinstance(first, str) else tuple(first)


def _slot_gather(mesh, axes: tuple[str, ...]):
    """A program copying one slot's state out of the pools, replicated. Pools split by slot over `axes` are
    read where they lie: each device takes the slot's row if it holds it (zeros if not), and one sum over
    the devices of every layer's row, packed as uint32 bits, makes it whole on all of them, bit for bit.
    Indexing the split pools instead made XLA gather every pool whole (every slot, one all-gather per layer),
    and a program's independent collectives hang between hosts on CPU (`collectives_over_gloo`)."""
    if not axes:
        return _gather_state_jit

    def local(pools, slot):
        leaves, tree = jax.tree.flatten(pools)
        n = leaves[0].shape[0]  # this device's slots
        start = axes_index(axes) * n
        mine = (slot >= start) & (slot < start + n)
        rows = [jax.lax.dynamic_index_in_dim(a, jnp.clip(slot - start, 0, n - 1), keepdims=False) for a in leaves]
        bits = jnp.concatenate([jax.lax.bitcast_convert_type(r, jnp.uint32).reshape(-1) for r in rows])
        whole = jax.lax.psum(jnp.where(mine, bits, jnp.uint32(0)), axes)
        out, at = [], 0
        for r in rows:
            out.append(jax.lax.bitcast_convert_type(whole[at : at + r.size].reshape(r.shape), r.dtype))
            at += r.size
        return jax.tree.unflatten(tree, out)

    gather = jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(axes), PartitionSpec()), out_specs=PartitionSpec())
    return jax.jit(gather)


def _gather_over_ranks(mesh, axes: tuple[str, ...], out_sharding: NamedSharding):
    """A multi-host export's copy (`gather_blocks_first`, placed as `out_sharding`) in one collective. With
    the pages split by blocks over `axes`, each device copies the blocks it holds (zeros for the others)
    and one sum over the devices completes every row, as XLA's own partitioning of the gather does, but in
    one collective for all layers: XLA gathered each layer's block ids on its own, and a program's
    independent collectives hang between hosts on CPU (`collectives_over_gloo`)."""
    if not axes:
        return jax.jit(block_copy.gather_blocks_first, out_shardings=out_sharding, static_argnums=2)

    def local(kv_pages, ids, width):
        first = axes_index(axes)
        layers = []
        for i, pages in enumerate(kv_pages):
            n = pages.shape[0]  # this device's blocks
            at = block_copy.ids_of(ids, i) - first * n
            mine = ((at >= 0) & (at < n)).reshape(-1, *([1] * (pages.ndim - 1)))
            layers.append(block_copy.to_transport(jnp.where(mine, pages[jnp.clip(at, 0, n - 1)], 0), width))
        return jax.lax.psum(jnp.stack(layers, axis=1), axes)

    def gather(kv_pages, ids, width):
        split = jax.shard_map(
            functools.partial(local, width=width), mesh=mesh, in_specs=(PartitionSpec(axes), PartitionSpec()), out_specs=PartitionSpec()
        )
        return split(kv_pages, ids)

    return jax.jit(gather, out_shardings=out_sharding, static_argnums=2)


def _gather_state(pools, slot):
    conv, rec = pools
    return [c[slot] for c in conv], [r[slot] for r in rec]


def _scatter_state(pools, slot, conv_data, rec_data):
    conv, rec = pools
    return [c.at[slot].set(d) for c, d in zip(conv, conv_data)], [r.at[slot].set(d) for r, d in zip(rec, rec_data)]


_gather_state_jit = jax.jit(_gather_state)  # shared by the runners of one process: one compilation per shape
_init_slots_jit = jax.jit(init_slots, donate_argnums=(0,))
_scatter_state_jit = jax.jit(_scatter_state, donate_argnums=(0,))


def kv_bytes_per_block(model: LoadedModel, block_size: int, layers=None) -> int:
    """A block's bytes over every cache layer (or over `layers`, cache layer indices)."""
    cfg = model.cfg
    layers = range(cfg.num_kv_layers) if layers is None else layers
    return block_size * sum(math.prod(cfg.kv_layer_page_dims(i)) for i in layers) * jnp.dtype(model.dtype).itemsize


def window_layers(cfg) -> tuple[int, ...]:
    """The cache layers of a sliding-window group (window_cache.py): the sliding ones of a model that also has
    full-attention layers; none otherwise (a model whose every layer slides keeps one group)."""
    windows = [cfg.sliding_windows[layer] for layer in cfg.kv_layer_ids]
    if all(w is None for w in windows) or all(w is not None for w in windows):
        return ()
    return tuple(i for i, w in enumerate(windows) if w is not None)


def state_bytes_per_sequence(cfg) -> int:
    """float32 conv + recurrent state of every linear-attention layer (0 for attention-only models)."""
    if not cfg.is_hybrid:
        return 0
    return cfg.num_state_layers * 4 * (math.prod(cfg.conv_state_shape) + math.prod(cfg.recurrent_state_shape))
