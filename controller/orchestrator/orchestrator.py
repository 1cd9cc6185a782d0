"""Orchestrator: owns the lock groups, the switch coordinator, the cooperative processes and the metrics.

Owned by the orchestrator server (and, in the cluster, by the controller, which adds
and removes groups as claims change). The gRPC servicer looks groups up here. Group
events go to the metrics first, then to the caller's observer (claim status); each
observer is isolated from the others' failures.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from timeslice.controller.orchestrator import takeover
from timeslice.controller.orchestrator.agent_pool import AgentPool
from timeslice.controller.orchestrator.agents import AgentClient
from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.cooperative import CooperativeJobs
from timeslice.controller.orchestrator.group import LockGroup, Observer
from timeslice.controller.orchestrator.group_model import GroupEvent, Switcher
from timeslice.controller.orchestrator.metrics import OrchestratorMetrics
from timeslice.controller.orchestrator.pinned_pool import PinnedPool
from timeslice.controller.orchestrator.state_file import StateFile
from timeslice.controller.orchestrator.switch import SwitchCoordinator, own_records, records_of
from timeslice.driver.errors import FailedPrecondition, InvalidArgument, NotFound, SwitchFailed, TimeSliceServerError

log = logging.getLogger("timeslice.orchestrator")


def pod_key(pod_uid: str) -> str:
    """The alias key of a pod (`Orchestrator.set_aliases`): a caller that names no job is
    known by the pod its token is bound to."""
    return f"pod:{pod_uid}"


class Orchestrator:
    def __init__(self, groups: Iterable[GroupSpec] = (), switcher: Switcher | None = None,
                 observer: Observer | None = None, agents: AgentPool | None = None,
                 pinned_pool: PinnedPool | None = None, state: StateFile | None = None) -> None:
        """`pinned_pool`: this node's shared pinned host memory for cooperative checkpoints
        (one-box mode; None: each cooperative process keeps its own host copy). `state`:
        the standalone state file (epochs never repeat across restarts; the last holder and
        the jobs that must leave are adopted at start)."""
        self._state = state
        self._pool = agents or AgentPool()
        self.metrics = OrchestratorMetrics(self.groups)
        self._observers: list[Observer] = [self.metrics.observe, *([observer] if observer else [])]
        self.cooperative = CooperativeJobs(pinned_pool, state, on_lost=self._checkpoint_lost,
                                           on_learned=self._checkpoint_learned,
                                           on_streams_closed=self._streams_closed, on_started=self._started)
        self._switcher: Switcher = switcher or SwitchCoordinator(self._pool, self.cooperative)
        self._groups: dict[str, LockGroup] = {}
        # (client job, claim-set name) -> (group id, member job): in a cluster a client names
        # its pod-level claim, and holds the lock as its claim set
        self._aliases: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}
        self._handles: dict[str, tuple[str, ...]] = {}  # of `_aliases`: key -> its handles, sorted
        for spec in groups:
            self.add_group(spec)

    def add_group(self, spec: GroupSpec) -> LockGroup:
        """Add a group, or replace the spec of a known one (its state is kept)."""
        group = self._groups.get(spec.id)
        if group is None:
            group = self._groups[spec.id] = LockGroup(spec, self._switcher, observer=self._observe,
                                                      state=self._state)
        else:
            group.spec = spec
        return group

    async def remove_group(self, group_id: str) -> None:
        """Forget a group: its lock stops, its metrics series go."""
        group = self._groups.pop(group_id, None)
        if group is not None:
            await group.close()
            self.metrics.forget(group_id)

    def add_observer(self, observer: Observer) -> None:
        """Tell `observer` every group event from now on, after the others (it must not raise)."""
        self._observers.append(observer)

    def _streams_closed(self, group_id: str, job: str) -> None:
        """A cooperative job's last command stream closed: a holder kept past its lease
        because it streamed loses it now (`Leases.streams_closed`)."""
        group = self._groups.get(group_id)
        if group is not None:
            group.leases.streams_closed(job)

    def _started(self, group_id: str, job: str) -> None:
        """A cooperative job started (again): `LockGroup.job_started`."""
        group = self._groups.get(group_id)
        if group is not None:
            group.job_started(job)

    def _observe(self, group: LockGroup, event: GroupEvent) -> None:
        """Tell the observers (metrics, claim status) a group's event; a removed group's late
        ones (a switch that ended while it closed) reach none: its series and status are gone."""
        if self._groups.get(group.id) is not group:
            return
        for observer in self._observers:
            try:
                observer(group, event)
            except Exception:  # an observer must never break the lock, nor the other observers
                log.exception("group observer failed group=%s event=%s", group.id, event.kind)

    def carry(self, old_id: str, new_id: str, jobs: set[str]) -> None:
        """Claim sets `jobs` moved from group `old_id` to `new_id` (groups re-formed):
        `takeover.carry`. Raises NotFound."""
        takeover.carry(self.group(new_id), self.group(old_id), jobs)

    def group(self, group_id: str) -> LockGroup:
        """The group of that id; raises NotFound."""
        try:
            return self._groups[group_id]
        except KeyError:
            raise NotFound(f"unknown group {group_id!r} (`timeslice status` lists the groups)") from None

    def set_aliases(self, aliases: Mapping[tuple[str, str], tuple[tuple[str, str], ...]]) -> None:
        """Replace the (job, handle) -> [(group id, member job)] table (the reconciler; a
        handle is a pod-level claim name or a claim source)."""
        self._aliases = dict(aliases)
        handles: dict[str, set[str]] = {}
        for key, handle in self._aliases:
            handles.setdefault(key, set()).add(handle)
        self._handles = {key: tuple(sorted(h)) for key, h in handles.items()}

    def set_agent_certificates(self, certificates: Mapping[str, str]) -> None:
        """Replace the table node-agent target -> the certificate (PEM) its plugin pod
        publishes (the reconciler, on every snapshot). Calls to a target listed here go over
        TLS pinning that certificate; a changed certificate gets a new channel
        (`AgentPool.set_certificates`)."""
        self._pool.set_certificates(certificates)

    def group_for(self, job: str, name: str, pod_uid: str = "") -> tuple[LockGroup, str]:
        """(group, the job as the group knows it) for `job` naming `name`: a group id, or
        one of the job's claim sets by its pod-level claim name (e.g. "gpu") or its claim
        source (e.g. "trainer-gpu"). When two claim sets of the job share the name (its
        trainer and sampler pods both call their claim "gpu"), the one whose pods include
        `pod_uid` (the caller's, from its token) is meant. In a group with members, only
        members may act. `job` "": the job of the pod `pod_uid` (the caller named none).
        `name` "": the pod's only claim of this driver (DESIGN.md: with a single claim the
        name may be omitted). Raises NotFound, FailedPrecondition (a shared name and no pod
        that decides), InvalidArgument (no name, and the pod has several claims)."""
        if not name:
            names = self._handles.get(pod_key(pod_uid), ())  # (not a scan of every alias at each call)
            if len(names) != 1:
                raise (NotFound if not names else InvalidArgument)(
                    f"no group named, and the calling pod ({pod_uid or 'unknown: no token'}) holds "
                    + (f"{len(names)} claims of this driver ({', '.join(names)}): name one (group_id=, or "
                       "$TIMESLICE_GROUP)" if names else "no claim of this driver"))
            name = names[0]
        if not job:
            targets = self._aliases.get((pod_key(pod_uid), name), ())
            if not targets:
                raise NotFound(f"the calling pod ({pod_uid or 'unknown: no token'}) holds no claim called {name!r} "
                               "of this driver (or set TIMESLICE_JOB)")
            if len(targets) > 1:
                raise FailedPrecondition(f"the calling pod's claims {', '.join(m for _, m in targets)} are all "
                                         f"called {name!r}: lock by the claim source (the part after ':')")
        else:
            targets = self._aliases.get((job, name), ((name, job),))
        if len(targets) > 1:
            mine = [(g, m) for g, m in targets if g in self._groups and
                    pod_uid in getattr(self._groups[g].spec.member(m), "pod_uids", ())] if pod_uid else []
            if len(mine) != 1:
                raise FailedPrecondition(
                    f"job {job!r} has {len(targets)} claim sets its pods call {name!r} "
                    f"({', '.join(m for _, m in targets)}): the calling pod decides which when the orchestrator "
                    "authenticates pods (--auth tokenreview); else lock by the claim source (the part after ':')")
            targets = tuple(mine)
        group_id, member = targets[0]
        group = self.group(group_id)
        if group.spec.members and group.spec.member(member) is None:
            raise NotFound(f"job {job!r} has no claim in group {group_id!r}")
        return group, member

    async def checkpointed_jobs(self, group: LockGroup) -> set[str]:
        """The group's jobs that its node agents report checkpointed (leader takeover). An
        agent that does not answer (its node has no plugin pod, it is restarting) is
        logged and skipped: the rest of the group's state is still worth adopting, and the
        group reads that agent's records before its next grant (`Settling.records_unknown`)."""
        found: set[str] = set()
        for target in group.spec.agents:
            try:
                found |= await self._pool.get(target).checkpointed_jobs(records_of(group.spec))
            except TimeSliceServerError as err:
                log.warning("checkpoint records unknown group=%s agent=%s: %s", group.id, target, err)
                group.moves.settling.records_unknown.add(target)
        return own_records(group.spec, found)

    def groups(self) -> list[LockGroup]:
        return [self._groups[k] for k in sorted(self._groups)]

    def agent(self, target: str) -> AgentClient:
        """The client of the node agent at `target` (`AgentPool.get`)."""
        return self._pool.get(target)

    async def adopt_agents(self) -> None:
        """Standalone start: each group resumes from its persisted epoch floor and placement
        (`StateFile`) and the jobs its node agents report checkpointed (they are restored
        before they are granted again): `takeover.adopt_standalone`; an idle `freeze` group
        then thaws them, as it would any frozen job while nobody holds. The cooperative
        jobs the state file records checkpointed into the pinned pool
        (`CooperativeJobs.adopt`) count as resident until their processes confirm it
        (`_checkpoint_learned`): their restore may have run after the record."""
        unconfirmed = self.cooperative.adopt()
        for group in self.groups():
            checkpointed = await self.checkpointed_jobs(group) if group.spec.agents else set()
            takeover.adopt_standalone(group, self._state, checkpointed, unconfirmed.get(group.id, set()))
            group.idle.refresh_memory()  # idle: a freeze group thaws what it adopted frozen (no one may ask)

    def _checkpoint_lost(self, group_id: str, job: str, reason: str) -> None:
        """A cooperative job's checkpoint cannot be proven intact: the job fails with
        `reason` (its acquires are refused until it restarts, which drops it)."""
        group = self._groups.get(group_id)
        if group is None:
            return
        group.failed_jobs[job] = reason
        group.fail_job(job, SwitchFailed(f"group {group_id}: job {job} failed: {reason} (it is not retried: restart "
                                         "the job, which drops it)"))
        group.notify("job-failed", job)

    def _checkpoint_learned(self, group_id: str, job: str) -> None:
        """A cooperative job's process reported a checkpoint this orchestrator had no record
        of, or confirmed a recorded one after a restart: it is restored before it computes
        again (unless it holds, or the switch in flight moves it out: that switch's outcome
        places it, and a rollback restores it)."""
        group = self._groups.get(group_id)
        if group is not None and (group.holder is None or group.holder.job_id != job) and not group.moves.evicting(job):
            group.residency.moved_out(job)

    def drop_job(self, group_id: str, job: str, reason: str) -> None:
        """A job of the group is gone: its waiters fail, its hold ends, its cooperative
        processes and their pinned ranges are forgotten. Raises NotFound."""
        self.group(group_id).drop_job(job, reason)
        self.cooperative.forget(group_id, job)

    def leave(self, group_id: str, job: str) -> str:
        """A process of `job` is done with the group (`LockGroup.leave`); a job that left has
        its cooperative processes and their pinned ranges forgotten too (a cooperative job
        needs no restore to end). A job with a cooperative process still connected (another
        process of it, e.g. a pod of the same unit) is "busy" and stays. Returns "left" or
        "busy". Raises NotFound."""
        group = self.group(group_id)
        if self.cooperative.connected(group_id, job):
            return "busy"
        result = group.leave(job)
        if result == "left":
            self.cooperative.forget(group_id, job)
        return result

    async def close(self) -> None:
        for group in list(self._groups.values()):
            await group.close()
        await self._pool.close()
        await self.cooperative.close()
        if self._state is not None:
            await self._state.written()
            self._state.close()
