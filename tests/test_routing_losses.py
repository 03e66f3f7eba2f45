"""Where kv-aware routing lost prefix hits against the oracle (issue #19, `moray bench routing --peer`), one
test per cause found, each on the real orchestrator and router (memory index) in process.

1. Speculative entries lapsed while the chosen worker had not started the request. A burst on a new
   prefix then scattered: the first request sat in a busy worker's queue past speculative_ttl_s, its
   entries expired before the worker computed (and announced) a single block, and the next requests
   with that prefix saw nothing cached anywhere and went by load to other workers, each computing the
   prefix again (the shared-prefix workload's extra cold decisions). Now a routed request's entries are
   renewed until its first token.
"""

from __future__ import annotations

import asyncio

from fakes import heartbeat

from cluster.config import RouterConfig
from cluster.orchestrator import Orchestrator
from cluster.router.memory_index import MemoryKVIndex
from cluster.router.router import Router
from cluster.router.types import WorkerLoad

BLOCK = 8


def orchestrator(speculative_ttl_s: float, workers=("d0", "d1")) -> tuple[Orchestrator, Router]:
    """The real orchestrator and router (memory index, live workers that send no KV events)."""
    index = MemoryKVIndex()
    for w in workers:
        index.heartbeat(WorkerLoad.from_heartbeat(heartbeat(w)))
    router = Router(index, RouterConfig(policy="kv-aware", speculative_ttl_s=speculative_ttl_s), block_size=BLOCK)
    return Orchestrator(router, None, None, None, BLOCK, "tiny", True), router


def test_a_request_waiting_in_a_queue_keeps_attracting_its_prefix():
    async def scenario():
        orch, router = orchestrator(speculative_ttl_s=0.2)
        prefix = list(range(100, 100 + 12 * BLOCK))
        first = await orch.route("a", prefix + [1] * BLOCK, None)  # a new prefix: a cold decision
        # The worker queues it (its slots are busy): no first token, no KV events, for 5 TTLs.
        await asyncio.sleep(1.0)
        second = await orch.route("b", prefix + [2] * BLOCK, None)
        assert second.decode_worker == first.decode_worker, "the prefix scattered: the entries lapsed in the queue"
        assert second.expected_cached_tokens == 12 * BLOCK and second.reason == "cache-hit"
        # Once the first request starts (its first token), renewal stops: the real KV events take over.
        orch._started("a")
        orch._started("b")
        await asyncio.sleep(1.0)
        third = await orch.route("c", prefix + [3] * BLOCK, None)
        assert third.expected_cached_tokens == 0  # nothing was announced: the fake workers send no events
        orch._started("c")

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_request_that_leaves_before_starting_stops_being_renewed():
    async def scenario():
        orch, _ = orchestrator(speculative_ttl_s=0.2)
        await orch.route("a", list(range(100, 100 + 4 * BLOCK)), None)
        assert "a" in orch._unstarted
        orch._started("a")  # the stream ended (client left, failure) before a token
        await asyncio.sleep(0.3)
        assert not orch._unstarted and orch._renewer.done()

    asyncio.run(asyncio.wait_for(scenario(), 30))
