"""Takeover: a lock group's state after a leader change or an orchestrator restart.

Called by `LockGroup` (`adopt`, and keep-alives from leases it does not know). The node
agents' records are the truth about GPU state (DESIGN.md, "Leader election and
takeover"); the group's last epoch comes from claim status or the standalone epoch file,
so epochs never repeat.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.group_model import ADOPTED, Hold, JobCounters
from timeslice.controller.orchestrator.state_file import Placement, StateFile
from timeslice.driver import names

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")


@dataclass(frozen=True)
class Adoption:
    """What a takeover makes of an empty group (`adoption`): `checkpointed`, off the GPUs;
    `residents`, on them, least recently held first; `leaving`, on them and bound to leave
    before anyone is granted (they may still compute without the lock); `holder`, the
    presumptive holder (the most recently held resident); and the fencing `epoch`."""

    checkpointed: frozenset[str]
    residents: tuple[str, ...]
    leaving: tuple[str, ...]
    holder: str | None
    epoch: int


def adoption(resident: str | None, checkpointed: Set[str], epoch: int, must_leave: Set[str] = frozenset(),
             residents: Set[str] = frozenset()) -> Adoption:
    """Where each job is after a takeover (`adopt`'s rules). Pure. A job is in one place: the
    presumptive holder on the GPUs (it held last: the agents' records of a checkpoint of it
    are older), then checkpointed per the agents' records, then a job that must leave on the
    GPUs, then the others that may be there."""
    out = frozenset(checkpointed) - {resident}
    leaving = tuple(sorted(set(must_leave) - out - {resident}))
    others = tuple(sorted(set(residents) - out - set(must_leave) - {resident}))
    return Adoption(out, (*leaving[::-1], *others[::-1], *([resident] if resident is not None else [])), leaving,
                    resident, epoch)


@dataclass(frozen=True)
class Carrying:
    """What groups re-forming makes of the claim sets carried from an old group to a new one
    (`carrying`): the new group's fencing `epoch`; `checkpointed`, off the GPUs, and
    `residents`, on them (sorted); `leaving`, on them and bound to leave before the new group
    grants anyone (the old group's lapsed, dropped or preempted holders, in its order); and the
    old group's holder, if carried, in exactly one of: `holder` (it holds on in the new group
    under its lease), `parked` (preempted: it keeps its lease, leaves the GPUs before anyone is
    granted, and is restored in its turn) or `revoked` (its lease is revoked: nothing stops its
    processes, so it leaves as a lapsed holder)."""

    epoch: int
    checkpointed: tuple[str, ...]
    residents: tuple[str, ...]
    leaving: tuple[str, ...]
    holder: str | None = None
    parked: str | None = None
    revoked: str | None = None


# Backends under which a carried holder preempted by the new group's own is revoked, not parked:
# nothing stops its processes (none, cooperative), or its memory moves once its client released
# (app, vmm: `names.UNRELEASED_KEPT_BACKENDS`)
REVOKING_BACKENDS = (names.BACKEND_NONE, names.BACKEND_COOPERATIVE, *names.UNRELEASED_KEPT_BACKENDS)


def carrying(jobs: Set[str], epochs: tuple[int, int], checkpointed: Set[str], residents: Set[str],
             leaving: Sequence[str], holder: str | None, new_holds: bool, new_leaving: Set[str],
             backend: str) -> Carrying:
    """`carry`'s rules. Pure. `jobs`: the claim sets carried; `epochs`: (old, new) groups'
    epochs; `checkpointed`, `residents`, `leaving`: the old group's; `holder`: its holder's job
    (None: nobody holds); `new_holds`: the new group has a holder; `new_leaving`: the new
    group's jobs that must leave the GPUs; `backend`: the new group's. The new epoch is never
    below either group's; a carried job is in one place, checkpointed first (as the old group
    knew it); the carried holder holds on only where the new group has no holder and nobody
    (but it) must leave first, else it is parked, or revoked under `REVOKING_BACKENDS`."""
    out = tuple(sorted(j for j in jobs if j in checkpointed))
    on = tuple(sorted(j for j in jobs if j in residents and j not in checkpointed))
    gone = tuple(j for j in leaving if j in jobs)
    c = Carrying(max(epochs), out, on, gone)
    if holder is None or holder not in jobs:
        return c
    if not new_holds and not ({*new_leaving, *gone} - {holder}):
        return dataclasses.replace(c, holder=holder)
    if backend in REVOKING_BACKENDS:
        return dataclasses.replace(c, revoked=holder)
    return dataclasses.replace(c, parked=holder)


def adopt(g: LockGroup, resident: str | None, checkpointed: set[str], epoch: int,
          must_leave: set[str] | frozenset[str] = frozenset(),
          residents: set[str] | frozenset[str] = frozenset()) -> None:
    """Take over an empty group. `resident` and `checkpointed` come from the node agents'
    records (and claim status, or the standalone state file); `epoch` is the last one
    recorded. The resident job becomes a *presumptive* holder: its next keep-alive or
    release with its old lease is accepted (and adopts that lease); if it was not holding,
    the hold lapses after one lease period; its memory is watched as a holder's (`HolderWatch`).
    `must_leave`: jobs that may still compute without the lock (a lapsed or dropped holder,
    persisted): resident, and checkpointed before anyone is granted. `residents`: jobs that
    may be on the GPUs (persisted), resident unless checkpointed. Where each job goes is
    `adoption` (pure). A group that already holds, queues or granted is left as it is."""
    if g.holder is not None or g.epoch or len(g.queue):
        return
    a = adoption(resident, checkpointed, epoch, must_leave, residents)
    for job in a.checkpointed:
        g.residency.moved_out(job)
    for job in a.residents:
        if job == a.holder:
            g.residency.held(job, observed=False)  # it held before this orchestrator watched it
        else:
            g.residency.moved_in(job, next_up=True)  # (appended: `a.residents` is least recently held first)
    for job in a.leaving:
        g.moves.lapsed(job)
    g.epoch = a.epoch
    for job in {*a.checkpointed, *([a.holder] if a.holder is not None else [])}:  # counted from here (`JobCounters`)
        g.job_counters.setdefault(job, JobCounters())
    if resident is not None:
        now = g.clock()
        member = g.spec.member(resident)
        g.holder = Hold(resident, ADOPTED, epoch, now, now + g.spec.lease_seconds, set(), False, 0.0,
                        member.priority if member is not None else 0, callers_unknown=True)
        g.leases.arm()
        # its growth is watched as a granted holder's: the hold may be in progress (a helper's attack on
        # `timeslice orchestrator`: restarted at a grant, the holder then grew unwatched into an OOM)
        g.moves.watch.start()
    log.info("adopted group=%s resident=%s checkpointed=%s must_leave=%s residents=%s epoch=%d", g.id, resident,
             sorted(checkpointed), sorted(must_leave), list(g.residency.residents), epoch)


def adopt_standalone(g: LockGroup, state: StateFile | None, checkpointed: set[str],
                     unconfirmed: set[str] | frozenset[str] = frozenset()) -> None:
    """A standalone orchestrator's start: adopt `state`'s epoch floor and placement and the
    jobs the node agents report `checkpointed`. `unconfirmed`: jobs whose checkpoint only
    `state` records (cooperative: the orchestrator may have died after their restore ran):
    residents, their memory counted on the GPUs, until their processes say (`CooperativeJobs`
    reports a confirmed checkpoint, and the group moves the job out). The job granted last,
    unless checkpointed or recorded so, is the presumptive holder; the jobs that had to leave
    the GPUs still must; the others that may be on the GPUs are residents, and so are the jobs
    the agents had moved out and no longer hold (`timeslice serve`'s stop restores them: a
    helper's attack, the job it thawed computed beside every later holder; also ended jobs,
    which have nothing to move). Not on `cooperative`, whose agents keep no such records."""
    start, placed = (state.start(g.id), state.placement(g.id)) if state else (0, Placement())
    holder = placed.holder if placed.holder not in checkpointed | unconfirmed else None
    back = set(placed.moved_out) if g.spec.backend != names.BACKEND_COOPERATIVE else set()
    adopt(g, holder, checkpointed, start, set(placed.must_leave) - checkpointed - {holder},
          (set(placed.residents) | unconfirmed | back) - checkpointed)
    if state is not None and g.holder is not None and g.holder.epoch == start:
        # the presumptive hold carries the floor as its epoch, which a caller joining it is granted: a block
        # past it is reserved first, so the next start's floor is new again (fencing epochs never repeat)
        state.reserve(g.id, start + 1)


def record_placement(g: LockGroup, incoming: str | None = None) -> None:
    """Persist who may be computing or on the GPUs (standalone `StateFile`), with the
    `incoming` job of a switch about to start (which waits for `StateFile.written`)."""
    persist_placement(g, g.holder.job_id if g.holder else None, incoming)


def persist_placement(g: LockGroup, holder: str | None, incoming: str | None = None) -> None:
    """Record `g`'s placement with `holder` as its holder (written off the loop:
    `StateFile.durable`)."""
    if g.state is not None:
        g.state.record(g.id, holder, g.moves.must_leave(holder or ""),
                       [*g.residency.residents, *(j for j in (holder, incoming) if j)],
                       g.residency.checkpointed - {holder, incoming})


def requeue_switched_out(g: LockGroup, job_id: str, lease_id: str, epoch: int) -> None:
    """A keep-alive for a lease this group does not know (granted by an earlier leader), from a
    job that is checkpointed here (`lease_calls.Act.REQUEUE_SWITCHED_OUT` says when), comes from
    a holder switched out mid-phase under that leader (preempted, or lapsed while cut off): its
    process is stopped on the GPU, so it is queued again with that lease rather than left
    stopped for good. Only on backends that stop processes (`STOPPING_BACKENDS`); elsewhere the
    keep-alive is refused and its client's next acquire is granted restored: under `app` its
    engine would be woken under the hold its client believes uninterrupted (a vLLM sleep of
    level 2 discards the weights); under `cooperative` the process was never stopped: it is a
    client that had not yet seen its grant when it was moved out (issue 22, case 4), and its
    hold must end, never resume on a state that is out."""
    now = g.clock()
    member = g.spec.member(job_id)
    g.leases.remember(lease_id)
    g.preemption.park(Hold(job_id, lease_id, epoch, now, now, set(), False, 0.0, member.priority if member else 0))
    log.warning("checkpointed holder queued again group=%s job=%s epoch=%d: it still keeps its lease alive",
                g.id, job_id, epoch)
    g.dispatch()
    g.preemption.arm()


def carry(new: LockGroup, old: LockGroup, jobs: set[str]) -> None:
    """Groups re-formed (a claim set joined or left, and groups merged or split): the claim
    sets `jobs` moved from `old` to `new` (members of `new` now). Their state comes along:
    residency (resident, checkpointed, peaks), the fencing epoch floor (never below
    `old`'s), the jobs that must leave the GPUs before a grant, their waiters in their order
    (callers, futures and preempted holders' leases included: nobody waits in a group that
    is gone), and `old`'s holder. That one goes on holding in `new` with its lease when `new`
    has no holder; else it is preempted (`Preemption.park`): it keeps its lease, leaves the
    GPUs (checkpointed, or frozen) before `new` grants anyone, and is restored in its turn,
    invisibly to its code; with `none` or `cooperative` (nothing stops it) its lease is
    revoked and it must leave as a lapsed holder, with `app` once its client released
    (`AwakeEngines`, which carries along). Callers carry the old group of the
    highest-priority holder first."""
    h = old.holder
    r_old, r_new = old.residency, new.residency
    c = carrying(jobs, (old.epoch, new.epoch), set(r_old.checkpointed), set(r_old.residents), old.moves.must_leave(""),
                 h.job_id if h is not None else None, new.holder is not None, set(new.moves.must_leave()),
                 new.spec.backend)
    new.epoch = c.epoch
    for job in c.checkpointed:
        r_new.moved_out(job)
    for job in c.residents:
        r_new.moved_in(job)
    for job in sorted(jobs & r_old.peaks.keys()):
        r_new.peaks[job] = dict(r_old.peaks[job])
    for job in c.leaving:
        new.moves.lapsed(job, *(old.awake.unreleased_hold(job) or (None, "its lease lapsed")))
    for w in old.queue:
        if w.job_id not in jobs:
            continue
        old.queue.remove(w)
        parked = old.preemption.forget(w)
        if parked is not None:  # a preempted holder's entry: queued again there under its lease
            new.leases.remember(parked.lease_id)
            new.preemption.park(parked)
            continue
        w.owner = new
        new.queue.adopt(w)
    if h is not None and c.holder is not None:
        old.holder = None
        old.leases.stop()
        h.kept = ""  # (overdue in `old`: `new`'s lease timer decides afresh)
        old.preemption.stop_clock()
        new.holder = h
        new.leases.remember(h.lease_id)
        r_new.held(h.job_id, observed=False)  # `old` watched it until now
        new.leases.arm()
        new.moves.watch.start()  # and `new` from now on (its memory may still grow)
        log.info("holder carried group=%s job=%s epoch=%d from=%s", new.id, h.job_id, h.epoch, old.id)
    elif h is not None and (c.parked or c.revoked):
        old.end_hold(h, f"preempted: its claim set moved to group {new.id}, which has another holder")
        r_new.moved_in(h.job_id)
        if c.revoked:  # nothing stops it: its lease is revoked (app: its engine sleeps once its client released)
            new.moves.lapsed(h.job_id, h, f"its claim set moved to group {new.id}, which has another holder")
        else:  # as if preempted: it keeps its lease, leaves the GPUs before any grant, is restored in turn
            new.leases.remember(h.lease_id)
            new.preemption.park(h)
        log.warning("holder preempted group=%s job=%s epoch=%d: its group merged with one that holds; it "
                    "leaves the GPUs before anyone is granted", new.id, h.job_id, h.epoch)
    log.info("carried group=%s from=%s jobs=%s waiters=%d", new.id, old.id, sorted(jobs), len(new.queue))
    new.preemption.arm()
    old.preemption.disarm_when_unwaited()
    old.dispatch()
    new.dispatch()
