"""What an Acquire does, given what its lock group knows now (`admit`).

Pure: it reads one immutable `AcquireFacts` record and returns one `Admission`, touching
nothing; `LockGroup.acquire` (group.py) gathers the facts and performs the answer, asking again
after the two steps that change them (a wait for ended processes' memory, a hold ended). The
rules, as in DESIGN.md ("Lock groups and the orchestrator"):

- A job that failed for good is refused (`Refuse`) until it is dropped (a restart drops it):
  also a caller of its hold, should it hold.
- A caller of the job that holds joins its hold (`JoinHold`: a job's processes share its hold).
  On a memory-aware group it first waits, once, for the memory of the job's ended processes
  to be freed (`WaitForExits`: a process that joins may be the next one of a job whose holder
  was killed; exits.py); a claim set that moved to another group meanwhile is refused
  (`Moved`, retryable). A hold whose processes have all ended is not joined: it ends and the
  caller waits its turn, planned on a fresh memory report (`EndHold`; cooperative schedules
  seed 30009: a new process joined at once and ran out of memory beside the ended one's bytes).
- A caller whose request is queued already is one more caller of that entry (`AddCaller`).
- Otherwise it queues (`Queue`) at its claim set's configured priority in a cluster (a pod
  cannot jump the queue), else at the priority it asks.

The invariants `tests/test_acquire_calls.py` checks over random facts: a caller joins only the
hold of its own job, never a hold whose processes ended, and on a memory-aware group only after
waiting for exits; a failed job is never queued or joined; a member queues at its configured
priority, whatever it asks; a request is never queued twice; each answer moves towards one that
ends the call (a join, a refusal or a place in the queue).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AcquireFacts:
    """`job` asks at `priority`; `configured`: its claim set's priority in a cluster (None: not a
    member, or static groups); `holder`: the job that holds (None: nobody); `processes_ended`:
    every process of that hold has ended; `memory_aware`: the group plans memory; `exits_waited`:
    this call waited for the job's ended processes already; `moved`: the group has members and
    the job is no longer one of them; `failed`: why the job failed for good (None: it did not);
    `queued`: the call's request has an entry in the queue."""

    job: str
    priority: int
    configured: int | None = None
    holder: str | None = None
    processes_ended: bool = False
    memory_aware: bool = False
    exits_waited: bool = False
    moved: bool = False
    failed: str | None = None
    queued: bool = False


@dataclass(frozen=True)
class WaitForExits:
    """Wait for the memory of the job's ended processes to be freed, then ask again."""


@dataclass(frozen=True)
class Moved:
    """Refuse the call as Unavailable: the job's claim set is now another group's."""


@dataclass(frozen=True)
class EndHold:
    """End the job's hold (its processes ended), then ask again."""


@dataclass(frozen=True)
class JoinHold:
    """The caller joins the job's hold: it is granted at once."""


@dataclass(frozen=True)
class Refuse:
    """Refuse the call as JobFailed: `why` the job failed."""

    why: str


@dataclass(frozen=True)
class AddCaller:
    """One more caller of the request's entry in the queue."""


@dataclass(frozen=True)
class Queue:
    """A new entry in the queue at `priority`."""

    priority: int


Admission = WaitForExits | Moved | EndHold | JoinHold | Refuse | AddCaller | Queue


def admit(f: AcquireFacts) -> Admission:
    """What the Acquire of `f.job` does now (the rules: this module's docstring)."""
    if f.failed is not None:
        return Refuse(f.failed)
    if f.exits_waited and f.moved:
        return Moved()
    if f.holder == f.job:
        if f.memory_aware and not f.exits_waited:
            return WaitForExits()
        return EndHold() if f.processes_ended else JoinHold()
    if f.queued:
        return AddCaller()
    return Queue(f.configured if f.configured is not None else f.priority)
