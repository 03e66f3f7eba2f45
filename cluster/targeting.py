"""Serve request routing that honours the router's choice of replica.

Our router picks a worker (a Serve replica) by KV-cache overlap and load; Serve's default router would
pick its own. Calls carry `target_replica=<replica unique id>`; this request router sends them there,
and falls back to Serve's power-of-two choice when the target is gone (scaled down, restarting, dead:
Serve drops a replica whose actor died on the first failed call and routes the request again).

Serve's FIFO mixin hands a replica chosen while routing one request to the *oldest* pending request,
which under concurrency is often another one with another target (requests then land on replicas the
router did not choose: `moray_misrouted_requests_total`). A targeted request's replica goes to that
very request here; untargeted ones keep Serve's FIFO order.
"""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.request_router import RequestRouter

TARGET_KWARG = "target_replica"


class TargetedRequestRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        target = pending_request.kwargs.get(TARGET_KWARG) if pending_request is not None else None
        if target:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if chosen:
                return [chosen]
        return await super().choose_replicas(candidate_replicas, pending_request)

    def _fulfill_next_pending_request(self, replica, request_metadata=None):
        pending = self._get_pending_request_matching_internal_request_id(request_metadata)
        if pending is not None and pending.kwargs.get(TARGET_KWARG):
            # The exact request this replica was chosen for (RequestRouter's own matching).
            return RequestRouter._fulfill_next_pending_request(self, replica, request_metadata)
        return super()._fulfill_next_pending_request(replica, request_metadata)


REQUEST_ROUTER_CLASS = "cluster.targeting:TargetedRequestRouter"
