"""`EngineConfig`: everything one engine (one prefill or decode worker) needs; the cluster config embeds it."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_COMPILE_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "moray", "xla")


def powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


class MoEParallelConfig(BaseModel):
    """How an expert-parallel MoE layer moves tokens (see `workers/models/moe_parallel.py`)."""

    model_config = ConfigDict(extra="forbid")

    dispatch: Literal["flat", "hierarchical", "hierarchical-dispatch"] = Field(
        default="flat",
        description="flat: one all-gather/reduce-scatter over all EP axes; hierarchical: one per mesh level "
        "(fast level first for the reduce-scatter); hierarchical-dispatch: each fast-domain device gathers H/k "
        "columns across the slow levels (needs hidden % (128*k) == 0, else the flat path)",
    )
    gather_dtype: Literal["model", "fp8"] = Field(
        default="model", description="fp8: gather hidden states as e4m3 with a per-row scale (not exact)"
    )
    fast_axes: list[str] | None = Field(
        default=None, description="the hierarchical dispatch's fast domain (innermost EP axes); default all but the outermost"
    )
    all_to_all_min_tokens: int | None = Field(
        default=None, ge=1, description="use the all-to-all dispatch for steps of at least this many tokens"
    )


class DistributedConfig(BaseModel):
    """One engine over several processes/hosts (`jax.distributed`). Unset: the MORAY_* variables of the
    local launcher, or GKE's TPU_WORKER_ID/TPU_WORKER_HOSTNAMES, or a single process."""

    model_config = ConfigDict(extra="forbid")

    coordinator_address: str | None = Field(default=None, description="host:port of process 0")
    num_processes: int | None = Field(default=None, ge=1)
    process_id: int | None = Field(default=None, ge=0)


class ParallelConfig(BaseModel):
    """Devices of one engine: a mesh over the machine's levels (host, chip, core) and how attention
    (data parallel), dense layers (tensor parallel) and experts (expert parallel) use it.
    The default is one device."""

    model_config = ConfigDict(extra="forbid")

    mesh: str | None = Field(default=None, pattern=r"^[1-9][0-9]*(x[1-9][0-9]*){0,2}$", description="e.g. 8, 2x4 (host x chip), 2x2x2")
    dp: int | None = Field(default=None, ge=1, description="attention data-parallel size; default devices / tp")
    tp: int = Field(default=1, ge=1, description="tensor parallelism of the dense parts (trailing mesh axes)")
    ep: int | None = Field(default=None, ge=1, description="expert-parallel size (trailing mesh axes); default all devices")
    moe: MoEParallelConfig = Field(default_factory=MoEParallelConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @model_validator(mode="after")
    def _check(self) -> "ParallelConfig":
        if self.mesh:
            dims = [int(d) for d in self.mesh.split("x")]
            n = 1
            for d in dims:
                n *= d
            dp = self.dp or n // self.tp
            if dp * self.tp != n:
                raise ValueError(f"dp x tp must equal the mesh size: {dp} x {self.tp} != {n} (mesh {self.mesh})")
            if self.ep is not None and n % self.ep:
                raise ValueError(f"ep={self.ep} must divide the mesh size {n} (mesh {self.mesh})")
        return self

    @property
    def is_single_device(self) -> bool:
        return not self.mesh and not any(s and s > 1 for s in (self.dp, self.tp, self.ep))


class HostKVConfig(BaseModel):
    """A host-memory tier below the device KV cache (workers/engine/host_tier.py): evicted cached blocks
    are kept there and copied back on a prefix hit. Off unless sized; attention-only single-rank engines."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=False, description="keep evicted prefix-cache blocks in host memory")
    blocks: int | None = Field(
        default=None,
        ge=0,
        description="size in KV blocks (wins over memory_gib; with a sliding-window cache group, the full layers' blocks, "
        "the window group's tier getting the device pools' proportion); 0: off",
    )
    memory_gib: float | None = Field(default=None, ge=0, description="size in GiB of host memory; 0: off")
    memory_fraction: float = Field(
        default=0.2, gt=0, le=0.9, description="size when neither blocks nor memory_gib is set: this share of the host's available memory"
    )

    @model_validator(mode="before")
    @classmethod
    def _sized_means_enabled(cls, data):
        """Giving a size turns the tier on (a size of 0 turns it off), so `host_kv: {memory_gib: 8}` is enough."""
        if isinstance(data, dict) and "enabled" not in data:
            size = data.get("blocks", data.get("memory_gib"))
            if size is not None:
                data = {**data, "enabled": size > 0}
        return data

    def num_blocks(self, block_nbytes: int, available_bytes: int | None = None) -> int:
        """How many blocks of `block_nbytes` the tier holds (0: off)."""
        if not self.enabled:
            return 0
        if self.blocks is not None:
            return self.blocks
        if self.memory_gib is not None:
            return int(self.memory_gib * (1 << 30)) // block_nbytes
        available = available_bytes if available_bytes is not None else available_host_memory()
        return int(self.memory_fraction * available) // block_nbytes


def available_host_memory() -> int:
    """Bytes of host memory available to new allocations (MemAvailable; the cgroup limit if lower)."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = open(path).read().strip()
            usage_path = path.replace("memory.max", "memory.current").replace("limit_in_bytes", "usage_in_bytes")
            if limit.isdigit():
                available = min(available, int(limit) - int(open(usage_path).read().strip()))
        except (OSError, ValueError):
            continue
    return max(0, available)


class EplbConfig(BaseModel):
    """Expert load balancing while serving (`workers/engine/expert_balancer.py`), after vLLM's `eplb_config`:
    redundant expert slots re-placed from the engine's own expert-load counts."""

    model_config = ConfigDict(extra="forbid")

    num_redundant_experts: int = Field(
        default=0, ge=0, description="extra physical expert slots per MoE layer (a multiple of the expert-parallel size)"
    )
    period_steps: int = Field(
        default=3000, ge=0, description="engine steps between rebalances (from the loads since the last one); 0: only when asked"
    )
    layers_per_move: int = Field(
        default=1,
        ge=1,
        description="MoE layers whose experts are copied to their new slots together, beside the steps running on the old "
        "ones; the next group starts when one is swapped in. More moves faster, but a step that queues behind a larger copy "
        "takes longer (bench eplb, CPU: 1 layer 0.6-0.75 of a step at worst, 4 layers 2.5-5), and the copy's extra memory "
        "is this many layers' experts",
    )


class SpeculativeConfig(BaseModel):
    """Speculative decoding (`workers/engine/speculative.py`), under vLLM's `speculative_config` names: a
    proposer guesses up to `num_speculative_tokens` next tokens and one target step verifies them all."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "draft", "draft_model", "mtp"] = Field(
        default="ngram",
        description="ngram: prompt lookup (the longest suffix of the sequence seen earlier in it proposes what followed it); "
        "draft (vLLM: draft_model): a smaller model with the same tokenizer (`model`) proposes greedily, run by the same "
        "worker; mtp: the checkpoint's own multi-token-prediction head (DeepSeek-V3, Qwen3.5, Qwen3-Next) proposes "
        "greedily, chained for k > 1",
    )
    model: str | None = Field(default=None, description="draft: the draft model's checkpoint directory")
    num_speculative_tokens: int = Field(default=3, ge=1, le=16, description="most tokens proposed per request and step")
    prompt_lookup_min: int = Field(default=1, ge=1, description="ngram: shortest suffix matched")
    prompt_lookup_max: int = Field(default=4, ge=1, description="ngram: longest suffix matched")
    disable_by_batch_size: int | None = Field(
        default=None, ge=1, description="no proposals while this many requests or more run (speculation stops paying)"
    )
    adaptive: bool = Field(
        default=True,
        description="measure decode throughput with and without speculation per batch size and speculate only where it "
        "is faster (probing the other mode now and then)",
    )
    min_acceptance: float = Field(
        default=0.15,
        ge=0,
        le=1,
        description="a request whose recent drafts were accepted less than this often proposes one token at a time until "
        "its acceptance recovers",
    )

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative: prompt_lookup_min must be <= prompt_lookup_max")
        if self.method == "draft_model":
            self.method = "draft"
        if self.method == "draft" and not self.model:
            raise ValueError("speculative: method draft needs `model` (the draft checkpoint directory)")
        if self.method == "mtp" and self.model:
            raise ValueError("speculative: method mtp reads its head from the served checkpoint; `model` is for method draft")
        return self


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(description="checkpoint directory (Hugging Face layout)")
    served_model_name: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="compute dtype; default float32 on CPU, bfloat16 on TPU"
    )
    load_format: Literal["safetensors", "dummy"] = "safetensors"
    seed: int = 0

    block_size: int = Field(default=16, ge=1, le=1024)
    num_kv_blocks: int | None = Field(default=None, ge=2, description="overrides kv_cache_memory_bytes")
    kv_cache_memory_bytes: int = Field(default=256 << 20, gt=0)
    enable_prefix_caching: bool = True
    sliding_window_group: bool = Field(
        default=True,
        description="sliding-window layers of a model that also has full-attention ones (Gemma 4) keep their KV in a "
        "pool of their own and hold only their window's blocks per sequence; off: every layer in one pool, every "
        "block kept",
    )
    host_kv: HostKVConfig = Field(default_factory=lambda: HostKVConfig())
    session_idle_s: float = Field(
        default=600.0,
        ge=0,
        description="a session with no turn for this long has ended: its cached blocks (device and host tier) are "
        "evicted like sessionless ones; until then after them (workers/engine/retention.py)",
    )
    # Hybrid (linear-attention) models: per-sequence state slots, float32, outside kv_cache_memory_bytes
    # unless state_cache_memory_bytes takes the snapshots' share out of it.
    state_snapshots: int | None = Field(
        default=None, ge=0, description="most state snapshots kept for prefix caching; default 2 x max_num_seqs"
    )
    state_cache_memory_bytes: int | None = Field(
        default=None,
        ge=0,
        description="device bytes for state snapshots (prefix caching of hybrid models), taken out of kv_cache_memory_bytes: "
        "as many snapshots as fit, the KV pool gets the rest; instead of state_snapshots",
    )
    structured_coerce_one_of: bool = Field(
        default=False,
        description="JSON schemas: a oneOf whose branches may overlap (refused otherwise) is enforced as anyOf, llguidance's "
        "coerce_one_of; not sound (an output may match two branches), so each finished output is checked against the "
        "schema as sent and a violation is reported (finish_reason schema_violation), never returned as valid",
    )
    state_keep_points: Literal["shared", "step-ends"] = Field(
        default="shared",
        description="where a hybrid model's prefill keeps states: shared = also at branch points (a prefix another prompt "
        "computed) and the chat path's message boundaries (prefix_boundaries); step-ends = only the last block boundary of "
        "each step (the old rule, for comparison)",
    )
    state_snapshot_every_blocks: int = Field(
        default=0, ge=0, description="also keep a state every this many blocks of a prompt (0: off); each costs a prefill step"
    )
    num_state_slots: int | None = Field(
        default=None, ge=1, description="state slots: one per live request plus snapshots; default 2 x max_num_seqs + state_snapshots"
    )

    async_scheduling: bool = Field(
        default_factory=lambda: os.environ.get("MORAY_ASYNC_SCHEDULING", "1") != "0",
        description="prepare the next step and process the last one's outputs while the device runs this one "
        "(default on; MORAY_ASYNC_SCHEDULING=0 turns it off for a whole process tree, e.g. a test run)",
    )
    max_num_seqs: int = Field(default=32, ge=1)
    max_num_batched_tokens: int = Field(default=512, ge=1)
    max_model_len: int | None = Field(default=None, ge=2, description="default: the model's, capped at 4096")

    # Static shapes for XLA: a step's token count and pages-per-sequence are padded up to a bucket.
    token_buckets: list[int] | None = None
    page_buckets: list[int] | None = None
    warmup: bool = True
    background_compile: bool = Field(
        default=True,
        description="with warmup: compile the smallest step program before serving and the rest on a background "
        "thread (a step needing one not compiled yet compiles it first); off: all before serving",
    )
    compilation_cache_dir: str | None = DEFAULT_COMPILE_CACHE
    retain_freed_host_memory: bool = Field(
        default=True,
        description="keep freed host memory in the process (glibc's allocator, workers/engine/host_memory.py) so that "
        "large host buffers (KV export copies, XLA:CPU's outputs) reuse warm pages instead of faulting fresh ones in; "
        "up to 512 MiB of freed memory stays with the process",
    )

    speculative: SpeculativeConfig | None = Field(default=None, description="speculative decoding; off unless set")
    eplb: EplbConfig | None = Field(default=None, description="expert load balancing with redundant experts (MoE models); off unless set")

    worker_id: str = "worker-0"
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.state_cache_memory_bytes is not None and self.state_snapshots is not None:
            raise ValueError("state_snapshots and state_cache_memory_bytes both size the snapshots: set one")
        if (
            self.state_cache_memory_bytes is not None
            and self.num_kv_blocks is None
            and self.state_cache_memory_bytes >= self.kv_cache_memory_bytes
        ):
            raise ValueError("state_cache_memory_bytes is taken out of kv_cache_memory_bytes: it must be smaller")
        if self.host_kv.enabled and not self.enable_prefix_caching:
            raise ValueError("host_kv needs enable_prefix_caching: the host tier keeps evicted prefix-cache blocks")
        for name in ("token_buckets", "page_buckets"):
            buckets = getattr(self, name)
            if buckets is not None and (not buckets or sorted(set(buckets)) != buckets or buckets[0] < 1):
                raise ValueError(f"{name} must be a non-empty, strictly increasing list of positive integers")
        return self

    def max_state_snapshots(self, state_bytes: int) -> int:
        """Snapshots kept, given one state's bytes: what state_cache_memory_bytes holds, else state_snapshots
        (default 2 x max_num_seqs)."""
        if self.state_cache_memory_bytes is not None:
            return self.state_cache_memory_bytes // max(1, state_bytes)
        return 2 * self.max_num_seqs if self.state_snapshots is None else self.state_snapshots

    def state_slots(self, state_bytes: int) -> int:
        """Working slots for running, held and importing requests (2 x max_num_seqs), plus snapshots."""
        return self.num_state_slots or 2 * self.max_num_seqs + self.max_state_snapshots(state_bytes)

    def keep_points(self):
        """Where a hybrid model's prefill keeps states (state_cache.KeepPoints)."""
        from .state_cache import KeepPoints

        return KeepPoints(shared=self.state_keep_points == "shared", every_blocks=self.state_snapshot_every_blocks)

    def kv_pool_bytes(self, state_bytes: int, hybrid: bool) -> int:
        """kv_cache_memory_bytes less the snapshots' share when state_cache_memory_bytes sets it."""
        if not hybrid or self.state_cache_memory_bytes is None:
            return self.kv_cache_memory_bytes
        return self.kv_cache_memory_bytes - self.max_state_snapshots(state_bytes) * state_bytes

    @property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))
