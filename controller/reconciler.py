"""Reconciler: cluster snapshots (claim sets, lock groups) -> the orchestrator's groups.

Owned by the controller app; called with every new `grouping.Snapshot` from
`ClusterState`. Each `Group` becomes a `GroupSpec` whose members are its claim sets
(a claim set holds the lock as `<job>:<claim source>`), with the node agents of the
group's nodes (found from the node-plugin pods, `node_agents.py`, or from a fixed
`agent_template` such as `{node}:50052` when the agents are not pods), and the agents'
published TLS certificates (target -> PEM) go to the orchestrator before any group
changes, so that every call pins the certificate of the agent as it is now; clients name
their claim set by the pod-level claim name (or its source), mapped by (job, name)
aliases; a name two claim sets of a job share is resolved by the calling pod.
Groups that vanished are removed; claim sets that vanished (claim deallocated, pods
gone) are dropped from their group: they leave the queue and lose the lock at once, not
after a lease. Claim sets that moved to another group (groups merged or split) take their
holder, waiters and residency along (`takeover.carry`) before the old group goes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from timeslice.controller.grouping import Group, Snapshot
from timeslice.controller.node_agents import agent_certificates, missing_target
from timeslice.controller.orchestrator.config import GroupSpec, MemberSpec
from timeslice.controller.orchestrator.group import LockGroup
from timeslice.controller.orchestrator.orchestrator import Orchestrator, pod_key
from timeslice.driver.errors import NotFound

log = logging.getLogger("timeslice.controller")


def agent_target(node: str, snapshot: Snapshot, template: str | None) -> str:
    """The node agent address of `node`: from `template` (`{node}` replaced) when given,
    else the node's plugin pod, else `missing_target(node)`."""
    if template is not None:
        return template.format(node=node)
    endpoint = snapshot.node_agents.get(node)
    return endpoint.target if endpoint is not None else missing_target(node)


def group_spec(group: Group, default_backend: str, agent: Callable[[str], str]) -> GroupSpec:
    """`agent(node)` -> that node's agent target."""
    members = []
    for cs in group.claim_sets:
        claims = tuple((c.namespace, c.name) for c in cs.claims)
        members.append(MemberSpec(claim_set=cs.id, claims_by_agent={agent(n): claims for n in cs.nodes},
                                  pod_uids=cs.pods, claim_name=cs.name, priority=cs.config.priority,
                                  max_hold_seconds=cs.config.max_hold_seconds, app=cs.config.app,
                                  memory=cs.config.memory))
    backend = default_backend if group.backend == "auto" else group.backend
    agents = () if backend == "none" else tuple(agent(n) for n in group.nodes)
    return GroupSpec(id=group.id, backend=backend, agents=agents, lease_seconds=group.lease_seconds,
                     residency=group.residency, memory_headroom=group.memory_headroom,
                     resident_first_seconds=group.resident_first_seconds, members=tuple(members))


class Reconciler:
    """`agent_template` names a node's agent (`{node}` is replaced; None: the node-plugin
    pods in the snapshot); `default_backend` stands for `auto` (freeze on GPU-less
    clusters, cuda on GPU nodes)."""

    def __init__(self, orchestrator: Orchestrator, agent_template: str | None = None,
                 default_backend: str = "cuda", on_group_set: Callable[[LockGroup], None] | None = None) -> None:
        self.orchestrator = orchestrator
        self._on_group_set = on_group_set
        self.agent_template = agent_template
        self.default_backend = default_backend
        self.snapshot = Snapshot()

    async def apply(self, snapshot: Snapshot) -> None:
        old, self.snapshot = self.snapshot, snapshot
        self.orchestrator.set_agent_certificates(agent_certificates(snapshot.node_agents.values()))
        moved: dict[tuple[str, str], set[str]] = {}  # (old group, new group) -> claim sets that moved
        for cs_id in old.claim_sets:
            if cs_id not in snapshot.claim_sets:
                self._drop(old.group_of.get(cs_id), cs_id, "its claims were deallocated or its pods are gone")
            elif old.group_of.get(cs_id) and snapshot.group_of.get(cs_id) != old.group_of.get(cs_id):
                moved.setdefault((old.group_of[cs_id], snapshot.group_of[cs_id]), set()).add(cs_id)
        self._set_groups(snapshot, old)
        for (old_id, new_id), jobs in sorted(moved.items(), key=lambda kv: self._carry_order(kv[0][0])):
            try:
                self.orchestrator.carry(old_id, new_id, jobs)
            except NotFound:  # the old group was never set up (its spec failed): nothing to carry
                pass
        for group_id in set(old.groups) - set(snapshot.groups):
            await self.orchestrator.remove_group(group_id)
            log.info("group removed group=%s", group_id)
        self.orchestrator.set_aliases(aliases(snapshot.claim_sets.values(), snapshot.group_of))

    def _carry_order(self, old_id: str) -> tuple[int, int, float]:
        """Old groups whose holder has the highest priority (then the earliest grant) carry
        first: that holder goes on holding in a merged group, the others are preempted
        (`takeover.carry`)."""
        try:
            h = self.orchestrator.group(old_id).holder
        except NotFound:
            h = None
        return (0, -h.priority, h.granted_at) if h is not None else (1, 0, 0.0)

    def _set_groups(self, snapshot: Snapshot, old: Snapshot) -> None:
        warned: dict[str, list[str]] = {}  # group id -> its claims' configuration warnings
        for w in snapshot.warnings:
            for cs in snapshot.claim_sets.values():
                if w.claim in cs.claims:
                    warned.setdefault(snapshot.group_of[cs.id], []).append(f"{w.reason}: {w.message}")
        for group in snapshot.groups.values():
            spec = group_spec(group, self.default_backend,
                              lambda node: agent_target(node, snapshot, self.agent_template))
            if group.id not in old.groups or spec != self.orchestrator.group(group.id).spec:
                lock = self.orchestrator.add_group(spec)
                if self._on_group_set is not None:
                    self._on_group_set(lock)  # e.g. show the group in its claims' status
                log.info("group set group=%s members=%s nodes=%s backend=%s", group.id,
                         [m.claim_set for m in spec.members], list(group.nodes), spec.backend)
            self.orchestrator.group(group.id).warnings = tuple(dict.fromkeys(warned.get(group.id, ())))

    def _drop(self, group_id: str | None, cs_id: str, why: str) -> None:
        if group_id is None:
            return
        try:
            # gone: its pods are, or are going (an `app` engine in them is not kept: `MemoryMoves.dropped`)
            self.orchestrator.group(group_id).drop_job(cs_id, why, gone=True)
            log.info("claim set dropped group=%s claim_set=%s: %s", group_id, cs_id, why)
        except NotFound:
            pass


def aliases(claim_sets: Iterable, group_of: dict[str, str]) -> dict[tuple[str, str], tuple[tuple[str, str], ...]]:
    """(job, handle), (claim-set id, handle) and (`pod_key(uid)`, handle) of each of its
    pods -> every (group id, claim-set id) it may name; a handle is a pod-level claim name
    or the claim source (`ClaimSet.handles`)."""
    table: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for cs in claim_sets:
        target = (group_of[cs.id], cs.id)
        for handle in cs.handles:
            for key in ((cs.job, handle), (cs.id, handle), *((pod_key(uid), handle) for uid in cs.pods)):
                table.setdefault(key, []).append(target)
    return {k: tuple(sorted(v)) for k, v in table.items()}
