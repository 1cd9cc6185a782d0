"""The decision core of a lock group: given what the group knows now, what it does next
(`decide`, at a dispatch) and what a lapsing lease does (`lease_timer`).

Pure: `decide(facts)` reads one immutable `DispatchFacts` record and returns one `Decision`,
touching nothing; `MemoryMoves.dispatch` (moves.py) gathers the facts from the group and runs
the decision (a grant, a switch, a staging, a read of records, ...). The rules, as in
DESIGN.md ("Lock groups and the orchestrator"):

- While a job holds, the job its release would grant (`next_job`) is *staged* when it is
  checkpointed: room is made for it beside the holder and it is restored without a grant
  (`Stage`). Never beside a job whose need is not known (declared or settled), never for a job
  that failed, that must leave, or that found no room already in this hold.
- While a staging runs and nobody holds, the job it makes room beside holds again at once when
  it waits at the head's priority or above (`GrantBeside`).
- The lock free: nothing is granted on a guess. Checkpoint records a takeover could not read
  are read first (`ReadRecords`), and jobs a rollback could not put back are settled with
  their node agents (`SettleUnsure`). An `app` engine left awake by a hold that ended without
  its release keeps its GPUs until its client released (`WaitForRelease`), unless a waiter of
  that very job is queued (nothing moves for it). A resident job with room is granted where
  it is (`GrantOnGpu`, which its node agents confirm); any other grant is a `Switch` (a plan
  picks what leaves when `evict` is None), restoring the job when its state is off the GPUs.
- Which job is granted: the head waiter's, unless its grant would move memory and a waiter of
  its priority is resident with room: that one goes first while `pass_remaining` lasts (one
  switch per run of phases, not per phase; measured on the H200: 3 jobs of 50.8 GB, 32 switches
  in strict order, 14 with this; bench/results/rl-grpo-b-h200.json).

The invariants `tests/test_decisions.py` checks over random facts: no job other than the holder
is granted while one holds; a job whose state is off the GPUs (or not confirmed on them) is
never granted where it is; nothing is granted or moved while records are unread or a rollback
is unsettled; jobs that must leave are never granted where they are; a staging happens only
while a job holds, for a checkpointed job with a known need beside a holder with a known need.
"""

from __future__ import annotations

from dataclasses import dataclass

from timeslice.driver import names


@dataclass(frozen=True)
class Waiting:
    """A queued waiter (`LockQueue` order: priority, then arrival)."""

    job: str
    priority: int


@dataclass(frozen=True)
class DispatchFacts:
    """What a group's dispatch decides on, gathered at once (`MemoryMoves.facts`).

    `residents`: jobs with state on the GPUs, least recently held first; `checkpointed`: jobs
    whose state is off them; `unconfirmed`: jobs whose processes have not said since a restart
    where their state is; `known`: jobs whose need is known (declared or settled); `roomy`: the
    queued residents that the last memory report leaves room to grow (`memory_plan.roomy`);
    `leaving`: resident jobs that must leave before anyone is granted (preempted, fenced, lapsed
    or unreleased holders), in that order; `unreleased`: `app` jobs left awake on the GPUs by a
    hold that ended without its release, sorted; `failed`: jobs failed for good; `unstaged`:
    (holder's epoch, job) a staging found no room for; `beside`: the job a staging in flight
    makes room beside; `records_unknown` / `unsure`: checkpoint records to read / jobs to settle
    before any grant; `pass_remaining`: seconds resident waiters may still pass the head
    waiter; `head_moves_nothing`: the head's grant moves no memory by the last report (left False
    where it cannot decide: nothing may pass the head, or it is resident with room)."""

    backend: str
    memory_aware: bool
    holder: str | None = None
    holder_epoch: int = 0
    switching: bool = False
    beside: str | None = None
    queue: tuple[Waiting, ...] = ()
    residents: tuple[str, ...] = ()
    checkpointed: frozenset[str] = frozenset()
    unconfirmed: frozenset[str] = frozenset()
    known: frozenset[str] = frozenset()
    roomy: frozenset[str] = frozenset()
    leaving: tuple[str, ...] = ()
    unreleased: tuple[str, ...] = ()
    failed: frozenset[str] = frozenset()
    unstaged: tuple[int, str] | None = None
    records_unknown: bool = False
    unsure: bool = False
    pass_remaining: float = 0.0
    head_moves_nothing: bool = False

    def must_leave(self, incoming: str = "") -> list[str]:
        """`leaving`, but `incoming`."""
        return [j for j in self.leaving if j != incoming]


@dataclass(frozen=True)
class Nothing:
    """Nothing to do now (no waiter, or a staging that is not due)."""


@dataclass(frozen=True)
class ReadRecords:
    """Read the checkpoint records a takeover could not read, then dispatch again."""


@dataclass(frozen=True)
class SettleUnsure:
    """Settle the jobs a rollback could not put back with their node agents, then dispatch again."""


@dataclass(frozen=True)
class WaitForRelease:
    """`jobs`' engines stay awake until their clients release: watch for it, grant nobody."""

    jobs: tuple[str, ...]


@dataclass(frozen=True)
class GrantOnGpu:
    """Grant `job`, whose state is on the GPUs, once its node agents confirm it."""

    job: str


@dataclass(frozen=True)
class Switch:
    """Checkpoint `evict` (None: as a fresh plan says) and restore `job` when `restore`, then
    grant it. `may_defer`: the grant moves memory for the head waiter; the runner may hold it
    back while the residents are between their phases (`deferral.Deferral.defer`)."""

    evict: tuple[str, ...] | None
    job: str
    restore: bool
    may_defer: bool = False


@dataclass(frozen=True)
class Stage:
    """Make room for checkpointed `job` beside the holder `beside` and restore it, without a grant."""

    job: str
    beside: str


@dataclass(frozen=True)
class GrantBeside:
    """Grant `job`, which a staging in flight keeps room for, at once."""

    job: str


Decision = Nothing | ReadRecords | SettleUnsure | WaitForRelease | GrantOnGpu | Switch | Stage | GrantBeside


def decide(f: DispatchFacts) -> Decision:
    """What the group does now. Pure: reads `f` only."""
    if f.holder is not None:
        return _stage(f)
    if f.switching:
        return _grant_beside(f)
    if not f.queue:
        return Nothing()
    return _grant_or_switch(f)


def next_job(f: DispatchFacts) -> str:
    """The job to grant next (the queue is not empty): the head waiter's, unless its grant
    would move memory (it is not resident with room, and `head_moves_nothing` is False) and
    a waiter of its priority is resident with room: that one goes first, while resident
    waiters may pass the head (`pass_remaining`)."""
    head = f.queue[0]
    if not f.memory_aware or f.must_leave() or f.pass_remaining <= 0:
        return head.job  # (a preempted or dropped holder leaves first anyway)
    if (head.job in f.residents and head.job in f.roomy) or f.head_moves_nothing:
        return head.job
    for w in f.queue:
        if w.priority == head.priority and w.job in f.residents and w.job in f.roomy:
            return w.job
    return head.job


def _stage(f: DispatchFacts) -> Decision:
    if not f.queue or f.switching or not f.memory_aware:
        return Nothing()
    incoming = next_job(f)
    if incoming == f.holder or incoming not in f.checkpointed or f.must_leave(incoming) \
            or f.unstaged == (f.holder_epoch, incoming) or incoming in f.failed \
            or not (incoming in f.known and f.holder in f.known):
        return Nothing()  # an unsettled job runs alone: nothing is staged beside it, nor it beside others
    return Stage(incoming, f.holder)  # type: ignore[arg-type]  # (holder is set: `decide`)


def _grant_beside(f: DispatchFacts) -> Decision:
    job = f.beside
    if job is None or not f.queue or f.must_leave(job) or job not in f.residents:
        return Nothing()
    w = next((w for w in f.queue if w.job == job), None)
    return GrantBeside(job) if w is not None and w.priority >= f.queue[0].priority else Nothing()


def _grant_or_switch(f: DispatchFacts) -> Decision:
    if f.records_unknown:
        return ReadRecords()
    if f.unsure:
        return SettleUnsure()
    head = f.queue[0]
    incoming = next_job(f)
    awake = [j for j in f.unreleased if j != incoming]
    if awake:
        own = next((w.job for w in f.queue if w.job in awake), None)
        if own is None or any(j != own for j in f.unreleased):
            return WaitForRelease(tuple(awake))
        incoming = own
    restore = incoming in f.checkpointed or incoming in f.unconfirmed
    if f.backend == names.BACKEND_NONE or (f.memory_aware and incoming in f.residents and not restore
                                            and not f.must_leave(incoming) and incoming in f.roomy):
        return GrantOnGpu(incoming)
    evict = None if f.memory_aware else tuple(j for j in f.residents if j != incoming)
    if evict is not None and not evict and not restore:
        return GrantOnGpu(incoming)
    return Switch(evict, incoming, restore, may_defer=f.memory_aware and incoming == head.job)


@dataclass(frozen=True)
class LeaseFacts:
    """What a holder's lease timer decides on when it fires (`Leases.on_timer`): whether the
    hold it was armed for still holds (`current`), clock() seconds `now` and the lease's
    `deadline`, whether a process of the holder keeps its memory command stream open
    (`streaming`: cooperative), whether its node agents reported a process of it live a
    moment ago (`live`: `GoneHolders`), whether the hold's callers are unknown (adopted after
    a restart), whether it is already kept past its deadline (`overdue`), and whether a
    checkpoint would leave its processes running (`unfenceable`: on a backend that locks CUDA
    contexts, its last memory report showed it holding no GPU memory, so no context to lock)."""

    backend: str
    current: bool
    now: float
    deadline: float
    streaming: bool = False
    callers_unknown: bool = False
    overdue: bool = False
    live: bool = False
    unfenceable: bool = False


@dataclass(frozen=True)
class Rearm:
    """The lease was extended since the timer was armed: time it again."""


@dataclass(frozen=True)
class KeepOverdue:
    """A holder past its deadline that is computing (its keep-alives are late) keeps the lock:
    a cooperative one whose processes keep their streams open, or one that nothing could stop
    (`names.UNRELEASED_KEPT_BACKENDS`, or `unfenceable`) whose processes its agents report
    live; `first`: newly overdue; `why` and `until`: for the log line."""

    first: bool
    why: str = ""
    until: str = "they end, are no longer reported live,"


@dataclass(frozen=True)
class Lapse:
    """The hold ends. `requeue`: on a backend that stops processes, its lease is remembered so
    that a late keep-alive queues it again and a late release is accepted."""

    requeue: bool


LeaseDecision = Nothing | Rearm | KeepOverdue | Lapse


def lease_timer(f: LeaseFacts) -> LeaseDecision:
    """What a fired lease timer does (leases.py's rules). Pure: reads `f` only."""
    if not f.current:
        return Nothing()
    if f.now < f.deadline:  # extended by keep-alives since armed
        return Rearm()
    if f.streaming and not f.callers_unknown:  # (an adopted hold: the job may be idle)
        return KeepOverdue(not f.overdue, "its processes keep their memory command streams open (computing)",
                           "they close")
    if f.live and (f.backend in names.UNRELEASED_KEPT_BACKENDS or f.unfenceable) and not f.callers_unknown:
        # its keep-alives are late, its processes run: it may compute, and nothing could stop it
        # (`cuda`: a holder stopped or starved before its first CUDA call, once continued, would
        # make that call beside the next holder: a helper's attack on `timeslice serve`)
        return KeepOverdue(not f.overdue, "its processes live with no CUDA context to lock (stopped or starved "
                           "before their first CUDA call)" if f.unfenceable else "its processes live (computing, or "
                           "stopped by someone: its memory cannot move under them)")
    return Lapse(requeue=f.backend in names.STOPPING_BACKENDS)
