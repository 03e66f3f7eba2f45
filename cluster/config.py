"""`ClusterConfig`: one schema for `moray serve --config`, `cluster.deploy`, `moray serve-config` and the
Helm chart's `serveConfigV2`. It embeds the engine's own `EngineConfig`.

Unknown keys are rejected and every error names the field path (e.g. `decode.replicas`).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from workers.engine.config import EngineConfig

# A slice up to this many chips is one TPU VM; larger slices are hosts of 4 chips each.
SINGLE_HOST_MAX_CHIPS = {"v4": 4, "v5e": 8, "v5p": 4, "v6e": 8, "v7x": 4}
# v5e/v6e slices are 2-D (e.g. 2x4); v4/v5p/v7x are 3-D (e.g. 2x2x4).
TOPOLOGY_DIMS = {"v4": 3, "v5e": 2, "v5p": 3, "v6e": 2, "v7x": 3}
_TOPOLOGY = re.compile(r"^[1-9]\d*x[1-9]\d*(x[1-9]\d*)?$")


class ConfigError(ValueError):
    """A cluster config that cannot be used; the message names the field path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class TPUConfig(_Strict):
    type: Literal["v4", "v5e", "v5p", "v6e", "v7x"] = "v6e"
    topology: str = Field(default="2x4", description="slice topology, e.g. 2x4, 4x4, 2x2x1")

    @field_validator("topology")
    @classmethod
    def _topology(cls, v: str) -> str:
        if not _TOPOLOGY.match(v):
            raise ValueError(f"topology must look like 2x4 or 2x2x1 with positive sizes, got {v!r}")
        return v

    @model_validator(mode="after")
    def _shape(self) -> "TPUConfig":
        dims = len(self.topology.split("x"))
        if dims != TOPOLOGY_DIMS[self.type]:
            raise ValueError(f"{self.type} topologies have {TOPOLOGY_DIMS[self.type]} dimensions, got {self.topology!r}")
        if self.chips > SINGLE_HOST_MAX_CHIPS[self.type] and self.chips % 4:
            raise ValueError(f"a {self.chips}-chip slice does not split into hosts of 4 chips")
        return self

    @property
    def chips(self) -> int:
        n = 1
        for d in self.topology.split("x"):
            n *= int(d)
        return n

    @property
    def hosts(self) -> int:
        """Hosts per slice: one replica spans all of them."""
        return 1 if self.chips <= SINGLE_HOST_MAX_CHIPS[self.type] else self.chips // 4

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts


class ResourcesConfig(_Strict):
    cpus: float = Field(default=1.0, ge=0)
    memory_gb: float | None = Field(default=None, gt=0)
    tpu: TPUConfig | None = None


class AutoscalingConfig(_Strict):
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    target_ongoing_requests: float = Field(default=16, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


class PoolConfig(_Strict):
    replicas: int = Field(default=1, ge=0)
    autoscaling: AutoscalingConfig | None = None
    resources: ResourcesConfig = ResourcesConfig()
    # Processes (hosts) per replica; on TPU it follows the slice topology. A replica over several hosts
    # reserves one bundle per host and runs one engine process on each (see cluster/multihost.py).
    hosts_per_replica: int = Field(default=1, ge=1)
    placement_strategy: Literal["STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"] = Field(
        default="STRICT_SPREAD", description="how a multi-host replica's bundles are placed (PACK: all on one machine, for tests)"
    )
    env: dict[str, str] = Field(default_factory=dict, description="environment variables of the pool's engine processes")
    max_ongoing_requests: int = Field(default=64, ge=1)
    # Ray node labels a replica must land on (the Helm chart labels each pool's hosts).
    label_selector: dict[str, str] = Field(default_factory=dict)
    # Per-pool engine settings layered over the cluster's `engine` (e.g. a larger max_num_seqs for decode).
    engine_overrides: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _hosts_from_tpu(self) -> "PoolConfig":
        if self.resources.tpu is not None:
            self.hosts_per_replica = self.resources.tpu.hosts
        return self


class RouterConfig(_Strict):
    policy: Literal["kv-aware", "least-loaded", "round-robin", "session-sticky"] = "kv-aware"
    # Conditional disaggregation: prefill on the decode worker when fewer uncached tokens than this.
    remote_prefill_min_tokens: int = Field(default=256, ge=0)
    cache_weight: float = Field(default=1.0, ge=0)
    load_weight: float = Field(default=1.0, ge=0)
    session_bonus_blocks: float = Field(default=4.0, ge=0)
    temperature: float = Field(default=0.0, ge=0)
    exploration: float = Field(default=0.0, ge=0, le=1)
    heartbeat_ttl_s: float = Field(default=10.0, gt=0)
    # Cost terms (cluster/router/policy.py): blocks credited per host-tier block, blocks per queued request.
    host_tier_credit: float = Field(default=0.75, ge=0, le=1)
    queue_weight: float = Field(default=1.0, ge=0)
    load_slack_blocks: float = Field(default=64.0, ge=0, description="load above the mean that costs nothing")
    speculative_ttl_s: float = Field(default=2.0, ge=0, description="how long a decision counts as cached on the chosen workers")
    session_ttl_s: float = Field(default=600.0, gt=0)
    session_idle_s: float = Field(
        default=60.0, gt=0, description="a conversation counts as live on its worker this long after its last turn (balances new ones)"
    )
    seed: int | None = Field(default=None, description="seeds temperature/exploration sampling (tests, benchmarks)")


class KVIndexConfig(_Strict):
    backend: str = Field(default="memory", description='"memory", or a redis:// / rediss:// URL')
    timeout_s: float = Field(default=0.05, gt=0)
    lookups: Literal["redis", "mirror"] = Field(
        default="redis",
        description='with Redis: "redis" asks Redis on every decision (one round trip); "mirror" keeps a local copy '
        "of the index from Redis's event stream and answers from memory (faster, stale by one poll interval)",
    )
    mirror_poll_interval_s: float = Field(default=0.01, gt=0, description="how often a mirror reads the event stream")
    stream_maxlen: int = Field(default=100_000, ge=100)
    retry_interval_s: float = Field(default=1.0, gt=0, description="how often an unreachable Redis is probed")
    password_env: str | None = Field(default=None, description="env var holding the Redis password (instead of the URL)")
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_check_hostname: bool = True
    # Worker-side event sink: a batch leaves when this many events wait or this much time passed.
    sink_batch_size: int = Field(default=512, ge=1)
    sink_flush_interval_s: float = Field(default=0.01, gt=0)

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        if v != "memory" and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError('backend must be "memory" or a redis://, rediss:// or unix:// URL')
        return v


class ServerConfig(_Strict):
    host: str = "0.0.0.0"
    http_port: int = Field(default=8000, ge=1, le=65535)
    grpc_port: int = Field(default=9000, ge=1, le=65535)
    ingress: Literal["serve", "direct"] = Field(
        default="serve",
        description="serve: Serve's proxies take HTTP and gRPC on every node and pass requests to the front-end replicas; "
        "direct: the front-end replicas listen on http_port and grpc_port themselves (SO_REUSEPORT) and no proxy runs: "
        "one process less per request (cluster/direct_ingress.py); clients must reach the nodes the front ends run on",
    )
    api_keys: list[str] = Field(default_factory=list, description="bearer tokens; empty disables auth")
    api_keys_env: str | None = Field(default=None, description="env var holding comma-separated keys")
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="a request running longer is aborted (its KV freed) and answered 504 / DEADLINE_EXCEEDED"
    )
    max_migrations: int = Field(
        default=2,
        ge=0,
        le=16,
        description="a stream whose decode replica dies (or is drained) continues on another one, resumed after the tokens "
        "already sent, at most this many times; then it ends with an error",
    )
    drain_watch_s: float = Field(
        default=1.0,
        ge=0,
        description="how often the registry asks Serve which worker replicas it is stopping (scale-down, redeploy): "
        "their streams then move to other replicas instead of holding the stop up to graceful_shutdown_timeout_s; 0 = never",
    )
    max_queued_requests: int = Field(
        default=256,
        ge=0,
        description="requests an ingress replica holds that have no first token yet; more are refused with 429 + Retry-After / "
        "RESOURCE_EXHAUSTED (0: no limit)",
    )
    tool_call_parser: Literal["auto", "qwen", "deepseek"] = Field(
        default="auto", description="the model's tool-call syntax; auto: read from its chat template (cluster/tool_calls.py)"
    )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


class ObservabilityConfig(_Strict):
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="Moray's log records in the replicas and `moray serve`: text lines, or one JSON object per line "
        "(timestamp, level, logger, message, request_id, replica); json also switches Serve's own replica logs to JSON",
    )
    tracing: bool = Field(
        default=False,
        description="OpenTelemetry spans for every request: ingress, router, prefill, KV handoff, decode (cluster/tracing.py)",
    )
    otlp_endpoint: str | None = Field(
        default=None,
        description="where spans go: an OTLP/HTTP traces endpoint, e.g. http://otel-collector:4318/v1/traces "
        "(needs the `tracing` extra: pip install 'moray[tracing]')",
    )
    trace_sample_ratio: float = Field(default=1.0, ge=0, le=1, description="fraction of requests traced (decided at the ingress)")
    trace_file: str | None = Field(
        default=None, description="also append finished spans as JSON lines to this file on each replica's node (tests, debugging)"
    )

    @field_validator("otlp_endpoint")
    @classmethod
    def _exporter_installed(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// URL (OTLP over HTTP), got {v!r}")
        if not _importable("opentelemetry.exporter.otlp.proto.http"):
            raise ValueError("the OTLP exporter is not installed: pip install 'moray[tracing]' (opentelemetry-exporter-otlp-proto-http)")
        return v


class KVTransferConfig(_Strict):
    """How a prompt's KV moves from a prefill to a decode worker (`workers/kv_transfer.py`)."""

    transport: Literal["object_store", "shared_memory"] = Field(
        default="object_store",
        description="object_store: Ray's object store (any Ray cluster; chunks bypass the replicas' request queues). "
        "shared_memory: prefill and decode replicas on one node; each prefill process writes its exports into a "
        "shared-memory arena the decode side reads in place (a decode replica on another node prefills locally "
        "instead). A direct device-to-device path plugs in here (cluster/kv_transport.py)",
    )
    shared_memory_mib: float = Field(
        default=1024,
        gt=0,
        description="shared_memory: each prefill process's arena (memory is used as exports first touch it); an export "
        "that does not fit goes through the object store",
    )
    chunk_mib: float = Field(default=8.0, gt=0, le=1024, description="KV chunk size; a smaller request moves as one chunk")
    chunks_in_flight: int = Field(default=4, ge=1, le=64, description="chunks a decode worker fetches at once per request")
    inline_kib: float = Field(
        default=1024, ge=0, description="a request's KV up to this size travels inside the handoff message (no separate fetch)"
    )
    timeout_s: float = Field(default=30.0, gt=0, description="a transfer not done by then is abandoned: the decode worker prefills locally")
    hold_timeout_s: float = Field(default=60.0, gt=0, description="a prefill worker drops published KV nobody fetched by then")

    def build_transport(self):
        """This config's transport for a prefill or decode worker on this host (cluster/kv_transport.py)."""
        from .kv_transport import build_transport

        return build_transport(self.transport, int(self.inline_kib * 1024), int(self.shared_memory_mib * (1 << 20)))


class ClusterConfig(_Strict):
    name: str = Field(default="moray", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=40)
    engine: EngineConfig
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()
    router: RouterConfig = RouterConfig()
    kv_index: KVIndexConfig = KVIndexConfig()
    server: ServerConfig = ServerConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    kv_transfer: KVTransferConfig = KVTransferConfig()
    stream_interval_ms: float = Field(
        default=5.0,
        ge=0,
        le=1000,
        description="a decode worker sends each front end at most one token batch per this many ms (every step's "
        "tokens since the last batch go together); 0: one batch per engine step",
    )
    stream_transport: Literal["direct", "serve"] = Field(
        default="direct",
        description="how a decode worker's token batches, starts and aborts reach a front end: direct: over a "
        "TCP connection of their own (the decode replica listens on a free port of its node's address; Serve "
        "still finds the replica and owns its lifetime: cluster/direct_stream.py); serve: as items and calls "
        "of Serve's handles (a worker that cannot be reached directly falls back to it by itself)",
    )
    # Serve lifecycle: model load and compile can take minutes on TPU.
    health_check_period_s: float = Field(default=10.0, gt=0)
    health_check_timeout_s: float = Field(default=60.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(default=30.0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "handoff_layers_per_chunk" in data:
            raise ValueError("handoff_layers_per_chunk was replaced by kv_transfer.chunk_mib: KV moves in chunks of bytes")
        return data

    def engine_for(self, pool: Literal["prefill", "decode"], worker_id: str) -> EngineConfig:
        overrides = getattr(self, pool).engine_overrides
        config = {**self.engine.model_dump(), **overrides, "worker_id": worker_id}
        if pool == "prefill":  # it samples one token per request: a proposer (draft model, MTP head) would only cost memory
            config["speculative"] = None
        return EngineConfig(**config)


def format_validation_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        path = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{path}: {msg}")
    return "; ".join(parts)


def parse_cluster_config(data: dict[str, Any]) -> ClusterConfig:
    if not isinstance(data, dict):
        raise ConfigError("the cluster config must be a mapping")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def load_cluster_config(path: str | Path) -> ClusterConfig:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    return parse_cluster_config(data or {})
