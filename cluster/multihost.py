"""Replicas that span hosts: the Serve replica is the leader (process 0) of a `jax.distributed` cluster
whose other processes are Ray actors, one per host, in the replica's placement group.

Serve reserves the replica's bundles (`placement_group_bundles`, one per host, STRICT_SPREAD on a real
cluster); the replica actor sits in bundle 0 and starts an `EngineFollower` actor in each other bundle.
All of them build the same engine, joining `jax.distributed` with the leader's address as coordinator,
then the leader runs the engine and sends each state-changing call to the followers
(`workers.multihost.ReplicatedCore`). Only the leader reports to the router and streams results.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.engine.async_engine import AsyncEngine
from workers.engine.config import DistributedConfig, EngineConfig
from workers.engine.engine import EngineCore
from workers.kv_transfer import KVTransferFailed, Published
from workers.multihost import EngineFollower, Op, ReplicatedCore
from workers.parallel import free_port

from .config import KVTransferConfig, PoolConfig
from .kv_transport import build_transport

log = logging.getLogger("moray.cluster")


class FollowerChannel:
    """Sends ops to the follower actors in order; surfaces a follower's failure on the next send. On a
    prefill replica it is also the `PeerExports` of the leader's worker: each follower publishes the part
    of a handoff's KV its host holds."""

    def __init__(self, followers: list, export_timeout_s: float = 30.0):
        self.followers = followers
        self.export_timeout_s = export_timeout_s
        self._pending: list = []
        self._batches = 0  # op batches sent so far

    async def export(self, request_id: str, chunk_bytes: int) -> list[Published]:
        calls = [f.export.remote(request_id, chunk_bytes, self.export_timeout_s) for f in self.followers]
        return list(await asyncio.wait_for(asyncio.gather(*calls), self.export_timeout_s + 10))

    def unpublish(self, request_id: str) -> None:
        for f in self.followers:
            f.unpublish.remote(request_id)

    def send(self, op: Op) -> None:
        self._raise_failures()
        # Numbered: the followers run them in this order whatever order Ray delivers them in (`EngineFollower.apply`).
        self._pending += [f.apply.remote([op], self._batches) for f in self.followers]
        self._batches += 1

    def _raise_failures(self) -> None:
        if not self._pending:
            return
        done, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        ray.get(done)  # a follower's exception (or death) stops the leader's engine: the replica is replaced

    def check(self, timeout_s: float = 10.0) -> None:
        """Raises if a follower is dead or failed."""
        self._raise_failures()
        ray.get([f.ops.remote() for f in self.followers], timeout=timeout_s)

    async def acheck(self, timeout_s: float = 10.0) -> None:
        """`check` without blocking the event loop (Serve's health check)."""
        self._raise_failures()
        await asyncio.wait_for(asyncio.gather(*(f.ops.remote() for f in self.followers)), timeout_s)

    def shutdown(self) -> None:
        for f in self.followers:
            ray.kill(f)


# The ops run in the default group (one thread: they keep their order). Exports run in their own threads,
# so the ops never wait for a host copy or an object-store put; the liveness probe in its own, so it never
# waits behind a long step (a compile takes seconds: Serve would replace a healthy replica).
@ray.remote(concurrency_groups={"export": 2, "health": 1})
class EngineFollowerActor:
    def __init__(self, config: EngineConfig, kv_transfer: KVTransferConfig | None = None):
        self.follower = EngineFollower(config)
        # A follower host's part goes through the object store: the decode replica may be on any node (a
        # shared-memory arena is read only on its own node).
        self.transport = None if kv_transfer is None else build_transport("object_store", int(kv_transfer.inline_kib * 1024))

    def apply(self, ops: list[Op], batch: int) -> int:
        return self.follower.apply(ops, batch)

    @ray.method(concurrency_group="health")
    def ops(self) -> int:
        return self.follower.ops

    @ray.method(concurrency_group="export")
    def export(self, request_id: str, chunk_bytes: int, timeout_s: float) -> Published:
        if self.transport is None:
            raise KVTransferFailed("this host has no KV transport (not a prefill replica)")
        return self.follower.export(request_id, self.transport, chunk_bytes, timeout_s)

    @ray.method(concurrency_group="export")
    def unpublish(self, request_id: str) -> None:
        if self.transport is not None:
            self.transport.unpublish(request_id)


def process_config(config: EngineConfig, coordinator: str, hosts: int, process_id: int, seed: int) -> EngineConfig:
    distributed = DistributedConfig(coordinator_address=coordinator, num_processes=hosts, process_id=process_id)
    parallel = config.parallel.model_copy(update={"distributed": distributed})
    # One seed for every process: unseeded sampling draws its per-step seeds from it, identically.
    return config.model_copy(update={"parallel": parallel, "seed": seed})


def start_multihost_engine(
    config: EngineConfig, pool: PoolConfig, kv_transfer: KVTransferConfig | None = None, show_progress: bool = False
) -> tuple[AsyncEngine, FollowerChannel]:
    """Called in the Serve replica (the leader); returns its engine and the channel to the followers.
    `kv_transfer`: a prefill replica's, with which each follower publishes its part of the handoffs."""
    hosts = pool.hosts_per_replica
    pg = ray.util.get_current_placement_group()
    if pg is None:
        raise RuntimeError(f"a replica over {hosts} hosts needs its placement group (placement_group_bundles)")
    coordinator = f"{ray.util.get_node_ip_address()}:{free_port()}"
    seed = config.seed if config.seed is not None else secrets.randbits(31)
    resources = {"TPU": pool.resources.tpu.chips_per_host} if pool.resources.tpu is not None else {}
    followers = [
        EngineFollowerActor.options(
            num_cpus=pool.resources.cpus,
            resources=resources,
            runtime_env={"env_vars": dict(pool.env)} if pool.env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(process_config(config, coordinator, hosts, i, seed), kv_transfer)
        for i in range(1, hosts)
    ]
    log.info("replica over %d hosts: coordinator %s", hosts, coordinator)
    # Joins the followers (their constructors run now too) and builds the same engine in lockstep.
    leader_config = process_config(config, coordinator, hosts, 0, seed)
    core = EngineCore(leader_config, show_progress=show_progress)
    channel = FollowerChannel(followers, kv_transfer.timeout_s if kv_transfer is not None else 30.0)
    channel.check(timeout_s=600)  # every follower built its engine
    return AsyncEngine(leader_config, core=ReplicatedCore(core, channel.send)), channel


def placement_options(pool: PoolConfig) -> dict:
    """Serve deployment options reserving one bundle per host for a multi-host replica."""
    if pool.hosts_per_replica <= 1:
        return {}
    bundle = {"CPU": pool.resources.cpus}
    if pool.resources.tpu is not None:
        bundle["TPU"] = pool.resources.tpu.chips_per_host
    return {
        "placement_group_bundles": [dict(bundle) for _ in range(pool.hosts_per_replica)],
        "placement_group_strategy": pool.placement_strategy,
    }
