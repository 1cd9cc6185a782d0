"""The typed state and views of a lock group (`LockGroup` owns them; `SwitchCoordinator`
makes `SwitchRecord`s; status, claim status, Events and metrics read the views)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from timeslice.controller.orchestrator.config import GroupSpec
from timeslice.controller.orchestrator.lock_queue import Waiter
from timeslice.controller.orchestrator.memory_snapshot import MemorySnapshot
from timeslice.controller.orchestrator.residency import Residency
from timeslice.driver.errors import SwitchFailed

ADOPTED = "*adopted*"  # lease id of a presumptive holder after a leader change


@dataclass
class SwitchRecord:
    """One switch, as shown in status. Seconds and bytes summed over the group's nodes.
    `evicted`: every job checkpointed to make room (`from_job` is the first of them)."""

    from_job: str | None
    to_job: str
    ok: bool = True
    error: str = ""
    checkpoint_seconds: float = 0.0
    restore_seconds: float = 0.0
    bytes_checkpointed: int = 0
    bytes_restored: int = 0
    finished_at_unix: float = 0.0
    evicted: tuple[str, ...] = ()
    gone: tuple[str, ...] = ()  # of `evicted`: no live process on any of their nodes (nothing was moved)
    unreachable: bool = False  # failed only because agents did not answer: not the job's fault
    # the step that ran and failed: "checkpoint" (of an evicted job) or "restore" (of `to_job`);
    # "" when none did (a plan without room, a restore that could not start yet)
    failed_step: str = ""
    checkpointed_by_job: dict[str, int] = field(default_factory=dict)  # of `evicted`: bytes moved off, by job

    @property
    def seconds(self) -> float:
        return self.checkpoint_seconds + self.restore_seconds


class SwitchError(SwitchFailed):
    """Raised by a `Switcher`: the switch failed; `off_gpu` names the evicted jobs whose
    state the rollback could not put back on the GPUs (normally none)."""

    def __init__(self, message: str, record: SwitchRecord, off_gpu: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.record = record
        self.off_gpu = frozenset(off_gpu)


class Switcher(Protocol):
    """Moves GPU state for a group (`SwitchCoordinator`). `__call__(spec, evict, incoming,
    restore)`: checkpoint every job of `evict`, then restore `incoming` when `restore`;
    raises SwitchError. A plan that needs the restore first (`Plan.restore_first`) passes
    `restore_first=True`; only a switcher that reports memory is given one. A switcher
    that can also report memory has `memory(spec, jobs) -> MemorySnapshot | None`; without
    it the group keeps one resident job. One that can tell residents whose memory is about
    to be freed has `departing(spec, jobs) -> list[str]`: a plan without room waits for
    them (bounded by their grace) instead of failing. One that can ask the node agents has
    `confirm(spec, job) -> bool`: whether the job's state is on the GPUs by their records,
    asked before a job believed resident is granted. One that knows cooperative processes
    has `streaming(spec, job) -> bool`: whether one of the job's keeps its memory command
    stream open (a holder past its lease then keeps the lock), and `unconfirmed(spec, job)
    -> bool`: whether one that the state file records checkpointed has not said since a
    restart where its state is (the job counts as resident, and is granted only through a
    restore), and `pin_ahead(spec)`: a grant may move memory from now on (its processes
    prepare their host memory ahead of need)."""

    async def __call__(self, spec: GroupSpec, evict: Sequence[str], incoming: str,
                       restore: bool) -> SwitchRecord: ...


@dataclass(frozen=True)
class GroupEvent:
    """What happened in a group, for observers (claim status, Events, metrics): `kind` is
    "granted", "released", "switched", "switch-failed", "lease-expired", "preempted" or
    "job-failed" (its restore failed `MAX_RESTORE_FAILURES` times in a row).
    `waited_seconds` (a grant): the longest wait among the granted job's waiters, seconds."""

    kind: str
    group_id: str
    job_id: str
    epoch: int = 0
    record: SwitchRecord | None = None
    waited_seconds: float = 0.0


@dataclass(frozen=True)
class GrantInfo:
    lease_id: str
    epoch: int
    lease_seconds: float
    waited_seconds: float
    restored: bool
    switch_seconds: float


@dataclass
class Hold:
    job_id: str
    lease_id: str
    epoch: int
    granted_at: float
    lease_deadline: float
    request_ids: set[str]
    restored: bool
    switch_seconds: float
    priority: int = 0
    past_epochs: frozenset[int] = frozenset()  # earlier grants of this lease (preempted, restored)
    # an adopted hold's callers are not known here (granted by an earlier leader): no caller
    # leaving ends it, only its release or its lease
    callers_unknown: bool = False
    # cooperative: every command stream of the job closed during the hold (`streams_closed`), and
    # then a new process of the job connected (`processes_ended`): the hold is its ended processes';
    # a new Acquire of the job ends it rather than join it
    streams_closed: bool = False
    processes_ended: bool = False
    # request id -> clock() seconds its caller last kept its part alive (a KeepAlive naming it):
    # `Callers.prune_parts`
    kept_alive: dict[str, float] = field(default_factory=dict)
    live_at: float | None = None  # clock() seconds its node agents last reported a process of it live
    kept: str = ""  # why it keeps the lock past its lease (overdue: `decisions.KeepOverdue.why`); "" while current
    ended: bool = False  # `LockGroup.end_hold` ran (a hold carried to another group goes on there)


@dataclass
class Counters:
    """Totals since the group was created. `held_seconds`: seconds of ended holds (the
    current hold is `GroupView.held_seconds`)."""

    grants: int = 0
    switches: int = 0
    failed_switches: int = 0
    lease_expiries: int = 0
    preemptions: int = 0
    held_seconds: float = 0.0


@dataclass
class JobCounters:
    """One job's totals in its group, since the group last saw it arrive (a dropped job's
    go with it). `held_seconds`: seconds of its ended holds; `waited_seconds`: per grant,
    the longest wait among its callers, summed; `checkpoints`, `restores`: switches that
    moved it off or onto the GPUs, and the bytes they moved."""

    grants: int = 0
    held_seconds: float = 0.0
    waited_seconds: float = 0.0
    checkpoints: int = 0
    restores: int = 0
    bytes_checkpointed: int = 0
    bytes_restored: int = 0


def count_moves(job_counters: Mapping[str, JobCounters], record: SwitchRecord) -> None:
    """A switch that succeeded: what it moved, per job (`JobCounters`) of the jobs counted
    since their grant or hold (a dropped job moved off, or restored for nobody, is not)."""
    for job, n in record.checkpointed_by_job.items():
        if (jc := job_counters.get(job)) is not None and job not in record.gone:
            jc.checkpoints += 1
            jc.bytes_checkpointed += n
    if record.restore_seconds and (jc := job_counters.get(record.to_job)) is not None:
        jc.restores += 1
        jc.bytes_restored += record.bytes_restored


@dataclass
class WaiterView:
    job_id: str
    priority: int
    waiting_seconds: float
    position: int


@dataclass
class GroupView:
    """A snapshot of a group for status output; times in seconds."""

    group_id: str
    backend: str
    phase: str
    epoch: int
    holder: Hold | None
    held_seconds: float
    lease_remaining_seconds: float
    waiters: list[WaiterView]
    resident_job: str | None
    checkpointed_jobs: list[str]
    counters: Counters
    recent_switches: list[SwitchRecord]
    agents: list[str]
    residency: str = "exclusive"
    resident_jobs: list[str] = field(default_factory=list)  # least recently held first
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)  # job -> device -> bytes
    memory: MemorySnapshot | None = None
    warnings: list[str] = field(default_factory=list)
    declared: dict[str, int] = field(default_factory=dict)  # job -> bytes per GPU it declared
    # job -> device -> its reservation (jobs that declared or settled; the others run alone)
    reserved: dict[str, dict[str, int]] = field(default_factory=dict)
    settled: list[str] = field(default_factory=list)  # jobs whose memory stopped growing
    jobs: dict[str, JobCounters] = field(default_factory=dict)  # job -> its totals (ended holds)




def group_view(spec: GroupSpec, *, now: float, phase: str, epoch: int, holder: Hold | None,
               queue: Iterable[Waiter], residency: Residency, memory_aware: bool, counters: Counters,
               recent: Iterable[SwitchRecord], warnings: Sequence[str],
               job_counters: Mapping[str, JobCounters]) -> GroupView:
    """A group's state at clock() time `now`, for status output (copies: the view does not
    change with the group)."""
    h, r = holder, residency
    return GroupView(
        group_id=spec.id, backend=spec.backend, phase=phase, epoch=epoch,
        holder=h, held_seconds=now - h.granted_at if h else 0.0,
        lease_remaining_seconds=max(0.0, h.lease_deadline - now) if h else 0.0,
        waiters=[WaiterView(w.job_id, w.priority, now - w.enqueued_at, i) for i, w in enumerate(queue)],
        resident_job=r.most_recent, checkpointed_jobs=sorted(r.checkpointed),
        counters=Counters(**vars(counters)), recent_switches=list(recent),
        agents=list(spec.agents),
        residency=spec.residency if memory_aware else "exclusive",
        resident_jobs=list(r.residents),
        peaks={j: dict(p) for j, p in r.peaks.items()}, memory=r.snapshot,
        warnings=list(warnings), declared=dict(r.declared),
        reserved={j: r.need(j) for j in r.known_jobs() if r.known(j)},
        settled=sorted(r.settled), jobs={j: replace(c) for j, c in job_counters.items()})
