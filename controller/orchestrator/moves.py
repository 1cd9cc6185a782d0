"""MemoryMoves: when a lock group moves GPU memory, and what it moves.

Owned by `LockGroup` (one per group); runs the group's switches through its `Switcher`.
Residency (`residency.py`, plans in `placement.py`): several jobs may be resident at once; the lock orders
compute, memory moves only when needed. `auto` (the default, for the backends that move
GPU memory): a resident waiter is granted at once; any other is granted after a plan
over fresh node-agent memory reports checkpoints the least recently held idle residents
it does not fit beside, then restores it when it is checkpointed. A plan without room
fails the waiters with `SwitchFailed` (nothing attempted; their clients ask again, and it
never counts against the job as a failed restore). While a job
holds, the job to be granted next, when checkpointed, is *staged*: room is made for it
beside the holder (never moving the holder, leaving it room to grow to its need: its
peak or what it declared) and it is restored behind the holder's phase, so the hand-off
moves nothing; a staging without room is left to the hand-off. When the group goes idle, checkpointed jobs that fit are
restored in the background. `exclusive` (and
the `freeze` backend, and agents that report no GPU memory): one job is resident, as in
a checkpoint at every hand-off.

Jobs that must leave the GPUs before anyone is granted, whether or not the incoming job
fits beside them (their processes may still compute): preempted holders, *fenced* ones
(dropped while holding) and *lapsed* ones (their lease ran out). *Orphans*: checkpointed
jobs nobody will ask for (dropped, or lapsed while preempted), restored when the group is
idle (`idle_restores.py`) so no process stays stopped, then forgotten.

Backend `app`: a holder whose hold ended without its release leaves the GPUs only once its
client released, or is gone (`awake_engines.py`); nobody is granted in its place until then.

`MemoryMoves` decides (`decisions.decide` over `facts`) and keeps the jobs that must leave;
its collaborators, each owning its own state: `SwitchRunner` (switch_run.py: the switch in
flight and its outcome), `HolderWatch` (holder_watch.py: the holder's growth) and `Settling`
(in_flight.py: records and unsure jobs settled before a grant), `Deferral` (deferral.py: a grant
that would move memory waits while residents are between phases); memory reports and plans are
functions of the group (memory_plan.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.config import MEMORY_BACKENDS
from timeslice.controller.orchestrator.decisions import (
    DispatchFacts,
    GrantBeside,
    GrantOnGpu,
    ReadRecords,
    SettleUnsure,
    Stage,
    Switch,
    WaitForRelease,
    Waiting,
    decide,
)
from timeslice.controller.orchestrator.deferral import Deferral
from timeslice.controller.orchestrator.group_model import Hold
from timeslice.controller.orchestrator.holder_watch import HolderWatch
from timeslice.controller.orchestrator.in_flight import Settling
from timeslice.controller.orchestrator.memory_plan import roomy
from timeslice.controller.orchestrator.move_cost import CostInputs, moves_nothing, pass_remaining
from timeslice.controller.orchestrator.switch_run import SwitchRunner
from timeslice.driver import names
from timeslice.driver.tasks import cancel_and_wait

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")


class MemoryMoves:
    """When `group` moves GPU memory: its dispatch decisions, the jobs that must leave or be
    restored, and its collaborators (`runner`: the switch in progress; `watch`: the holder's
    growth; `settling`: records and unsure jobs settled before a grant; `deferral`)."""

    def __init__(self, group: LockGroup) -> None:
        self._g = group
        self.runner = SwitchRunner(group)
        self.watch = HolderWatch(group)
        self.settling = Settling(group)
        self._fenced: set[str] = set()  # dropped holders to checkpoint before anyone is granted
        self._lapsed: set[str] = set()  # holders whose lease lapsed: checkpointed before anyone is granted
        self.deferral = Deferral(group)

    @property
    def memory_aware(self) -> bool:
        """Residency `auto` on a backend that moves GPU memory, with a switcher that reports it."""
        spec = self._g.spec
        return spec.residency == "auto" and spec.backend in MEMORY_BACKENDS and hasattr(self._g.switcher, "memory")

    # -- what happened to a job ------------------------------------------------------
    def granted(self, job: str) -> None:
        """`job` holds the lock with its state on the GPUs: nothing pending about it (a hold of
        it that ended unreleased is superseded: its client holds again)."""
        self.deferral.granted(job)
        self.runner.forget(job)
        self._fenced.discard(job)
        self._lapsed.discard(job)
        self._g.awake.forget(job)

    def lapsed(self, job: str, hold: Hold | None = None, why: str = "its lease lapsed") -> bool:
        """`job`'s lease lapsed while it held (or was revoked: `hold`, the hold that ended, and
        `why`): cut off, not gone, it may still compute, so it leaves the GPUs before anyone is
        granted. On backends `app` and `vmm` (`names.UNRELEASED_KEPT_BACKENDS`) only once its
        client released (`AwakeEngines.lapsed`, whose answer it returns: whether the job is to be
        dropped instead)."""
        if self._g.spec.backend in names.UNRELEASED_KEPT_BACKENDS:
            return self._g.awake.lapsed(job, hold, why)
        if self._g.spec.backend != names.BACKEND_NONE:
            self._lapsed.add(job)
        return False

    def evicting(self, job: str) -> bool:
        """Whether the switch in flight moves `job` off the GPUs (its outcome says where it is)."""
        return job in self.runner.evicting

    def unconfirmed(self, job: str) -> bool:
        """Whether a process of `job` has not said since a restart whether its state is on the
        GPUs or checkpointed (`SwitchCoordinator.unconfirmed`; the state file alone does not
        tell: the orchestrator may have died after a restore ran and before its answer was
        recorded). Such a job counts as resident: its memory counts against the GPUs, and room
        made beside it checkpoints it, which waits for its processes. It is never granted as
        resident: its grant restores it, refused (its client asks again) until they have
        reconnected."""
        unconfirmed = getattr(self._g.switcher, "unconfirmed", None)
        return unconfirmed is not None and bool(unconfirmed(self._g.spec, job))

    def dropped(self, job: str, held: bool, gone: bool = False) -> None:
        """`job` is gone (`held`: while it held the lock; `gone`: no process of it is left). A
        holder (or a lapsed or fenced job, or one the switch in flight moves off) still resident
        is fenced: nobody is granted until a switch has checkpointed (or frozen, or found gone)
        its processes; then, like one dropped while checkpointed, it is restored when the group
        is idle, then forgotten. On backend `app` an engine outlives its client (a process that
        left, a client killed): unless `gone`, it stays where it is, an awake one a resident that
        the next switch puts to sleep like any other, an asleep one asleep until its job asks
        again (a sleeping engine is no stopped process: `IdleRestores.unowned`). Forgotten awake,
        the next job's wake ran out of memory beside it (app schedules seed 3), and so did an
        orphan's wake beside the awake resident (a helper's attack: every client that ended while
        its engine slept)."""
        g = self._g
        r = g.residency
        if (held or job in self._lapsed | self._fenced | self.runner.evicting | g.awake.unreleased_jobs()) \
                and g.spec.backend != "none" and job in r.residents:  # dropped again while fenced: it stays
            self._fenced.add(job)  # (being evicted: an orphan once out)
        elif g.spec.backend == names.BACKEND_APP and not gone and (job in r.residents or job in r.checkpointed):
            pass  # its engine stays where it is
        elif job in r.checkpointed and g.spec.backend not in (names.BACKEND_NONE, names.BACKEND_APP):
            g.idle.unowned(job)  # (an `app` one gone is forgotten: a sleeping engine is no stopped process)
        else:
            r.forget(job)
        self._lapsed.discard(job)
        g.awake.forget(job)
        self.runner.dropped(job)
        self.deferral.forget(job)

    # -- grants ------------------------------------------------------------------------
    def facts(self) -> DispatchFacts:
        """What the group knows now, for `decisions.decide`. The memory-aware facts (room by
        the last report, how long resident waiters may pass the head, whether the head's grant
        moves nothing) only on memory-aware groups, the last only where it decides: the others
        decide without them."""
        g, r = self._g, self._g.residency
        aware = self.memory_aware
        head = g.queue.head()
        queued = {w.job_id for w in g.queue}
        leaving = tuple(self.must_leave())
        costs = self.costs() if aware and head is not None else None
        room = frozenset(j for j in queued if j in r.residents and roomy(g, j)) if aware else frozenset()
        passing = pass_remaining(costs, head) if costs is not None and head is not None and not leaving else 0.0
        return DispatchFacts(
            backend=g.spec.backend, memory_aware=aware,
            holder=g.holder.job_id if g.holder else None, holder_epoch=g.holder.epoch if g.holder else 0,
            switching=self.runner.switching is not None, beside=self.runner.beside,
            queue=tuple(Waiting(w.job_id, w.priority) for w in g.queue),
            residents=tuple(r.residents), checkpointed=frozenset(r.checkpointed),
            unconfirmed=frozenset(j for j in queued if self.unconfirmed(j)),
            known=frozenset(j for j in queued | ({g.holder.job_id} if g.holder else set()) if r.known(j)),
            roomy=room,
            leaving=leaving, unreleased=tuple(g.awake.unreleased()), failed=frozenset(g.failed_jobs),
            unstaged=self.runner.unstaged,
            records_unknown=bool(self.settling.records_unknown) and hasattr(g.switcher, "checkpointed"),
            unsure=bool(self.settling.unsure) and self.settling.settles_unsure,
            pass_remaining=passing,
            # (a plan of its own: asked only where it decides, while residents may pass a head without room)
            head_moves_nothing=costs is not None and head is not None and passing > 0 and head.job_id not in room
            and moves_nothing(costs, head.job_id, self.unconfirmed(head.job_id)))

    def costs(self) -> CostInputs:
        """What the cost model (move_cost.py) reads of the group now."""
        g = self._g
        prior = g.switcher.prior_speed(g.spec) if hasattr(g.switcher, "prior_speed") else None
        return CostInputs(g.spec, g.residency, g.clock(), g.recent, g.recent_holds, g.recent_holds.maxlen,
                          g.holder.granted_at if g.holder else None, prior)

    def dispatch(self) -> None:
        """Run what `decisions.decide` says the group does now."""
        g = self._g
        d = decide(self.facts())
        head = g.queue.head()
        if isinstance(d, (GrantOnGpu, Switch)) and head is not None and d.job != head.job_id:
            log.debug("resident first group=%s job=%s before=%s", g.id, d.job, head.job_id)
        if isinstance(d, ReadRecords):
            self.settling.read_records()
        elif isinstance(d, SettleUnsure):
            self.settling.settle_unsure()
        elif isinstance(d, WaitForRelease):
            log.info("grant waits group=%s: the engine of %s stays awake until its client releases (%s)",
                     g.id, ", ".join(d.jobs), "; ".join(g.awake.why(j) for j in d.jobs))
            g.awake.watch(list(d.jobs))
        elif isinstance(d, GrantOnGpu):
            self._grant_on_gpu(d.job)
        elif isinstance(d, Switch):
            if not (d.may_defer and head is not None and self.deferral.defer(head)):
                self.runner.start(None if d.evict is None else list(d.evict), d.job, d.restore, grant=True)
        elif isinstance(d, Stage):
            self.runner.stage(d.job, d.beside)
        elif isinstance(d, GrantBeside):
            log.debug("granted beside a staging group=%s job=%s", g.id, d.job)
            g.grant(d.job, restored=False, switch_seconds=0.0)

    def _grant_on_gpu(self, incoming: str) -> None:
        """Grant `incoming`, which the group believes has its state on the GPUs, once its node
        agents confirm it (`Switcher.confirm`: none holds a checkpoint record of it). A job an
        agent reports checkpointed after all is restored first; an agent that does not answer
        fails the waiters (nothing is granted on a guess). Immediate: without agents (`none`),
        for a switcher that cannot confirm, and for a job this group never placed (no step of
        it ran here; after a restart or a leader change the agents' records were adopted)."""
        g = self._g
        if g.spec.backend == "none" or not hasattr(g.switcher, "confirm") or incoming not in g.residency.residents:
            g.grant(incoming, restored=False, switch_seconds=0.0)
            return
        self.runner.confirm(incoming)

    def must_leave(self, incoming: str = "") -> list[str]:
        """Holders preempted mid-phase, dropped, or whose lease lapsed, that are still on the
        GPUs: they must leave whether or not the incoming job fits beside them (their
        processes may still be computing; on backend `app` once their client released:
        `unreleased`)."""
        jobs = self._g.preemption.parked_jobs() + sorted(self._fenced | self._lapsed | self._g.awake.unreleased_jobs())
        return [j for j in dict.fromkeys(jobs) if j != incoming and j in self._g.residency.residents]

    def left(self, job: str) -> bool:
        """`job` left the GPUs (the switch runner checkpointed it, or found nothing of it
        anywhere): it need not leave any more. Returns whether it was fenced."""
        self._lapsed.discard(job)
        fenced = job in self._fenced
        self._fenced.discard(job)
        return fenced

    async def close(self) -> None:
        self.deferral.close()
        for task in (self.deferral.report_task, self.watch.task, self.settling.records_task,
                     self.settling.settle_task, self.runner.task):
            await cancel_and_wait(task)  # (a cancel swallowed by 3.11's wait_for is sent again)

