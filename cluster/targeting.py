"""Serve request routing that honours the router's choice of replica.

Our router picks a worker (a Serve replica) by KV-cache overlap and load; Serve's default router would
pick its own. Calls carry `target_replica=<replica unique id>`; this request router sends them there,
and falls back to Serve's power-of-two choice when the target is gone (scaled down, restarting).
"""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

TARGET_KWARG = "target_replica"


class TargetedRequestRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        target = pending_request.kwargs.get(TARGET_KWARG) if pending_request is not None else None
        if target:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if chosen:
                return [chosen]
        return await super().choose_replicas(candidate_replicas, pending_request)


REQUEST_ROUTER_CLASS = "cluster.targeting:TargetedRequestRouter"
