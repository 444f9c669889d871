"""The Ray Serve request router of the model deployment: :class:`~.affinity.PrefixAffinity`
over Ray's replicas.  Ray Serve's own prefix-aware router needs vLLM or SGLang installed (its
request models come from them), so npuw-kv brings its own."""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .affinity import PrefixAffinity
from .forward import Forwarded


class PrefixRouter(RequestRouter):
    """Each request to the replica that holds the longest prefix of its prompt, unless that
    one is busier than the least busy by more than ``imbalance`` requests in flight; the rest
    ranked by load.  What each replica holds is what this router sent it."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = PrefixAffinity(**kwargs)
        self.in_flight: dict[str, int] = {}
        self.sent: dict[str, str] = {}  # request id -> replica, until it completes

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {name: self.in_flight.get(name, 0) for name in by_id}
        ranked = self.policy.rank(_key(pending_request), loads)
        return [[by_id[name]] for name in ranked]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        name = replica_id.unique_id
        self.policy.record(name, _key(pending_request))
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        self.sent[pending_request.metadata.internal_request_id] = name

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        name = self.sent.pop(internal_request_id, None)
        if name is not None and self.in_flight.get(name, 0) > 0:
            self.in_flight[name] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray's new set of replicas: the ones scaled down or replaced are forgotten (a new
        replica of the same name would hold none of their prefixes)."""
        super().update_replicas(replicas)
        current = {r.replica_id.unique_id for r in replicas}
        for name in set(self.policy.held) | set(self.in_flight):
            if name not in current:
                self._forget(name)

    def _forget(self, name: str) -> None:
        self.policy.forget(name)
        self.in_flight.pop(name, None)


def _key(pending_request: PendingRequest | None) -> str:
    if pending_request is None or not pending_request.args:
        return ""
    first = pending_request.args[0]
    return first.key if isinstance(first, Forwarded) else ""


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn: blind to prefixes, and to load, but spread
    evenly (Ray Serve's default prefers the replica beside the endpoint, which on a quiet
    cluster sends nearly everything to one)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.turn = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        self.turn = (self.turn + 1) % len(ordered)
        return [[r] for r in ordered[self.turn :] + ordered[: self.turn]]
