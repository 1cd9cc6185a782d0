"""The decision core of a switch's outcome: given how a switch (or a staging) ended, what
changes. Pure: `outcome(facts, result)` returns the effects in the order they run;
`SwitchRunner` (switch_run.py) gathers the facts, runs the switch, and performs them.

The rules (DESIGN.md, "Lock groups and the orchestrator"):
- A switch that ran: its evicted jobs are off the GPUs (`CheckedOut`; a fenced one is then
  restored when idle and forgotten), but those it found gone on every node with no waiter
  (`Dropped`, after the grant); the incoming job is held (`Held`, a switch that grants), an
  orphan restored for nobody is forgotten (`RestoredForNobody`), or a staged or background
  restore is resident (`MovedIn`).
- A job dropped while its switch ran (it left, or was found gone), or whose processes started
  again meanwhile, is not granted by it: the waiters it has now are a later incarnation's, whose
  processes the plan did not see (the old ones may still hold the GPU's memory: cuda schedules
  seed 600008, a job SIGTERMed while waiting and started again was granted in place at the end of
  a switch planned for it, and its new process ran out of memory beside the old one's 66 GB).
  They stay queued, nothing of the switch fails them or counts against them, and the next
  dispatch plans afresh. A dropped job is not taken to be on the GPUs by it, but an `app`
  engine its drop kept (`kept`: `MemoryMoves.dropped`), which the restore woke: it is a resident
  that the next switch puts to sleep (`MovedIn`, not next up; taken for asleep, the next wake
  ran out of memory beside it: app schedules seed 3, a SIGTERMed job left during its switch).
  One started again whose restore ran is resident, next up (`MovedIn`).
- A plan without room fails the incoming job's waiters (`FailWaiters`: their clients ask
  again), except a staging, which is left to the hand-off (`Unstaged`).
- A switch that failed is counted, the evicted jobs the rollback could not put back are off
  the GPUs and unsure until their node agents settle them (`Unsure`), `app` engines the
  rollback woke say so at their next grant (`Woke`), and the incoming job's waiters get
  `SwitchFailed`.
- The job that fails for good is the one whose step failed: only the incoming job, only for a
  restore step that ran and failed (`failed_step == "restore"`, its agents answered), and
  only once `MAX_RESTORE_FAILURES` of its restores failed in a row over at least
  `RESTORE_FAILURE_SECONDS` (`JobFailed`). A failed
  background restore is not tried again in the background (`IdleFailed`).
"""

from __future__ import annotations

from dataclasses import dataclass

from timeslice.controller.orchestrator.group_model import SwitchRecord
from timeslice.driver import names

# A job whose restore fails this many times in a row, over at least RESTORE_FAILURE_SECONDS
# from the first of them, fails (`JobFailed`): its acquires are refused with the last cause
# until it is dropped (its pods restarted), and the group serves the others instead of
# repeating checkpoint(other) -> restore -> rollback at every acquire. The seconds keep a
# fault that passes (a driver error, memory not yet freed) from costing the job: its client
# asks again after 0.25, 0.5, 1, 2, 4, 5 s (`timeslice._rpc`), so a job fails at its seventh
# failed restore, ~13 s after the first. Only a restore step that ran and failed counts: not
# a plan without room, nor a checkpoint of another job, nor agents that did not answer (none
# of them is the job's own fault).
MAX_RESTORE_FAILURES = 3
RESTORE_FAILURE_SECONDS = 10.0


@dataclass(frozen=True)
class SwitchResult:
    """How a switch ended. `kind`: "ran" (`record` None: nothing had to move), "no-room" (its
    plan found none), "failed" (the switcher's SwitchError, rolled back; `off_gpu`: evicted
    jobs the rollback could not put back) or "crashed" (a switcher bug). `error`: why."""

    kind: str
    record: SwitchRecord | None = None
    off_gpu: frozenset[str] = frozenset()
    error: str = ""


@dataclass(frozen=True)
class OutcomeFacts:
    """What the outcome depends on besides the result: the switch (`evict`, `incoming`,
    `restore`, `grant`, `beside`: the holder a staging made room beside), the jobs that wait,
    whether `incoming` is an orphan restored for nobody, its restores failed in a row before
    this switch and the seconds since the first of them (0.0: none), the holder's epoch, and
    whether `incoming` was dropped (`dropped`; `kept`: the group still knows where it is, as
    `MemoryMoves.dropped` keeps an `app` engine) or its processes started again (`restarted`)
    while the switch ran."""

    group_id: str
    backend: str
    evict: tuple[str, ...]
    incoming: str
    restore: bool
    grant: bool
    beside: str | None = None
    queued: frozenset[str] = frozenset()
    orphan: bool = False
    restore_failures: int = 0
    failing_seconds: float = 0.0
    holder_epoch: int = 0
    dropped: bool = False
    kept: bool = False
    restarted: bool = False

    @property
    def replaced(self) -> bool:
        """The incoming job's waiters are a later incarnation's (`dropped` or `restarted`)."""
        return self.dropped or self.restarted


@dataclass(frozen=True)
class Counted:
    """The switch counts as done (`ok`) or failed."""

    ok: bool


@dataclass(frozen=True)
class CheckedOut:
    job: str


@dataclass(frozen=True)
class OffGpu:
    """A job the rollback could not put back: off the GPUs as far as the group knows."""

    job: str


@dataclass(frozen=True)
class Unsure:
    jobs: frozenset[str]


@dataclass(frozen=True)
class Woke:
    jobs: tuple[str, ...]


@dataclass(frozen=True)
class Held:
    job: str


@dataclass(frozen=True)
class RestoredForNobody:
    job: str


@dataclass(frozen=True)
class MovedIn:
    job: str
    next_up: bool


@dataclass(frozen=True)
class Unstaged:
    epoch: int
    job: str


@dataclass(frozen=True)
class FailWaiters:
    """The waiters of `job` get `SwitchFailed(message)`."""

    job: str
    message: str


@dataclass(frozen=True)
class Recorded:
    """Keep `record` in the group's recent switches and tell the observers (of `job`'s switch)."""

    job: str
    record: SwitchRecord


@dataclass(frozen=True)
class Grant:
    job: str
    restored: bool
    switch_seconds: float


@dataclass(frozen=True)
class Dropped:
    job: str


@dataclass(frozen=True)
class IdleFailed:
    job: str


@dataclass(frozen=True)
class RestoreFailed:
    """One more failed restore of `job` in a row; `fails`: it fails for good now (`JobFailed`)."""

    job: str
    record: SwitchRecord
    fails: bool


Effect = (Counted | CheckedOut | OffGpu | Unsure | Woke | Held | RestoredForNobody | MovedIn | Unstaged
          | FailWaiters | Recorded | Grant | Dropped | IdleFailed | RestoreFailed)


def outcome(f: OutcomeFacts, r: SwitchResult) -> tuple[SwitchRecord | None, list[Effect]]:
    """The switch's record (None: nothing to show) and the effects of its end, in order."""
    effects: list[Effect] = []
    vanished: list[str] = []
    record = r.record
    replaced = f.replaced
    grant = f.grant and not replaced
    if r.kind == "no-room":
        if f.beside is not None:  # not now: the hand-off plans again, without the holder
            return None, [Unstaged(f.holder_epoch, f.incoming)]
        record = SwitchRecord(None, f.incoming, ok=False, error=r.error)
        effects += _fail(f, r.error)
    elif r.kind == "failed":
        effects += [Counted(False), *(OffGpu(j) for j in sorted(r.off_gpu)), Unsure(r.off_gpu)]
        if f.backend == names.BACKEND_APP:  # put back by a wake (those it did not reach: a reload more)
            effects.append(Woke(tuple(j for j in f.evict if j not in r.off_gpu)))
        effects += _fail(f, r.error)
    elif r.kind == "crashed":
        record = SwitchRecord(None, f.incoming, ok=False, error=f"internal error: {r.error}")
        effects += [Counted(False), *_fail(f, f"internal error: {r.error}")]
    else:
        vanished = [j for j in f.evict if record is not None and j in record.gone and j not in f.queued]
        effects += [CheckedOut(j) for j in f.evict if j not in vanished]
        if record is not None:
            effects.append(Counted(True))
        if grant:
            effects.append(Held(f.incoming))
        elif f.orphan:  # its processes run on, unowned
            effects.append(RestoredForNobody(f.incoming))
        elif f.restore and record is not None and (not f.dropped or (f.kept and f.backend == names.BACKEND_APP)):
            effects.append(MovedIn(f.incoming, next_up=not f.dropped and (f.beside is not None or f.grant)))
    ok = record is None or record.ok
    if record is not None:
        effects.append(Recorded(f.incoming, record))
    if grant and ok:  # before the drops below, which dispatch (seed 252)
        effects.append(Grant(f.incoming, f.restore, record.seconds if record else 0.0))
    effects += [Dropped(j) for j in vanished]  # a one-box job killed with its client: nothing of it anywhere
    if replaced:  # what it did was for an earlier incarnation: no failure of it counts against this one
        return record, effects
    if not f.grant and f.beside is None and (record is None or not record.ok):
        effects.append(IdleFailed(f.incoming))
    elif record is not None and record.failed_step == "restore" and not record.unreachable:
        effects.append(RestoreFailed(f.incoming, record, f.restore_failures + 1 >= MAX_RESTORE_FAILURES
                                     and f.failing_seconds >= RESTORE_FAILURE_SECONDS))
    return record, effects


def _fail(f: OutcomeFacts, why: str) -> list[Effect]:
    """The incoming job's waiters fail with `why`; none of a later incarnation's."""
    return [] if f.replaced else [FailWaiters(f.incoming, f"group {f.group_id}: {why}")]
