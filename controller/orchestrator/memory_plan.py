"""Memory reports and plans of a lock group: what is on its GPUs, and what must leave for a job.

Functions of a `LockGroup`, used by `MemoryMoves` (moves.py), the switch runner
(switch_run.py), the holder's watch (holder_watch.py) and the idle restores: `snapshot` asks
the node agents for fresh memory reports, `plan` picks the residents to checkpoint so that a
job fits (`placement.place`), and `roomy` says whether the last report leaves a resident
room to be granted at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, NamedTuple

from timeslice.controller.orchestrator.memory_snapshot import MemorySnapshot
from timeslice.controller.orchestrator.placement import (
    NoRoom,
    as_planned,
    crowded,
    devices_of,
    held_by_others,
    lacking_room,
    moves_may_come,
    place,
)
from timeslice.driver.headroom import parse_headroom

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")

# While a resident's processes are departing (see `SwitchCoordinator.departing`), a plan that
# finds no room asks for a fresh memory report this often, seconds.
DEPARTING_POLL_SECONDS = 0.25


class AgentsUnanswered(NoRoom):
    """A memory report a plan needs was not answered by every node agent (`snapshot`)."""


class Plan(NamedTuple):
    """What a switch moves: `evict`, the residents to checkpoint, in order; `restore_first`:
    the incoming job's checkpoint is restored before theirs are taken (`plan_room`)."""

    evict: list[str]
    restore_first: bool = False


def pin_if_moves_may_come(g: LockGroup) -> None:
    """Once a grant of this group may move memory by the last report (`moves_may_come`
    over its jobs), let the switcher prepare for it (`Switcher.pin_ahead`)."""
    r = g.residency
    pin = getattr(g.switcher, "pin_ahead", None)
    if pin is None or r.snapshot is None:
        return
    if moves_may_come(group_jobs(g), r.snapshot, r.peaks, parse_headroom(g.spec.memory_headroom), r.known,
                      r.declared):
        pin(g.spec)


def group_jobs(g: LockGroup) -> list[str]:
    """The group's jobs: resident (the holder among them), checkpointed or waiting."""
    return sorted({*g.residency.residents, *g.residency.checkpointed, *(w.job_id for w in g.queue)})


async def snapshot(g: LockGroup) -> MemorySnapshot | None:
    """Fresh memory reports of the group's jobs (None: the agents report no GPU memory).
    Raises AgentsUnanswered when a node agent did not answer: its GPUs' memory is unknown, not
    absent (schedules seed 5112: with the agent killed, an idle group's plan read "no
    memory reports" and restored a job beside one that had ended and still held 60 GB)."""
    snap = await g.switcher.memory(g.spec, group_jobs(g))  # type: ignore[attr-defined]
    if snap is None:
        return None
    g.residency.observe(snap)  # without devices too: the holds a failed report missed are unobserved
    pin_if_moves_may_come(g)
    g.moves.settling.reported(snap)
    if snap.unanswered:
        raise AgentsUnanswered(f"node agent(s) {', '.join(sorted(snap.unanswered))} did not answer a memory "
                               "report: no memory is added to their GPUs until they do")
    return snap if snap.devices else None


async def plan(g: LockGroup, incoming: str, allow_evictions: bool, beside: str | None = None,
               residents_grow: bool = False) -> Plan:
    """Residents to checkpoint so that `incoming` fits (memory-aware groups), preempted
    holders first. `beside`: a holder that stays, with room to grow to its need (its peak
    or what it declared, `need_of`); `residents_grow`: so does every idle resident (a
    background restore: each may grow at its next grant, which is at once). When their
    checkpoints lack host memory and `incoming` is checkpointed, it is restored first
    where its checkpoint fits beside
    them (H200, 3 jobs of 47 GB checkpoints, a 101 GB pool: two were out, and the third
    ran all its phases alone while they waited, bench/results/
    rl-grpo-b-serve-cooperative-h200.json). Raises NoRoom."""
    forced = g.moves.must_leave(incoming) if allow_evictions else []
    waited = False
    while True:
        try:
            snap = await snapshot(g)
        except AgentsUnanswered:  # a resident's grant only frees memory: one resident at a time
            if beside is not None or not allow_evictions or incoming in g.residency.checkpointed or \
                    g.moves.unconfirmed(incoming) or g.moves.settling.unsure or g.residency.left_since_report() or \
                    any(g.residency.started_since_report(j) for j in group_jobs(g)) or _held_by_nobody(g, incoming):
                raise  # (a job started again or left: its ended processes' bytes may linger; an unsure job's may)
            snap = None
        if snap is None:  # no memory information: one resident at a time
            if beside is not None:
                raise NoRoom(f"no memory reports: {incoming} is not restored beside {beside}")
            return Plan(g.residency.lru(excluding=[incoming]) if allow_evictions else [])
        residents = g.residency.lru(excluding=[incoming, *forced, *([beside] if beside else [])]) \
            if allow_evictions else []
        r = g.residency
        growing = [beside] if beside is not None else r.lru(excluding=[incoming]) if residents_grow else []
        snap = as_planned(snap, forced, growing, r.peaks, r.declared)
        if beside is not None and not (r.known(incoming) and r.known(beside)):
            raise NoRoom(f"{incoming if not r.known(incoming) else beside} has not settled its memory (it "
                         f"declared none and its holds still grow it): {incoming} is not restored beside {beside}")
        try:
            evict, first = place(incoming, residents, snap, r.peaks, r.declared,
                                 parse_headroom(g.spec.memory_headroom), known=r.known(incoming),
                                 checkpointed=incoming in r.checkpointed, first_ok=beside is None and not forced)
        except NoRoom:
            departing = g.switcher.departing(g.spec, g.residency.residents) \
                if hasattr(g.switcher, "departing") else []
            if not departing or not allow_evictions:
                raise
            if not waited:  # bounded: a job stops departing after the reconnect grace
                log.info("no room for %s yet group=%s: waiting for departing %s to free the GPU memory",
                         incoming, g.id, departing)
                waited = True
            await asyncio.sleep(DEPARTING_POLL_SECONDS)
            continue
        return Plan([*forced, *evict], first)


def _held_by_nobody(g: LockGroup, incoming: str) -> bool:
    """The last answered report showed memory that checkpointing every other resident would not
    free, over the headroom (an ended process's, still being freed, or another user's): one
    resident at a time would be a guess onto it (cuda schedules seed 310022: a job's process was
    killed holding 83 GB, the reports after it showed them still held, then the agent stopped
    answering and the job's next process was granted on that guess, and ran out of memory). The
    group's jobs' bytes in that report are someone's: residents leave, and those moved out
    since are gone."""
    r = g.residency
    last = r.snapshot
    if last is None:
        return False
    ours = [j for j in last.device_bytes if j != incoming and (j in r.residents or j in r.checkpointed)]
    others = held_by_others(incoming, last, set(last.devices), ours)
    return bool(crowded(last, others, parse_headroom(g.spec.memory_headroom)))


def roomy(g: LockGroup, incoming: str) -> bool:
    """The last memory report leaves a resident `incoming` its growth plus twice the
    headroom (the holder that just released may have grown since that report), and its
    growth plus the headroom once the jobs that held since that report are taken to have
    grown to their need (`Residency.worst_case`: that holder may have built its model or
    optimizer state since): grant at once. Otherwise the grant waits for a fresh report
    and a plan (also for a job whose state may be checkpointed: `MemoryMoves.unconfirmed`,
    and for one whose processes started after that report: `Residency.started_since_report`;
    after a resident job left since that report: `Residency.left_since_report`; and after a job
    whose need is not known held since that report: `Residency.unsettled_held_since_report`)."""
    r = g.residency
    fraction, fixed = parse_headroom(g.spec.memory_headroom)
    last = r.snapshot
    if not r.known(incoming) and (r.lru(excluding=[incoming]) or (last is not None and crowded(
            last, held_by_others(incoming, last, devices_of(incoming, last, r.peaks)), (fraction, fixed)))):
        return False  # unsettled: granted alone (none of others' memory: schedules seed 30039), after a plan
    if g.moves.unconfirmed(incoming) or r.started_since_report(incoming) or r.left_since_report() \
            or r.unsettled_held_since_report(excluding=incoming):
        return False
    snap = r.worst_case(excluding=incoming)
    if snap is None or last is None:
        return True
    if lacking_room(incoming, last, r.peaks, (2 * fraction, 2 * fixed), r.declared):
        return False
    return not any(must for _, must in lacking_room(incoming, snap, r.peaks, (fraction, fixed), r.declared).values())
